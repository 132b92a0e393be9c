//! A thread-safe, bounded priority run queue of [`spindle_fiber`] fibers.
//!
//! The run queue ties fibers, synchronisation primitives and your own
//! worker threads together: a fiber pushed onto a [`RunQueue`] remembers it
//! as its home (the queue implements spindle-fiber's `Schedule` trait, the
//! seam between fibers and scheduling), and when a primitive from
//! `spindle-sync` wakes the fiber it goes back onto that queue by itself.
//!
//! # Worker threads and pinned fibers
//!
//! A fiber given its function with the safe `set_function` is pinned to
//! the first thread that runs it: a pop on any other thread passes over it
//! (it is set aside for its own thread, counted in [`RunQueueStats`]'s
//! `wrong_thread`). So a worker thread that has started fibers must keep
//! popping until they have finished: a fiber pinned to a thread that left
//! its loop stays in the queue, counted in `len()`, until the queue is
//! dropped. Stop workers once the work is done, not on a timer: loop on
//! [`RunQueue::pop`], and [`close`](RunQueue::close) the queue when the
//! last fiber has finished (count them, as the `workers` example does);
//! every worker's `pop` then returns `None`. Fibers whose functions are
//! safe to move (`set_function_migratable`, `unsafe`) may run on any
//! worker.
//!
//! Pinning also decides the balance: each fiber stays with whichever
//! worker ran it first, and a worker that is free while another is busy
//! takes every new fiber. Fibers pushed before the workers start can all
//! go to the first worker to wake, which then runs every one of them while
//! the others find nothing they may run. To choose, pin each fiber to a
//! worker before pushing it: each worker hands out its
//! [`ThreadToken`](spindle_fiber::ThreadToken) when it starts, and
//! [`Fiber::pin_to`](spindle_fiber::Fiber::pin_to) pins a function that has
//! not run yet to that worker, as the `workers` example does (a pop on
//! another worker sets the fiber aside for its own). That spreads the
//! fibers, not necessarily the work: a fiber that finds nothing to do
//! while another worker's fibers take it all (the example's consumers on a
//! busy machine) still leaves its worker idle. Giving each worker its own
//! queue, or migratable fibers, are the other ways to spread them.
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
//! at its next push. Priority is strict and nothing ages a waiting fiber:
//! a fiber that keeps yielding at the top level starves every lower level
//! for as long as it does.
//!
//! # Threads
//!
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
//!
//! ```compile_fail,E0277
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<spindle_run_queue::RunQueue<std::rc::Rc<u8>>>();
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

mod queue;

pub use queue::{PushError, Ran, RunQueue, RunQueueStats};
