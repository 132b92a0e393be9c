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
//!   declared in `global_asm!` as one 16-byte symbol, and every access is
//!   one inline `asm!` block that finds the block's offset from the thread
//!   pointer with a TLS descriptor (`@TLSDESC`/`@TLSCALL`) and reads or
//!   writes `fs:[offset]` (or `fs:[offset + 8]`). The thread pointer is
//!   read by that instruction on whatever thread runs it, and the compiler
//!   may neither merge nor move an `asm!` block that is not marked `pure`:
//!   nothing can be cached across a switch.
//!   - In an executable the linker relaxes the sequence: the `lea` becomes
//!     `mov rax, offset` and the call a two-byte nop, so an access is two
//!     instructions and a nop, inlined into the caller.
//!   - In a shared object the descriptor call stays: the C library's
//!     resolver returns the offset (a short call for objects loaded at
//!     startup; for an object loaded later with `dlopen`, the dynamic TLS
//!     path, which works there too, unlike the initial-exec model).
//!   - The descriptor ABI says the call clobbers only `rax` and the flags,
//!     but glibc before 2.40 breaks that for vector registers on the
//!     dynamic path (bug 31372), so the blocks declare the C ABI's clobbers.
//!   - On that dynamic path, a thread's first access may allocate (as
//!     `__tls_get_addr` does for `thread_local!`): the overflow handler's
//!     read is async-signal-safe only once the thread has used the words,
//!     which every thread that runs a fiber has.
//!   - The symbols are named after a function of this crate
//!     (`__private::tls_anchor`), whose mangled name is unique to each
//!     build of the crate: two copies of the crate in one program never
//!     share or clash. It is public (hidden from the docs) so that its
//!     name is the same in every object file that inlines an access.
//! * **Elsewhere** (and under loom or miri, or with `--cfg
//!   spindle_portable_tls`, which CI uses to test this path on x86-64):
//!   `thread_local!`, each access in a small
//!   `#[inline(never)]` function that does not suspend, so the address is
//!   computed on each call by the thread that makes it. Under loom they
//!   are loom's thread-locals, one pair per model thread.
//!
//! Either way the words are plain: no destructor, readable from a signal
//! handler (the overflow report reads the current fiber). Under loom they
//! are loom's, which only code inside a model may read: the overflow
//! handler and the panic hook leave them alone there.

pub(crate) use imp::{
    current, set_current, set_thread_id, swap_current, swap_current_read_thread_id, thread_id_word,
};

#[cfg(all(
    target_arch = "x86_64",
    target_pointer_width = "64",
    target_os = "linux",
    not(loom),
    not(miri),
    not(spindle_portable_tls)
))]
mod imp {
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
    // block's offset from the thread pointer in rax; the loads and stores
    // then address this thread's words through `fs`. None is `pure`: the
    // compiler never merges one with another access or moves it across a
    // stack switch. None is `nostack`: the call pushes its return address
    // (and the stack is aligned for a call). None preserves the flags.
    //
    // The descriptor ABI promises that the call clobbers nothing but rax
    // and the flags, and in an executable the call is gone (the linker
    // turns the sequence into `mov rax, offset` and a nop). But in a shared
    // object loaded with `dlopen`, glibc before 2.40 lets the first access
    // of each thread clobber vector registers (glibc bug 31372), so every
    // block also declares what a C call clobbers (`clobber_abi("C")`). The
    // runner and the fiber hold nothing in those registers at these points
    // (the stack switch next to them clobbers everything anyway), so this
    // costs nothing measurable.

    /// One access to this thread's words: the descriptor call, then the
    /// given instructions with the block's offset in rax, then the given
    /// operands. Every access goes through here, so the sequence, the
    /// anchor and the clobbers are written once.
    macro_rules! words_asm {
        ($($insn:literal),+; $($operands:tt)*) => {
            std::arch::asm!(
                "lea rax, [rip + {a}.words@TLSDESC]",
                "call qword ptr [rax + {a}.words@TLSCALL]",
                $($insn,)+
                a = sym anchor,
                $($operands)*
                clobber_abi("C"),
            )
        };
    }

    /// The fiber running on this thread, or null.
    #[inline(always)]
    pub(crate) fn current() -> *const Header {
        let h: *const Header;
        // SAFETY: reads this thread's current-fiber word (see above).
        unsafe { words_asm!("mov rax, qword ptr fs:[rax]"; out("rax") h,) };
        h
    }

    /// Makes `h` the current fiber; returns the one that was current.
    #[inline(always)]
    pub(crate) fn swap_current(h: *const Header) -> *const Header {
        let prev: *const Header;
        // SAFETY: reads and writes this thread's current-fiber word (see
        // above). The input `h` is read after the call, which preserves
        // every general register but rax (the descriptor ABI; the glibc bug
        // concerns vector registers only); rax and rdx are early outputs,
        // so `h` is in neither.
        unsafe {
            words_asm!(
                "mov rdx, qword ptr fs:[rax]",
                "mov qword ptr fs:[rax], {h}";
                h = in(reg) h, out("rdx") prev, out("rax") _,
            )
        };
        prev
    }

    /// [`swap_current`] and [`thread_id_word`] in one access: the runner's
    /// step before a switch (one descriptor sequence instead of two).
    #[inline(always)]
    pub(crate) fn swap_current_read_thread_id(h: *const Header) -> (*const Header, u64) {
        let prev: *const Header;
        let id: u64;
        // SAFETY: as in `swap_current`; rcx is an early output too.
        unsafe {
            words_asm!(
                "mov rdx, qword ptr fs:[rax]",
                "mov rcx, qword ptr fs:[rax + 8]",
                "mov qword ptr fs:[rax], {h}";
                h = in(reg) h, out("rdx") prev, out("rcx") id, out("rax") _,
            )
        };
        (prev, id)
    }

    /// Makes `h` the current fiber.
    ///
    /// # Safety
    /// `h` is null or the header of a fiber that stays alive for as long as
    /// it is current on this thread (a runner's fiber, or what was current
    /// before it).
    #[inline(always)]
    pub(crate) unsafe fn set_current(h: *const Header) {
        // SAFETY: writes this thread's current-fiber word (see above; `h`
        // is read after the call, as in `swap_current`).
        unsafe { words_asm!("mov qword ptr fs:[rax], {h}"; h = in(reg) h, out("rax") _,) };
    }

    /// This thread's id word: 0 until [`set_thread_id`].
    #[inline(always)]
    pub(crate) fn thread_id_word() -> u64 {
        let id: u64;
        // SAFETY: reads this thread's id word (see above).
        unsafe { words_asm!("mov rax, qword ptr fs:[rax + 8]"; out("rax") id,) };
        id
    }

    /// Sets this thread's id word.
    pub(crate) fn set_thread_id(id: u64) {
        // SAFETY: writes this thread's id word (see above; `id` is read
        // after the call, as in `swap_current`).
        unsafe { words_asm!("mov qword ptr fs:[rax + 8], {id}"; id = in(reg) id, out("rax") _,) };
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_pointer_width = "64",
    target_os = "linux",
    not(loom),
    not(miri),
    not(spindle_portable_tls)
)))]
mod imp {
    use std::cell::Cell;
    use std::ptr;

    use crate::header::Header;

    #[cfg(not(loom))]
    thread_local! {
        static CURRENT: Cell<*const Header> = const { Cell::new(ptr::null()) };
        static THREAD_ID: Cell<u64> = const { Cell::new(0) };
    }

    // Under loom, the model's own thread-locals: loom runs every model
    // thread on one OS thread, and these give each its own words, so the
    // models see each thread's current fiber and id (pinned fibers, the
    // run queue's set-aside list).
    #[cfg(loom)]
    loom::thread_local! {
        static CURRENT: Cell<*const Header> = Cell::new(ptr::null());
        static THREAD_ID: Cell<u64> = Cell::new(0);
    }

    /// The fiber running on this thread, or null.
    #[inline(never)]
    pub(crate) fn current() -> *const Header {
        CURRENT.with(Cell::get)
    }

    /// Makes `h` the current fiber; returns the one that was current.
    #[inline(never)]
    pub(crate) fn swap_current(h: *const Header) -> *const Header {
        CURRENT.with(|c| c.replace(h))
    }

    /// [`swap_current`] and [`thread_id_word`] in one call.
    #[inline(never)]
    pub(crate) fn swap_current_read_thread_id(h: *const Header) -> (*const Header, u64) {
        (CURRENT.with(|c| c.replace(h)), THREAD_ID.with(Cell::get))
    }

    /// Makes `h` the current fiber.
    ///
    /// # Safety
    /// As for the fast implementation.
    #[inline(never)]
    pub(crate) unsafe fn set_current(h: *const Header) {
        CURRENT.with(|c| c.set(h))
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
    use crate::header::Header;

    /// `swap_current` must store the new fiber, not the previous one it
    /// read first (an output sharing the input's register would do that),
    /// and `set_current` must put the previous one back, on each thread
    /// separately.
    #[test]
    fn swap_and_set_change_this_threads_current_word() {
        let check = |a: usize, b: usize| {
            let (a, b) = (a as *const Header, b as *const Header);
            assert!(current().is_null());
            assert!(swap_current(a).is_null());
            assert_eq!(current(), a);
            assert_eq!(swap_current(b), a);
            assert_eq!(current(), b);
            // SAFETY: the words are restored before anything reads them as
            // headers.
            unsafe { set_current(a) };
            assert_eq!(current(), a);
            // SAFETY: null is "no fiber", never read as a header.
            unsafe { set_current(std::ptr::null()) };
            assert!(current().is_null());
        };
        check(0x1000, 0x2000);
        std::thread::spawn(move || check(0x3000, 0x4000)).join().unwrap();
        check(0x5000, 0x6000);
    }

    #[test]
    fn the_thread_id_word_is_per_thread() {
        // An id the process counter never reaches.
        set_thread_id(u64::MAX - 1);
        assert_eq!(thread_id_word(), u64::MAX - 1);
        std::thread::spawn(|| assert_eq!(thread_id_word(), 0))
            .join()
            .unwrap();
        assert_eq!(thread_id_word(), u64::MAX - 1);
        assert!(current().is_null(), "the two words are separate");
    }
}
