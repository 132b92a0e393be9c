//! The public executor API: `Executor`, `Handle`, `JoinHandle`, spawning.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle as ThreadHandle;

use spindle_fiber::{FiberId, Priority};

use crate::config::{Builder, Config};
use crate::shared::{Job, Shared};
use crate::task::{JoinError, TaskCell, TaskRef};

/// An M:N pool of worker threads running fibers.
///
/// Dropping it shuts it down: workers and sysmon stop, fibers still queued
/// or asleep in the executor (in `sleep`, `join`, a yield) are unwound on
/// their worker and their joins fail with [`JoinError::Cancelled`], and
/// every thread is joined.
///
/// ```
/// use spindle_executor::Executor;
///
/// let exec = Executor::builder().workers(2).build();
/// let h = exec.spawn(|| "hello from a fiber");
/// assert_eq!(h.join().unwrap(), "hello from a fiber");
/// ```
pub struct Executor {
    handle: Handle,
    sysmon: Option<ThreadHandle<()>>,
}

/// A cheap, clonable handle to an executor, for spawning from anywhere
/// (including from its own fibers, see [`Handle::current`]).
#[derive(Clone)]
pub struct Handle {
    pub(crate) shared: Arc<Shared>,
}

/// Name, priority of a fiber to spawn.
///
/// ```
/// use spindle_executor::{Executor, Priority, SpawnOptions};
///
/// let exec = Executor::builder().workers(1).build();
/// let h = exec.spawn_with(SpawnOptions::new().name("answer").priority(Priority::HIGHEST), || 42);
/// assert_eq!(h.join().unwrap(), 42);
/// ```
#[derive(Debug, Clone, Default)]
pub struct SpawnOptions {
    pub(crate) name: Option<Arc<str>>,
    pub(crate) priority: Priority,
}

impl SpawnOptions {
    /// Defaults: no name, [`Priority::NORMAL`].
    pub fn new() -> SpawnOptions {
        SpawnOptions::default()
    }

    /// A name, shown in panic reports, join errors and deadlock reports.
    pub fn name(mut self, name: impl Into<Arc<str>>) -> SpawnOptions {
        self.name = Some(name.into());
        self
    }

    /// The fiber's priority.
    pub fn priority(mut self, p: Priority) -> SpawnOptions {
        self.priority = p;
        self
    }

    pub(crate) fn priority_value(&self) -> Priority {
        self.priority
    }
}

impl Default for Executor {
    fn default() -> Executor {
        Executor::new()
    }
}

impl Executor {
    /// An executor with the default settings (see [`Builder`]).
    pub fn new() -> Executor {
        Builder::default().build()
    }

    /// Settings for a new executor.
    pub fn builder() -> Builder {
        Builder::default()
    }

    pub(crate) fn start(config: Config) -> Executor {
        let base = config.base_workers;
        let (shared, sysmon_parker) = Shared::new(config);
        shared.active.store(base, Ordering::Release);
        for i in 0..base {
            crate::sysmon::activate(&shared, i);
        }
        shared.note_workers();
        let s = Arc::clone(&shared);
        let sysmon = std::thread::Builder::new()
            .name("spindle-sysmon".into())
            .spawn(move || crate::sysmon::run(s, sysmon_parker))
            .expect("spawning the sysmon thread");
        Executor {
            handle: Handle { shared },
            sysmon: Some(sysmon),
        }
    }

    /// A handle for spawning from elsewhere.
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Spawns a fiber running `f`; see [`Handle::spawn`].
    pub fn spawn<F, T>(&self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.handle.spawn(f)
    }

    /// Spawns a fiber with a name and priority; see [`Handle::spawn_with`].
    pub fn spawn_with<F, T>(&self, options: SpawnOptions, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.handle.spawn_with(options, f)
    }

    /// Runs `f` on a fiber and waits for it (from `main`, a thread, or a
    /// fiber).
    #[track_caller]
    pub fn block_on<F, T>(&self, f: F) -> Result<T, JoinError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.spawn(f).join()
    }

    /// Structured concurrency: every fiber spawned on the scope is joined
    /// before `scope` returns, so they may borrow from the caller. See
    /// [`Scope`](crate::Scope).
    pub fn scope<'env, F, R>(&self, f: F) -> R
    where
        F: for<'scope> FnOnce(&'scope crate::Scope<'scope, 'env>) -> R,
    {
        crate::scope::scope(&self.handle, f)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ExecutorStats {
        self.handle.stats()
    }
}

impl Handle {
    /// The executor whose fiber calls this, or `None` elsewhere.
    pub fn current() -> Option<Handle> {
        crate::worker::current_worker().map(|w| Handle {
            shared: Arc::clone(&w.shared),
        })
    }

    /// Spawns a fiber running `f`, with no name at [`Priority::NORMAL`].
    ///
    /// Never blocks and never fails: the fiber and its stack are created
    /// when a worker starts it, so spawns beyond the number of stacks the
    /// system can map queue instead of failing.
    pub fn spawn<F, T>(&self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.spawn_with(SpawnOptions::default(), f)
    }

    /// Spawns a fiber with a name and priority.
    pub fn spawn_with<F, T>(&self, options: SpawnOptions, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let cell = TaskCell::<T>::new(options.name);
        let slot = Arc::clone(&cell);
        let run = Box::new(move || {
            let value = f();
            *slot.result.lock() = Some(value);
        });
        self.push(run, TaskCell::erase(&cell), options.priority);
        JoinHandle {
            cell,
            shared: Arc::clone(&self.shared),
            _not_sync: PhantomData,
        }
    }

    pub(crate) fn push(&self, run: Box<dyn FnOnce() + Send>, task: TaskRef, priority: Priority) {
        let shared = &self.shared;
        assert!(
            !shared.shutdown.load(Ordering::Acquire),
            "spindle-executor: spawn on an executor that is shutting down"
        );
        shared.live.fetch_add(1, Ordering::AcqRel);
        shared.stats.spawned.fetch_add(1, Ordering::Relaxed);
        shared.push_fresh(Job { run, task, priority });
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ExecutorStats {
        let c = &self.shared.stats;
        ExecutorStats {
            spawned: c.spawned.load(Ordering::Relaxed),
            completed: c.completed.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            steals: c.steals.load(Ordering::Relaxed),
            inbox_handoffs: c.inbox_handoffs.load(Ordering::Relaxed),
            parks: c.parks.load(Ordering::Relaxed),
            scale_ups: c.scale_ups.load(Ordering::Relaxed),
            scale_downs: c.scale_downs.load(Ordering::Relaxed),
            workers: self.shared.active.load(Ordering::Relaxed),
            peak_workers: c.peak_workers.load(Ordering::Relaxed),
            deadlocks: c.deadlocks.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle").field("stats", &self.stats()).finish()
    }
}

impl fmt::Debug for Executor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executor").field("stats", &self.stats()).finish()
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let shared = &self.handle.shared;
        shared.shutdown.store(true, Ordering::SeqCst);
        shared.timers.fire_all();
        shared.wake_all();
        if let Some(s) = self.sysmon.take() {
            let _ = s.join();
        }
        let threads = std::mem::take(&mut *shared.threads.lock());
        for t in threads {
            let _ = t.join();
        }
        // Jobs that never started: drop them and fail their joins.
        for q in shared.global.iter() {
            while let Some(job) = crate::shared::steal_one(q) {
                let name = job.task.name.clone();
                let task = job.task.clone();
                drop(job);
                task.complete(Some(JoinError::Cancelled { fiber: None, name }));
                shared.live.fetch_sub(1, Ordering::AcqRel);
            }
        }
        if shared.config.stats_at_shutdown {
            eprintln!("spindle-executor stats: {:?}", self.stats());
        }
    }
}

/// Counters of an executor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecutorStats {
    /// Fibers spawned.
    pub spawned: u64,
    /// Fibers completed (returned, panicked or cancelled).
    pub completed: u64,
    /// Of those, cancelled.
    pub cancelled: u64,
    /// Jobs taken from another worker's queue.
    pub steals: u64,
    /// Woken fibers handed to their worker's inbox.
    pub inbox_handoffs: u64,
    /// Times a worker parked.
    pub parks: u64,
    /// Times sysmon added workers.
    pub scale_ups: u64,
    /// Times an extra worker retired.
    pub scale_downs: u64,
    /// Active workers now.
    pub workers: usize,
    /// Most active workers at once.
    pub peak_workers: usize,
    /// Deadlocks detected.
    pub deadlocks: u64,
}

/// Owns the right to join a spawned fiber.
///
/// [`join`](JoinHandle::join) from a fiber puts that fiber to sleep; from a
/// thread it blocks the thread (no busy wait). Dropping the handle detaches
/// the fiber.
pub struct JoinHandle<T> {
    cell: Arc<TaskCell<T>>,
    shared: Arc<Shared>,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<T> JoinHandle<T> {
    pub(crate) fn from_parts(cell: Arc<TaskCell<T>>, shared: Arc<Shared>) -> JoinHandle<T> {
        JoinHandle {
            cell,
            shared,
            _not_sync: PhantomData,
        }
    }
}

impl<T: Send + 'static> JoinHandle<T> {
    /// Waits for the fiber and returns its value, or why there is none.
    #[track_caller]
    pub fn join(self) -> Result<T, JoinError> {
        let task = &self.cell;
        if !task.finished.load(Ordering::Acquire) {
            if spindle_fiber::in_fiber() {
                task.done.acquire();
            } else {
                // A blocked thread: visible to deadlock detection.
                let me = TaskCell::erase(task);
                self.shared.blocked_joiners.lock().push(me);
                self.shared.sysmon_unparker.unpark();
                task.done.acquire();
                let mut joiners = self.shared.blocked_joiners.lock();
                if let Some(i) = joiners.iter().position(|t| std::ptr::eq(&**t, &***task)) {
                    joiners.swap_remove(i);
                }
            }
        }
        if let Some(v) = task.result.lock().take() {
            return Ok(v);
        }
        Err(task.error.lock().take().unwrap_or_else(|| JoinError::Deadlock {
            report: "the fiber completed without a value or an error".into(),
        }))
    }

    /// Asks the fiber to stop: it unwinds (destructors run) at its next
    /// executor suspension point (`yield_now`, `sleep`, `yield_timeout`,
    /// `yield_if_needed`, or when next taken from a queue), and
    /// [`join`](JoinHandle::join) returns [`JoinError::Cancelled`]. A fiber
    /// asleep in `sleep` or `yield_timeout` is woken at once; one asleep on
    /// a `spindle-sync` primitive is unwound when that wakes it.
    pub fn cancel(&self) {
        self.cell.cancelled.store(true, Ordering::Release);
        self.wake();
    }

    /// Ends a [`yield_timeout`](crate::yield_timeout) of the fiber early
    /// (Tarantool's `fiber_wakeup`). No effect otherwise.
    pub fn wake(&self) {
        let waiter = self.cell.sleep.lock().waiter.take();
        if let Some(w) = waiter {
            w.wake();
        }
    }

    /// Whether the fiber has completed.
    pub fn is_finished(&self) -> bool {
        self.cell.finished.load(Ordering::Acquire)
    }

    /// The fiber's id, once it has started.
    pub fn fiber_id(&self) -> Option<FiberId> {
        self.cell.started_fiber.get().copied()
    }
}

impl<T> fmt::Debug for JoinHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinHandle")
            .field("name", &self.cell.name)
            .field("fiber", &self.cell.started_fiber.get())
            .field("finished", &self.cell.finished.load(Ordering::Relaxed))
            .finish()
    }
}
