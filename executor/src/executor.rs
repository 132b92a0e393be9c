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

/// What a fiber blocked in [`JoinHandle::join`] waits on, in reports.
static JOINING: spindle_fiber::WaitReason = spindle_fiber::WaitReason("a join (JoinHandle::join)");
static WAITING_FOR_TASK: spindle_fiber::WaitReason =
    spindle_fiber::WaitReason("a task (JoinHandle::wait_timeout or wait_until)");

/// An M:N pool of worker threads running fibers.
///
/// Dropping it shuts it down: workers and sysmon stop, fibers still queued
/// or asleep in the executor (in `sleep`, `join`, a yield) are unwound on
/// their worker and their joins fail with [`JoinError::Cancelled`], and
/// every thread is joined before `drop` returns. (Dropped on a worker or
/// monitor thread of an executor, this one's or another's (inside a
/// fiber, or by a panic payload's `Drop` on a monitor thread), it does
/// not wait there: waiting could hold the very thread it waits for. The
/// shutdown then runs on a thread of its own, and `drop` returns at once,
/// with the executor already refusing spawns and cancelling its fibers.)
/// Fibers in an
/// interruptible wait on a `spindle-sync` primitive
/// (`acquire_interruptible`, `lock_interruptible`, `pop_interruptible`) are interrupted and
/// unwind at their next cancellation point. Fibers asleep in a plain wait
/// on a primitive are not unwound by the shutdown (their joins fail as
/// cancelled): the primitive's wait list holds them. One signalled
/// later is dropped where the signal comes from: unwound if that is its
/// worker's thread (a thread-local destructor there, say), else its stack
/// is leaked and its destructors never run; one never signalled leaks
/// with the primitive. A [`scope`](Executor::scope) waiting for such a
/// fiber waits until its stack is unwound, which may be never. A fiber
/// asleep in `join` on such a fiber is woken when the shutdown completes
/// the joined task as cancelled, and unwound on its worker; one asleep in
/// `join` on a task of another executor is woken only when that task
/// finishes, and leaked then (its worker is gone).
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
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
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
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
    #[must_use = "SpawnOptions is a builder: pass the returned value to spawn_with"]
    pub fn name(mut self, name: impl Into<Arc<str>>) -> SpawnOptions {
        self.name = Some(name.into());
        self
    }

    /// The fiber's priority. The executor schedules by three classes, not
    /// by every level: high (`Priority::HIGH`, 192, and up), normal, and
    /// low (`Priority::LOW`, 64, and below); a
    /// worker takes work of a higher class first, FIFO within one (while a
    /// job waits for a stack, every other round runs started fibers of any
    /// class before it: they may free one).
    #[must_use = "SpawnOptions is a builder: pass the returned value to spawn_with"]
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
    ///
    /// # Panics
    ///
    /// If a worker or the sysmon thread cannot be started (the system is
    /// out of threads or memory).
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
            if let Err(e) = crate::sysmon::activate(&shared, i) {
                stop_started_workers(&shared);
                panic!(
                    "spindle-executor: could not start worker thread {} of {base} ({e}); ask for \
                     fewer workers (Builder::workers, SPINDLE_WORKERS) or raise the process's limits \
                     on threads and memory (ulimit -u, ulimit -v)",
                    i + 1
                );
            }
        }
        shared.note_workers();
        let s = Arc::clone(&shared);
        let sysmon = match std::thread::Builder::new()
            .name("spindle-sysmon".into())
            .spawn(move || crate::sysmon::run(s, sysmon_parker))
        {
            Ok(sysmon) => sysmon,
            Err(e) => {
                stop_started_workers(&shared);
                panic!(
                    "spindle-executor: could not start the sysmon thread ({e}); raise the process's \
                     limits on threads and memory (ulimit -u, ulimit -v)"
                );
            }
        };
        Executor { handle: Handle { shared }, sysmon: Some(sysmon) }
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
    ///
    /// # Errors
    ///
    /// As [`JoinHandle::join`].
    #[track_caller]
    pub fn block_on<F, T>(&self, f: F) -> Result<T, JoinError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.handle.block_on(f)
    }

    /// Structured concurrency: every fiber spawned on the scope is joined
    /// before `scope` returns, so they may borrow from the caller. See
    /// [`Scope`](crate::Scope). "Joined" means its stack is done: a scoped
    /// fiber asleep on a `spindle-sync` primitive when the executor shuts
    /// down keeps the scope waiting until something signals it (see the
    /// shutdown notes on [`Executor`]). A fiber you drive by hand that waits
    /// in a scope must not be dropped before the scope returns: unwinding a
    /// dropped stack cannot suspend, so its scope blocks the thread until
    /// the scoped fibers finish, and those that started on the same worker
    /// then never run again (the worker hangs).
    ///
    /// # Panics
    ///
    /// If `f` panics (after the scoped fibers are done), or if a scoped
    /// fiber panicked, was cancelled after it started, or never started for
    /// want of a stack (`JoinError::NoStack`), and nobody joined its handle,
    /// as `std::thread::scope` does. (A job cancelled before it started
    /// never ran: that is not reported.) A scope in a fiber that was itself
    /// cancelled, or whose executor is shutting down, unwinds as cancelled
    /// instead, as at a cancellation point.
    #[track_caller]
    pub fn scope<'env, F, R>(&self, f: F) -> R
    where
        F: for<'scope> FnOnce(&'scope crate::Scope<'scope, 'env>) -> R,
    {
        crate::scope::scope(&self.handle, f)
    }

    /// A snapshot of the counters; see [`Handle::stats`] for which of them
    /// are read together.
    pub fn stats(&self) -> ExecutorStats {
        self.handle.stats()
    }
}

impl Handle {
    /// The executor whose worker thread runs the caller: in one of its
    /// fibers, or in user code a worker runs outside them (the drop of a
    /// cancelled job's captures or of an unjoined panic's payload);
    /// `None` elsewhere.
    pub fn current() -> Option<Handle> {
        crate::worker::current_worker().map(|w| Handle { shared: Arc::clone(&w.shared) })
    }

    /// [`Executor::scope`] through a handle, e.g. from inside a fiber:
    ///
    /// ```
    /// # std::thread::spawn(|| { // a watchdog: a hang fails the example
    /// #     std::thread::sleep(std::time::Duration::from_secs(60));
    /// #     eprintln!("watchdog: this example did not finish within 60 s");
    /// #     std::process::exit(1)
    /// # });
    /// use spindle_executor::{Executor, Handle};
    ///
    /// let exec = Executor::builder().workers(2).build();
    /// let total = exec.block_on(|| {
    ///     let parts = [1, 2, 3];
    ///     Handle::current().unwrap().scope(|s| {
    ///         let hs: Vec<_> = parts.iter().map(|p| s.spawn(move || p * 10)).collect();
    ///         hs.into_iter().map(|h| h.join().unwrap()).sum::<i32>()
    ///     })
    /// });
    /// assert_eq!(total.unwrap(), 60);
    /// ```
    ///
    /// # Panics
    ///
    /// As [`Executor::scope`].
    #[track_caller]
    pub fn scope<'env, F, R>(&self, f: F) -> R
    where
        F: for<'scope> FnOnce(&'scope crate::Scope<'scope, 'env>) -> R,
    {
        crate::scope::scope(self, f)
    }

    /// Runs `f` on a fiber and waits for it; see [`Executor::block_on`].
    ///
    /// ```
    /// # std::thread::spawn(|| { // a watchdog: a hang fails the example
    /// #     std::thread::sleep(std::time::Duration::from_secs(60));
    /// #     eprintln!("watchdog: this example did not finish within 60 s");
    /// #     std::process::exit(1)
    /// # });
    /// use spindle_executor::{Executor, Handle};
    ///
    /// let exec = Executor::builder().workers(1).build();
    /// let outer = exec.block_on(|| {
    ///     // Inside a fiber: the executor it runs on.
    ///     let handle = Handle::current().unwrap();
    ///     handle.block_on(|| 20).unwrap() + 1
    /// });
    /// assert_eq!(outer.unwrap(), 21);
    /// ```
    ///
    /// # Errors
    ///
    /// As [`JoinHandle::join`].
    #[track_caller]
    pub fn block_on<F, T>(&self, f: F) -> Result<T, JoinError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.spawn(f).join()
    }

    /// Spawns a fiber running `f`, with no name at [`Priority::NORMAL`].
    ///
    /// Never blocks and never fails: the fiber and its stack are created
    /// when a worker starts it, so spawns beyond the number of stacks the
    /// system can map queue instead of failing. Once the [`Executor`] has
    /// been dropped, a spawn through a handle that outlived it never runs:
    /// its [`join`](JoinHandle::join) fails at once with
    /// [`JoinError::Cancelled`].
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
        // SAFETY: F and T are 'static: nothing borrowed to keep alive.
        let task = unsafe { TaskCell::create(options.name, f, None) };
        self.push(task.clone(), options.priority);
        JoinHandle::from_parts(task, Arc::clone(&self.shared))
    }

    /// Queues a task: onto the caller's own worker if called from one of
    /// this executor's fibers, else round-robin over the workers.
    pub(crate) fn push(&self, task: TaskRef, priority: Priority) {
        let shared = &self.shared;
        shared.stats.spawned.fetch_add(1, Ordering::Relaxed);
        let job = Job { task, priority };
        match crate::worker::current_worker() {
            // From this executor's worker thread (one of its fibers, or
            // user code the worker runs outside them, an unjoined panic's
            // payload or a cancelled job's closure being dropped): the worker is busy running it, so shutdown cannot
            // get past it before the push is done, and the worker drains
            // its own queue. Should that code go on to block the worker, the
            // job can still be stolen, and sysmon adds a worker for it.
            Some(w) if Arc::ptr_eq(&w.shared, shared) => {
                if shared.shutdown.load(Ordering::Acquire) {
                    return cancel_unstarted(shared, job);
                }
                w.push_local(job)
            }
            _ => {
                // Shutdown protocol, spawner side: announce the spawn, then
                // check the flag (both SeqCst, against shutdown's store of
                // the flag and its wait for the count to reach zero). Either
                // shutdown sees the spawn in flight and waits for the push
                // (the workers then drain it), or the spawn sees the flag.
                shared.spawns_in_flight.fetch_add(1, Ordering::SeqCst);
                if shared.shutdown.load(Ordering::SeqCst) {
                    shared.spawns_in_flight.fetch_sub(1, Ordering::SeqCst);
                    return cancel_unstarted(shared, job);
                }
                shared.push_fresh(job);
                shared.spawns_in_flight.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// A snapshot of the counters. Each is read on its own, except the four
    /// that scaling changes (`workers`, `peak_workers`, `scale_ups`,
    /// `scale_downs`), which are read together and agree with each other.
    /// (After shutdown `workers` is 0 and no longer follows from the
    /// scaling counters.)
    pub fn stats(&self) -> ExecutorStats {
        let c = &self.shared.stats;
        let sum = |f: fn(&crate::shared::WorkerCounters) -> &std::sync::atomic::AtomicU64| -> u64 {
            self.shared.workers.iter().map(|w| f(&w.hot.counters).load(Ordering::Relaxed)).sum()
        };
        // Tasks completed outside the workers: unstarted jobs cancelled at
        // shutdown, and fibers woken into a closed inbox (all cancelled).
        let outside = c.completed_outside.load(Ordering::Relaxed)
            + self.shared.workers.iter().map(|w| w.inbox.orphans.load(Ordering::Relaxed)).sum::<u64>();
        // The worker count and the scaling counters change together under
        // the scaling lock (a scale-up, a retirement): read under it, they
        // agree (a pool back at its base size after a peak shows the
        // retirements that brought it there).
        let scaling = self.shared.scaling.lock();
        let (scale_ups, scale_downs, workers, peak_workers) = (
            c.scale_ups.load(Ordering::Relaxed),
            c.scale_downs.load(Ordering::Relaxed),
            self.shared.active.load(Ordering::Relaxed),
            c.peak_workers.load(Ordering::Relaxed),
        );
        drop(scaling);
        ExecutorStats {
            spawned: c.spawned.load(Ordering::Relaxed),
            completed: sum(|w| &w.completed) + outside,
            cancelled: sum(|w| &w.cancelled) + outside,
            steals: sum(|w| &w.steals),
            inbox_handoffs: self
                .shared
                .workers
                .iter()
                .map(|w| w.inbox.handoffs.load(Ordering::Relaxed))
                .sum(),
            parks: sum(|w| &w.parks),
            scale_ups,
            scale_downs,
            workers,
            peak_workers,
            deadlocks: c.deadlocks.load(Ordering::Relaxed),
            stack_waits: c.stack_waits.load(Ordering::Relaxed),
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

/// Spawned while shutting down (e.g. from a destructor): the job never
/// runs, its join fails.
fn cancel_unstarted(shared: &Shared, job: Job) {
    // SAFETY: we hold the only job of this task; it never runs.
    unsafe { job.task.drop_job() };
    let name = job.task.name.clone();
    // Counted before the joiner is woken, as the workers count theirs, so
    // that a joiner reading the stats sees its task counted.
    shared.stats.completed_outside.fetch_add(1, Ordering::Release);
    job.task.complete(Some(JoinError::Cancelled { fiber: None, name }));
}

/// Waits until every started worker is parked with nothing queued and no
/// timer pending, seen twice with no heartbeat in between.
fn wait_quiescent(shared: &Shared) {
    let beats = || -> u64 {
        shared
            .started_workers()
            .iter()
            .map(|w| w.hot.heartbeat.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    };
    // Timers first: a timer being fired is counted until its fiber is in
    // an inbox, so once `is_empty` says none is left, the queues read next
    // hold what it woke.
    let quiet = || {
        shared.timers.is_empty()
            && !shared.pending_work()
            && shared
                .workers
                .iter()
                .filter(|w| w.started.load(Ordering::Acquire))
                .all(|w| w.inbox.parked.load(Ordering::SeqCst))
    };
    let started = std::time::Instant::now();
    let mut warned = false;
    let mut last = None;
    loop {
        shared.timers.fire_all();
        if quiet() {
            let b = beats();
            if last == Some(b) {
                return;
            }
            last = Some(b);
        } else {
            last = None;
        }
        if !warned && started.elapsed() > std::time::Duration::from_secs(5) {
            warn!(
                "spindle-executor: shutdown is waiting for its workers to go idle: a fiber that \
                 never yields keeps its worker busy (so does one that catches the cancellation \
                 unwind with catch_unwind and goes on: let it resume_unwind), and so does a Drop \
                 that blocks on a worker outside any fiber (a cancelled job's capture, an \
                 unjoined panic's payload)"
            );
            warned = true;
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// An executor that could not start all its threads: the workers already
/// started leave (nothing was spawned yet) and are joined, so that the
/// panic that follows leaves no thread behind.
fn stop_started_workers(shared: &Shared) {
    shared.exit.store(true, Ordering::SeqCst);
    shared.wake_all();
    join_workers(shared);
}

/// Joins every worker thread started so far (after `exit` was set).
fn join_workers(shared: &Shared) {
    let threads = std::mem::take(&mut *shared.threads.lock());
    for t in threads {
        let _ = t.join();
    }
}

/// Shuts the executor down (see `Drop for Executor`).
fn shut_down(handle: Handle, sysmon: Option<ThreadHandle<()>>) {
    let shared = &handle.shared;
    // 1. Cancel everything: unstarted jobs are dropped as workers take
    //    them, started fibers unwind at their next executor suspension
    //    point; wake every timer sleeper and every worker. Spawns from
    //    outside that did not see the flag are waited for (their jobs are
    //    then queued, and drained like any other).
    shared.shutdown.store(true, Ordering::SeqCst);
    while shared.spawns_in_flight.load(Ordering::SeqCst) > 0 {
        std::thread::yield_now();
    }
    shared.timers.fire_all();
    shared.interrupt_all_sleeping();
    shared.wake_all();
    // 2. Let the workers run until nothing is left to run: unwinding
    //    one fiber may wake others (joiners, semaphore waiters).
    wait_quiescent(shared);
    // 3. Workers leave and drop what is left, each on its own thread.
    shared.exit.store(true, Ordering::SeqCst);
    shared.wake_all();
    if let Some(s) = sysmon {
        let _ = s.join();
    }
    join_workers(shared);
    // Jobs that never started: drop them and fail their joins.
    for q in shared.global.iter() {
        while let Some(job) = crate::shared::steal_one(q) {
            cancel_unstarted(shared, job);
        }
    }
    if shared.config.stats_at_shutdown {
        warn!("spindle-executor stats: {:?}", handle.stats());
    }
    // Every worker has left: `stats().workers` says so from now on (after
    // the dump above, which shows the workers active at the end).
    {
        let _scaling = shared.scaling.lock();
        shared.active.store(0, Ordering::Release);
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let handle = self.handle.clone();
        let sysmon = self.sysmon.take();
        // On a worker or the sysmon thread of any executor, this one's or
        // another's.
        let on_an_executor_thread =
            crate::worker::current_worker().is_some() || crate::sysmon::is_any_sysmon();
        match on_an_executor_thread {
            // Dropped on one of its own threads: inside one of its fibers,
            // whose worker cannot go quiet until the fiber suspends or
            // ends, or on its sysmon thread (a panic payload whose last
            // reference a stale timer held), which the shutdown joins and
            // which fires the timers it waits for. Or on another
            // executor's: waiting there would hold that worker (or its
            // timers) until this executor is quiet, and this executor's
            // fibers may need it, or, if one of them drops that other
            // executor in turn, each shutdown waits for the other's only
            // worker for good (found in review). The shutdown is left to a
            // thread of its own, and this returns; the flag is set first,
            // so that from now on spawns through a handle are cancelled
            // and the fibers' cancellation points unwind them, as the docs
            // say of a dropped executor.
            true => {
                handle.shared.shutdown.store(true, Ordering::SeqCst);
                let spawned = std::thread::Builder::new()
                    .name("spindle-shutdown".into())
                    .spawn(move || shut_down(handle, sysmon));
                if let Err(e) = spawned {
                    warn!(
                        "spindle-executor: cannot start a thread to shut down the executor dropped \
                         on an executor's worker or monitor thread ({e}); its threads are left running \
                         (spawns are refused and its fibers unwind at their cancellation points, but \
                         nothing drains it)"
                    );
                }
            }
            false => shut_down(handle, sysmon),
        }
    }
}

/// Counters of an executor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecutorStats {
    /// Fibers spawned.
    pub spawned: u64,
    /// Fibers completed (returned, panicked or cancelled), and jobs that
    /// never started for want of a stack ([`JoinError::NoStack`]).
    pub completed: u64,
    /// Of those, cancelled.
    pub cancelled: u64,
    /// Jobs taken from another worker's queue (a steal takes up to half of
    /// it, at most a bounded batch, at once; each job counts, estimated from
    /// the thief's queue length, so steals from the thief meanwhile can make
    /// this a little low).
    pub steals: u64,
    /// Woken fibers handed to their worker's inbox.
    pub inbox_handoffs: u64,
    /// Times a worker parked.
    pub parks: u64,
    /// Times sysmon added workers (each time adds one or more, so this can
    /// be smaller than `scale_downs`).
    pub scale_ups: u64,
    /// Extra workers that retired (one per worker).
    pub scale_downs: u64,
    /// Active workers now (0 once the executor has shut down).
    pub workers: usize,
    /// Most active workers at once.
    pub peak_workers: usize,
    /// Deadlocks detected.
    pub deadlocks: u64,
    /// Times a job could not start because no fiber stack could be mapped
    /// (the kernel's `vm.max_map_count` limit, the address-space limit, or
    /// memory) and went back to its queue, to start once running fibers
    /// have finished. (A job that no stack could ever fit fails its join
    /// with [`JoinError::NoStack`] instead.)
    pub stack_waits: u64,
}

/// Owns the right to join a spawned fiber.
///
/// [`join`](JoinHandle::join) from a fiber puts that fiber to sleep; from a
/// thread it blocks the thread (no busy wait). Dropping the handle detaches
/// the fiber.
pub struct JoinHandle<T> {
    task: TaskRef,
    shared: Arc<Shared>,
    _value: PhantomData<(T, std::cell::Cell<()>)>,
}

impl<T> JoinHandle<T> {
    /// `task` must have been created as a `TaskCell<T, _>`.
    pub(crate) fn from_parts(task: TaskRef, shared: Arc<Shared>) -> JoinHandle<T> {
        JoinHandle { task, shared, _value: PhantomData }
    }
}

/// Dropping the handle detaches the fiber: a value it has already
/// returned is dropped here, one it returns later is dropped on its own
/// fiber as it returns, where a `Drop` of the value that waits (joins
/// another fiber, say) puts that fiber to sleep. A handle dropped by the
/// worker (captured by a job cancelled before it started, or held in a
/// panic's payload) drops a finished value on that worker thread: a wait
/// there blocks the worker. A panic of the value's drop is the dropping
/// code's, as for any value it drops, except on a thread that is already
/// panicking, where it is contained (and reported to a scope).
impl<T> Drop for JoinHandle<T> {
    fn drop(&mut self) {
        // Set already by a `join` that took a finished task's outcome:
        // nothing is left to detach. (Only this handle sets the flag.)
        if self.task.detached.load(Ordering::Relaxed) {
            return;
        }
        self.task.detached.store(true, Ordering::Relaxed);
        // SAFETY: JoinHandle<T> is only made for TaskCell<T, _> tasks.
        let value = unsafe { self.task.result::<T>() }.lock().take();
        if value.is_some() && std::thread::panicking() {
            // A handle dropped while its thread unwinds: a panic of the
            // value's drop would abort the process. Contained instead.
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(value))) {
                // For a scope's report (the task is dropped after this).
                self.task.value_drop_panicked.store(true, Ordering::Relaxed);
                // Not a forced unwind: the thread is panicking.
                let _ = crate::task::drop_payload(payload);
            }
        } else {
            drop(value);
        }
    }
}

impl<T: Send> JoinHandle<T> {
    /// Waits for the fiber and returns its value, or why there is none.
    ///
    /// # Errors
    ///
    /// [`JoinError::Panicked`] if the fiber panicked,
    /// [`JoinError::Cancelled`] if it was cancelled or the executor shut down
    /// before it finished (a join that cannot sleep, in a fiber unwound
    /// because it was dropped or outside any fiber, on a worker thread of
    /// the task's own executor while it shuts down, says so at once for a
    /// task not finished yet, even one that would still finish with a
    /// value: blocking that worker could keep the shutdown from ever
    /// completing the task), [`JoinError::NoStack`] if it never started
    /// because no stack could be mapped for it (and no fiber that could free
    /// one was left), and [`JoinError::Deadlock`] if deadlock detection
    /// (on by default, see the crate docs) found the executor stuck while
    /// this thread waited; a fiber joining is not failed that way, but one
    /// joining its own handle gets [`JoinError::JoinedItself`] at once.
    ///
    /// # Panics
    ///
    /// A cancelled fiber calling `join` on a fiber that has not finished
    /// unwinds (a cancellation point); a finished fiber's outcome is
    /// returned at once.
    #[track_caller]
    pub fn join(self) -> Result<T, JoinError> {
        let task = &self.task;
        if !task.finished.load(Ordering::Acquire) {
            // The task's own fiber (an unfinished task's fiber runs nothing
            // else) would wait for itself: nothing else sees that.
            if let Some(me) = self.waited_on_by_its_own_fiber() {
                // Still a cancellation point, as any join that would wait.
                if spindle_fiber::may_sleep() {
                    crate::ops::check_cancel();
                }
                return Err(JoinError::JoinedItself { fiber: me, name: task.name.clone() });
            }
            // A fiber that may not sleep (its stack is being unwound after
            // it was dropped) waits as a thread does.
            if spindle_fiber::may_sleep() {
                crate::ops::check_cancel();
                task.done.acquire_for(&JOINING);
                crate::ops::check_cancel();
            } else if self.on_its_executors_worker_shutting_down() {
                // A worker of the task's own executor, shutting down, in a
                // fiber it unwinds because it was dropped (or outside any
                // fiber): waiting would block the thread that shutdown needs
                // to complete the task (the one worker, or every worker's
                // drain), for good. Shutdown cancels the task: say so now.
                // (Found by the randomized shutdown stress test: a fiber run
                // by hand, dropped while it slept in a join, was released by
                // that join's wake on its worker, and the join in its
                // destructor blocked the only worker.)
                return Err(JoinError::Cancelled {
                    fiber: spindle_fiber::FiberId::from_u64(task.started_fiber.load(Ordering::Acquire)),
                    name: task.name.clone(),
                });
            } else {
                // A blocked thread: visible to deadlock detection.
                self.shared.blocked_joiners.lock().push(task.clone());
                self.shared.blocked_generation.fetch_add(1, Ordering::AcqRel);
                self.shared.sysmon_unparker.unpark();
                task.done.acquire_for(&JOINING);
                let mut joiners = self.shared.blocked_joiners.lock();
                if let Some(i) = joiners.iter().position(|t| std::ptr::eq(&**t, &**task)) {
                    joiners.swap_remove(i);
                }
            }
        }
        // A finished task's outcome is taken below: nothing is left for
        // the drop to detach, which the flag tells it (the fiber has looked
        // at it already, before the task finished). A join failed by
        // deadlock detection returns before the task finished: the drop
        // detaches it.
        if task.finished.load(Ordering::Acquire) {
            task.detached.store(true, Ordering::Relaxed);
        }
        // SAFETY: JoinHandle<T> is only made for TaskCell<T, _> tasks.
        if let Some(v) = unsafe { task.result::<T>() }.lock().take() {
            return Ok(v);
        }
        Err(task.error.lock().take().map_or_else(
            || JoinError::Deadlock {
                report: "the fiber completed without a value or an error (a bug in spindle-executor: please \
                         report it)"
                    .into(),
            },
            |e| *e,
        ))
    }

    /// Asks the fiber to stop: a job not started yet never runs (its
    /// closure is dropped); a started fiber unwinds (destructors run) at its
    /// next executor suspension point (`yield_now`, `sleep`, `sleep_until`,
    /// `yield_timeout`, `interrupt_after`, `interrupt_at`, `join`, `wait_timeout`,
    /// `wait_until`, or `yield_if_needed` when
    /// it yields), and
    /// [`join`](JoinHandle::join) then returns [`JoinError::Cancelled`]. A
    /// fiber asleep in `sleep`, `sleep_until` or `yield_timeout` is woken at once. One
    /// blocked in `join` on another fiber waits until that fiber completes,
    /// then unwinds in `join` (the joined fiber's value is dropped). One
    /// in an interruptible wait on a `spindle-sync` primitive
    /// (`Semaphore::acquire_interruptible`, `Mutex::lock_interruptible`,
    /// `Channel::pop_interruptible`) is
    /// interrupted: the wait returns `Err(Interrupted)` at once (or, if the
    /// fiber is not waiting yet, its next interruptible wait does), and the
    /// fiber unwinds at its next executor suspension point. One asleep in a
    /// plain wait (`acquire`, `pop`: not a cancellation point) first gets
    /// what it waits for: a fiber in a plain `pop` on a channel nobody
    /// pushes to is not stopped by a cancel. A loop that retries an
    /// interruptible wait after `Interrupted` must reach a cancellation
    /// point (`yield_now`, or [`interrupt_after`](crate::interrupt_after) or
    /// [`interrupt_at`](crate::interrupt_at), which are ones), or it spins once cancelled: every wait it makes then
    /// returns at once.
    ///
    /// A request, not a guarantee: a fiber that has already finished, or
    /// finishes without reaching a suspension point, keeps its result, and
    /// a fiber that catches the unwind (`catch_unwind`) may go on and
    /// return a value.
    pub fn cancel(&self) {
        // SeqCst: the worker that puts the fiber to sleep inserts it into
        // its sleeping map, then loads the flag (see `interrupt_sleeping`).
        self.task.cancelled.store(true, Ordering::SeqCst);
        self.wake();
        // SeqCst: against the worker's store of `started_fiber` then load of
        // `cancelled` (store buffering: one of the two loads sees the
        // other's store).
        if let Some(id) = FiberId::from_u64(self.task.started_fiber.load(Ordering::SeqCst)) {
            self.shared.interrupt_sleeping(id, self.task.as_raw(), true);
        }
    }

    /// Ends a [`sleep`](crate::sleep), [`sleep_until`](crate::sleep_until)
    /// or [`yield_timeout`](crate::yield_timeout) of the fiber early
    /// (Tarantool's `fiber_wakeup`). No effect otherwise.
    pub fn wake(&self) {
        let waiter = self.task.sleep.lock().waiter.take();
        if let Some(w) = waiter {
            w.wake();
        }
    }

    /// Waits at most `timeout` for the fiber to complete; whether it has.
    /// Its outcome stays in the handle: [`join`](JoinHandle::join) then
    /// returns it at once. Unlike `join`, a wait that times out leaves the
    /// task running and the handle usable (wait again, or
    /// [`cancel`](JoinHandle::cancel) it).
    ///
    /// On a thread it is a timed wait; in a fiber of an executor, an
    /// interruptible wait under [`interrupt_after`](crate::interrupt_after)
    /// (so another interrupt of the fiber ends it early too, and it is a
    /// cancellation point). A fiber waiting for its own task gets `false`
    /// at once, and so does a wait that cannot sleep (in a fiber unwound
    /// because it was dropped, or outside any fiber) on a worker of the
    /// task's own executor while it shuts down, as `join` does there.
    /// Deadlock detection does not count a thread waiting here: its wait
    /// ends by itself.
    ///
    /// ```
    /// # std::thread::spawn(|| { // a watchdog: a hang fails the example
    /// #     std::thread::sleep(std::time::Duration::from_secs(60));
    /// #     eprintln!("watchdog: this example did not finish within 60 s");
    /// #     std::process::exit(1)
    /// # });
    /// use std::time::Duration;
    /// use spindle_executor::sync::Semaphore;
    /// use spindle_executor::Executor;
    /// use std::sync::Arc;
    ///
    /// let exec = Executor::builder().workers(1).build();
    /// let gate = Arc::new(Semaphore::new(0));
    /// let g = gate.clone();
    /// let task = exec.spawn(move || {
    ///     g.acquire();
    ///     7
    /// });
    /// assert!(!task.wait_timeout(Duration::from_millis(10)), "still waiting at its gate");
    /// gate.release(1);
    /// assert!(task.wait_timeout(Duration::from_secs(30)));
    /// assert_eq!(task.join().unwrap(), 7);
    /// ```
    ///
    /// # Panics
    ///
    /// In a fiber that is not an executor's (a fiber driven by hand or by
    /// a run queue: [`interrupt_after`](crate::interrupt_after) has no
    /// clock there). A cancelled fiber unwinds here unless the task has
    /// finished already (a cancellation point).
    #[track_caller]
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> bool {
        self.wait_for(Deadline::After(timeout))
    }

    /// Waits for the task until `deadline`: [`wait_timeout`](JoinHandle::wait_timeout)
    /// with an instant instead of a duration. Whether the task has
    /// finished. With a deadline already past, a thread only looks; a
    /// fiber's wait ends at sysmon's next tick (as `interrupt_at` does).
    ///
    /// ```
    /// # std::thread::spawn(|| { // a watchdog: a hang fails the example
    /// #     std::thread::sleep(std::time::Duration::from_secs(60));
    /// #     eprintln!("watchdog: this example did not finish within 60 s");
    /// #     std::process::exit(1)
    /// # });
    /// use std::time::{Duration, Instant};
    /// use spindle_executor::sync::Semaphore;
    /// use spindle_executor::Executor;
    /// use std::sync::Arc;
    ///
    /// let exec = Executor::builder().workers(1).build();
    /// let gate = Arc::new(Semaphore::new(0));
    /// let g = gate.clone();
    /// let task = exec.spawn(move || g.acquire());
    /// assert!(!task.wait_until(Instant::now() + Duration::from_millis(10)));
    /// gate.release(1);
    /// assert!(task.wait_until(Instant::now() + Duration::from_secs(30)));
    /// ```
    ///
    /// # Panics
    ///
    /// Where [`wait_timeout`](JoinHandle::wait_timeout) does; a cancellation
    /// point as it is.
    #[track_caller]
    pub fn wait_until(&self, deadline: std::time::Instant) -> bool {
        self.wait_for(Deadline::At(deadline))
    }

    /// `wait_timeout` and `wait_until`.
    #[track_caller]
    fn wait_for(&self, deadline: Deadline) -> bool {
        let task = &self.task;
        if task.finished.load(Ordering::Acquire) {
            return true;
        }
        if self.waited_on_by_its_own_fiber().is_some() {
            return false;
        }
        // The done token (taken once the task completes) is left taken:
        // `finished` is set before it is released, and `join` looks at that
        // first.
        if spindle_fiber::may_sleep() {
            if crate::ops::current_task().is_none() {
                let what = match deadline {
                    Deadline::After(_) => "wait_timeout",
                    Deadline::At(_) => "wait_until",
                };
                panic!(
                    "spindle_executor: JoinHandle::{what} called in a fiber that is not an \
                     executor's (driven by hand or by a run queue): nothing there keeps the time \
                     for its deadline; poll is_finished, or wait on a thread"
                );
            }
            let wait = || task.done.acquire_interruptible_for(&WAITING_FOR_TASK);
            let _ = match deadline {
                Deadline::After(timeout) => crate::interrupt_after(timeout, wait),
                Deadline::At(at) => crate::interrupt_at(at, wait),
            };
            // A cancel interrupts the wait: unwind now, as `join` does.
            crate::ops::check_cancel();
        } else if self.on_its_executors_worker_shutting_down() {
            // As in `join`: a worker of the task's own executor, shutting
            // down, in a fiber it unwinds because it was dropped (or
            // outside any fiber). Waiting would hold the thread the
            // shutdown needs to complete the task, for the whole timeout
            // (for good with a long one: found in review).
            return task.finished.load(Ordering::Acquire);
        } else {
            let _ = match deadline {
                Deadline::After(timeout) => task.done.acquire_timeout(timeout),
                Deadline::At(at) => task.done.acquire_until(at),
            };
        }
        task.finished.load(Ordering::Acquire)
    }

    /// The calling fiber, if it is the task's own (an unfinished task's
    /// fiber runs nothing else): waiting for the task there would wait for
    /// itself, which nothing else sees.
    fn waited_on_by_its_own_fiber(&self) -> Option<FiberId> {
        spindle_fiber::current_id()
            .filter(|me| me.as_u64() == self.task.started_fiber.load(Ordering::Acquire))
    }

    /// Whether the caller runs on a worker of the task's own executor while
    /// it shuts down: a wait there that cannot sleep would hold the thread
    /// the shutdown needs to complete the task.
    fn on_its_executors_worker_shutting_down(&self) -> bool {
        crate::worker::current_worker().is_some_and(|w| {
            Arc::ptr_eq(&w.shared, &self.shared) && w.shared.shutdown.load(Ordering::Acquire)
        })
    }

    /// Whether the fiber has completed.
    pub fn is_finished(&self) -> bool {
        self.task.finished.load(Ordering::Acquire)
    }

    /// The id of the fiber running the task, once it has started. The
    /// executor reuses fibers, so tasks that ran one after another may
    /// report the same id (and panic reports name the same fiber); name a
    /// task ([`SpawnOptions::name`]) to tell tasks apart.
    pub fn fiber_id(&self) -> Option<FiberId> {
        FiberId::from_u64(self.task.started_fiber.load(Ordering::Acquire))
    }
}

/// The end of a `JoinHandle` wait: a duration from now or an instant.
#[derive(Clone, Copy)]
enum Deadline {
    After(std::time::Duration),
    At(std::time::Instant),
}

impl<T> fmt::Debug for JoinHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinHandle")
            .field("name", &self.task.name)
            .field("fiber", &FiberId::from_u64(self.task.started_fiber.load(Ordering::Relaxed)))
            .field("finished", &self.task.finished.load(Ordering::Relaxed))
            .finish()
    }
}
