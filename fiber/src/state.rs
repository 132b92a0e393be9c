//! The fiber state machine: one atomic word, named transitions.
//!
//! ```text
//!            set_function                 run                 yield
//!  Empty ───────────────▶ Ready ─────────────────▶ Running ──────────▶ Ready
//!  Finished ────────────▶   ▲  ◀── mark_dequeued ── Queued               │
//!                           │  ── mark_queued ───▶   ▲                   │
//!                           │                        │ wake (has home)   │
//!                           └──── wake (no home) ── Sleeping ◀── sleep ──┤
//!                                                                        │
//!  Running ── wake before the stack switched out ──▶ RunningWoken        │
//!  RunningWoken ── sleep ──▶ Queued (has home) / Ready (no home)         │
//!  Running ── return / panic ──▶ Finished ◀──────────────────────────────┘
//! ```
//!
//! `Locked` is a short exclusive state taken by whoever rewrites the fiber's
//! slot (`set_function`, `mark_queued`, `set_home`) or decides where a woken
//! fiber goes (a waker, or the runner finishing a deferred wake). A wake
//! holds it from `Sleeping` until its home queues it (`Woken::into_queued`
//! stores `Queued`) or refuses it; a refused waker keeps holding it while
//! it takes back what it handed over (`RefusedWake`), then stores `Ready`.
//! A value-handing wake of a fiber whose home refused it before
//! (`home_refused`) takes `Ready` → `Locked` the same way, and is refused.
//! Whoever moved the state out of `Ready`, `Sleeping`, `Empty` or `Finished`
//! owns the fiber's slot until it stores the next state (Release); the next
//! owner's successful CAS (Acquire) sees everything the previous one wrote.
//! `Fiber::run_mut` claims `Ready` → `Running` without a CAS, and
//! `Fiber::mark_queued_mut` / `mark_dequeued_mut` move `Ready` ↔ `Queued`
//! with a plain load and store: their `&mut` handle is the only
//! reference, and an Acquire fence after reading the count orders them
//! after the previous owner's Release.

use crate::loom::sync::atomic::{AtomicU8, Ordering};

/// Where a fiber is in its life. Returned by [`Fiber::state`](crate::Fiber::state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FiberState {
    /// No function set.
    Empty = 0,
    /// Runnable: a function is set and not started, or it yielded, or it
    /// was woken with no run queue to go to (or one that refused it).
    Ready = 1,
    /// Sitting in a run queue.
    Queued = 2,
    /// Running on some thread.
    Running = 3,
    /// Running, and already woken from the sleep it is about to enter.
    RunningWoken = 4,
    /// Asleep on a synchronisation primitive.
    Sleeping = 5,
    /// Its function returned or panicked; a new function may be set.
    Finished = 6,
    /// Briefly held exclusively by `set_function`, `mark_queued`,
    /// `set_home`, or whoever finishes a wake.
    Locked = 7,
}

impl FiberState {
    fn from_u8(v: u8) -> FiberState {
        match v {
            0 => FiberState::Empty,
            1 => FiberState::Ready,
            2 => FiberState::Queued,
            3 => FiberState::Running,
            4 => FiberState::RunningWoken,
            5 => FiberState::Sleeping,
            6 => FiberState::Finished,
            _ => FiberState::Locked,
        }
    }
}

/// What a waker found when it tried to wake a sleeper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
#[doc(hidden)]
pub enum WakeTransition {
    /// The fiber was `Sleeping`; the waker now holds it `Locked` and must
    /// store `Queued` (and schedule it) or `Ready`.
    Owned,
    /// The fiber had not switched out yet; it was marked `RunningWoken` and
    /// its runner finishes the wake.
    Deferred,
    /// The fiber was neither `Sleeping` nor `Running` (queued or ready after
    /// another wake, finished, or locked by someone): the wake is void.
    Void,
}

/// What the runner found after a fiber switched out to sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
#[doc(hidden)]
pub enum SleepTransition {
    /// The fiber is now `Sleeping`; a waker will move it.
    Asleep,
    /// A waker came first: the runner holds it `Locked` and must store
    /// `Queued` (and schedule it) or `Ready`.
    AlreadyWoken,
}

/// The atomic state word. Public only for the loom model tests (through
/// the hidden `__loom` module); not part of the crate's API.
#[derive(Debug)]
#[doc(hidden)]
pub struct StateCell(AtomicU8);

impl StateCell {
    pub fn new(s: FiberState) -> StateCell {
        StateCell(AtomicU8::new(s as u8))
    }

    #[inline]
    pub fn load(&self) -> FiberState {
        FiberState::from_u8(self.0.load(Ordering::Acquire))
    }

    /// Publishes `to`, ending an exclusive section.
    #[inline]
    pub fn store(&self, to: FiberState) {
        self.0.store(to as u8, Ordering::Release);
    }

    /// `from` → `to`, or the state actually found.
    #[inline]
    pub fn transition(&self, from: FiberState, to: FiberState) -> Result<(), FiberState> {
        self.0
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(FiberState::from_u8)
    }

    /// Waker step 3 (see DESIGN.md, "sleep/wake protocol"): `Sleeping` →
    /// `Locked`, or `Running` → `RunningWoken`; any other state: void.
    ///
    /// A wake in another state cannot end a sleep: it is void, as a wake
    /// that arrives for a fiber which then yields is, and must not take down
    /// the thread that makes it. A stale waiter (a second waiter of one
    /// sleep, or one kept after the fiber moved on) that finds the fiber
    /// `Sleeping` or `Running` does end its current or next sleep: a
    /// spurious wakeup, which callers of `sleep` must tolerate by checking
    /// their condition again (`spindle-sync`'s wait loop does).
    pub fn transition_to_woken(&self) -> WakeTransition {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            let next = match FiberState::from_u8(cur) {
                FiberState::Sleeping => FiberState::Locked,
                FiberState::Running => FiberState::RunningWoken,
                _ => return WakeTransition::Void,
            };
            match self
                .0
                .compare_exchange_weak(cur, next as u8, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if next == FiberState::Locked => return WakeTransition::Owned,
                Ok(_) => return WakeTransition::Deferred,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Sleeper step 4 (runner side, after the stack switched out):
    /// `Running` → `Sleeping`, or `RunningWoken` → `Locked`.
    pub fn transition_to_sleeping(&self) -> SleepTransition {
        match self.transition(FiberState::Running, FiberState::Sleeping) {
            Ok(()) => SleepTransition::Asleep,
            Err(FiberState::RunningWoken) => {
                // Only the runner moves a fiber out of RunningWoken.
                self.store(FiberState::Locked);
                SleepTransition::AlreadyWoken
            }
            Err(other) => unreachable!("fiber went to sleep from state {other:?}"),
        }
    }

    /// Runner, after a yield: `Running`/`RunningWoken` → `Ready`. A wake that
    /// arrived for a fiber which then yielded instead of sleeping is void.
    #[inline]
    pub fn transition_to_yielded(&self) {
        self.store(FiberState::Ready);
    }
}
