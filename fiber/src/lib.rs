//! Stackful fibers for Rust: create one with attributes, give it a function
//! and a priority, [`run`](Fiber::run) it until its next suspension point,
//! yield from anywhere in its call stack, get its return value, and reuse it
//! (and its stack) for another function.
//!
//! ```
//! use spindle_fiber::{yield_value, Fiber, FiberAttr, Priority, RunOutcome};
//!
//! let fiber = Fiber::new(FiberAttr::new().name("counter")).unwrap();
//! fiber.set_function(Priority::NORMAL, || {
//!     for i in 0..10 {
//!         yield_value(i);
//!     }
//!     10
//! }).unwrap();
//! let mut seen = Vec::new();
//! loop {
//!     match fiber.run().unwrap() {
//!         RunOutcome::Yielded(v) => seen.push(v),
//!         RunOutcome::Returned(v) => { seen.push(v); break }
//!         other => panic!("unexpected {other:?}"),
//!     }
//! }
//! assert_eq!(seen, (0..=10).collect::<Vec<_>>());
//! ```
//!
//! This crate knows nothing about scheduling beyond one seam: a fiber
//! remembers the [`Schedule`] it was last queued on, and when a
//! synchronisation primitive wakes it (through a [`Waiter`]) it hands itself
//! back there. `spindle-run-queue`, `spindle-sync` and `spindle-executor`
//! build on that seam.
//!
//! Stacks are anonymous mappings with a guard page, pooled by a
//! [`StackPool`]; a stack overflow in a fiber prints a report naming the
//! fiber and aborts.
//!
//! See DESIGN.md for the state machine, the sleep/wake protocol and the
//! soundness argument for fibers that move between threads.
//!
//! # Platforms
//!
//! Unix only (the stacks are `mmap`ed and overflows are caught with a
//! signal handler); the fast thread-local access is written for x86-64
//! Linux, and other unix targets use `thread_local!`.
//!
//! # Process-wide side effects
//!
//! The first [`Fiber::new`] in a process installs two things that outlive
//! every fiber:
//!
//! * **A `SIGSEGV`/`SIGBUS` handler** that reports a fault in a fiber's
//!   guard page (naming the fiber) and aborts. Every other fault goes on to
//!   the handler that was installed before (Rust's own, which reports thread
//!   stack overflows), so code that installs its handler before the first
//!   fiber keeps it. A handler installed *after* replaces this one and the
//!   overflow report is lost (the process still dies on the fault). Each
//!   thread that runs a fiber also gets an alternate signal stack, unmapped
//!   when the thread exits, unless it already had one.
//! * **A panic hook** that names the panicking fiber (a line `panic in
//!   fiber 'name' (#id):` on stderr) and notes that the fiber's function
//!   is panicking, then calls the hook that was installed before. The note
//!   lets a fiber dropped while suspended inside its own panic's unwind (a
//!   destructor that yields) be leaked instead of unwound a second time,
//!   which would abort the process ([`resume_unwind`] notes an unwind
//!   that no panic began, which `std::panic::resume_unwind` does not). A
//!   hook set later with
//!   [`std::panic::set_hook`] replaces it: reports then no longer name the
//!   fiber, and such a drop aborts again. One that should keep both can
//!   chain to [`std::panic::take_hook`]'s result. A hook set *before* the
//!   first fiber, one that prints nothing say, still gets that line in
//!   front of it: to silence panics in fibers, set the hook after creating
//!   the first fiber; that also drops the note above, so a fiber dropped
//!   while suspended in its panic's unwind aborts the process again: run
//!   such fibers to the end.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

#[cfg(not(unix))]
compile_error!("spindle-fiber supports unix targets only (mmap'd stacks, signal-based overflow reports)");

/// `eprintln!` that cannot panic: a warning printed from a library thread
/// or a drop must not fail (and kill that thread) when stderr is closed,
/// as in `program 2>&1 | head -1`.
macro_rules! warn {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod current;
mod defer;
mod error;
mod fiber;
mod header;
mod loom;
mod overflow;
mod report;
mod stack;
mod state;
mod tls;

pub use current::{
    current, current_id, current_sched_data, in_fiber, may_sleep, set_current_priority, sleep, sleep_on,
    take_interrupt, yield_now, yield_value, CurrentFiber, RefusedWake, ThreadToken, WaitHook, WaitToken,
    Waiter,
};
pub use defer::defer_releases;
pub use error::{FiberError, StackError};
pub use fiber::{Fiber, FiberAttr, Panic, RunOutcome, Schedule, Woken};
pub use header::{FiberId, FiberIdHasher, FiberStats, Priority, WaitReason};
pub use report::{leaked_stacks, resume_unwind};
pub use stack::{
    FiberStack, StackPool, DEFAULT_POOL_CAPACITY, DEFAULT_STACK_SIZE, MAX_STACK_SIZE, MIN_STACK_SIZE,
};
pub use state::FiberState;

#[doc(hidden)]
pub mod __private {
    //! Not part of the API.

    /// Names the crate's thread-local symbols (see `tls.rs`); never called.
    /// Public so that the compiler keeps its mangled name as it is in
    /// every object file.
    #[inline(never)]
    pub fn tls_anchor() {}
}

#[doc(hidden)]
pub mod __loom {
    //! The state machine, exposed for the loom model tests only.
    pub use crate::state::*;
}
