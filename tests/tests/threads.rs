//! Fibers and threads together: threads waking fibers and waiting on
//! fibers, mixed waiters on one semaphore, pinned fibers refusing other
//! threads, and a multi-threaded stress run of K worker threads over one
//! run queue with semaphore ping-pong and channel producers/consumers.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::{
    fiber, sleepers_on, spin_until, watchdog, watchdog_with_progress, watchdog_with_status, Stage, XorShift,
};
use spindle_fiber::{yield_now, Fiber, FiberAttr, FiberError, FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, Semaphore};

/// How long an idle worker parks before it looks at the `done` flag again.
/// Not a synchronisation delay: work wakes a parked worker at once.
const IDLE_PARK: Duration = Duration::from_millis(20);

/// A plain thread releases a semaphore on which fibers sleep: each release
/// wakes the oldest sleeper onto its run queue, where the test thread (a
/// worker parked in `pop_timeout`) picks it up.
#[test]
fn a_thread_releases_a_semaphore_that_wakes_fibers() {
    const N: usize = 32;
    watchdog("a_thread_releases_a_semaphore_that_wakes_fibers", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        stage.set("putting the fibers to sleep");
        let queue = sleepers_on(&sem, N);

        let s = sem.clone();
        let releaser = thread::spawn(move || {
            // Ones and twos: release(n) hands n tokens to n waiters.
            let mut left = N;
            while left > 0 {
                let n = (1 + left % 2).min(left);
                s.release(n);
                left -= n;
            }
        });
        stage.set("running fibers as the releasing thread wakes them");
        let mut returned = Vec::with_capacity(N);
        while returned.len() < N {
            let f = queue
                .pop_timeout(Duration::from_secs(600))
                .expect("a woken fiber arrives before the timeout");
            returned.push(queue.run_popped(f).outcome.unwrap().unwrap_returned());
        }
        releaser.join().unwrap();
        assert_eq!(returned, (0..N).collect::<Vec<_>>(), "woken in the order they slept");
        assert_eq!((sem.waiters(), sem.available()), (0, 0));
        assert_eq!(queue.stats().wakes, N as u64);
    });
}

/// A plain thread waits (parks) on a semaphore that a fiber releases.
#[test]
fn a_thread_waits_on_a_semaphore_released_by_a_fiber() {
    const ROUNDS: usize = 200;
    watchdog("a_thread_waits_on_a_semaphore_released_by_a_fiber", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let waiter = thread::spawn(move || {
            for _ in 0..ROUNDS {
                s.acquire();
            }
            ROUNDS
        });
        stage.set("waiting for the thread to wait on the semaphore");
        spin_until(|| sem.waiters() == 1);

        // The fiber releases one token each time the thread waits again,
        // yielding (back to the test thread's run loop) in between.
        let queue = RunQueue::<usize>::new(1);
        let s = sem.clone();
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                for _ in 0..ROUNDS {
                    while s.waiters() == 0 {
                        yield_now();
                    }
                    s.release(1);
                }
                ROUNDS
            }))
            .unwrap();
        stage.set("running the releasing fiber");
        let mut returned = None;
        while let Some(ran) = queue.run_next() {
            if let Ok(RunOutcome::Returned(n)) = ran.outcome {
                returned = Some(n);
            }
        }
        assert_eq!(returned, Some(ROUNDS));
        stage.set("joining the waiting thread");
        assert_eq!(waiter.join().unwrap(), ROUNDS);
        assert_eq!((sem.waiters(), sem.available()), (0, 0));
    });
}

/// A thread releases the moment a fiber has linked itself into the wait
/// list, often before the fiber's stack has switched out: every such early
/// wake is delivered (the fiber is queued once, never lost, never twice).
#[test]
fn a_wake_racing_the_sleep_is_never_lost() {
    // Debug builds are unoptimised: fewer rounds keep the test short.
    const ROUNDS: u64 = if cfg!(debug_assertions) { 100_000 } else { 200_000 };
    // Every round needs both threads scheduled (each yields while it
    // waits for the other): on a busy machine the rounds take milliseconds
    // each, and the whole run minutes. A lost wakeup stops the rounds for
    // good: the watchdog fails the test only if no release happens in 60 s.
    let released = Arc::new(AtomicU64::new(0));
    let (status_released, progress_released) = (Arc::clone(&released), Arc::clone(&released));
    let status = move || format!("{} of {ROUNDS} releases", status_released.load(Ordering::Relaxed));
    let progress = move || progress_released.load(Ordering::Relaxed);
    watchdog_with_progress("a_wake_racing_the_sleep_is_never_lost", 60, status, progress, move |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::<u64>::new(1);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            for _ in 0..ROUNDS {
                s.acquire();
            }
            ROUNDS
        });
        queue.try_push(f.clone()).unwrap();
        let s = sem.clone();
        let releaser = thread::spawn(move || {
            for _ in 0..ROUNDS {
                spin_until(|| s.waiters() == 1);
                s.release(1);
                released.fetch_add(1, Ordering::Relaxed);
            }
        });
        stage.set("running the fiber while another thread wakes it as early as it can");
        let returned = loop {
            let f = queue.pop_timeout(Duration::from_secs(600)).expect("the fiber is woken");
            match queue.run_popped(f).outcome {
                Ok(RunOutcome::Slept) => {}
                Ok(RunOutcome::Returned(n)) => break n,
                other => panic!("unexpected outcome {other:?}"),
            }
        };
        releaser.join().unwrap();
        assert_eq!(returned, ROUNDS);
        assert_eq!(f.stats().sleeps, ROUNDS, "every acquire had to wait");
        let stats = queue.stats();
        assert_eq!(stats.wakes, ROUNDS, "one wake per sleep: {stats:?}");
        assert_eq!(stats.pops, ROUNDS + 1);
        assert!(queue.is_empty());
        assert_eq!((sem.waiters(), sem.available()), (0, 0));
    });
}

/// Several threads wait on one semaphore (any count, not just one); one
/// `release(n)` from a fiber wakes them all.
#[test]
fn several_waiting_threads_are_woken_by_one_release() {
    const THREADS: usize = 4;
    watchdog("several_waiting_threads_are_woken_by_one_release", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                let s = sem.clone();
                thread::spawn(move || s.acquire())
            })
            .collect();
        stage.set("waiting for all threads to wait");
        spin_until(|| sem.waiters() == THREADS);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || s.release(THREADS + 1));
        f.run().unwrap().unwrap_returned();
        stage.set("joining the woken threads");
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!((sem.waiters(), sem.available()), (0, 1));
    });
}

/// Fibers and threads waiting on one semaphore are woken in one FIFO
/// order, whichever kind they are.
#[test]
fn mixed_fiber_and_thread_waiters_are_woken_in_fifo_order() {
    const PATTERN: &str = "TFFTFTTFFT";
    watchdog("mixed_fiber_and_thread_waiters_are_woken_in_fifo_order", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let log = Arc::new(Mutex::new(Vec::new()));
        let queue = RunQueue::<()>::new(PATTERN.len());
        let mut threads = Vec::new();
        for (k, kind) in PATTERN.chars().enumerate() {
            let (s, l) = (sem.clone(), log.clone());
            if kind == 'T' {
                threads.push(thread::spawn(move || {
                    s.acquire();
                    l.lock().unwrap().push(k);
                }));
            } else {
                queue
                    .try_push(fiber(Priority::NORMAL, move || {
                        s.acquire();
                        l.lock().unwrap().push(k);
                    }))
                    .unwrap();
                assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
            }
            stage.set(format!("waiting for waiter {k} ({kind}) to join the wait list"));
            spin_until(|| sem.waiters() == k + 1);
        }
        for (k, kind) in PATTERN.chars().enumerate() {
            stage.set(format!("release {k}: expecting waiter {k} ({kind}) to be woken"));
            sem.release(1);
            if kind == 'F' {
                assert_eq!(queue.len(), 1, "release {k} should have woken a fiber");
                queue.run_next().unwrap().outcome.unwrap().unwrap_returned();
            } else {
                spin_until(|| log.lock().unwrap().len() == k + 1);
                assert!(queue.is_empty(), "release {k} should have woken a thread, not a fiber");
            }
            assert_eq!(log.lock().unwrap().len(), k + 1);
        }
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*log.lock().unwrap(), (0..PATTERN.len()).collect::<Vec<_>>());
        assert_eq!((sem.waiters(), sem.available()), (0, 0));
    });
}

/// Many fibers (on two worker threads) and many threads acquire from one
/// semaphore while the test thread releases the exact total in random
/// chunks: every waiter gets every token it waits for, none is lost.
#[test]
fn mixed_fiber_and_thread_waiters_under_load_lose_no_wakeup() {
    const THREADS: usize = 4;
    const FIBERS: usize = 16;
    const WORKERS: usize = 2;
    // Debug builds are unoptimised: fewer rounds keep the test short.
    const ROUNDS: usize = if cfg!(debug_assertions) { 2_000 } else { 20_000 };
    let acquired = Arc::new(AtomicUsize::new(0));
    let a = acquired.clone();
    watchdog_with_status(
        "mixed_fiber_and_thread_waiters_under_load_lose_no_wakeup",
        120,
        move || format!("{} of {} acquisitions done", a.load(Ordering::Relaxed), (THREADS + FIBERS) * ROUNDS),
        move |stage| {
            let sem = Arc::new(Semaphore::new(0));
            let queue = RunQueue::<()>::new(FIBERS);
            for _ in 0..FIBERS {
                let (s, acq) = (sem.clone(), acquired.clone());
                let f = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
                // SAFETY: the function holds only Arcs (Send) across its
                // suspension points and touches no thread-local.
                unsafe {
                    f.set_function_migratable(Priority::NORMAL, move || {
                        for r in 0..ROUNDS {
                            s.acquire();
                            acq.fetch_add(1, Ordering::Relaxed);
                            if r % 16 == 15 {
                                yield_now();
                            }
                        }
                    })
                }
                .unwrap();
                queue.try_push(f).unwrap();
            }
            let threads: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (s, acq) = (sem.clone(), acquired.clone());
                    thread::spawn(move || {
                        for _ in 0..ROUNDS {
                            s.acquire();
                            acq.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            let pool = WorkerPool::start(&queue, WORKERS, FIBERS, &stage);

            stage.set("releasing tokens in random chunks");
            let total = (THREADS + FIBERS) * ROUNDS;
            let mut rng = XorShift::new(0xface);
            let mut released = 0;
            while released < total {
                let n = (1 + rng.below(8) as usize).min(total - released);
                sem.release(n);
                released += n;
                if rng.below(4) == 0 {
                    thread::yield_now();
                }
            }
            stage.set("joining the waiting threads");
            for t in threads {
                t.join().unwrap();
            }
            pool.join(&stage);
            assert_eq!(acquired.load(Ordering::Relaxed), total);
            assert_eq!((sem.waiters(), sem.available()), (0, 0), "every token taken, nobody waiting");
            assert!(queue.is_empty());
        },
    );
}

/// A fiber set with the safe `set_function` is pinned: after a wake, a
/// thread that is handed it anyway gets `WrongThread`, the fiber goes back
/// into the queue for its thread (no other thread's pop gets it), and its
/// own thread runs it.
#[test]
fn a_pinned_fiber_refuses_to_run_on_another_thread() {
    watchdog("a_pinned_fiber_refuses_to_run_on_another_thread", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::<&'static str>::new(1);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            s.acquire();
            "home again"
        });
        queue.try_push(f.clone()).unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        sem.release(1);
        assert_eq!(queue.len(), 1);

        stage.set("another thread is not handed the pinned fiber, and refuses to run it");
        let popped = queue.try_pop().expect("its own thread is handed it");
        let q = queue.clone();
        // Handed to another thread anyway (popped here, run there).
        let (back, error, foreign_pop) = thread::spawn(move || {
            let ran = q.run_popped(popped);
            (ran.fiber, ran.outcome.err(), q.try_pop().is_some())
        })
        .join()
        .unwrap();
        assert!(!foreign_pop, "a pop on another thread does not hand it out");
        match error {
            Some(FiberError::WrongThread(id)) => assert_eq!(id, f.id()),
            other => panic!("running a pinned fiber elsewhere gave {other:?}"),
        }
        assert!(Fiber::ptr_eq(&back, &f));
        assert_eq!(f.state(), FiberState::Queued, "the refused fiber went back into the queue");
        // Counted twice: the refused run sent it back into its level, and
        // the foreign pop that then met it set it aside.
        assert_eq!((queue.len(), queue.stats().wrong_thread), (1, 2));
        let ran = queue.run_next().expect("its own thread pops it");
        assert_eq!(ran.outcome.unwrap().unwrap_returned(), "home again");
        assert_eq!(f.stats().migrations, 0);
    });
}

/// K worker threads over one run queue, each looping `pop_timeout` +
/// `run_popped` until the last fiber finished.
struct WorkerPool {
    done: Arc<AtomicBool>,
    workers: Vec<thread::JoinHandle<()>>,
    finished: Arc<AtomicUsize>,
    failures: Arc<Mutex<Vec<String>>>,
}

/// Sets `done` if a worker unwinds, so its peers stop too.
struct StopOnPanic(Arc<AtomicBool>);

impl Drop for StopOnPanic {
    fn drop(&mut self) {
        if thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

impl WorkerPool {
    /// Starts `k` workers that stop once `fibers` fibers have returned (or a
    /// fiber panicked, or `run` failed).
    fn start(queue: &RunQueue<()>, k: usize, fibers: usize, stage: &Stage) -> WorkerPool {
        let done = Arc::new(AtomicBool::new(false));
        let finished = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let workers = (0..k)
            .map(|w| {
                let (queue, done, finished, failures) =
                    (queue.clone(), done.clone(), finished.clone(), failures.clone());
                thread::Builder::new()
                    .name(format!("worker {w}"))
                    .spawn(move || {
                        let _stop = StopOnPanic(done.clone());
                        while !done.load(Ordering::Acquire) {
                            let Some(f) = queue.pop_timeout(IDLE_PARK) else {
                                continue;
                            };
                            let ran = queue.run_popped(f);
                            let failure = match ran.outcome {
                                Ok(RunOutcome::Yielded(_) | RunOutcome::Slept) => None,
                                Ok(RunOutcome::Returned(())) => {
                                    if finished.fetch_add(1, Ordering::AcqRel) + 1 == fibers {
                                        done.store(true, Ordering::Release);
                                    }
                                    None
                                }
                                Ok(RunOutcome::Panicked(p)) => Some(format!(
                                    "fiber {} panicked: {}",
                                    p.fiber,
                                    p.message().unwrap_or("(no message)")
                                )),
                                Err(e) => Some(format!("worker {w}: run failed: {e}")),
                            };
                            if let Some(failure) = failure {
                                failures.lock().unwrap().push(failure);
                                done.store(true, Ordering::Release);
                            }
                        }
                    })
                    .expect("spawning a worker thread")
            })
            .collect();
        stage.set(format!("{k} workers running {fibers} fibers"));
        WorkerPool { done, workers, finished, failures }
    }

    /// Waits for the workers to stop and fails on any fiber failure.
    fn join(self, stage: &Stage) -> usize {
        stage.set("joining the worker threads (they stop when the last fiber returns)");
        for w in self.workers {
            w.join().expect("a worker thread panicked");
        }
        assert!(self.done.load(Ordering::Acquire));
        let failures = self.failures.lock().unwrap();
        assert!(failures.is_empty(), "fiber failures: {failures:?}");
        self.finished.load(Ordering::Acquire)
    }
}

/// The shape of a stress run.
#[derive(Clone, Copy)]
struct Stress {
    workers: usize,
    producers: usize,
    consumers: usize,
    messages: usize,
    /// Messages circulating between producers and consumers (`Msg` reuse).
    in_flight: usize,
    pairs: usize,
    rounds: u64,
    /// Fibers set with the safe `set_function`: each stays on the worker
    /// that first runs it, so pops by other workers set it aside for that
    /// worker.
    pinned: bool,
}

impl Stress {
    /// 1,000,000 messages and 100,000 ping-pong rounds per pair in release
    /// builds (`cargo test --release -p spindle-tests --test threads`).
    /// Plain `cargo test` builds unoptimised code: 400,000 messages and
    /// 20,000 rounds there keep each stress test at a few seconds (under
    /// 20 s on a loaded two-core machine).
    fn new(workers: usize) -> Stress {
        let debug = cfg!(debug_assertions);
        Stress {
            workers,
            producers: 4,
            consumers: 5,
            messages: if debug { 400_000 } else { 1_000_000 },
            in_flight: 16,
            pairs: 4,
            rounds: if debug { 20_000 } else { 100_000 },
            pinned: false,
        }
    }

    /// The same with pinned fibers, a quarter of the size.
    fn pinned(workers: usize) -> Stress {
        let s = Stress::new(workers);
        Stress { messages: s.messages / 4, rounds: s.rounds / 4, pinned: true, ..s }
    }

    fn fibers(&self) -> usize {
        self.producers + self.consumers + 2 * self.pairs
    }
}

/// Counters the stress fibers keep; read by the checks and the watchdog.
#[derive(Default)]
struct Tally {
    received: AtomicU64,
    sum: AtomicU64,
    duplicates: AtomicU64,
    out_of_order: AtomicU64,
    bad_ids: AtomicU64,
    half_rounds: AtomicU64,
    bad_turns: AtomicU64,
}

impl Tally {
    fn status(&self, cfg: &Stress) -> String {
        format!(
            "{} of {} messages received, {} of {} ping-pong half-rounds",
            self.received.load(Ordering::Relaxed),
            cfg.messages,
            self.half_rounds.load(Ordering::Relaxed),
            2 * cfg.rounds * cfg.pairs as u64
        )
    }
}

/// A migratable fiber running `f`.
fn migratable(f: impl FnOnce() + Send + 'static) -> Fiber<()> {
    let fiber = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).expect("creating a fiber");
    // SAFETY: every stress fiber holds only Send values across its
    // suspension points (Arcs, integers, Vecs of integers, Msg handles) and
    // none reads a thread-local: they may resume on any worker thread.
    unsafe { fiber.set_function_migratable(Priority::NORMAL, f) }.expect("setting the fiber's function");
    fiber
}

/// Message payload: (producer, sequence number within the producer).
type Item = (usize, u64);

fn stress(name: &'static str, cfg: Stress) {
    assert_eq!(cfg.messages % cfg.producers, 0);
    assert_eq!(cfg.messages % cfg.consumers, 0);
    let tally = Arc::new(Tally::default());
    let t = tally.clone();
    watchdog_with_status(
        name,
        120,
        move || t.status(&cfg),
        move |stage| {
            let queue = RunQueue::<()>::new(cfg.fibers());
            let data = Arc::new(Channel::<Item>::new());
            let free = Arc::new(Channel::<Item>::new());
            for _ in 0..cfg.in_flight {
                free.push(Msg::new((0, 0))).unwrap();
            }
            let seen: Arc<Vec<AtomicBool>> =
                Arc::new((0..cfg.messages).map(|_| AtomicBool::new(false)).collect());
            let per_producer = (cfg.messages / cfg.producers) as u64;
            let per_consumer = cfg.messages / cfg.consumers;

            let pinned = cfg.pinned;
            let migratable = move |f: Box<dyn FnOnce() + Send>| {
                if pinned {
                    let fiber = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).expect("creating a fiber");
                    fiber.set_function(Priority::NORMAL, f).expect("setting the fiber's function");
                    fiber
                } else {
                    migratable(f)
                }
            };
            let mut fibers = Vec::new();
            // Producers: take a free message (sleeping while none is free), fill
            // it, send it; yield now and then.
            for p in 0..cfg.producers {
                let (data, free) = (data.clone(), free.clone());
                fibers.push(migratable(Box::new(move || {
                    for seq in 0..per_producer {
                        let mut m = free.pop().unwrap();
                        *m = (p, seq);
                        data.push(m).unwrap();
                        if seq % 64 == 63 {
                            yield_now();
                        }
                    }
                })));
            }
            // Consumers: take a fixed share, check each message, give the
            // handle back to the free list.
            for _ in 0..cfg.consumers {
                let (data, free, seen, tally) = (data.clone(), free.clone(), seen.clone(), tally.clone());
                let producers = cfg.producers;
                fibers.push(migratable(Box::new(move || {
                    let mut last: Vec<Option<u64>> = vec![None; producers];
                    for _ in 0..per_consumer {
                        let m = data.pop().unwrap();
                        let (p, seq) = *m;
                        free.push(m).unwrap();
                        if p >= producers || seq >= per_producer {
                            tally.bad_ids.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        // The channel is FIFO and each producer sends in order,
                        // so each consumer sees each producer's numbers rise.
                        if last[p].is_some_and(|l| seq <= l) {
                            tally.out_of_order.fetch_add(1, Ordering::Relaxed);
                        }
                        last[p] = Some(seq);
                        let idx = p as u64 * per_producer + seq;
                        if seen[idx as usize].swap(true, Ordering::Relaxed) {
                            tally.duplicates.fetch_add(1, Ordering::Relaxed);
                        }
                        tally.sum.fetch_add(idx, Ordering::Relaxed);
                        tally.received.fetch_add(1, Ordering::Relaxed);
                    }
                })));
            }
            // Ping-pong pairs: strict alternation checked through `turn`.
            let mut sems = Vec::new();
            for _ in 0..cfg.pairs {
                let ping = Arc::new(Semaphore::new(0));
                let pong = Arc::new(Semaphore::new(0));
                let turn = Arc::new(AtomicU64::new(0));
                let rounds = cfg.rounds;
                let (pi, po, tu, ta) = (ping.clone(), pong.clone(), turn.clone(), tally.clone());
                fibers.push(migratable(Box::new(move || {
                    for r in 0..rounds {
                        if tu.load(Ordering::Relaxed) != 2 * r {
                            ta.bad_turns.fetch_add(1, Ordering::Relaxed);
                        }
                        tu.store(2 * r + 1, Ordering::Relaxed);
                        ta.half_rounds.fetch_add(1, Ordering::Relaxed);
                        pi.release(1);
                        po.acquire();
                    }
                })));
                let (pi, po, tu, ta) = (ping.clone(), pong.clone(), turn.clone(), tally.clone());
                fibers.push(migratable(Box::new(move || {
                    for r in 0..rounds {
                        pi.acquire();
                        if tu.load(Ordering::Relaxed) != 2 * r + 1 {
                            ta.bad_turns.fetch_add(1, Ordering::Relaxed);
                        }
                        tu.store(2 * r + 2, Ordering::Relaxed);
                        ta.half_rounds.fetch_add(1, Ordering::Relaxed);
                        po.release(1);
                    }
                })));
                sems.push((ping, pong, turn));
            }
            assert_eq!(fibers.len(), cfg.fibers());
            for f in &fibers {
                queue.try_push(f.clone()).unwrap();
            }

            let pool = WorkerPool::start(&queue, cfg.workers, cfg.fibers(), &stage);
            let finished = pool.join(&stage);
            stage.set("checking the counts");

            assert_eq!(finished, cfg.fibers(), "every fiber returned");
            for f in &fibers {
                assert_eq!(f.state(), FiberState::Finished, "{f:?}");
            }
            let n = cfg.messages as u64;
            assert_eq!(tally.bad_ids.load(Ordering::Relaxed), 0, "messages with ids never sent");
            assert_eq!(tally.duplicates.load(Ordering::Relaxed), 0, "messages received twice");
            assert_eq!(tally.out_of_order.load(Ordering::Relaxed), 0, "per-producer order broken");
            assert_eq!(tally.received.load(Ordering::Relaxed), n);
            assert_eq!(tally.sum.load(Ordering::Relaxed), n * (n - 1) / 2);
            let missing = seen.iter().filter(|s| !s.load(Ordering::Relaxed)).count();
            assert_eq!(missing, 0, "messages never received");
            assert_eq!(data.len(), 0);
            assert_eq!(free.len(), cfg.in_flight, "every message handle came back, none duplicated");
            assert_eq!((data.receivers(), free.receivers()), (0, 0));

            assert_eq!(tally.bad_turns.load(Ordering::Relaxed), 0, "ping-pong turns interleaved");
            assert_eq!(tally.half_rounds.load(Ordering::Relaxed), 2 * cfg.rounds * cfg.pairs as u64);
            for (ping, pong, turn) in &sems {
                assert_eq!(turn.load(Ordering::Relaxed), 2 * cfg.rounds);
                assert_eq!((ping.available(), pong.available()), (0, 0));
                assert_eq!((ping.waiters(), pong.waiters()), (0, 0));
            }

            assert!(queue.is_empty());
            let stats = queue.stats();
            assert_eq!(stats.pushes, stats.pops, "every push popped once: {stats:?}");
            assert!(stats.wakes > 0, "{stats:?}");
            assert_eq!(stats.full_pushes, 0);
            let migrations: u64 = fibers.iter().map(|f| f.stats().migrations).sum();
            if cfg.pinned {
                assert_eq!(migrations, 0, "pinned fibers never moved");
            }
            eprintln!("{name}: {stats:?}, {migrations} fiber migrations between workers");
        },
    );
}

#[test]
fn stress_two_workers() {
    stress("stress_two_workers", Stress::new(2));
}

#[test]
fn stress_four_workers() {
    stress("stress_four_workers", Stress::new(4));
}

#[test]
fn stress_four_workers_pinned_fibers() {
    stress("stress_four_workers_pinned_fibers", Stress::pinned(4));
}
