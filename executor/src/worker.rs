//! The worker loop.
//!
//! Each round: take the next fiber, strictly by priority class (high, then
//! normal, then low), and within a class alternate between fibers that
//! already ran (yielded, or woken into the inbox) and fresh jobs (own local
//! deque, own injector, the global queue, then stealing from other
//! workers), so that neither starves the other. Nothing to do: search
//! (spin) briefly, then park (the protocol is in `shared.rs`).

use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_deque::Worker as Deque;
use crossbeam_utils::sync::Parker;
use spindle_fiber::{Fiber, FiberAttr, FiberError, RunOutcome, StackError};

use crate::shared::{class_of, retry, steal_one, Job, Shared, Task, WorkerCounters, WorkerShared, CLASSES};
use crate::task::{Cancelled, JoinError, PanicPayload, TaskRef};

/// Rounds of polling before a worker parks (each round scans every queue).
const SEARCH_ROUNDS: u32 = 64;
/// Finished, unnamed fibers a worker keeps to start the next jobs on.
const FIBER_CACHE: usize = 64;

thread_local! {
    /// The worker running on this thread (null elsewhere).
    static CURRENT: Cell<*const WorkerCtx> = const { Cell::new(std::ptr::null()) };
    /// Set once this thread's worker loop and final drain are over (the
    /// executor shut down): a fiber unwound here later (a thread-local
    /// destructor woke it) must not sleep the thread, which the drop joins.
    static LOOP_OVER: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is a worker thread whose loop is over.
pub(crate) fn worker_loop_over() -> bool {
    LOOP_OVER.with(Cell::get)
}

/// What a fiber can reach of its worker: lives as long as the worker
/// thread's loop, on that thread only.
pub(crate) struct WorkerCtx {
    pub(crate) shared: Arc<Shared>,
    pub(crate) index: usize,
    /// Local FIFO deques of fresh jobs, one per class; others steal through
    /// `WorkerShared::stealers`. `crossbeam_deque::Worker` is used through
    /// `&self` on its own thread only: by the loop, and by fibers of this
    /// worker spawning (the loop is suspended in `run_mut` meanwhile).
    pub(crate) locals: [Deque<Job>; CLASSES],
}

impl WorkerCtx {
    pub(crate) fn me(&self) -> &WorkerShared {
        &self.shared.workers[self.index]
    }

    /// Spawn from a fiber of this worker: onto the local deque, then make
    /// sure someone will look if we stay busy (notifier steps).
    pub(crate) fn push_local(&self, job: Job) {
        let class = class_of(job.priority);
        self.locals[class].push(job);
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.shared.searching.load(Ordering::SeqCst) == 0 {
            self.shared.wake_one_parked();
        }
    }
}

/// The worker of the calling thread. Not inlined and never held across a
/// suspension, so a fiber always reads its current thread's slot (see
/// spindle-fiber's notes on llvm/llvm-project#98479).
#[inline(never)]
pub(crate) fn current_worker() -> Option<&'static WorkerCtx> {
    // SAFETY: the pointer is set for the lifetime of the worker thread's
    // loop, and the context outlives every fiber run on it.
    CURRENT.with(|c| unsafe { c.get().as_ref() })
}

struct Worker {
    ctx: Box<WorkerCtx>,
    /// Started fibers that are runnable, by class (owned by this thread).
    resumed: [VecDeque<Task>; CLASSES],
    cache: Vec<Task>,
    tick: u64,
    rng: u64,
    /// Per class: local pops until the jobs last batched into the local
    /// deque from the injector or the global queue have left it (it is
    /// FIFO: they are gone after that many pops, or sooner if stolen).
    /// Taking an outside job before those would break FIFO order.
    outside_in_local: [usize; CLASSES],
    /// A job could not start for want of a stack: run started fibers (which
    /// may free one) before fresh jobs, whatever their priority, until a
    /// job starts or a fiber finishes.
    stack_starved: bool,
    /// Set by a start that failed for want of a stack; see `main_loop`.
    stack_backoff: bool,
    /// Since when this worker has found nothing to run (None while it
    /// finds work): an extra worker retires once this is `idle_retire` old.
    idle_since: Option<std::time::Instant>,
}

/// How long a worker whose job could not get a stack, and that has nothing
/// else to run, waits before trying again.
const STACK_BACKOFF: std::time::Duration = std::time::Duration::from_millis(1);

pub(crate) fn run(shared: Arc<Shared>, index: usize) {
    let parker = shared.workers[index].parker.lock().take().expect("a worker starts once");
    let locals = shared.workers[index].locals.lock().take().expect("a worker starts once");
    let mut w = Worker {
        ctx: Box::new(WorkerCtx { shared, index, locals }),
        resumed: Default::default(),
        cache: Vec::with_capacity(FIBER_CACHE),
        tick: 0,
        rng: 0x9E37_79B9_7F4A_7C15 ^ (index as u64 + 1),
        outside_in_local: [0; CLASSES],
        stack_starved: false,
        stack_backoff: false,
        idle_since: None,
    };
    CURRENT.with(|c| c.set(&*w.ctx));
    // Declared after `w`, so dropped before it, on an unwind too: no
    // later thread-local destructor on this thread can reach a freed
    // context through `Handle::current` or `spawn`.
    struct ClearCurrent;
    impl Drop for ClearCurrent {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(std::ptr::null()));
            LOOP_OVER.with(|l| l.set(true));
        }
    }
    let _clear = ClearCurrent;
    // A worker thread that unwinds (a bug: user code's panics are caught)
    // must not keep the others in their final drain: its inbox closes
    // and counts as idle.
    struct IdleIfUnwound(Arc<Shared>, usize);
    impl Drop for IdleIfUnwound {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                return;
            }
            let shared = &self.0;
            let last = {
                let mut inbox = shared.workers[self.1].inbox.queues.lock();
                inbox.closed = true;
                if inbox.drain_idle {
                    return;
                }
                mark_drain_idle(shared, &mut inbox)
            };
            if last {
                close_all_if_idle(shared);
            }
        }
    }
    let _idle_if_unwound = IdleIfUnwound(Arc::clone(&w.ctx.shared), index);
    w.main_loop(&parker);
    w.drain(&parker);
}

enum Next {
    Resumed(Task),
    Fresh(Job),
}

impl Worker {
    fn shared(&self) -> &Shared {
        &self.ctx.shared
    }

    fn me(&self) -> &WorkerShared {
        self.ctx.me()
    }

    fn main_loop(&mut self, parker: &Parker) {
        // Woken from a park last round: this round searches (counted in
        // `searching`) rather than taking work straight from `next()`, so
        // that finding it as the last searcher with more pending wakes one
        // more (`idle`). A woken worker that took its job as a non-searcher
        // ended the chain of wakes: work pushed while a worker searched
        // (which woke nobody) got one wake from the last searcher (or step
        // 3b) however much of it there was, and a spawn that woke its
        // parked target woke nobody else even if a fiber woken into that
        // worker's inbox then ran first and blocked it (found by loom
        // models 8 and 9 in review).
        let mut woken = false;
        loop {
            if self.shared().exit.load(Ordering::Acquire) {
                return;
            }
            // Heartbeat: one relaxed store per scheduling round on a line of
            // its own, read by sysmon to spot a worker stuck in one fiber.
            let hot = &self.me().hot;
            hot.heartbeat.store(hot.heartbeat.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            if std::mem::take(&mut woken) {
                woken = self.idle(parker);
            } else {
                match self.next() {
                    Some(n) => {
                        self.idle_since = None;
                        self.run_one(n)
                    }
                    None => woken = self.idle(parker),
                }
            }
            // A job could not start for want of a stack, and this worker has
            // no started fiber of its own to run meanwhile (none resumed,
            // none woken into its inbox): back off before trying again,
            // instead of spinning on the failing mapping. Only `wake_all`
            // ends the wait early (the worker is not marked parked, so a
            // fiber woken into its inbox meanwhile waits for the rest of it).
            if std::mem::take(&mut self.stack_backoff)
                && self.resumed.iter().all(VecDeque::is_empty)
                && self.me().inbox.len.load(Ordering::Acquire) == 0
            {
                parker.park_timeout(STACK_BACKOFF);
            }
        }
    }

    fn next(&mut self) -> Option<Next> {
        self.tick += 1;
        self.drain_inbox();
        if self.shared().stack_pressure.load(Ordering::Relaxed) {
            self.cache.clear();
        }
        if self.stack_starved && self.tick % 2 == 1 {
            // A job waits for a stack: every other round, started fibers
            // first, of any priority (a higher job that cannot start must
            // not keep the fibers that hold the stacks from running); the
            // other rounds try the job again (a stack may be freed
            // anywhere, not only by this worker's fibers).
            for class in 0..CLASSES {
                if let Some(t) = self.resumed[class].pop_front() {
                    return Some(Next::Resumed(t));
                }
            }
        }
        let active = self.me().active.load(Ordering::Relaxed);
        let fresh_first = self.tick % 2 == 0;
        // Now and then, jobs from outside before this worker's own spawns
        // (as Go's scheduler looks at its global queue every 61st tick):
        // a fiber that keeps its local deque full would starve the
        // injector and the global queue for as long as it kept spawning.
        // One job, not a batch: a batch would land behind the local ones.
        // Not while outside jobs batched earlier are still in the local
        // deque: they are older, and go first.
        let outside_tick = self.tick % OUTSIDE_EVERY == 0;
        // On the same rounds, other workers' queues before this worker's
        // yielded fibers: a worker kept busy by a fiber that yields over and
        // over would otherwise never steal, and a job queued behind a worker
        // whose fiber blocks its thread would wait out the block (found in
        // review: two seconds, with no worker to spare).
        let steal_first = outside_tick && active;
        for class in 0..CLASSES {
            let outside_first = outside_tick && self.outside_in_local[class] == 0;
            if !fresh_first && !steal_first {
                if let Some(t) = self.resumed[class].pop_front() {
                    return Some(Next::Resumed(t));
                }
            }
            let ctx = &*self.ctx;
            if outside_first {
                let own = &ctx.me().fresh[class];
                let global = &ctx.shared.global[class];
                let from_own = || (!own.is_empty()).then(|| retry(|| own.steal())).flatten();
                let from_global =
                    || (active && !global.is_empty()).then(|| retry(|| global.steal())).flatten();
                // By turns, so that neither starves the other either.
                let taken = match (self.tick / OUTSIDE_EVERY) % 2 {
                    0 => from_own().or_else(from_global),
                    _ => from_global().or_else(from_own),
                };
                if let Some(j) = taken {
                    return Some(Next::Fresh(j));
                }
            }
            let local = &ctx.locals[class];
            if let Some(j) = local.pop() {
                self.outside_in_local[class] = self.outside_in_local[class].saturating_sub(1);
                return Some(Next::Fresh(j));
            }
            let own = &ctx.me().fresh[class];
            if !own.is_empty() {
                if let Some(j) = retry(|| own.steal_batch_and_pop(local)) {
                    self.outside_in_local[class] = local.len();
                    return Some(Next::Fresh(j));
                }
            }
            let global = &ctx.shared.global[class];
            if active && !global.is_empty() {
                if let Some(j) = retry(|| global.steal_batch_and_pop(local)) {
                    self.outside_in_local[class] = local.len();
                    return Some(Next::Fresh(j));
                }
            }
            if steal_first {
                if let Some(j) = self.steal_from_others(class) {
                    return Some(Next::Fresh(j));
                }
            }
            if let Some(t) = self.resumed[class].pop_front() {
                return Some(Next::Resumed(t));
            }
            if active && !steal_first {
                if let Some(j) = self.steal_from_others(class) {
                    return Some(Next::Fresh(j));
                }
            }
        }
        None
    }

    /// A job of `class` stolen from another worker, starting at a random one.
    fn steal_from_others(&mut self, class: usize) -> Option<Job> {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let ctx = &*self.ctx;
        ctx.shared.steal(ctx.index, class, self.rng as usize, &ctx.locals[class])
    }

    /// Moves woken fibers from the inbox into `resumed`.
    fn drain_inbox(&mut self) {
        let me = self.ctx.me();
        if me.inbox.len.load(Ordering::Acquire) == 0 {
            return;
        }
        // Lock order: inbox, then sleeping (nowhere the other way round).
        let mut inbox = me.inbox.queues.lock();
        let mut sleeping = me.sleeping.lock();
        let mut moved = 0;
        for class in 0..CLASSES {
            while let Some(mut t) = inbox.q[class].pop_front() {
                // The sleeping list's handle goes first: then this one is
                // usually the only one, and the transition a plain store.
                sleeping.remove(&t.id());
                t.mark_dequeued_mut().expect("a fiber in an inbox is Queued");
                self.resumed[class].push_back(t);
                moved += 1;
            }
        }
        drop(sleeping);
        drop(inbox);
        me.inbox.len.fetch_sub(moved, Ordering::AcqRel);
    }

    // Inlined: no call frame of ours stays live across the switch (DESIGN.md).
    #[inline]
    fn run_one(&mut self, next: Next) {
        let mut fiber = match next {
            Next::Resumed(t) => t,
            Next::Fresh(job) => match self.start(job) {
                Some(f) => f,
                None => return,
            },
        };
        // A cancelled fiber is resumed like any other: it unwinds itself at
        // its executor suspension point (ops.rs), on its own stack, after
        // whatever woke it (a token, a message) has been handed over.
        let me = self.ctx.me();
        if me.hot.preempt.load(Ordering::Relaxed) {
            me.hot.preempt.store(false, Ordering::Relaxed);
        }
        me.hot.running_fiber.store(fiber.id().as_u64(), Ordering::Relaxed);
        me.hot.running_task.store(fiber.sched_data(), Ordering::Relaxed);
        let panicking_at_resume = std::thread::panicking();
        me.hot.panicking_at_resume.store(panicking_at_resume, Ordering::Relaxed);
        // The sched word holds a counted reference to the task until
        // `take_task`, which runs after this (in `finish`, `drain` or
        // `cancel_orphan`), never during the run.
        let task = |raw: usize| {
            // SAFETY: as above, for both uses below.
            unsafe { TaskRef::borrow_raw(raw) }
        };
        let raw = fiber.sched_data();
        if !panicking_at_resume && raw != 0 && task(raw).unwinding.load(Ordering::Relaxed) {
            // A fiber stuck in the middle of an unwind keeps the thread
            // panicking; this one is not unwinding (it caught the panic).
            task(raw).unwinding.store(false, Ordering::Relaxed);
        }
        let outcome = fiber.run_mut();
        if std::thread::panicking() && !panicking_at_resume && raw != 0 {
            // The fiber switched out in the middle of its own unwind (a
            // destructor that waits): from now on the thread's panic count
            // is raised on its account too, and its cancellation points
            // must know it is unwinding (`ops::check_cancel`).
            task(raw).unwinding.store(true, Ordering::Relaxed);
        }
        me.hot.running_fiber.store(0, Ordering::Relaxed);
        me.hot.running_task.store(0, Ordering::Relaxed);
        match outcome {
            Ok(RunOutcome::Yielded(_)) => self.resumed[class_of(fiber.priority())].push_back(fiber),
            Ok(RunOutcome::Slept) => {
                let id = fiber.id();
                self.me().sleeping.lock().insert(id, fiber);
                // A cancel that came while the fiber ran missed it in the
                // map: interrupt it here (`Shared::interrupt_sleeping`
                // covers the other order; SeqCst on both flags' sides).
                // So is a shutdown that began while it ran. Only a new mark
                // wakes it (see `interrupt_sleeping`). And so is a fiber
                // inside an `interrupt_after` whose deadline fired
                // (deadlines are sticky for their call).
                if raw != 0
                    && (task(raw).cancelled.load(Ordering::SeqCst)
                        || self.shared().shutdown.load(Ordering::SeqCst)
                        || task(raw).fired_deadlines.load(Ordering::Relaxed) > 0)
                {
                    self.shared().interrupt_sleeping(id, raw, false);
                }
            }
            Ok(RunOutcome::Returned(())) => self.finish(fiber, None),
            Ok(RunOutcome::Panicked(p)) => {
                let err = if p.payload.is::<Cancelled>() {
                    JoinError::Cancelled { fiber: Some(p.fiber), name: p.name }
                } else {
                    JoinError::Panicked {
                        fiber: p.fiber,
                        name: p.name,
                        payload: PanicPayload::new(p.payload),
                    }
                };
                self.finish(fiber, Some(err));
            }
            Err(e) => panic!("spindle-executor: internal error, a queued fiber could not run: {e}"),
        }
    }

    /// Starts a job on a cached or new fiber.
    fn start(&mut self, job: Job) -> Option<Task> {
        if job.task.cancelled.load(Ordering::Acquire) || self.shared().shutdown.load(Ordering::Acquire) {
            self.drop_job(job);
            return None;
        }
        let fiber = match (job.task.name.is_none(), self.cache.pop()) {
            (true, Some(f)) => f,
            (_, cached) => {
                if let Some(f) = cached {
                    self.cache.push(f);
                }
                let mut attr = FiberAttr::new().stack_size(self.shared().config.stack_size);
                if let Some(n) = &job.task.name {
                    attr = attr.name(n.clone());
                }
                // Out of stacks: this worker's idle cached fibers may hold
                // some. And a failure seen with no fiber stack mapped
                // anywhere is tried once more: a stack freed while the
                // mapping failed could have made room.
                let no_stack_mapped = |e: &FiberError| {
                    matches!(e, FiberError::Stack(StackError::OutOfMemory { mapped: 0, .. }))
                };
                let created = Fiber::new(attr.clone()).or_else(|e| {
                    if !self.cache.is_empty() || no_stack_mapped(&e) {
                        self.cache.clear();
                        Fiber::new(attr)
                    } else {
                        Err(e)
                    }
                });
                match created {
                    Ok(f) => f,
                    Err(FiberError::Stack(error)) if !matches!(error, StackError::OutOfMemory { mapped, .. } if mapped > 0) =>
                    {
                        // No fiber stack is mapped in the process that a
                        // finishing fiber could free, twice (or the mapping
                        // was refused for another reason than memory):
                        // waiting for fibers to finish cannot help. Fail
                        // its join rather than wait.
                        let name = job.task.name.clone();
                        self.fail_job(job, JoinError::NoStack { name, error });
                        return None;
                    }
                    Err(e) => {
                        // Out of stacks (mappings or memory): put the job
                        // back and let running fibers finish first; every
                        // worker drops its idle fibers meanwhile. Said once
                        // per process: it can recur for every job.
                        self.stack_starved = true;
                        if !self.shared().stack_pressure.swap(true, Ordering::Relaxed) {
                            self.shared().wake_all();
                        }
                        static WARNED: std::sync::Once = std::sync::Once::new();
                        WARNED.call_once(|| {
                            warn!(
                                "spindle-executor: cannot start more fibers for now ({e}); \
                                 jobs wait until running fibers finish"
                            )
                        });
                        self.shared().stats.stack_waits.fetch_add(1, Ordering::Relaxed);
                        self.shared().global[class_of(job.priority)].push(job);
                        // With no searcher left, wake one parked worker, as
                        // a spawn does. A retired worker never looks at the
                        // global queue. An active one comes back to the job
                        // after its back-off, but only if it gets back to
                        // its loop: a resumed fiber that then blocks its
                        // thread would leave the job to parked workers that
                        // nobody woke (found in review, the same class as
                        // loom models 7-9; loom model 12).
                        std::sync::atomic::fence(Ordering::SeqCst);
                        if self.shared().searching.load(Ordering::SeqCst) == 0 {
                            self.shared().wake_one_parked();
                        }
                        self.stack_backoff = true;
                        return None;
                    }
                }
            }
        };
        self.stack_starved = false;
        // Whichever worker starts a job ends the pressure.
        if self.shared().stack_pressure.load(Ordering::Relaxed) {
            self.shared().stack_pressure.store(false, Ordering::Relaxed);
        }
        let Job { task, priority } = job;
        // SeqCst: see `JoinHandle::cancel`.
        task.started_fiber.store(fiber.id().as_u64(), Ordering::SeqCst);
        // The function's own counted reference, on the fiber's stack until
        // it returns or is unwound. Scope soundness rests on it: a scoped
        // task cannot finish (and release its scope) while its closure's
        // borrows are still live on this stack, even when shutdown
        // completes the task early (see `Scope::spawn_with`).
        let runner = task.clone();
        // SAFETY: this worker took the job; it runs the closure once.
        let body = move || unsafe { runner.run_job() };
        fiber.set_function(priority, body).expect("a cached or new fiber takes a function");
        fiber.set_home(Some(&self.me().home)).expect("a fiber with a new function is Ready");
        fiber.set_sched_data(task.into_raw());
        Some(fiber)
    }

    /// A job cancelled (or shut down) before it started: drop its closure
    /// here and fail its join.
    fn drop_job(&self, job: Job) {
        let name = job.task.name.clone();
        self.fail_job(job, JoinError::Cancelled { fiber: None, name });
    }

    /// A job that will never start: drop its closure here and fail its
    /// join with `err`.
    fn fail_job(&self, job: Job, err: JoinError) {
        let _busy = BusyOutsideFiber::new(self.me());
        // SAFETY: we hold the job; its closure is dropped, never run.
        unsafe { job.task.drop_job() };
        self.complete(job.task, Some(err));
    }

    fn finish(&mut self, fiber: Task, err: Option<JoinError>) {
        let task = take_task(&fiber);
        // Only unnamed fibers this worker created (at the configured stack
        // size) are cached; named ones keep their name for their task only.
        // A fiber's end may free a stack a waiting job needs.
        self.stack_starved = false;
        if fiber.name().is_none()
            && self.cache.len() < FIBER_CACHE
            && !self.shared().stack_pressure.load(Ordering::Relaxed)
        {
            self.cache.push(fiber);
        } else {
            drop(fiber);
        }
        self.complete(task, err);
    }

    fn complete(&self, task: TaskRef, err: Option<JoinError>) {
        // Dropping the task may drop what it still holds (an unjoined
        // panic's payload), whose `Drop` is user code that may block (even
        // join another task).
        let _busy = BusyOutsideFiber::new(self.me());
        // A task the final drain completed early (its fiber went on to
        // finish its unwind; see `drain`) is complete already. The outcome
        // is dropped here, inside `_busy` and contained, as the task's own
        // drop contains what it holds: a panic payload whose drop panics
        // must not take the worker down (found in review).
        if task.finished.load(Ordering::Acquire) {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(move || drop((err, task)))) {
                if let Some(forced) = crate::task::drop_payload(payload) {
                    std::panic::resume_unwind(forced);
                }
            }
            return;
        }
        let c = &self.me().hot.counters;
        if matches!(err, Some(JoinError::Cancelled { .. })) {
            WorkerCounters::bump(&c.cancelled);
        }
        // Counted before the joiner is woken, so that a joiner reading the
        // stats sees its task counted.
        c.completed.store(c.completed.load(Ordering::Relaxed) + 1, Ordering::Release);
        task.complete(err);
        // Inside `_busy` (a parameter would be dropped after it).
        drop(task);
    }

    /// Searches, then parks if nothing turns up; returns whether it parked
    /// and is back (woken, or a retiring worker's countdown over without a
    /// retirement): the next round then searches (`main_loop`).
    fn idle(&mut self, parker: &Parker) -> bool {
        let shared = Arc::clone(&self.ctx.shared);
        // Only an active worker counts as searching: a retired one looks at
        // its own queues only, so a spawner that saw it searching and woke
        // no one would leave its job to a busy worker.
        let searching = self.me().active.load(Ordering::Relaxed);
        if searching {
            shared.searching.fetch_add(1, Ordering::SeqCst);
        }
        for _ in 0..SEARCH_ROUNDS {
            if let Some(n) = self.next() {
                if searching && shared.searching.fetch_sub(1, Ordering::SeqCst) == 1 && shared.pending_work()
                {
                    // The last searcher found work and more is pending: get
                    // another worker looking.
                    shared.wake_one_parked();
                }
                self.idle_since = None;
                self.run_one(n);
                return false;
            }
            std::hint::spin_loop();
        }
        if searching {
            shared.searching.fetch_sub(1, Ordering::SeqCst);
        }

        let since = *self.idle_since.get_or_insert_with(std::time::Instant::now);
        let me = self.me();
        // Parking protocol, worker steps 1-4 (shared.rs).
        me.inbox.parked.store(true, Ordering::SeqCst);
        // Orders the store before every load of the re-check, whatever
        // their own orderings (the notifier has the matching fence).
        std::sync::atomic::fence(Ordering::SeqCst);
        if shared.exit.load(Ordering::SeqCst) || shared.work_visible(self.ctx.index) {
            me.inbox.parked.store(false, Ordering::SeqCst);
            // Worker step 3b: jobs seen here may have been spawned while
            // this worker still counted as searching, so their notifiers
            // woke nobody and left them to the searchers. Take one now and,
            // with no searcher left and jobs still queued, wake one more,
            // as the last searcher to find work does; else a second job
            // could wait behind a busy (or blocked) worker while another
            // stays parked (found by a loom model in review: model 7).
            // Stealable work only: a woken fiber's inbox push wakes its
            // owner itself, searchers or not. A worker still searching
            // takes the baton otherwise.
            if searching && !shared.exit.load(Ordering::Acquire) {
                if let Some(n) = self.next() {
                    if shared.searching.load(Ordering::SeqCst) == 0 && shared.stealable_work() {
                        shared.wake_one_parked();
                    }
                    self.idle_since = None;
                    self.run_one(n);
                }
            }
            return false;
        }
        let i = self.ctx.index;
        let counted_park = || {
            WorkerCounters::bump(&me.hot.counters.parks);
            crate::trace_event!(worker = i, "park");
        };
        // Extra workers retire from the top (LIFO), once idle for
        // `idle_retire`: only the highest active one waits with a timeout.
        // The others park until woken, by work or by the retirement of the
        // one above them (which makes them the highest), instead of waking
        // every `idle_retire` to search and fail to retire (read after
        // `parked` and the fence above: see `try_retire`). Not while
        // shutting down: nothing retires then, and the shutdown waits for
        // every worker to be parked and still.
        let retiring = i >= shared.config.base_workers
            && me.active.load(Ordering::Relaxed)
            && shared.active.load(Ordering::SeqCst) == i + 1
            && !shared.shutdown.load(Ordering::Relaxed);
        if retiring {
            let left = shared.config.idle_retire.saturating_sub(since.elapsed());
            // Idle long enough already: no park (and none counted), on to
            // the retirement.
            if !left.is_zero() {
                counted_park();
                parker.park_timeout(left);
            }
            if me.inbox.parked.swap(false, Ordering::SeqCst) {
                // Nobody woke us: retire if nothing came in meanwhile (a
                // spawn that found us parked-by-timeout and nobody
                // searching woke nobody; the fence pairs with its own).
                std::sync::atomic::fence(Ordering::SeqCst);
                if !shared.work_visible(i) && self.try_retire() {
                    if i > shared.config.base_workers {
                        // The next one down is the highest now: if it is idle,
                        // it starts its own countdown (or retires at once if it
                        // has been idle long enough).
                        shared.workers[i - 1].notify();
                    }
                    return false;
                }
            }
            true
        } else {
            counted_park();
            parker.park();
            me.inbox.parked.store(false, Ordering::SeqCst);
            true
        }
    }

    /// Retires this worker if it is the highest active one; returns
    /// whether it did.
    fn try_retire(&self) -> bool {
        let shared = self.shared();
        let i = self.ctx.index;
        // Under the scaling lock: a scale-up between the count and the flag
        // would otherwise activate this worker and then see it deactivated.
        let scaling = shared.scaling.lock();
        if shared.active.compare_exchange(i + 1, i, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return false;
        }
        self.me().active.store(false, Ordering::Release);
        shared.stats.scale_downs.fetch_add(1, Ordering::Relaxed);
        // Not under the lock: a subscriber may read `stats()`, which takes it.
        drop(scaling);
        crate::trace_event!(worker = i, "retire");
        // Jobs that raced into our queues are still stealable, and we
        // keep polling our own: nothing is stranded.
        //
        // Orders the count's change before the caller's look at the next
        // worker's `parked` (the store-buffer pattern with that worker's
        // `parked` store, fence and load of the count in `idle`): either
        // it sees itself highest, or the caller sees it parked and wakes
        // it.
        std::sync::atomic::fence(Ordering::SeqCst);
        true
    }

    /// Exit, after shutdown reached quiescence: whatever is left is asleep
    /// on a primitive outside the executor (those fibers are held by their
    /// primitives' wait lists) or was queued in the last instant. Dropped on
    /// this thread, where started fibers are pinned.
    fn drain(&mut self, parker: &Parker) {
        // Completing a task wakes its joiners, into this inbox or another
        // worker's: drain until every worker has nothing left, then close
        // every inbox at once (a later wake finds it closed: `cancel_orphan`). A
        // worker that closed its own inbox as soon as it was empty left a
        // joiner that another worker's drain woke later with no thread to
        // unwind it on: its stack leaked and its destructors never ran.
        loop {
            self.drain_inbox();
            // Fibers in the middle of an unwind are run, once each per pass:
            // one that yields stays queued for the next pass, after the rest
            // of this one, which may be what it waits for (found in review:
            // a fiber whose destructor yielded until another fiber of the
            // worker was dropped kept the drain running it for ever).
            let ran = self.run_unwinding();
            let mut fibers = Vec::new();
            for q in &mut self.resumed {
                let (unwinding, rest): (VecDeque<Task>, VecDeque<Task>) = q.drain(..).partition(is_unwinding);
                *q = unwinding;
                fibers.extend(rest);
            }
            // One scope for the whole pass: a fiber released anywhere in it
            // (one woken for the value an abandoned fiber hands on and
            // refused; a joiner nobody else holds, released by the wake of
            // a completion: a fiber run by hand and dropped while it slept
            // in the join) is unwound only once every fiber here is let go
            // of and every task completed (found in review: such a joiner
            // joined another task of the batch and the executor's drop
            // hung).
            let idle = spindle_fiber::defer_releases(|| {
                // Woken fibers this worker took out of its inbox and will not
                // run again: let go of for good, so one woken for nothing (an
                // interrupt) hands on what a primitive hands it later, and
                // later wakes of it are refused. (Not the sleeping ones: one of
                // them may sit in the inbox, queued, by now; asleep, the
                // closed inbox refuses them.)
                for fiber in &fibers {
                    let _ = fiber.abandon();
                }
                fibers.extend(self.me().sleeping.lock().drain().map(|(_, f)| f));
                if fibers.is_empty() {
                    // Idle only if nothing ran either (what ran may have
                    // woken others, or be queued again).
                    return !ran && self.resumed.iter().all(VecDeque::is_empty);
                }
                // Every task of the batch is completed before any fiber is
                // dropped: a dropped fiber may be unwound here, and a
                // destructor of it that joins another task of the batch
                // would otherwise block this thread for good (that task is
                // completed only by this loop).
                for fiber in &fibers {
                    let raw = fiber.sched_data();
                    if raw == 0 {
                        continue;
                    }
                    // A fiber asleep in a wait it began while its thread was
                    // panicking (a destructor that waits during its unwind)
                    // keeps its task: if the wait ends (a join of a task
                    // completed here), `run_unwinding` runs it to the end,
                    // as a task of this shut-down executor, since dropping it
                    // cannot unwind it (its stack would be leaked, its
                    // remaining destructors never run). Its joiners are told
                    // now; its end (`finish`, or `cancel_orphan` for a wake
                    // after the inboxes closed) takes the task and finds it
                    // complete. Never woken, its stack leaks when released,
                    // with the task reference held on it and in its word.
                    let task = if fiber.slept_while_panicking() {
                        // SAFETY: the sched word holds a counted reference.
                        unsafe { TaskRef::clone_raw(raw) }
                    } else {
                        take_task(fiber)
                    };
                    let err = JoinError::Cancelled { fiber: Some(fiber.id()), name: task.name.clone() };
                    self.complete(task, Some(err));
                }
                drop(std::mem::take(&mut fibers));
                false
            });
            if idle {
                // Jobs queued in the last instant are dropped before this
                // worker goes idle: failing their joins wakes joiners too.
                if self.drop_queued_jobs() {
                    continue;
                }
                if self.wait_for_close(parker) {
                    break;
                }
            }
        }
        self.cache.clear();
    }

    /// In the final drain, runs the woken fibers that are in the middle of
    /// an unwind (a destructor that waited or yielded during a panic or
    /// their cancel unwind, e.g. a join of a task the drain has just
    /// completed as cancelled) instead of dropping them: a forced unwind
    /// would start inside that destructor's cleanup, which aborts the
    /// process (spindle-fiber leaks such a stack instead, and the rest of
    /// its destructors never run). Run, the wait returns (the join says
    /// `Cancelled`) and the unwind finishes on the fiber's own stack; a
    /// fiber that waits again is handled by the next pass. Returns whether
    /// it ran any (they may have woken others).
    fn run_unwinding(&mut self) -> bool {
        let mut run = Vec::new();
        for q in &mut self.resumed {
            let (unwinding, rest): (VecDeque<Task>, VecDeque<Task>) = q.drain(..).partition(is_unwinding);
            *q = rest;
            run.extend(unwinding);
        }
        let ran = !run.is_empty();
        for fiber in run {
            self.run_one(Next::Resumed(fiber));
        }
        ran
    }

    /// Drops the jobs left in this worker's queues; returns whether there
    /// were any.
    fn drop_queued_jobs(&mut self) -> bool {
        // Failing a job's join wakes its joiners: in a scope, as in
        // `drain`, so that a joiner released by its wake is unwound only
        // once every job here has failed. Each closure is dropped before
        // its job completes (a scope's borrows end with the closure), so
        // a fiber a capture held last is unwound at the scope's end too,
        // after every job here has failed: its destructor may join one of
        // them. (A capture that drops a fiber and then waits for that
        // fiber's destructors to run would wait for ever; DESIGN.md,
        // "Deferred releases".)
        spindle_fiber::defer_releases(|| self.drop_queued_jobs_now())
    }

    fn drop_queued_jobs_now(&mut self) -> bool {
        let mut any = false;
        for class in 0..CLASSES {
            while let Some(job) = self.ctx.locals[class].pop() {
                self.drop_job(job);
                any = true;
            }
            while let Some(job) = steal_one(&self.me().fresh[class]) {
                self.drop_job(job);
                any = true;
            }
        }
        any
    }
}

impl Worker {
    /// Idle in the final drain: marks this worker idle (under its inbox
    /// lock, with the inbox empty) and waits until a fiber is woken into
    /// its inbox (returns false: busy again) or every inbox is closed
    /// (returns true). The worker that sees every started worker idle
    /// closes them all: under every inbox lock at once, idle marks and
    /// empty inboxes mean no worker can wake another fiber any more (only
    /// a busy worker completes tasks), so nothing woken by a drain is
    /// left behind.
    fn wait_for_close(&mut self, parker: &Parker) -> bool {
        let shared = Arc::clone(&self.ctx.shared);
        let me = self.me();
        let last = {
            let mut inbox = me.inbox.queues.lock();
            if inbox.closed {
                return true;
            }
            if !inbox.q.iter().all(|q| q.is_empty()) {
                return false;
            }
            mark_drain_idle(&shared, &mut inbox)
        };
        // The worker that makes the count reach every started worker looks
        // (a look that fails is followed by another: the worker whose inbox
        // got a fiber is notified, drains it and comes here again).
        if last {
            close_all_if_idle(&shared);
        }
        loop {
            // Parking protocol (worker steps 1-3): a wake into this inbox
            // notifies us.
            me.inbox.parked.store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            {
                let mut inbox = me.inbox.queues.lock();
                if inbox.closed {
                    me.inbox.parked.store(false, Ordering::SeqCst);
                    return true;
                }
                if !inbox.q.iter().all(|q| q.is_empty()) {
                    inbox.drain_idle = false;
                    shared.drain_idle.fetch_sub(1, Ordering::SeqCst);
                    me.inbox.parked.store(false, Ordering::SeqCst);
                    return false;
                }
            }
            // A timeout as a backstop only (a look made while a worker
            // counted as started had not started yet): every idle worker
            // polling every 1 ms cost a pool of 1024 workers seconds.
            parker.park_timeout(CLOSE_BACKSTOP);
            me.inbox.parked.store(false, Ordering::SeqCst);
            if shared.drain_idle.load(Ordering::SeqCst) >= started_count(&shared) {
                close_all_if_idle(&shared);
            }
        }
    }
}

/// How long a worker idle in its final drain waits, if nothing wakes it,
/// before it looks again whether every inbox can close.
const CLOSE_BACKSTOP: std::time::Duration = std::time::Duration::from_millis(50);

/// Marks a worker idle in its final drain (its inbox locked: the mark and
/// the count change together); returns whether that completes the count,
/// so the caller looks whether every inbox can close.
fn mark_drain_idle(shared: &Shared, inbox: &mut crate::shared::ClassQueues) -> bool {
    inbox.drain_idle = true;
    shared.drain_idle.fetch_add(1, Ordering::SeqCst) + 1 >= started_count(shared)
}

/// Started workers (their threads run, or ran).
fn started_count(shared: &Shared) -> usize {
    shared.started_workers().iter().filter(|w| w.started.load(Ordering::Acquire)).count()
}

/// Closes every started worker's inbox if every one is idle in its final
/// drain with its inbox empty, looked at under all their locks at once
/// (taken in index order; nothing else holds two).
fn close_all_if_idle(shared: &Shared) {
    // Blocking: a look that waits for another one still looks (that one
    // may have failed for a worker busy then and idle now).
    let _closing = shared.closing.lock();
    let workers: Vec<&crate::shared::WorkerShared> =
        shared.started_workers().iter().filter(|w| w.started.load(Ordering::Acquire)).collect();
    let mut inboxes: Vec<_> = workers.iter().map(|w| w.inbox.queues.lock()).collect();
    let idle = inboxes.iter().all(|i| i.closed || (i.drain_idle && i.q.iter().all(|q| q.is_empty())));
    if !idle {
        return;
    }
    for inbox in &mut inboxes {
        inbox.closed = true;
    }
    drop(inboxes);
    for w in workers {
        w.notify();
    }
}

/// A fiber woken after the inboxes closed (after shutdown: a thread
/// outside the executor signalled a primitive it sleeps on). No thread will
/// run it again: its join fails as cancelled here, and its inbox refuses
/// it, so that the waker takes back what it handed over (`spindle-sync`
/// gives it to the next waiter) before it drops the fiber: unwound if that
/// is on its worker's thread, else its stack is leaked and counted by
/// `spindle_fiber::leaked_stacks` rather than unwound on the wrong thread.
/// A task it completes is counted in `orphans` first, so a joiner it wakes
/// reads stats that include it.
pub(crate) fn cancel_orphan(fiber: &Task, orphans: &AtomicU64) {
    if fiber.sched_data() == 0 {
        return;
    }
    let task = take_task(fiber);
    if task.finished.load(Ordering::Acquire) {
        // Completed by the final drain already (see `drain`).
        return;
    }
    let err = JoinError::Cancelled { fiber: Some(fiber.id()), name: task.name.clone() };
    orphans.fetch_add(1, Ordering::Release);
    task.complete(Some(err));
}

/// Whether the final drain runs the fiber rather than dropping it: it
/// holds its task, and is in the middle of an unwind (its task is marked,
/// or it slept while its thread was panicking; see `Worker::drain`).
fn is_unwinding(f: &Task) -> bool {
    let raw = f.sched_data();
    // SAFETY: the sched word holds a counted reference to the task while
    // it is not 0 (see `Worker::run_one`).
    raw != 0
        && (f.slept_while_panicking()
            || unsafe { TaskRef::borrow_raw(raw) }.unwinding.load(Ordering::Relaxed))
}

/// Takes the TaskRef out of a fiber's sched word.
fn take_task(fiber: &Task) -> TaskRef {
    let raw = fiber.sched_data();
    fiber.set_sched_data(0);
    // SAFETY: set in `start` from `TaskRef::into_raw`; taken once.
    unsafe { TaskRef::from_raw(raw) }
}

/// Every this many picks, a worker takes a job from its injector or the
/// global queue before its local deque (see `Worker::next`).
const OUTSIDE_EVERY: u64 = 61;

/// `running_fiber` while a worker runs user code outside any fiber (an
/// unjoined panic's payload or a cancelled job's closure dropped in the
/// worker loop): never a fiber id,
/// and not 0, so sysmon counts the worker as stuck if that code blocks,
/// and adds a worker for the work it strands.
pub(crate) const BUSY_OUTSIDE_FIBER: u64 = u64::MAX;

/// Marks the worker [`BUSY_OUTSIDE_FIBER`] until dropped, then puts back
/// what was there (guards nest).
struct BusyOutsideFiber<'a>(&'a WorkerShared, u64);

impl<'a> BusyOutsideFiber<'a> {
    fn new(me: &'a WorkerShared) -> BusyOutsideFiber<'a> {
        // Only the worker's own thread writes the word: no swap needed.
        let before = me.hot.running_fiber.load(Ordering::Relaxed);
        me.hot.running_fiber.store(BUSY_OUTSIDE_FIBER, Ordering::Relaxed);
        BusyOutsideFiber(me, before)
    }
}

impl Drop for BusyOutsideFiber<'_> {
    fn drop(&mut self) {
        self.0.hot.running_fiber.store(self.1, Ordering::Relaxed);
    }
}
