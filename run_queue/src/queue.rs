//! The run queue proper.
//!
//! # Parking protocol (no lost wakeups)
//!
//! Poppers that find the queue empty may park in [`RunQueue::pop`] or
//! [`RunQueue::pop_timeout`].
//! All queue state, including the count of parked poppers, lives in
//! [`Synced`] behind one mutex.
//!
//! Popper:
//! 1. lock; pop if non-empty, unlock, done;
//! 2. else, if the queue is closed, unlock and return `None`;
//! 3. else increment `sleepers`, wait on the condvar (which releases the
//!    lock atomically with going to sleep), decrement `sleepers` on waking,
//!    go to 1 until the deadline.
//!
//! Pusher:
//! 1. lock; insert; read `sleepers`; unlock;
//! 2. if `sleepers > 0` and the fiber is not pinned to this thread
//!    (`Fiber::is_pinned_here`), notify one. (No parked popper may run a
//!    fiber pinned to the pusher, and the pusher is not parked, so the
//!    skipped notify loses no wakeup.)
//!
//! A push either happens before the popper's step 1 (the popper sees the
//! fiber) or after its step 3 registered it (the pusher sees `sleepers > 0`
//! and notifies, if the popper may run the fiber). Both read and write `sleepers` under the lock, so there is
//! no third order.
//!
//! Closer ([`RunQueue::close`]):
//! 1. lock; set `closed`; unlock;
//! 2. notify every parked popper.
//!
//! A popper either reads `closed` at its step 2 (and returns) or registered
//! at its step 3 before the closer's step 1 took the lock, and is then
//! woken by step 2, goes round to its step 2 and returns. `closed` is only
//! read and written under the lock, and never cleared.
//!
//! A pop hands out only fibers the popping thread may run; one pinned to
//! another thread is set aside for it (under the lock), and the popper then
//! notifies every parked popper, so that its thread, if parked, wakes and
//! takes it (step 1 weighs the fibers set aside for its thread against the
//! levels, by priority).
//!
//! `run_queue/tests/loom.rs` model-checks this file's code under loom: the
//! `sync` module at the end swaps parking_lot for loom's mutex and condvar when
//! built with `--cfg loom` (loom cannot see parking_lot).

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spindle_fiber::{Fiber, FiberError, Priority, RunOutcome, Schedule, Woken};

use self::sync::{Condvar, Mutex, MutexGuard};

/// How many times an idle popper polls before parking: waking a parked
/// thread costs tens of microseconds, a short spin catches most handoffs.
/// (Two under loom: one of each kind of poll is enough for the model.)
const SPINS: u32 = if cfg!(loom) { 2 } else { 64 };

/// One FIFO per priority level and a 256-bit map of the non-empty levels:
/// push and pop are O(1) (a bit scan finds the highest level), FIFO among
/// equal priorities holds by construction, and nothing is hashed.
struct Levels<T> {
    fifos: Box<[VecDeque<Fiber<T>>]>,
    /// Bit `p` is set when level `p` is non-empty.
    occupied: [u64; 4],
    len: usize,
}

impl<T> Levels<T> {
    fn new() -> Levels<T> {
        Levels { fifos: (0..256).map(|_| VecDeque::new()).collect(), occupied: [0; 4], len: 0 }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, fiber: Fiber<T>, level: Priority) {
        let p = level.0 as usize;
        self.fifos[p].push_back(fiber);
        self.occupied[p / 64] |= 1 << (p % 64);
        self.len += 1;
    }

    /// The highest non-empty level.
    fn top(&self) -> Option<Priority> {
        let word = (0..4).rev().find(|&w| self.occupied[w] != 0)?;
        Some(Priority((word * 64 + (63 - self.occupied[word].leading_zeros() as usize)) as u8))
    }

    /// The front of `level`, which `top` found non-empty.
    fn pop_at(&mut self, level: Priority) -> Fiber<T> {
        let p = level.0 as usize;
        let fiber = self.fifos[p].pop_front().expect("an occupied level holds a fiber");
        if self.fifos[p].is_empty() {
            self.occupied[p / 64] &= !(1 << (p % 64));
        }
        self.len -= 1;
        fiber
    }

    /// Moves a queued fiber to the back of `level`; `false` if it is not
    /// here. Scans the occupied levels: priority changes are rare.
    fn change_priority(&mut self, fiber: &Fiber<T>, level: Priority) -> bool {
        for p in 0..256 {
            if self.occupied[p / 64] & (1 << (p % 64)) == 0 {
                continue;
            }
            if let Some(i) = self.fifos[p].iter().position(|f| Fiber::ptr_eq(f, fiber)) {
                let f = self.fifos[p].remove(i).expect("found above");
                if self.fifos[p].is_empty() {
                    self.occupied[p / 64] &= !(1 << (p % 64));
                }
                self.len -= 1;
                self.push(f, level);
                return true;
            }
        }
        false
    }
}

/// Everything guarded by the queue's mutex.
struct Synced<T> {
    heap: Levels<T>,
    /// Fibers (`Queued`) pinned to a thread other than the one that popped
    /// them, oldest first: only their own thread takes them. Usually empty.
    /// Each with the level it was queued at: a set-aside fiber keeps its
    /// place as a fiber in the levels does, whatever `Fiber::set_priority`
    /// does meanwhile (that takes effect at its next push).
    elsewhere: Vec<(Fiber<T>, Priority)>,
    /// Poppers parked on the condvar.
    sleepers: usize,
    /// Set by `RunQueue::close`, never cleared: poppers no longer wait,
    /// and `try_push` refuses.
    closed: bool,
    /// Counters: plain fields, since every operation holds the lock anyway.
    stats: RunQueueStats,
}

impl<T> Synced<T> {
    /// Fibers in the queue, including those set aside for their threads.
    fn len(&self) -> usize {
        self.heap.len() + self.elsewhere.len()
    }

    /// Pops, under the lock, the next fiber the calling thread may run
    /// (`Fiber::may_run_here`): one set aside for this thread first, then
    /// the highest priority. A fiber pinned to another thread met on the
    /// way is set aside for it instead of being handed out (its `run` would
    /// be refused), and the second value says so: the caller then wakes
    /// every parked popper, since one of them may be its thread. `None`:
    /// nothing here for this thread. Counts, and refreshes the length hint.
    fn pop(&mut self, len_hint: &AtomicUsize, count_empty: bool) -> (Option<Fiber<T>>, bool) {
        let mut set_aside = false;
        // The highest-priority fiber set aside for this thread (the oldest
        // among equals), if any: usually there is none to look at.
        let mut mine: Option<(usize, Priority)> = None;
        for (i, (f, p)) in self.elsewhere.iter().enumerate() {
            let p = *p;
            if mine.map_or(true, |(_, best)| p > best) && f.may_run_here() {
                mine = Some((i, p));
            }
        }
        let found = loop {
            match (mine, self.heap.top()) {
                // Set aside before the heap's fibers of its level: older.
                (Some((i, p)), top) if top.map_or(true, |t| t <= p) => {
                    break Some(self.elsewhere.remove(i).0)
                }
                (_, None) => break None,
                (_, Some(level)) => {
                    let f = self.heap.pop_at(level);
                    if f.may_run_here() {
                        break Some(f);
                    }
                    self.stats.wrong_thread += 1;
                    self.elsewhere.push((f, level));
                    set_aside = true;
                }
            }
        };
        match found {
            Some(_) => self.stats.pops += 1,
            None if count_empty => self.stats.empty_pops += 1,
            None => {}
        }
        len_hint.store(self.len(), Ordering::Relaxed);
        (found, set_aside)
    }
}

struct Shared<T> {
    /// `RunQueue` handles alive. Fibers point back here (their home), so
    /// the queue's memory outlives the handles; when the last handle goes,
    /// queued fibers are released and later wakes are refused.
    handles: AtomicUsize,
    capacity: usize,
    synced: Mutex<Synced<T>>,
    not_empty: Condvar,
    /// The queue's length as of the last push or pop, written under the
    /// lock: lets idle pollers skip the lock while the queue is empty. Only
    /// a hint; every decision to sleep re-checks under the lock.
    len_hint: AtomicUsize,
}

/// A snapshot of a run queue's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunQueueStats {
    /// Fibers pushed (by `try_push`, re-queued yields and wakes, and
    /// fibers `run_popped` sends back for their own thread): `pushes -
    /// pops` is the queue's length.
    pub pushes: u64,
    /// Fibers popped.
    pub pops: u64,
    /// Pops that found nothing the popping thread may run (usually: the
    /// queue was empty).
    pub empty_pops: u64,
    /// `try_push` calls refused because the queue was full.
    pub full_pushes: u64,
    /// Fibers pushed back by a wake from a synchronisation primitive.
    pub wakes: u64,
    /// Times a popper parked its thread.
    pub parks: u64,
    /// Times a fiber pinned to another thread met a pop that set it aside
    /// for its own thread, or [`RunQueue::run_popped`] on the wrong thread
    /// (which sends it back into the queue).
    pub wrong_thread: u64,
}

/// Why [`RunQueue::try_push`] refused a fiber. The fiber is handed back.
#[non_exhaustive]
pub enum PushError<T> {
    /// The queue holds `capacity` fibers already.
    Full(Fiber<T>),
    /// The fiber is not runnable (running, already queued, asleep, finished
    /// or without a function).
    NotReady(Fiber<T>, FiberError),
    /// The queue was closed ([`RunQueue::close`]): its workers may have
    /// stopped popping, so a new fiber could wait there for ever.
    Closed(Fiber<T>),
}

impl<T> PushError<T> {
    /// The fiber that was not pushed.
    pub fn into_fiber(self) -> Fiber<T> {
        match self {
            PushError::Full(f) | PushError::NotReady(f, _) | PushError::Closed(f) => f,
        }
    }
}

impl<T> fmt::Debug for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PushError::Full(fiber) => f.debug_tuple("Full").field(&fiber.id()).finish(),
            PushError::NotReady(fiber, e) => f.debug_tuple("NotReady").field(&fiber.id()).field(e).finish(),
            PushError::Closed(fiber) => f.debug_tuple("Closed").field(&fiber.id()).finish(),
        }
    }
}

impl<T> fmt::Display for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PushError::Full(fiber) => write!(
                f,
                "run queue is full: fiber {} was handed back; pop fibers first or create the queue \
                 with a larger capacity",
                fiber.id()
            ),
            PushError::Closed(fiber) => write!(
                f,
                "run queue is closed: fiber {} was handed back; its workers may have stopped, so \
                 run it yourself or push it onto a queue that is still open",
                fiber.id()
            ),
            // A fiber's own message for `Queued` is about running it.
            PushError::NotReady(fiber, FiberError::Queued(_)) => write!(
                f,
                "fiber {} cannot be queued: it is in a queue already (a fiber is in one queue at a \
                 time): pop it from that queue first",
                fiber.id()
            ),
            // The fiber's own messages for these speak of running it.
            PushError::NotReady(fiber, FiberError::Finished(_)) => write!(
                f,
                "fiber {} cannot be queued: its function is over (it returned or panicked): call \
                 set_function to give it a new one first",
                fiber.id()
            ),
            PushError::NotReady(fiber, FiberError::Running(_)) => write!(
                f,
                "fiber {} cannot be queued: it is running (on another thread, or it is the caller \
                 or a fiber that runs the caller), or is held for a moment by a wake being finished \
                 for it: push it once it has suspended (or again); a fiber that wants to go back \
                 into its queue yields, and its runner requeues it",
                fiber.id()
            ),
            PushError::NotReady(fiber, FiberError::Sleeping(_)) => write!(
                f,
                "fiber {} cannot be queued: it is asleep on a synchronisation primitive, and the \
                 wake hands it to its home scheduler (or leaves it ready if it has none): push it \
                 only after that",
                fiber.id()
            ),
            // The fiber's own message names it already.
            PushError::NotReady(_, e) => write!(f, "cannot be queued: {e}"),
        }
    }
}

/// The message of [`NotReady`](PushError::NotReady) says why the fiber
/// cannot be queued (in its own words for a queued, finished, running or
/// sleeping fiber, else with the fiber's error), so `source()` is `None`
/// (a reporter that walks the chain would print it twice).
impl<T> std::error::Error for PushError<T> {}

/// A fiber taken from the queue and run by [`RunQueue::run_next`].
#[derive(Debug)]
pub struct Ran<T> {
    /// The fiber (already back in the queue if it yielded, unless another
    /// handle queued it somewhere meanwhile).
    pub fiber: Fiber<T>,
    /// What running it returned (`Fiber::run_mut`).
    pub outcome: Result<RunOutcome<T>, FiberError>,
}

/// A thread-safe priority queue of fibers, bounded at creation.
///
/// Cloning gives another handle to the same queue. Fibers pushed here are
/// woken back here by `spindle-sync` primitives.
///
/// The last handle releases the fibers still queued. A handle held by a
/// queued fiber's function (to push more fibers, say) counts too: once
/// every other handle is gone, the queue and that fiber keep each other
/// alive, as an `Arc` cycle does, and nothing is released. Let such fibers
/// finish, or have them drop their handle.
pub struct RunQueue<T = ()> {
    shared: Arc<Shared<T>>,
    /// The same allocation as `shared`, as the fiber's wake seam.
    home: Arc<dyn Schedule<T>>,
}

impl<T: Send + 'static> RunQueue<T> {
    /// A queue that accepts up to `capacity` fibers from
    /// [`try_push`](RunQueue::try_push). Each priority level's FIFO grows
    /// on first use and keeps its capacity, so in a steady state pushes and
    /// pops do not allocate.
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> RunQueue<T> {
        assert!(capacity > 0, "a run queue needs a capacity of at least 1");
        let shared = Arc::new(Shared {
            handles: AtomicUsize::new(1),
            capacity,
            synced: Mutex::new(Synced {
                heap: Levels::new(),
                elsewhere: Vec::new(),
                sleepers: 0,
                closed: false,
                stats: RunQueueStats::default(),
            }),
            not_empty: Condvar::new(),
            len_hint: AtomicUsize::new(0),
        });
        let home: Arc<dyn Schedule<T>> = shared.clone();
        RunQueue { shared, home }
    }

    /// Pushes a runnable fiber; it is popped by priority, FIFO among equals.
    ///
    /// # Errors
    ///
    /// The fiber comes back in the error, untouched: nothing is lost.
    /// [`PushError::Full`] if the queue holds [`capacity`](RunQueue::capacity)
    /// fibers; [`PushError::NotReady`] (with the fiber's own error) if it is
    /// not runnable: running, already queued, asleep, finished, or without a
    /// function; [`PushError::Closed`] once the queue is
    /// [closed](RunQueue::close).
    pub fn try_push(&self, mut fiber: Fiber<T>) -> Result<(), PushError<T>> {
        let mut synced = self.shared.synced.lock();
        if synced.closed {
            drop(synced);
            return Err(PushError::Closed(fiber));
        }
        if synced.len() >= self.shared.capacity {
            // A fiber that could not be queued anyway says why, rather than
            // sending its caller to make room for it.
            if let Err(e) = fiber.check_ready() {
                drop(synced);
                return Err(PushError::NotReady(fiber, e));
            }
            synced.stats.full_pushes += 1;
            drop(synced);
            return Err(PushError::Full(fiber));
        }
        // Under the lock, so a fiber refused as full is never re-homed here.
        // Taken by value: usually its only handle, and then the transition
        // is a plain store, not a compare-and-swap.
        let replaced = match fiber.mark_queued_mut(Some(&self.home)) {
            Ok(replaced) => replaced,
            Err(e) => {
                drop(synced);
                return Err(PushError::NotReady(fiber, e));
            }
        };
        self.shared.insert(synced, fiber);
        // The fiber's previous home, if this was its last reference, is
        // dropped after the lock: its drop may use this queue.
        drop(replaced);
        Ok(())
    }

    /// Pops the highest-priority fiber the calling thread may run, or
    /// `None` if there is none. A fiber pinned to another thread (see
    /// [`Fiber::may_run_here`]) is left in the queue for that thread.
    pub fn try_pop(&self) -> Option<Fiber<T>> {
        let popped = self.shared.synced.lock().pop(&self.shared.len_hint, true);
        self.shared.finish_pop(popped)
    }

    /// Pops the highest-priority fiber the calling thread may run, waiting
    /// for one as long as it takes; `None` once the queue is
    /// [closed](RunQueue::close) and holds nothing this thread may run.
    /// This is the loop of a worker thread:
    ///
    /// ```
    /// use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome};
    /// use spindle_run_queue::RunQueue;
    ///
    /// let queue = RunQueue::new(16);
    /// let worker = std::thread::spawn({
    ///     let queue = queue.clone();
    ///     move || {
    ///         let mut returned = 0;
    ///         // Ends when the queue is closed and empty.
    ///         while let Some(fiber) = queue.pop() {
    ///             if let Ok(RunOutcome::Returned(())) = queue.run_popped(fiber).outcome {
    ///                 returned += 1;
    ///             }
    ///         }
    ///         returned
    ///     }
    /// });
    /// let fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// let (tx, rx) = std::sync::mpsc::channel();
    /// fiber.set_function(Priority::NORMAL, move || { yield_now(); tx.send(()).unwrap() }).unwrap();
    /// queue.try_push(fiber).unwrap();
    /// rx.recv().unwrap(); // the fiber's work is done
    /// queue.close();
    /// assert_eq!(worker.join().unwrap(), 1);
    /// ```
    ///
    /// Close the queue only once no fiber can come back to it: a fiber
    /// still running, or asleep on a primitive, returns here when it
    /// yields or is woken, and a worker that has stopped will not run it.
    /// (In the example the send is the fiber's last step: nothing after it
    /// suspends, so once the main thread has received, the fiber can only
    /// return.)
    pub fn pop(&self) -> Option<Fiber<T>> {
        self.pop_timeout(Duration::MAX)
    }

    /// Pops the highest-priority fiber the calling thread may run, waiting
    /// up to `timeout` for one:
    /// polls briefly, then parks the thread. `None` on timeout, or at once
    /// (after the polls) if the queue is [closed](RunQueue::close) and
    /// holds nothing this thread may run. A zero
    /// timeout is [`try_pop`](RunQueue::try_pop); the polls that yield the
    /// thread stop at the deadline (one `yield_now` may outlast it on a
    /// busy machine).
    pub fn pop_timeout(&self, timeout: Duration) -> Option<Fiber<T>> {
        if timeout.is_zero() {
            return self.try_pop();
        }
        // Read the clock only once the spinning polls found nothing (a
        // popper that finds a fiber at once pays for no clock read); the
        // spins take well under a microsecond. A timeout too large to
        // represent waits without a deadline.
        let mut deadline = None;
        let mut deadline_of = || *deadline.get_or_insert_with(|| Instant::now().checked_add(timeout));
        let passed = |d: Option<Instant>| d.is_some_and(|d| Instant::now() >= d);
        for i in 0..SPINS {
            if let Some(f) = self.try_pop_quiet() {
                return Some(f);
            }
            if i < SPINS / 2 {
                std::hint::spin_loop();
            } else if passed(deadline_of()) {
                break;
            } else {
                std::thread::yield_now();
            }
        }
        let deadline = deadline_of();
        let mut synced = self.shared.synced.lock();
        loop {
            // Empty checks while waiting are not counted; the outcome is.
            let (popped, set_aside) = synced.pop(&self.shared.len_hint, false);
            if set_aside {
                self.shared.not_empty.notify_all();
            }
            if popped.is_some() {
                drop(synced);
                return self.shared.finish_pop((popped, false));
            }
            if synced.closed {
                // Popper step 2: a closed queue is not waited on.
                synced.stats.empty_pops += 1;
                return None;
            }
            if passed(deadline) {
                // Out of time before parking: no park to count.
                let popped = synced.pop(&self.shared.len_hint, true);
                drop(synced);
                return self.shared.finish_pop(popped);
            }
            synced.sleepers += 1;
            synced.stats.parks += 1;
            let timed_out = match deadline {
                Some(d) => self.shared.not_empty.wait_until(&mut synced, d).timed_out(),
                None => {
                    self.shared.not_empty.wait(&mut synced);
                    false
                }
            };
            synced.sleepers -= 1;
            if timed_out {
                let popped = synced.pop(&self.shared.len_hint, true);
                drop(synced);
                return self.shared.finish_pop(popped);
            }
        }
    }

    /// A poll by an idle popper: skips the lock while the queue looks
    /// empty, does not wait for it while someone else holds it (a pusher
    /// is likely mid-push: the next poll sees its fiber, and waiting would
    /// enter the mutex's slow path, which yields the thread), and does not
    /// count empty polls. The parking step after the polls takes the lock
    /// for real, so a fiber missed here is not missed there.
    fn try_pop_quiet(&self) -> Option<Fiber<T>> {
        if self.shared.len_hint.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut synced = self.shared.synced.try_lock()?;
        if synced.len() == 0 {
            return None;
        }
        let popped = synced.pop(&self.shared.len_hint, false);
        drop(synced);
        self.shared.finish_pop(popped)
    }

    /// Pops the next fiber and runs it on this thread until it suspends. A
    /// fiber that yielded is pushed back (behind its equals) before this
    /// returns; one that slept belongs to whatever it sleeps on. `None` if
    /// the queue held nothing this thread may run.
    #[inline]
    pub fn run_next(&self) -> Option<Ran<T>> {
        let fiber = self.try_pop()?;
        Some(self.run_popped(fiber))
    }

    /// Runs a fiber popped from this queue until it suspends, pushing it
    /// back if it yielded (see [`run_next`](RunQueue::run_next)). Pops
    /// only hand out fibers the popping thread may run; a fiber pinned to
    /// another thread that reaches this anyway (popped on one thread, run
    /// on another) is not run: it goes back into the queue, at the back of
    /// its level (its own thread takes it from there; another thread's pop
    /// sets it aside), and the outcome is [`FiberError::WrongThread`].
    ///
    /// [`FiberError::WrongThread`]: spindle_fiber::FiberError::WrongThread
    #[inline]
    pub fn run_popped(&self, mut fiber: Fiber<T>) -> Ran<T> {
        // Usually the queue held the only reference: no atomic claim.
        let outcome = fiber.run_mut();
        match outcome {
            // Refused only if another handle queued (or marked) it
            // meanwhile: it is someone else's then.
            Ok(RunOutcome::Yielded(_)) => {
                // `requeue`, with the handle still our own (usually the
                // only one): the transition needs no compare-and-swap.
                if let Ok(replaced) = fiber.mark_queued_mut(Some(&self.home)) {
                    let synced = self.shared.synced.lock();
                    self.shared.insert(synced, fiber.clone());
                    drop(replaced);
                }
            }
            Err(FiberError::WrongThread(_)) => self.wrong_thread(&fiber),
            _ => {}
        }
        Ran { fiber, outcome }
    }

    #[cold]
    fn wrong_thread(&self, fiber: &Fiber<T>) {
        if let Ok(replaced) = fiber.mark_queued(Some(&self.home)) {
            let mut synced = self.shared.synced.lock();
            synced.stats.wrong_thread += 1;
            // It enters the queue again (its pop was counted).
            synced.stats.pushes += 1;
            // Pushed again, at the back of its level: set aside, it would
            // count as older than the fibers queued there meanwhile (found
            // in review). Its own thread takes it from the levels; another
            // thread's pop sets it aside once it reaches the front.
            synced.heap.push(fiber.clone(), fiber.priority());
            self.shared.len_hint.store(synced.len(), Ordering::Relaxed);
            drop(synced);
            self.shared.not_empty.notify_all();
            drop(replaced);
        }
    }

    /// Pushes back a fiber popped from this queue that just yielded. It
    /// was admitted by a push before, so this does not check the capacity;
    /// `len()` may then exceed the capacity for a while, if pushes took the
    /// place it freed when popped. Nothing checks that the fiber came from
    /// this queue: a fiber it never admitted would pass the bound here, so
    /// bring those in with [`try_push`](RunQueue::try_push), which checks.
    ///
    /// # Errors
    ///
    /// The fiber is not `Ready` (it sleeps on a primitive, which will wake
    /// it back here; it finished; someone else queued or runs it): it is
    /// left alone, and the error says where it is.
    pub fn requeue(&self, fiber: &Fiber<T>) -> Result<(), FiberError> {
        let replaced = fiber.mark_queued(Some(&self.home))?;
        let synced = self.shared.synced.lock();
        self.shared.insert(synced, fiber.clone());
        drop(replaced);
        Ok(())
    }

    /// Changes the priority of `fiber`; if it is in this queue it moves to
    /// its new place at once, behind fibers already at that priority (one
    /// set aside for its thread too: it goes back among the others).
    pub fn set_priority(&self, fiber: &Fiber<T>, priority: Priority) {
        // Both under the lock: two calls at once would otherwise leave the
        // fiber's priority from one and its place from the other.
        let mut synced = self.shared.synced.lock();
        fiber.set_priority(priority);
        if !synced.heap.change_priority(fiber, priority) {
            // Set aside, it counts as the oldest of its level (`pop`), which
            // it no longer is at the new one. Its thread's poppers take it
            // from the levels as well; another thread's sets it aside again.
            if let Some(i) = synced.elsewhere.iter().position(|(f, _)| Fiber::ptr_eq(f, fiber)) {
                let (f, _) = synced.elsewhere.remove(i);
                synced.heap.push(f, priority);
            }
        }
        drop(synced);
    }
}

impl<T> RunQueue<T> {
    /// Closes the queue, for the end of a pool of worker threads: poppers
    /// stop waiting ([`pop`](RunQueue::pop) and
    /// [`pop_timeout`](RunQueue::pop_timeout) return `None` as soon as
    /// the queue holds nothing the popping thread may run, and every
    /// parked popper wakes to see it), and [`try_push`](RunQueue::try_push)
    /// refuses new fibers ([`PushError::Closed`]). Fibers already in it
    /// stay and can still be popped. Fibers that come back on their own
    /// are still taken in, so that nothing is lost: one that yields in
    /// [`run_popped`](RunQueue::run_popped) (or is
    /// [requeued](RunQueue::requeue)), and one woken by a primitive. A
    /// worker that keeps popping until `None` runs them, as long as they
    /// come back before it stops.
    ///
    /// Returns `true` if this call closed it, `false` if it was closed
    /// already. A queue is never reopened.
    pub fn close(&self) -> bool {
        let mut synced = self.shared.synced.lock();
        let was = std::mem::replace(&mut synced.closed, true);
        drop(synced);
        // Closer step 2: every parked popper goes round and sees it.
        self.shared.not_empty.notify_all();
        !was
    }

    /// Whether [`close`](RunQueue::close) was called.
    pub fn is_closed(&self) -> bool {
        self.shared.synced.lock().closed
    }

    /// Fibers in the queue now.
    pub fn len(&self) -> usize {
        self.shared.synced.lock().len()
    }

    /// Whether the queue is empty now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most fibers `try_push` accepts: a bound on admission. Fibers that
    /// come back (a requeue after a yield, a wake) are never refused, so
    /// `len()` may exceed it for a while (DESIGN.md, "The run queue").
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> RunQueueStats {
        self.shared.synced.lock().stats
    }
}

impl<T> Shared<T> {
    /// Inserts a fiber already marked `Queued`, then notifies a parked
    /// popper if there is one (pusher steps 1 and 2).
    fn insert(&self, mut synced: MutexGuard<'_, Synced<T>>, fiber: Fiber<T>) {
        let level = fiber.priority();
        // A fiber pinned to this thread: no parked popper may run it, and
        // this thread is not parked; waking one only makes it set the
        // fiber aside and wake every other parked popper. (Looked at only
        // when someone is parked: the common push pays nothing for it.)
        let wake = synced.sleepers > 0 && !fiber.is_pinned_here();
        synced.heap.push(fiber, level);
        synced.stats.pushes += 1;
        self.len_hint.store(synced.len(), Ordering::Relaxed);
        drop(synced);
        if wake {
            self.not_empty.notify_one();
        }
    }
}

impl<T> Shared<T> {
    /// Outside the lock: wakes every parked popper if the pop set a fiber
    /// aside for its thread (one of them may be it); the popped fiber goes
    /// from `Queued` to `Ready`. One that someone took out of `Queued` by
    /// hand while it was in the queue (`mark_dequeued` is public) is handed
    /// out as it is: running it reports its state instead of this panicking
    /// in the popper.
    fn finish_pop(&self, (mut popped, set_aside): (Option<Fiber<T>>, bool)) -> Option<Fiber<T>> {
        if set_aside {
            self.not_empty.notify_all();
        }
        // Out of the queue: usually the fiber's only handle (no compare-and-swap).
        if let Some(f) = &mut popped {
            let _ = f.mark_dequeued_mut();
        }
        popped
    }
}

impl<T: Send + 'static> Schedule<T> for Shared<T> {
    /// A woken fiber comes back. Wakes are not refused for capacity: that
    /// bounds `try_push`, and a fiber that slept was counted there before.
    /// Once every handle is gone, nobody pops this queue again: the wake
    /// is refused (the fiber ends up `Ready`, and a `spindle-sync` waker
    /// hands its token or message to the next waiter instead).
    fn schedule<'w>(&self, woken: Woken<'w, T>) -> Result<(), Woken<'w, T>> {
        let mut synced = self.synced.lock();
        if self.handles.load(Ordering::Acquire) == 0 {
            drop(synced);
            return Err(woken);
        }
        synced.stats.wakes += 1;
        self.insert(synced, woken.into_queued());
        Ok(())
    }
}

impl<T> Clone for RunQueue<T> {
    fn clone(&self) -> RunQueue<T> {
        self.shared.handles.fetch_add(1, Ordering::Relaxed);
        RunQueue { shared: Arc::clone(&self.shared), home: Arc::clone(&self.home) }
    }
}

impl<T> Drop for RunQueue<T> {
    /// The last handle releases the fibers still queued: each is abandoned
    /// ([`Fiber::abandon`]: back to `Ready`, marked refused, and a token or
    /// message a primitive handed it goes on to the next waiter) and
    /// dropped here unless someone else holds it. A
    /// fiber dropped this way, or woken later with nobody holding it,
    /// follows the fiber's own rule for a last handle: a suspended pinned
    /// fiber released on another thread than its own leaks its stack (its
    /// locals are never dropped; `spindle_fiber::leaked_stacks` counts it),
    /// and a suspended migratable one is unwound on the releasing (or
    /// waking) thread (unless it may be suspended inside its own panic's
    /// unwind: then it is leaked too). If that thread is panicking (the last handle was
    /// held by a fiber that is itself being unwound, say), a destructor of
    /// such a fiber that yields aborts the process: see
    /// [`yield_value`](spindle_fiber::yield_value). Drop the last handle
    /// outside fibers that may be dropped suspended, or let the queued
    /// fibers finish first.
    fn drop(&mut self) {
        if self.shared.handles.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let drained: Vec<Fiber<T>> = {
            let mut synced = self.shared.synced.lock();
            let mut all: Vec<Fiber<T>> =
                std::iter::from_fn(|| synced.heap.top().map(|l| synced.heap.pop_at(l))).collect();
            all.extend(synced.elsewhere.drain(..).map(|(f, _)| f));
            all
        };
        // Every fiber is abandoned before any is released: a released
        // fiber may be unwound here, and a destructor on its stack may
        // wait for a token or message that abandoning a later one hands on
        // (found in review: it waited for ever). That includes fibers
        // released inside an abandon (a sleeper whose wake this queue
        // refuses, handed a value by the abandoned one): the scope defers
        // them too.
        spindle_fiber::defer_releases(|| {
            for f in &drained {
                let _ = f.abandon();
            }
            drop(drained);
        });
    }
}

impl<T> fmt::Debug for RunQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One lock hold: the length and the counters of one moment.
        let (len, closed, stats) = {
            let synced = self.shared.synced.lock();
            (synced.len(), synced.closed, synced.stats)
        };
        f.debug_struct("RunQueue")
            .field("len", &len)
            .field("capacity", &self.capacity())
            .field("closed", &closed)
            .field("stats", &stats)
            .finish()
    }
}

/// The queue's lock and condvar: parking_lot normally; under `--cfg loom`,
/// the same API over loom's primitives, so that the loom models run this
/// file's code. Loom has no clock: there a timed wait never times out, it
/// waits until notified (a lost notification is then a deadlock, which loom
/// reports).
#[cfg(not(loom))]
mod sync {
    pub(crate) use parking_lot::{Condvar, Mutex, MutexGuard};
}

#[cfg(loom)]
mod sync {
    use std::ops::{Deref, DerefMut};
    use std::time::Instant;

    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    /// `None` only while a condvar wait holds the inner guard.
    pub(crate) struct MutexGuard<'a, T>(Option<loom::sync::MutexGuard<'a, T>>);

    pub(crate) struct Condvar(loom::sync::Condvar);

    pub(crate) struct WaitTimeoutResult;

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Mutex<T> {
            Mutex(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(self.0.lock().expect("run queue lock poisoned")))
        }

        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            self.0.try_lock().ok().map(|g| MutexGuard(Some(g)))
        }
    }

    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0.as_ref().expect("guard held")
        }
    }

    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0.as_mut().expect("guard held")
        }
    }

    impl Condvar {
        pub(crate) fn new() -> Condvar {
            Condvar(loom::sync::Condvar::new())
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }

        pub(crate) fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
            let inner = guard.0.take().expect("guard held");
            guard.0 = Some(self.0.wait(inner).expect("run queue lock poisoned"));
        }

        pub(crate) fn wait_until<T>(
            &self,
            guard: &mut MutexGuard<'_, T>,
            _deadline: Instant,
        ) -> WaitTimeoutResult {
            self.wait(guard);
            WaitTimeoutResult
        }
    }

    impl WaitTimeoutResult {
        pub(crate) fn timed_out(&self) -> bool {
            false
        }
    }
}
