//! The crate's two thread-local words (the current fiber, this thread's
//! id), with accesses that stay right when a fiber moves between threads.
//!
//! # The hazard
//!
//! LLVM treats the address of a thread-local as constant within a function
//! (llvm/llvm-project#98479). A function that reads a thread-local, calls
//! something that switches stacks, resumes on another thread and reads the
//! thread-local again may reuse the first thread's address. Every function
//! that suspends a fiber, and every function a suspending fiber inlines,
//! is such a function.
//!
//! # Two implementations
//!
//! * **x86-64 Linux** (the fast one): the words live in the ELF TLS block,
//!   declared in `global_asm!`, and every access is one inline `asm!` block
//!   that finds the word's offset from the thread pointer with a TLS
//!   descriptor (`@TLSDESC`/`@TLSCALL`) and reads or writes `fs:[offset]`.
//!   The thread pointer is read by that instruction on whatever thread runs
//!   it, and the compiler may neither merge nor move an `asm!` block that is
//!   not marked `pure`: nothing can be cached across a switch.
//!   - In an executable the linker turns the descriptor call into a
//!     constant (`mov rax, offset`), so an access is two instructions and
//!     no call, inlined into the caller.
//!   - In a shared object the descriptor call stays: the C library's
//!     resolver returns the offset (a short call for objects loaded at
//!     startup; for an object loaded later with `dlopen`, the dynamic TLS
//!     path, which works everywhere, unlike the initial-exec model).
//!   - The descriptor call clobbers only `rax` and the flags (the x86-64
//!     TLS descriptor ABI, which compilers rely on as well).
//!   - The symbols are named after a function of this crate
//!     (`__private::tls_anchor`), whose mangled name is unique to each
//!     build of the crate: two copies of the crate in one program never
//!     share or clash. It is public (hidden from the docs) so that its
//!     name is the same in every object file that inlines an access.
//! * **Elsewhere** (and under loom): `thread_local!`, each access in a small
//!   `#[inline(never)]` function that does not suspend, so the address is
//!   computed on each call by the thread that makes it.
//!
//! Either way the words are plain: no destructor, readable from a signal
//! handler (the overflow report reads the current fiber).

use crate::header::Header;

pub(crate) use imp::{current, set_current, set_thread_id, thread_id_word};

#[cfg(all(
    target_arch = "x86_64",
    target_pointer_width = "64",
    target_os = "linux",
    not(loom),
    not(miri)
))]
mod imp {
    use crate::header::Header;

    use crate::__private::tls_anchor as anchor;

    // Two zero-initialised words in the thread-local BSS. Global (inlined
    // accesses in other crates' object files refer to them) but hidden:
    // each executable or shared object that links the crate has its own,
    // as with `thread_local!`.
    std::arch::global_asm!(
        ".pushsection .tbss,\"awT\",@nobits",
        ".p2align 3",
        ".globl {a}.current",
        ".hidden {a}.current",
        ".type {a}.current,@object",
        ".size {a}.current,8",
        "{a}.current:",
        ".zero 8",
        ".globl {a}.thread_id",
        ".hidden {a}.thread_id",
        ".type {a}.thread_id,@object",
        ".size {a}.thread_id,8",
        "{a}.thread_id:",
        ".zero 8",
        ".popsection",
        a = sym anchor,
    );

    /// Reads one of the words: `$word` is `current` or `thread_id`.
    macro_rules! tls_read {
        ($word:literal) => {{
            let v: usize;
            // SAFETY: the descriptor call returns the word's offset from the
            // thread pointer in rax (clobbering nothing else but the flags),
            // and the load reads this thread's word. Not `pure`: never
            // merged with another access or moved across a stack switch.
            // Not `nostack`: the call pushes its return address.
            unsafe {
                std::arch::asm!(
                    concat!("lea rax, [rip + {a}.", $word, "@TLSDESC]"),
                    concat!("call qword ptr [rax + {a}.", $word, "@TLSCALL]"),
                    "mov {v}, qword ptr fs:[rax]",
                    a = sym anchor,
                    v = lateout(reg) v,
                    out("rax") _,
                );
            }
            v
        }};
    }

    /// Writes one of the words.
    macro_rules! tls_write {
        ($word:literal, $value:expr) => {{
            let v: usize = $value;
            // SAFETY: as in `tls_read`; writes this thread's word. `v` is an
            // input that the asm reads after the call, which leaves every
            // register but rax as it was (rax is declared clobbered, so `v`
            // is never allocated to it).
            unsafe {
                std::arch::asm!(
                    concat!("lea rax, [rip + {a}.", $word, "@TLSDESC]"),
                    concat!("call qword ptr [rax + {a}.", $word, "@TLSCALL]"),
                    "mov qword ptr fs:[rax], {v}",
                    a = sym anchor,
                    v = in(reg) v,
                    out("rax") _,
                );
            }
        }};
    }

    /// The fiber running on this thread, or null.
    #[inline(always)]
    pub(crate) fn current() -> *const Header {
        tls_read!("current") as *const Header
    }

    /// Makes `h` the fiber running on this thread (null: none).
    #[inline(always)]
    pub(crate) fn set_current(h: *const Header) {
        tls_write!("current", h as usize)
    }

    /// This thread's id word: 0 until `set_thread_id`.
    #[inline(always)]
    pub(crate) fn thread_id_word() -> u64 {
        tls_read!("thread_id") as u64
    }

    /// Sets this thread's id word.
    pub(crate) fn set_thread_id(id: u64) {
        tls_write!("thread_id", id as usize)
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_pointer_width = "64",
    target_os = "linux",
    not(loom),
    not(miri)
)))]
mod imp {
    use std::cell::Cell;
    use std::ptr;

    use crate::header::Header;

    thread_local! {
        static CURRENT: Cell<*const Header> = const { Cell::new(ptr::null()) };
        static THREAD_ID: Cell<u64> = const { Cell::new(0) };
    }

    /// The fiber running on this thread, or null.
    #[inline(never)]
    pub(crate) fn current() -> *const Header {
        CURRENT.with(Cell::get)
    }

    /// Makes `h` the fiber running on this thread (null: none).
    #[inline(never)]
    pub(crate) fn set_current(h: *const Header) {
        CURRENT.with(|c| c.set(h))
    }

    /// This thread's id word: 0 until `set_thread_id`.
    #[inline(never)]
    pub(crate) fn thread_id_word() -> u64 {
        THREAD_ID.with(Cell::get)
    }

    /// Sets this thread's id word.
    #[inline(never)]
    pub(crate) fn set_thread_id(id: u64) {
        THREAD_ID.with(|c| c.set(id))
    }
}

/// Replaces the current fiber, returning the one that was current.
#[inline(always)]
pub(crate) fn swap_current(h: *const Header) -> *const Header {
    let prev = current();
    set_current(h);
    prev
}
