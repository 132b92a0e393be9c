//! A model-based property test of the single-thread fiber lifecycle
//! (DESIGN.md, "State machine"): random sequences of operations on a few
//! `spindle_fiber::Fiber`s, each checked step by step against a reference
//! model of the documented state machine, with proptest shrinking a
//! failing sequence to a minimal one.
//!
//! The fibers' functions are drawn from a small script language: yield a
//! value, `yield_now`, sleep on a published `Waiter`, look at `current()`,
//! change the current priority, try to run or rewrite itself through a
//! handle the runner lent it, run another fiber nested inside it, keep a
//! local whose destructor yields; then return a value or panic. Every closure carries a guard whose drop is
//! counted, so the model also predicts when a function's locals (or an
//! unstarted closure's captures) are dropped: at its return or panic, when
//! `set_function` replaces an unstarted one or refuses a new one, and when
//! the last reference to a suspended fiber goes (its stack is unwound,
//! with the fiber current and `may_sleep()` false).
//!
//! Sleeps are woken from the test thread by the published `Waiter` (the
//! fibers have no home, so a wake leaves them `Ready`); queueing is
//! `mark_queued(None)` / `mark_dequeued` by hand. Threads, schedulers and
//! timed sleeps are other tests' business.
//!
//! `PROPTEST_CASES` and `PROPTEST_RNG_SEED` change the run.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use spindle_fiber::{
    current, current_id, in_fiber, leaked_stacks, may_sleep, set_current_priority, sleep, yield_now,
    yield_value, Fiber, FiberAttr, FiberError, FiberId, FiberState, Priority, RunOutcome, Waiter,
};
use spindle_test_support::watchdog;

/// Fiber slots a sequence of operations works on.
const SLOTS: usize = 3;
/// Handles of one fiber at most (no clones are made beyond).
const MAX_HANDLES: usize = 3;
/// Small, but a panic with `RUST_BACKTRACE` set needs about 32 KiB
/// (`FiberAttr::stack_size`), and scripts panic.
const STACK_SIZE: usize = 32 * 1024;
/// Cases per run unless `PROPTEST_CASES` says otherwise.
const DEFAULT_CASES: u32 = 512;
/// The value a sleep suspends with inside the library (`SLEEP_SIGNAL`,
/// fiber.rs): a plain `yield_value` of it is still a yield (DESIGN.md,
/// "Layout", `sleep_request`).
const SLEEP_SIGNAL: usize = usize::MAX - 0x51ee;

// ---------------------------------------------------------------------------
// What the runs exercised

/// Paths the test claims to cover: it fails if a run of the default
/// length missed one (a generator change that made it unreachable).
#[derive(Clone, Copy, Debug)]
enum Event {
    Yielded,
    YieldedSleepSignal,
    Returned,
    Slept,
    Panicked,
    RunNoFunction,
    RunFinished,
    RunQueued,
    RunSleeping,
    RunMutUnique,
    SelfCheckLent,
    NestedRun,
    NestedRunRefused,
    SetFunctionReplacedUnstarted,
    SetFunctionBusyYielded,
    SetFunctionBusySleeping,
    SetFunctionQueued,
    ReusedAfterReturn,
    ReusedAfterPanic,
    DroppedSuspended,
    DroppedUnstarted,
    OrphanWoken,
    Woken,
    Dequeued,
    Abandoned,
    DeferredYield,
    DroppedWithDeferredYield,
    DroppedInDeferredYield,
}

const ALL_EVENTS: [Event; 28] = [
    Event::Yielded,
    Event::YieldedSleepSignal,
    Event::Returned,
    Event::Slept,
    Event::Panicked,
    Event::RunNoFunction,
    Event::RunFinished,
    Event::RunQueued,
    Event::RunSleeping,
    Event::RunMutUnique,
    Event::SelfCheckLent,
    Event::NestedRun,
    Event::NestedRunRefused,
    Event::SetFunctionReplacedUnstarted,
    Event::SetFunctionBusyYielded,
    Event::SetFunctionBusySleeping,
    Event::SetFunctionQueued,
    Event::ReusedAfterReturn,
    Event::ReusedAfterPanic,
    Event::DroppedSuspended,
    Event::DroppedUnstarted,
    Event::OrphanWoken,
    Event::Woken,
    Event::Dequeued,
    Event::Abandoned,
    Event::DeferredYield,
    Event::DroppedWithDeferredYield,
    Event::DroppedInDeferredYield,
];

static TALLY: [AtomicUsize; ALL_EVENTS.len()] = [const { AtomicUsize::new(0) }; ALL_EVENTS.len()];

fn note(event: Event) {
    TALLY[event as usize].fetch_add(1, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------
// The script language

/// One step of a fiber's script.
#[derive(Clone, Debug)]
enum Step {
    /// `yield_value(v)`: the run returns `Yielded(v)`.
    Yield(usize),
    /// `yield_now()`: the run returns `Yielded(0)`.
    YieldNow,
    /// Publishes `Waiter::current()` in the fiber's cell and sleeps: the
    /// run returns `Slept`, and the test thread wakes it later.
    Sleep,
    /// Records what `current()`, `current_id()` and `in_fiber()` say.
    Observe,
    /// `set_current_priority(p)`, recording its result.
    SetPriority(u8),
    /// Takes the handle of itself the runner lent it (if any) and records
    /// what `run`, `set_function`, `mark_dequeued`, `abandon` and `state`
    /// say of the running fiber; drops the handle before suspending.
    SelfCheck,
    /// Runs the fiber the runner lent it for nesting (if any) once, and
    /// records the result; drops its handle before suspending.
    RunSub,
    /// Keeps a local whose destructor calls `yield_value(v)`: after the
    /// return value is made, before the function returns, the run returns
    /// `Yielded(v)` (in the order the locals were made); while a dropped
    /// fiber is unwound the yield yields the thread and `v` is discarded.
    /// A script that panics disarms them first (no suspending while the
    /// thread panics).
    DeferYield(usize),
}

/// How a script ends.
#[derive(Clone, Debug)]
enum End {
    Return(u64),
    Panic,
}

#[derive(Clone, Debug)]
struct Script {
    steps: Vec<Step>,
    end: End,
}

/// What a run returned, in a comparable form.
#[derive(Debug, PartialEq)]
enum Outcome {
    Yielded(usize),
    Returned(u64),
    Slept,
    /// The fiber's id and name, and the panic message.
    Panicked(FiberId, Option<String>, Option<String>),
}

fn observed(outcome: RunOutcome<u64>) -> Outcome {
    let suspended = outcome.is_suspended();
    let seen = match outcome {
        RunOutcome::Yielded(v) => Outcome::Yielded(v),
        RunOutcome::Returned(v) => Outcome::Returned(v),
        RunOutcome::Slept => Outcome::Slept,
        RunOutcome::Panicked(p) => {
            Outcome::Panicked(p.fiber, p.name.as_deref().map(str::to_owned), p.message().map(str::to_owned))
        }
    };
    assert_eq!(suspended, matches!(seen, Outcome::Yielded(_) | Outcome::Slept), "is_suspended of {seen:?}");
    seen
}

/// What the fibers' functions record, in order, for the model to predict.
#[derive(Debug, PartialEq)]
enum Obs {
    Current {
        id: Option<FiberId>,
        name: Option<String>,
        priority: Option<Priority>,
        current_id: Option<FiberId>,
        in_fiber: bool,
    },
    SetPriority(bool),
    SelfCheck {
        /// `Ok` would mean the fiber ran itself.
        run: Result<(), FiberError>,
        set_function: Result<(), FiberError>,
        mark_dequeued: Result<(), FiberError>,
        abandon: Result<(), FiberError>,
        state: FiberState,
    },
    /// `SelfCheck` or `RunSub` without a lent handle.
    NotLent,
    /// What the nested run returned.
    Sub(Result<Outcome, FiberError>),
    /// A started function's locals were dropped: by its return or panic,
    /// or by the unwind of its dropped fiber.
    LocalsDropped {
        current_id: Option<FiberId>,
        may_sleep: bool,
    },
}

/// What one test case shares with the fibers' functions.
#[derive(Default)]
struct Shared {
    /// Guards dropped (one per closure ever made).
    drops: AtomicUsize,
    log: Mutex<Vec<Obs>>,
}

impl Shared {
    fn record(&self, obs: Obs) {
        self.log.lock().unwrap().push(obs);
    }
}

/// Captured by every closure given to a fiber; its drop is counted.
struct Guard(Arc<Shared>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.drops.fetch_add(1, Ordering::Relaxed);
    }
}

/// A started function's guard, as a local: records where it is dropped.
struct Local(Guard);

impl Drop for Local {
    fn drop(&mut self) {
        self.0 .0.record(Obs::LocalsDropped { current_id: current_id(), may_sleep: may_sleep() });
    }
}

/// A local whose destructor yields, unless disarmed.
struct YieldOnDrop {
    value: usize,
    armed: bool,
}

impl Drop for YieldOnDrop {
    fn drop(&mut self) {
        if self.armed {
            yield_value(self.value);
        }
    }
}

/// Per fiber: where its function publishes its waiter, and where the
/// runner lends it handles (of itself, and of a fiber to run nested).
#[derive(Default)]
struct Cells {
    waiter: Mutex<Option<Waiter>>,
    lent: Mutex<Option<Fiber<u64>>>,
    sub: Mutex<Option<Fiber<u64>>>,
}

fn panic_message(serial: u64) -> String {
    format!("script {serial} panics")
}

/// A closure that is never meant to run (`set_function` refuses it).
fn inert(shared: &Arc<Shared>) -> impl FnOnce() -> u64 + Send + 'static {
    let guard = Guard(shared.clone());
    move || {
        drop(guard);
        u64::MAX
    }
}

/// The function that runs `script`.
fn body(
    script: Script,
    serial: u64,
    shared: Arc<Shared>,
    cells: Arc<Cells>,
) -> impl FnOnce() -> u64 + Send + 'static {
    let guard = Guard(shared.clone());
    move || {
        // A local from here on: dropped when the function returns or
        // panics, or is unwound because its fiber was dropped.
        let _local = Local(guard);
        // Dropped before `_local`, front to back.
        let mut deferred = Vec::new();
        for step in &script.steps {
            match *step {
                Step::Yield(v) => yield_value(v),
                Step::YieldNow => yield_now(),
                Step::Sleep => {
                    let waiter = Waiter::current();
                    *cells.waiter.lock().unwrap() = waiter;
                    sleep();
                }
                Step::Observe => {
                    let me = current();
                    shared.record(Obs::Current {
                        id: me.as_ref().map(|c| c.id()),
                        name: me.as_ref().and_then(|c| c.name().map(str::to_owned)),
                        priority: me.as_ref().map(|c| c.priority()),
                        current_id: current_id(),
                        in_fiber: in_fiber(),
                    });
                }
                Step::SetPriority(p) => shared.record(Obs::SetPriority(set_current_priority(Priority(p)))),
                Step::SelfCheck => {
                    let lent = cells.lent.lock().unwrap().take();
                    let obs = match lent {
                        Some(me) => Obs::SelfCheck {
                            run: me.run().map(drop),
                            set_function: me.set_function(Priority::LOWEST, inert(&shared)),
                            mark_dequeued: me.mark_dequeued(),
                            abandon: me.abandon(),
                            state: me.state(),
                        },
                        None => Obs::NotLent,
                    };
                    shared.record(obs);
                }
                Step::DeferYield(value) => deferred.push(YieldOnDrop { value, armed: true }),
                Step::RunSub => {
                    let sub = cells.sub.lock().unwrap().clone();
                    let obs = match sub {
                        Some(sub) => Obs::Sub(sub.run().map(observed)),
                        None => Obs::NotLent,
                    };
                    shared.record(obs);
                }
            }
        }
        match script.end {
            End::Return(v) => v,
            End::Panic => {
                for d in &mut deferred {
                    d.armed = false;
                }
                panic!("{}", panic_message(serial))
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Operations

#[derive(Clone, Debug)]
enum Op {
    /// Drops the slot's fiber (all its handles) if any, and makes a new one.
    New {
        slot: usize,
        named: bool,
    },
    /// `set_function` through one of the handles.
    SetFunction {
        slot: usize,
        handle: usize,
        priority: u8,
        script: Script,
    },
    /// `run` (or `run_mut`) through one of the handles, maybe lending the
    /// fiber a handle of itself (`SelfCheck`) and one of the fiber in
    /// slot `sub` to run nested (`RunSub`).
    Run {
        slot: usize,
        handle: usize,
        by_mut: bool,
        lend: bool,
        sub: Option<usize>,
    },
    SetPriority {
        slot: usize,
        handle: usize,
        priority: u8,
    },
    Clone {
        slot: usize,
    },
    /// Drops one handle (the fiber with its last one).
    Drop {
        slot: usize,
        handle: usize,
    },
    /// Wakes the slot's fiber through the waiter it published, if any.
    Wake {
        slot: usize,
    },
    /// Wakes the oldest sleeping fiber whose handles were all dropped
    /// (its waiter is its last reference: the wake unwinds it).
    WakeOrphan,
    /// `mark_queued(None)` (or `mark_queued_mut`).
    Queue {
        slot: usize,
        handle: usize,
        by_mut: bool,
    },
    /// `mark_dequeued` (or `mark_dequeued_mut`).
    Dequeue {
        slot: usize,
        handle: usize,
        by_mut: bool,
    },
    Abandon {
        slot: usize,
        handle: usize,
    },
}

fn yielded_value() -> impl Strategy<Value = usize> {
    prop_oneof![6 => 0..8usize, 1 => Just(usize::MAX), 1 => Just(SLEEP_SIGNAL), 1 => any::<usize>()]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => yielded_value().prop_map(Step::Yield),
        2 => Just(Step::YieldNow),
        2 => Just(Step::Sleep),
        2 => Just(Step::Observe),
        1 => any::<u8>().prop_map(Step::SetPriority),
        2 => Just(Step::SelfCheck),
        3 => Just(Step::RunSub),
        1 => yielded_value().prop_map(Step::DeferYield),
    ]
}

fn script() -> impl Strategy<Value = Script> {
    let end = prop_oneof![3 => any::<u64>().prop_map(End::Return), 1 => Just(End::Panic)];
    (prop::collection::vec(step(), 0..6), end).prop_map(|(steps, end)| Script { steps, end })
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..SLOTS;
    let handle = 0..MAX_HANDLES;
    let run = (
        slot.clone(),
        handle.clone(),
        any::<bool>(),
        prop::bool::weighted(0.4),
        prop::option::weighted(0.5, slot.clone()),
    );
    prop_oneof![
        1 => (slot.clone(), any::<bool>()).prop_map(|(slot, named)| Op::New { slot, named }),
        6 => (slot.clone(), handle.clone(), any::<u8>(), script()).prop_map(|(slot, handle, priority, script)| {
            Op::SetFunction { slot, handle, priority, script }
        }),
        10 => run.prop_map(|(slot, handle, by_mut, lend, sub)| Op::Run { slot, handle, by_mut, lend, sub }),
        1 => (slot.clone(), handle.clone(), any::<u8>())
            .prop_map(|(slot, handle, priority)| Op::SetPriority { slot, handle, priority }),
        1 => slot.clone().prop_map(|slot| Op::Clone { slot }),
        2 => (slot.clone(), handle.clone()).prop_map(|(slot, handle)| Op::Drop { slot, handle }),
        2 => slot.clone().prop_map(|slot| Op::Wake { slot }),
        1 => Just(Op::WakeOrphan),
        2 => (slot.clone(), handle.clone(), any::<bool>())
            .prop_map(|(slot, handle, by_mut)| Op::Queue { slot, handle, by_mut }),
        2 => (slot.clone(), handle.clone(), any::<bool>())
            .prop_map(|(slot, handle, by_mut)| Op::Dequeue { slot, handle, by_mut }),
        1 => (slot, handle).prop_map(|(slot, handle)| Op::Abandon { slot, handle }),
    ]
}

// ---------------------------------------------------------------------------
// The model

/// A function the model knows: its script and how far it got.
#[derive(Clone, Debug)]
struct Func {
    script: Script,
    serial: u64,
    /// The next step to run (past the steps: the next deferred yield of
    /// a returning function).
    pc: usize,
    started: bool,
}

/// The states a fiber can be seen in from outside (DESIGN.md, "State
/// machine"; `Running` only from inside, `Locked` never here).
#[derive(Clone, Debug)]
enum MState {
    Empty,
    Ready(Func),
    Queued(Func),
    Sleeping(Func),
    Finished,
}

impl MState {
    fn public(&self) -> FiberState {
        match self {
            MState::Empty => FiberState::Empty,
            MState::Ready(_) => FiberState::Ready,
            MState::Queued(_) => FiberState::Queued,
            MState::Sleeping(_) => FiberState::Sleeping,
            MState::Finished => FiberState::Finished,
        }
    }

    /// The error `run` (and `mark_queued`, `abandon`) gives in a state
    /// other than `Ready` (DESIGN.md: errors follow from the state a CAS
    /// finds).
    fn run_error(&self, id: FiberId) -> FiberError {
        match self {
            MState::Empty => FiberError::NoFunction(id),
            MState::Finished => FiberError::Finished(id),
            MState::Queued(_) => FiberError::Queued(id),
            MState::Sleeping(_) => FiberError::Sleeping(id),
            MState::Ready(_) => unreachable!("a ready fiber runs"),
        }
    }
}

/// One fiber: the model's view of it and the real handles.
struct Slot {
    // The model.
    id: FiberId,
    name: Option<String>,
    priority: u8,
    state: MState,
    runs: u64,
    yields: u64,
    sleeps: u64,
    /// Whether its last function ended in a panic.
    last_panicked: bool,
    // The real thing.
    handles: Vec<Fiber<u64>>,
    cells: Arc<Cells>,
}

/// One test case: the slots, the orphaned sleepers, and what the model
/// predicts.
struct World {
    shared: Arc<Shared>,
    slots: Vec<Option<Slot>>,
    /// Waiters of sleeping fibers whose handles were all dropped, oldest
    /// first (the fibers' last references), with the fibers' ids.
    orphans: VecDeque<(Waiter, FiberId)>,
    /// Closures made so far (each carries one guard).
    closures: usize,
    /// Guards the model says have been dropped.
    drops: usize,
    /// What the model says the functions recorded since the last check.
    expected: Vec<Obs>,
    next_serial: u64,
    fibers_made: usize,
    ids: HashSet<FiberId>,
}

/// `prop_assert_eq!` naming the operation and what was compared.
macro_rules! check_eq {
    ($ctx:expr, $left:expr, $right:expr, $what:expr) => {
        prop_assert_eq!($left, $right, "{} ({})", $ctx, $what)
    };
}

impl World {
    fn new() -> World {
        World {
            shared: Arc::new(Shared::default()),
            slots: (0..SLOTS).map(|_| None).collect(),
            orphans: VecDeque::new(),
            closures: 0,
            drops: 0,
            expected: Vec::new(),
            next_serial: 0,
            fibers_made: 0,
            ids: HashSet::new(),
        }
    }

    fn slot(&mut self, slot: usize) -> &mut Slot {
        self.slots[slot].as_mut().expect("the model runs live fibers only")
    }

    /// The model of a run of the `Ready` fiber in slot `a`, from where its
    /// function is to its next suspension point; `lend` and `sub` are
    /// what the runner lent it.
    fn model_run(&mut self, a: usize, lend: bool, sub: Option<usize>) -> Outcome {
        let s = self.slot(a);
        let MState::Ready(mut func) = s.state.clone() else { unreachable!("runs only a ready fiber") };
        let id = s.id;
        s.runs += 1;
        func.started = true;
        let mut lent = lend;
        while let Some(step) = func.script.steps.get(func.pc).cloned() {
            func.pc += 1;
            match step {
                Step::Yield(v) => {
                    note(if v == SLEEP_SIGNAL { Event::YieldedSleepSignal } else { Event::Yielded });
                    let s = self.slot(a);
                    s.yields += 1;
                    s.state = MState::Ready(func);
                    return Outcome::Yielded(v);
                }
                Step::YieldNow => {
                    note(Event::Yielded);
                    let s = self.slot(a);
                    s.yields += 1;
                    s.state = MState::Ready(func);
                    return Outcome::Yielded(0);
                }
                Step::Sleep => {
                    note(Event::Slept);
                    let s = self.slot(a);
                    s.sleeps += 1;
                    s.state = MState::Sleeping(func);
                    return Outcome::Slept;
                }
                Step::Observe => {
                    let s = self.slot(a);
                    let obs = Obs::Current {
                        id: Some(id),
                        name: s.name.clone(),
                        priority: Some(Priority(s.priority)),
                        current_id: Some(id),
                        in_fiber: true,
                    };
                    self.expected.push(obs);
                }
                Step::SetPriority(p) => {
                    self.slot(a).priority = p;
                    self.expected.push(Obs::SetPriority(true));
                }
                Step::SelfCheck if lent => {
                    note(Event::SelfCheckLent);
                    lent = false;
                    let running = Err(FiberError::Running(id));
                    self.expected.push(Obs::SelfCheck {
                        run: running,
                        set_function: running,
                        mark_dequeued: running,
                        abandon: running,
                        state: FiberState::Running,
                    });
                    // The closure `set_function` refused.
                    self.closures += 1;
                    self.drops += 1;
                }
                Step::SelfCheck => self.expected.push(Obs::NotLent),
                Step::RunSub => {
                    let Some(b) = sub else {
                        self.expected.push(Obs::NotLent);
                        continue;
                    };
                    let result = if b == a {
                        Err(FiberError::Running(id))
                    } else {
                        let s = self.slot(b);
                        match s.state.clone() {
                            // The fiber it runs has nothing lent to it.
                            MState::Ready(_) => Ok(self.model_run(b, false, None)),
                            other => Err(other.run_error(s.id)),
                        }
                    };
                    note(if result.is_ok() { Event::NestedRun } else { Event::NestedRunRefused });
                    self.expected.push(Obs::Sub(result));
                }
                Step::DeferYield(_) => {}
            }
        }
        if let End::Return(_) = func.script.end {
            // The locals that yield when dropped, in the order made.
            let deferred = func.script.steps.iter().filter_map(|s| match *s {
                Step::DeferYield(v) => Some(v),
                _ => None,
            });
            if let Some(v) = deferred.clone().nth(func.pc - func.script.steps.len()) {
                note(Event::DeferredYield);
                func.pc += 1;
                let s = self.slot(a);
                s.yields += 1;
                s.state = MState::Ready(func);
                return Outcome::Yielded(v);
            }
        }
        // The function is over: its guard was dropped on the way out.
        self.expected.push(Obs::LocalsDropped { current_id: Some(id), may_sleep: true });
        self.drops += 1;
        let s = self.slot(a);
        s.state = MState::Finished;
        s.last_panicked = matches!(func.script.end, End::Panic);
        match func.script.end {
            End::Return(v) => {
                note(Event::Returned);
                Outcome::Returned(v)
            }
            End::Panic => {
                note(Event::Panicked);
                Outcome::Panicked(id, s.name.clone(), Some(panic_message(func.serial)))
            }
        }
    }

    /// Drops every handle of the slot's fiber: a suspended function is
    /// unwound, an unstarted one dropped, now; unless the fiber sleeps
    /// (its waiter keeps it, and becomes an orphan).
    fn drop_fiber(&mut self, slot: usize) {
        let Some(s) = self.slots[slot].take() else { return };
        match &s.state {
            MState::Sleeping(_) => {
                let waiter =
                    s.cells.waiter.lock().unwrap().take().expect("a sleeping fiber published its waiter");
                self.orphans.push_back((waiter, s.id));
            }
            MState::Ready(f) | MState::Queued(f) => {
                if f.started {
                    note(Event::DroppedSuspended);
                    if f.script.steps[..f.pc.min(f.script.steps.len())]
                        .iter()
                        .any(|s| matches!(s, Step::DeferYield(_)))
                    {
                        note(Event::DroppedWithDeferredYield);
                    }
                    if f.pc > f.script.steps.len() {
                        // Suspended in one of those destructors: the
                        // unwind starts there.
                        note(Event::DroppedInDeferredYield);
                    }
                    // Unwound with the fiber current, and no sleeping then.
                    self.expected.push(Obs::LocalsDropped { current_id: Some(s.id), may_sleep: false });
                } else {
                    note(Event::DroppedUnstarted);
                }
                self.drops += 1;
            }
            MState::Empty | MState::Finished => {}
        }
        drop(s.handles);
    }

    fn make_fiber(&mut self, slot: usize, named: bool) -> Result<(), TestCaseError> {
        self.drop_fiber(slot);
        let name = named.then(|| format!("model-{slot}-{}", self.fibers_made));
        self.fibers_made += 1;
        let mut attr = FiberAttr::new().stack_size(STACK_SIZE);
        if let Some(n) = &name {
            attr = attr.name(n.as_str());
        }
        let fiber = Fiber::<u64>::new(attr).map_err(|e| TestCaseError::fail(format!("Fiber::new: {e}")))?;
        prop_assert!(self.ids.insert(fiber.id()), "fiber id {} reused", fiber.id());
        prop_assert_eq!(fiber.name(), name.as_deref());
        prop_assert_eq!(fiber.stack_size(), STACK_SIZE);
        self.slots[slot] = Some(Slot {
            id: fiber.id(),
            name,
            priority: Priority::default().0,
            state: MState::Empty,
            runs: 0,
            yields: 0,
            sleeps: 0,
            last_panicked: false,
            handles: vec![fiber],
            cells: Arc::new(Cells::default()),
        });
        Ok(())
    }

    /// Applies one operation to the fibers and to the model, and checks
    /// what it returned and everything observable against the model.
    fn apply(&mut self, op: &Op, ctx: &str) -> Result<(), TestCaseError> {
        match *op {
            Op::New { slot, named } => self.make_fiber(slot, named)?,
            Op::SetFunction { slot, handle, priority, ref script } => {
                let Some(s) = self.slots[slot].as_mut() else { return self.check(ctx) };
                let serial = self.next_serial;
                self.next_serial += 1;
                self.closures += 1;
                let f = body(script.clone(), serial, self.shared.clone(), s.cells.clone());
                let got = s.handles[handle % s.handles.len()].set_function(Priority(priority), f);
                let want = match &s.state {
                    MState::Empty => Ok(()),
                    MState::Finished => {
                        note(if s.last_panicked {
                            Event::ReusedAfterPanic
                        } else {
                            Event::ReusedAfterReturn
                        });
                        Ok(())
                    }
                    MState::Ready(func) if !func.started => {
                        // The unstarted closure it replaces is dropped.
                        note(Event::SetFunctionReplacedUnstarted);
                        self.drops += 1;
                        Ok(())
                    }
                    MState::Ready(_) => {
                        note(Event::SetFunctionBusyYielded);
                        Err(FiberError::Busy(s.id))
                    }
                    MState::Sleeping(_) => {
                        note(Event::SetFunctionBusySleeping);
                        Err(FiberError::Busy(s.id))
                    }
                    MState::Queued(_) => {
                        note(Event::SetFunctionQueued);
                        Err(FiberError::Queued(s.id))
                    }
                };
                check_eq!(ctx, got, want, "set_function's result");
                if want.is_ok() {
                    s.state = MState::Ready(Func { script: script.clone(), serial, pc: 0, started: false });
                    s.priority = priority;
                } else {
                    // Refused: `f` was dropped, the fiber left as it was.
                    self.drops += 1;
                }
            }
            Op::Run { slot, handle, by_mut, lend, sub } => {
                let sub = sub.filter(|&b| self.slots[b].is_some());
                let sub_handle = sub.map(|b| self.slot(b).handles[0].clone());
                let Some(s) = self.slots[slot].as_mut() else { return self.check(ctx) };
                if lend {
                    let me = s.handles[0].clone();
                    *s.cells.lent.lock().unwrap() = Some(me);
                }
                *s.cells.sub.lock().unwrap() = sub_handle;
                let h = handle % s.handles.len();
                if by_mut && !lend && sub != Some(slot) && s.handles.len() == 1 {
                    note(Event::RunMutUnique);
                }
                let got = if by_mut { s.handles[h].run_mut() } else { s.handles[h].run() };
                // Take back what was lent (what the function did not take).
                let unused = (s.cells.lent.lock().unwrap().take(), s.cells.sub.lock().unwrap().take());
                drop(unused);
                let got = got.map(observed);
                let id = s.id;
                let want = match s.state.clone() {
                    MState::Ready(_) => Ok(self.model_run(slot, lend, sub)),
                    other => {
                        note(match other {
                            MState::Empty => Event::RunNoFunction,
                            MState::Finished => Event::RunFinished,
                            MState::Queued(_) => Event::RunQueued,
                            _ => Event::RunSleeping,
                        });
                        Err(other.run_error(id))
                    }
                };
                check_eq!(ctx, got, want, "run's result");
            }
            Op::SetPriority { slot, handle, priority } => {
                if let Some(s) = self.slots[slot].as_mut() {
                    s.handles[handle % s.handles.len()].set_priority(Priority(priority));
                    s.priority = priority;
                }
            }
            Op::Clone { slot } => {
                if let Some(s) = self.slots[slot].as_mut() {
                    if s.handles.len() < MAX_HANDLES {
                        let c = s.handles[0].clone();
                        s.handles.push(c);
                    }
                }
            }
            Op::Drop { slot, handle } => match self.slots[slot].as_mut() {
                Some(s) if s.handles.len() > 1 => {
                    let h = handle % s.handles.len();
                    drop(s.handles.swap_remove(h));
                }
                _ => self.drop_fiber(slot),
            },
            Op::Wake { slot } => {
                if let Some(s) = self.slots[slot].as_mut() {
                    let waiter = s.cells.waiter.lock().unwrap().take();
                    if let Some(w) = waiter {
                        w.wake();
                    }
                    if let MState::Sleeping(func) = s.state.clone() {
                        note(Event::Woken);
                        // No home: the wake leaves it `Ready`.
                        s.state = MState::Ready(func);
                    }
                }
            }
            Op::WakeOrphan => {
                if let Some((w, id)) = self.orphans.pop_front() {
                    note(Event::OrphanWoken);
                    // Its last reference: the fiber is unwound here.
                    w.wake();
                    self.expected.push(Obs::LocalsDropped { current_id: Some(id), may_sleep: false });
                    self.drops += 1;
                }
            }
            Op::Queue { slot, handle, by_mut } => {
                let Some(s) = self.slots[slot].as_mut() else { return self.check(ctx) };
                let h = handle % s.handles.len();
                let got =
                    if by_mut { s.handles[h].mark_queued_mut(None) } else { s.handles[h].mark_queued(None) };
                let got = got.map(|home| home.is_some());
                let want = match s.state.clone() {
                    MState::Ready(func) => {
                        s.state = MState::Queued(func);
                        Ok(false)
                    }
                    other => Err(other.run_error(s.id)),
                };
                check_eq!(ctx, got, want, "mark_queued's result (Ok(true): it had a home)");
            }
            Op::Dequeue { slot, handle, by_mut } => {
                let Some(s) = self.slots[slot].as_mut() else { return self.check(ctx) };
                let h = handle % s.handles.len();
                let got =
                    if by_mut { s.handles[h].mark_dequeued_mut() } else { s.handles[h].mark_dequeued() };
                let want = match s.state.clone() {
                    MState::Queued(func) => {
                        note(Event::Dequeued);
                        s.state = MState::Ready(func);
                        Ok(())
                    }
                    MState::Ready(_) | MState::Empty | MState::Finished => Err(FiberError::NotQueued(s.id)),
                    MState::Sleeping(_) => Err(FiberError::Sleeping(s.id)),
                };
                check_eq!(ctx, got, want, "mark_dequeued's result");
            }
            Op::Abandon { slot, handle } => {
                let Some(s) = self.slots[slot].as_mut() else { return self.check(ctx) };
                let got = s.handles[handle % s.handles.len()].abandon();
                let want = match s.state.clone() {
                    MState::Ready(func) | MState::Queued(func) => {
                        note(Event::Abandoned);
                        s.state = MState::Ready(func);
                        Ok(())
                    }
                    other => Err(other.run_error(s.id)),
                };
                check_eq!(ctx, got, want, "abandon's result");
            }
        }
        self.check(ctx)
    }

    /// Everything observable from outside agrees with the model.
    fn check(&mut self, ctx: &str) -> Result<(), TestCaseError> {
        let recorded = std::mem::take(&mut *self.shared.log.lock().unwrap());
        let expected = std::mem::take(&mut self.expected);
        check_eq!(ctx, recorded, expected, "what the functions recorded");
        check_eq!(ctx, self.shared.drops.load(Ordering::Relaxed), self.drops, "guards dropped");
        check_eq!(ctx, current().map(|c| c.id()), None, "current() outside any fiber");
        check_eq!(ctx, current_id(), None, "current_id() outside any fiber");
        check_eq!(ctx, in_fiber(), false, "in_fiber() outside any fiber");
        for s in self.slots.iter().flatten() {
            let what = |field: &str| format!("{field} of fiber {} ({:?})", s.id, s.name);
            for f in &s.handles {
                check_eq!(ctx, f.id(), s.id, what("id"));
                check_eq!(ctx, f.name(), s.name.as_deref(), what("name"));
            }
            let f = &s.handles[0];
            check_eq!(ctx, f.state(), s.state.public(), what("state"));
            check_eq!(ctx, f.priority(), Priority(s.priority), what("priority"));
            let stats = f.stats();
            check_eq!(
                ctx,
                (stats.runs, stats.yields, stats.sleeps),
                (s.runs, s.yields, s.sleeps),
                what("stats")
            );
            check_eq!(ctx, stats.migrations, 0, what("migrations"));
            let published = s.cells.waiter.lock().unwrap().is_some();
            check_eq!(ctx, published, matches!(s.state, MState::Sleeping(_)), what("a published waiter"));
        }
        Ok(())
    }

    /// Wakes every sleeper and drops every fiber: every closure ever made
    /// has then been dropped exactly once.
    fn finish(mut self) -> Result<(), TestCaseError> {
        for slot in 0..SLOTS {
            self.apply(&Op::Wake { slot }, "cleanup")?;
            self.drop_fiber(slot);
            self.check("cleanup")?;
        }
        while !self.orphans.is_empty() {
            self.apply(&Op::WakeOrphan, "cleanup")?;
        }
        prop_assert_eq!(self.drops, self.closures, "the model lost count of its closures");
        Ok(())
    }
}

/// The fibers' first functions (a priority and a script each, or none),
/// and the operations.
type Case = (Vec<Option<(u8, Script)>>, Vec<Op>);

fn case() -> impl Strategy<Value = Case> {
    let first = prop::option::weighted(0.8, (any::<u8>(), script()));
    (prop::collection::vec(first, SLOTS), prop::collection::vec(op(), 1..48))
}

/// Runs one sequence of operations against the fibers and the model.
fn run_case((first, ops): &Case) -> Result<(), TestCaseError> {
    let leaked_before = leaked_stacks();
    let mut world = World::new();
    for (slot, first) in first.iter().enumerate() {
        world.make_fiber(slot, slot % 2 == 0)?;
        if let Some((priority, script)) = first {
            let op = Op::SetFunction { slot, handle: 0, priority: *priority, script: script.clone() };
            world.apply(&op, &format!("setup: {op:?}"))?;
        }
    }
    world.check("setup")?;
    for (i, op) in ops.iter().enumerate() {
        world.apply(op, &format!("op {i}: {op:?}"))?;
    }
    world.finish()?;
    prop_assert_eq!(leaked_stacks(), leaked_before, "stacks leaked");
    Ok(())
}

fn cases() -> u32 {
    match std::env::var("PROPTEST_CASES") {
        Ok(_) => Config::default().cases,
        Err(_) => DEFAULT_CASES,
    }
}

/// Any sequence of `set_function` (scripts that yield values, call
/// `yield_now`, sleep, look at `current()`, change their priority, try to
/// run or rewrite themselves, run another fiber nested, keep locals whose
/// destructors yield, and return or panic), `run`/`run_mut`, priority changes, clones and drops of handles
/// (dropping suspended, unstarted and sleeping fibers), wakes,
/// `mark_queued`/`mark_dequeued` (and their `_mut` forms) and `abandon` on
/// a few fibers behaves as the documented state machine says, step by
/// step: each run's `RunOutcome` (`Yielded(v)`, `Returned(v)`, `Slept`,
/// `Panicked` with the fiber's id, name and message) or `FiberError`
/// variant is the model's, nested runs included; so are the state,
/// priority and stats (runs, yields, sleeps; no migrations) after every
/// operation, and what `current()` says inside (id, name, priority, also
/// around a nested run) and outside (`None`). A refused `set_function`
/// leaves the fiber as it was. Every closure's captures and every
/// function's locals are dropped exactly once, when the model says (at the
/// end of the function, when `set_function` replaces an unstarted one or
/// refuses a new one, or when the last reference to a suspended fiber
/// goes, then with the fiber current and `may_sleep()` false, a yield in
/// a destructor yielding the thread), and no stack is leaked.
#[test]
fn fiber_lifecycle_follows_the_model() {
    assert!(ALL_EVENTS.iter().enumerate().all(|(i, &e)| e as usize == i), "ALL_EVENTS in declaration order");
    watchdog("fiber_lifecycle_follows_the_model", 120, |stage| {
        let config = Config { cases: cases(), failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new(config);
        let cases_run = AtomicUsize::new(0);
        let result = runner.run(&case(), |case| {
            let n = cases_run.fetch_add(1, Ordering::Relaxed);
            stage.set(format!("case {n}, {} operations", case.1.len()));
            run_case(&case)
        });
        match result {
            Ok(()) => {}
            Err(TestError::Fail(why, (first, ops))) => panic!(
                "{why}\nminimal failing case: first functions {first:#?}\nand {} operations:\n{ops:#?}",
                ops.len()
            ),
            Err(e) => panic!("{e}"),
        }
        // With the default number of cases every path is taken many times
        // over (the rarest, a few dozen times in trial runs).
        if cases() >= DEFAULT_CASES {
            let tally: Vec<usize> = TALLY.iter().map(|n| n.load(Ordering::Relaxed)).collect();
            let missed: Vec<Event> = ALL_EVENTS.into_iter().filter(|&e| tally[e as usize] == 0).collect();
            assert!(missed.is_empty(), "never exercised: {missed:?} (tally {tally:?})");
        }
    });
}
