//! Model-based property tests: random sequences of operations on a run
//! queue and on the synchronisation primitives, each step checked against
//! a simple reference model (what the docs promise), shrunk by proptest to
//! a minimal failing sequence when a step disagrees.
//!
//! The run queue, channels, semaphore and mutex are first driven from
//! the test's thread alone, through their forms that do not wait; then
//! fibers wait on each primitive, run one at a time from a run queue, while
//! the thread releases, pushes, closes and interrupts.
//!
//! Each property runs its whole proptest loop under a watchdog: a step
//! that blocks where the model says it cannot fails the test with the
//! sequence that hung. `PROPTEST_CASES` changes the number of cases of
//! every property here (each has its own default, sized so that the file
//! runs in a few seconds in a debug build).

mod common;

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{FileFailurePersistence, TestCaseResult, TestRunner};

use common::{watchdog_with_progress, Counted, DropCounter};
use spindle_fiber::{yield_value, Fiber, FiberAttr, FiberError, FiberId, FiberState, Priority, RunOutcome};
use spindle_run_queue::{PushError, RunQueue, RunQueueStats};
use spindle_sync::{Channel, Closed, Interrupted, Msg, MsgHeader, Mutex, RawChannel, Semaphore, TimedOut};

/// Usable stack of every fiber here: they only yield and return.
const STACK: usize = 16 * 1024;

/// Seconds without a finished case before a property's watchdog calls
/// it hung (a case takes milliseconds; a slow machine only makes the whole
/// run longer, which the watchdog tolerates).
const WATCHDOG_SECS: u64 = 60;

/// Runs `test` on `cases` inputs from `strategy` (or `PROPTEST_CASES`),
/// under a watchdog that fails the test, naming the case being run, if no
/// case finishes for `WATCHDOG_SECS`; panics with proptest's minimal
/// failing input if a case fails.
fn check<S, G, F>(name: &'static str, cases: u32, strategy: G, test: F)
where
    S: Strategy + 'static,
    S::Value: Debug,
    G: FnOnce() -> S + Send + 'static,
    F: Fn(S::Value) -> TestCaseResult + Send + 'static,
{
    let done = Arc::new(AtomicU64::new(0));
    let progress = {
        let done = done.clone();
        move || done.load(Ordering::Relaxed)
    };
    let status = {
        let done = done.clone();
        move || format!("{} cases finished", done.load(Ordering::Relaxed))
    };
    watchdog_with_progress(name, WATCHDOG_SECS, status, progress, move |stage| {
        let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
        let config = ProptestConfig {
            cases,
            source_file: Some(file!()),
            // Minimal failing cases are kept next to this file.
            failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
            ..ProptestConfig::default()
        };
        let mut runner = TestRunner::new(config);
        let result = runner.run(&strategy(), |input| {
            stage.set(format!("running the case {input:?}"));
            let r = test(input);
            done.fetch_add(1, Ordering::Relaxed);
            r
        });
        if let Err(e) = result {
            panic!("{name}: {e}");
        }
    })
}

/// A priority, mostly from a few values (so that levels are shared and
/// FIFO order among equals is exercised), sometimes any.
fn priority() -> impl Strategy<Value = u8> {
    prop_oneof![4 => prop::sample::select(vec![0u8, 1, 128, 254, 255]), 1 => any::<u8>()]
}

// ---------------------------------------------------------------------------
// RunQueue
// ---------------------------------------------------------------------------

/// An operation on a run queue, with the fibers the test holds ("in
/// hand": created, popped, refused or returned by `run_next`) picked by
/// index.
#[derive(Debug, Clone)]
enum QueueOp {
    /// A new fiber in hand: a function that yields `yields` times and
    /// returns, or none.
    Create {
        prio: u8,
        yields: Option<u8>,
    },
    /// A new fiber with a function, pushed at once.
    Spawn {
        prio: u8,
        yields: u8,
    },
    /// `try_push` of a fiber in hand.
    Push(Index),
    TryPop,
    /// `pop_timeout(Duration::ZERO)`: documented as `try_pop`.
    PopZero,
    /// `pop`, only when the model says it does not wait (something is
    /// queued, or the queue is closed); skipped otherwise.
    Pop,
    /// `pop_timeout` of an hour, under the same condition as `Pop`.
    PopLong,
    RunNext,
    /// `run_popped` of a fiber in hand.
    RunPopped(Index),
    /// `requeue` of a fiber in hand.
    Requeue(Index),
    /// `set_function` again on a fiber in hand (reuse).
    Reuse {
        at: Index,
        prio: u8,
        yields: u8,
    },
    /// `RunQueue::set_priority`: moves a queued fiber at once.
    QueueSetPriority {
        at: Index,
        prio: u8,
    },
    /// `Fiber::set_priority`: takes effect at the next push.
    FiberSetPriority {
        at: Index,
        prio: u8,
    },
    /// Drops a handle in hand.
    Drop(Index),
    Close,
}

fn queue_ops() -> impl Strategy<Value = (usize, Vec<QueueOp>)> {
    let yields = || 0u8..3;
    let op = prop_oneof![
        2 => (priority(), prop::option::weighted(0.85, yields()))
            .prop_map(|(prio, yields)| QueueOp::Create { prio, yields }),
        5 => (priority(), yields()).prop_map(|(prio, yields)| QueueOp::Spawn { prio, yields }),
        4 => any::<Index>().prop_map(QueueOp::Push),
        3 => Just(QueueOp::TryPop),
        1 => Just(QueueOp::PopZero),
        1 => Just(QueueOp::Pop),
        1 => Just(QueueOp::PopLong),
        4 => Just(QueueOp::RunNext),
        2 => any::<Index>().prop_map(QueueOp::RunPopped),
        1 => any::<Index>().prop_map(QueueOp::Requeue),
        1 => (any::<Index>(), priority(), yields())
            .prop_map(|(at, prio, yields)| QueueOp::Reuse { at, prio, yields }),
        1 => (any::<Index>(), priority()).prop_map(|(at, prio)| QueueOp::QueueSetPriority { at, prio }),
        1 => (any::<Index>(), priority()).prop_map(|(at, prio)| QueueOp::FiberSetPriority { at, prio }),
        1 => any::<Index>().prop_map(QueueOp::Drop),
        1 => Just(QueueOp::Close),
    ];
    (1usize..=5, prop::collection::vec(op, 1..60))
}

/// What the model knows of one fiber (its tag is its index in
/// `QueueModel::fibers`; its function yields and returns that tag).
#[derive(Debug)]
struct FiberModel {
    id: FiberId,
    prio: u8,
    /// Yields left before its function returns.
    yields_left: u8,
    /// Whether its function has run (so `set_function` says `Busy`).
    started: bool,
    state: FiberState,
}

/// The reference: one FIFO per priority, highest first, admission bounded
/// by the capacity, closed for good once closed.
#[derive(Debug)]
struct QueueModel {
    capacity: usize,
    closed: bool,
    /// Non-empty levels only.
    levels: BTreeMap<u8, VecDeque<usize>>,
    stats: RunQueueStats,
    fibers: Vec<FiberModel>,
}

impl QueueModel {
    fn len(&self) -> usize {
        self.levels.values().map(VecDeque::len).sum()
    }

    /// A fiber enters the queue, at the back of its level.
    fn enqueue(&mut self, tag: usize) {
        let f = &mut self.fibers[tag];
        f.state = FiberState::Queued;
        self.levels.entry(f.prio).or_default().push_back(tag);
        self.stats.pushes += 1;
    }

    /// The front of the highest level, counted as a pop (or an empty pop).
    fn pop(&mut self) -> Option<usize> {
        let Some(mut level) = self.levels.last_entry() else {
            self.stats.empty_pops += 1;
            return None;
        };
        let tag = level.get_mut().pop_front().expect("levels in the model are non-empty");
        if level.get().is_empty() {
            level.remove();
        }
        self.fibers[tag].state = FiberState::Ready;
        self.stats.pops += 1;
        Some(tag)
    }

    /// What `run` (and `check_ready`) says of a fiber that is not `Ready`.
    fn not_ready(&self, tag: usize) -> FiberError {
        let f = &self.fibers[tag];
        match f.state {
            FiberState::Empty => FiberError::NoFunction(f.id),
            FiberState::Finished => FiberError::Finished(f.id),
            FiberState::Queued => FiberError::Queued(f.id),
            other => unreachable!("the model has no fiber {other:?} between steps"),
        }
    }

    /// Checks the outcome of running fiber `tag` (popped, or in hand) and
    /// updates the model: a ready fiber yields its tag (and goes back to
    /// the queue) or returns it; any other says why it cannot run.
    fn ran(&mut self, tag: usize, outcome: Result<RunOutcome<usize>, FiberError>) -> TestCaseResult {
        if self.fibers[tag].state != FiberState::Ready {
            let expected = self.not_ready(tag);
            prop_assert!(
                matches!(outcome, Err(e) if e == expected),
                "running fiber {tag}: expected {expected:?}"
            );
            return Ok(());
        }
        let f = &mut self.fibers[tag];
        if f.yields_left > 0 {
            prop_assert!(
                matches!(outcome, Ok(RunOutcome::Yielded(t)) if t == tag),
                "fiber {tag} should have yielded its tag, got {outcome:?}"
            );
            f.yields_left -= 1;
            f.started = true;
            // Yielded in run_popped/run_next: back into the queue, past the
            // capacity and the close.
            self.enqueue(tag);
        } else {
            prop_assert!(
                matches!(outcome, Ok(RunOutcome::Returned(t)) if t == tag),
                "fiber {tag} should have returned its tag, got {outcome:?}"
            );
            f.state = FiberState::Finished;
            f.started = false;
        }
        Ok(())
    }
}

/// The function of fiber `tag`: yields its tag `yields` times, then
/// returns it.
fn yielder(tag: usize, yields: u8) -> impl FnOnce() -> usize + Send + 'static {
    move || {
        for _ in 0..yields {
            yield_value(tag);
        }
        tag
    }
}

fn new_fiber() -> Fiber<usize> {
    Fiber::new(FiberAttr::new().stack_size(STACK)).expect("creating a fiber")
}

/// Checks that a fiber came back untouched: the same fiber, in the state
/// and at the priority the model has for it.
fn same_fiber(model: &QueueModel, tag: usize, fiber: &Fiber<usize>, what: &str) -> TestCaseResult {
    let m = &model.fibers[tag];
    prop_assert_eq!(fiber.id(), m.id, "{}: another fiber than {}", what, tag);
    prop_assert_eq!(fiber.state(), m.state, "{}: fiber {} state", what, tag);
    prop_assert_eq!(fiber.priority(), Priority(m.prio), "{}: fiber {} priority", what, tag);
    Ok(())
}

fn run_queue_case(capacity: usize, ops: Vec<QueueOp>) -> TestCaseResult {
    let queue = RunQueue::<usize>::new(capacity);
    let mut model = QueueModel {
        capacity,
        closed: false,
        levels: BTreeMap::new(),
        stats: RunQueueStats::default(),
        fibers: vec![],
    };
    // (tag, handle): fibers the test holds. A handle to a queued fiber
    // (from `run_next` after a yield, or `requeue`) is one too.
    let mut hand: Vec<(usize, Fiber<usize>)> = Vec::new();
    for (step, op) in ops.into_iter().enumerate() {
        let pick =
            |at: &Index, hand: &Vec<(usize, Fiber<usize>)>| (!hand.is_empty()).then(|| at.index(hand.len()));
        match op {
            QueueOp::Create { prio, yields } => {
                let tag = model.fibers.len();
                let fiber = new_fiber();
                let (prio, state) = match yields {
                    Some(y) => {
                        fiber
                            .set_function(Priority(prio), yielder(tag, y))
                            .expect("set_function on a new fiber");
                        (prio, FiberState::Ready)
                    }
                    None => (Priority::NORMAL.0, FiberState::Empty),
                };
                model.fibers.push(FiberModel {
                    id: fiber.id(),
                    prio,
                    yields_left: yields.unwrap_or(0),
                    started: false,
                    state,
                });
                hand.push((tag, fiber));
            }
            QueueOp::Spawn { prio, yields } => {
                let tag = model.fibers.len();
                let fiber = new_fiber();
                fiber
                    .set_function(Priority(prio), yielder(tag, yields))
                    .expect("set_function on a new fiber");
                model.fibers.push(FiberModel {
                    id: fiber.id(),
                    prio,
                    yields_left: yields,
                    started: false,
                    state: FiberState::Ready,
                });
                hand.push((tag, fiber));
                push_last(&queue, &mut model, &mut hand)?;
            }
            QueueOp::Push(at) => {
                if let Some(i) = pick(&at, &hand) {
                    let last = hand.len() - 1;
                    hand.swap(i, last);
                    push_last(&queue, &mut model, &mut hand)?;
                }
            }
            QueueOp::TryPop | QueueOp::PopZero | QueueOp::Pop | QueueOp::PopLong => {
                let popped = match op {
                    QueueOp::TryPop => queue.try_pop(),
                    QueueOp::PopZero => queue.pop_timeout(Duration::ZERO),
                    // These wait while the queue is open and empty.
                    _ if model.len() == 0 && !model.closed => continue,
                    QueueOp::Pop => queue.pop(),
                    _ => queue.pop_timeout(Duration::from_secs(3600)),
                };
                match (model.pop(), popped) {
                    (None, None) => {}
                    (Some(tag), Some(fiber)) => {
                        same_fiber(&model, tag, &fiber, "popped")?;
                        hand.push((tag, fiber));
                    }
                    (expected, got) => prop_assert!(
                        false,
                        "step {step} {op:?}: expected fiber {expected:?}, popped {:?}",
                        got.map(|f| f.id())
                    ),
                }
            }
            QueueOp::RunNext => match (model.pop(), queue.run_next()) {
                (None, None) => {}
                (Some(tag), Some(ran)) => {
                    prop_assert_eq!(
                        ran.fiber.id(),
                        model.fibers[tag].id,
                        "run_next ran another fiber than {}",
                        tag
                    );
                    model.ran(tag, ran.outcome)?;
                    hand.push((tag, ran.fiber));
                }
                (expected, got) => prop_assert!(
                    false,
                    "step {step} run_next: expected fiber {expected:?}, ran {:?}",
                    got.map(|r| r.fiber.id())
                ),
            },
            QueueOp::RunPopped(at) => {
                if let Some(i) = pick(&at, &hand) {
                    let (tag, fiber) = hand.swap_remove(i);
                    let ran = queue.run_popped(fiber);
                    prop_assert_eq!(ran.fiber.id(), model.fibers[tag].id);
                    model.ran(tag, ran.outcome)?;
                    hand.push((tag, ran.fiber));
                }
            }
            QueueOp::Requeue(at) => {
                if let Some(i) = pick(&at, &hand) {
                    let tag = hand[i].0;
                    let result = queue.requeue(&hand[i].1);
                    if model.fibers[tag].state == FiberState::Ready {
                        prop_assert_eq!(result, Ok(()), "requeue of ready fiber {}", tag);
                        // Not bounded by the capacity, nor refused once closed.
                        model.enqueue(tag);
                    } else {
                        prop_assert_eq!(result, Err(model.not_ready(tag)), "requeue of fiber {}", tag);
                    }
                }
            }
            QueueOp::Reuse { at, prio, yields } => {
                if let Some(i) = pick(&at, &hand) {
                    let tag = hand[i].0;
                    let result = hand[i].1.set_function(Priority(prio), yielder(tag, yields));
                    let m = &mut model.fibers[tag];
                    let expected = match m.state {
                        FiberState::Empty | FiberState::Finished => Ok(()),
                        FiberState::Ready if !m.started => Ok(()),
                        FiberState::Ready => Err(FiberError::Busy(m.id)),
                        FiberState::Queued => Err(FiberError::Queued(m.id)),
                        other => unreachable!("no fiber is {other:?} between steps"),
                    };
                    prop_assert_eq!(result, expected, "set_function on fiber {}", tag);
                    if expected.is_ok() {
                        *m = FiberModel {
                            id: m.id,
                            prio,
                            yields_left: yields,
                            started: false,
                            state: FiberState::Ready,
                        };
                    }
                }
            }
            QueueOp::QueueSetPriority { at, prio } => {
                if let Some(i) = pick(&at, &hand) {
                    let tag = hand[i].0;
                    queue.set_priority(&hand[i].1, Priority(prio));
                    model.fibers[tag].prio = prio;
                    if model.fibers[tag].state == FiberState::Queued {
                        // Moved at once, behind the fibers of its new level
                        // (from the level it was queued at, which a
                        // `Fiber::set_priority` since then did not change).
                        let (&old, level) = model
                            .levels
                            .iter_mut()
                            .find(|(_, fifo)| fifo.contains(&tag))
                            .expect("a queued fiber is in a level");
                        level.retain(|&t| t != tag);
                        if level.is_empty() {
                            model.levels.remove(&old);
                        }
                        model.levels.entry(prio).or_default().push_back(tag);
                    }
                }
            }
            QueueOp::FiberSetPriority { at, prio } => {
                if let Some(i) = pick(&at, &hand) {
                    // A queued fiber keeps its place; the next push uses it.
                    hand[i].1.set_priority(Priority(prio));
                    model.fibers[hand[i].0].prio = prio;
                }
            }
            QueueOp::Drop(at) => {
                if let Some(i) = pick(&at, &hand) {
                    drop(hand.swap_remove(i));
                }
            }
            QueueOp::Close => {
                prop_assert_eq!(queue.close(), !model.closed, "close says whether it closed the queue");
                model.closed = true;
            }
        }
        check_queue(&queue, &model, &hand)
            .map_err(|e| TestCaseError::fail(format!("after step {step}: {e}")))?;
    }
    // Whatever is left comes out in the model's order.
    while let Some(tag) = model.pop() {
        let fiber = queue.try_pop();
        prop_assert_eq!(
            fiber.map(|f| f.id()),
            Some(model.fibers[tag].id),
            "draining: expected fiber {}",
            tag
        );
    }
    prop_assert!(queue.try_pop().is_none() && queue.is_empty());
    Ok(())
}

/// `try_push` of the last fiber in hand: accepted (into the model), or
/// handed back untouched with the documented error.
fn push_last(
    queue: &RunQueue<usize>,
    model: &mut QueueModel,
    hand: &mut Vec<(usize, Fiber<usize>)>,
) -> TestCaseResult {
    let (tag, fiber) = hand.pop().expect("a fiber in hand");
    let state = model.fibers[tag].state;
    let result = queue.try_push(fiber);
    let back = match result {
        Ok(()) => {
            prop_assert!(
                !model.closed && state == FiberState::Ready && model.len() < model.capacity,
                "fiber {tag} ({state:?}) accepted, closed {}, len {} of {}",
                model.closed,
                model.len(),
                model.capacity
            );
            model.enqueue(tag);
            return Ok(());
        }
        Err(PushError::Closed(f)) => {
            prop_assert!(model.closed, "fiber {tag} refused as closed by an open queue");
            f
        }
        Err(PushError::NotReady(f, e)) => {
            prop_assert!(!model.closed, "fiber {tag}: NotReady from a closed queue");
            prop_assert_eq!(e, model.not_ready(tag), "fiber {} refused as not ready", tag);
            f
        }
        Err(PushError::Full(f)) => {
            prop_assert!(
                !model.closed && state == FiberState::Ready && model.len() >= model.capacity,
                "fiber {tag} ({state:?}) refused as full, closed {}, len {} of {}",
                model.closed,
                model.len(),
                model.capacity
            );
            model.stats.full_pushes += 1;
            f
        }
        Err(other) => return Err(TestCaseError::fail(format!("fiber {tag}: unexpected {other:?}"))),
    };
    same_fiber(model, tag, &back, "handed back by try_push")?;
    hand.push((tag, back));
    Ok(())
}

/// The queue's observable state against the model's.
fn check_queue(
    queue: &RunQueue<usize>,
    model: &QueueModel,
    hand: &[(usize, Fiber<usize>)],
) -> TestCaseResult {
    prop_assert_eq!(queue.len(), model.len(), "len");
    prop_assert_eq!(queue.is_empty(), model.len() == 0, "is_empty");
    prop_assert_eq!(queue.is_closed(), model.closed, "is_closed");
    prop_assert_eq!(queue.capacity(), model.capacity, "capacity");
    let stats = queue.stats();
    prop_assert_eq!(stats, model.stats, "stats");
    prop_assert_eq!(stats.pushes - stats.pops, queue.len() as u64, "pushes - pops is the length");
    for (tag, fiber) in hand {
        same_fiber(model, *tag, fiber, "in hand")?;
    }
    Ok(())
}

/// A run queue driven by random pushes (new and held fibers of random
/// priorities, refused ones handed back untouched), pops in every
/// non-waiting form, runs of fibers that yield and return, requeues,
/// function reuse, priority changes and a close behaves as the model: one
/// FIFO per priority, highest first (every popped or run fiber is the one
/// the model names), admission bounded by the capacity (`Full`), refused
/// for fibers that are not ready (`NotReady` with the fiber's own error)
/// and after the close (`Closed`, checked first), while yields and
/// requeues come back past both; `len`, `is_empty`, `is_closed` and the
/// counters (`pushes - pops` is the length) agree after every step.
#[test]
fn run_queue_follows_the_priority_fifo_model() {
    check("run_queue_follows_the_priority_fifo_model", 192, queue_ops, |(capacity, ops)| {
        run_queue_case(capacity, ops)
    });
}

// ---------------------------------------------------------------------------
// Channel
// ---------------------------------------------------------------------------

/// An operation on a `Channel<Counted>` from one thread.
#[derive(Debug, Clone)]
enum ChanOp {
    /// Pushes a new message (`Msg::new`, or `.into()` when `from`).
    Push {
        from: bool,
    },
    /// Pushes again a message the test holds (popped, or handed back by
    /// a refused push), its value changed in place.
    Repush(Index),
    TryPop,
    /// `pop` (and `pop_interruptible`, which a thread waits in as in
    /// `pop`), only when the model says it does not wait.
    Pop {
        interruptible: bool,
    },
    /// `pop_timeout(Duration::ZERO)`.
    PopZero,
    /// `pop_until` a deadline already past.
    PopPast,
    /// Drops a message the test holds.
    DropHeld(Index),
    Close,
}

fn chan_ops() -> impl Strategy<Value = Vec<ChanOp>> {
    let op = prop_oneof![
        5 => any::<bool>().prop_map(|from| ChanOp::Push { from }),
        3 => any::<Index>().prop_map(ChanOp::Repush),
        4 => Just(ChanOp::TryPop),
        2 => any::<bool>().prop_map(|interruptible| ChanOp::Pop { interruptible }),
        1 => Just(ChanOp::PopZero),
        1 => Just(ChanOp::PopPast),
        1 => any::<Index>().prop_map(ChanOp::DropHeld),
        1 => Just(ChanOp::Close),
    ];
    prop::collection::vec(op, 1..80)
}

/// A message's identity: its value and its allocation (the channel hands
/// back the caller's own message, not a copy).
fn msg_key(m: &Msg<Counted>) -> (u64, usize) {
    (m.1, &**m as *const Counted as usize)
}

fn channel_case(ops: Vec<ChanOp>) -> TestCaseResult {
    let drops = DropCounter::default();
    let mut made = 0u64;
    let mut dropped_by_test = 0usize;
    let chan = Channel::<Counted>::new();
    let mut queued: VecDeque<(u64, usize)> = VecDeque::new();
    let mut closed = false;
    let mut held: Vec<Msg<Counted>> = Vec::new();
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            ChanOp::Push { .. } | ChanOp::Repush(_) => {
                made += 1;
                let msg = match op {
                    ChanOp::Push { from: false } => Msg::new(drops.make(made)),
                    ChanOp::Push { from: true } => drops.make(made).into(),
                    ChanOp::Repush(at) if !held.is_empty() => {
                        let mut m = held.swap_remove(at.index(held.len()));
                        // The old value is dropped here, the new one takes
                        // its place in the same allocation.
                        *m = drops.make(made);
                        dropped_by_test += 1;
                        m
                    }
                    _ => {
                        made -= 1;
                        continue;
                    }
                };
                let key = msg_key(&msg);
                match chan.push(msg) {
                    Ok(()) => {
                        prop_assert!(!closed, "step {step}: a closed channel took a message");
                        queued.push_back(key);
                    }
                    Err(Closed(m)) => {
                        prop_assert!(closed, "step {step}: an open channel refused a message");
                        prop_assert_eq!(msg_key(&m), key, "a refused message comes back as it was");
                        held.push(m);
                    }
                }
            }
            ChanOp::TryPop | ChanOp::Pop { .. } | ChanOp::PopZero | ChanOp::PopPast => {
                let got: Result<Option<Msg<Counted>>, TimedOut> = match op {
                    ChanOp::TryPop => Ok(chan.try_pop()),
                    ChanOp::PopZero => chan.pop_timeout(Duration::ZERO),
                    ChanOp::PopPast => chan.pop_until(Instant::now()),
                    // These wait while the channel is open and empty.
                    _ if queued.is_empty() && !closed => continue,
                    ChanOp::Pop { interruptible: false } => Ok(chan.pop()),
                    _ => {
                        Ok(chan.pop_interruptible().expect("a thread's pop_interruptible is not interrupted"))
                    }
                };
                let expected = match queued.pop_front() {
                    Some(key) => Ok(Some(key)),
                    // try_pop: None whether closed or not; the others tell
                    // a closed channel (None) from an open one (timed out).
                    None if closed || matches!(op, ChanOp::TryPop) => Ok(None),
                    None => Err(TimedOut),
                };
                let got = got.map(|m| {
                    m.map(|m| {
                        let key = msg_key(&m);
                        held.push(m);
                        key
                    })
                });
                prop_assert_eq!(got, expected, "step {} {:?}", step, op);
            }
            ChanOp::DropHeld(at) => {
                if !held.is_empty() {
                    drop(held.swap_remove(at.index(held.len())));
                    dropped_by_test += 1;
                }
            }
            ChanOp::Close => {
                prop_assert_eq!(chan.close(), !closed, "close says whether it closed the channel");
                closed = true;
            }
        }
        prop_assert_eq!(chan.len(), queued.len(), "len after step {}", step);
        prop_assert_eq!(chan.is_empty(), queued.is_empty(), "is_empty after step {}", step);
        prop_assert_eq!(chan.is_closed(), closed, "is_closed after step {}", step);
        prop_assert_eq!(chan.receivers(), 0, "receivers after step {}", step);
        prop_assert_eq!(drops.drops(), dropped_by_test, "the channel dropped a message (step {})", step);
    }
    // Dropping the channel drops what it still holds, each once.
    let still_queued = queued.len();
    drop(chan);
    prop_assert_eq!(drops.drops(), dropped_by_test + still_queued, "messages dropped with the channel");
    drop(held);
    prop_assert_eq!(drops.drops() as u64, made, "every message dropped exactly once");
    Ok(())
}

/// A channel used from one thread through its non-waiting forms (and
/// `pop`/`pop_interruptible` only when a message is queued or the
/// channel is closed) behaves as a FIFO: every pop returns the oldest
/// queued message, the caller's own allocation with its value; `try_pop`
/// gives `None` when empty, the timed forms `TimedOut` when open and
/// empty and `Ok(None)` when closed and empty; after `close` (which says
/// whether it closed it) pushes hand the message back untouched in
/// `Closed` while queued messages are still received in order; popped and
/// refused messages can be changed in place and pushed again; the channel
/// never drops a message it holds, and its drop drops each queued one
/// exactly once.
#[test]
fn channel_follows_the_fifo_model() {
    check("channel_follows_the_fifo_model", 256, chan_ops, channel_case);
}

/// An operation on a `RawChannel` with a fixed set of caller-owned headers.
#[derive(Debug, Clone)]
enum RawOp {
    /// Pushes header `i`; one still on the channel must panic.
    Push(Index),
    TryPop,
    /// `pop`, only when the model says it does not wait.
    Pop,
    PopZero,
    Close,
}

fn raw_ops() -> impl Strategy<Value = Vec<RawOp>> {
    let op = prop_oneof![
        4 => any::<Index>().prop_map(RawOp::Push),
        3 => Just(RawOp::TryPop),
        1 => Just(RawOp::Pop),
        1 => Just(RawOp::PopZero),
        1 => Just(RawOp::Close),
    ];
    prop::collection::vec(op, 1..60)
}

/// Header blocks owned by the test: freed on drop, after the channel
/// (declared after this) is gone.
struct Headers {
    payload: Box<[u8; 64]>,
    hdrs: Vec<NonNull<MsgHeader>>,
}

impl Headers {
    fn new(n: usize) -> Headers {
        let mut payload = Box::new([0u8; 64]);
        let base = payload.as_mut_ptr();
        let hdrs = (0..n)
            .map(|i| {
                // Each header describes its own slice of the payload.
                let hdr = MsgHeader::new(base.wrapping_add(i * 8), i + 1);
                NonNull::from(Box::leak(Box::new(hdr)))
            })
            .collect();
        Headers { payload, hdrs }
    }

    /// Whether `hdr` still describes the slice it was made with.
    fn intact(&self, i: usize) -> bool {
        // SAFETY: called only while header `i` is not on a channel.
        let h = unsafe { self.hdrs[i].as_ref() };
        std::ptr::eq(h.buf, self.payload.as_ptr().wrapping_add(i * 8)) && h.len == i + 1
    }
}

impl Drop for Headers {
    fn drop(&mut self) {
        for h in &self.hdrs {
            // SAFETY: made by Box::leak in `new`; every channel that held
            // it is gone.
            drop(unsafe { Box::from_raw(h.as_ptr()) });
        }
    }
}

fn raw_channel_case(ops: Vec<RawOp>) -> TestCaseResult {
    const N: usize = 4;
    let headers = Headers::new(N);
    let chan = RawChannel::new();
    let mut queued: VecDeque<usize> = VecDeque::new();
    let mut closed = false;
    let index_of = |p: NonNull<MsgHeader>| headers.hdrs.iter().position(|&h| h == p);
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            RawOp::Push(at) => {
                let i = at.index(N);
                let hdr = headers.hdrs[i];
                // SAFETY: a live header made by MsgHeader::new, which the
                // test does not touch while the channel holds it; one push
                // at a time.
                let pushed = catch_unwind(AssertUnwindSafe(|| unsafe { chan.push(hdr) }));
                match pushed {
                    Err(_) => prop_assert!(queued.contains(&i), "step {step}: push of header {i} panicked"),
                    Ok(_) if queued.contains(&i) => {
                        // Its queue may now be a cycle: not dropped.
                        std::mem::forget(chan);
                        return Err(TestCaseError::fail(format!(
                            "step {step}: header {i} pushed twice without a panic"
                        )));
                    }
                    Ok(Ok(())) => {
                        prop_assert!(!closed, "step {step}: a closed channel took header {i}");
                        queued.push_back(i);
                    }
                    Ok(Err(Closed(back))) => {
                        prop_assert!(closed, "step {step}: an open channel refused header {i}");
                        prop_assert_eq!(back, hdr, "a refused header comes back");
                    }
                }
            }
            RawOp::TryPop | RawOp::Pop | RawOp::PopZero => {
                let got = match op {
                    RawOp::TryPop => Ok(chan.try_pop()),
                    RawOp::PopZero => chan.pop_timeout(Duration::ZERO),
                    _ if queued.is_empty() && !closed => continue,
                    _ => Ok(chan.pop()),
                };
                let expected = match queued.pop_front() {
                    Some(i) => Ok(Some(i)),
                    None if closed || matches!(op, RawOp::TryPop) => Ok(None),
                    None => Err(TimedOut),
                };
                let got = got.map(|h| h.map(|h| index_of(h).expect("one of the test's headers")));
                prop_assert_eq!(got, expected, "step {} {:?}", step, op);
                if let Ok(Some(i)) = got {
                    prop_assert!(headers.intact(i), "header {} came back changed", i);
                }
            }
            RawOp::Close => {
                prop_assert_eq!(chan.close(), !closed);
                closed = true;
            }
        }
        prop_assert_eq!(chan.len(), queued.len(), "len after step {}", step);
        prop_assert_eq!(chan.is_empty(), queued.is_empty());
        prop_assert_eq!(chan.is_closed(), closed);
    }
    // The drop lets go of the headers still queued: each may be pushed
    // again elsewhere.
    drop(chan);
    let again = RawChannel::new();
    for (i, &h) in headers.hdrs.iter().enumerate() {
        prop_assert!(headers.intact(i), "header {} changed", i);
        // SAFETY: as above; no channel holds it now.
        prop_assert!(unsafe { again.push(h) }.is_ok(), "header {} still marked queued after the drop", i);
    }
    while again.try_pop().is_some() {}
    Ok(())
}

/// A raw channel of caller-owned headers is a FIFO of those headers
/// (returned by pointer, their `buf`/`len` untouched); a push of a header
/// still on the channel panics and queues nothing; after `close` pushes
/// hand the header back in `Closed`; a dropped channel lets go of the
/// headers it held, so they can be pushed elsewhere.
#[test]
fn raw_channel_follows_the_fifo_model() {
    check("raw_channel_follows_the_fifo_model", 256, raw_ops, raw_channel_case);
}

// ---------------------------------------------------------------------------
// Semaphore
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum SemOp {
    TryAcquire,
    Release(usize),
    /// `release(usize::MAX)`: overflows unless no token is available.
    ReleaseMax,
    /// `acquire_timeout(Duration::ZERO)`.
    AcquireZero,
    /// `acquire_until` a deadline already past.
    AcquirePast,
    /// A waiting form (`acquire`, `acquire_for`, `acquire_with_priority`,
    /// `acquire_interruptible`, picked by the number), only when a token
    /// is available.
    Acquire(u8),
}

fn sem_ops() -> impl Strategy<Value = (usize, Vec<SemOp>)> {
    let op = prop_oneof![
        4 => Just(SemOp::TryAcquire),
        4 => (0usize..4).prop_map(SemOp::Release),
        1 => Just(SemOp::ReleaseMax),
        1 => Just(SemOp::AcquireZero),
        1 => Just(SemOp::AcquirePast),
        2 => (0u8..4).prop_map(SemOp::Acquire),
    ];
    let start = prop_oneof![0usize..4, (0usize..4).prop_map(|k| usize::MAX - k)];
    (start, prop::collection::vec(op, 1..60))
}

static SEM_REASON: spindle_fiber::WaitReason = spindle_fiber::WaitReason("the model");

fn semaphore_case(start: usize, ops: Vec<SemOp>) -> TestCaseResult {
    let sem = Semaphore::new(start);
    let mut tokens = start;
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            SemOp::TryAcquire | SemOp::AcquireZero | SemOp::AcquirePast => {
                let got = match op {
                    SemOp::TryAcquire => sem.try_acquire(),
                    SemOp::AcquireZero => sem.acquire_timeout(Duration::ZERO),
                    _ => sem.acquire_until(Instant::now()),
                };
                prop_assert_eq!(got, tokens > 0, "step {} {:?} with {} tokens", step, op, tokens);
                tokens -= usize::from(got);
            }
            SemOp::Release(_) | SemOp::ReleaseMax => {
                let n = if let SemOp::Release(n) = op { n } else { usize::MAX };
                let released = catch_unwind(AssertUnwindSafe(|| sem.release(n)));
                match tokens.checked_add(n) {
                    Some(t) => {
                        prop_assert!(released.is_ok(), "step {step}: release({n}) of {tokens} panicked");
                        tokens = t;
                    }
                    // Documented: panics if the count would pass usize::MAX;
                    // nothing is added.
                    None => {
                        prop_assert!(released.is_err(), "step {step}: release({n}) of {tokens} overflowed")
                    }
                }
            }
            SemOp::Acquire(form) => {
                if tokens == 0 {
                    continue;
                }
                match form {
                    0 => sem.acquire(),
                    1 => sem.acquire_for(&SEM_REASON),
                    2 => sem.acquire_with_priority(Priority::HIGH),
                    _ => prop_assert!(sem.acquire_interruptible().is_ok()),
                }
                tokens -= 1;
            }
        }
        prop_assert_eq!(sem.available(), tokens, "available after step {}", step);
        prop_assert_eq!(sem.waiters(), 0);
    }
    Ok(())
}

/// A semaphore used from one thread behaves as a counter: `try_acquire`
/// and the timed forms with no time left take a token iff one is
/// available, the waiting forms take one at once when available,
/// `release(n)` adds `n`, and a release that would pass `usize::MAX`
/// panics and adds nothing; `available` follows the count after every
/// step and nobody waits.
#[test]
fn semaphore_follows_the_counter_model() {
    check("semaphore_follows_the_counter_model", 256, sem_ops, |(start, ops)| semaphore_case(start, ops));
}

// ---------------------------------------------------------------------------
// Mutex
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum MutexOp {
    TryLock,
    /// `lock` (or `lock_interruptible`), only when the mutex is free.
    Lock {
        interruptible: bool,
    },
    /// `lock_timeout(Duration::ZERO)`.
    LockZero,
    /// `lock_until` a deadline already past.
    LockPast,
    /// Drops the guard held, if any.
    Unlock,
    /// Writes through the guard held, if any.
    Write(u32),
    /// Formats the mutex with `Debug`.
    Format,
}

fn mutex_ops() -> impl Strategy<Value = Vec<MutexOp>> {
    let op = prop_oneof![
        4 => Just(MutexOp::TryLock),
        2 => any::<bool>().prop_map(|interruptible| MutexOp::Lock { interruptible }),
        1 => Just(MutexOp::LockZero),
        1 => Just(MutexOp::LockPast),
        4 => Just(MutexOp::Unlock),
        3 => any::<u32>().prop_map(MutexOp::Write),
        1 => Just(MutexOp::Format),
    ];
    prop::collection::vec(op, 1..60)
}

fn mutex_case(ops: Vec<MutexOp>) -> TestCaseResult {
    let mutex = Mutex::new(0u32);
    let mut value = 0u32;
    let mut guard = None;
    for (step, op) in ops.into_iter().enumerate() {
        let locked = guard.is_some();
        match op {
            MutexOp::TryLock | MutexOp::LockZero | MutexOp::LockPast => {
                let got = match op {
                    MutexOp::TryLock => mutex.try_lock(),
                    MutexOp::LockZero => mutex.lock_timeout(Duration::ZERO),
                    _ => mutex.lock_until(Instant::now()),
                };
                prop_assert_eq!(got.is_some(), !locked, "step {} {:?}, locked {}", step, op, locked);
                if let Some(g) = got {
                    prop_assert_eq!(*g, value, "the value the last holder left");
                    guard = Some(g);
                }
            }
            MutexOp::Lock { interruptible } => {
                if locked {
                    continue;
                }
                let g = match interruptible {
                    false => mutex.lock(),
                    true => {
                        mutex.lock_interruptible().expect("a thread's lock_interruptible is not interrupted")
                    }
                };
                prop_assert_eq!(*g, value);
                guard = Some(g);
            }
            MutexOp::Unlock => guard = None,
            MutexOp::Write(v) => {
                if let Some(g) = guard.as_mut() {
                    **g = v;
                    value = v;
                }
            }
            MutexOp::Format => {
                let shown = format!("{mutex:?}");
                let expected = if locked { "<locked>".to_owned() } else { format!("value: {value}") };
                prop_assert!(shown.contains(&expected), "{shown:?} should show {expected:?}");
            }
        }
        prop_assert_eq!(mutex.is_locked(), guard.is_some(), "is_locked after step {}", step);
        prop_assert_eq!(mutex.waiters(), 0);
    }
    drop(guard);
    prop_assert!(!mutex.is_locked());
    prop_assert_eq!(mutex.into_inner(), value, "the value last written");
    Ok(())
}

/// A mutex used from one thread behaves as a lock bit and a value:
/// `try_lock` and the timed forms with no time left lock it iff it is
/// free (a failed attempt, and `Debug`, leave the holder's lock alone),
/// the waiting forms lock a free mutex at once, dropping the guard
/// unlocks it, each holder sees what the last one wrote, and `into_inner`
/// gives the last value.
#[test]
fn mutex_follows_the_lock_model() {
    check("mutex_follows_the_lock_model", 256, mutex_ops, mutex_case);
}

// ---------------------------------------------------------------------------
// Fibers waiting on the primitives
// ---------------------------------------------------------------------------

/// What a waiting fiber's function returns: a message (channels), nothing
/// (semaphores, mutexes), or `Interrupted`.
type Got = Result<Option<u64>, Interrupted>;

/// A step of a fiber waiting on a primitive, the fibers run one at a time
/// by `run_next` from a run queue on the test's thread.
#[derive(Debug, Clone)]
enum WaitOp<T> {
    /// A new fiber at `prio` that waits once (in the plain or the
    /// interruptible form; a plain wait on a semaphore with `wake_prio`
    /// is `acquire_with_priority`), pushed on the run queue.
    Spawn {
        prio: u8,
        interruptible: bool,
        wake_prio: Option<u8>,
    },
    RunNext,
    /// `Fiber::interrupt` of one of the fibers spawned so far.
    Interrupt(Index),
    /// Closes the run queue: later spawns are refused, while wakes and
    /// yields still come back to it.
    CloseQueue,
    /// Something the test's thread does to the primitive.
    Thread(T),
}

fn wait_ops<T: Debug + Clone>(thread: impl Strategy<Value = T>) -> impl Strategy<Value = Vec<WaitOp<T>>> {
    let op = prop_oneof![
        3 => (priority(), any::<bool>(), prop::option::of(priority()))
            .prop_map(|(prio, interruptible, wake_prio)| WaitOp::Spawn { prio, interruptible, wake_prio }),
        4 => Just(WaitOp::RunNext),
        1 => any::<Index>().prop_map(WaitOp::Interrupt),
        1 => Just(WaitOp::CloseQueue),
        3 => thread.prop_map(WaitOp::Thread),
    ];
    prop::collection::vec(op, 1..50)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Queued, its function not started.
    Fresh,
    /// Its wait node is linked on the primitive's list (asleep, or queued
    /// by a wake).
    Linked,
    /// Holds the mutex, yielded (mutex fibers only).
    Holding,
    /// Its function returned.
    Done,
}

#[derive(Debug)]
struct WaiterModel {
    prio: u8,
    /// The priority a waker that hands it something gives it.
    wake_prio: Option<u8>,
    interruptible: bool,
    /// An interrupt is pending (for its current function).
    marked: bool,
    phase: Phase,
    in_queue: bool,
    /// What a waker handed it (`Some(None)`: a token, a lock, or a close).
    handed: Option<Option<u64>>,
}

/// The fibers, the run queue (one FIFO per priority, highest first) and
/// the primitive's wait list, as the model sees them.
#[derive(Default)]
struct Waits {
    /// Non-empty levels only.
    queue: BTreeMap<u8, VecDeque<usize>>,
    /// Linked wait nodes, oldest first.
    waiters: VecDeque<usize>,
    queue_closed: bool,
    fibers: Vec<WaiterModel>,
    handles: Vec<Fiber<Got>>,
}

/// What running a fiber should come back with.
#[derive(Debug, PartialEq)]
enum Expect {
    Slept,
    Yielded,
    Returned(Got),
}

impl Waits {
    /// The fiber goes to the back of its level of the run queue, unless
    /// it is queued (then it keeps its place).
    fn wake(&mut self, tag: usize) {
        let f = &mut self.fibers[tag];
        if !std::mem::replace(&mut f.in_queue, true) {
            self.queue.entry(f.prio).or_default().push_back(tag);
        }
    }

    /// The next fiber `run_next` takes.
    fn next(&mut self) -> Option<usize> {
        let mut level = self.queue.last_entry()?;
        let tag = level.get_mut().pop_front().expect("levels in the model are non-empty");
        if level.get().is_empty() {
            level.remove();
        }
        self.fibers[tag].in_queue = false;
        Some(tag)
    }

    fn queued(&self) -> usize {
        self.queue.values().map(VecDeque::len).sum()
    }

    /// A waker hands `value` to the oldest linked waiter, if any, which
    /// takes the priority it asked to be woken at, then wakes it.
    fn hand_first(&mut self, value: Option<u64>) -> bool {
        let Some(tag) = self.waiters.pop_front() else { return false };
        let f = &mut self.fibers[tag];
        f.handed = Some(value);
        if let Some(p) = f.wake_prio {
            f.prio = p;
        }
        self.wake(tag);
        true
    }

    /// `Fiber::interrupt`: marks a fiber whose function runs, and wakes it
    /// if it sleeps (a plain wait sleeps again, keeping its place).
    fn interrupt(&mut self, tag: usize) {
        let f = &mut self.fibers[tag];
        if f.phase == Phase::Done {
            return;
        }
        f.marked = true;
        if f.phase == Phase::Linked {
            self.wake(tag);
        }
    }

    /// A running fiber found nothing for it: an interruptible wait with an
    /// interrupt pending ends (unlinked), else it sleeps (linked at the
    /// tail if it was not linked).
    fn wait_or_interrupted(&mut self, tag: usize) -> Expect {
        let f = &mut self.fibers[tag];
        if f.interruptible && f.marked {
            f.marked = false;
            f.phase = Phase::Done;
            self.waiters.retain(|&t| t != tag);
            return Expect::Returned(Err(Interrupted));
        }
        if f.phase != Phase::Linked {
            f.phase = Phase::Linked;
            self.waiters.push_back(tag);
        }
        Expect::Slept
    }

    /// A linked fiber that runs takes what it was handed.
    fn take_handed(&mut self, tag: usize) -> Option<Option<u64>> {
        let f = &mut self.fibers[tag];
        if f.phase == Phase::Linked {
            f.handed.take()
        } else {
            None
        }
    }

    /// Every fiber's state and the queue's length against the model.
    fn check(&self, queue: &RunQueue<Got>) -> TestCaseResult {
        prop_assert_eq!(queue.len(), self.queued(), "run queue length");
        for (tag, (f, h)) in self.fibers.iter().zip(&self.handles).enumerate() {
            let expected = match f.phase {
                Phase::Done => FiberState::Finished,
                _ if f.in_queue => FiberState::Queued,
                Phase::Linked => FiberState::Sleeping,
                other => unreachable!("a {other:?} fiber is always queued"),
            };
            prop_assert_eq!(h.state(), expected, "fiber {} ({:?})", tag, f);
            prop_assert_eq!(h.priority(), Priority(f.prio), "fiber {} ({:?})", tag, f);
        }
        Ok(())
    }
}

type Body = Box<dyn FnOnce() -> Got + Send>;

/// One primitive with fibers waiting on it, and its model.
trait WaitModel {
    type Op: Debug + Clone;
    /// The function of fiber `tag`: one wait, in the form asked for, and
    /// the priority it asks to be woken at (if the primitive has that
    /// form).
    fn body(&self, tag: usize, interruptible: bool, wake_prio: Option<u8>) -> (Body, Option<u8>);
    /// The model's step for running fiber `tag`, popped from the queue.
    fn run(&mut self, w: &mut Waits, tag: usize) -> Expect;
    fn thread(&mut self, w: &mut Waits, op: Self::Op) -> TestCaseResult;
    /// The primitive's counts against the model.
    fn check(&self, w: &Waits) -> TestCaseResult;
    /// Wakes every linked waiter (release, unlock, close), at the end.
    fn wind_down(&mut self, w: &mut Waits) -> TestCaseResult;
}

fn run_next_waiter<M: WaitModel>(queue: &RunQueue<Got>, w: &mut Waits, model: &mut M) -> TestCaseResult {
    let ran = queue.run_next();
    let Some(tag) = w.next() else {
        prop_assert!(
            ran.is_none(),
            "run_next ran {:?} from a queue the model has empty",
            ran.map(|r| r.fiber.id())
        );
        return Ok(());
    };
    let Some(ran) = ran else {
        return Err(TestCaseError::fail(format!("run_next found nothing, expected {tag}")));
    };
    prop_assert_eq!(ran.fiber.id(), w.handles[tag].id(), "run_next ran another fiber than {}", tag);
    let expected = model.run(w, tag);
    let got = match ran.outcome {
        Ok(RunOutcome::Slept) => Expect::Slept,
        Ok(RunOutcome::Yielded(t)) if t == tag => Expect::Yielded,
        Ok(RunOutcome::Returned(r)) => Expect::Returned(r),
        other => return Err(TestCaseError::fail(format!("fiber {tag}: unexpected {other:?}"))),
    };
    prop_assert_eq!(&got, &expected, "running fiber {}", tag);
    if got == Expect::Yielded {
        w.wake(tag);
    }
    Ok(())
}

fn waits_case<M: WaitModel>(model: &mut M, ops: Vec<WaitOp<M::Op>>) -> TestCaseResult {
    let queue = RunQueue::<Got>::new(1 << 16);
    let mut w = Waits::default();
    for (step, op) in ops.into_iter().enumerate() {
        let at_step = |e: TestCaseError| TestCaseError::fail(format!("step {step}: {e}"));
        match op {
            WaitOp::Spawn { prio, interruptible, wake_prio } => {
                let tag = w.fibers.len();
                let fiber = Fiber::new(FiberAttr::new().stack_size(STACK)).expect("creating a fiber");
                let (body, wake_prio) = model.body(tag, interruptible, wake_prio);
                fiber.set_function(Priority(prio), body).expect("set_function");
                let handle = fiber.clone();
                match queue.try_push(fiber) {
                    Ok(()) => prop_assert!(!w.queue_closed, "step {step}: a closed run queue took a fiber"),
                    Err(PushError::Closed(_)) if w.queue_closed => continue,
                    Err(e) => return Err(TestCaseError::fail(format!("step {step}: try_push: {e:?}"))),
                }
                w.handles.push(handle);
                w.fibers.push(WaiterModel {
                    prio,
                    wake_prio,
                    interruptible,
                    marked: false,
                    phase: Phase::Fresh,
                    in_queue: false,
                    handed: None,
                });
                w.wake(tag);
            }
            WaitOp::RunNext => run_next_waiter(&queue, &mut w, model).map_err(at_step)?,
            WaitOp::Interrupt(at) => {
                if !w.handles.is_empty() {
                    let tag = at.index(w.handles.len());
                    w.handles[tag].interrupt();
                    w.interrupt(tag);
                }
            }
            WaitOp::CloseQueue => {
                prop_assert_eq!(queue.close(), !w.queue_closed);
                w.queue_closed = true;
            }
            WaitOp::Thread(op) => model.thread(&mut w, op).map_err(at_step)?,
        }
        w.check(&queue).map_err(at_step)?;
        model.check(&w).map_err(at_step)?;
    }
    // Every waiter gets what it waits for, and every fiber finishes.
    let winding_down = |e: TestCaseError| TestCaseError::fail(format!("winding down: {e}"));
    loop {
        while !w.queue.is_empty() {
            run_next_waiter(&queue, &mut w, model).map_err(winding_down)?;
            w.check(&queue).map_err(winding_down)?;
            model.check(&w).map_err(winding_down)?;
        }
        if w.waiters.is_empty() {
            break;
        }
        model.wind_down(&mut w).map_err(winding_down)?;
        prop_assert!(!w.queue.is_empty(), "winding down woke none of the waiters {:?}", w.waiters);
    }
    for (tag, f) in w.fibers.iter().enumerate() {
        prop_assert_eq!(f.phase, Phase::Done, "fiber {} did not finish", tag);
    }
    Ok(())
}

/// A semaphore with fiber waiters, and the thread's `release`/`try_acquire`.
struct SemWaits {
    sem: Arc<Semaphore>,
    tokens: usize,
}

#[derive(Debug, Clone)]
enum SemThreadOp {
    Release(usize),
    TryAcquire,
    /// `acquire_timeout(Duration::ZERO)`: a thread's timed wait that
    /// gives up at once.
    AcquireZero,
}

impl WaitModel for SemWaits {
    type Op = SemThreadOp;

    fn body(&self, _tag: usize, interruptible: bool, wake_prio: Option<u8>) -> (Body, Option<u8>) {
        let s = self.sem.clone();
        let wake_prio = wake_prio.filter(|_| !interruptible);
        let body = Box::new(move || {
            match (interruptible, wake_prio) {
                (true, _) => return s.acquire_interruptible().map(|()| None),
                (false, None) => s.acquire(),
                (false, Some(p)) => s.acquire_with_priority(Priority(p)),
            }
            Ok(None)
        });
        (body, wake_prio)
    }

    fn run(&mut self, w: &mut Waits, tag: usize) -> Expect {
        if w.take_handed(tag).is_some() {
            w.fibers[tag].phase = Phase::Done;
            return Expect::Returned(Ok(None));
        }
        if w.fibers[tag].phase == Phase::Fresh && self.tokens > 0 {
            // A token there is taken, an interrupt pending or not.
            self.tokens -= 1;
            w.fibers[tag].phase = Phase::Done;
            return Expect::Returned(Ok(None));
        }
        w.wait_or_interrupted(tag)
    }

    fn thread(&mut self, w: &mut Waits, op: SemThreadOp) -> TestCaseResult {
        match op {
            SemThreadOp::Release(n) => {
                self.sem.release(n);
                // Waiters first, oldest first; the rest are counted.
                for _ in 0..n {
                    if !w.hand_first(None) {
                        self.tokens += 1;
                    }
                }
            }
            SemThreadOp::TryAcquire | SemThreadOp::AcquireZero => {
                let got = match op {
                    SemThreadOp::TryAcquire => self.sem.try_acquire(),
                    _ => self.sem.acquire_timeout(Duration::ZERO),
                };
                prop_assert_eq!(got, self.tokens > 0, "{:?} with {} tokens", op, self.tokens);
                self.tokens = self.tokens.saturating_sub(1);
            }
        }
        Ok(())
    }

    fn check(&self, w: &Waits) -> TestCaseResult {
        prop_assert_eq!(self.sem.available(), self.tokens, "available");
        prop_assert_eq!(self.sem.waiters(), w.waiters.len(), "waiters");
        Ok(())
    }

    fn wind_down(&mut self, w: &mut Waits) -> TestCaseResult {
        self.thread(w, SemThreadOp::Release(w.waiters.len()))
    }
}

/// Fibers of random priorities waiting on a semaphore (`acquire`,
/// `acquire_interruptible`, `acquire_with_priority`; interrupted at
/// random), run one at a time by `run_next` (the run queue may be closed
/// meanwhile: wakes and yields still come back to it), while the thread
/// releases, `try_acquire`s and gives up timed waits at once: `release(n)`
/// hands tokens to the oldest waiters first, each woken onto the queue at
/// the priority it asked for (one already queued by an interrupt keeps
/// its place, with the new priority), and counts the rest; fibers run by
/// priority, FIFO among equals; a token there is taken at once, even with
/// an interrupt pending; an interrupted interruptible waiter leaves the
/// list with `Interrupted` unless a token was handed to it before it ran;
/// an interrupted plain waiter sleeps on at its place; `available`,
/// `waiters` and every fiber's state and priority follow the model, and
/// in the end every waiter gets a token.
#[test]
fn semaphore_waiters_follow_the_fifo_model() {
    check(
        "semaphore_waiters_follow_the_fifo_model",
        128,
        || {
            wait_ops(prop_oneof![
                3 => (0usize..3).prop_map(SemThreadOp::Release),
                1 => Just(SemThreadOp::TryAcquire),
                1 => Just(SemThreadOp::AcquireZero),
            ])
        },
        |ops| {
            let mut model = SemWaits { sem: Arc::new(Semaphore::new(0)), tokens: 0 };
            waits_case(&mut model, ops)
        },
    );
}

/// A mutex with fiber lockers (each locks, bumps the value, yields holding
/// the lock, then unlocks) and the thread's `try_lock` and unlock.
struct MutexWaits<'a> {
    mutex: &'a Arc<Mutex<u64>>,
    guard: Option<spindle_sync::MutexGuard<'a, u64>>,
    locked: bool,
    value: u64,
}

#[derive(Debug, Clone)]
enum MutexThreadOp {
    TryLock,
    /// `lock_timeout(Duration::ZERO)`: a thread's timed wait that gives
    /// up at once.
    LockZero,
    Unlock,
}

impl MutexWaits<'_> {
    /// The lock goes to the oldest waiter, or is unlocked.
    fn unlocked(&mut self, w: &mut Waits) {
        if !w.hand_first(None) {
            self.locked = false;
        }
    }
}

impl WaitModel for MutexWaits<'_> {
    type Op = MutexThreadOp;

    fn body(&self, tag: usize, interruptible: bool, _: Option<u8>) -> (Body, Option<u8>) {
        let m = self.mutex.clone();
        let body = Box::new(move || {
            let mut g = if interruptible { m.lock_interruptible()? } else { m.lock() };
            *g += 1;
            yield_value(tag);
            drop(g);
            Ok(None)
        });
        (body, None)
    }

    fn run(&mut self, w: &mut Waits, tag: usize) -> Expect {
        if w.fibers[tag].phase == Phase::Holding {
            self.unlocked(w);
            w.fibers[tag].phase = Phase::Done;
            return Expect::Returned(Ok(None));
        }
        let handed = w.take_handed(tag).is_some();
        if handed || (w.fibers[tag].phase == Phase::Fresh && !self.locked) {
            self.locked = true;
            self.value += 1;
            w.fibers[tag].phase = Phase::Holding;
            return Expect::Yielded;
        }
        w.wait_or_interrupted(tag)
    }

    fn thread(&mut self, w: &mut Waits, op: MutexThreadOp) -> TestCaseResult {
        match op {
            MutexThreadOp::TryLock | MutexThreadOp::LockZero => {
                let got = match op {
                    MutexThreadOp::TryLock => self.mutex.try_lock(),
                    _ => self.mutex.lock_timeout(Duration::ZERO),
                };
                prop_assert_eq!(got.is_some(), !self.locked, "{:?}, locked {}", op, self.locked);
                if let Some(g) = got {
                    prop_assert_eq!(*g, self.value, "the value the last holder left");
                    self.locked = true;
                    self.guard = Some(g);
                }
            }
            MutexThreadOp::Unlock => {
                if self.guard.take().is_some() {
                    self.unlocked(w);
                }
            }
        }
        Ok(())
    }

    fn check(&self, w: &Waits) -> TestCaseResult {
        prop_assert_eq!(self.mutex.is_locked(), self.locked, "is_locked");
        prop_assert_eq!(self.mutex.waiters(), w.waiters.len(), "waiters");
        Ok(())
    }

    fn wind_down(&mut self, w: &mut Waits) -> TestCaseResult {
        prop_assert!(self.guard.is_some(), "fibers wait for a lock nobody holds: {:?}", w.waiters);
        self.thread(w, MutexThreadOp::Unlock)
    }
}

/// Fibers of random priorities locking a mutex (plain and interruptible,
/// interrupted at random, each holding the lock across a yield), run one
/// at a time by `run_next`, while the thread `try_lock`s, gives up a timed
/// lock at once, and unlocks: the lock is handed to the oldest waiter
/// (fair: a free mutex with waiters is never seen), a free mutex is taken
/// at once even with an interrupt pending, an interrupted interruptible
/// waiter leaves with `Interrupted` unless the lock was handed to it
/// first, the thread's attempts succeed iff the model's mutex is free,
/// every holder sees the value the last one left, `is_locked`, `waiters`
/// and every fiber's state follow the model, and in the end every locker
/// gets the lock.
#[test]
fn mutex_waiters_follow_the_fair_lock_model() {
    check(
        "mutex_waiters_follow_the_fair_lock_model",
        128,
        || {
            wait_ops(prop_oneof![
                2 => Just(MutexThreadOp::TryLock),
                1 => Just(MutexThreadOp::LockZero),
                3 => Just(MutexThreadOp::Unlock),
            ])
        },
        |ops| {
            let mutex = Arc::new(Mutex::new(0u64));
            let mut model = MutexWaits { mutex: &mutex, guard: None, locked: false, value: 0 };
            waits_case(&mut model, ops)?;
            drop(model.guard.take());
            prop_assert_eq!(*mutex.try_lock().expect("free at the end"), model.value);
            Ok(())
        },
    );
}

/// A channel with fiber receivers, and the thread's push, `try_pop` and
/// close.
struct ChanWaits {
    chan: Arc<Channel<u64>>,
    messages: VecDeque<u64>,
    closed: bool,
    next: u64,
}

#[derive(Debug, Clone)]
enum ChanThreadOp {
    Push,
    TryPop,
    /// `pop_timeout(Duration::ZERO)`: a thread's timed wait that gives up
    /// at once.
    PopZero,
    Close,
}

impl WaitModel for ChanWaits {
    type Op = ChanThreadOp;

    fn body(&self, _tag: usize, interruptible: bool, _: Option<u8>) -> (Body, Option<u8>) {
        let c = self.chan.clone();
        let body = Box::new(move || {
            if interruptible {
                c.pop_interruptible().map(|m| m.map(Msg::into_inner))
            } else {
                Ok(c.pop().map(Msg::into_inner))
            }
        });
        (body, None)
    }

    fn run(&mut self, w: &mut Waits, tag: usize) -> Expect {
        if let Some(value) = w.take_handed(tag) {
            w.fibers[tag].phase = Phase::Done;
            return Expect::Returned(Ok(value));
        }
        if w.fibers[tag].phase == Phase::Fresh && (self.closed || !self.messages.is_empty()) {
            // Queued messages first, then the close, then an interrupt.
            w.fibers[tag].phase = Phase::Done;
            return Expect::Returned(Ok(self.messages.pop_front()));
        }
        w.wait_or_interrupted(tag)
    }

    fn thread(&mut self, w: &mut Waits, op: ChanThreadOp) -> TestCaseResult {
        match op {
            ChanThreadOp::Push => {
                self.next += 1;
                match self.chan.push(Msg::new(self.next)) {
                    Ok(()) => {
                        prop_assert!(!self.closed, "a closed channel took a message");
                        // To the longest-waiting receiver, else queued.
                        if !w.hand_first(Some(self.next)) {
                            self.messages.push_back(self.next);
                        }
                    }
                    Err(Closed(m)) => {
                        prop_assert!(self.closed, "an open channel refused a message");
                        prop_assert_eq!(*m, self.next);
                    }
                }
            }
            ChanThreadOp::TryPop => {
                let got = self.chan.try_pop().map(Msg::into_inner);
                prop_assert_eq!(got, self.messages.pop_front(), "try_pop");
            }
            ChanThreadOp::PopZero => {
                let got = self.chan.pop_timeout(Duration::ZERO).map(|m| m.map(Msg::into_inner));
                let expected = match self.messages.pop_front() {
                    None if !self.closed => Err(TimedOut),
                    front => Ok(front),
                };
                prop_assert_eq!(got, expected, "pop_timeout(0)");
            }
            ChanThreadOp::Close => {
                prop_assert_eq!(self.chan.close(), !self.closed, "close says whether it closed the channel");
                self.closed = true;
                // Every waiting receiver is woken with `None`.
                while w.hand_first(None) {}
            }
        }
        Ok(())
    }

    fn check(&self, w: &Waits) -> TestCaseResult {
        prop_assert_eq!(self.chan.len(), self.messages.len(), "len");
        prop_assert_eq!(self.chan.receivers(), w.waiters.len(), "receivers");
        prop_assert_eq!(self.chan.is_closed(), self.closed, "is_closed");
        Ok(())
    }

    fn wind_down(&mut self, w: &mut Waits) -> TestCaseResult {
        self.thread(w, ChanThreadOp::Close)
    }
}

/// Fiber receivers of random priorities on a channel (plain and
/// interruptible `pop`, interrupted at random), run one at a time by
/// `run_next`, while the thread pushes, `try_pop`s, gives up timed pops at
/// once, and closes: a push hands its message to the longest-waiting
/// receiver or queues it; a receiver takes a queued message at once,
/// else `None` from a closed channel, before a pending interrupt; an
/// interrupted interruptible receiver leaves with `Interrupted` unless a
/// message (or the close) reached it first; `close` wakes every waiting
/// receiver with `None` and refuses later pushes (handing the message
/// back); `len`, `receivers` and `is_closed` follow the model, and every
/// receiver finishes once the channel is closed.
#[test]
fn channel_receivers_follow_the_fifo_model() {
    check(
        "channel_receivers_follow_the_fifo_model",
        128,
        || {
            wait_ops(prop_oneof![
                4 => Just(ChanThreadOp::Push),
                1 => Just(ChanThreadOp::TryPop),
                1 => Just(ChanThreadOp::PopZero),
                1 => Just(ChanThreadOp::Close),
            ])
        },
        |ops| {
            let mut model = ChanWaits {
                chan: Arc::new(Channel::new()),
                messages: VecDeque::new(),
                closed: false,
                next: 0,
            };
            waits_case(&mut model, ops)
        },
    );
}
