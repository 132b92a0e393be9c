//! `WaitGroup`: wait until every clone of a group is gone.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use spindle_fiber::WaitReason;

use crate::wait::refuse_in_fiber_instead;
use crate::{Interrupted, Semaphore};

/// What a fiber waiting in [`WaitGroup::wait`] waits for, as
/// [`Fiber::wait_site`](spindle_fiber::Fiber::wait_site) and deadlock
/// reports show it.
static WAIT_REASON: WaitReason = WaitReason("a wait group");

/// Waits until every member of a group has finished: each member holds a
/// clone of the `WaitGroup`, and [`wait`](WaitGroup::wait) returns once
/// all the clones are gone. A fiber waits by sleeping, a thread by
/// parking, like every wait of this crate.
///
/// A member finishes by dropping its clone, so a fiber whose function
/// moved a clone in finishes when its function ends, whether it returns
/// or panics (the unwind drops the closure's captures), and when a fiber
/// suspended with one is dropped (its stack is unwound). That makes a
/// group the way to learn that a set of fibers run by your own workers
/// has ended, for instance before you close their run queue
/// (`spindle_run_queue::RunQueue::close`).
///
/// A clone that is never dropped keeps the group from finishing, and every
/// wait on it from returning: one forgotten (`std::mem::forget`), or held
/// by a suspended fiber whose stack is leaked instead of unwound (a pinned
/// fiber dropped on another thread than its own, or any suspended fiber
/// dropped in a `panic = "abort"` build: see
/// [`Fiber`](spindle_fiber::Fiber)). Drop such fibers on their own thread,
/// or let them finish. Nor can a thread wait for fibers that only it runs:
/// its wait parks it.
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority};
/// use spindle_sync::WaitGroup;
///
/// let group = WaitGroup::new();
/// let done = Arc::new(AtomicUsize::new(0));
/// let workers: Vec<_> = (0..3)
///     .map(|_| {
///         let (member, done) = (group.clone(), done.clone());
///         std::thread::spawn(move || {
///             // A fiber per thread, pinned there; the clone is the fiber's.
///             let fiber = Fiber::new(FiberAttr::new()).unwrap();
///             fiber.set_function(Priority::NORMAL, move || {
///                 let _member = member; // dropped when the function ends
///                 yield_now();
///                 done.fetch_add(1, Ordering::Relaxed);
///             }).unwrap();
///             while fiber.run().is_ok() {}
///         })
///     })
///     .collect();
/// group.wait(); // this thread parks until the three fibers have ended
/// assert_eq!(done.load(Ordering::Relaxed), 3);
/// # for w in workers { w.join().unwrap(); }
/// ```
///
/// Several may wait: each waiter gives up its own clone and returns once
/// the count of clones is zero.
pub struct WaitGroup {
    inner: Arc<Inner>,
}

struct Inner {
    /// Live clones.
    count: AtomicUsize,
    /// No token until `count` reaches zero, then [`OPEN`] of them: every
    /// waiter asleep then is woken at once, and every later one takes one
    /// without waiting.
    done: Semaphore,
}

/// Tokens a finished group holds: more than there can ever be waiters.
/// (Handing one token on from waiter to waiter instead would make a
/// thread's wait depend on fibers that got the token first: found by
/// `every_waiter_gets_through`, where those fibers' queue is run by the
/// waiting thread itself.)
const OPEN: usize = usize::MAX / 2;

impl WaitGroup {
    /// A group of one: this handle. Clone it for each member.
    pub fn new() -> WaitGroup {
        WaitGroup { inner: Arc::new(Inner { count: AtomicUsize::new(1), done: Semaphore::new(0) }) }
    }

    /// Gives up this handle and waits until no other is left: a fiber
    /// sleeps, a thread parks. Returns at once when this was the last.
    ///
    /// In a fiber that is being dropped, the wait is
    /// [`Semaphore::acquire`]'s, with the same rules.
    #[track_caller]
    pub fn wait(self) {
        let inner = self.leave();
        inner.done.acquire_for(&WAIT_REASON);
    }

    /// Like [`wait`](WaitGroup::wait), but a fiber that is interrupted
    /// ([`Fiber::interrupt`](spindle_fiber::Fiber::interrupt)) stops
    /// waiting.
    ///
    /// A group that is done when the wait starts, or by the time the
    /// interrupt is seen, wins: the wait returns `Ok(())` and the interrupt
    /// stays pending. In a fiber that is being dropped it does not wait:
    /// `Ok(())` if the group is done, else `Interrupted` at once. A thread
    /// waits as in `wait`. The rules are
    /// [`Semaphore::acquire_interruptible`]'s.
    ///
    /// # Errors
    ///
    /// [`Interrupted`] if the fiber was interrupted before the group was
    /// done, or, with the group not done, at once in a fiber being
    /// dropped. The handle is given up either way.
    #[track_caller]
    pub fn wait_interruptible(self) -> Result<(), Interrupted> {
        let inner = self.leave();
        inner.done.acquire_interruptible_for(&WAIT_REASON)
    }

    /// Like [`wait`](WaitGroup::wait), for a thread that waits at most
    /// `timeout`: `true` if the group was done in time. The handle is
    /// given up either way, so to wait again after a timeout, wait on a
    /// clone (as the example does).
    ///
    /// ```
    /// use spindle_sync::WaitGroup;
    /// use std::time::Duration;
    ///
    /// let group = WaitGroup::new();
    /// let member = group.clone();
    /// assert!(!group.clone().wait_timeout(Duration::from_millis(10))); // `member` is alive
    /// drop(member);
    /// assert!(group.wait_timeout(Duration::from_millis(10)));
    /// ```
    ///
    /// # Panics
    ///
    /// In a fiber that may sleep, as [`Semaphore::acquire_timeout`] does
    /// (a fiber uses [`wait_interruptible`](WaitGroup::wait_interruptible)
    /// under its scheduler's deadline instead); the unwind gives up the
    /// handle. A fiber that is being dropped waits as a thread does.
    #[track_caller]
    #[must_use = "the wait may time out; check whether the group was done"]
    pub fn wait_timeout(self, timeout: Duration) -> bool {
        // Before leaving, and naming this method: the semaphore's own
        // refusal would name `Semaphore::acquire_timeout` and point to a
        // `try_` method that a group does not have.
        refuse_in_fiber_instead(
            "WaitGroup::wait_timeout",
            "WaitGroup::wait_interruptible under your scheduler's deadline (spindle-executor: \
             interrupt_after, interrupt_at)",
        );
        let inner = self.leave();
        inner.done.acquire_timeout(timeout)
    }

    /// Handles of this group alive now, this one included. A snapshot:
    /// other threads may clone or drop theirs at any moment.
    pub fn count(&self) -> usize {
        self.inner.count.load(Ordering::Acquire)
    }

    /// Drops this handle and returns the shared part to wait on.
    fn leave(self) -> Arc<Inner> {
        let inner = self.inner.clone();
        drop(self);
        inner
    }
}

impl Default for WaitGroup {
    fn default() -> WaitGroup {
        WaitGroup::new()
    }
}

impl Clone for WaitGroup {
    fn clone(&self) -> WaitGroup {
        // A clone is made from a live handle, so the count is not zero and
        // cannot reach zero meanwhile: `Relaxed` is enough, as for `Arc`.
        self.inner.count.fetch_add(1, Ordering::Relaxed);
        WaitGroup { inner: self.inner.clone() }
    }
}

impl Drop for WaitGroup {
    fn drop(&mut self) {
        // Release: what this member did happens before the wait returns.
        // Acquire (for the last): the token then carries every member's
        // work through the semaphore's lock to the waiters.
        if self.inner.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.done.release(OPEN);
        }
    }
}

impl fmt::Debug for WaitGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WaitGroup").field("count", &self.count()).finish()
    }
}
