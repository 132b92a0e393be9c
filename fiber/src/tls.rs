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

pub(crate) use imp::{current, enter, exit, set_thread_id, thread_id_word};

/// What [`enter`] found: the fiber that was current, and this thread's id
/// word (0 until [`set_thread_id`]).
#[derive(Clone, Copy)]
pub(crate) struct Entered {
    pub(crate) prev: *const Header,
    pub(crate) thread: u64,
}

#[cfg(all(
    target_arch = "x86_64",
    target_pointer_width = "64",
    target_os = "linux",
    not(loom),
    not(miri)
))]
mod imp {
    use super::Entered;
    use crate::header::Header;

    use crate::__private::tls_anchor as anchor;

    // The two words, zero-initialised, in the thread-local BSS: the current
    // fiber at offset 0, the thread id at offset 8. Global (inlined
    // accesses in other crates' object files refer to them) but hidden:
    // each executable or shared object that links the crate has its own,
    // as with `thread_local!`.
    std::arch::global_asm!(
        ".pushsection .tbss,\"awT\",@nobits",
        ".p2align 4",
        ".globl {a}.words",
        ".hidden {a}.words",
        ".type {a}.words,@object",
        ".size {a}.words,16",
        "{a}.words:",
        ".zero 16",
        ".popsection",
        a = sym anchor,
    );

    // Every block below starts with the descriptor call, which returns the
    // words' offset from the thread pointer in rax and clobbers nothing
    // else but the flags; the loads and stores then address this thread's
    // words through `fs`. None is `pure`: the compiler never merges one
    // with another access or moves it across a stack switch. None is
    // `nostack`: the call pushes its return address.

    /// The fiber running on this thread, or null.
    #[inline(always)]
    pub(crate) fn current() -> *const Header {
        let h: *const Header;
        // SAFETY: reads this thread's current-fiber word (see above).
        unsafe {
            std::arch::asm!(
                "lea rax, [rip + {a}.words@TLSDESC]",
                "call qword ptr [rax + {a}.words@TLSCALL]",
                "mov {h}, qword ptr fs:[rax]",
                a = sym anchor,
                h = lateout(reg) h,
                out("rax") _,
            );
        }
        h
    }

    /// Makes `h` the current fiber; returns what [`exit`] needs to put the
    /// previous one back, and this thread's id word.
    #[inline(always)]
    pub(crate) fn enter(h: *const Header) -> Entered {
        let (prev, thread): (*const Header, u64);
        // SAFETY: reads and writes this thread's words (see above). `h` is
        // an input read after the call, which preserves every register but
        // rax; rax is an output, so `h` is never allocated to it. `prev` is
        // written before `h` is read, so it is an early `out` (never the
        // register of `h`); `thread` is written last and may share one.
        unsafe {
            std::arch::asm!(
                "lea rax, [rip + {a}.words@TLSDESC]",
                "call qword ptr [rax + {a}.words@TLSCALL]",
                "mov {prev}, qword ptr fs:[rax]",
                "mov qword ptr fs:[rax], {h}",
                "mov {thread}, qword ptr fs:[rax + 8]",
                a = sym anchor,
                h = in(reg) h,
                prev = out(reg) prev,
                thread = lateout(reg) thread,
                out("rax") _,
            );
        }
        Entered { prev, thread }
    }

    /// Puts back the fiber that was current before `e`'s [`enter`].
    ///
    /// # Safety
    /// Called on the thread that made that `enter`: elsewhere it would give
    /// that thread a current fiber its runner does not keep alive.
    #[inline(always)]
    pub(crate) unsafe fn exit(e: Entered) {
        // SAFETY: writes this thread's current-fiber word (see above).
        unsafe {
            std::arch::asm!(
                "lea rax, [rip + {a}.words@TLSDESC]",
                "call qword ptr [rax + {a}.words@TLSCALL]",
                "mov qword ptr fs:[rax], {prev}",
                a = sym anchor,
                prev = in(reg) e.prev,
                out("rax") _,
            );
        }
    }

    /// This thread's id word: 0 until [`set_thread_id`].
    #[inline(always)]
    pub(crate) fn thread_id_word() -> u64 {
        let id: u64;
        // SAFETY: reads this thread's id word (see above).
        unsafe {
            std::arch::asm!(
                "lea rax, [rip + {a}.words@TLSDESC]",
                "call qword ptr [rax + {a}.words@TLSCALL]",
                "mov {id}, qword ptr fs:[rax + 8]",
                a = sym anchor,
                id = lateout(reg) id,
                out("rax") _,
            );
        }
        id
    }

    /// Sets this thread's id word.
    pub(crate) fn set_thread_id(id: u64) {
        // SAFETY: writes this thread's id word (see above).
        unsafe {
            std::arch::asm!(
                "lea rax, [rip + {a}.words@TLSDESC]",
                "call qword ptr [rax + {a}.words@TLSCALL]",
                "mov qword ptr fs:[rax + 8], {id}",
                a = sym anchor,
                id = in(reg) id,
                out("rax") _,
            );
        }
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

    use super::Entered;
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

    /// Makes `h` the current fiber; returns what [`exit`] needs to put the
    /// previous one back, and this thread's id word.
    #[inline(never)]
    pub(crate) fn enter(h: *const Header) -> Entered {
        Entered {
            prev: CURRENT.with(|c| c.replace(h)),
            thread: THREAD_ID.with(Cell::get),
        }
    }

    /// Puts back the fiber that was current before `e`'s [`enter`].
    ///
    /// # Safety
    /// Called on the thread that made that `enter` (see the fast
    /// implementation).
    #[inline(never)]
    pub(crate) unsafe fn exit(e: Entered) {
        CURRENT.with(|c| c.set(e.prev))
    }

    /// This thread's id word: 0 until [`set_thread_id`].
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `enter` must store the new fiber, not the previous one it read
    /// first (an output sharing the input's register would do that), and
    /// `exit` must put the previous one back, on each thread separately.
    #[test]
    fn enter_and_exit_swap_this_threads_current_word() {
        let check = |a: usize, b: usize| {
            let (a, b) = (a as *const Header, b as *const Header);
            assert!(current().is_null());
            let outer = enter(a);
            assert!(outer.prev.is_null());
            assert_eq!(current(), a);
            let inner = enter(b);
            assert_eq!(inner.prev, a);
            assert_eq!(inner.thread, outer.thread);
            assert_eq!(current(), b);
            // SAFETY: same thread as the `enter`s; the words are restored
            // before anything reads them as headers.
            unsafe { exit(inner) };
            assert_eq!(current(), a);
            unsafe { exit(outer) };
            assert!(current().is_null());
        };
        check(0x1000, 0x2000);
        std::thread::spawn(move || check(0x3000, 0x4000)).join().unwrap();
        check(0x5000, 0x6000);
    }

    #[test]
    fn the_thread_id_word_is_per_thread() {
        set_thread_id(41);
        assert_eq!(thread_id_word(), 41);
        assert_eq!(enter(std::ptr::null()).thread, 41);
        std::thread::spawn(|| assert_eq!(thread_id_word(), 0))
            .join()
            .unwrap();
        assert_eq!(thread_id_word(), 41);
    }
}
