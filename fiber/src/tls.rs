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
//!   that loads the word's offset from the thread pointer (constant for the
//!   process: the initial-exec model, `@GOTTPOFF`) and reads or writes
//!   `fs:[offset]`. The thread pointer is read afresh by the instruction
//!   itself, and the compiler may neither merge nor move an `asm!` block
//!   that is not marked `pure`: nothing can be cached across a switch. The
//!   accesses inline into the caller, which costs one load and no call.
//!   Initial-exec TLS works in executables and in shared libraries loaded at
//!   startup; a library `dlopen`ed later takes its 16 bytes from the static
//!   TLS surplus that glibc and musl reserve for this.
//! * **Elsewhere** (and under loom): `thread_local!`, each access in a small
//!   `#[inline(never)]` function that does not suspend, so the address is
//!   computed on each call by the thread that makes it.
//!
//! Either way the words are plain: no destructor, readable from a signal
//! handler (the overflow report reads the current fiber).

use crate::header::Header;

pub(crate) use imp::{current, set_current, set_thread_id, thread_id_word};

#[cfg(all(target_arch = "x86_64", target_os = "linux", not(loom), not(miri)))]
mod imp {
    use crate::header::Header;

    /// A symbol name private to this version of the crate, so that two
    /// versions linked into one program keep separate words.
    macro_rules! tls_symbol {
        ($word:literal) => {
            concat!(
                "spindle_fiber_",
                env!("CARGO_PKG_VERSION_MAJOR"),
                "_",
                env!("CARGO_PKG_VERSION_MINOR"),
                "_",
                env!("CARGO_PKG_VERSION_PATCH"),
                "_",
                $word
            )
        };
    }

    // Two zero-initialised words in the thread-local BSS. Hidden: each
    // executable or shared object that links the crate has its own, as with
    // `thread_local!`.
    std::arch::global_asm!(
        ".pushsection .tbss,\"awT\",@nobits",
        ".p2align 3",
        concat!(".globl ", tls_symbol!("current")),
        concat!(".hidden ", tls_symbol!("current")),
        concat!(tls_symbol!("current"), ":"),
        ".zero 8",
        concat!(".globl ", tls_symbol!("thread_id")),
        concat!(".hidden ", tls_symbol!("thread_id")),
        concat!(tls_symbol!("thread_id"), ":"),
        ".zero 8",
        ".popsection",
    );

    /// The fiber running on this thread, or null.
    #[inline(always)]
    pub(crate) fn current() -> *const Header {
        let h: *const Header;
        // SAFETY: reads this thread's word (TLS offset from the GOT, then a
        // load relative to the thread pointer). Not `pure`: never merged
        // with another read or moved across a stack switch.
        unsafe {
            std::arch::asm!(
                concat!("mov {off}, qword ptr [rip + ", tls_symbol!("current"), "@GOTTPOFF]"),
                "mov {h}, qword ptr fs:[{off}]",
                off = out(reg) _,
                h = out(reg) h,
                options(nostack, readonly, preserves_flags),
            );
        }
        h
    }

    /// Makes `h` the fiber running on this thread (null: none).
    #[inline(always)]
    pub(crate) fn set_current(h: *const Header) {
        // SAFETY: writes this thread's word; see `current`.
        unsafe {
            std::arch::asm!(
                concat!("mov {off}, qword ptr [rip + ", tls_symbol!("current"), "@GOTTPOFF]"),
                "mov qword ptr fs:[{off}], {h}",
                off = out(reg) _,
                h = in(reg) h,
                options(nostack, preserves_flags),
            );
        }
    }

    /// This thread's id word: 0 until `set_thread_id`.
    #[inline(always)]
    pub(crate) fn thread_id_word() -> u64 {
        let id: u64;
        // SAFETY: as in `current`.
        unsafe {
            std::arch::asm!(
                concat!("mov {off}, qword ptr [rip + ", tls_symbol!("thread_id"), "@GOTTPOFF]"),
                "mov {id}, qword ptr fs:[{off}]",
                off = out(reg) _,
                id = out(reg) id,
                options(nostack, readonly, preserves_flags),
            );
        }
        id
    }

    /// Sets this thread's id word.
    pub(crate) fn set_thread_id(id: u64) {
        // SAFETY: as in `set_current`.
        unsafe {
            std::arch::asm!(
                concat!("mov {off}, qword ptr [rip + ", tls_symbol!("thread_id"), "@GOTTPOFF]"),
                "mov qword ptr fs:[{off}], {id}",
                off = out(reg) _,
                id = in(reg) id,
                options(nostack, preserves_flags),
            );
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(loom), not(miri))))]
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
