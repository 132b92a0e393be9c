//! Model-based property tests of the executor's public API
//! (DESIGN.md, "The executor"): random trees of tasks, each a small
//! script, run on executors of random small configurations (1-3 workers,
//! up to one more by scaling, 64 or 128 KiB stacks, short or default time
//! slices, retirement and sysmon intervals), every outcome checked
//! against what a reference model of the scripts predicts, with proptest
//! shrinking a failing tree.
//!
//! A script computes a value (an accumulator mixed with constants); it
//! yields (`yield_now`, `yield_if_needed`, a run of yields), keeps its
//! worker busy for up to 1.5 ms, sleeps on the executor's timers
//! (`sleep`, `yield_timeout`, up to 3 ms); spawns children (through
//! `spawn`, `Handle::current()` or a captured `Handle`, named or not, at
//! the three priority classes), runs one with `block_on`, and joins,
//! cancels, wakes, waits with `wait_timeout` on or detaches the ones it
//! holds (a child may instead be handed its own handle, and its join of
//! it must fail with `JoinedItself`); hands a token or a message to a
//! later sibling over a `Semaphore` or `Channel`, taken with a plain, an
//! interruptible or a deadline-bound (`interrupt_after`) wait (the
//! giver's guard hands it over when its closure is dropped, run or not,
//! so no wait can outlast its giver); opens a scope (`Executor::scope`,
//! `Handle::scope`) whose fibers read borrowed inputs and write borrowed
//! slots and a shared sum; and returns its value or panics. The model is
//! the script itself read without the executor: the value a task returns
//! is a function of its script, of the values of the children it joins
//! without having cancelled them, of the tokens it takes and of its
//! scopes' slots.
//!
//! Every closure carries a probe whose drop records how the closure
//! ended: returned (with what), panicked as planned, unwound by a cancel
//! or the shutdown, or dropped without having run; every value counts its
//! drops. Joins, scopes and the end of the run check these records
//! against the model and the documented outcomes; anything that
//! disagrees is collected (fibers do not panic for it) and fails the
//! case. Three properties end a run differently: after every closure is
//! gone, by dropping the executor while tasks still run, and by dropping
//! it inside one of its own fibers.
//!
//! Each property runs its whole proptest loop under a watchdog that fails,
//! naming the case being run, if no case finishes for `WATCHDOG_SECS`.
//! `PROPTEST_CASES` changes the number of cases of each property (the
//! default is sized so that the file runs in a few seconds in a debug
//! build), `PROPTEST_RNG_SEED` replays a run, and `MODEL_EXECUTOR_TALLY`
//! prints how often each checked outcome occurred.

mod common;

use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestCaseResult, TestRunner};

use common::watchdog_with_progress;
use spindle_executor::sync::{Channel, Msg, Semaphore};
use spindle_executor::{
    Executor, FiberId, Handle, JoinError, JoinHandle, Priority, Scope, ScopedJoinHandle, SpawnOptions,
};

/// Cases per property unless `PROPTEST_CASES` says otherwise (about a
/// second and a half per property in a debug build).
const DEFAULT_CASES: u32 = 256;

/// Seconds without a finished case before a property's watchdog calls it
/// hung (a case takes milliseconds).
const WATCHDOG_SECS: u64 = 60;

/// How long the quiescent run waits for every closure to be dropped
/// before it fails the case (a bound, not a synchronisation: the wait
/// ends as soon as the last probe goes).
const QUIESCE_BOUND: Duration = Duration::from_secs(20);

/// Planned panics (of a task, or of a scope's body) start with this; the
/// panic hook keeps them quiet.
const PLANNED: &str = "planned panic";
/// The start of the panic a scope raises for an unjoined fiber that
/// panicked or was cancelled (`Executor::scope`); kept quiet too.
const SCOPE_PANIC: &str = "a fiber spawned in a spindle-executor scope";

// Values the accumulators are mixed with.
const PANIC_MARK: u64 = 0x5041_4e49_4321;
const CANCEL_MARK: u64 = 0x4341_4e43_454c;
const OTHER_MARK: u64 = 0x4f54_4845_5221;
const BODY_SEED: u64 = 0x424f_4459;
const BODY_PANIC_MARK: u64 = 0x4250_414e_4943;
const LINK_SEED: u64 = 0x4c49_4e4b;
/// What a scoped fiber's slot holds until the fiber writes it.
const SENTINEL: u64 = u64::MAX;

fn mix(acc: u64, x: u64) -> u64 {
    (acc ^ x).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(17) ^ 0x9e37_79b9
}

fn seed(tag: u32) -> u64 {
    mix(0x5345_4544, u64::from(tag))
}

fn link_value(id: usize) -> u64 {
    mix(LINK_SEED, id as u64)
}

fn planned_message(tag: u32) -> String {
    format!("{PLANNED} in task {tag}")
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------
// Scripts

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prio {
    Low,
    Normal,
    High,
}

impl Prio {
    fn get(self) -> Priority {
        match self {
            Prio::Low => Priority::LOW,
            Prio::Normal => Priority::NORMAL,
            Prio::High => Priority::HIGH,
        }
    }
}

/// How a fiber spawns a child: the free `spawn` (unnamed children at the
/// normal priority only; the others go through the captured handle),
/// `Handle::current()`, or the `Handle` the task captured. On the test's
/// thread: `Executor::spawn`, `Executor::spawn_with`, `Handle::spawn_with`
/// (and for `block_on` and scopes, `Executor`'s or the handle's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Free,
    Current,
    Captured,
}

#[derive(Debug, Clone)]
struct TaskSpec {
    /// Its number in the tree (preorder), set by `normalize`.
    tag: u32,
    named: bool,
    prio: Prio,
    via: Via,
    steps: Vec<Step>,
    /// Ends in a panic instead of returning.
    panics: bool,
    /// Spawned by a `Spawn` step, it is handed its own join handle
    /// (through a channel) and joins it first: `JoinedItself`. Its parent
    /// keeps no handle.
    self_join: bool,
    /// The links (in its parent's group) it gives, set by `normalize`.
    gives: Vec<usize>,
    /// The links among its own children, set by `normalize`.
    links: Vec<LinkSpec>,
}

/// A token (semaphore) or message (channel) from one child to a later
/// sibling.
#[derive(Debug, Clone, Copy)]
struct LinkSpec {
    chan: bool,
}

/// What a task does with a child it holds (picked among those it still
/// holds).
#[derive(Debug, Clone)]
enum KidOp {
    Join(Index),
    /// `cancel`; if `started`, once the child has started (or finished;
    /// looked at between yields, a bounded number of times).
    Cancel(Index, bool),
    /// Drops the handle.
    Detach(Index),
    /// `wake`; `started` as for `Cancel`.
    Wake(Index, bool),
    /// `wait_timeout` of that many microseconds.
    WaitTimeout(Index, u16),
}

#[derive(Debug, Clone)]
enum Step {
    Compute(u8),
    Yield,
    YieldIfNeeded,
    /// `yield_now` that many times.
    Spin(u8),
    /// Keeps its worker busy for that many microseconds without a
    /// suspension (calling `yield_if_needed` as it goes if the flag is
    /// set): sysmon then sees a stuck worker and may add one.
    Busy(u16, bool),
    /// `sleep` of that many microseconds.
    Sleep(u16),
    /// `yield_timeout` of that many microseconds.
    YieldTimeout(u16),
    Spawn(Box<TaskSpec>),
    BlockOn(Box<TaskSpec>),
    Kid(KidOp),
    /// Gives one of its links now (the link is set by `normalize`).
    Give(Index, Option<usize>),
    /// Takes the token or message of a link from an earlier sibling
    /// (`pick` chooses the giver; `link` is set by `normalize`).
    /// With a `deadline`, the take is interruptible under
    /// `interrupt_after` of that many microseconds, and taken again
    /// (without a deadline) if the deadline interrupted it: the token or
    /// message is not lost, and later waits are not interrupted.
    Take {
        pick: Index,
        chan: bool,
        interruptible: bool,
        deadline: Option<u16>,
        link: Option<usize>,
    },
    Scope(ScopeSpec),
}

#[derive(Debug, Clone)]
enum ScopeOp {
    Kid(KidOp),
    Yield,
}

#[derive(Debug, Clone)]
struct ScopeSpec {
    /// `Executor::scope` on the thread, `Handle::current()` in a fiber;
    /// else the captured handle's.
    via_current: bool,
    children: Vec<TaskSpec>,
    /// What the body does after spawning every child; the handles it
    /// still holds at its end are dropped.
    ops: Vec<ScopeOp>,
    body_panics: bool,
    /// The links among the scope's children, set by `normalize`.
    links: Vec<LinkSpec>,
}

/// Numbers the tasks and wires the links: in each group of siblings (a
/// task's `Spawn`/`BlockOn` children in order, or a scope's children),
/// a `Take` of child `i` takes from a new link given by an earlier child
/// `j < i` (none for the first child), and a `Give` gives one of the
/// child's links, if it has any. Givers come first, so waits cannot form
/// a cycle.
fn normalize(spec: &mut TaskSpec, next: &mut u32) {
    spec.tag = *next;
    *next += 1;
    for step in spec.steps.iter_mut() {
        match step {
            Step::Spawn(c) | Step::BlockOn(c) => normalize(c, next),
            Step::Scope(sc) => {
                for c in sc.children.iter_mut() {
                    normalize(c, next);
                }
                sc.links = assign_links(sc.children.iter_mut().collect());
            }
            _ => {}
        }
    }
    let group: Vec<&mut TaskSpec> = spec
        .steps
        .iter_mut()
        .filter_map(|s| match s {
            Step::Spawn(c) | Step::BlockOn(c) => Some(&mut **c),
            _ => None,
        })
        .collect();
    spec.links = assign_links(group);
}

fn assign_links(mut group: Vec<&mut TaskSpec>) -> Vec<LinkSpec> {
    for c in group.iter_mut() {
        c.gives.clear();
    }
    let mut links = Vec::new();
    for i in 0..group.len() {
        let mut gives = Vec::new();
        for step in group[i].steps.iter_mut() {
            if let Step::Take { pick, chan, link, .. } = step {
                *link = (i > 0).then(|| {
                    let id = links.len();
                    links.push(LinkSpec { chan: *chan });
                    gives.push((pick.index(i), id));
                    id
                });
            }
        }
        for (j, id) in gives {
            group[j].gives.push(id);
        }
    }
    for c in group.iter_mut() {
        let gives = c.gives.clone();
        for step in c.steps.iter_mut() {
            if let Step::Give(at, link) = step {
                *link = (!gives.is_empty()).then(|| gives[at.index(gives.len())]);
            }
        }
    }
    links
}

/// The root (the test's thread) has no siblings: nothing to take or give.
fn unlink_root(root: &mut TaskSpec) {
    root.panics = false;
    for step in root.steps.iter_mut() {
        match step {
            Step::Take { link, .. } => *link = None,
            Step::Give(_, link) => *link = None,
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------
// The model

/// What a task that is neither cancelled nor shut down ends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Value(u64),
    Panic,
}

impl Expect {
    fn folded(self) -> u64 {
        match self {
            Expect::Value(v) => v,
            Expect::Panic => PANIC_MARK,
        }
    }
}

/// The `at`-th of the children still held (the model and the run pick
/// the same way).
fn pick<T>(kids: &[Option<T>], at: &Index) -> Option<usize> {
    let held: Vec<usize> = kids.iter().enumerate().filter(|(_, k)| k.is_some()).map(|(i, _)| i).collect();
    (!held.is_empty()).then(|| held[at.index(held.len())])
}

/// A child as the model sees it: its outcome, and whether it was
/// cancelled (its value is then not folded in when joined).
type ModelKid = Option<(Expect, bool)>;

fn model_kid_op(kids: &mut [ModelKid], cancelled: &mut [bool], op: &KidOp, acc: u64) -> u64 {
    match op {
        KidOp::Join(at) => {
            if let Some(i) = pick(kids, at) {
                let (e, canc) = kids[i].take().unwrap();
                if !canc {
                    return mix(acc, e.folded());
                }
            }
        }
        KidOp::Cancel(at, _) => {
            if let Some(i) = pick(kids, at) {
                kids[i].as_mut().unwrap().1 = true;
                cancelled[i] = true;
            }
        }
        KidOp::Detach(at) => {
            if let Some(i) = pick(kids, at) {
                kids[i] = None;
            }
        }
        KidOp::Wake(..) | KidOp::WaitTimeout(..) => {}
    }
    acc
}

fn expect(spec: &TaskSpec) -> Expect {
    let mut acc = seed(spec.tag);
    let mut kids: Vec<ModelKid> = Vec::new();
    let mut cancelled = Vec::new();
    for step in &spec.steps {
        match step {
            Step::Compute(k) => acc = mix(acc, u64::from(*k)),
            Step::Spawn(c) if c.self_join => {}
            Step::Spawn(c) => {
                kids.push(Some((expect(c), false)));
                cancelled.push(false);
            }
            Step::BlockOn(c) => acc = mix(acc, expect(c).folded()),
            Step::Kid(op) => acc = model_kid_op(&mut kids, &mut cancelled, op, acc),
            Step::Take { link: Some(id), .. } => acc = mix(acc, link_value(*id)),
            Step::Scope(sc) => acc = expect_scope(sc, acc),
            _ => {}
        }
    }
    if spec.panics {
        Expect::Panic
    } else {
        Expect::Value(acc)
    }
}

/// The inputs a scope lends its fibers.
fn scope_inputs(acc: u64, n: usize) -> Vec<u64> {
    (0..n).map(|i| mix(acc, i as u64 + 1)).collect()
}

/// A scoped fiber returns (and writes into its slot) its script's value
/// mixed with its input.
fn expect_scoped(c: &TaskSpec, input: u64) -> Expect {
    match expect(c) {
        Expect::Value(v) => Expect::Value(mix(v, input)),
        Expect::Panic => Expect::Panic,
    }
}

/// The accumulator after a scope: the body's value (joins of children
/// not cancelled) and the slots of the children not cancelled, or a mark
/// if the body panics. Whether the scope itself panics for an unjoined
/// child is checked against the probes, not folded in.
fn expect_scope(sc: &ScopeSpec, acc: u64) -> u64 {
    let inputs = scope_inputs(acc, sc.children.len());
    let exp: Vec<Expect> = sc.children.iter().zip(&inputs).map(|(c, i)| expect_scoped(c, *i)).collect();
    let mut kids: Vec<ModelKid> = exp.iter().map(|e| Some((*e, false))).collect();
    let mut cancelled = vec![false; exp.len()];
    let mut body = BODY_SEED;
    for op in &sc.ops {
        if let ScopeOp::Kid(op) = op {
            body = model_kid_op(&mut kids, &mut cancelled, op, body);
        }
    }
    if sc.body_panics {
        return mix(acc, BODY_PANIC_MARK);
    }
    let mut acc = mix(acc, body);
    for (e, canc) in exp.iter().zip(&cancelled) {
        if !canc {
            acc = mix(
                acc,
                match e {
                    Expect::Value(v) => *v,
                    Expect::Panic => SENTINEL,
                },
            );
        }
    }
    acc
}

// ---------------------------------------------------------------------------
// What the run records

/// How a task's closure ended, as its probe saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Actual {
    Returned(u64),
    Panicked,
    /// Unwound by a cancel or the shutdown.
    Unwound,
    /// Dropped without having run.
    NotStarted,
}

struct Record {
    tag: u32,
    name: Option<String>,
    expected: Expect,
    /// Its handle's `cancel` was called (set before the call).
    cancelled: AtomicBool,
    /// Its handle's `wake` was called (set before the call).
    woken: AtomicBool,
    /// A join returned its outcome.
    joined: AtomicBool,
    /// Drops of the value it returned (a `Val`).
    value_drops: AtomicUsize,
    started: AtomicBool,
    /// Set just before its planned panic.
    planned_panic: AtomicBool,
    /// It saw the shutdown cancel a child it had not cancelled, and its
    /// value may differ from the model's for that.
    tainted: AtomicBool,
    outcome: Mutex<Option<Actual>>,
}

impl Record {
    fn who(&self) -> String {
        format!("task {}", self.tag)
    }
}

/// Outcomes the properties check, counted for the coverage check.
#[derive(Clone, Copy, Debug)]
enum Event {
    /// A join returned a value (of a task not cancelled).
    JoinValue,
    JoinPanicked,
    /// A join said `Cancelled` with the fiber it had started on.
    JoinCancelledStarted,
    /// A join said `Cancelled` with no fiber.
    JoinCancelledNotStarted,
    /// A join of a cancelled task returned its value.
    CancelledButFinished,
    /// A scope panicked for an unjoined fiber.
    ScopePanicked,
    ScopeBodyPanicked,
    /// An interruptible take returned `Interrupted` (a cancel, the
    /// shutdown).
    TakeInterrupted,
    YieldTimeoutWoken,
    /// `wait_timeout` saw the task finish.
    WaitTimeoutDone,
    /// A task nobody cancelled or joined was unwound by the shutdown.
    UnjoinedUnwoundAtShutdown,
    /// A task nobody joined returned.
    UnjoinedReturned,
    /// A task cancelled by its parent, unwound (joined or not).
    CancelUnwound,
    /// A task cancelled by its parent before it started (joined or not).
    CancelNeverRan,
    JoinedItself,
    /// A take's `interrupt_after` deadline interrupted it.
    TakeTimedOut,
    /// Sysmon added a worker during the case.
    ScaledUp,
}

const EVENTS: usize = 17;
const ALL_EVENTS: [Event; EVENTS] = [
    Event::JoinValue,
    Event::JoinPanicked,
    Event::JoinCancelledStarted,
    Event::JoinCancelledNotStarted,
    Event::CancelledButFinished,
    Event::ScopePanicked,
    Event::ScopeBodyPanicked,
    Event::TakeInterrupted,
    Event::YieldTimeoutWoken,
    Event::WaitTimeoutDone,
    Event::UnjoinedUnwoundAtShutdown,
    Event::UnjoinedReturned,
    Event::CancelUnwound,
    Event::CancelNeverRan,
    Event::JoinedItself,
    Event::TakeTimedOut,
    Event::ScaledUp,
];
/// How often each event occurred, per property (`End`).
static TALLY: [[AtomicUsize; EVENTS]; 3] = [const { [const { AtomicUsize::new(0) }; EVENTS] }; 3];

struct World {
    records: Mutex<Vec<Arc<Record>>>,
    violations: Mutex<Vec<String>>,
    /// Probes not yet dropped.
    live: Mutex<usize>,
    live_cv: Condvar,
    /// Joins that returned a task's outcome (value, panic, cancel).
    joins_returned: AtomicU64,
    shutdown_started: AtomicBool,
    base: usize,
    max: usize,
    end: End,
}

impl World {
    fn new(cfg: &Cfg, end: End) -> World {
        World {
            records: Mutex::new(Vec::new()),
            violations: Mutex::new(Vec::new()),
            live: Mutex::new(0),
            live_cv: Condvar::new(),
            joins_returned: AtomicU64::new(0),
            shutdown_started: AtomicBool::new(false),
            base: cfg.workers,
            max: cfg.max_workers,
            end,
        }
    }

    fn note(&self, e: Event) {
        TALLY[self.end as usize][e as usize].fetch_add(1, SeqCst);
    }

    fn fail(&self, what: String) {
        lock(&self.violations).push(what);
    }

    fn shutting_down(&self) -> bool {
        self.shutdown_started.load(SeqCst)
    }

    fn record(&self, tag: u32, name: Option<String>, expected: Expect) -> Arc<Record> {
        let rec = Arc::new(Record {
            tag,
            name,
            expected,
            cancelled: AtomicBool::new(false),
            woken: AtomicBool::new(false),
            joined: AtomicBool::new(false),
            value_drops: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            planned_panic: AtomicBool::new(false),
            tainted: AtomicBool::new(false),
            outcome: Mutex::new(None),
        });
        lock(&self.records).push(rec.clone());
        rec
    }

    /// Waits (bounded) until every probe has been dropped.
    fn wait_quiescent(&self) -> bool {
        let live = lock(&self.live);
        let (live, _) = self
            .live_cv
            .wait_timeout_while(live, QUIESCE_BOUND, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        *live == 0
    }

    /// The stats checks that hold while the executor runs: a join that
    /// returned was counted before its joiner woke (so the joins are
    /// counted first, then the stats read), the scaling counters agree.
    fn check_running_stats(&self, handle: &Handle) {
        let joined = self.joins_returned.load(SeqCst);
        let s = handle.stats();
        let (workers, peak) = (s.workers, s.peak_workers);
        if s.completed < joined {
            self.fail(format!("stats: {} completed, but {joined} joins had returned: {s:?}", s.completed));
        }
        if workers < self.base || workers > peak || peak > self.max {
            self.fail(format!("stats: workers {workers}, peak {peak}, base {}, max {}", self.base, self.max));
        }
        if workers as u64 + s.scale_downs < self.base as u64 + s.scale_ups {
            self.fail(format!("stats: scaling counters disagree with the worker count: {s:?}"));
        }
    }
}

/// Rides in a task's closure: records how the closure ended.
struct Probe {
    world: Arc<World>,
    rec: Arc<Record>,
}

impl Probe {
    fn new(world: &Arc<World>, rec: &Arc<Record>) -> Probe {
        *lock(&world.live) += 1;
        Probe { world: world.clone(), rec: rec.clone() }
    }

    fn finish(self, v: u64) {
        *lock(&self.rec.outcome) = Some(Actual::Returned(v));
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let mut outcome = lock(&self.rec.outcome);
        if outcome.is_none() {
            *outcome = Some(if !self.rec.started.load(SeqCst) {
                Actual::NotStarted
            } else if !std::thread::panicking() {
                self.world.fail(format!(
                    "{}: its closure ended neither by returning nor by unwinding",
                    self.rec.who()
                ));
                Actual::Unwound
            } else if self.rec.planned_panic.load(SeqCst) {
                Actual::Panicked
            } else {
                Actual::Unwound
            });
        }
        drop(outcome);
        let mut live = lock(&self.world.live);
        *live -= 1;
        if *live == 0 {
            self.world.live_cv.notify_all();
        }
    }
}

/// The runtime side of a group of links.
struct LinkRt {
    chan: bool,
    value: u64,
    sem: Semaphore,
    ch: Channel<u64>,
}

type Group = Arc<Vec<LinkRt>>;

fn make_group(specs: &[LinkSpec]) -> Group {
    Arc::new(
        specs
            .iter()
            .enumerate()
            .map(|(id, s)| LinkRt {
                chan: s.chan,
                value: link_value(id),
                sem: Semaphore::new(0),
                ch: Channel::new(),
            })
            .collect(),
    )
}

fn give(link: &LinkRt) {
    if link.chan {
        // Never closed: the push cannot be refused.
        let _ = link.ch.push(Msg::new(link.value));
    } else {
        link.sem.release(1);
    }
}

/// Rides in a task's closure: gives the task's links, at a `Give` step
/// or, for those not given by then, when the closure is dropped (whether
/// it ran to its end, unwound or never ran).
struct Gives {
    group: Group,
    ids: Vec<(usize, bool)>,
}

impl Gives {
    fn new(group: &Group, ids: &[usize]) -> Gives {
        Gives { group: group.clone(), ids: ids.iter().map(|&id| (id, false)).collect() }
    }

    fn give(&mut self, id: usize) {
        if let Some(e) = self.ids.iter_mut().find(|e| e.0 == id && !e.1) {
            e.1 = true;
            give(&self.group[id]);
        }
    }
}

impl Drop for Gives {
    fn drop(&mut self) {
        for &(id, given) in &self.ids {
            if !given {
                give(&self.group[id]);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Running scripts

/// What a task returns: its value, whose drops its record counts (each
/// must be dropped exactly once: by the joiner, by the handle's drop, or
/// by the fiber itself if the handle was dropped first).
struct Val {
    v: u64,
    rec: Arc<Record>,
}

impl Drop for Val {
    fn drop(&mut self) {
        self.rec.value_drops.fetch_add(1, SeqCst);
    }
}

/// Takes a joined value out (dropping the `Val`).
fn unwrap_val(r: Result<Val, JoinError>) -> Result<u64, JoinError> {
    r.map(|val| val.v)
}

/// A join handle, plain or scoped.
trait Joinable {
    fn join_(self) -> Result<u64, JoinError>;
    fn cancel_(&self);
    fn wake_(&self);
    fn wait_timeout_(&self, d: Duration) -> bool;
    fn is_finished_(&self) -> bool;
    fn fiber_id_(&self) -> Option<FiberId>;
}

/// The same forwarding for both handle types.
macro_rules! joinable {
    (impl$(<$lt:lifetime>)? for $ty:ty) => {
        impl$(<$lt>)? Joinable for $ty {
            fn join_(self) -> Result<u64, JoinError> {
                unwrap_val(self.join())
            }
            fn cancel_(&self) {
                self.cancel()
            }
            fn wake_(&self) {
                self.wake()
            }
            fn wait_timeout_(&self, d: Duration) -> bool {
                self.wait_timeout(d)
            }
            fn is_finished_(&self) -> bool {
                self.is_finished()
            }
            fn fiber_id_(&self) -> Option<FiberId> {
                self.fiber_id()
            }
        }
    };
}

joinable!(impl for JoinHandle<Val>);
joinable!(impl<'s> for ScopedJoinHandle<'s, Val>);

struct Kid<H> {
    h: H,
    rec: Arc<Record>,
}

/// Where a script runs.
struct Env<'a> {
    world: &'a Arc<World>,
    handle: &'a Handle,
    /// The root, on the test's thread.
    exec: Option<&'a Executor>,
    /// In an executor fiber (else on the test's thread).
    fiber: bool,
    /// The running task's record (none for the root).
    me: Option<&'a Arc<Record>>,
    /// The links of the running task's sibling group.
    siblings: Option<&'a Group>,
    /// Every `Take` waits interruptibly (the shutdown property: a fiber
    /// left in a plain wait at shutdown is documented to leak).
    interruptible_only: bool,
}

impl Env<'_> {
    fn who(&self) -> String {
        self.me.map_or_else(|| "the root".to_owned(), |r| r.who())
    }

    fn taint(&self) {
        if let Some(me) = self.me {
            me.tainted.store(true, SeqCst);
        }
    }
}

fn options(c: &TaskSpec) -> SpawnOptions {
    let o = SpawnOptions::new().priority(c.prio.get());
    if c.named {
        o.name(format!("t{}", c.tag))
    } else {
        o
    }
}

fn name_of(c: &TaskSpec) -> Option<String> {
    c.named.then(|| format!("t{}", c.tag))
}

/// What a spawned closure captures.
struct TaskCtx {
    world: Arc<World>,
    handle: Handle,
    spec: TaskSpec,
    siblings: Group,
    probe: Probe,
    gives: Gives,
    interruptible_only: bool,
    /// Where its own join handle comes from (`TaskSpec::self_join`).
    own: Option<Arc<Channel<JoinHandle<Val>>>>,
}

/// The body of every spawned closure: runs the script, then `post` on its
/// value (a scoped fiber writes its slot there), then returns or panics
/// as planned.
fn run_task(t: TaskCtx, post: impl FnOnce(u64) -> u64) -> Val {
    let TaskCtx { world, handle, spec, siblings, probe, mut gives, interruptible_only, own } = t;
    probe.rec.started.store(true, SeqCst);
    if Handle::current().is_none() {
        world.fail(format!("task {}: Handle::current() is None in its fiber", spec.tag));
    }
    if let Some(own) = own {
        // Pushed by the parent right after the spawn.
        let h = if interruptible_only { own.pop_interruptible().ok().flatten() } else { own.pop() };
        if let Some(h) = h {
            let me = spindle_fiber::current_id();
            match unwrap_val(h.into_inner().join()) {
                Err(JoinError::JoinedItself { fiber, name })
                    if Some(fiber) == me && name.as_deref() == probe.rec.name.as_deref() =>
                {
                    world.note(Event::JoinedItself)
                }
                other => world.fail(format!("task {}: joining its own handle gave {other:?}", spec.tag)),
            }
        }
    }
    let env = Env {
        world: &world,
        handle: &handle,
        exec: None,
        fiber: true,
        me: Some(&probe.rec),
        siblings: Some(&siblings),
        interruptible_only,
    };
    let (acc, kids) = run_steps(&env, &spec, Some(&mut gives));
    drop(kids);
    if spec.panics {
        probe.rec.planned_panic.store(true, SeqCst);
        std::panic::panic_any(planned_message(spec.tag));
    }
    let v = post(acc);
    let rec = probe.rec.clone();
    probe.finish(v);
    Val { v, rec }
}

/// What a child's closure captures, and its record.
fn task_ctx(env: &Env, c: &TaskSpec, group: &Group, rec: &Arc<Record>) -> TaskCtx {
    TaskCtx {
        world: env.world.clone(),
        handle: env.handle.clone(),
        spec: c.clone(),
        siblings: group.clone(),
        probe: Probe::new(env.world, rec),
        gives: Gives::new(group, &c.gives),
        interruptible_only: env.interruptible_only,
        own: None,
    }
}

/// A spawned child's closure and record.
fn prepare(
    env: &Env,
    c: &TaskSpec,
    group: &Group,
    name: Option<String>,
    own: Option<Arc<Channel<JoinHandle<Val>>>>,
) -> (Arc<Record>, impl FnOnce() -> Val + Send + 'static) {
    let rec = env.world.record(c.tag, name, expect(c));
    let t = TaskCtx { own, ..task_ctx(env, c, group, &rec) };
    (rec, move || run_task(t, |v| v))
}

fn spawn_kid(env: &Env, c: &TaskSpec, group: &Group) -> Option<Kid<JoinHandle<Val>>> {
    let own = c.self_join.then(|| Arc::new(Channel::new()));
    let (rec, f) = prepare(env, c, group, name_of(c), own.clone());
    let plain = !c.named && c.prio == Prio::Normal;
    let h = match (env.fiber, env.exec, c.via) {
        (true, _, Via::Free) if plain => spindle_executor::spawn(f),
        (true, _, Via::Current) => Handle::current().expect("in an executor fiber").spawn_with(options(c), f),
        (false, Some(exec), Via::Free) if plain => exec.spawn(f),
        (false, Some(exec), Via::Current) => exec.spawn_with(options(c), f),
        _ => env.handle.spawn_with(options(c), f),
    };
    match own {
        Some(own) => {
            // Never closed: the push cannot be refused.
            let _ = own.push(Msg::new(h));
            None
        }
        None => Some(Kid { h, rec }),
    }
}

fn block_on_kid(env: &Env, c: &TaskSpec, group: &Group) -> (Arc<Record>, Result<u64, JoinError>) {
    let (rec, f) = prepare(env, c, group, None, None);
    let r = match (env.fiber, env.exec, c.via) {
        (true, _, Via::Current) => Handle::current().expect("in an executor fiber").block_on(f),
        (false, Some(exec), Via::Current | Via::Free) => exec.block_on(f),
        _ => env.handle.block_on(f),
    };
    (rec, unwrap_val(r))
}

/// Checks that a task's value was dropped exactly once if it returned
/// one, and never otherwise.
fn check_value_dropped(world: &World, rec: &Record, when: &str) {
    let drops = rec.value_drops.load(SeqCst);
    let returned = matches!(*lock(&rec.outcome), Some(Actual::Returned(_)));
    if drops != usize::from(returned) {
        world.fail(format!(
            "{}: its value was dropped {drops} times {when} (returned one: {returned})",
            rec.who()
        ));
    }
}

/// Checks a join's result against the child's record and the model.
fn check_join(world: &World, rec: &Record, before: Option<FiberId>, r: &Result<u64, JoinError>) {
    let who = rec.who();
    let shutdown = world.shutting_down();
    let cancelled = rec.cancelled.load(SeqCst);
    let outcome = *lock(&rec.outcome);
    let name_ok = |n: &Option<Arc<str>>| n.as_deref() == rec.name.as_deref();
    match r {
        Ok(v) => {
            world.note(if cancelled { Event::CancelledButFinished } else { Event::JoinValue });
            if outcome != Some(Actual::Returned(*v)) {
                world.fail(format!("{who}: join gave Ok({v:#x}), its probe saw {outcome:?}"));
            }
            let tainted = rec.tainted.load(SeqCst);
            if !matches!(rec.expected, Expect::Value(e) if e == *v || tainted) {
                world.fail(format!("{who}: join gave Ok({v:#x}), the model says {:?}", rec.expected));
            }
        }
        Err(JoinError::Panicked { fiber, name, payload }) => {
            world.note(Event::JoinPanicked);
            if rec.expected != Expect::Panic || outcome != Some(Actual::Panicked) {
                world.fail(format!(
                    "{who}: join gave {:?}, the model says {:?}, its probe saw {outcome:?}",
                    r.as_ref().unwrap_err(),
                    rec.expected
                ));
            }
            if payload.message() != Some(planned_message(rec.tag).as_str()) || !name_ok(name) {
                world.fail(format!(
                    "{who}: join gave {:?} (name {:?} expected)",
                    r.as_ref().unwrap_err(),
                    rec.name
                ));
            }
            if before.is_some_and(|b| b != *fiber) {
                world.fail(format!("{who}: panicked in fiber {fiber:?}, its handle said {before:?}"));
            }
        }
        Err(JoinError::Cancelled { fiber, name }) => {
            if !cancelled && !shutdown {
                world.fail(format!(
                    "{who}: join says cancelled, but it was not cancelled and no shutdown began"
                ));
            }
            if !name_ok(name) {
                world.fail(format!("{who}: cancelled join names {name:?}, expected {:?}", rec.name));
            }
            match fiber {
                None => {
                    world.note(Event::JoinCancelledNotStarted);
                    if outcome != Some(Actual::NotStarted) || before.is_some() {
                        world.fail(format!(
                            "{who}: join says cancelled before it started, its probe saw {outcome:?}, its \
                             handle said fiber {before:?}"
                        ));
                    }
                }
                Some(f) => {
                    world.note(Event::JoinCancelledStarted);
                    // At shutdown the join may report the cancel just before
                    // the drained fiber is unwound (JoinError::Cancelled).
                    let ok = outcome == Some(Actual::Unwound) || (outcome.is_none() && shutdown);
                    if !ok || before.is_some_and(|b| b != *f) {
                        world.fail(format!(
                            "{who}: join says cancelled in fiber {f:?}, its probe saw {outcome:?}, its handle \
                             said fiber {before:?}"
                        ));
                    }
                }
            }
        }
        Err(e) => world.fail(format!("{who}: join failed: {e:?}")),
    }
}

/// Folds a join's result into `acc` as the model does (a cancelled
/// child's result is not folded in).
fn join_outcome(
    env: &Env,
    rec: &Record,
    before: Option<FiberId>,
    r: Result<u64, JoinError>,
    acc: u64,
) -> u64 {
    if matches!(r, Ok(_) | Err(JoinError::Panicked { .. } | JoinError::Cancelled { .. })) {
        rec.joined.store(true, SeqCst);
        env.world.joins_returned.fetch_add(1, SeqCst);
    }
    check_join(env.world, rec, before, &r);
    if !env.world.shutting_down() {
        env.world.check_running_stats(env.handle);
    }
    if rec.cancelled.load(SeqCst) {
        return acc;
    }
    match r {
        Ok(v) => {
            if rec.tainted.load(SeqCst) {
                env.taint();
            }
            mix(acc, v)
        }
        Err(JoinError::Panicked { .. }) => mix(acc, PANIC_MARK),
        Err(JoinError::Cancelled { .. }) => {
            env.taint();
            mix(acc, CANCEL_MARK)
        }
        Err(_) => mix(acc, OTHER_MARK),
    }
}

/// Yields (a bounded number of times) until the child has started or
/// finished. Bounded: a child of a lower priority class never starts on
/// this worker while this fiber keeps yielding.
fn wait_started<H: Joinable>(h: &H) {
    for _ in 0..500 {
        if h.fiber_id_().is_some() || h.is_finished_() {
            return;
        }
        spindle_executor::yield_now();
    }
}

fn kid_op<H: Joinable>(
    env: &Env,
    kids: &mut [Option<Kid<H>>],
    joined: &mut [bool],
    op: &KidOp,
    acc: u64,
) -> u64 {
    match op {
        KidOp::Join(at) => {
            if let Some(i) = pick(kids, at) {
                let Kid { h, rec } = kids[i].take().unwrap();
                joined[i] = true;
                let before = h.fiber_id_();
                let r = h.join_();
                return join_outcome(env, &rec, before, r, acc);
            }
        }
        KidOp::Cancel(at, started) => {
            if let Some(i) = pick(kids, at) {
                let kid = kids[i].as_ref().unwrap();
                if *started {
                    wait_started(&kid.h);
                }
                kid.rec.cancelled.store(true, SeqCst);
                kid.h.cancel_();
            }
        }
        KidOp::Detach(at) => {
            if let Some(i) = pick(kids, at) {
                kids[i] = None;
            }
        }
        KidOp::Wake(at, started) => {
            if let Some(i) = pick(kids, at) {
                let kid = kids[i].as_ref().unwrap();
                if *started {
                    wait_started(&kid.h);
                }
                kid.rec.woken.store(true, SeqCst);
                kid.h.wake_();
            }
        }
        KidOp::WaitTimeout(at, us) => {
            if let Some(i) = pick(kids, at) {
                let kid = kids[i].as_ref().unwrap();
                if kid.h.wait_timeout_(Duration::from_micros(u64::from(*us))) {
                    env.world.note(Event::WaitTimeoutDone);
                    if !kid.h.is_finished_() {
                        env.world.fail(format!(
                            "{}: wait_timeout said finished, is_finished says not",
                            kid.rec.who()
                        ));
                    }
                    if lock(&kid.rec.outcome).is_none() && !env.world.shutting_down() {
                        env.world.fail(format!("{}: finished before its closure was dropped", kid.rec.who()));
                    }
                }
            }
        }
    }
    acc
}

/// Runs a script's steps; returns its value and the children it still
/// holds.
fn run_steps(
    env: &Env,
    spec: &TaskSpec,
    mut gives: Option<&mut Gives>,
) -> (u64, Vec<Option<Kid<JoinHandle<Val>>>>) {
    let mut acc = seed(spec.tag);
    let group = make_group(&spec.links);
    let mut kids: Vec<Option<Kid<JoinHandle<Val>>>> = Vec::new();
    let mut joined = Vec::new();
    for step in &spec.steps {
        match step {
            Step::Compute(k) => acc = mix(acc, u64::from(*k)),
            Step::Yield => spindle_executor::yield_now(),
            Step::YieldIfNeeded => spindle_executor::yield_if_needed(),
            Step::Spin(n) => {
                for _ in 0..*n {
                    spindle_executor::yield_now();
                }
            }
            Step::Busy(us, yield_if_needed) => {
                let start = std::time::Instant::now();
                while start.elapsed() < Duration::from_micros(u64::from(*us)) {
                    if *yield_if_needed {
                        spindle_executor::yield_if_needed();
                    }
                    std::hint::spin_loop();
                }
            }
            Step::Sleep(us) => spindle_executor::sleep(Duration::from_micros(u64::from(*us))),
            Step::YieldTimeout(us) => {
                let timed_out = spindle_executor::yield_timeout(Duration::from_micros(u64::from(*us)));
                if !timed_out {
                    env.world.note(Event::YieldTimeoutWoken);
                    let woken = env.me.is_some_and(|me| me.woken.load(SeqCst));
                    if !woken && !env.world.shutting_down() {
                        env.world.fail(format!("{}: yield_timeout reported a wake nobody made", env.who()));
                    }
                }
            }
            Step::Spawn(c) => {
                if let Some(kid) = spawn_kid(env, c, &group) {
                    kids.push(Some(kid));
                    joined.push(false);
                }
            }
            Step::BlockOn(c) => {
                let (rec, r) = block_on_kid(env, c, &group);
                acc = join_outcome(env, &rec, None, r, acc);
            }
            Step::Kid(op) => acc = kid_op(env, &mut kids, &mut joined, op, acc),
            Step::Give(_, Some(id)) => {
                if let Some(g) = gives.as_deref_mut() {
                    g.give(*id);
                }
            }
            Step::Take { link: Some(id), interruptible, deadline, .. } => {
                let Some(link) = env.siblings.map(|g| &g[*id]) else {
                    env.world.fail(format!("{}: a take with no sibling group", env.who()));
                    continue;
                };
                let interruptible = *interruptible || env.interruptible_only;
                let mut got = match deadline {
                    Some(us) => {
                        spindle_executor::interrupt_after(Duration::from_micros(u64::from(*us)), || {
                            take(link, true)
                        })
                    }
                    None => take(link, interruptible),
                };
                let cancelled = env.me.is_some_and(|me| me.cancelled.load(SeqCst));
                if got.is_err() && deadline.is_some() && !cancelled {
                    // The deadline (or a shutdown, which interrupts the
                    // take again): nothing was taken, and the disarmed
                    // deadline interrupts nothing more.
                    env.world.note(Event::TakeTimedOut);
                    got = take(link, interruptible);
                }
                match got {
                    Ok(v) => acc = mix(acc, v),
                    Err(()) => {
                        env.world.note(Event::TakeInterrupted);
                        let cancelled = env.me.is_some_and(|me| me.cancelled.load(SeqCst));
                        if !cancelled && !env.world.shutting_down() {
                            env.world.fail(format!(
                                "{}: its take was interrupted, but it was not cancelled",
                                env.who()
                            ));
                        }
                        // A cancellation point: a cancelled fiber unwinds here.
                        spindle_executor::yield_now();
                        env.world
                            .fail(format!("{}: went on after an interrupted take and yield_now", env.who()));
                    }
                }
            }
            Step::Give(_, None) | Step::Take { link: None, .. } => {}
            Step::Scope(sc) => acc = run_scope(env, sc, acc),
        }
    }
    (acc, kids)
}

/// Takes a link's token or message; `Err` if interrupted.
fn take(link: &LinkRt, interruptible: bool) -> Result<u64, ()> {
    let got = match (link.chan, interruptible) {
        (true, true) => link.ch.pop_interruptible().map_err(|_| ())?.map(Msg::into_inner),
        (true, false) => link.ch.pop().map(Msg::into_inner),
        (false, true) => link.sem.acquire_interruptible().map(|()| link.value).map_err(|_| ()).map(Some)?,
        (false, false) => {
            link.sem.acquire();
            Some(link.value)
        }
    };
    // The channel is never closed: `None` would be a bug; the value then
    // differs from the model's.
    Ok(got.unwrap_or(OTHER_MARK))
}

/// What a scope's body works with; borrowed data lives in `run_scope`.
struct ScopeData<'a, 'env> {
    env: &'a Env<'a>,
    sc: &'a ScopeSpec,
    recs: &'a [Arc<Record>],
    group: &'a Group,
    slots: Vec<&'env mut u64>,
    inputs: &'env [u64],
    sum: &'env AtomicU64,
    joined: &'a mut Vec<bool>,
    body_out: &'a mut Option<u64>,
    owner: u32,
}

fn scope_body<'scope, 'env>(s: &'scope Scope<'scope, 'env>, d: ScopeData<'_, 'env>) {
    let env = d.env;
    let mut kids: Vec<Option<Kid<ScopedJoinHandle<'scope, Val>>>> = Vec::new();
    for (i, (slot, input)) in d.slots.into_iter().zip(d.inputs).enumerate() {
        let c = &d.sc.children[i];
        let rec = d.recs[i].clone();
        let t = task_ctx(env, c, d.group, &rec);
        let sum = d.sum;
        let f = move || {
            run_task(t, move |v| {
                let v = mix(v, *input);
                *slot = v;
                sum.fetch_add(v, SeqCst);
                v
            })
        };
        let h = if !c.named && c.prio == Prio::Normal && c.via == Via::Free {
            s.spawn(f)
        } else {
            s.spawn_with(options(c), f)
        };
        kids.push(Some(Kid { h, rec }));
    }
    let mut body = BODY_SEED;
    for op in &d.sc.ops {
        match op {
            ScopeOp::Kid(op) => body = kid_op(env, &mut kids, d.joined, op, body),
            ScopeOp::Yield => spindle_executor::yield_now(),
        }
    }
    *d.body_out = Some(body);
    drop(kids);
    if d.sc.body_panics {
        std::panic::panic_any(format!("{PLANNED} in a scope body of task {}", d.owner));
    }
}

fn payload_str(p: &(dyn std::any::Any + Send)) -> Option<&str> {
    p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied())
}

fn run_scope(env: &Env, sc: &ScopeSpec, acc: u64) -> u64 {
    let n = sc.children.len();
    let owner = env.me.map_or(0, |r| r.tag);
    let inputs = scope_inputs(acc, n);
    let mut slots = vec![SENTINEL; n];
    let sum = AtomicU64::new(0);
    let group = make_group(&sc.links);
    let recs: Vec<Arc<Record>> = sc
        .children
        .iter()
        .zip(&inputs)
        .map(|(c, i)| env.world.record(c.tag, name_of(c), expect_scoped(c, *i)))
        .collect();
    let mut joined = vec![false; n];
    let mut body_out = None;
    let result = {
        let d = ScopeData {
            env,
            sc,
            recs: &recs,
            group: &group,
            slots: slots.iter_mut().collect(),
            inputs: &inputs,
            sum: &sum,
            joined: &mut joined,
            body_out: &mut body_out,
            owner,
        };
        catch_unwind(AssertUnwindSafe(|| match (env.fiber, env.exec, sc.via_current) {
            (true, _, true) => Handle::current().expect("in an executor fiber").scope(|s| scope_body(s, d)),
            (false, Some(exec), true) => exec.scope(|s| scope_body(s, d)),
            _ => env.handle.scope(|s| scope_body(s, d)),
        }))
    };
    // The scope is over: every scoped task is gone, so every probe has
    // been dropped, and the slots hold what the fibers wrote.
    let body_panicked = match &result {
        Ok(()) => false,
        Err(p) if payload_str(&**p).is_some_and(|m| m.starts_with(PLANNED)) => {
            env.world.note(Event::ScopeBodyPanicked);
            true
        }
        Err(p) if payload_str(&**p).is_some_and(|m| m.starts_with(SCOPE_PANIC)) => {
            env.world.note(Event::ScopePanicked);
            false
        }
        // A cancel or the shutdown unwinding the owner: let it go on.
        Err(_) => spindle_fiber::resume_unwind(result.unwrap_err()),
    };
    let who = env.who();
    let mut unjoined_failure = false;
    let mut returned_sum = 0u64;
    for (i, rec) in recs.iter().enumerate() {
        check_value_dropped(env.world, rec, "when its scope returned");
        let outcome = *lock(&rec.outcome);
        match outcome {
            None => env
                .world
                .fail(format!("{who}: its scope returned before scoped {}'s closure was dropped", rec.who())),
            Some(Actual::Returned(v)) => {
                returned_sum = returned_sum.wrapping_add(v);
                if slots[i] != v {
                    env.world.fail(format!(
                        "{who}: scoped {} returned {v:#x} but its slot holds {:#x}",
                        rec.who(),
                        slots[i]
                    ));
                }
            }
            Some(o) => {
                if slots[i] != SENTINEL {
                    env.world.fail(format!("{who}: scoped {} ended {o:?} but wrote its slot", rec.who()));
                }
                if !joined[i] && matches!(o, Actual::Panicked | Actual::Unwound) {
                    unjoined_failure = true;
                }
            }
        }
    }
    if sum.load(SeqCst) != returned_sum {
        env.world.fail(format!("{who}: the scope's shared sum disagrees with what its fibers returned"));
    }
    let scope_panicked = result.is_err() && !body_panicked;
    if body_panicked != sc.body_panics || scope_panicked != (unjoined_failure && !sc.body_panics) {
        env.world.fail(format!(
            "{who}: scope ended {} (body panics: {}, an unjoined fiber panicked or was cancelled after it \
             started: {unjoined_failure})",
            match (body_panicked, scope_panicked) {
                (true, _) => "with the body's panic",
                (false, true) => "with a panic for an unjoined fiber",
                (false, false) => "normally",
            },
            sc.body_panics
        ));
    }
    if sc.body_panics {
        return mix(acc, BODY_PANIC_MARK);
    }
    let mut acc = mix(acc, body_out.unwrap_or(OTHER_MARK));
    for (rec, slot) in recs.iter().zip(&slots) {
        if !rec.cancelled.load(SeqCst) {
            // A fiber the shutdown cancelled wrote no slot, or a value
            // that differs from the model's (checked at the end).
            let outcome = *lock(&rec.outcome);
            if matches!(outcome, Some(Actual::Unwound | Actual::NotStarted)) || rec.tainted.load(SeqCst) {
                env.taint();
            }
            acc = mix(acc, *slot);
        }
    }
    acc
}

// ---------------------------------------------------------------------------
// Cases

#[derive(Debug, Clone)]
struct Cfg {
    workers: usize,
    max_workers: usize,
    stack_kib: usize,
    time_slice_us: u64,
    idle_retire_us: u64,
    sysmon_us: u64,
}

fn cfg() -> impl Strategy<Value = Cfg> {
    (
        1usize..=3,
        0usize..=1,
        prop::sample::select(vec![64usize, 128]),
        prop::sample::select(vec![500u64, 10_000]),
        prop::sample::select(vec![1_000u64, 100_000]),
        prop::sample::select(vec![250u64, 1_000]),
    )
        .prop_map(|(workers, extra, stack_kib, time_slice_us, idle_retire_us, sysmon_us)| Cfg {
            workers,
            max_workers: workers + extra,
            stack_kib,
            time_slice_us,
            idle_retire_us,
            sysmon_us,
        })
}

fn build(c: &Cfg) -> Executor {
    Executor::builder()
        .workers(c.workers)
        .max_workers(c.max_workers)
        .stack_size(c.stack_kib * 1024)
        .time_slice(Duration::from_micros(c.time_slice_us))
        .idle_retire(Duration::from_micros(c.idle_retire_us))
        .sysmon_interval(Duration::from_micros(c.sysmon_us))
        .build()
}

fn kid_op_strategy() -> impl Strategy<Value = KidOp> {
    prop_oneof![
        4 => any::<Index>().prop_map(KidOp::Join),
        2 => (any::<Index>(), any::<bool>()).prop_map(|(at, started)| KidOp::Cancel(at, started)),
        1 => any::<Index>().prop_map(KidOp::Detach),
        1 => (any::<Index>(), any::<bool>()).prop_map(|(at, started)| KidOp::Wake(at, started)),
        1 => (any::<Index>(), micros()).prop_map(|(at, us)| KidOp::WaitTimeout(at, us)),
    ]
}

/// Microseconds of a sleep or timed wait: mostly a few hundred, at most
/// a few milliseconds.
fn micros() -> impl Strategy<Value = u16> {
    prop_oneof![4 => 0u16..300, 1 => 300u16..3000]
}

fn leaf_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => any::<u8>().prop_map(Step::Compute),
        2 => Just(Step::Yield),
        1 => Just(Step::YieldIfNeeded),
        1 => (1u8..20).prop_map(Step::Spin),
        1 => (0u16..1500, any::<bool>()).prop_map(|(us, y)| Step::Busy(us, y)),
        1 => micros().prop_map(Step::Sleep),
        1 => micros().prop_map(Step::YieldTimeout),
        4 => kid_op_strategy().prop_map(Step::Kid),
        1 => any::<Index>().prop_map(|at| Step::Give(at, None)),
        2 => (any::<Index>(), any::<bool>(), any::<bool>())
            .prop_map(|(pick, chan, interruptible)| Step::Take { pick, chan, interruptible, deadline: None, link: None }),
        1 => (any::<Index>(), any::<bool>(), micros())
            .prop_map(|(pick, chan, us)| Step::Take { pick, chan, interruptible: true, deadline: Some(us), link: None }),
    ]
}

fn step(depth: u32) -> BoxedStrategy<Step> {
    if depth == 0 {
        return leaf_step().boxed();
    }
    let child = || task(depth - 1, 0..6);
    prop_oneof![
        10 => leaf_step(),
        4 => child().prop_map(|c| Step::Spawn(Box::new(c))),
        1 => child().prop_map(|c| Step::BlockOn(Box::new(c))),
        1 => scope(depth - 1).prop_map(Step::Scope),
    ]
    .boxed()
}

fn scope(depth: u32) -> impl Strategy<Value = ScopeSpec> {
    let op = prop_oneof![4 => kid_op_strategy().prop_map(ScopeOp::Kid), 1 => Just(ScopeOp::Yield)];
    (
        any::<bool>(),
        prop::collection::vec(task(depth, 0..5), 0..4),
        prop::collection::vec(op, 0..6),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(via_current, children, ops, body_panics)| ScopeSpec {
            via_current,
            children,
            ops,
            body_panics,
            links: Vec::new(),
        })
}

fn task(depth: u32, steps: std::ops::Range<usize>) -> BoxedStrategy<TaskSpec> {
    let prio = prop_oneof![1 => Just(Prio::Low), 2 => Just(Prio::Normal), 1 => Just(Prio::High)];
    let via = prop_oneof![Just(Via::Free), Just(Via::Current), Just(Via::Captured)];
    (
        prop::bool::weighted(0.3),
        prio,
        via,
        prop::collection::vec(step(depth), steps),
        prop::bool::weighted(0.15),
        prop::bool::weighted(0.05),
    )
        .prop_map(|(named, prio, via, steps, panics, self_join)| TaskSpec {
            tag: 0,
            named,
            prio,
            via,
            steps,
            panics,
            self_join,
            gives: Vec::new(),
            links: Vec::new(),
        })
        .boxed()
}

#[derive(Debug, Clone)]
struct Case {
    cfg: Cfg,
    root: TaskSpec,
}

fn case() -> impl Strategy<Value = Case> {
    (cfg(), task(3, 0..16)).prop_map(|(cfg, mut root)| {
        normalize(&mut root, &mut 0);
        unlink_root(&mut root);
        Case { cfg, root }
    })
}

/// How a case ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Waits until every closure has been dropped, then drops the
    /// executor.
    Quiesce,
    /// Drops the executor as soon as the root's script is done, with
    /// detached tasks running; joins the handles the root still holds
    /// afterwards, and spawns once more through a handle.
    Shutdown,
    /// As `Shutdown`, with the last `Executor` dropped inside one of its
    /// own fibers (its shutdown then runs on a thread of its own); waits
    /// for that shutdown to end (`stats().workers` is 0 then).
    DropInFiber,
}

/// Installs (once) a panic hook that keeps planned panics quiet and
/// passes every other panic on to the one before (spindle-fiber's, which
/// names the fiber; installed with the first fiber, made here first).
fn quiet_planned_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        drop(spindle_fiber::Fiber::<()>::new(spindle_fiber::FiberAttr::new()).expect("a fiber"));
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if payload_str(info.payload())
                .is_some_and(|m| m.starts_with(PLANNED) || m.starts_with(SCOPE_PANIC))
            {
                return;
            }
            previous(info);
        }));
    });
}

/// One case at a time: the executors' threads share two cores, and the
/// leaked-stack count is the process's.
static SERIAL: Mutex<()> = Mutex::new(());

fn run_case(case: &Case, end: End) -> TestCaseResult {
    let _serial = lock(&SERIAL);
    let leaked_before = spindle_fiber::leaked_stacks();
    let world = Arc::new(World::new(&case.cfg, end));
    let exec = build(&case.cfg);
    let handle = exec.handle();
    let (root_value, kids) = {
        let env = Env {
            world: &world,
            handle: &handle,
            exec: Some(&exec),
            fiber: false,
            me: None,
            siblings: None,
            interruptible_only: end != End::Quiesce,
        };
        if Handle::current().is_some() {
            world.fail("Handle::current() is Some on the test's thread".to_owned());
        }
        run_steps(&env, &case.root, None)
    };
    let expected = expect(&case.root);
    if expected != Expect::Value(root_value) {
        world.fail(format!("the root computed {root_value:#x}, the model says {expected:?}"));
    }
    world.check_running_stats(&handle);
    match end {
        End::Quiesce => {
            drop(kids);
            if !world.wait_quiescent() {
                world.fail(format!(
                    "{} closures were still not dropped after {QUIESCE_BOUND:?} (a lost wakeup or a deadlock)",
                    lock(&world.live)
                ));
                return Err(TestCaseError::fail(lock(&world.violations).join("\n")));
            }
            drop(exec);
        }
        End::Shutdown | End::DropInFiber => {
            world.shutdown_started.store(true, SeqCst);
            if end == End::Shutdown {
                drop(exec);
            } else {
                // The drop returns at once in the fiber, which goes on and
                // returns its value.
                let rec = world.record(u32::MAX - 1, None, Expect::Value(0));
                let probe = Probe::new(&world, &rec);
                let dropper = handle.spawn(move || {
                    probe.rec.started.store(true, SeqCst);
                    drop(exec);
                    probe.finish(0);
                    0
                });
                match dropper.join() {
                    Ok(0) => {}
                    other => world.fail(format!("the fiber that dropped the executor joined with {other:?}")),
                }
            }
            let env = Env {
                world: &world,
                handle: &handle,
                exec: None,
                fiber: false,
                me: None,
                siblings: None,
                interruptible_only: true,
            };
            for kid in kids.into_iter().flatten() {
                let before = kid.h.fiber_id();
                let r = unwrap_val(kid.h.join());
                join_outcome(&env, &kid.rec, before, r, 0);
            }
            // A spawn through a handle that outlived its executor never
            // runs: its join fails at once as cancelled.
            let rec = world.record(u32::MAX, None, Expect::Value(0));
            let probe = Probe::new(&world, &rec);
            let h = handle.spawn(move || {
                probe.rec.started.store(true, SeqCst);
                probe.finish(0);
                0
            });
            match h.join() {
                Err(JoinError::Cancelled { fiber: None, name: None }) => {}
                other => world.fail(format!("a spawn after the drop joined with {other:?}")),
            }
            if *lock(&rec.outcome) != Some(Actual::NotStarted) {
                world.fail("a spawn after the drop ran, or its closure was kept".to_owned());
            }
            if end == End::DropInFiber {
                if !world.wait_quiescent() {
                    world.fail(format!(
                        "{} closures were still not dropped {QUIESCE_BOUND:?} after the executor was dropped \
                         in a fiber",
                        lock(&world.live)
                    ));
                    return Err(TestCaseError::fail(lock(&world.violations).join("\n")));
                }
                // The shutdown thread's last step (the watchdog bounds it).
                common::spin_until(|| handle.stats().workers == 0);
            }
        }
    }
    // The executor's drop has returned: every task ran to its end or was
    // cancelled (and its closure dropped, run or not).
    let stats = handle.stats();
    let shutdown = world.shutting_down();
    let recs = lock(&world.records).clone();
    let mut cancelled = 0;
    for rec in &recs {
        let who = rec.who();
        let outcome = *lock(&rec.outcome);
        let tainted = rec.tainted.load(SeqCst);
        if rec.tag < u32::MAX - 1 {
            check_value_dropped(&world, rec, "when the executor's drop had returned");
        }
        match outcome {
            None => world.fail(format!(
                "{who}: when the executor's drop returned, its closure had neither ended nor been dropped"
            )),
            Some(Actual::Returned(v)) => {
                if !matches!(rec.expected, Expect::Value(e) if e == v || tainted) {
                    world.fail(format!("{who}: returned {v:#x}, the model says {:?}", rec.expected));
                }
                if !rec.joined.load(SeqCst) {
                    world.note(Event::UnjoinedReturned);
                }
            }
            Some(Actual::Panicked) => {
                if rec.expected != Expect::Panic {
                    world.fail(format!("{who}: panicked, the model says {:?}", rec.expected));
                }
            }
            Some(o @ (Actual::Unwound | Actual::NotStarted)) => {
                cancelled += 1;
                if !rec.cancelled.load(SeqCst) && !shutdown {
                    world.fail(format!("{who}: ended {o:?} though it was not cancelled"));
                }
                match (rec.cancelled.load(SeqCst), o) {
                    (true, Actual::Unwound) => world.note(Event::CancelUnwound),
                    (true, _) => world.note(Event::CancelNeverRan),
                    (false, Actual::Unwound) if !rec.joined.load(SeqCst) => {
                        world.note(Event::UnjoinedUnwoundAtShutdown)
                    }
                    (false, _) => {}
                }
            }
        }
        if tainted && !shutdown {
            world.fail(format!("{who}: saw a child cancelled without a cancel or a shutdown"));
        }
    }
    let expected_stats = (recs.len() as u64, recs.len() as u64, cancelled, 0usize, 0u64);
    let got = (stats.spawned, stats.completed, stats.cancelled, stats.workers, stats.deadlocks);
    if got != expected_stats {
        world.fail(format!(
            "stats after the drop: (spawned, completed, cancelled, workers, deadlocks) = {got:?}, expected \
             {expected_stats:?}: {stats:?}"
        ));
    }
    if stats.scale_ups > 0 {
        world.note(Event::ScaledUp);
    }
    if stats.peak_workers < case.cfg.workers || stats.peak_workers > case.cfg.max_workers {
        world.fail(format!("stats after the drop: peak workers {} out of range", stats.peak_workers));
    }
    let leaked = spindle_fiber::leaked_stacks() - leaked_before;
    if leaked != 0 {
        world.fail(format!("{leaked} fiber stacks leaked"));
    }
    let violations = std::mem::take(&mut *lock(&world.violations));
    if violations.is_empty() {
        Ok(())
    } else {
        Err(TestCaseError::fail(violations.join("\n")))
    }
}

/// Runs `cases` cases (or `PROPTEST_CASES`) of `end` under a watchdog
/// that fails the test, naming the case being run, if no case finishes
/// for `WATCHDOG_SECS`; panics with proptest's minimal failing case.
fn check(name: &'static str, default_cases: u32, end: End) {
    assert!(ALL_EVENTS.iter().enumerate().all(|(i, &e)| e as usize == i), "ALL_EVENTS in declaration order");
    quiet_planned_panics();
    let done = Arc::new(AtomicU64::new(0));
    let progress = {
        let done = done.clone();
        move || done.load(SeqCst)
    };
    let status = {
        let done = done.clone();
        move || format!("{} cases finished", done.load(SeqCst))
    };
    watchdog_with_progress(name, WATCHDOG_SECS, status, progress, move |stage| {
        let cases =
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default_cases);
        let config = Config { cases, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new(config);
        let result = runner.run(&case(), |case| {
            stage.set(format!("running the case {case:#?}"));
            let r = run_case(&case, end);
            done.fetch_add(1, SeqCst);
            r
        });
        if let Err(e) = result {
            panic!("{name}: {e}");
        }
        // With the default number of cases the outcomes the property is
        // about occur (each at least a dozen times in trial runs): a
        // generator change that made one unreachable fails here. The rare
        // ones (a few per hundred cases) are counted, not required.
        let tally: Vec<(Event, usize)> =
            ALL_EVENTS.iter().map(|&e| (e, TALLY[end as usize][e as usize].load(SeqCst))).collect();
        if std::env::var("MODEL_EXECUTOR_TALLY").is_ok() {
            eprintln!("{name}: {tally:?}");
        }
        if cases >= default_cases {
            let missed: Vec<Event> =
                tally.iter().filter(|&&(e, n)| n == 0 && required(e, end)).map(|&(e, _)| e).collect();
            assert!(missed.is_empty(), "{name}: never exercised: {missed:?} (tally {tally:?})");
        }
    })
}

/// Whether a run of the default length of the property must see `e`.
fn required(e: Event, end: End) -> bool {
    match e {
        Event::TakeInterrupted | Event::YieldTimeoutWoken | Event::TakeTimedOut | Event::ScaledUp => false,
        Event::UnjoinedUnwoundAtShutdown | Event::JoinCancelledStarted | Event::JoinCancelledNotStarted => {
            end != End::Quiesce
        }
        _ => true,
    }
}

/// Any tree of tasks, run to quiescence on an executor of 1-3 workers
/// (up to one more by scaling), behaves as the scripts say: a join of a
/// task not cancelled returns the model's value, or `Panicked` with the
/// planned message, the task's name and its fiber; a join of a cancelled
/// task returns its value (it finished first) or `Cancelled`, with no
/// fiber exactly when its closure was dropped without running; tokens
/// and messages handed between siblings arrive (an interruptible take is
/// interrupted only in a cancelled fiber, which then unwinds at its next
/// `yield_now`); `yield_timeout` reports a wake only after a `wake`; a
/// scope returns only after every scoped closure is gone, its fibers saw
/// the borrowed inputs and wrote the borrowed slots exactly when they
/// returned, and it panics exactly when its body did or an unjoined
/// scoped fiber panicked or was unwound by a cancel; unjoined tasks run
/// to their end; once the executor is dropped, `stats()` counts every
/// task spawned, completed, and as cancelled exactly those unwound by a
/// cancel or never started; no join made while tasks ran returned before
/// its task was counted; no stack leaks and nothing panics unplanned.
#[test]
fn task_trees_follow_the_model() {
    check("task_trees_follow_the_model", DEFAULT_CASES, End::Quiesce);
}

/// The same trees (every take interruptible), with the executor dropped
/// as soon as the root's script is done: when the drop returns, every
/// task has run to its end or been cancelled (unwound, destructors run,
/// or dropped unstarted), none panicked unplanned, the handles the root
/// still held join with an outcome its probe agrees with, a spawn through
/// a handle that outlived the executor fails at once as cancelled without
/// running, and the stats add up as in the quiescent property.
#[test]
fn shutdown_completes_or_cancels_every_task() {
    check("shutdown_completes_or_cancels_every_task", DEFAULT_CASES, End::Shutdown);
}

/// As `shutdown_completes_or_cancels_every_task`, with the last
/// `Executor` dropped inside one of its own fibers: that fiber's drop
/// returns at once and the fiber returns its value, the executor refuses
/// spawns from then on, and once its shutdown (on a thread of its own)
/// is over, every task has run to its end or been cancelled, and the
/// stats add up.
#[test]
fn dropping_the_executor_in_its_own_fiber_completes_or_cancels_every_task() {
    check(
        "dropping_the_executor_in_its_own_fiber_completes_or_cancels_every_task",
        DEFAULT_CASES,
        End::DropInFiber,
    );
}
