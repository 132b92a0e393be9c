//! Timers under stress: `sleep`, `sleep_until`, `yield_timeout`,
//! `interrupt_after`/`interrupt_at` and `wait_timeout` racing
//! `JoinHandle::wake`, `cancel`, completion, the pool scaling up and down,
//! extreme sysmon settings and shutdown.
//!
//! Behaviour only, no timing: every wait returns, every join gives the
//! fiber's value or `Cancelled` for a fiber that was cancelled, no more
//! `yield_timeout`s end early than there were wakes, and a progress
//! watchdog fails a round that stops moving. `TIMER_STRESS_ROUNDS` and
//! `TIMER_STRESS_SEED` change the run (the review that wrote it ran about
//! 400 rounds of each test in release and 300 in debug, all passing).
mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Rng;
use spindle_executor::sync::Semaphore;
use spindle_executor::{
    interrupt_after, interrupt_at, sleep, sleep_until, yield_now, yield_timeout, Executor, JoinHandle,
};
use spindle_test_support::watchdog_with_progress;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Default)]
struct Counts {
    progress: AtomicU64,
    wakes: AtomicU64,
    yt_false: AtomicU64,
    yt_true: AtomicU64,
    sleeps: AtomicU64,
    interrupts: AtomicU64,
}

/// One timed operation of a fiber, chosen at random; `shared_deadline` is a
/// deadline many fibers use at once. Waits that only a wake ends are used
/// only when `wakers` run.
fn timed_op(rng: &mut Rng, c: &Counts, shared_deadline: Instant, wakers: bool, sem: &Semaphore) {
    match rng.below(if wakers { 12 } else { 10 }) {
        0 => sleep(Duration::ZERO),
        1 => sleep(Duration::from_micros(rng.below(300))),
        2 => sleep_until(Instant::now() - Duration::from_millis(rng.below(5))),
        3 => sleep_until(shared_deadline),
        4 => {
            if yield_timeout(Duration::from_micros(rng.below(200))) {
                c.yt_true.fetch_add(1, SeqCst);
            } else {
                c.yt_false.fetch_add(1, SeqCst);
            }
        }
        5 => {
            if yield_timeout(Duration::ZERO) {
                c.yt_true.fetch_add(1, SeqCst);
            } else {
                c.yt_false.fetch_add(1, SeqCst);
            }
        }
        6 => {
            let r = interrupt_after(Duration::from_micros(rng.below(100)), || sem.acquire_interruptible());
            match r {
                Ok(()) => sem.release(1),
                Err(_) => {
                    c.interrupts.fetch_add(1, SeqCst);
                }
            }
        }
        7 => {
            let r = interrupt_at(shared_deadline, || {
                let r = sem.acquire_interruptible();
                if r.is_ok() {
                    sem.release(1);
                }
                // A nested deadline with zero time.
                let inner = interrupt_after(Duration::ZERO, || sem.acquire_interruptible());
                if inner.is_ok() {
                    sem.release(1);
                }
                r
            });
            if r.is_err() {
                c.interrupts.fetch_add(1, SeqCst);
            }
        }
        8 => yield_now(),
        9 => {
            // A sleep inside a deadline that fires during it.
            interrupt_after(Duration::ZERO, || sleep(Duration::from_micros(rng.below(50))));
        }
        10 => {
            if yield_timeout(Duration::MAX) {
                c.yt_true.fetch_add(1, SeqCst);
            } else {
                c.yt_false.fetch_add(1, SeqCst);
            }
        }
        _ => sleep(Duration::from_secs(3600)),
    }
    c.sleeps.fetch_add(1, SeqCst);
    c.progress.fetch_add(1, SeqCst);
}

/// Fibers doing timed operations while threads wake and cancel them.
fn racing_round(seed: u64, builder: spindle_executor::Builder, cancels: bool) {
    let mut rng = Rng::new(seed);
    let exec = builder.build();
    let c = Arc::new(Counts::default());
    let sem = Arc::new(Semaphore::new(2));
    let fibers = 8 + rng.below(24) as usize;
    let iters = 20 + rng.below(40);
    let shared_deadline = Instant::now() + Duration::from_micros(rng.below(2000));
    let mut hs = Vec::new();
    for i in 0..fibers {
        let c = Arc::clone(&c);
        let sem = Arc::clone(&sem);
        let mut r = Rng::new(seed * 1000 + i as u64);
        let h = exec.spawn(move || {
            for _ in 0..iters {
                timed_op(&mut r, &c, shared_deadline, true, &sem);
            }
            iters
        });
        // JoinHandle is not Sync: each behind a Mutex.
        hs.push(Mutex::new(h));
    }
    let handles = Arc::new(hs);
    let stop = Arc::new(AtomicBool::new(false));
    let cancelled = Arc::new(Mutex::new(vec![false; fibers]));
    let mut threads = Vec::new();
    for t in 0..2u64 {
        let handles = Arc::clone(&handles);
        let stop = Arc::clone(&stop);
        let c = Arc::clone(&c);
        let cancelled = Arc::clone(&cancelled);
        let mut r = Rng::new(seed * 7 + t);
        threads.push(std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                let i = r.below(fibers as u64) as usize;
                let h = handles[i].lock().unwrap();
                if cancels && r.below(400) == 0 {
                    cancelled.lock().unwrap()[i] = true;
                    h.cancel();
                } else {
                    c.wakes.fetch_add(1, SeqCst);
                    h.wake();
                }
                drop(h);
                if r.below(8) == 0 {
                    std::thread::yield_now();
                }
            }
        }));
    }
    // Wait from this thread with wait_timeout (short waits: the wakers
    // need the lock too).
    let mut r2 = rng.clone();
    for h in handles.iter() {
        loop {
            let d = match r2.below(3) {
                0 => Duration::ZERO,
                1 => Duration::from_micros(r2.below(500)),
                _ => Duration::from_millis(2),
            };
            let h = h.lock().unwrap();
            if h.wait_timeout(d) {
                assert!(h.is_finished());
                break;
            }
        }
    }
    stop.store(true, SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let handles = Arc::try_unwrap(handles).unwrap_or_else(|_| panic!("the wakers are gone"));
    for (i, h) in handles.into_iter().enumerate() {
        match h.into_inner().unwrap().join() {
            Ok(v) => assert_eq!(v, iters),
            Err(e) => assert!(
                e.is_cancelled() && cancelled.lock().unwrap()[i],
                "fiber {i} failed: {e:?} (cancelled: {})",
                cancelled.lock().unwrap()[i]
            ),
        }
    }
    assert!(
        c.yt_false.load(SeqCst) <= c.wakes.load(SeqCst) + fibers as u64,
        "more yield_timeouts ended by a wake ({}) than wakes ({})",
        c.yt_false.load(SeqCst),
        c.wakes.load(SeqCst)
    );
    drop(exec);
}

fn run_rounds(name: &'static str, default_rounds: u64, f: impl Fn(u64) + Send + Sync + 'static) {
    let rounds = env("TIMER_STRESS_ROUNDS", default_rounds);
    let seed0 = env("TIMER_STRESS_SEED", 1);
    let done = Arc::new(AtomicU64::new(0));
    let d2 = Arc::clone(&done);
    let d3 = Arc::clone(&done);
    watchdog_with_progress(
        name,
        60,
        move || format!("rounds done {}", d3.load(SeqCst)),
        move || d2.load(SeqCst),
        move |stage| {
            for seed in seed0..seed0 + rounds {
                stage.set(format!("seed {seed}"));
                f(seed);
                done.fetch_add(1, SeqCst);
            }
        },
    );
}

#[test]
fn timed_waits_racing_wakes() {
    run_rounds("timed_waits_racing_wakes", 20, |seed| {
        racing_round(seed, Executor::builder().workers(1 + (seed % 3) as usize), false)
    });
}

#[test]
fn timed_waits_racing_wakes_and_cancels() {
    run_rounds("timed_waits_racing_wakes_and_cancels", 20, |seed| {
        racing_round(seed, Executor::builder().workers(1 + (seed % 3) as usize), true)
    });
}

#[test]
fn timed_waits_with_a_tiny_sysmon_interval() {
    run_rounds("timed_waits_with_a_tiny_sysmon_interval", 10, |seed| {
        racing_round(seed, Executor::builder().workers(2).sysmon_interval(Duration::from_nanos(1)), true)
    });
}

#[test]
fn timed_waits_with_a_huge_sysmon_interval() {
    run_rounds("timed_waits_with_a_huge_sysmon_interval", 10, |seed| {
        racing_round(seed, Executor::builder().workers(2).max_workers(4).sysmon_interval(Duration::MAX), true)
    });
}

#[test]
fn timed_waits_while_the_pool_scales() {
    run_rounds("timed_waits_while_the_pool_scales", 10, |seed| {
        racing_round(
            seed,
            Executor::builder()
                .workers(1)
                .max_workers(6)
                .idle_retire(Duration::from_micros(1 + seed % 200))
                .stuck_threshold(Duration::from_micros(50)),
            true,
        )
    });
}

/// Fibers in every kind of timed wait when the executor is dropped.
fn shutdown_round(seed: u64) {
    let mut rng = Rng::new(seed);
    let workers = 1 + rng.below(3) as usize;
    let exec = Executor::builder().workers(workers).max_workers(workers + rng.below(3) as usize).build();
    let never = Arc::new(Semaphore::new(0));
    let c = Arc::new(Counts::default());
    let sem = Arc::new(Semaphore::new(1));
    let deadline = Instant::now() + Duration::from_micros(rng.below(3000));
    let started = Arc::new(AtomicUsize::new(0));
    let n = 4 + rng.below(20) as usize;
    let mut hs: Vec<JoinHandle<u64>> = Vec::new();
    let mut targets: Vec<Arc<Mutex<Option<JoinHandle<u64>>>>> = Vec::new();
    for i in 0..n {
        let never = Arc::clone(&never);
        let c = Arc::clone(&c);
        let sem = Arc::clone(&sem);
        let started = Arc::clone(&started);
        let kind = rng.below(8);
        let mut r = Rng::new(seed * 100 + i as u64);
        let target: Arc<Mutex<Option<JoinHandle<u64>>>> = Arc::new(Mutex::new(None));
        let tgt = Arc::clone(&target);
        targets.push(target);
        hs.push(exec.spawn(move || {
            started.fetch_add(1, SeqCst);
            match kind {
                0 => sleep(Duration::MAX),
                1 => {
                    let _ = yield_timeout(Duration::MAX);
                }
                2 => {
                    let _ = interrupt_after(Duration::MAX, || never.acquire_interruptible());
                }
                3 => {
                    let h = tgt.lock().unwrap().take();
                    if let Some(h) = h {
                        while !h.wait_timeout(Duration::from_micros(r.below(1000))) {}
                    }
                }
                4 => sleep_until(deadline),
                5 => loop {
                    timed_op(&mut r, &c, deadline, false, &sem);
                },
                6 => {
                    interrupt_at(deadline, || sleep(Duration::MAX));
                }
                _ => {
                    let h = tgt.lock().unwrap().take();
                    if let Some(h) = h {
                        let _ = h.join();
                    }
                    sleep(Duration::from_micros(r.below(100)));
                }
            }
            kind
        }));
    }
    // Fibers of kind 3 and 7 wait on a handle of a long sleeper.
    for t in &targets {
        *t.lock().unwrap() = Some(exec.spawn(|| {
            sleep(Duration::from_secs(3600));
            99
        }));
    }
    // Threads waiting with wait_timeout on some of the handles.
    let mut waiters = Vec::new();
    let mut kept = Vec::new();
    for (i, h) in hs.into_iter().enumerate() {
        if i % 3 == 0 {
            let d = Duration::from_micros(rng.below(2000));
            waiters.push(std::thread::spawn(move || {
                while !h.wait_timeout(d) {}
                h.join()
            }));
        } else {
            kept.push(h);
        }
    }
    // Let some start.
    let want = rng.below(n as u64 + 1) as usize;
    let until = Instant::now() + Duration::from_millis(50);
    while started.load(SeqCst) < want && Instant::now() < until {
        std::thread::yield_now();
    }
    if rng.below(4) == 0 {
        // Drop inside one of its own fibers.
        let holder = Arc::new(Mutex::new(None));
        let h2 = Arc::clone(&holder);
        let hnd = exec.spawn(move || {
            sleep(Duration::from_micros(50));
            drop(h2.lock().unwrap().take());
        });
        *holder.lock().unwrap() = Some(exec);
        drop(hnd);
        // The drop inside is asynchronous: wait on the joins.
        drop(holder);
    } else {
        drop(exec);
    }
    for h in kept {
        match h.join() {
            Ok(_) => {}
            Err(e) => assert!(e.is_cancelled(), "{e:?}"),
        }
    }
    for w in waiters {
        match w.join().unwrap() {
            Ok(_) => {}
            Err(e) => assert!(e.is_cancelled(), "{e:?}"),
        }
    }
    for t in targets {
        if let Some(h) = t.lock().unwrap().take() {
            match h.join() {
                Ok(v) => assert_eq!(v, 99),
                Err(e) => assert!(e.is_cancelled(), "{e:?}"),
            }
        }
    }
}

#[test]
fn timed_waits_at_shutdown() {
    run_rounds("timed_waits_at_shutdown", 40, shutdown_round);
}

/// wait_timeout from threads and fibers racing a task's completion and
/// cancellation; every wait ends and the join agrees with it.
fn wait_round(seed: u64) {
    let mut rng = Rng::new(seed);
    let exec = Executor::builder().workers(1 + rng.below(3) as usize).build();
    let n = 16;
    let mut pairs = Vec::new();
    for i in 0..n {
        let kind = rng.below(4);
        let spins = rng.below(50);
        let task = exec.spawn(move || {
            match kind {
                0 => {}
                1 => {
                    for _ in 0..spins {
                        yield_now();
                    }
                }
                2 => sleep(Duration::from_micros(spins * 10)),
                _ => {
                    let _ = yield_timeout(Duration::from_micros(spins));
                }
            }
            i
        });
        pairs.push((task, rng.below(3), rng.below(4)));
    }
    let mut threads = Vec::new();
    let mut fibers = Vec::new();
    for (i, (task, where_, cancel)) in pairs.into_iter().enumerate() {
        let task = Arc::new(Mutex::new(Some(task)));
        if cancel == 0 {
            let t = Arc::clone(&task);
            // Cancel from another fiber at once.
            drop(exec.spawn(move || {
                if let Some(h) = t.lock().unwrap().as_ref() {
                    h.cancel();
                }
            }));
        }
        let check = move |h: JoinHandle<u64>, waited: bool| {
            assert!(waited && h.is_finished());
            match h.join() {
                Ok(v) => assert_eq!(v, i as u64),
                Err(e) => assert!(e.is_cancelled() && cancel == 0, "task {i}: {e:?}"),
            }
        };
        let d = Duration::from_micros(rng.below(300));
        if where_ == 0 {
            threads.push(std::thread::spawn(move || {
                let h = task.lock().unwrap().take().unwrap();
                let mut w = false;
                while !w {
                    w = h.wait_timeout(d);
                }
                check(h, w);
            }));
        } else {
            fibers.push(exec.spawn(move || {
                // Holds the lock only between waits (a canceller may want it).
                loop {
                    let w = {
                        let g = task.lock().unwrap();
                        let h = g.as_ref().unwrap();
                        if h.is_finished() {
                            true
                        } else {
                            drop(g);
                            // Not holding a std lock across the wait.
                            let h = task.lock().unwrap().take().unwrap();
                            let w = if where_ == 1 {
                                h.wait_timeout(d)
                            } else {
                                h.wait_until(Instant::now() + d)
                            };
                            *task.lock().unwrap() = Some(h);
                            w
                        }
                    };
                    if w {
                        break;
                    }
                }
                let h = task.lock().unwrap().take().unwrap();
                check(h, true);
            }));
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    for f in fibers {
        f.join().unwrap();
    }
}

#[test]
fn wait_timeout_racing_completion_and_cancel() {
    run_rounds("wait_timeout_racing_completion_and_cancel", 60, wait_round);
}

/// Hogs make sysmon add workers; the extra workers retire while fibers
/// started on them sleep; timers must still wake those fibers.
fn scaling_round(seed: u64) {
    let mut rng = Rng::new(seed);
    let exec = Executor::builder()
        .workers(1)
        .max_workers(2 + rng.below(4) as usize)
        .idle_retire(Duration::from_micros(1 + rng.below(300)))
        .stuck_threshold(Duration::from_micros(20))
        .build();
    let c = Arc::new(Counts::default());
    let sem = Arc::new(Semaphore::new(1));
    let mut hs = Vec::new();
    for wave in 0..4u64 {
        // A hog per wave.
        let spin = Duration::from_micros(500 + rng.below(2000));
        hs.push(exec.spawn(move || {
            let end = Instant::now() + spin;
            while Instant::now() < end {
                std::hint::spin_loop();
            }
            0
        }));
        for i in 0..(8 + rng.below(16)) {
            let c = Arc::clone(&c);
            let sem = Arc::clone(&sem);
            let mut r = Rng::new(seed * 10_000 + wave * 100 + i);
            let deadline = Instant::now() + Duration::from_micros(r.below(5000));
            hs.push(exec.spawn(move || {
                for _ in 0..(1 + r.below(6)) {
                    timed_op(&mut r, &c, deadline, false, &sem);
                    // Long enough for the worker that started this to retire.
                    sleep(Duration::from_micros(r.below(2000)));
                }
                1
            }));
        }
    }
    let total: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(total > 0);
    if std::env::var("TIMER_STRESS_VERBOSE").is_ok() {
        eprintln!("seed {seed}: {:?}", exec.stats());
    }
}

#[test]
fn timed_waits_on_workers_that_retire() {
    run_rounds("timed_waits_on_workers_that_retire", 10, scaling_round);
}

#[test]
fn timed_waits_with_extreme_settings() {
    run_rounds("timed_waits_with_extreme_settings", 6, |seed| {
        let d = if seed % 2 == 0 { Duration::MAX } else { Duration::ZERO };
        let b = Executor::builder()
            .workers(1 + (seed % 2) as usize)
            .max_workers(3)
            .time_slice(d)
            .deadlock_grace(d)
            .idle_retire(d)
            .stuck_threshold(d);
        racing_round(seed, b, true);
        scaling_round(seed);
    });
}
