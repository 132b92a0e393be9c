//! A counting semaphore for fibers and threads.

use std::fmt;
use std::ptr;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use spindle_fiber::{Priority, WaitReason};

use crate::wait::{refuse_in_fiber, thread_deadline, wait, Interrupted, WaitList, Wakeup};

static WAIT_REASON: WaitReason = WaitReason("a semaphore");

/// Lock-guarded state.
struct Synced {
    /// Available tokens; non-zero only when `waiters` is empty, except
    /// after a wake panicked in `release` (tokens it had not handed out
    /// yet are counted here, with waiters still asleep): the next
    /// `release` hands them to those waiters first.
    tokens: usize,
    waiters: WaitList,
}

impl Synced {
    /// Takes an available token.
    fn try_take(&mut self) -> bool {
        if self.tokens > 0 {
            self.tokens -= 1;
            true
        } else {
            false
        }
    }

    /// A token handed to a waiter that will not take it (a fiber dropped
    /// before it ran again, or whose scheduler refused its wake): to the
    /// next waiter, or back to the count.
    fn give_back(&mut self, _: *mut ()) -> Option<Wakeup> {
        self.waiters.pop_front(ptr::null_mut()).or_else(|| {
            // Saturating: this runs in an unwind, where an overflow
            // panic would abort, and a count at `usize::MAX` has
            // no token to spare anyway.
            self.tokens = self.tokens.saturating_add(1);
            None
        })
    }
}

/// A counting semaphore whose waiters are fibers (which sleep and are
/// pushed back on their run queue when woken) or ordinary threads (which
/// park). Waiters are woken in FIFO order, fibers and threads alike.
///
/// [`release`](Semaphore::release) may be called from any thread, fiber or
/// not; it never waits for a waiter and allocates nothing itself (a woken
/// fiber goes back to its run queue, which may grow a buffer the first
/// time a priority level is used). (One exception to "never waits":
/// waking a fiber whose only reference was its wait node, with no run
/// queue to go to, drops it there: unwound on its own thread or if it may
/// migrate (its destructors then run inside `release`, and block it if
/// they wait), else its stack leaks with the token it was handed.)
///
/// A fiber that cannot sleep, because its stack is being unwound after
/// its last handle was dropped, waits like a thread in `acquire`: its
/// destructors may `acquire`, blocking the dropping thread until a
/// release. Its `acquire_interruptible` does not wait: it takes a token if
/// there is one, else returns `Interrupted` at once.
///
/// A token handed to a sleeping fiber is its own from then on, unless its
/// run queue or executor refuses the wake or abandons the fiber (it is
/// gone or shut down, so the fiber would never run): then whoever lets go
/// of the fiber takes the token back through its wait hook and gives it
/// to the next waiter, or to the count; the fiber, if it ever runs again,
/// waits again. If the fiber is dropped before it runs again, the unwind
/// gives the token back the same way; if its stack cannot be unwound (a
/// pinned fiber dropped on another thread by a holder that did not
/// abandon it first: the stack is leaked, see `spindle_fiber`), the token
/// is lost with it.
///
/// ```
/// use std::sync::Arc;
/// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
/// use spindle_run_queue::RunQueue;
/// use spindle_sync::Semaphore;
///
/// let sem = Arc::new(Semaphore::new(0));
/// let queue = RunQueue::new(4);
/// let fiber = Fiber::new(FiberAttr::new()).unwrap();
/// let s = sem.clone();
/// fiber.set_function(Priority::NORMAL, move || { s.acquire(); "got it" }).unwrap();
/// queue.try_push(fiber).unwrap();
///
/// let ran = queue.run_next().unwrap();
/// assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
/// assert!(queue.is_empty());
///
/// sem.release(1); // wakes the fiber back onto `queue`
/// let ran = queue.run_next().unwrap();
/// assert!(matches!(ran.outcome, Ok(RunOutcome::Returned("got it"))));
/// ```
pub struct Semaphore {
    synced: Mutex<Synced>,
}

impl Semaphore {
    /// A semaphore holding `tokens` tokens.
    pub const fn new(tokens: usize) -> Semaphore {
        Semaphore { synced: Mutex::new(Synced { tokens, waiters: WaitList::new() }) }
    }

    /// Takes a token, waiting for one if there is none: a fiber sleeps, a
    /// thread parks.
    #[track_caller]
    #[inline]
    pub fn acquire(&self) {
        let _ = self.acquire_inner::<false>(None, &WAIT_REASON, None);
    }

    /// Like [`acquire`](Semaphore::acquire), naming what a fiber that has
    /// to wait is waiting for (shown by
    /// [`Fiber::wait_site`](spindle_fiber::Fiber::wait_site) and in
    /// deadlock reports) instead of "a semaphore": for primitives built on
    /// a semaphore, such as a join.
    ///
    /// ```
    /// use spindle_fiber::WaitReason;
    /// use spindle_sync::Semaphore;
    ///
    /// static BARRIER: WaitReason = WaitReason("the start barrier");
    /// let sem = Semaphore::new(1);
    /// sem.acquire_for(&BARRIER); // a token is there: no wait
    /// ```
    #[track_caller]
    #[inline]
    pub fn acquire_for(&self, reason: &'static WaitReason) {
        let _ = self.acquire_inner::<false>(None, reason, None);
    }

    /// Like [`acquire`](Semaphore::acquire); a fiber that has to wait is
    /// woken at `priority`, which stays its priority afterwards (as with
    /// [`set_current_priority`](spindle_fiber::set_current_priority)).
    ///
    /// The priority is applied as the wake queues the fiber. A fiber that an
    /// earlier wake queued already (an interrupt, or a stale
    /// [`Waiter`](spindle_fiber::Waiter)) keeps its place in its queue and
    /// takes the token there; the new priority counts from its next push.
    #[track_caller]
    #[inline]
    pub fn acquire_with_priority(&self, priority: Priority) {
        let _ = self.acquire_inner::<false>(Some(priority), &WAIT_REASON, None);
    }

    /// Like [`acquire`](Semaphore::acquire), but a fiber's wait ends early
    /// if the fiber is interrupted ([`Waiter::interrupt`],
    /// [`Fiber::interrupt`]; an interrupt made before the wait counts too,
    /// once): then no token is taken. A token that is available is taken
    /// even with an interrupt pending. A thread waits as in `acquire`. A
    /// fiber that is being dropped (a destructor run by the unwind of its
    /// suspended stack, or code that caught that unwind:
    /// [`may_sleep`](spindle_fiber::may_sleep) is false) does not wait: it
    /// takes a token if there is one, else returns `Interrupted`, and so
    /// does every retry (do not loop on it there: use `acquire`, which
    /// blocks the thread, if the token must be had).
    ///
    /// ```
    /// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
    /// use spindle_sync::{Interrupted, Semaphore};
    /// use std::sync::Arc;
    ///
    /// let sem = Arc::new(Semaphore::new(0));
    /// let fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// let s = sem.clone();
    /// fiber.set_function(Priority::NORMAL, move || s.acquire_interruptible()).unwrap();
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
    /// fiber.interrupt(); // e.g. a timeout or a cancel
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(Err(Interrupted)))));
    /// assert_eq!((sem.waiters(), sem.available()), (0, 0));
    /// ```
    ///
    /// # Errors
    ///
    /// [`Interrupted`] if the fiber was interrupted before a token came,
    /// or, with none there, at once in a fiber being dropped.
    ///
    /// [`Waiter::interrupt`]: spindle_fiber::Waiter::interrupt
    /// [`Fiber::interrupt`]: spindle_fiber::Fiber::interrupt
    #[track_caller]
    #[inline]
    pub fn acquire_interruptible(&self) -> Result<(), Interrupted> {
        self.acquire_inner::<true>(None, &WAIT_REASON, None)
    }

    /// Like [`acquire_interruptible`](Semaphore::acquire_interruptible),
    /// naming what a fiber that has to wait is waiting for, as
    /// [`acquire_for`](Semaphore::acquire_for) does.
    ///
    /// ```
    /// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome, WaitReason};
    /// use spindle_sync::Semaphore;
    /// use std::sync::Arc;
    ///
    /// static READY: WaitReason = WaitReason("the ready signal");
    /// let sem = Arc::new(Semaphore::new(0));
    /// let fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// let s = sem.clone();
    /// fiber.set_function(Priority::NORMAL, move || s.acquire_interruptible_for(&READY)).unwrap();
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
    /// assert_eq!(fiber.wait_site().unwrap().0, "the ready signal");
    /// sem.release(1);
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(Ok(())))));
    /// ```
    ///
    /// # Errors
    ///
    /// As [`acquire_interruptible`](Semaphore::acquire_interruptible).
    #[track_caller]
    #[inline]
    pub fn acquire_interruptible_for(&self, reason: &'static WaitReason) -> Result<(), Interrupted> {
        self.acquire_inner::<true>(None, reason, None)
    }

    #[track_caller]
    #[inline]
    fn acquire_inner<const INTERRUPTIBLE: bool>(
        &self,
        priority: Option<Priority>,
        reason: &'static WaitReason,
        deadline: Option<Instant>,
    ) -> Result<(), Interrupted> {
        let mut synced = self.synced.lock();
        if synced.try_take() {
            return Ok(());
        }
        // The waker hands the token over directly (it never reaches
        // `tokens`), so no one can take it in between.
        wait::<_, INTERRUPTIBLE>(
            synced,
            |s| &mut s.waiters,
            Synced::give_back,
            |s| s.try_take().then_some(ptr::null_mut()),
            priority,
            reason,
            deadline,
        )
        .map(drop)
    }

    /// Like [`acquire`](Semaphore::acquire), for a thread that waits at
    /// most `timeout`: whether it took a token. A token handed to it as the
    /// timeout passes is still taken (`true`); one not taken stays for the
    /// others. A duration too long to add to the current time waits as
    /// `acquire` does.
    ///
    /// ```
    /// use spindle_sync::Semaphore;
    /// use std::time::Duration;
    ///
    /// let sem = Semaphore::new(1);
    /// assert!(sem.acquire_timeout(Duration::from_millis(10))); // one there
    /// assert!(!sem.acquire_timeout(Duration::from_millis(10))); // none comes
    /// assert_eq!(sem.waiters(), 0, "a wait that timed out leaves nothing behind");
    /// ```
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep: not while its dropped stack is
    /// unwound): this crate has no clock to wake a sleeping fiber at the
    /// deadline. A fiber uses
    /// [`acquire_interruptible`](Semaphore::acquire_interruptible) under
    /// its scheduler's deadline instead (`spindle-executor`:
    /// `interrupt_after`).
    #[track_caller]
    #[must_use = "the wait may time out; check whether a token was taken"]
    pub fn acquire_timeout(&self, timeout: Duration) -> bool {
        let deadline = thread_deadline(timeout, "Semaphore::acquire_timeout");
        self.acquire_inner::<false>(None, &WAIT_REASON, deadline).is_ok()
    }

    /// Like [`acquire_timeout`](Semaphore::acquire_timeout), with a
    /// deadline instead of a duration: whether it took a token by
    /// `deadline`. A deadline already past still takes a token that is
    /// there now.
    ///
    /// ```
    /// use spindle_sync::Semaphore;
    /// use std::time::{Duration, Instant};
    ///
    /// let sem = Semaphore::new(1);
    /// let deadline = Instant::now() + Duration::from_millis(10);
    /// assert!(sem.acquire_until(deadline)); // one there
    /// assert!(!sem.acquire_until(deadline)); // none comes
    /// let past = Instant::now();
    /// sem.release(1);
    /// assert!(sem.acquire_until(past), "a token there now is taken, the deadline past or not");
    /// ```
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep), as
    /// [`acquire_timeout`](Semaphore::acquire_timeout).
    #[track_caller]
    #[must_use = "the wait may time out; check whether a token was taken"]
    pub fn acquire_until(&self, deadline: Instant) -> bool {
        refuse_in_fiber("Semaphore::acquire_until");
        self.acquire_inner::<false>(None, &WAIT_REASON, Some(deadline)).is_ok()
    }

    /// Takes a token if one is available now.
    #[must_use = "try_acquire may fail; check whether a token was taken"]
    pub fn try_acquire(&self) -> bool {
        self.synced.lock().try_take()
    }

    /// Adds `n` tokens, handing them to waiters first, in FIFO order.
    ///
    /// A wake can drop a fiber's last reference (a fiber run by hand and
    /// dropped while it slept, or one whose scheduler has shut down), and
    /// its stack is then unwound on this thread. With more than one token
    /// that happens only once every token is handed out or counted
    /// ([`defer_releases`](spindle_fiber::defer_releases)), so a
    /// destructor there that acquires from this semaphore finds its token.
    ///
    /// # Panics
    /// If the count of available tokens would pass `usize::MAX` (the
    /// tokens handed to waiters before that stay handed). A wake whose
    /// scheduler panics (`Schedule::schedule` must not) unwinds out of
    /// `release`; the tokens not handed out by then are added to the count
    /// rather than lost, and the next `release` hands them to the waiters
    /// still asleep, with its own.
    pub fn release(&self, n: usize) {
        if n == 1 {
            // One token to one waiter (the common case) cannot be withheld
            // from that waiter's own wake: no scope.
            let mut synced = self.synced.lock();
            if synced.waiters.is_empty() {
                let available = synced.tokens;
                synced.tokens = available.checked_add(1).unwrap_or_else(|| overflow(n, available));
                return;
            }
            if synced.tokens == 0 {
                let wakeup = synced.waiters.pop_front(ptr::null_mut());
                drop(synced);
                if let Some(wakeup) = wakeup {
                    wakeup.deliver();
                }
                return;
            }
            // Tokens a panicking wake left counted while waiters slept ride
            // along: several wakes, so the scope below.
        }
        // Found in review: `release(2)` whose first wake unwound a fiber,
        // whose destructor acquired here, waited for the second token,
        // still in this frame. In the scope the unwind waits until every
        // token is placed.
        spindle_fiber::defer_releases(|| self.release_each(n));
    }

    /// `release`, one waiter per lock hold.
    fn release_each(&self, n: usize) {
        /// The tokens not handed out yet: counted as available if a wake
        /// unwinds.
        struct Rest<'a> {
            sem: &'a Semaphore,
            left: usize,
        }
        impl Drop for Rest<'_> {
            fn drop(&mut self) {
                if self.left > 0 {
                    let mut synced = self.sem.synced.lock();
                    synced.tokens = synced.tokens.saturating_add(self.left);
                }
            }
        }
        let mut rest = Rest { sem: self, left: n };
        while rest.left > 0 {
            let mut synced = self.synced.lock();
            match synced.waiters.pop_front(ptr::null_mut()) {
                Some(wakeup) => {
                    // Tokens counted while waiters slept (left by a wake
                    // that panicked) go to the waiters too.
                    if synced.tokens > 0 {
                        rest.left = rest.left.saturating_add(std::mem::take(&mut synced.tokens));
                    }
                    drop(synced);
                    // Handed to that waiter, whatever its wake does (a
                    // refused one gives it on: `Synced::give_back`).
                    rest.left -= 1;
                    wakeup.deliver();
                }
                None => {
                    let left = std::mem::take(&mut rest.left);
                    // Checked in every build: a wrapped count would hand
                    // out tokens that were never released.
                    let available = synced.tokens;
                    synced.tokens = available.checked_add(left).unwrap_or_else(|| overflow(n, available));
                    return;
                }
            }
        }
    }

    /// Tokens available now.
    pub fn available(&self) -> usize {
        self.synced.lock().tokens
    }

    /// Fibers and threads waiting now.
    pub fn waiters(&self) -> usize {
        self.synced.lock().waiters.len()
    }
}

/// `Semaphore::release(n)` would wrap the count of `available` tokens.
#[cold]
#[track_caller]
fn overflow(n: usize, available: usize) -> ! {
    panic!(
        "spindle-sync: Semaphore::release({n}) overflows the token count ({available} available): release \
         only tokens that were acquired"
    )
}

impl Default for Semaphore {
    fn default() -> Semaphore {
        Semaphore::new(0)
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One look under the lock, then format without it: the formatter's
        // writer is the caller's code, which may use this semaphore.
        let (tokens, waiters) = {
            let s = self.synced.lock();
            (s.tokens, s.waiters.len())
        };
        f.debug_struct("Semaphore").field("tokens", &tokens).field("waiters", &waiters).finish()
    }
}

impl Drop for Semaphore {
    fn drop(&mut self) {
        // A waiter borrows the semaphore for as long as it waits, so none
        // is left here, except a fiber suspended inside the `with` of a
        // thread-local semaphore that its thread's exit drops (DESIGN.md,
        // "Known gaps"): it is never woken, and said so.
        let waiters = self.synced.get_mut().waiters.len();
        if waiters > 0 {
            warn!(
                "spindle-sync: a semaphore was dropped with {waiters} waiter(s) (a thread-local \
                 semaphore whose thread exited while a fiber slept in it); they are never woken"
            );
        }
    }
}
