//! A mutual-exclusion lock for fibers and threads.

use std::cell::UnsafeCell;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use spindle_fiber::WaitReason;

use crate::wait::{refuse_in_fiber, thread_deadline, wait, Interrupted, WaitList, Wakeup};

static WAIT_REASON: WaitReason = WaitReason("a mutex");

/// A mutual-exclusion lock whose waiters are fibers (which sleep and are
/// pushed back on their run queue when the lock is handed to them) or
/// ordinary threads (which park).
///
/// It waits as a [`Semaphore`](crate::Semaphore) does (the same wait
/// list, the same wake, no allocation), behind a state word that locks
/// and unlocks with one atomic instruction each while nobody waits.
/// Unlike `std::sync::Mutex`, a fiber that waits for it gives up its
/// thread to other fibers instead of blocking it, and a guard may be held
/// across a suspension (a yield, a sleep, another wait): a `std` mutex
/// held there blocks every other fiber of the thread that wants it, for
/// good if the holder can only be resumed by that same thread.
///
/// * **Fair.** Waiters get the lock in FIFO order, fibers and threads
///   alike: unlocking hands the lock to the first waiter directly, so a
///   fiber that locks again at once cannot take it back first.
/// * **Not poisoned.** A panic while the lock is held unlocks it as the
///   guard is dropped by the unwind, and the next holder sees whatever
///   the panicking code left (as with `parking_lot` and tokio, unlike
///   `std`). Keep the value consistent at every point that can panic, or
///   catch the panic while holding the guard.
/// * **Not reentrant.** A fiber or thread that locks a mutex it holds
///   waits for itself for ever.
/// * **Dropped fibers.** A fiber that cannot sleep (its stack is being
///   unwound after its last handle was dropped:
///   [`may_sleep`](spindle_fiber::may_sleep) is false) waits like a
///   thread in [`lock`](Mutex::lock), blocking the dropping thread until
///   the lock is free; [`lock_interruptible`](Mutex::lock_interruptible)
///   does not wait there. A waiting fiber handed the lock and then
///   leaked instead of unwound (a pinned fiber whose last handle is
///   dropped on another thread, see `spindle_fiber`) takes the lock with
///   it: the mutex stays locked, as a semaphore keeps such a token.
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// use std::sync::Arc;
/// use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority};
/// use spindle_run_queue::RunQueue;
/// use spindle_sync::Mutex;
///
/// let log = Arc::new(Mutex::new(Vec::new()));
/// let queue = RunQueue::new(4);
/// for name in ["a", "b"] {
///     let log = log.clone();
///     let fiber = Fiber::new(FiberAttr::new()).unwrap();
///     fiber.set_function(Priority::NORMAL, move || {
///         let mut entries = log.lock();
///         entries.push(format!("{name} 1"));
///         yield_now(); // still holding the lock: the other fiber waits
///         entries.push(format!("{name} 2"));
///     }).unwrap();
///     queue.try_push(fiber).unwrap();
/// }
/// while queue.run_next().is_some() {}
/// assert_eq!(*log.lock(), ["a 1", "a 2", "b 1", "b 2"]);
/// ```
pub struct Mutex<T: ?Sized> {
    /// [`LOCKED`] and [`WAITERS`] bits.
    state: AtomicUsize,
    waiters: parking_lot::Mutex<Waiters>,
    value: UnsafeCell<T>,
}

/// The state word's bit: held.
const LOCKED: usize = 1;
/// The state word's bit: a waiter is linked, or about to be (set under the
/// waiters' lock): an unlock must take the slow path and hand the lock on.
/// May be left set with nobody linked (a waiter interrupted); the next
/// unlock clears it.
const WAITERS: usize = 2;

/// Lock-guarded state: fibers and threads waiting for the lock, FIFO.
struct Waiters {
    list: WaitList,
}

impl Drop for Waiters {
    fn drop(&mut self) {
        // Dropped with the mutex. A waiter borrows the mutex for as long as
        // it waits, so none is left here, except a fiber suspended inside
        // the `with` of a thread-local mutex that its thread's exit drops
        // (DESIGN.md, "Known gaps"): it is never woken, and said so, as
        // the semaphore and the channel do (found in review). Here rather
        // than on `Mutex`, whose `into_inner` moves the value out.
        let waiters = self.list.len();
        if waiters > 0 {
            warn!(
                "spindle-sync: a mutex was dropped with {waiters} waiter(s) (a thread-local mutex \
                 whose thread exited while a fiber slept in it); they are never woken"
            );
        }
    }
}

/// Under the waiters' lock: takes the lock if it is free, else sets
/// [`WAITERS`] (locker step 2). One compare-and-swap decides between the
/// two against an unlock's fast path (which succeeds only from exactly
/// [`LOCKED`]): either the unlock comes first and this takes the lock, or
/// the bit is set first and the unlock takes the slow path, which needs
/// the waiters' lock, held here until the waiter is linked.
fn take_or_mark(state: &AtomicUsize) -> bool {
    let mut s = state.load(Ordering::Relaxed);
    loop {
        let new = if s & LOCKED == 0 {
            s | LOCKED
        } else if s & WAITERS == 0 {
            s | WAITERS
        } else {
            // Held, waiters marked already: the unlock's fast path cannot
            // succeed (the word is not exactly LOCKED), so it takes the
            // slow path, as above.
            return false;
        };
        match state.compare_exchange_weak(s, new, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => return s & LOCKED == 0,
            Err(now) => s = now,
        }
    }
}

/// Under the waiters' lock, for the holder (or for a woken waiter that
/// will not take the lock: `give_back`): hands the lock to the first
/// waiter, which then holds it (the state stays [`LOCKED`], so nobody can
/// take it in between), or unlocks. Unlocker step 2.
fn hand_on(w: &mut Waiters, state: &AtomicUsize) -> Option<Wakeup> {
    // The state word's address goes with the lock, for `give_back`.
    match w.list.pop_front(state as *const AtomicUsize as *mut ()) {
        Some(wake) => {
            if w.list.is_empty() {
                // Nobody else may change the word meanwhile: lockers need
                // the waiters' lock to set a bit, the fast paths need 0
                // (lock) or exactly LOCKED (unlock, the holder's own).
                state.store(LOCKED, Ordering::Relaxed);
            }
            Some(wake)
        }
        None => {
            // Release: what the holder wrote is seen by the next locker.
            state.store(0, Ordering::Release);
            None
        }
    }
}

/// A woken waiter that will not take the lock (dropped before it ran
/// again, or refused by its scheduler) gives it back: to the next waiter,
/// or unlocked.
fn give_back(w: &mut Waiters, value: *mut ()) -> Option<Wakeup> {
    // SAFETY: `value` is the state word's address `hand_on` handed over;
    // the mutex is alive and in place, borrowed by the frame that waits
    // for it (this runs in that frame's unwind, or while it is suspended
    // there: the wait hook).
    let state = unsafe { &*(value as *const AtomicUsize) };
    hand_on(w, state)
}

// SAFETY: the mutex gives out `&mut T` to one holder at a time, on any
// thread: `T` must be `Send` (as for `std::sync::Mutex`), never `Sync`.
unsafe impl<T: ?Sized + Send> Send for Mutex<T> {}
// SAFETY: as above.
unsafe impl<T: ?Sized + Send> Sync for Mutex<T> {}

impl<T> Mutex<T> {
    /// An unlocked mutex holding `value`.
    pub const fn new(value: T) -> Mutex<T> {
        Mutex {
            state: AtomicUsize::new(0),
            waiters: parking_lot::Mutex::new(Waiters { list: WaitList::new() }),
            value: UnsafeCell::new(value),
        }
    }

    /// The value, taken out of the mutex.
    pub fn into_inner(self) -> T {
        self.value.into_inner()
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Locks the mutex, waiting until it is free: a fiber sleeps, a thread
    /// parks. Unlocked when the guard is dropped.
    #[track_caller]
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        // Locker step 1: free and nobody waiting.
        if self.state.compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_err() {
            let _ = self.lock_slow::<false>(None);
        }
        MutexGuard { mutex: self }
    }

    /// Locker steps 2 and 3: under the waiters' lock, takes the lock or
    /// marks [`WAITERS`], then waits to be handed the lock
    /// (DESIGN.md, "Mutex").
    #[cold]
    #[track_caller]
    fn lock_slow<const INTERRUPTIBLE: bool>(&self, deadline: Option<Instant>) -> Result<(), Interrupted> {
        let w = self.waiters.lock();
        if take_or_mark(&self.state) {
            return Ok(());
        }
        wait::<_, INTERRUPTIBLE>(
            w,
            |w| &mut w.list,
            give_back,
            // A waiter whose hand-over was taken back and that runs anyway
            // starts over (the wait protocol's revoked case).
            |_| take_or_mark(&self.state).then_some(ptr::null_mut()),
            None,
            &WAIT_REASON,
            deadline,
        )
        .map(drop)
    }

    /// Unlocks: hands the lock to the first waiter if there is one.
    #[inline]
    fn unlock(&self) {
        // Unlocker step 1: nobody waiting. Release: what the holder wrote
        // is seen by the next locker.
        if self.state.compare_exchange(LOCKED, 0, Ordering::Release, Ordering::Relaxed).is_err() {
            self.unlock_slow();
        }
    }

    #[cold]
    fn unlock_slow(&self) {
        let mut w = self.waiters.lock();
        let wake = hand_on(&mut w, &self.state);
        drop(w);
        // Unlocker step 3, after the lock is released.
        if let Some(wake) = wake {
            wake.deliver();
        }
    }

    /// Like [`lock`](Mutex::lock), but a fiber's wait ends early if the
    /// fiber is interrupted ([`Fiber::interrupt`], [`Waiter::interrupt`]; in
    /// `spindle-executor`, a cancel or an `interrupt_after` deadline), as
    /// [`Semaphore::acquire_interruptible`](crate::Semaphore::acquire_interruptible) does. A thread waits as in
    /// `lock`. A free lock is taken even with an interrupt pending (the
    /// interrupt stays for the next interruptible wait). In
    /// `spindle-executor`, a cancelled fiber gets `Err(Interrupted)` here
    /// and unwinds only at its next cancellation point (`yield_now`,
    /// `sleep`, `join`, ...): a function that returns right after this
    /// wait returns normally, and its join says so.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
    /// use spindle_sync::{Interrupted, Mutex};
    ///
    /// let mutex = Arc::new(Mutex::new(0));
    /// let held = mutex.lock();
    /// let fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// let m = mutex.clone();
    /// fiber.set_function(Priority::NORMAL, move || m.lock_interruptible().is_err()).unwrap();
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
    /// fiber.interrupt(); // e.g. a timeout
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(true))));
    /// drop(held);
    /// ```
    ///
    /// # Errors
    ///
    /// [`Interrupted`] if the fiber was interrupted before it got the
    /// lock, or, with the lock held, at once in a fiber being dropped.
    ///
    /// [`Fiber::interrupt`]: spindle_fiber::Fiber::interrupt
    /// [`Waiter::interrupt`]: spindle_fiber::Waiter::interrupt
    #[track_caller]
    #[inline]
    pub fn lock_interruptible(&self) -> Result<MutexGuard<'_, T>, Interrupted> {
        if self.state.compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_slow::<true>(None)?;
        }
        Ok(MutexGuard { mutex: self })
    }

    /// Like [`lock`](Mutex::lock), for a thread that waits at most
    /// `timeout`: `None` if the lock did not come by then. A lock handed to
    /// it as the timeout passes is still taken. A duration too long to add
    /// to the current time waits as `lock` does.
    ///
    /// ```
    /// use spindle_sync::Mutex;
    /// use std::time::Duration;
    ///
    /// let mutex = Mutex::new(0);
    /// let guard = mutex.lock();
    /// std::thread::scope(|s| {
    ///     s.spawn(|| assert!(mutex.lock_timeout(Duration::from_millis(10)).is_none()));
    /// });
    /// drop(guard);
    /// assert!(mutex.lock_timeout(Duration::from_millis(10)).is_some());
    /// ```
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep), as
    /// [`Semaphore::acquire_timeout`](crate::Semaphore::acquire_timeout)
    /// does: a fiber uses [`lock_interruptible`](Mutex::lock_interruptible)
    /// under its scheduler's deadline.
    #[track_caller]
    #[must_use = "the wait may time out, and the lock is released when the guard is dropped"]
    pub fn lock_timeout(&self, timeout: Duration) -> Option<MutexGuard<'_, T>> {
        let deadline = thread_deadline(timeout, "Mutex::lock_timeout");
        if self.state.compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_err()
            && self.lock_slow::<false>(deadline).is_err()
        {
            return None;
        }
        Some(MutexGuard { mutex: self })
    }

    /// Like [`lock_timeout`](Mutex::lock_timeout), with a deadline instead
    /// of a duration: `None` if the lock did not come by `deadline`. A
    /// deadline already past still takes a lock that is free now.
    ///
    /// ```
    /// use spindle_sync::Mutex;
    /// use std::time::{Duration, Instant};
    ///
    /// let mutex = Mutex::new(0);
    /// let guard = mutex.lock();
    /// std::thread::scope(|s| {
    ///     s.spawn(|| assert!(mutex.lock_until(Instant::now() + Duration::from_millis(10)).is_none()));
    /// });
    /// drop(guard);
    /// assert!(mutex.lock_until(Instant::now()).is_some());
    /// ```
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep), as
    /// [`lock_timeout`](Mutex::lock_timeout).
    #[track_caller]
    #[must_use = "the wait may time out, and the lock is released when the guard is dropped"]
    pub fn lock_until(&self, deadline: Instant) -> Option<MutexGuard<'_, T>> {
        refuse_in_fiber("Mutex::lock_until");
        if self.state.compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_err()
            && self.lock_slow::<false>(Some(deadline)).is_err()
        {
            return None;
        }
        Some(MutexGuard { mutex: self })
    }

    /// Locks the mutex if it is free now (and nobody waits for it).
    ///
    /// ```
    /// use spindle_sync::Mutex;
    ///
    /// let mutex = Mutex::new(1);
    /// let guard = mutex.try_lock().unwrap();
    /// assert!(mutex.try_lock().is_none());
    /// assert!(mutex.is_locked(), "a failed try_lock leaves the holder's lock alone");
    /// drop(guard);
    /// assert_eq!(*mutex.try_lock().unwrap(), 1);
    /// ```
    #[must_use = "try_lock may fail, and the lock is released when the guard is dropped"]
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        // `then`, not `then_some`: a guard built for a failed attempt would
        // be dropped at once, and its drop would unlock the holder's lock
        // (found in review).
        self.state
            .compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then(|| MutexGuard { mutex: self })
    }

    /// The value, through `&mut` (no lock needed: nobody else can hold
    /// it).
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    /// Whether the mutex is locked now (a snapshot).
    pub fn is_locked(&self) -> bool {
        self.state.load(Ordering::Relaxed) & LOCKED != 0
    }

    /// How many fibers and threads wait for the lock now (a snapshot).
    pub fn waiters(&self) -> usize {
        self.waiters.lock().list.len()
    }
}

impl<T: Default> Default for Mutex<T> {
    fn default() -> Mutex<T> {
        Mutex::new(T::default())
    }
}

impl<T> From<T> for Mutex<T> {
    fn from(value: T) -> Mutex<T> {
        Mutex::new(value)
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Mutex");
        match self.try_lock() {
            Some(guard) => d.field("value", &&*guard),
            None => d.field("value", &format_args!("<locked>")),
        };
        d.field("waiters", &self.waiters()).finish()
    }
}

/// The lock on a [`Mutex`], held until dropped; gives access to the value.
///
/// It may be held across a suspension of the fiber, and sent to another
/// thread when `T` is `Send + Sync`: unlocking from another thread is
/// fine (the lock is a bit in a word, not a thread's). A guard of a
/// `!Send` value cannot move:
///
/// ```compile_fail,E0277
/// fn assert_send<T: Send>() {}
/// assert_send::<spindle_sync::MutexGuard<'static, std::rc::Rc<u8>>>();
/// ```
#[must_use = "if unused the Mutex will immediately unlock"]
pub struct MutexGuard<'a, T: ?Sized> {
    mutex: &'a Mutex<T>,
}

// SAFETY: the guard gives out `&T` through `&MutexGuard`.
unsafe impl<T: ?Sized + Sync> Sync for MutexGuard<'_, T> {}
// SAFETY: moving the guard moves the `&mut T` it gives out (`T: Send`) and
// its `&T` (`T: Sync`, as `&MutexGuard` does); the unlock itself may
// happen on any thread.
unsafe impl<T: ?Sized + Send + Sync> Send for MutexGuard<'_, T> {}

impl<T: ?Sized> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock: no other guard exists, and `&self` keeps `&mut` access out of reach meanwhile.
        unsafe { &*self.mutex.value.get() }
    }
}

impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, with `&mut self`.
        unsafe { &mut *self.mutex.value.get() }
    }
}

impl<T: ?Sized> Drop for MutexGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.mutex.unlock();
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for MutexGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl<T: ?Sized + fmt::Display> fmt::Display for MutexGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&**self, f)
    }
}
