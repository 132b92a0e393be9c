//! An opt-in M:N fiber pool for Spindle: a user who adopts it writes
//! `spawn`, `join`, channels, mutexes and semaphores and never thinks about
//! workers.
//!
//! ```
//! # std::thread::spawn(|| { // a watchdog: a hang fails the example
//! #     std::thread::sleep(std::time::Duration::from_secs(60));
//! #     eprintln!("watchdog: this example did not finish within 60 s");
//! #     std::process::exit(1)
//! # });
//! use spindle_executor::{yield_now, Executor};
//!
//! let exec = Executor::builder().workers(2).build();
//! let handles: Vec<_> = (0..100u64)
//!     .map(|i| exec.spawn(move || { yield_now(); i * i }))
//!     .collect();
//! let sum: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
//! assert_eq!(sum, (0..100u64).map(|i| i * i).sum());
//! ```
//!
//! * Workers: base = available cores (or `SPINDLE_WORKERS`, or the
//!   builder), growing up to twice the cores when sysmon sees workers
//!   stuck while jobs another worker could take are queued (one more
//!   worker for each stuck one); extra workers retire when idle.
//! * Queues: per worker a stealable queue of fresh (not yet started) jobs
//!   and an inbox for woken fibers; one global queue. Spawns from outside
//!   the executor go round-robin across workers, a spawn from one of its
//!   fibers to that fiber's own worker (idle workers steal it); each wakes
//!   at most one worker.
//! * Priorities: three classes (high: `Priority::HIGH` (192) and above,
//!   low: `Priority::LOW` (64) and below, normal between); a worker
//!   takes work of a higher class first (while a job waits for a stack,
//!   every other round runs started fibers of any class before it).
//! * `spindle-sync` primitives work unchanged inside: the executor
//!   implements the fiber crate's wake seam.
//! * A started fiber stays on the worker that started it (so safe code
//!   cannot move `!Send` stack values between threads); load balances by
//!   stealing jobs before they start. See DESIGN.md.
//!
//! Set `SPINDLE_STATS=1` to print counters at shutdown. The `tracing`
//! feature (off by default) emits `tracing` trace events when a worker
//! parks, is unparked, steals or retires, when the pool scales up, and when
//! sysmon flags a time slice overrun.
//!
//! # Cancellation
//!
//! [`JoinHandle::cancel`] and shutdown are requests: the fiber unwinds at
//! its next cancellation point, which is any of this crate's
//! [`yield_now`], [`yield_if_needed`] (when it yields), [`sleep`],
//! [`sleep_until`], [`yield_timeout`], [`interrupt_after`], [`interrupt_at`],
//! [`JoinHandle::join`], [`JoinHandle::wait_timeout`] and
//! [`JoinHandle::wait_until`]. The unwind
//! is a panic with a private payload (started with
//! `spindle_fiber::resume_unwind`, so no panic message): destructors run,
//! and the join reports [`JoinError::Cancelled`]. A `catch_unwind` in the
//! fiber catches it too; code that catches panics should let it go on
//! (`spindle_fiber::resume_unwind`, which notes the unwind for
//! spindle-fiber; `std::panic::resume_unwind` does not). Waits on `spindle-sync` primitives are not
//! cancellation points, but a cancel interrupts their interruptible forms
//! (`Semaphore::acquire_interruptible`, `Mutex::lock_interruptible`,
//! `Channel::pop_interruptible`): the wait returns `Err(Interrupted)`, and
//! the fiber unwinds at its next cancellation point. A fiber in a plain
//! `acquire`, `lock` or `pop` keeps waiting.
//! [`interrupt_after`] and [`interrupt_at`] give the same waits a timeout.
//!
//! # Deadlock detection
//!
//! On by default ([`OnDeadlock::FailJoin`], grace period 1 s): when nothing
//! in the executor is runnable, no timer is pending and fibers sleep, the
//! joins that threads are blocked in fail with [`JoinError::Deadlock`] and
//! a report of the sleeping fibers is printed (a thread waiting in
//! [`Executor::scope`] is reported but keeps waiting). Detection sees the executor
//! only: fibers waiting for a plain thread that feeds them (through a
//! channel, say) look deadlocked once that thread has been quiet for the
//! grace period. Such programs set [`Builder::on_deadlock`] or
//! [`Builder::deadlock_grace`].
//!
//! # Out of stacks
//!
//! A job gets its fiber, and its stack, when a worker starts it, so any
//! number of jobs can be queued. When no stack can be mapped (the kernel's
//! `vm.max_map_count`, an address-space limit such as `ulimit -v`, or
//! memory), the workers give up the idle fibers they cache and the job
//! waits until running fibers finish ([`ExecutorStats::stack_waits`]
//! counts the waits); one that could never start, because no fiber stack
//! is left to free, fails its join with [`JoinError::NoStack`].
//!
//! # Same names as in `spindle-fiber`
//!
//! This crate's [`yield_now`] also checks for cancellation
//! (`spindle_fiber::yield_now` does not), and its [`sleep`] is a timer,
//! while `spindle_fiber::sleep` waits for a `Waiter`. Use this crate's in
//! executor fibers. Outside one (on a thread, or in a fiber run by
//! something else), `sleep` sleeps the thread.
//!
//! # Threads
//!
//! `Executor` and `Handle` are `Send + Sync`; a `JoinHandle<T>` is `Send`
//! for `T: Send` (join it from any thread or fiber) but not `Sync`:
//!
//! ```
//! fn assert_send_sync<T: Send + Sync>() {}
//! fn assert_send<T: Send>() {}
//! assert_send_sync::<spindle_executor::Executor>();
//! assert_send_sync::<spindle_executor::Handle>();
//! assert_send::<spindle_executor::JoinHandle<String>>();
//! // Errors cross threads and box into `dyn Error + Send + Sync`.
//! assert_send_sync::<spindle_executor::JoinError>();
//! ```
//!
//! ```compile_fail,E0277
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<spindle_executor::JoinHandle<String>>();
//! ```
//!
//! Spawned closures and their values must be `Send`, and borrow nothing
//! (use [`Executor::scope`] to borrow):
//!
//! ```compile_fail,E0277
//! let exec = spindle_executor::Executor::builder().workers(1).build();
//! let rc = std::rc::Rc::new(1);
//! exec.spawn(move || *rc);
//! ```
//!
//! ```compile_fail,E0277
//! let exec = spindle_executor::Executor::builder().workers(1).build();
//! let _ = exec.spawn(|| std::rc::Rc::new(1));
//! ```
//!
//! ```compile_fail,E0373
//! let exec = spindle_executor::Executor::builder().workers(1).build();
//! let v = vec![1];
//! let _ = exec.spawn(|| v.len());
//! ```
//!
//! A join handle of a `!Send` value is not `Send` either:
//!
//! ```compile_fail,E0277
//! fn assert_send<T: Send>() {}
//! assert_send::<spindle_executor::JoinHandle<std::rc::Rc<u8>>>();
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

#[cfg(feature = "tracing")]
macro_rules! trace_event {
    ($($t:tt)*) => { tracing::trace!($($t)*) };
}
#[cfg(not(feature = "tracing"))]
macro_rules! trace_event {
    ($($t:tt)*) => {};
}
pub(crate) use trace_event;

/// `eprintln!` that cannot panic: a warning printed from a library thread
/// or a drop must not fail (and kill that thread) when stderr is closed,
/// as in `program 2>&1 | head -1`.
macro_rules! warn {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod config;
mod executor;
mod ops;
mod scope;
mod shared;
mod sysmon;
mod task;
mod timer;
mod worker;

pub use config::{Builder, OnDeadlock, MAX_WORKERS};
pub use executor::{Executor, ExecutorStats, Handle, JoinHandle, SpawnOptions};
pub use ops::{
    interrupt_after, interrupt_at, sleep, sleep_until, spawn, yield_if_needed, yield_now, yield_timeout,
};
pub use scope::{Scope, ScopedJoinHandle};
pub use spindle_fiber::{FiberId, Priority};
pub use task::{JoinError, PanicPayload};

/// The fiber-aware channels, mutexes and semaphores (`spindle-sync`), which work
/// unchanged inside executor fibers: a fiber that waits sleeps and frees
/// its worker.
pub use spindle_sync as sync;
