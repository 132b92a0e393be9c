//! Executor configuration and its builder.

use std::time::Duration;

/// Resolved settings.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) base_workers: usize,
    pub(crate) max_workers: usize,
    pub(crate) stack_size: usize,
    pub(crate) sysmon_interval: Duration,
    pub(crate) stuck_threshold: Duration,
    pub(crate) time_slice: Duration,
    pub(crate) idle_retire: Duration,
    pub(crate) on_deadlock: OnDeadlock,
    pub(crate) deadlock_grace: Duration,
    pub(crate) stats_at_shutdown: bool,
}

/// The most workers an executor runs (base or scaled up). An executor
/// allocates a slot for each of its [`Builder::max_workers`] up front
/// (about 11 KiB each), and more threads than this would only contend.
pub const MAX_WORKERS: usize = 1024;

/// What deadlock detection does when it finds one (`Ignore`: detection is
/// off).
///
/// Detection sees the executor only. A fiber asleep on a primitive that a
/// thread outside the executor will signal (a plain thread feeding a
/// channel, say, or a fiber of another executor, which counts as outside
/// too, even when it is only sleeping on a timer) looks deadlocked once
/// that thread has been quiet for the grace period
/// ([`Builder::deadlock_grace`]). Programs whose fibers wait for such
/// outside threads use [`Report`](OnDeadlock::Report) or
/// [`Ignore`](OnDeadlock::Ignore), or a longer grace period.
///
/// A thread waiting in [`Executor::scope`](crate::Executor::scope) for
/// fibers that can never finish is detected and reported too, but under
/// `FailJoin` it cannot be failed: its fibers may borrow from its frame, so
/// it keeps waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnDeadlock {
    /// Fail the joins that threads are blocked in with
    /// [`JoinError::Deadlock`](crate::JoinError::Deadlock), and print the
    /// report. (A fiber blocked in `join` is part of the deadlock and stays
    /// asleep; the threads waiting on the executor are what fail.)
    FailJoin,
    /// Abort the process.
    Abort,
    /// Only print the report (once per episode); the joins keep waiting.
    Report,
    /// Do nothing.
    Ignore,
}

/// Builds an [`Executor`](crate::Executor).
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// use std::time::Duration;
/// use spindle_executor::Executor;
///
/// let exec = Executor::builder()
///     .workers(2)
///     .max_workers(4)
///     .time_slice(Duration::from_millis(5))
///     .build();
/// assert_eq!(exec.block_on(|| 6 * 7).unwrap(), 42);
/// ```
#[derive(Debug, Clone)]
pub struct Builder {
    workers: Option<usize>,
    max_workers: Option<usize>,
    stack_size: usize,
    sysmon_interval: Duration,
    stuck_threshold: Duration,
    time_slice: Duration,
    idle_retire: Duration,
    on_deadlock: OnDeadlock,
    deadlock_grace: Duration,
}

impl Default for Builder {
    fn default() -> Builder {
        Builder {
            workers: None,
            max_workers: None,
            stack_size: spindle_fiber::DEFAULT_STACK_SIZE,
            sysmon_interval: Duration::from_micros(250),
            stuck_threshold: Duration::from_micros(250),
            time_slice: Duration::from_millis(10),
            idle_retire: Duration::from_millis(100),
            on_deadlock: OnDeadlock::FailJoin,
            deadlock_grace: Duration::from_secs(1),
        }
    }
}

impl Builder {
    /// Initial (base) number of workers. Default: `SPINDLE_WORKERS` if set
    /// and not empty (a value that is not a number of workers up to
    /// [`MAX_WORKERS`] is reported on stderr once per process and ignored),
    /// else the number of available cores. 0 counts as 1.
    ///
    /// # Panics
    ///
    /// If `n` is more than [`MAX_WORKERS`].
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn workers(mut self, n: usize) -> Builder {
        assert!(n <= MAX_WORKERS, "spindle-executor: Builder::workers({n}): at most {MAX_WORKERS} workers");
        self.workers = Some(n.max(1));
        self
    }

    /// Most workers auto-scaling may add up to. Default: twice the cores.
    /// A value below the base count (see [`workers`](Builder::workers)) is
    /// raised to it, which turns auto-scaling off; 0 counts as 1.
    ///
    /// # Panics
    ///
    /// If `n` is more than [`MAX_WORKERS`].
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn max_workers(mut self, n: usize) -> Builder {
        assert!(
            n <= MAX_WORKERS,
            "spindle-executor: Builder::max_workers({n}): at most {MAX_WORKERS} workers"
        );
        self.max_workers = Some(n.max(1));
        self
    }

    /// Usable stack size of spawned fibers (default 128 KiB). Executor
    /// fibers unwind on a panic and on cancellation, which needs about
    /// 8 KiB of stack (32 KiB with `RUST_BACKTRACE` set): smaller stacks
    /// risk a stack-overflow abort then.
    ///
    /// # Panics
    ///
    /// If `bytes` is outside
    /// [`MIN_STACK_SIZE`](spindle_fiber::MIN_STACK_SIZE)`..=`[`MAX_STACK_SIZE`](spindle_fiber::MAX_STACK_SIZE):
    /// no fiber could be created, and every job's join would fail with
    /// [`JoinError::NoStack`](crate::JoinError::NoStack).
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn stack_size(mut self, bytes: usize) -> Builder {
        assert!(
            (spindle_fiber::MIN_STACK_SIZE..=spindle_fiber::MAX_STACK_SIZE).contains(&bytes),
            "spindle-executor: a fiber stack size of {bytes} bytes cannot be mapped: use {} to {} bytes \
             (the default is 128 KiB)",
            spindle_fiber::MIN_STACK_SIZE,
            spindle_fiber::MAX_STACK_SIZE
        );
        self.stack_size = bytes;
        self
    }

    /// How often sysmon looks at the workers (default 250 µs). While a
    /// worker runs, or a deadlock is being confirmed, sysmon never naps for
    /// less than this between its regular looks (a timer deadline or a wake
    /// can end a nap sooner; with every worker parked it looks every 10 ms,
    /// whatever this is), so nothing it watches is acted on faster: a
    /// deadlock is confirmed after the larger of this and
    /// [`deadlock_grace`](Builder::deadlock_grace), and a time slice
    /// shorter than two intervals is flagged up to an interval late. Timers
    /// do not wait for a look: sysmon wakes for the earliest deadline.
    /// (Raise it to spend less on sysmon while workers run; at 30 s, a
    /// deadlocked join is failed after 30 s or more, and `yield_if_needed`
    /// yields every 30 s or so.)
    ///
    /// # Panics
    ///
    /// If `d` is zero (sysmon would spin).
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn sysmon_interval(mut self, d: Duration) -> Builder {
        assert!(
            !d.is_zero(),
            "spindle-executor: the sysmon interval must be above zero (the default is 250 µs)"
        );
        self.sysmon_interval = d;
        self
    }

    /// How long a worker may go without a heartbeat while work is pending
    /// before sysmon adds workers (default 250 µs).
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn stuck_threshold(mut self, d: Duration) -> Builder {
        self.stuck_threshold = d;
        self
    }

    /// How long a fiber may run before `yield_if_needed` yields (default 10 ms).
    /// Sysmon checks every half slice while it watches slices (but at
    /// least every 10 ms, and every 5 ms while the pool can still grow),
    /// so the flag comes between one and one and a half slices after the
    /// fiber's worker last switched; sysmon never looks more often than
    /// [`sysmon_interval`](Builder::sysmon_interval), so a slice shorter
    /// than two intervals is flagged up to an interval after it ends. A
    /// long slice does not slow stuck detection or deadlock detection.
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn time_slice(mut self, d: Duration) -> Builder {
        self.time_slice = d;
        self
    }

    /// How long an extra worker stays idle before it retires (default
    /// 100 ms). Extra workers retire from the highest down, each once it
    /// has been idle this long.
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn idle_retire(mut self, d: Duration) -> Builder {
        self.idle_retire = d;
        self
    }

    /// What deadlock detection does (default: fail the join).
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn on_deadlock(mut self, action: OnDeadlock) -> Builder {
        self.on_deadlock = action;
        self
    }

    /// How long the executor must look deadlocked (a thread blocked in a
    /// join or waiting in a scope, every worker parked, nothing queued, no timer pending, no
    /// heartbeat) before it is reported (default 1 s). See [`OnDeadlock`]
    /// for what detection cannot see.
    #[must_use = "Builder is a builder: call build() on the returned value"]
    pub fn deadlock_grace(mut self, d: Duration) -> Builder {
        self.deadlock_grace = d;
        self
    }

    /// Starts the executor.
    ///
    /// # Panics
    ///
    /// If a worker or the sysmon thread cannot be started (the system is
    /// out of threads or memory). The threads started before are stopped
    /// and joined first, so none is left behind.
    pub fn build(self) -> crate::Executor {
        crate::Executor::start(self.resolve())
    }

    fn resolve(self) -> Config {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Read only when the builder did not say: a value it overrides is
        // not reported.
        let env_workers = || {
            // Set but empty counts as unset; a bad value is reported once
            // per process, not for every executor built.
            std::env::var("SPINDLE_WORKERS").ok().filter(|v| !v.trim().is_empty()).and_then(|v| {
                match v.trim().parse::<usize>() {
                    Ok(n) if n <= MAX_WORKERS => Some(n),
                    _ => {
                        static WARNED: std::sync::Once = std::sync::Once::new();
                        WARNED.call_once(|| {
                            warn!(
                                "spindle-executor: SPINDLE_WORKERS={v:?} is not a number of workers up \
                                 to {MAX_WORKERS}; using the default, one per available core"
                            )
                        });
                        None
                    }
                }
            })
        };
        let base = self.workers.or_else(env_workers).unwrap_or(cores).clamp(1, MAX_WORKERS);
        let max = self.max_workers.unwrap_or(2 * cores).clamp(base, MAX_WORKERS);
        Config {
            base_workers: base,
            max_workers: max,
            stack_size: self.stack_size,
            sysmon_interval: self.sysmon_interval,
            stuck_threshold: self.stuck_threshold,
            time_slice: self.time_slice,
            idle_retire: self.idle_retire,
            on_deadlock: self.on_deadlock,
            deadlock_grace: self.deadlock_grace,
            stats_at_shutdown: std::env::var("SPINDLE_STATS").is_ok_and(|v| v == "1"),
        }
    }
}
