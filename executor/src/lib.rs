//! An opt-in M:N fiber pool for Spindle: a user who adopts it writes
//! `spawn`, `join`, channels and semaphores and never thinks about workers.
//!
//! ```
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
//!   builder), growing by 50% up to twice the cores when sysmon sees a
//!   worker stuck while work is pending; extra workers retire when idle.
//! * Queues: per worker a stealable queue of fresh (not yet started) jobs
//!   and an inbox for woken fibers; one global queue. Spawns go round-robin
//!   and wake at most one worker.
//! * Priorities: three classes (high >= 192, normal, low < 64); a worker
//!   always takes work of a higher class first.
//! * `spindle-sync` primitives work unchanged inside: the executor
//!   implements the fiber crate's wake seam.
//! * A started fiber stays on the worker that started it (so safe code
//!   cannot move `!Send` stack values between threads); load balances by
//!   stealing jobs before they start. See DESIGN.md.
//!
//! Set `SPINDLE_STATS=1` to print counters at shutdown.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

#[cfg(feature = "tracing")]
macro_rules! trace_event {
    ($($t:tt)*) => { tracing::trace!($($t)*) };
}
#[cfg(not(feature = "tracing"))]
macro_rules! trace_event {
    ($($t:tt)*) => {};
}
pub(crate) use trace_event;

mod config;
mod executor;
mod ops;
mod scope;
mod shared;
mod sysmon;
mod task;
mod timer;
mod worker;

pub use config::{Builder, OnDeadlock};
pub use executor::{Executor, ExecutorStats, Handle, JoinHandle, SpawnOptions};
pub use ops::{sleep, spawn, yield_if_needed, yield_now, yield_timeout};
pub use scope::{Scope, ScopedJoinHandle};
pub use spindle_fiber::Priority;
pub use task::JoinError;
