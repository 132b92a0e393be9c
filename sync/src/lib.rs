//! Fiber-aware synchronisation: a counting [`Semaphore`], a [`Mutex`],
//! unbounded [`Channel`]s of caller-owned messages and a [`WaitGroup`] to
//! wait until a set of fibers has ended.
//!
//! Waiters are fibers or ordinary threads. A fiber that has to wait goes to
//! sleep ([`spindle_fiber::sleep`]) linked into the primitive's wait list
//! by a node on its own stack (no allocation); whoever wakes it hands it
//! back to the run queue it came from (the [`spindle_fiber::Schedule`]
//! seam). A thread that has to wait parks. Releasing and pushing work from
//! anywhere.
//!
//! ```
//! # std::thread::spawn(|| { // a watchdog: a hang fails the example
//! #     std::thread::sleep(std::time::Duration::from_secs(60));
//! #     eprintln!("watchdog: this example did not finish within 60 s");
//! #     std::process::exit(1)
//! # });
//! use std::sync::Arc;
//! use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
//! use spindle_run_queue::RunQueue;
//! use spindle_sync::{Channel, Msg, Semaphore};
//!
//! let queue = RunQueue::new(8);
//! let chan = Arc::new(Channel::<u32>::new());
//! let done = Arc::new(Semaphore::new(0));
//! let (rx, d) = (chan.clone(), done.clone());
//! let consumer = Fiber::new(FiberAttr::new()).unwrap();
//! consumer.set_function(Priority::NORMAL, move || {
//!     let mut sum = 0;
//!     while let Some(m) = rx.pop() { // `None` once closed and drained
//!         sum += m.into_inner();
//!     }
//!     d.release(1);
//!     sum
//! }).unwrap();
//! queue.try_push(consumer).unwrap();
//! for i in 1..=3 {
//!     chan.push(Msg::new(i)).unwrap();
//! }
//! chan.close(); // no more messages: the consumer's loop ends
//! let mut sum = None;
//! while let Some(ran) = queue.run_next() {
//!     if let Ok(RunOutcome::Returned(s)) = ran.outcome {
//!         sum = Some(s);
//!     }
//! }
//! done.acquire(); // an ordinary thread waits too
//! assert_eq!(sum, Some(6));
//! ```
//!
//! See DESIGN.md ("sleep/wake protocol") for the numbered steps of both
//! sides and why no wakeup is lost.
//!
//! # Interruptible waits
//!
//! [`Semaphore::acquire_interruptible`], [`Mutex::lock_interruptible`]
//! and [`Channel::pop_interruptible`] end early, with [`Interrupted`] and
//! nothing taken, when the waiting fiber is interrupted
//! ([`spindle_fiber::Fiber::interrupt`],
//! [`spindle_fiber::Waiter::interrupt`]). That is how a wait is given up:
//! `spindle-executor`'s `JoinHandle::cancel` interrupts them, its
//! `interrupt_after` gives them a timeout, and a scheduler or a timer of
//! your own can interrupt them too. The plain `acquire`, `lock` and `pop`
//! are not interrupted (an interrupt stays pending for the next
//! interruptible wait). Threads are not interrupted (they have timed waits
//! instead, below). A fiber being dropped
//! (a destructor run by the unwind of its suspended stack: `may_sleep()`
//! is false in a fiber) does not wait in an interruptible wait at all: it
//! takes what is there, else gets [`Interrupted`] at once.
//!
//! # Closing a channel
//!
//! [`Channel::close`] ends a stream: pushes are refused from then on (the
//! message comes back in [`Closed`]), receivers take what is still queued
//! and then get `None` from [`Channel::pop`] instead of waiting, and the
//! receivers waiting when it closes are woken with `None`. Nothing closes
//! a channel by itself (there are no separate sender handles to count):
//! the producer that is done says so.
//!
//! # Timed waits (threads)
//!
//! [`Semaphore::acquire_timeout`] (`bool`), [`Mutex::lock_timeout`]
//! (`Option` of the guard) and [`Channel::pop_timeout`] (and
//! `RawChannel::pop_timeout`: [`TimedOut`], since `Ok(None)` already means
//! closed) wait at most a given time on a thread; a timeout takes
//! nothing. Each has a form with a deadline instead of a duration
//! ([`Semaphore::acquire_until`], [`Mutex::lock_until`],
//! [`Channel::pop_until`]), for waits that share one deadline. They panic in a fiber that may sleep: this crate has no clock
//! to wake a sleeping fiber. In a fiber, put the interruptible wait under
//! your scheduler's deadline, as with `spindle-executor`:
//! `interrupt_after(d, || sem.acquire_interruptible()).is_ok()`; or poll
//! with the `try_` methods.

//! # Threads
//!
//! Every primitive is `Send + Sync` (for channels: when the message type is
//! `Send`), so it can be shared by fibers and threads:
//!
//! ```
//! fn assert_send_sync<T: Send + Sync>() {}
//! assert_send_sync::<spindle_sync::Semaphore>();
//! assert_send_sync::<spindle_sync::Mutex<String>>();
//! assert_send_sync::<spindle_sync::MutexGuard<'static, String>>();
//! assert_send_sync::<spindle_sync::RawChannel>();
//! assert_send_sync::<spindle_sync::Channel<String>>();
//! assert_send_sync::<spindle_sync::Msg<String>>();
//! ```
//!
//! A mutex of a `!Send` value cannot be shared, since its holders may be
//! on any thread:
//!
//! ```compile_fail,E0277
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<spindle_sync::Mutex<std::rc::Rc<u8>>>();
//! ```
//!
//! A channel of `!Send` values cannot be shared, since its messages would
//! move between threads:
//!
//! ```compile_fail,E0277
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<spindle_sync::Channel<std::rc::Rc<u8>>>();
//! ```
//!
//! ```compile_fail,E0277
//! fn assert_send<T: Send>() {}
//! assert_send::<spindle_sync::Channel<std::rc::Rc<u8>>>();
//! ```
//!
//! ```compile_fail,E0277
//! fn assert_send<T: Send>() {}
//! assert_send::<spindle_sync::Msg<std::rc::Rc<u8>>>();
//! ```
//!
//! A `Msg<T>` is `Sync` only for `T: Sync` (a `&Msg<T>` gives out `&T`):
//!
//! ```compile_fail,E0277
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<spindle_sync::Msg<std::cell::Cell<u8>>>();
//! ```
//!
//! A channel is invariant in its message type: a channel of `'static`
//! references cannot be used as one of shorter-lived references, which
//! would let a short-lived reference be pushed and popped back as
//! `'static`:
//!
//! ```compile_fail
//! use spindle_sync::{Channel, Msg};
//!
//! let chan: Channel<&'static str> = Channel::new();
//! {
//!     let s = String::from("short-lived");
//!     let short: &Channel<&str> = &chan;
//!     short.push(Msg::new(s.as_str())).unwrap();
//! }
//! let _dangling: Msg<&'static str> = chan.pop().unwrap();
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

/// `eprintln!` that cannot panic: a warning printed from a library thread
/// or a drop must not fail (and kill that thread) when stderr is closed,
/// as in `program 2>&1 | head -1`.
macro_rules! warn {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod channel;
mod mutex;
mod semaphore;
mod wait;
mod wait_group;

pub use channel::{Channel, Closed, Msg, MsgHeader, RawChannel};
pub use mutex::{Mutex, MutexGuard};
pub use semaphore::Semaphore;
pub use wait::{Interrupted, TimedOut};
pub use wait_group::WaitGroup;
