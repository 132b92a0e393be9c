//! The type-erased part of a fiber: what the current-fiber lookup, the wait
//! seam and the stack overflow handler need, without knowing the fiber's
//! return type.

use std::fmt;
use std::num::NonZeroU64;
use std::panic::Location;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::state::{FiberState, StateCell};

/// A fiber's process-unique identifier. Never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FiberId(NonZeroU64);

impl FiberId {
    pub(crate) fn next() -> FiberId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        FiberId(NonZeroU64::new(id).expect("fiber id counter wrapped"))
    }

    /// The id as a number.
    pub fn as_u64(self) -> u64 {
        self.0.get()
    }

    /// The id with this number, if it is not 0 (the inverse of
    /// [`as_u64`](FiberId::as_u64); the fiber need not exist).
    pub fn from_u64(v: u64) -> Option<FiberId> {
        NonZeroU64::new(v).map(FiberId)
    }
}

/// A hasher for maps keyed by [`FiberId`]: ids are unique and sequential,
/// so one multiplication spreads them (SipHash would cost more than the
/// rest of a run queue operation).
///
/// ```
/// use std::collections::HashMap;
/// use std::hash::BuildHasherDefault;
/// use spindle_fiber::{Fiber, FiberIdHasher};
///
/// let fiber = Fiber::<()>::new(Default::default()).unwrap();
/// let mut map: HashMap<_, _, BuildHasherDefault<FiberIdHasher>> = HashMap::default();
/// map.insert(fiber.id(), "a fiber");
/// assert_eq!(map[&fiber.id()], "a fiber");
/// ```
#[derive(Debug, Default, Clone, Copy)]
pub struct FiberIdHasher(u64);

impl std::hash::Hasher for FiberIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

impl fmt::Display for FiberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A scheduling priority: larger values run first. Any of the 256 values
/// may be used; the constants name five of them, evenly spread (the
/// executor's three priority classes are `HIGH` and above, `LOW` and
/// below, and the values between).
///
/// ```
/// use spindle_fiber::Priority;
/// assert!(Priority::HIGHEST > Priority::HIGH && Priority::HIGH > Priority::NORMAL);
/// assert!(Priority::NORMAL > Priority::LOW && Priority::LOW > Priority::LOWEST);
/// assert_eq!(Priority::default(), Priority::NORMAL);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(pub u8);

impl Priority {
    /// The highest level (255): a run queue runs it before every lower
    /// level. A scheduler may group levels into fewer classes (the
    /// executor runs 192 and above as one class, FIFO within it).
    pub const HIGHEST: Priority = Priority(u8::MAX);
    /// Above the default (192).
    pub const HIGH: Priority = Priority(192);
    /// The default.
    pub const NORMAL: Priority = Priority(128);
    /// Below the default (64).
    pub const LOW: Priority = Priority(64);
    /// Runs when nothing else is ready.
    pub const LOWEST: Priority = Priority(0);
}

impl Default for Priority {
    fn default() -> Priority {
        Priority::NORMAL
    }
}

/// `Priority(n)`: `Priority::from(200) > Priority::NORMAL`.
impl From<u8> for Priority {
    fn from(level: u8) -> Priority {
        Priority(level)
    }
}

/// Per-fiber counters, written only by whoever runs the fiber (relaxed
/// load + store, no read-modify-write), readable from anywhere.
///
/// Yields are not counted but derived: every run ends in a yield, a sleep
/// or the end of the function (return or panic), or is still going on, so
/// `yields = runs - sleeps - ends - running`. That keeps the common round
/// trip (run, yield) to one counter update.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) runs: AtomicU64,
    pub(crate) sleeps: AtomicU64,
    /// Functions that returned or panicked.
    pub(crate) ends: AtomicU64,
    pub(crate) migrations: AtomicU64,
}

impl Counters {
    #[inline]
    pub(crate) fn bump(c: &AtomicU64) {
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// A snapshot of a fiber's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FiberStats {
    /// Times `run` switched into the fiber.
    pub runs: u64,
    /// Times the fiber yielded.
    pub yields: u64,
    /// Times the fiber went to sleep on a synchronisation primitive.
    pub sleeps: u64,
    /// Times the fiber ran on a different thread than its previous run
    /// (of this function or an earlier one: a new function's first run
    /// elsewhere counts too).
    pub migrations: u64,
}

/// Functions of the typed fiber that erased code calls.
pub(crate) struct VTable {
    /// Adds a reference.
    pub(crate) retain: unsafe fn(NonNull<Header>),
    /// Drops a reference.
    pub(crate) release: unsafe fn(NonNull<Header>),
    /// Finishes a wake the caller owns (state `Locked`), consuming one
    /// reference: hands the fiber to its home (which queues it), or
    /// stores `Ready` if it has none. True if the home refused it: the
    /// reference is the caller's again, and so is the hold (`Locked`).
    pub(crate) finish_wake: unsafe fn(NonNull<Header>) -> bool,
}

/// The erased head of every fiber. `#[repr(C)]` first field of the typed
/// fiber, so a `NonNull<Header>` converts back to the typed allocation.
pub(crate) struct Header {
    pub(crate) id: FiberId,
    pub(crate) name: Option<Arc<str>>,
    pub(crate) state: StateCell,
    pub(crate) priority: AtomicU8,
    /// Usable size of the stack, guard range: fixed at creation, read by the
    /// overflow handler.
    pub(crate) stack_size: usize,
    pub(crate) guard: (usize, usize),
    /// Address of the corosensei yielder of the current function. Written
    /// by the fiber itself when its function starts; moved to
    /// `drop_yielder` (null here) by `release` for a dropped fiber's forced
    /// unwind; cleared when the function ends and by `set_function`. Read
    /// only on the fiber's own stack (`yield_value`/`sleep_on`).
    pub(crate) yielder: AtomicPtr<()>,
    /// The yielder moved aside by `release` while it unwinds the stack of
    /// the dropped fiber (`yielder` is null meanwhile, so that suspensions
    /// then take the cold path: `current.rs`, `yield_without_yielder`).
    /// Same thread, same lifetime rules as `yielder`.
    pub(crate) drop_yielder: AtomicPtr<()>,
    /// Set by the fiber just before it switches out to sleep, read and
    /// cleared by its runner just after (same thread); cleared by
    /// `set_function`.
    pub(crate) sleep_request: AtomicBool,
    /// Bit 0: an interrupt is pending (`Waiter::interrupt`,
    /// `Fiber::interrupt`), set by anyone before they wake the fiber, taken
    /// by the fiber (`take_interrupt`). The other bits: the function's
    /// generation, bumped by `set_function` (which clears the mark), so
    /// that a `Waiter` kept from an earlier function cannot interrupt a
    /// later one (fibers are reused).
    pub(crate) interrupt: AtomicU64,
    /// Set by `release` while it unwinds the stack of the dropped fiber
    /// (read by `may_sleep` on the fiber's stack, same thread), cleared
    /// when that unwind is over and by `set_function`.
    pub(crate) unwinding_for_drop: AtomicBool,
    /// Set with `unwinding_for_drop` when the dropping thread was not
    /// panicking as the unwind began: then, on the fiber's stack,
    /// `std::thread::panicking()` says exactly whether code runs inside the
    /// unwind's own propagation (a destructor) or after a `catch_unwind`
    /// that stopped it. When the thread was panicking already, the two
    /// cannot be told apart (the count is the thread's, not the fiber's).
    pub(crate) panicking_means_unwinding: AtomicBool,
    /// The fiber's last sleep began while its thread was panicking (a
    /// destructor that waits during an unwind): a forced unwind from there
    /// would start inside that destructor's cleanup and abort the process,
    /// so `release` leaks such a stack instead. Written by the fiber as it
    /// sleeps, cleared by `set_function`.
    pub(crate) slept_panicking: AtomicBool,
    /// The thread (its id word) on which a panic last began in the
    /// fiber's current function, or 0: written by the crate's panic hook as
    /// the panic starts (if it was not replaced since) and by
    /// `resume_unwind`, cleared when the function ends, when it sleeps
    /// while its thread is not panicking, and by `set_function`. Non-zero
    /// while the fiber is suspended means it may be suspended inside that
    /// panic's unwind (a destructor that yields), which `release` cannot
    /// unwind again without aborting the process.
    pub(crate) panicked_on: AtomicU64,
    /// Set once the fiber has lost its stack for good (its suspended
    /// function was unwound on drop while a destructor kept a reference,
    /// or dropping an unstarted closure panicked); never cleared. Read by
    /// the error paths of `run` and `set_function`.
    pub(crate) stackless: AtomicBool,
    /// Set when the fiber's home refused a wake of it for good (the
    /// scheduler shut down, or `Fiber::abandon`), cleared when it is queued
    /// again (`mark_queued`, `Woken::into_queued`) or given another home
    /// (`set_home`); written only while its
    /// state is held `Locked`. A value-handing wake (`Waiter::try_wake`)
    /// that finds such a fiber `Ready` is refused too: an earlier refused
    /// wake left it so, maybe still in its wait, and nobody will run it.
    pub(crate) home_refused: AtomicBool,
    /// Thread id of the last run; written by the runner.
    pub(crate) last_thread: AtomicU64,
    /// The thread a pinned function is bound to once it has run, or since
    /// `Fiber::pin_to` named it (0: none, the function is migratable or
    /// has not run and was not pinned). Written on the cold paths that
    /// bind and unbind it; read by `Fiber::may_run_here` and by the first
    /// run's thread check.
    pub(crate) pinned_to: AtomicU64,
    pub(crate) counters: Counters,
    pub(crate) vtable: &'static VTable,
    /// A word for the scheduler's use (`Fiber::set_sched_data`).
    pub(crate) sched_data: AtomicUsize,
    /// What the fiber last slept on and where: written by the fiber before
    /// it sleeps, read by anyone for reports.
    pub(crate) wait_reason: AtomicPtr<WaitReason>,
    pub(crate) wait_location: AtomicPtr<Location<'static>>,
    /// The hook of the wait the fiber is in (`WaitToken::enter_wait`; null
    /// outside one): written only by the fiber itself, read by whoever lets
    /// go of it while holding it after a refused wake (`let_go_refused`).
    /// Also cleared by `set_function` and when the function ends.
    pub(crate) wait_hook: AtomicPtr<crate::current::WaitHook>,
}

/// What a sleeping fiber waits on, for reports (a deadlock report, `Debug`).
/// Synchronisation primitives declare one as a `static` and pass it to
/// [`sleep_on`](crate::sleep_on).
#[derive(Debug)]
pub struct WaitReason(pub &'static str);

impl Header {
    /// Whether the suspended fiber may be inside the unwind of a panic
    /// (a destructor that yielded while its function panicked), which a
    /// forced unwind could not start from without aborting the process.
    /// Certain only on the thread the panic began on: there the thread is
    /// still panicking while the unwind is suspended (std counts panics per
    /// thread). On another thread, or while this thread panics for another
    /// reason, a panic the function caught cannot be told from one still
    /// unwinding, and the answer is yes. Called on the thread dropping the
    /// fiber, by whoever owns its slot.
    pub(crate) fn may_be_suspended_in_panic(&self) -> bool {
        let on = self.panicked_on.load(Ordering::Relaxed);
        on != 0 && (on != crate::tls::thread_id_word() || std::thread::panicking())
    }

    /// Notes that a panic of the fiber's function began on this thread
    /// (`panicked_on`): the panic hook, or `resume_unwind`, in the running
    /// fiber.
    pub(crate) fn note_panicking(&self) {
        self.panicked_on
            .store(crate::tls::thread_id_word(), Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn priority(&self) -> crate::Priority {
        crate::Priority(self.priority.load(Ordering::Relaxed))
    }

    pub(crate) fn wait_site(&self) -> Option<(&'static str, &'static Location<'static>)> {
        let r = self.wait_reason.load(Ordering::Acquire);
        let l = self.wait_location.load(Ordering::Acquire);
        // SAFETY: both pointers are null or come from `&'static` references.
        unsafe { Some((r.as_ref()?.0, l.as_ref()?)) }
    }

    pub(crate) fn stats(&self) -> FiberStats {
        let c = &self.counters;
        // The counters are plain words that the runner updates one at a
        // time, so a read taken while another thread runs the fiber is
        // retried until the run count and the state held still across it
        // (a few tries; the runner does not wait for readers).
        let mut tries = 0;
        let (runs, sleeps, ends, running) = loop {
            let state = self.state.load();
            let runs = c.runs.load(Ordering::Relaxed);
            let sleeps = c.sleeps.load(Ordering::Relaxed);
            let ends = c.ends.load(Ordering::Relaxed);
            tries += 1;
            if (c.runs.load(Ordering::Relaxed) == runs && self.state.load() == state) || tries == 8 {
                let running = matches!(state, FiberState::Running | FiberState::RunningWoken);
                break (runs, sleeps, ends, running);
            }
        };
        FiberStats {
            runs,
            // Exact when the fiber is not running, or when it reads its own
            // counters; read while another thread runs it, it may be one
            // step behind or ahead (the runner counts a sleep or an end just
            // before it changes the state). Never below zero.
            yields: runs.saturating_sub(sleeps + ends + running as u64),
            sleeps,
            migrations: c.migrations.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn display_name(&self) -> String {
        match &self.name {
            Some(n) => format!("'{n}' ({})", self.id),
            None => format!("{}", self.id),
        }
    }
}
