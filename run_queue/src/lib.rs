//! A thread-safe, bounded priority run queue of [`spindle_fiber`] fibers.
//!
//! The run queue is the seam that ties fibers, synchronisation primitives and
//! your own worker threads together: a fiber pushed onto a [`RunQueue`]
//! remembers it, and when a primitive from `spindle-sync` wakes the fiber it
//! goes back onto that queue by itself.
//!
//! ```
//! use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome};
//! use spindle_run_queue::RunQueue;
//!
//! let queue = RunQueue::new(16);
//! for prio in [Priority::LOWEST, Priority::HIGHEST, Priority::NORMAL] {
//!     let fiber = Fiber::new(FiberAttr::new()).unwrap();
//!     fiber.set_function(prio, move || { yield_now(); prio.0 }).unwrap();
//!     queue.try_push(fiber).unwrap();
//! }
//! // A worker loop: highest priority first, yielded fibers go back in.
//! let mut finished = Vec::new();
//! while let Some(ran) = queue.run_next() {
//!     if let Ok(RunOutcome::Returned(p)) = ran.outcome {
//!         finished.push(p);
//!     }
//! }
//! assert_eq!(finished, [255, 128, 0]);
//! ```
//!
//! Ordering: highest [`Priority`](spindle_fiber::Priority) first, FIFO among
//! equal priorities (one FIFO per priority level). Changing the priority
//! of a queued fiber through [`RunQueue::set_priority`] moves it at once;
//! [`Fiber::set_priority`](spindle_fiber::Fiber::set_priority) takes effect
//! at its next push.

//! A `RunQueue<T>` is `Send + Sync` for `T: Send`: worker threads share it.
//!
//! ```
//! fn assert_send_sync<T: Send + Sync>() {}
//! assert_send_sync::<spindle_run_queue::RunQueue<String>>();
//! ```
//!
//! ```compile_fail,E0277
//! fn assert_send<T: Send>() {}
//! assert_send::<spindle_run_queue::RunQueue<std::rc::Rc<u8>>>();
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod queue;

pub use queue::{PushError, Ran, RunQueue, RunQueueStats};
