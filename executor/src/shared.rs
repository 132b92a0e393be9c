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
//! One `global[class]` injector takes spawns when no worker is running yet
//! and overflow; every worker polls it.
//!
//! # Parking protocol
//!
//! Worker (going idle), after finding nothing anywhere:
//! 1. `parked = true` (SeqCst);
//! 2. look at every queue it could take work from again (own inbox and fresh
//!    queues, the global queue, other workers' fresh queues);
//! 3. if anything is there, `parked = false` and go back to work;
//! 4. else park on its `Parker` (whose token makes an unpark that arrives
//!    before the park not lost); on waking, `parked = false`.
//!
//! Notifier (after pushing work):
//! 1. push the fiber (the queue's own synchronisation);
//! 2. a SeqCst fence;
//! 3. for an inbox push: if the owner's `parked.swap(false)` was true,
//!    unpark it. For a spawn: the same for the target worker; if the target
//!    is awake and no worker is searching for work, wake one parked worker so
//!    it can steal (one, not all).
//!
//! Steps 1 (worker) and 2 (notifier) are SeqCst on both sides: either the
//! worker's step 2 sees the pushed fiber, or the notifier's step 3 sees
//! `parked == true` and unparks it.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle as ThreadHandle;

use crossbeam_deque::{Injector, Steal};
use crossbeam_utils::sync::{Parker, Unparker};
use parking_lot::Mutex;
use spindle_fiber::{Fiber, FiberId, Priority, Schedule};

use crate::config::Config;
use crate::task::TaskRef;
use crate::timer::Timers;

/// Priority classes: 0 = high (>= 192), 1 = normal, 2 = low (< 64).
pub(crate) const CLASSES: usize = 3;

pub(crate) fn class_of(p: Priority) -> usize {
    match p.0 {
        192..=255 => 0,
        64..=191 => 1,
        _ => 2,
    }
}

/// A started fiber (pinned to the worker that started it).
pub(crate) type Task = Fiber<()>;

/// A spawned job that has not started yet: no fiber or stack is allocated
/// until a worker starts it, so any number of spawns can be queued.
pub(crate) struct Job {
    pub(crate) run: Box<dyn FnOnce() + Send>,
    pub(crate) task: TaskRef,
    pub(crate) priority: Priority,
}

/// Per-class FIFOs guarded by the inbox lock.
#[derive(Default)]
pub(crate) struct ClassQueues {
    pub(crate) q: [std::collections::VecDeque<Task>; CLASSES],
}

/// Counters, on request and at shutdown.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) spawned: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) steals: AtomicU64,
    pub(crate) inbox_handoffs: AtomicU64,
    pub(crate) parks: AtomicU64,
    pub(crate) scale_ups: AtomicU64,
    pub(crate) scale_downs: AtomicU64,
    pub(crate) peak_workers: AtomicUsize,
    pub(crate) cancelled: AtomicU64,
    pub(crate) deadlocks: AtomicU64,
}

/// One worker's shared half.
pub(crate) struct WorkerShared {
    pub(crate) index: usize,
    pub(crate) fresh: [Injector<Job>; CLASSES],
    pub(crate) inbox: Mutex<ClassQueues>,
    /// Number of fibers in the inbox (a hint to skip the lock).
    pub(crate) inbox_len: AtomicUsize,
    pub(crate) unparker: Unparker,
    /// The parker, taken by the thread when it starts.
    pub(crate) parker: Mutex<Option<Parker>>,
    /// Parking protocol flag (see module docs).
    pub(crate) parked: AtomicBool,
    /// Takes fresh work (base workers, and extra ones while scaled up).
    pub(crate) active: AtomicBool,
    /// The thread has been started.
    pub(crate) started: AtomicBool,
    /// Bumped by the worker once per batch; read by sysmon.
    pub(crate) heartbeat: AtomicU64,
    /// Set by sysmon when the running fiber overran its time slice; read and
    /// cleared by `yield_if_needed` and by the worker between fibers.
    pub(crate) preempt: AtomicBool,
    /// Fibers of this worker that sleep, for deadlock reports. Written by
    /// the worker, read by sysmon.
    pub(crate) sleeping: Mutex<std::collections::HashMap<FiberId, Task>>,
    /// The fiber this worker is running and its task (raw `TaskRef`):
    /// written by the worker before each run, read by that fiber on the same
    /// thread, to tell the executor's own fibers from fibers nested in them.
    pub(crate) running_fiber: AtomicU64,
    pub(crate) running_task: AtomicUsize,
    /// The wake seam for fibers pinned to this worker.
    pub(crate) home: Arc<dyn Schedule<()>>,
}

impl WorkerShared {
    pub(crate) fn has_fresh(&self) -> bool {
        self.fresh.iter().any(|q| !q.is_empty())
    }

    /// Unparks the worker if it is parked (notifier step 3).
    pub(crate) fn notify(&self) -> bool {
        if self.parked.swap(false, Ordering::SeqCst) {
            crate::trace_event!(worker = self.index, "unpark");
            self.unparker.unpark();
            true
        } else {
            false
        }
    }
}

/// The seam: a woken fiber goes back to the inbox of its worker.
pub(crate) struct WorkerHome {
    pub(crate) shared: Weak<Shared>,
    pub(crate) index: usize,
}

impl Schedule<()> for WorkerHome {
    fn schedule(&self, fiber: Task) {
        let Some(shared) = self.shared.upgrade() else {
            // The executor is gone; dropping the fiber here would unwind a
            // pinned stack on the wrong thread, which Fiber's drop refuses
            // (it leaks the stack instead).
            return;
        };
        let w = &shared.workers[self.index];
        let class = class_of(fiber.priority());
        w.inbox.lock().q[class].push_back(fiber);
        w.inbox_len.fetch_add(1, Ordering::SeqCst);
        shared.stats.inbox_handoffs.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        w.notify();
    }
}

/// Everything the executor's threads share.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) workers: Box<[WorkerShared]>,
    pub(crate) global: [Injector<Job>; CLASSES],
    /// Active workers (take fresh work).
    pub(crate) active: AtomicUsize,
    /// Workers looking for work (spinning before they park).
    pub(crate) searching: AtomicUsize,
    /// Round-robin cursor for spawns.
    pub(crate) next_spawn: AtomicUsize,
    /// Tasks spawned and not yet complete.
    pub(crate) live: AtomicUsize,
    /// Threads blocked in `join`/`block_on`: their tasks, for deadlock
    /// detection.
    pub(crate) blocked_joiners: Mutex<Vec<TaskRef>>,
    pub(crate) timers: Timers,
    pub(crate) shutdown: AtomicBool,
    pub(crate) stats: Counters,
    pub(crate) threads: Mutex<Vec<ThreadHandle<()>>>,
    pub(crate) sysmon_unparker: Unparker,
}

impl Shared {
    pub(crate) fn new(config: Config) -> (Arc<Shared>, Parker) {
        let sysmon_parker = Parker::new();
        let sysmon_unparker = sysmon_parker.unparker().clone();
        let shared = Arc::new_cyclic(|weak: &Weak<Shared>| {
            let workers = (0..config.max_workers)
                .map(|index| {
                    let parker = Parker::new();
                    WorkerShared {
                        index,
                        fresh: Default::default(),
                        inbox: Mutex::new(ClassQueues::default()),
                        inbox_len: AtomicUsize::new(0),
                        unparker: parker.unparker().clone(),
                        parker: Mutex::new(Some(parker)),
                        parked: AtomicBool::new(false),
                        active: AtomicBool::new(false),
                        started: AtomicBool::new(false),
                        heartbeat: AtomicU64::new(0),
                        preempt: AtomicBool::new(false),
                        sleeping: Mutex::new(Default::default()),
                        running_fiber: AtomicU64::new(0),
                        running_task: AtomicUsize::new(0),
                        home: Arc::new(WorkerHome {
                            shared: weak.clone(),
                            index,
                        }),
                    }
                })
                .collect();
            Shared {
                config,
                workers,
                global: Default::default(),
                active: AtomicUsize::new(0),
                searching: AtomicUsize::new(0),
                next_spawn: AtomicUsize::new(0),
                live: AtomicUsize::new(0),
                blocked_joiners: Mutex::new(Vec::new()),
                timers: Timers::new(),
                shutdown: AtomicBool::new(false),
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

    /// Wakes one parked active worker, if any.
    pub(crate) fn wake_one_parked(&self) -> bool {
        let n = self.active.load(Ordering::Relaxed);
        self.workers[..n.min(self.workers.len())]
            .iter()
            .any(|w| w.notify())
    }

    /// Is there any work a worker (`me`) could take?
    pub(crate) fn work_visible(&self, me: usize) -> bool {
        let w = &self.workers[me];
        if w.inbox_len.load(Ordering::SeqCst) > 0 {
            return true;
        }
        if !w.active.load(Ordering::Relaxed) {
            return false;
        }
        w.has_fresh()
            || self.global.iter().any(|q| !q.is_empty())
            || self.workers.iter().any(|o| o.index != me && o.has_fresh())
    }

    /// Is any fiber waiting to run anywhere?
    pub(crate) fn pending_work(&self) -> bool {
        self.global.iter().any(|q| !q.is_empty())
            || self
                .workers
                .iter()
                .any(|w| w.has_fresh() || w.inbox_len.load(Ordering::Relaxed) > 0)
    }

    /// Steals one fresh fiber of `class` from another worker.
    pub(crate) fn steal(&self, me: usize, class: usize, start: usize) -> Option<Job> {
        let n = self.workers.len();
        for k in 0..n {
            let v = (start + k) % n;
            if v == me {
                continue;
            }
            loop {
                match self.workers[v].fresh[class].steal() {
                    Steal::Success(t) => {
                        self.stats.steals.fetch_add(1, Ordering::Relaxed);
                        crate::trace_event!(worker = me, victim = v, "steal");
                        return Some(t);
                    }
                    Steal::Empty => break,
                    Steal::Retry => continue,
                }
            }
        }
        None
    }

    pub(crate) fn note_workers(&self) {
        let n = self.active.load(Ordering::Relaxed);
        self.stats.peak_workers.fetch_max(n, Ordering::Relaxed);
    }

    /// Wakes every thread (shutdown).
    pub(crate) fn wake_all(&self) {
        for w in self.workers.iter() {
            w.parked.store(false, Ordering::SeqCst);
            w.unparker.unpark();
        }
        self.sysmon_unparker.unpark();
    }
}

/// Pops one job from an injector.
pub(crate) fn steal_one(q: &Injector<Job>) -> Option<Job> {
    loop {
        match q.steal() {
            Steal::Success(t) => return Some(t),
            Steal::Empty => return None,
            Steal::Retry => continue,
        }
    }
}
