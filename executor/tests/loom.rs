//! Loom models of the executor's parking protocol (`src/shared.rs`, module
//! docs; DESIGN.md, "The executor", "Parking protocol").
//!
//! Run with:
//!
//! ```text
//! LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test --release -p spindle-executor --test loom
//! ```
//!
//! The executor's queues are crossbeam-deque's and its parkers crossbeam's,
//! which loom cannot see, so the protocol is mirrored here line for line
//! rather than run: each function below names the function of `src/` it
//! mirrors, and a change there must be made here too. Mirrored:
//!
//! * worker side (`worker.rs`): `main_loop`, `next`, `drain_inbox`, `idle`
//!   (base workers; the extra workers' choice of park against a retirement
//!   and against a scale-up have models of their own, models 5 and 6),
//!   `start` (a job that starts, or goes back on the global queue for want
//!   of a stack), `finish`'s end of `stack_starved`,
//!   `WorkerCtx::push_local`;
//! * notifier side (`shared.rs`): `Inbox::notify`, `Inbox::schedule`,
//!   `Shared::push_fresh`, `wake_one_parked`, `work_visible`,
//!   `pending_work`, `steal`, `wake_all`; and step 3 of `Executor::drop`
//!   (`exit`, then `wake_all`), which ends models 1-4.
//!
//! Modelled:
//!
//! * one priority class (the code checks the classes in turn, with the same
//!   steps for each); every worker active (no scaling);
//! * crossbeam's `Injector` and `Worker`/`Stealer` are reduced to their
//!   indices, with the orderings crossbeam-deque 0.8 uses on them in `push`,
//!   `pop`, `steal` and `is_empty` (the protocol's argument rests on those);
//!   `steal_batch_and_pop` takes one job, as it does with at most two
//!   queued (model 8 can have three queued, where crossbeam would take two
//!   and keep one in the stealer's own deque: not modelled; the
//!   last-searcher rule is believed to cover it, since the stealer is
//!   then busy with a job and the kept one is stealable). A job's payload is kept beside the indices in a std mutex that
//!   loom does not see; crossbeam's own slot hand-off is not re-checked;
//! * the inbox is a `VecDeque` under a loom mutex plus the real `len`;
//! * a worker's `Parker` is loom's thread park: an unpark that comes before
//!   the park leaves a token, as crossbeam's does;
//! * loom treats SeqCst loads and stores as Acquire/Release (loom's README,
//!   "Unsupported features"), so the worker's step 1 in the code is a SeqCst
//!   store followed by a SeqCst fence (`Worker::idle`), which loom models
//!   exactly ([`store_seq_cst`]), pairing with the notifier's fence;
//! * a start fails for want of a stack for the first `failing_starts`
//!   starts and succeeds after; the back-off that follows a failure
//!   (`main_loop`'s timed park) ends at once (loom has no clock).
//!
//! Models 1-4 end with all their jobs run and every worker gone: a lost
//! wakeup leaves a worker parked with work queued that nobody else can take
//! (loom reports a deadlock). Models 5 and 6 end when their idle worker has
//! either seen itself the highest or been woken. Models 7-12 end as models
//! 1-4 do.

#![cfg(loom)]

use std::collections::VecDeque;
use std::sync::atomic::{
    AtomicBool as StdAtomicBool, AtomicUsize as StdAtomicUsize, Ordering as StdOrdering,
};
use std::sync::{Arc, Mutex as StdMutex, OnceLock};

use loom::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Condvar, Mutex};
use loom::thread::{self, JoinHandle, Thread};

/// with `LOOM_TRACE_EVENTS` set, the protocol's events of the
/// execution under way, printed if it panics (loom's deadlock report).
static EVENTS: StdMutex<Vec<String>> = StdMutex::new(Vec::new());

fn tracing() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let on = std::env::var_os("LOOM_TRACE_EVENTS").is_some();
        if on {
            let prev = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                let p = info.payload();
                let msg = p.downcast_ref::<&str>().copied().or(p.downcast_ref::<String>().map(|s| &s[..]));
                if !msg.is_some_and(|m| m.contains("deadlock")) {
                    return prev(info);
                }
                eprintln!("events of the failing execution:");
                for e in EVENTS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                    eprintln!("  {e}");
                }
                prev(info)
            }));
        }
        on
    })
}

fn ev(f: impl FnOnce() -> String) {
    if tracing() {
        EVENTS.lock().unwrap_or_else(|e| e.into_inner()).push(f());
    }
}

/// When `LOOM_MAX_PREEMPTIONS` is not set.
const DEFAULT_PREEMPTIONS: usize = 3;

/// `worker.rs`: `SEARCH_ROUNDS` is 64. One round here: each round is one
/// more `next()`, and the rounds' count plays no part in the protocol.
const SEARCH_ROUNDS: u32 = 1;

/// `worker.rs`: `SEARCH_ROUNDS`. The count itself plays no part, but its
/// parity does: `next()` takes resumed fibers or fresh jobs first by the
/// parity of `tick`, which the real search advances by 64 (from a review).
const REAL_SEARCH_ROUNDS: u64 = 64;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(DEFAULT_PREEMPTIONS);
    }
    builder.check(f);
}

/// Worker step 1 as in `Worker::idle`: `parked.store(true, SeqCst)` and a
/// SeqCst fence (see the module docs).
fn store_seq_cst(flag: &AtomicBool, value: bool) {
    flag.store(value, Ordering::SeqCst);
    fence(Ordering::SeqCst);
}

/// What a job does when it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    /// Returns at once.
    Plain,
    /// Spawns a `Plain` child from the fiber (`push_local`), then stays busy
    /// (does not return to its worker's loop) until every other job, the
    /// child included, has run.
    SpawnChildThenWait,
    /// Stays busy until every other job has run.
    WaitForOthers,
    /// Spawns `WaitForOne` then `Plain` from the fiber (`push_local`),
    /// then stays busy until every other job has run.
    SpawnTwoThenWait,
    /// Stays busy (blocks its worker) until one other job has completed.
    WaitForOne,
    /// Spawns `WaitForOne`, `WaitForOne` then `Plain` from the fiber
    /// (`push_local`), then stays busy until every other job has run: the
    /// `Plain` one needs a fourth worker.
    SpawnThreeThenWait,
    /// Stays busy (blocks its worker) until `n` jobs have completed.
    WaitFor(usize),
}

/// `crossbeam_deque::Injector<Job>`, reduced to its indices.
struct Injector {
    head: AtomicUsize,
    tail: AtomicUsize,
    jobs: StdMutex<Vec<Body>>,
}

impl Injector {
    fn new() -> Injector {
        Injector { head: AtomicUsize::new(0), tail: AtomicUsize::new(0), jobs: StdMutex::new(Vec::new()) }
    }

    /// `Injector::push`: the tail index moves with a SeqCst CAS.
    fn push(&self, job: Body) {
        self.jobs.lock().unwrap().push(job);
        self.tail.fetch_add(1, Ordering::SeqCst);
    }

    /// `Injector::is_empty`: SeqCst loads of both indices.
    fn is_empty(&self) -> bool {
        let head = self.head.load(Ordering::SeqCst);
        let tail = self.tail.load(Ordering::SeqCst);
        head == tail
    }

    /// `Injector::steal` / `steal_batch_and_pop` under `retry`: head
    /// (Acquire), a SeqCst fence, tail (Relaxed), a SeqCst CAS of the head.
    fn steal(&self) -> Option<Body> {
        loop {
            let head = self.head.load(Ordering::Acquire);
            fence(Ordering::SeqCst);
            let tail = self.tail.load(Ordering::Relaxed);
            if head == tail {
                return None;
            }
            if self.head.compare_exchange(head, head + 1, Ordering::SeqCst, Ordering::Acquire).is_ok() {
                return Some(self.jobs.lock().unwrap()[head]);
            }
        }
    }
}

/// `crossbeam_deque::Worker<Job>` (FIFO) and its `Stealer`, reduced to
/// their indices: the owner pushes and pops, the others steal.
struct Deque {
    front: AtomicUsize,
    back: AtomicUsize,
    jobs: StdMutex<Vec<Body>>,
}

impl Deque {
    fn new() -> Deque {
        Deque { front: AtomicUsize::new(0), back: AtomicUsize::new(0), jobs: StdMutex::new(Vec::new()) }
    }

    /// `Worker::push` (owner): a Release fence, then a Relaxed store of the
    /// back index.
    fn push(&self, job: Body) {
        let b = self.back.load(Ordering::Relaxed);
        self.jobs.lock().unwrap().push(job);
        fence(Ordering::Release);
        self.back.store(b + 1, Ordering::Relaxed);
    }

    /// `Worker::pop`, FIFO flavour (owner).
    fn pop(&self) -> Option<Body> {
        let b = self.back.load(Ordering::Relaxed);
        let f = self.front.load(Ordering::Relaxed);
        if b.wrapping_sub(f) as isize <= 0 {
            return None;
        }
        let f = self.front.fetch_add(1, Ordering::SeqCst);
        if (b.wrapping_sub(f + 1) as isize) < 0 {
            self.front.store(f, Ordering::Relaxed);
            return None;
        }
        Some(self.jobs.lock().unwrap()[f])
    }

    /// `Stealer::is_empty`: front (Acquire), a SeqCst fence, back (Acquire).
    fn is_empty(&self) -> bool {
        let f = self.front.load(Ordering::Acquire);
        fence(Ordering::SeqCst);
        let b = self.back.load(Ordering::Acquire);
        b.wrapping_sub(f) as isize <= 0
    }

    /// `Stealer::steal` / `steal_batch_and_pop` under `retry`: front
    /// (Acquire), a SeqCst fence (`epoch::pin`), back (Acquire), a SeqCst
    /// CAS of the front.
    fn steal(&self) -> Option<Body> {
        loop {
            let f = self.front.load(Ordering::Acquire);
            fence(Ordering::SeqCst);
            let b = self.back.load(Ordering::Acquire);
            if b.wrapping_sub(f) as isize <= 0 {
                return None;
            }
            if self.front.compare_exchange(f, f + 1, Ordering::SeqCst, Ordering::Relaxed).is_ok() {
                return Some(self.jobs.lock().unwrap()[f]);
            }
        }
    }
}

/// `shared.rs`: `Inbox`.
struct Inbox {
    /// `queues` (one class): started fibers woken by other threads.
    queues: Mutex<VecDeque<Body>>,
    len: AtomicUsize,
    parked: AtomicBool,
}

/// `shared.rs`: `WorkerShared` (what the protocol touches).
struct WorkerShared {
    fresh: Injector,
    /// The worker's local deque (`WorkerCtx::locals`) and its stealer
    /// (`WorkerShared::stealers`).
    local: Deque,
    inbox: Inbox,
}

impl WorkerShared {
    /// `WorkerShared::has_fresh`.
    fn has_fresh(&self) -> bool {
        !self.fresh.is_empty() || !self.local.is_empty()
    }
}

/// Which paths of the protocol some execution of a model took (bookkeeping
/// outside loom: loom runs one thread at a time).
#[derive(Default)]
struct Coverage {
    /// A worker was unparked by a notifier (before shutdown).
    woken_by_notifier: StdAtomicBool,
    /// A worker's re-check (worker step 2) found work.
    recheck_found_work: StdAtomicBool,
    /// A notifier found its target awake and woke another parked worker.
    woke_another: StdAtomicBool,
    /// A job put back for want of a stack woke a parked worker
    /// (`Worker::start`).
    put_back_woke: StdAtomicBool,
}

impl Coverage {
    const fn new() -> Coverage {
        Coverage {
            woken_by_notifier: StdAtomicBool::new(false),
            recheck_found_work: StdAtomicBool::new(false),
            woke_another: StdAtomicBool::new(false),
            put_back_woke: StdAtomicBool::new(false),
        }
    }

    fn note(flag: &StdAtomicBool) {
        flag.store(true, StdOrdering::Relaxed);
    }

    fn assert(flag: &StdAtomicBool, what: &str) {
        assert!(flag.load(StdOrdering::Relaxed), "no execution reached: {what}");
    }
}

/// `shared.rs`: `Shared` (what the protocol touches), plus the model's
/// bookkeeping.
struct World {
    workers: Vec<WorkerShared>,
    global: Injector,
    searching: AtomicUsize,
    next_spawn: AtomicUsize,
    exit: AtomicBool,
    /// `Inbox::unparker`, one per worker: set before any worker runs.
    unparkers: OnceLock<Vec<Thread>>,
    /// Jobs and fibers run so far; the last one shuts the executor down.
    done: Mutex<usize>,
    done_cv: Condvar,
    total: usize,
    /// Set just before shutdown wakes everyone (bookkeeping).
    shutting_down: StdAtomicBool,
    coverage: &'static Coverage,
    /// Worker step 3b (a re-check that found work with no searcher left
    /// wakes one more); `false` is the code before it, which model 7 must
    /// catch.
    step_3b: bool,
    /// A worker woken from its park searches (counts in `searching`) on its
    /// next round, so that finding work as the last searcher with more
    /// pending wakes one more (`Worker::main_loop`); `false` is the code
    /// before that (a woken worker took work straight from `next()`), which
    /// models 8 and 9 must catch.
    woken_search: bool,
    /// `Shared::stack_pressure`.
    stack_pressure: AtomicBool,
    /// How many starts, the first ones, fail for want of a stack (a
    /// `Fiber::new` that finds no stack, with some mapped elsewhere that a
    /// finishing fiber may free); every later start succeeds. Bookkeeping
    /// outside loom.
    failing_starts: StdAtomicUsize,
    /// A job put back on the global queue for want of a stack: the active
    /// worker that put it back fences and, with no searcher, wakes one
    /// parked worker (`Worker::start`); `false` is the code before that (only
    /// a retired worker woke one), which model 12 must catch.
    put_back_wake: bool,
}

impl World {
    fn new(workers: usize, total: usize, coverage: &'static Coverage) -> World {
        if tracing() {
            EVENTS.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
        World {
            workers: (0..workers)
                .map(|_| WorkerShared {
                    fresh: Injector::new(),
                    local: Deque::new(),
                    inbox: Inbox {
                        queues: Mutex::new(VecDeque::new()),
                        len: AtomicUsize::new(0),
                        parked: AtomicBool::new(false),
                    },
                })
                .collect(),
            global: Injector::new(),
            searching: AtomicUsize::new(0),
            next_spawn: AtomicUsize::new(0),
            exit: AtomicBool::new(false),
            unparkers: OnceLock::new(),
            done: Mutex::new(0),
            done_cv: Condvar::new(),
            total,
            shutting_down: StdAtomicBool::new(false),
            coverage,
            step_3b: true,
            woken_search: true,
            stack_pressure: AtomicBool::new(false),
            failing_starts: StdAtomicUsize::new(0),
            put_back_wake: true,
        }
    }

    /// Every worker is active in the models (`Shared::active`).
    fn active(&self) -> usize {
        self.workers.len()
    }

    fn unpark(&self, i: usize) {
        self.unparkers.get().expect("unparkers set before the workers run")[i].unpark();
    }

    /// `Inbox::notify` (notifier step 3).
    fn notify(&self, i: usize) -> bool {
        let inbox = &self.workers[i].inbox;
        if inbox.parked.load(Ordering::SeqCst)
            && inbox.parked.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_ok()
        {
            ev(|| format!("notify: unpark worker {i}"));
            self.unpark(i);
            true
        } else {
            false
        }
    }

    /// `Inbox::schedule`: the wake seam of a fiber pinned to worker `i`.
    fn schedule(&self, i: usize, fiber: Body) {
        let inbox = &self.workers[i].inbox;
        let mut queues = inbox.queues.lock().unwrap();
        queues.push_back(fiber);
        inbox.len.fetch_add(1, Ordering::SeqCst);
        drop(queues);
        ev(|| format!("outside: wakes {fiber:?} into worker {i}'s inbox"));
        // `handoffs`: statistics.
        fence(Ordering::SeqCst);
        self.notify(i);
    }

    /// `Shared::push_fresh`: a spawn from outside the pool.
    fn push_fresh(&self, job: Body) {
        let active = self.active().max(1);
        let i = self.next_spawn.fetch_add(1, Ordering::Relaxed) % active;
        let w = &self.workers[i];
        w.fresh.push(job);
        fence(Ordering::SeqCst);
        ev(|| format!("outside: push_fresh {job:?} to worker {i}"));
        if !self.notify(i) && self.searching.load(Ordering::SeqCst) == 0 {
            let woke = self.wake_one_parked();
            if woke {
                Coverage::note(&self.coverage.woke_another);
            }
        }
    }

    /// `WorkerCtx::push_local`: a spawn from a fiber running on worker `me`.
    fn push_local(&self, me: usize, job: Body) {
        self.workers[me].local.push(job);
        fence(Ordering::SeqCst);
        let searching = self.searching.load(Ordering::SeqCst);
        ev(|| format!("worker {me}: push_local {job:?}, sees searching = {searching}"));
        if searching == 0 {
            let woke = self.wake_one_parked();
            if woke {
                Coverage::note(&self.coverage.woke_another);
            }
        }
    }

    /// `Shared::wake_one_parked`.
    fn wake_one_parked(&self) -> bool {
        let n = self.active();
        (0..n.min(self.workers.len())).any(|i| self.notify(i))
    }

    /// `Shared::work_visible` (worker step 2).
    fn work_visible(&self, me: usize) -> bool {
        let w = &self.workers[me];
        if w.inbox.len.load(Ordering::SeqCst) > 0 || w.has_fresh() {
            return true;
        }
        // `w.active`: always true here.
        !self.global.is_empty() || self.workers.iter().enumerate().any(|(i, o)| i != me && o.has_fresh())
    }

    /// `Shared::stealable_work`.
    fn stealable_work(&self) -> bool {
        !self.global.is_empty() || self.workers.iter().any(|w| w.has_fresh())
    }

    /// `Shared::pending_work`.
    fn pending_work(&self) -> bool {
        !self.global.is_empty()
            || self.workers.iter().any(|w| w.has_fresh() || w.inbox.len.load(Ordering::Relaxed) > 0)
    }

    /// `Shared::steal`: one fresh job from another worker.
    fn steal(&self, me: usize, start: usize) -> Option<Body> {
        let n = self.workers.len();
        for k in 0..n {
            let v = (start + k) % n;
            if v == me {
                continue;
            }
            let victim = &self.workers[v];
            let got = (!victim.local.is_empty())
                .then(|| victim.local.steal())
                .flatten()
                .or_else(|| (!victim.fresh.is_empty()).then(|| victim.fresh.steal()).flatten());
            if got.is_some() {
                return got;
            }
        }
        None
    }

    /// `Shared::wake_all`.
    fn wake_all(&self) {
        for (i, w) in self.workers.iter().enumerate() {
            w.inbox.parked.store(false, Ordering::SeqCst);
            self.unpark(i);
        }
    }

    /// A job or fiber returned: the last one stands for the joiner that then
    /// drops the executor (`Executor::drop`, step 3).
    fn complete(&self) {
        let mut done = self.done.lock().unwrap();
        *done += 1;
        let all = *done == self.total;
        drop(done);
        self.done_cv.notify_all();
        if all {
            self.shutting_down.store(true, StdOrdering::Relaxed);
            self.exit.store(true, Ordering::SeqCst);
            self.wake_all();
        }
    }

    /// A fiber staying busy on its worker until `n` jobs have completed.
    fn wait_until_done(&self, n: usize) {
        let mut done = self.done.lock().unwrap();
        while *done < n {
            done = self.done_cv.wait(done).unwrap();
        }
    }
}

/// `worker.rs`: `Next`.
enum Next {
    Resumed(Body),
    Fresh(Body),
}

/// `worker.rs`: `Worker` (the thread-owned half).
struct Worker {
    shared: Arc<World>,
    index: usize,
    resumed: VecDeque<Body>,
    tick: u64,
    rng: u64,
    stack_starved: bool,
    stack_backoff: bool,
}

impl Worker {
    /// `worker.rs`: `run` (the leftovers' `drain` has nothing to do here:
    /// every model ends with all its work run).
    fn run(shared: Arc<World>, index: usize) {
        let mut w = Worker {
            shared,
            index,
            resumed: VecDeque::new(),
            tick: 0,
            rng: 0x9E37_79B9_7F4A_7C15 ^ (index as u64 + 1),
            stack_starved: false,
            stack_backoff: false,
        };
        w.main_loop();
    }

    /// `Worker::main_loop`.
    fn main_loop(&mut self) {
        // Woken from a park on the last round.
        let mut woken = false;
        loop {
            if self.shared.exit.load(Ordering::Acquire) {
                return;
            }
            // Heartbeat: read by sysmon only.
            if std::mem::take(&mut woken) && self.shared.woken_search {
                // Straight into the search, as a searcher.
                woken = self.idle();
            } else {
                match self.next() {
                    Some(n) => self.run_one(n),
                    None => woken = self.idle(),
                }
            }
            // The back-off after a start that failed for want of a stack,
            // with no started fiber of its own to run. Loom has no clock:
            // the timed park (`park_timeout(STACK_BACKOFF)`, the worker not
            // marked parked) is modelled as its timeout passing at once.
            if std::mem::take(&mut self.stack_backoff)
                && self.resumed.is_empty()
                && self.shared.workers[self.index].inbox.len.load(Ordering::Acquire) == 0
            {
                ev(|| format!("worker {}: backs off (timeout passes)", self.index));
            }
        }
    }

    /// `Worker::next`, for one class.
    fn next(&mut self) -> Option<Next> {
        self.tick += 1;
        self.drain_inbox();
        // `stack_pressure`: the fiber cache (not modelled) is dropped.
        if self.stack_starved && self.tick % 2 == 1 {
            // A job waits for a stack: every other round, started fibers
            // first.
            if let Some(t) = self.resumed.pop_front() {
                return Some(Next::Resumed(t));
            }
        }
        // `me.active`: always true here.
        let fresh_first = self.tick % 2 == 0;
        if !fresh_first {
            if let Some(t) = self.resumed.pop_front() {
                return Some(Next::Resumed(t));
            }
        }
        let me = &self.shared.workers[self.index];
        if let Some(j) = me.local.pop() {
            return Some(Next::Fresh(j));
        }
        if !me.fresh.is_empty() {
            if let Some(j) = me.fresh.steal() {
                return Some(Next::Fresh(j));
            }
        }
        if !self.shared.global.is_empty() {
            if let Some(j) = self.shared.global.steal() {
                return Some(Next::Fresh(j));
            }
        }
        if let Some(t) = self.resumed.pop_front() {
            return Some(Next::Resumed(t));
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.shared.steal(self.index, self.rng as usize).map(Next::Fresh)
    }

    /// `Worker::drain_inbox`.
    fn drain_inbox(&mut self) {
        let me = &self.shared.workers[self.index];
        if me.inbox.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut inbox = me.inbox.queues.lock().unwrap();
        let mut moved = 0;
        while let Some(t) = inbox.pop_front() {
            self.resumed.push_back(t);
            moved += 1;
        }
        drop(inbox);
        me.inbox.len.fetch_sub(moved, Ordering::AcqRel);
    }

    /// `Worker::run_one`: runs the job's body on this thread (a job starts
    /// on a fiber; every fiber here returns).
    fn run_one(&mut self, next: Next) {
        let body = match next {
            Next::Resumed(t) => t,
            Next::Fresh(job) => match self.start(job) {
                Some(t) => t,
                None => return,
            },
        };
        ev(|| format!("worker {}: runs {body:?}", self.index));
        let shared = &*self.shared;
        match body {
            Body::Plain => {}
            Body::SpawnChildThenWait => {
                shared.push_local(self.index, Body::Plain);
                shared.wait_until_done(shared.total - 1);
            }
            Body::WaitForOthers => shared.wait_until_done(shared.total - 1),
            Body::SpawnTwoThenWait => {
                shared.push_local(self.index, Body::WaitForOne);
                shared.push_local(self.index, Body::Plain);
                shared.wait_until_done(shared.total - 1);
            }
            Body::WaitForOne => shared.wait_until_done(1),
            Body::WaitFor(n) => shared.wait_until_done(n),
            Body::SpawnThreeThenWait => {
                shared.push_local(self.index, Body::WaitForOne);
                shared.push_local(self.index, Body::WaitForOne);
                shared.push_local(self.index, Body::Plain);
                shared.wait_until_done(shared.total - 1);
            }
        }
        // `Worker::finish`: a fiber's end may free a stack.
        self.stack_starved = false;
        shared.complete();
    }

    /// `Worker::start`: the job starts, or (the first
    /// `World::failing_starts` starts) it cannot get a stack and goes back
    /// on the global queue. No job is cancelled and no shutdown comes
    /// before the last job has run, so no start drops its job; a failure
    /// with no stack mapped anywhere (the job's join failed instead) is not
    /// modelled.
    fn start(&mut self, job: Body) -> Option<Body> {
        let shared = &*self.shared;
        let i = self.index;
        let failed = shared
            .failing_starts
            .fetch_update(StdOrdering::Relaxed, StdOrdering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if failed {
            ev(|| format!("worker {i}: no stack for {job:?}, puts it back"));
            self.stack_starved = true;
            if !shared.stack_pressure.swap(true, Ordering::Relaxed) {
                shared.wake_all();
            }
            // `stack_waits`: statistics.
            shared.global.push(job);
            if shared.put_back_wake {
                fence(Ordering::SeqCst);
                if shared.searching.load(Ordering::SeqCst) == 0 && shared.wake_one_parked() {
                    ev(|| format!("worker {i}: put-back woke a parked worker"));
                    if !shared.shutting_down.load(StdOrdering::Relaxed) {
                        Coverage::note(&shared.coverage.put_back_woke);
                    }
                }
            }
            self.stack_backoff = true;
            return None;
        }
        self.stack_starved = false;
        if shared.stack_pressure.load(Ordering::Relaxed) {
            shared.stack_pressure.store(false, Ordering::Relaxed);
        }
        Some(job)
    }

    /// `Worker::idle` for a base worker: search, then the parking protocol's
    /// worker steps 1-4. Returns whether it parked (and was woken).
    fn idle(&mut self) -> bool {
        let shared = Arc::clone(&self.shared);
        let i = self.index;
        shared.searching.fetch_add(1, Ordering::SeqCst);
        ev(|| format!("worker {i}: searching"));
        for _ in 0..SEARCH_ROUNDS {
            if let Some(n) = self.next() {
                let last = shared.searching.fetch_sub(1, Ordering::SeqCst) == 1;
                ev(|| format!("worker {i}: search found work, last searcher: {last}"));
                if last && shared.pending_work() {
                    ev(|| format!("worker {i}: more pending, wakes one"));
                    shared.wake_one_parked();
                }
                self.run_one(n);
                return false;
            }
        }
        shared.searching.fetch_sub(1, Ordering::SeqCst);
        // The real search's other rounds (`tick` parity, see above).
        self.tick += REAL_SEARCH_ROUNDS - SEARCH_ROUNDS as u64;
        ev(|| format!("worker {i}: search found nothing, stops searching"));

        let me = &shared.workers[self.index];
        store_seq_cst(&me.inbox.parked, true);
        if shared.exit.load(Ordering::SeqCst) || shared.work_visible(self.index) {
            ev(|| format!("worker {i}: re-check finds work"));
            if !shared.shutting_down.load(StdOrdering::Relaxed) {
                Coverage::note(&shared.coverage.recheck_found_work);
            }
            me.inbox.parked.store(false, Ordering::SeqCst);
            // Step 3b.
            if shared.step_3b && !shared.exit.load(Ordering::Acquire) {
                if let Some(n) = self.next() {
                    if shared.searching.load(Ordering::SeqCst) == 0 && shared.stealable_work() {
                        shared.wake_one_parked();
                    }
                    self.run_one(n);
                }
            }
            return false;
        }
        // `parks` counter, trace event: statistics.
        ev(|| format!("worker {i}: parks"));
        thread::park();
        ev(|| format!("worker {i}: unparked"));
        if !shared.shutting_down.load(StdOrdering::Relaxed) {
            Coverage::note(&shared.coverage.woken_by_notifier);
        }
        me.inbox.parked.store(false, Ordering::SeqCst);
        true
    }
}

/// Starts `n` worker threads and hands out their unparkers before any of
/// them runs (loom switches threads only at its own operations).
fn start_workers(world: &Arc<World>) -> Vec<JoinHandle<()>> {
    let handles: Vec<_> = (0..world.workers.len())
        .map(|i| {
            let w = Arc::clone(world);
            thread::spawn(move || Worker::run(w, i))
        })
        .collect();
    let unparkers = handles.iter().map(|h| h.thread().clone()).collect();
    assert!(world.unparkers.set(unparkers).is_ok());
    handles
}

/// Joins the workers and checks that everything ran and nothing is left.
fn finish(world: &World, handles: Vec<JoinHandle<()>>) {
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(*world.done.lock().unwrap(), world.total);
    assert!(world.global.is_empty());
    for w in &world.workers {
        assert!(w.fresh.is_empty() && w.local.is_empty());
        assert_eq!(w.inbox.len.load(Ordering::SeqCst), 0);
        assert!(w.inbox.queues.lock().unwrap().is_empty());
        assert!(!w.inbox.parked.load(Ordering::SeqCst));
    }
    assert_eq!(world.searching.load(Ordering::SeqCst), 0);
}

/// Model 1: one worker going idle against a wake into its inbox from
/// another thread (`Inbox::schedule`, the wake seam of a fiber pinned to
/// it). The worker may see the fiber while searching, at its re-check, or
/// only once unparked.
#[test]
fn inbox_wake_reaches_idle_worker() {
    static COVERAGE: Coverage = Coverage::new();
    model(|| {
        let world = Arc::new(World::new(1, 1, &COVERAGE));
        let handles = start_workers(&world);
        world.schedule(0, Body::Plain);
        finish(&world, handles);
    });
    Coverage::assert(&COVERAGE.woken_by_notifier, "a worker unparked by the inbox wake");
    Coverage::assert(&COVERAGE.recheck_found_work, "the re-check seeing the inbox wake");
}

/// Model 2: two workers going idle against one spawn from outside the pool
/// (`Shared::push_fresh`, to worker 0): someone must run the job.
#[test]
fn spawn_from_outside_reaches_idle_workers() {
    static COVERAGE: Coverage = Coverage::new();
    model(|| {
        let world = Arc::new(World::new(2, 1, &COVERAGE));
        let handles = start_workers(&world);
        world.push_fresh(Body::Plain);
        finish(&world, handles);
    });
    Coverage::assert(&COVERAGE.woken_by_notifier, "a worker unparked by the spawn");
    Coverage::assert(&COVERAGE.recheck_found_work, "a re-check seeing the spawn");
}

/// Model 3: worker 0's queue holds a job that, once running, spawns a child
/// from its fiber (`push_local`) and stays busy until the child has run;
/// meanwhile the other worker goes idle and may park. The child is only on
/// the busy worker's local deque: the idle worker must steal it, so it must
/// not stay parked with the child visible.
#[test]
fn push_local_reaches_parking_worker() {
    static COVERAGE: Coverage = Coverage::new();
    model(|| {
        let world = Arc::new(World::new(2, 2, &COVERAGE));
        world.workers[0].fresh.push(Body::SpawnChildThenWait);
        let handles = start_workers(&world);
        finish(&world, handles);
    });
    Coverage::assert(&COVERAGE.woken_by_notifier, "a worker unparked by push_local");
    Coverage::assert(&COVERAGE.recheck_found_work, "a re-check seeing the child");
}

/// Model 4: worker 0's queue holds a job that stays busy until the rest has
/// run; a spawn from outside then lands on worker 0 (round-robin) while it
/// may be busy: if worker 0 is awake and nobody searches, `push_fresh` must
/// wake the other, possibly parked, worker to steal it.
#[test]
fn spawn_to_busy_worker_reaches_idle_worker() {
    static COVERAGE: Coverage = Coverage::new();
    model(|| {
        let world = Arc::new(World::new(2, 2, &COVERAGE));
        world.workers[0].fresh.push(Body::WaitForOthers);
        let handles = start_workers(&world);
        world.push_fresh(Body::Plain);
        finish(&world, handles);
    });
    Coverage::assert(&COVERAGE.woke_another, "push_fresh waking a worker other than its target");
    Coverage::assert(&COVERAGE.recheck_found_work, "a re-check seeing the spawn");
}

/// The retirement hand-off (`worker.rs`: `Worker::idle`'s choice of park,
/// `Worker::try_retire` and the wake that follows it). Three active
/// workers, worker 0 the only base one: worker 2, the highest, retires
/// (its timed park has run out) while worker 1 goes idle. Worker 1 parks
/// with a timeout only if it sees itself the highest, else until woken;
/// the retirer, after its count change and a fence, wakes worker 1 if it
/// sees it parked. Either worker 1 sees the new count or it is woken:
/// never parked for good while it is the highest (loom reports that as a
/// deadlock). `retirer_fence: false` drops the retirer's fence, which the
/// model must then catch.
fn retirement_hand_off(retirer_fence: bool) {
    model(move || {
        let active = Arc::new(AtomicUsize::new(3));
        let parked = Arc::new(AtomicBool::new(false));
        let idle = {
            let (active, parked) = (Arc::clone(&active), Arc::clone(&parked));
            thread::spawn(move || {
                // `idle`: step 1 (parked, fence), then the look at the count.
                store_seq_cst(&parked, true);
                if active.load(Ordering::SeqCst) == 2 {
                    // The highest: a timed park, whose end it then acts on
                    // (modelled as returning: the countdown ends).
                    parked.swap(false, Ordering::SeqCst);
                    return;
                }
                // Not the highest: park until woken (loom's park keeps an
                // unpark that came first, as crossbeam's does).
                thread::park();
                parked.store(false, Ordering::SeqCst);
                assert_eq!(active.load(Ordering::SeqCst), 2, "woken by the retirement");
            })
        };
        let woken = idle.thread().clone();
        // `try_retire` by worker 2, then the wake of worker 1.
        active.compare_exchange(3, 2, Ordering::AcqRel, Ordering::Relaxed).unwrap();
        if retirer_fence {
            fence(Ordering::SeqCst);
        }
        // `Inbox::notify`.
        if parked.load(Ordering::SeqCst)
            && parked.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_ok()
        {
            woken.unpark();
        }
        idle.join().unwrap();
    });
}

/// Model 5: the retirement hand-off as in the code.
#[test]
fn a_retirement_wakes_the_worker_below_or_it_sees_itself_highest() {
    retirement_hand_off(true);
}

/// Model 5 without the retirer's fence: the worker below can miss the new
/// count while the retirer misses its `parked`, and it parks for good.
#[test]
#[should_panic(expected = "deadlock")]
fn without_the_retirers_fence_the_worker_below_can_park_for_good() {
    retirement_hand_off(false);
}

/// The scale-up hand-off (`sysmon.rs`: `scale_up` and `activate`, against
/// `Worker::idle`'s choice of park). Worker 1, retired (count 1), is
/// reactivated by a scale-up while it goes idle: `activate` sets its flag,
/// fences and wakes it if parked, and `scale_up` then stores the new
/// count (2), fences and wakes it again. The worker parks with a timeout
/// only if it sees itself active and the highest, else until woken. It
/// must not park for good while it is the highest (it would never retire;
/// loom reports that as a deadlock). `wake_after_count: false` is the
/// code before the wake after the count store, which the model must catch.
fn scale_up_hand_off(wake_after_count: bool) {
    model(move || {
        let count = Arc::new(AtomicUsize::new(1));
        let flag = Arc::new(AtomicBool::new(false));
        let parked = Arc::new(AtomicBool::new(false));
        let idle = {
            let (count, flag, parked) = (Arc::clone(&count), Arc::clone(&flag), Arc::clone(&parked));
            thread::spawn(move || {
                // `idle`: step 1 (parked, fence), then the choice of park.
                store_seq_cst(&parked, true);
                if flag.load(Ordering::Relaxed) && count.load(Ordering::SeqCst) == 2 {
                    // The highest: a timed park, whose end it acts on.
                    parked.swap(false, Ordering::SeqCst);
                    return;
                }
                thread::park();
                parked.store(false, Ordering::SeqCst);
            })
        };
        let worker = idle.thread().clone();
        // `Inbox::notify`.
        let notify = || {
            if parked.load(Ordering::SeqCst)
                && parked.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_ok()
            {
                worker.unpark();
            }
        };
        // `activate` of a started worker.
        flag.store(true, Ordering::Release);
        fence(Ordering::SeqCst);
        notify();
        // `scale_up`, after its activations.
        count.store(2, Ordering::Release);
        if wake_after_count {
            fence(Ordering::SeqCst);
            notify();
        }
        idle.join().unwrap();
    });
}

/// Model 6: the scale-up hand-off as in the code.
#[test]
fn a_scale_up_wakes_a_worker_that_parked_before_the_count_or_it_sees_it() {
    scale_up_hand_off(true);
}

/// Model 6 without the wake after the count store: a worker that parked
/// between its activation and the count store parks for good.
#[test]
#[should_panic(expected = "deadlock")]
fn without_the_wake_after_the_count_a_new_highest_can_park_for_good() {
    scale_up_hand_off(false);
}

/// Model 7 (from review): worker 0 runs a job that spawns two children
/// from its fiber and stays busy until every other job has run; the first
/// child blocks its worker until one job has completed, so the second
/// must be run by the third worker. Both spawns can land while a worker
/// still counts as searching (so they wake nobody) and after its search
/// missed them; its re-check then finds them, and it takes the first as a
/// non-searcher. Worker step 3b wakes one more worker there; without it
/// the third worker stays parked for good (loom reports a deadlock).
/// Three workers: one preemption below the others' bound, never below 2
/// (at 3 it takes minutes; the case takes two).
fn last_searcher_hand_off(step_3b: bool) {
    let mut builder = loom::model::Builder::new();
    let bound = builder.preemption_bound.unwrap_or(DEFAULT_PREEMPTIONS);
    builder.preemption_bound = Some(bound.saturating_sub(1).max(2));
    builder.check(move || {
        static COVERAGE: Coverage = Coverage::new();
        let mut world = World::new(3, 3, &COVERAGE);
        world.step_3b = step_3b;
        let world = Arc::new(world);
        world.workers[0].fresh.push(Body::SpawnTwoThenWait);
        let handles = start_workers(&world);
        finish(&world, handles);
    });
}

#[test]
fn a_recheck_that_finds_work_with_no_searcher_left_wakes_one_more() {
    last_searcher_hand_off(true);
}

#[test]
#[should_panic(expected = "deadlock")]
fn without_step_3b_a_spawned_job_can_wait_behind_a_blocked_worker_for_good() {
    last_searcher_hand_off(false);
}

/// a model at bound 2 at most (the bigger models below take
/// minutes at 3).
fn model_capped(f: impl Fn() + Sync + Send + 'static) {
    model_capped_at(2, f)
}

fn model_capped_at(cap: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    let bound = builder.preemption_bound.unwrap_or(DEFAULT_PREEMPTIONS);
    builder.preemption_bound = Some(bound.min(cap));
    // Four workers make long executions.
    builder.max_branches = 20_000;
    builder.check(f);
}

/// Model 8 (from a review): the wake a last searcher hands on is not handed on
/// again. Four workers; worker 0 runs a job that spawns three children from
/// its fiber (`WaitForOne`, `WaitForOne`, `Plain`) and stays busy. Workers
/// 2 and 3 park; worker 1 is searching while the three spawns land, so none
/// wakes anyone. Its search takes the first child as the last searcher with
/// more pending and wakes one parked worker (2), which, woken, takes the
/// second child straight from `next()`, as a non-searcher: nobody wakes
/// worker 3 for the third, and workers 0-2 are all blocked. (Loom finds
/// it first through step 3b: worker 1's re-check finds all three, it wakes
/// worker 2, which takes the second.) Bound 1 (`LOOM_M8_BOUND` to change):
/// the case takes one preemption, and four workers take minutes at 2.
fn woken_worker_hand_off(woken_search: bool) {
    let cap = std::env::var("LOOM_M8_BOUND").ok().and_then(|b| b.parse().ok()).unwrap_or(1);
    model_capped_at(cap, move || {
        static COVERAGE: Coverage = Coverage::new();
        let mut world = World::new(4, 4, &COVERAGE);
        world.woken_search = woken_search;
        let world = Arc::new(world);
        // A started fiber pinned to worker 0 (woken into its inbox before
        // the workers run), so that no other worker takes it.
        world.schedule(0, Body::SpawnThreeThenWait);
        let handles = start_workers(&world);
        finish(&world, handles);
    });
}

#[test]
#[should_panic(expected = "deadlock")]
fn without_the_woken_search_a_last_searchers_wake_is_not_handed_on() {
    woken_worker_hand_off(false);
}

#[test]
fn a_woken_worker_searches_and_hands_the_wake_on() {
    woken_worker_hand_off(true);
}

/// Model 9 (from a review): a spawn from outside wakes its target, parked, and
/// nobody else; a fiber pinned to that worker is woken into its inbox
/// meanwhile, runs first (resumed fibers go first on odd ticks) and blocks
/// the worker until the spawned job has completed. Three workers; worker 0
/// has run one pinned fiber before (so that its tick is odd when it wakes,
/// as in the code: one round with work, one without, 64 search rounds).
/// Worker 1 or 2 must steal the job.
fn woken_target_hand_off(woken_search: bool) {
    model_capped(move || {
        static COVERAGE: Coverage = Coverage::new();
        let mut world = World::new(3, 3, &COVERAGE);
        world.woken_search = woken_search;
        let world = Arc::new(world);
        world.schedule(0, Body::Plain);
        let handles = start_workers(&world);
        world.push_fresh(Body::Plain);
        world.schedule(0, Body::WaitFor(2));
        finish(&world, handles);
    });
}

#[test]
#[should_panic(expected = "deadlock")]
fn without_the_woken_search_an_inbox_fiber_can_strand_a_spawn_on_its_blocked_target() {
    woken_target_hand_off(false);
}

#[test]
fn a_spawn_that_woke_its_target_reaches_another_worker_when_an_inbox_fiber_blocks_it() {
    woken_target_hand_off(true);
}

/// Model 10 (from a review): spawns from outside against searchers' decrements
/// and re-checks, with a blocked worker. Worker 0 runs a pinned fiber that
/// stays busy until the rest has run; two spawns from outside land on
/// worker 0 (`WaitForOne`, which then blocks whoever takes it) and worker 1
/// (round-robin). Workers 1 and 2 must run both.
#[test]
fn spawns_from_outside_with_a_blocked_target_reach_the_free_workers() {
    static COVERAGE: Coverage = Coverage::new();
    model_capped(|| {
        let world = Arc::new(World::new(3, 3, &COVERAGE));
        world.schedule(0, Body::WaitForOthers);
        let handles = start_workers(&world);
        world.push_fresh(Body::WaitForOne);
        world.push_fresh(Body::Plain);
        finish(&world, handles);
    });
}

/// Model 11 (from a review): two searchers end their search at once with two
/// jobs pushed. Worker 0 runs a pinned fiber that spawns `WaitForOne` and
/// `Plain` (`push_local`) and stays busy; workers 1 and 2 are both free to
/// search, and the first child blocks whoever takes it. (Model 7 with the
/// spawner pinned, so both other workers search from the start.)
#[test]
fn two_searchers_two_spawns_one_blocking() {
    static COVERAGE: Coverage = Coverage::new();
    model_capped(|| {
        let world = Arc::new(World::new(3, 3, &COVERAGE));
        world.schedule(0, Body::SpawnTwoThenWait);
        let handles = start_workers(&world);
        finish(&world, handles);
    });
}

/// Model 12 (from review): a job put back on the global queue for want of
/// a stack (`Worker::start`). Two workers. Worker 0 has run one pinned fiber
/// before (so that its next round, the one that takes the job, has an even
/// tick: fresh jobs first); its queue holds a job whose first start finds
/// no stack; a fiber pinned to it is woken into its inbox from outside and
/// blocks it until the job has run. Worker 0 takes the job, cannot start
/// it, puts it back on the global queue and, `stack_starved`, takes the
/// fiber first on its next (odd) round: only worker 1 can run the job now.
/// If worker 1 parked in between (also after the wake of every worker
/// with which the first failure starts the stack pressure), the put-back
/// must wake it: without that wake (`put_back_wake: false`, the code before
/// it for an active worker) loom reports a deadlock.
fn put_back_hand_off(put_back_wake: bool) {
    static COVERAGE: Coverage = Coverage::new();
    model(move || {
        let mut world = World::new(2, 3, &COVERAGE);
        world.put_back_wake = put_back_wake;
        world.failing_starts = StdAtomicUsize::new(1);
        // An earlier failure set the pressure (no start since), so this one
        // wakes nobody with `wake_all`: that wake only adds wakes, and
        // loom's unpark would release a worker blocked on a loom mutex
        // (the inbox's), which its mutex then rejects.
        world.stack_pressure = AtomicBool::new(true);
        let world = Arc::new(world);
        world.schedule(0, Body::Plain);
        world.workers[0].fresh.push(Body::Plain);
        let handles = start_workers(&world);
        world.schedule(0, Body::WaitFor(2));
        finish(&world, handles);
        assert_eq!(world.failing_starts.load(StdOrdering::Relaxed), 0, "the job's first start failed");
    });
    Coverage::assert(&COVERAGE.put_back_woke, "a put-back job waking a parked worker");
}

#[test]
fn a_job_put_back_for_want_of_a_stack_wakes_a_parked_worker() {
    put_back_hand_off(true);
}

#[test]
#[should_panic(expected = "deadlock")]
fn without_the_put_back_wake_a_job_can_wait_behind_its_blocked_worker_for_good() {
    put_back_hand_off(false);
}

/// Litmus models behind the notifier's `compare_exchange` (`Inbox::notify`):
/// loom 0.7 does not keep a read-modify-write's write next to the store it
/// read in the modification order (tokio-rs/loom#254). A `swap(false)` that
/// reads `false` still writes; loom leaves that write unordered against a
/// later `true` stored by a thread that never saw it, and a thread that has
/// seen both may then read the swap's `false` as the newest value. With
/// SeqCst fences on both sides, that reads as store buffering, which the
/// memory model forbids. Model 8 at bound 2 failed on exactly this with
/// `swap` in `notify` (see docs/loom.md). The `should_panic` ones fail the
/// day loom orders such writes (loom#391): then `notify` may go back to
/// `swap`.
mod litmus {
    use super::*;

    /// Worker: `parked = true`, SeqCst fence, reads the deque's back index.
    /// Notifier: its `notify` of the worker first (`take`), then a push
    /// (Release fence, Relaxed store, as crossbeam's), a SeqCst fence and a
    /// read of `parked`. Forbidden: the notifier took nothing, the worker
    /// missed the push and the notifier sees `parked == false`.
    fn store_buffering_after_a_notify(take: fn(&AtomicBool) -> bool) {
        model(move || {
            let parked = Arc::new(AtomicBool::new(false));
            let back = Arc::new(AtomicUsize::new(0));
            let (p, b) = (Arc::clone(&parked), Arc::clone(&back));
            let worker = thread::spawn(move || {
                store_seq_cst(&p, true);
                b.load(Ordering::Acquire)
            });
            let took = take(&parked);
            fence(Ordering::Release);
            back.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            let seen_parked = parked.load(Ordering::SeqCst);
            let seen_push = worker.join().unwrap() == 1;
            assert!(took || seen_push || seen_parked, "store buffering across SeqCst fences");
        });
    }

    /// A `swap` that reads the initial `false` writes `false`, which must
    /// come before the worker's `true` (it follows the store it read); loom
    /// lets the notifier read it after seeing the worker's store.
    #[test]
    #[should_panic(expected = "store buffering across SeqCst fences")]
    fn loom_lets_a_swap_that_read_false_hide_a_later_store() {
        store_buffering_after_a_notify(|p| p.swap(false, Ordering::SeqCst));
    }

    /// The same with a `compare_exchange(true, false)`: a failed one writes
    /// nothing, and loom finds no such history.
    #[test]
    fn a_failed_compare_exchange_writes_nothing() {
        store_buffering_after_a_notify(|p| {
            p.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_ok()
        });
    }

    /// Model 8's failing execution at bound 2, reduced: worker 2 parks
    /// (`parked = true`, fence); worker 1's `notify` takes the flag and
    /// unparks it; worker 0's `notify` of worker 2 (a spawn, `push_local`)
    /// reads the stale `true`, then swaps worker 1's `false` (and writes
    /// `false`); worker 2, woken, stores `false`, searches, stores `true`,
    /// fences and re-checks worker 0's deque before the next push; worker 0
    /// pushes, fences and reads `parked`. Loom lets worker 0 read its own
    /// swap's `false`, ordered after worker 2's `true`, and the spawn wakes
    /// nobody. Forbidden: the swap follows worker 1's `false`, which
    /// happens before worker 2's stores.
    fn model_8_reduced(take: fn(&AtomicBool) -> bool) {
        model(move || {
            let parked = Arc::new(AtomicBool::new(false));
            let back = Arc::new(AtomicUsize::new(0));
            let woken = Arc::new(AtomicBool::new(false));
            let (p, b) = (Arc::clone(&parked), Arc::clone(&back));
            let worker2 = thread::spawn(move || {
                store_seq_cst(&p, true);
                thread::park();
                p.store(false, Ordering::SeqCst);
                store_seq_cst(&p, true);
                b.load(Ordering::Acquire)
            });
            let (p, w, t) = (Arc::clone(&parked), Arc::clone(&woken), worker2.thread().clone());
            let worker1 = thread::spawn(move || loop {
                if p.load(Ordering::SeqCst) && take(&p) {
                    t.unpark();
                    w.store(true, Ordering::SeqCst);
                    return;
                }
                if w.load(Ordering::SeqCst) {
                    return;
                }
                thread::yield_now();
            });
            // Worker 0.
            let took = parked.load(Ordering::SeqCst) && take(&parked);
            if took {
                worker2.thread().unpark();
                woken.store(true, Ordering::SeqCst);
            }
            fence(Ordering::Release);
            back.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            let seen_parked = parked.load(Ordering::SeqCst);
            worker1.join().unwrap();
            let seen_push = worker2.join().unwrap() == 1;
            assert!(took || seen_push || seen_parked, "store buffering across SeqCst fences");
        });
    }

    #[test]
    #[should_panic(expected = "store buffering across SeqCst fences")]
    fn loom_lets_model_8_lose_the_wake_with_swap() {
        model_8_reduced(|p| p.swap(false, Ordering::SeqCst));
    }

    #[test]
    fn model_8_reduced_with_compare_exchange() {
        model_8_reduced(|p| p.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_ok());
    }
}
