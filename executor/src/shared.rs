//! State shared by the workers, the sysmon thread and spawners.
//!
//! # Queues
//!
//! Per worker:
//! * `fresh[class]`: fibers that have not started yet (`crossbeam_deque::Injector`):
//!   spawns land here round-robin, the owner pops and other workers steal.
//! * `inbox`: started fibers woken by other threads (a sync primitive, a
//!   timer, a join). Only the owner runs them: a started fiber is pinned to
//!   its worker (see DESIGN.md, "Soundness").
//! * `resumed` (owned by the worker thread, in `worker.rs`): fibers it ran
//!   that yielded.
//!
//! One `global[class]` injector takes jobs put back when no stack could be
//! mapped for them; active workers poll it.
//!
//! # Parking protocol
//!
//! Worker (going idle), after finding nothing anywhere:
//! 1. `parked = true` (SeqCst), then a SeqCst fence;
//! 2. look at every queue it could take work from again (own inbox and fresh
//!    queues, the global queue, other workers' fresh queues);
//! 3. if anything is there, `parked = false` and go back to work; (3b) an
//!    active worker that sees no other worker searching and work pending
//!    wakes one parked worker first (a spawn made while it still counted
//!    as searching woke nobody, leaving the work to the searchers);
//! 4. else park on its `Parker` (whose token makes an unpark that arrives
//!    before the park not lost); on waking, `parked = false`, and the next
//!    round searches (counted in `searching`), so that the wake is handed
//!    on by the last-searcher rule (`Worker::main_loop`).
//!
//! Notifier (after pushing work):
//! 1. push the fiber (the queue's own synchronisation);
//! 2. a SeqCst fence;
//! 3. for an inbox push: if the owner's `parked` is true and a
//!    compare-and-swap takes it to false, unpark it. For a spawn: the same
//!    for the target worker; if the target is awake and no worker is
//!    searching for work, wake one parked worker so it can steal (one, not
//!    all).
//!
//! Steps 1 (worker) and 2 (notifier) are SeqCst on both sides: either the
//! worker's step 2 sees the pushed fiber, or the notifier's step 3 sees
//! `parked == true` and unparks it.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle as ThreadHandle;

use crossbeam_deque::{Injector, Steal, Stealer, Worker};
use crossbeam_utils::sync::{Parker, Unparker};
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use spindle_fiber::{Fiber, FiberId, FiberIdHasher, Priority, Schedule, Woken};

use crate::config::Config;
use crate::task::TaskRef;
use crate::timer::Timers;

/// Priority classes: 0 = high (`Priority::HIGH`, 192, and above), 1 =
/// normal, 2 = low (`Priority::LOW`, 64, and below).
pub(crate) const CLASSES: usize = 3;

pub(crate) fn class_of(p: Priority) -> usize {
    match p {
        p if p >= Priority::HIGH => 0,
        p if p > Priority::LOW => 1,
        _ => 2,
    }
}

/// A started fiber (pinned to the worker that started it).
pub(crate) type Task = Fiber<()>;

/// A spawned task that has not started yet: no fiber or stack is
/// allocated until a worker starts it, so any number of spawns can be
/// queued. The closure lives in the task itself (one allocation per spawn).
pub(crate) struct Job {
    pub(crate) task: TaskRef,
    pub(crate) priority: Priority,
}

/// Per-class FIFOs guarded by the inbox lock.
#[derive(Default)]
pub(crate) struct ClassQueues {
    pub(crate) q: [std::collections::VecDeque<Task>; CLASSES],
    /// Set once every worker has drained for the last time, for all
    /// inboxes at once (`Worker::drain`): a fiber woken after that has no
    /// thread to run on.
    pub(crate) closed: bool,
    /// The worker found nothing left in its final drain and waits for the
    /// others (or for a fiber woken into this inbox).
    pub(crate) drain_idle: bool,
}

/// Executor-wide counters (rarely written, or written by spawners only).
#[derive(Default)]
pub(crate) struct Counters {
    /// Written by spawners: on its own cache line, away from the workers.
    pub(crate) spawned: CachePadded<AtomicU64>,
    /// Tasks completed outside the workers (shutdown).
    pub(crate) completed_outside: AtomicU64,
    pub(crate) scale_ups: AtomicU64,
    pub(crate) scale_downs: AtomicU64,
    pub(crate) peak_workers: AtomicUsize,
    pub(crate) deadlocks: AtomicU64,
    /// Jobs put back because no stack could be mapped (cold path).
    pub(crate) stack_waits: AtomicU64,
}

/// Counters written by one worker only (plain load + store), summed on
/// request.
#[derive(Default)]
pub(crate) struct WorkerCounters {
    pub(crate) completed: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) steals: AtomicU64,
    pub(crate) parks: AtomicU64,
}

impl WorkerCounters {
    #[inline]
    pub(crate) fn bump(c: &AtomicU64) {
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// Fields the worker writes all the time, on their own cache line so that
/// spawners and wakers touching `parked` or the queues do not bounce them.
#[derive(Default)]
pub(crate) struct Hot {
    /// Bumped by the worker once per scheduling round; read by sysmon.
    pub(crate) heartbeat: AtomicU64,
    /// The fiber this worker is running and its task (raw `TaskRef`):
    /// written by the worker before each run, read by that fiber on the same
    /// thread, to tell the executor's own fibers from fibers nested in them.
    pub(crate) running_fiber: AtomicU64,
    pub(crate) running_task: AtomicUsize,
    /// Set by sysmon when the running fiber overran its time slice; read and
    /// cleared by `yield_if_needed` and by the worker between fibers.
    pub(crate) preempt: AtomicBool,
    /// Whether the worker's thread was panicking when it resumed the
    /// running fiber (a fiber, this one or another, suspended in the middle
    /// of an unwind): if not, a panicking thread inside the fiber means the
    /// fiber itself is unwinding (`ops::check_cancel`). Written by the
    /// worker only.
    pub(crate) panicking_at_resume: AtomicBool,
    pub(crate) counters: WorkerCounters,
}

/// One worker's shared half.
pub(crate) struct WorkerShared {
    pub(crate) index: usize,
    pub(crate) fresh: [Injector<Job>; CLASSES],
    pub(crate) inbox: Arc<Inbox>,
    /// The parker, taken by the thread when it starts.
    pub(crate) parker: Mutex<Option<Parker>>,
    /// Stealers of the worker's local deques (the deques themselves belong
    /// to the worker thread).
    pub(crate) stealers: [Stealer<Job>; CLASSES],
    pub(crate) hot: CachePadded<Hot>,
    /// Takes fresh work (base workers, and extra ones while scaled up).
    pub(crate) active: AtomicBool,
    /// The thread has been started.
    pub(crate) started: AtomicBool,
    /// Fibers of this worker that sleep, for deadlock reports. Written by
    /// the worker, read by sysmon.
    pub(crate) sleeping: Mutex<HashMap<FiberId, Task, BuildHasherDefault<FiberIdHasher>>>,
    /// The worker's local deques, taken by its thread when it starts.
    pub(crate) locals: Mutex<Option<[Worker<Job>; CLASSES]>>,
    /// The wake seam for fibers pinned to this worker.
    pub(crate) home: Arc<dyn Schedule<()>>,
}

impl WorkerShared {
    pub(crate) fn has_fresh(&self) -> bool {
        self.fresh.iter().any(|q| !q.is_empty()) || self.stealers.iter().any(|q| !q.is_empty())
    }

    /// Unparks the worker if it is parked (notifier step 3).
    pub(crate) fn notify(&self) -> bool {
        self.inbox.notify()
    }
}

/// A worker's inbox: started fibers woken by other threads. It is also
/// the worker's wake seam (the `home` of every fiber pinned to it), so it
/// is its own allocation: a woken fiber reaches it without touching the
/// rest of the executor.
pub(crate) struct Inbox {
    #[cfg_attr(not(feature = "tracing"), allow(dead_code))]
    pub(crate) index: usize,
    pub(crate) queues: Mutex<ClassQueues>,
    /// Number of fibers queued (a hint to skip the lock).
    pub(crate) len: AtomicUsize,
    /// Parking protocol flag (see module docs).
    pub(crate) parked: CachePadded<AtomicBool>,
    pub(crate) unparker: Unparker,
    pub(crate) handoffs: AtomicU64,
    /// Tasks completed (cancelled) by `worker::cancel_orphan` for fibers woken
    /// after the inbox closed; counted in the stats as completed.
    pub(crate) orphans: AtomicU64,
}

impl Inbox {
    /// Unparks the worker if it is parked (notifier step 3). Loads before
    /// taking the flag so that the common case (awake) does not take the
    /// line. A compare-and-swap rather than a `swap(false)`: the same in the
    /// memory model (a swap that reads `false` writes `false` right after
    /// it, which nobody can tell from no write), but loom 0.7 leaves a
    /// swap's write unordered against the worker's next `parked = true` and
    /// reports lost wakeups that cannot happen (tokio-rs/loom#254; the
    /// litmus models in `tests/loom.rs`, docs/loom.md).
    pub(crate) fn notify(&self) -> bool {
        if self.parked.load(Ordering::SeqCst)
            && self.parked.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_ok()
        {
            crate::trace_event!(worker = self.index, "unpark");
            self.unparker.unpark();
            true
        } else {
            false
        }
    }
}

impl Schedule<()> for Inbox {
    /// The seam: a woken fiber goes back to the inbox of its worker.
    fn schedule<'w>(&self, woken: Woken<'w, ()>) -> Result<(), Woken<'w, ()>> {
        let class = class_of(woken.fiber().priority());
        let mut queues = self.queues.lock();
        if queues.closed {
            drop(queues);
            // No thread will run it again: refused, so that a waker takes
            // back what it handed over; its join fails as cancelled.
            crate::worker::cancel_orphan(woken.fiber(), &self.orphans);
            return Err(woken);
        }
        queues.q[class].push_back(woken.into_queued());
        // Counted under the lock, so a drain never subtracts a fiber that is
        // not counted yet.
        self.len.fetch_add(1, Ordering::SeqCst);
        drop(queues);
        self.handoffs.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        self.notify();
        Ok(())
    }
}

/// Everything the executor's threads share.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) workers: Box<[WorkerShared]>,
    pub(crate) global: [Injector<Job>; CLASSES],
    /// Active workers (take fresh work).
    pub(crate) active: AtomicUsize,
    /// Worker slots whose thread was ever started: a prefix of `workers`
    /// (threads start in index order and never stop before shutdown), so
    /// scans of the pool cost the workers it has had, not `max_workers`.
    pub(crate) slots: AtomicUsize,
    /// Held while `active`, the workers' `active` flags and the scaling
    /// counters (`scale_ups`, `scale_downs`, `peak_workers`) change
    /// (scale-up, retirement), and by `Handle::stats` while it reads them,
    /// so they agree. Not held across tracing events (a subscriber may call
    /// `stats()`).
    pub(crate) scaling: Mutex<()>,
    /// Workers idle in their final drain (`ClassQueues::drain_idle`).
    pub(crate) drain_idle: AtomicUsize,
    /// Held by a worker while it looks whether every inbox can close (one
    /// look at a time).
    pub(crate) closing: Mutex<()>,
    /// Workers looking for work (spinning before they park).
    pub(crate) searching: CachePadded<AtomicUsize>,
    /// Set by a worker that could not map a stack for a job: every worker
    /// then drops the idle fibers it caches (their stacks go back to the
    /// pool, which unmaps idle ones when a mapping fails) and caches no
    /// more, until a job starts again.
    pub(crate) stack_pressure: AtomicBool,
    /// Round-robin cursor for spawns.
    pub(crate) next_spawn: CachePadded<AtomicUsize>,
    /// Threads blocked in `join`/`block_on`: their tasks, for deadlock
    /// detection.
    pub(crate) blocked_joiners: Mutex<Vec<TaskRef>>,
    /// Threads blocked in `scope`, waiting for its fibers: deadlock
    /// detection reports them (a scope cannot be failed).
    pub(crate) blocked_scopes: AtomicUsize,
    /// Bumped whenever a thread starts blocking in `join`/`block_on` or
    /// waiting in `scope`: a new blocked thread starts a new deadlock
    /// episode, reported (and its join failed) in its own right.
    pub(crate) blocked_generation: AtomicU64,
    pub(crate) timers: Timers,
    /// Shutdown has begun: unstarted jobs are dropped, started fibers
    /// unwind at their next executor suspension point.
    pub(crate) shutdown: AtomicBool,
    /// Workers leave their loop (set once shutdown is quiescent).
    pub(crate) exit: AtomicBool,
    /// Spawns from outside the workers between their `shutdown` check and
    /// their push: shutdown waits for them (see `Handle::push`).
    pub(crate) spawns_in_flight: CachePadded<AtomicUsize>,
    pub(crate) stats: Counters,
    pub(crate) threads: Mutex<Vec<ThreadHandle<()>>>,
    pub(crate) sysmon_unparker: Unparker,
}

impl Shared {
    pub(crate) fn new(config: Config) -> (Arc<Shared>, Parker) {
        let sysmon_parker = Parker::new();
        let sysmon_unparker = sysmon_parker.unparker().clone();
        let shared = Arc::new({
            let workers = (0..config.max_workers)
                .map(|index| {
                    let parker = Parker::new();
                    let inbox = Arc::new(Inbox {
                        index,
                        queues: Mutex::new(ClassQueues::default()),
                        len: AtomicUsize::new(0),
                        parked: CachePadded::new(AtomicBool::new(false)),
                        unparker: parker.unparker().clone(),
                        handoffs: AtomicU64::new(0),
                        orphans: AtomicU64::new(0),
                    });
                    let locals: [Worker<Job>; CLASSES] = std::array::from_fn(|_| Worker::new_fifo());
                    let stealers = std::array::from_fn(|c| locals[c].stealer());
                    WorkerShared {
                        index,
                        fresh: Default::default(),
                        home: inbox.clone(),
                        inbox,
                        parker: Mutex::new(Some(parker)),
                        stealers,
                        hot: CachePadded::new(Hot::default()),
                        locals: Mutex::new(Some(locals)),
                        active: AtomicBool::new(false),
                        started: AtomicBool::new(false),
                        sleeping: Mutex::new(Default::default()),
                    }
                })
                .collect();
            Shared {
                config,
                workers,
                global: Default::default(),
                active: AtomicUsize::new(0),
                slots: AtomicUsize::new(0),
                scaling: Mutex::new(()),
                drain_idle: AtomicUsize::new(0),
                closing: Mutex::new(()),
                searching: CachePadded::new(AtomicUsize::new(0)),
                stack_pressure: AtomicBool::new(false),
                next_spawn: CachePadded::new(AtomicUsize::new(0)),
                blocked_joiners: Mutex::new(Vec::new()),
                blocked_scopes: AtomicUsize::new(0),
                blocked_generation: AtomicU64::new(0),
                timers: Timers::new(),
                shutdown: AtomicBool::new(false),
                exit: AtomicBool::new(false),
                spawns_in_flight: CachePadded::new(AtomicUsize::new(0)),
                stats: Counters::default(),
                threads: Mutex::new(Vec::new()),
                sysmon_unparker,
            }
        });
        (shared, sysmon_parker)
    }

    /// Pushes an unstarted fiber round-robin onto an active worker's fresh
    /// queue and wakes one worker if needed (notifier steps).
    pub(crate) fn push_fresh(&self, job: Job) {
        let class = class_of(job.priority);
        let active = self.active.load(Ordering::Relaxed).max(1);
        let i = self.next_spawn.fetch_add(1, Ordering::Relaxed) % active;
        let w = &self.workers[i];
        w.fresh[class].push(job);
        fence(Ordering::SeqCst);
        if !w.notify() && self.searching.load(Ordering::SeqCst) == 0 {
            self.wake_one_parked();
        }
    }

    /// The workers whose thread was ever started (see `slots`).
    pub(crate) fn started_workers(&self) -> &[WorkerShared] {
        &self.workers[..self.slots.load(Ordering::Acquire).min(self.workers.len())]
    }

    /// Wakes one parked active worker, if any.
    pub(crate) fn wake_one_parked(&self) -> bool {
        let n = self.active.load(Ordering::Relaxed);
        self.workers[..n.min(self.workers.len())].iter().any(|w| w.notify())
    }

    /// Is there any work a worker (`me`) could take?
    pub(crate) fn work_visible(&self, me: usize) -> bool {
        let w = &self.workers[me];
        if w.inbox.len.load(Ordering::SeqCst) > 0 || w.has_fresh() {
            return true;
        }
        if !w.active.load(Ordering::Relaxed) {
            return false;
        }
        self.global.iter().any(|q| !q.is_empty())
            || self.started_workers().iter().any(|o| o.index != me && o.has_fresh())
    }

    /// Is there work a new worker could take (queued jobs, not woken
    /// fibers, which are pinned to their workers)?
    pub(crate) fn stealable_work(&self) -> bool {
        self.global.iter().any(|q| !q.is_empty()) || self.started_workers().iter().any(|w| w.has_fresh())
    }

    /// Is any fiber waiting to run anywhere: queued jobs, or woken fibers
    /// in an inbox?
    pub(crate) fn pending_work(&self) -> bool {
        self.stealable_work()
            || self.started_workers().iter().any(|w| w.inbox.len.load(Ordering::Relaxed) > 0)
    }

    /// Steals one fresh fiber of `class` from another worker.
    pub(crate) fn steal(&self, me: usize, class: usize, start: usize, local: &Worker<Job>) -> Option<Job> {
        let victims = self.started_workers();
        let n = victims.len();
        for k in 0..n {
            let v = (start + k) % n;
            if v == me {
                continue;
            }
            let victim = &victims[v];
            let (deque, injector) = (&victim.stealers[class], &victim.fresh[class]);
            let before = local.len();
            let got = (!deque.is_empty())
                .then(|| retry(|| deque.steal_batch_and_pop(local)))
                .flatten()
                .or_else(|| {
                    (!injector.is_empty()).then(|| retry(|| injector.steal_batch_and_pop(local))).flatten()
                });
            if let Some(t) = got {
                // The job returned and the batch moved into `local` with it
                // (an estimate: other workers may steal from `local` meanwhile).
                let c = &self.workers[me].hot.counters.steals;
                let jobs = local.len().saturating_sub(before) as u64 + 1;
                c.store(c.load(Ordering::Relaxed) + jobs, Ordering::Relaxed);
                crate::trace_event!(worker = me, victim = v, "steal");
                return Some(t);
            }
        }
        None
    }

    pub(crate) fn note_workers(&self) {
        let n = self.active.load(Ordering::Relaxed);
        self.stats.peak_workers.fetch_max(n, Ordering::Relaxed);
    }

    /// Interrupts the fiber with this id if it sleeps on one of the
    /// workers (`JoinHandle::cancel`): its interruptible wait on a
    /// `spindle-sync` primitive, if it is in one, returns. The worker side
    /// of the race (a fiber that goes to sleep as this looks) is in
    /// `Worker::run_one`: whichever of the two comes second interrupts it.
    ///
    /// `always_wake`: wake it even if a mark was pending already. The
    /// worker's check after every sleep passes false: a fiber whose mark is
    /// still pending sleeps in a plain wait (an interruptible one takes the
    /// mark), and waking it again would only make it sleep again, forever.
    pub(crate) fn interrupt_sleeping(&self, id: FiberId, task: usize, always_wake: bool) {
        for w in self.started_workers() {
            // Marked under the lock, while the fiber is known to sleep in
            // this task (fibers are reused: a mark made later could reach
            // the next task's wait), woken after it: the wake locks the
            // inbox, which comes before `sleeping` in the lock order.
            let found = w.sleeping.lock().get(&id).filter(|f| f.sched_data() == task).map(|f| {
                let new = f.set_interrupt();
                (new || always_wake).then(|| f.waiter())
            });
            if let Some(waiter) = found {
                if let Some(w) = waiter {
                    w.wake();
                }
                return;
            }
        }
    }

    /// Shutdown: interrupts every fiber asleep in one of the workers'
    /// maps, so that those in interruptible waits reach their next
    /// cancellation point (fibers that sleep later are interrupted by
    /// their worker, which checks `shutdown` after every sleep).
    pub(crate) fn interrupt_all_sleeping(&self) {
        for w in self.started_workers() {
            let waiters: Vec<_> = w
                .sleeping
                .lock()
                .values()
                .filter(|f| f.sched_data() != 0)
                .map(|f| {
                    f.set_interrupt();
                    f.waiter()
                })
                .collect();
            for waiter in waiters {
                waiter.wake();
            }
        }
    }

    /// Wakes every thread (shutdown).
    pub(crate) fn wake_all(&self) {
        for w in self.workers.iter() {
            w.inbox.parked.store(false, Ordering::SeqCst);
            w.inbox.unparker.unpark();
        }
        self.sysmon_unparker.unpark();
    }
}

/// Pops one job from an injector.
pub(crate) fn steal_one(q: &Injector<Job>) -> Option<Job> {
    retry(|| q.steal())
}

/// Repeats a steal while it says `Retry`.
pub(crate) fn retry<T>(mut f: impl FnMut() -> Steal<T>) -> Option<T> {
    loop {
        match f() {
            Steal::Success(t) => return Some(t),
            Steal::Empty => return None,
            Steal::Retry => continue,
        }
    }
}

impl Shared {
    /// Tasks spawned and not yet complete.
    pub(crate) fn live(&self) -> u64 {
        let workers = self.started_workers();
        let done: u64 = workers.iter().map(|w| w.hot.counters.completed.load(Ordering::Acquire)).sum();
        let outside = self.stats.completed_outside.load(Ordering::Acquire)
            + workers.iter().map(|w| w.inbox.orphans.load(Ordering::Acquire)).sum::<u64>();
        self.stats.spawned.load(Ordering::Acquire).saturating_sub(done + outside)
    }
}
