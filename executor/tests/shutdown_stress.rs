//! Randomized shutdown stress: executors of 1 to 4 workers, a random mix
//! of tasks (waits nobody signals, timers, joins, scopes, yield loops,
//! values whose `Drop` joins or takes tokens, fibers run by hand inside
//! tasks, some dropped asleep, a panic whose unwind joins and yields, a
//! cancel unwind that runs a scope, joins and yields, holders and waiters
//! of a `spindle_sync::Mutex`, readers of a channel that pushers may
//! close), dropped at a random moment. Every drop and join must return, and every guard that
//! must be dropped is. (The last two kinds came from a review; a third,
//! a panic payload whose `Drop` joins, hangs some seeds: such a payload is
//! dropped where the task's last reference goes, DESIGN.md, "Cancellation,
//! scopes, shutdown", and is left out.)
//!
//! Seeds it found, each now a test of its own in `shutdown.rs`: 66 (a
//! joiner asleep in a destructor during its cancel unwind was dropped by
//! the final drain: the process aborted, later its stack leaked; now the
//! drain runs it to the end of its unwind), 81 (a fiber that slept while
//! another was stuck mid-unwind on its worker looked unwinding too; the
//! same fix's first version ran it without its task, and its `sleep` then
//! slept the worker thread) and 3051 (a join in a dropped hand-run fiber
//! blocked the only worker during shutdown). A hand-run fiber whose last reference a
//! wake on another worker releases is leaked (a pinned stack; reported on
//! stderr once): it holds no counted guard. Thousands of rounds in one
//! process use up the mapping limit with such leaks; run large sweeps as
//! several processes:
//!
//! ```text
//! SHUTDOWN_STRESS_ROUNDS=1000 SHUTDOWN_STRESS_SEED=1001 cargo test -p spindle-executor \
//!     --test shutdown_stress -- --nocapture
//! ```
//!
//! `SHUTDOWN_STRESS_ROUNDS` (default 300), `SHUTDOWN_STRESS_SEED` (default
//! 1), `SHUTDOWN_STRESS_VERBOSE` (prints each round's workers and task
//! kinds, `kind * 10 + sub`).
mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{watchdog, Rng};
use spindle_executor::{sleep, yield_now, Executor, JoinError, JoinHandle};
use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
use spindle_sync::{Channel, Semaphore};

/// Counts when dropped.
struct Guard(Arc<AtomicUsize>);
impl Drop for Guard {
    fn drop(&mut self) {
        self.0.fetch_add(1, SeqCst);
    }
}

/// Joins when dropped.
struct JoinsOnDrop(Option<JoinHandle<()>>);
impl Drop for JoinsOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

/// Releases `sem` (n tokens) and then acquires one from `plenty` and gives it back.
struct SemOnDrop(Arc<Semaphore>, usize, Arc<Semaphore>);
impl Drop for SemOnDrop {
    fn drop(&mut self) {
        self.0.release(self.1);
        self.2.acquire();
        self.2.release(1);
    }
}

/// Yields n times when dropped (executor yield_now).
struct YieldsOnDrop(usize);
impl Drop for YieldsOnDrop {
    fn drop(&mut self) {
        for _ in 0..self.0 {
            yield_now();
        }
    }
}

/// Runs a scope when dropped: spawns (cancelled at once during shutdown)
/// and joins a handle inside it.
struct ScopeOnDrop(usize, Option<JoinHandle<()>>);
impl Drop for ScopeOnDrop {
    fn drop(&mut self) {
        let Some(handle) = spindle_executor::Handle::current() else { return };
        let n = self.0;
        let h = self.1.take();
        let local = 3u32;
        handle.scope(|s| {
            for _ in 0..n {
                let local = &local;
                s.spawn(move || {
                    let _x = *local;
                    yield_now();
                });
            }
            if let Some(h) = h {
                let _ = h.join();
            }
        });
    }
}

type Pool = Arc<Mutex<Vec<JoinHandle<()>>>>;

fn take_one(pool: &Pool) -> Option<JoinHandle<()>> {
    pool.lock().unwrap().pop()
}

fn one_round(seed: u64, stage: common::Stage) -> String {
    let mut rng = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    for _ in 0..4 {
        rng.next();
    }
    let workers = 1 + rng.below(4) as usize;
    let exec = Executor::builder().workers(workers).build();
    let dropped = Arc::new(AtomicUsize::new(0));
    let expected = Arc::new(AtomicUsize::new(0)); // guards that must drop
    let never = Arc::new(Semaphore::new(0)); // nobody signals (interruptible waits)
    let plain = Arc::new(Semaphore::new(0)); // plain waiters; destructors release into it
    let plenty = Arc::new(Semaphore::new(1000));
    let chan: Arc<Channel<u32>> = Arc::new(Channel::new());
    let mtx = Arc::new(spindle_sync::Mutex::new(0u64));
    let pool: Pool = Arc::new(Mutex::new(Vec::new()));
    let stuck_pool: Pool = Arc::new(Mutex::new(Vec::new()));
    let stuck = Arc::new(Semaphore::new(0)); // plain waiters, never released
    let n = 1 + rng.below(24);
    let mut main_handles: Vec<JoinHandle<()>> = Vec::new();
    let mut kinds = Vec::new();
    let mut panicked_kind = false;
    for _ in 0..n {
        let mut kind = rng.below(18);
        // At most one user panic per round: a user panic while another
        // fiber is stuck mid-unwind on its worker can abort the process
        // (DESIGN.md, "Cancellation, scopes, shutdown": not fixed).
        if kind == 12 {
            if panicked_kind {
                kind = 13;
            }
            panicked_kind = true;
        }
        let sub = rng.below(4);
        kinds.push(kind * 10 + sub);
        let g = Guard(dropped.clone());
        let (never, plain, plenty, chan, tpool) =
            (never.clone(), plain.clone(), plenty.clone(), chan.clone(), pool.clone());
        let (stuck2, spool, mtx) = (stuck.clone(), stuck_pool.clone(), mtx.clone());
        // whether this task's guard must be dropped
        let counted = !matches!(kind, 7 | 11);
        if counted {
            expected.fetch_add(1, SeqCst);
        }
        let h = exec.spawn(move || {
            let _g = g;
            match kind {
                0 => {
                    let _ = never.acquire_interruptible();
                    sleep(Duration::from_secs(60));
                }
                1 => {
                    let _ = chan.pop_interruptible();
                    sleep(Duration::from_secs(60));
                }
                2 => sleep(Duration::from_millis(sub * 3 + 1).max(Duration::from_millis(1)) * 1000),
                3 => {
                    if let Some(h) = take_one(&tpool) {
                        let _ = h.join();
                    }
                    sleep(Duration::from_secs(60));
                }
                4 => {
                    let handle = spindle_executor::Handle::current().unwrap();
                    let local = 5u32;
                    handle.scope(|s| {
                        for i in 0..=sub {
                            let never = &never;
                            let local = &local;
                            s.spawn(move || {
                                let _x = *local;
                                match i % 3 {
                                    0 => sleep(Duration::from_secs(60)),
                                    1 => loop {
                                        yield_now()
                                    },
                                    _ => {
                                        let _ = never.acquire_interruptible();
                                        sleep(Duration::from_secs(60));
                                    }
                                }
                            });
                        }
                        sleep(Duration::from_secs(60));
                    });
                }
                5 => loop {
                    yield_now();
                },
                6 => {
                    let _j = JoinsOnDrop(take_one(&tpool));
                    sleep(Duration::from_secs(60));
                }
                7 => {
                    // plain wait nobody signals (maybe a SemOnDrop releases it)
                    plain.acquire();
                    sleep(Duration::from_secs(60));
                }
                8 => {
                    let _s = SemOnDrop(plain.clone(), 1 + sub as usize, plenty.clone());
                    if sub % 2 == 0 {
                        sleep(Duration::from_secs(60));
                    } else {
                        loop {
                            yield_now()
                        }
                    }
                }
                9 | 10 => {
                    // hand-run nested fiber
                    let f = Fiber::<()>::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
                    // only a fiber asleep in a join of a task the drain completes
                    // (stuck) holds a joining destructor: anything else is a user deadlock
                    let (joined, other) = if kind == 9 && sub == 3 {
                        (take_one(&spool), take_one(&spool))
                    } else {
                        (take_one(&tpool), None)
                    };
                    let inner_kind = sub;
                    f.set_function(Priority::NORMAL, move || {
                        let _j = JoinsOnDrop(other);
                        match inner_kind {
                            0 => spindle_fiber::yield_now(),
                            1 => {
                                let _ = never.acquire_interruptible();
                                spindle_fiber::yield_now();
                            }
                            _ => {
                                if let Some(h) = joined {
                                    let _ = h.join();
                                } else {
                                    spindle_fiber::yield_now();
                                }
                            }
                        }
                    })
                    .unwrap();
                    let r = f.run();
                    assert!(
                        matches!(
                            r,
                            Ok(RunOutcome::Yielded(_)) | Ok(RunOutcome::Slept) | Ok(RunOutcome::Returned(_))
                        ),
                        "run: {:?}",
                        r.map(|_| ())
                    );
                    if kind == 9 {
                        drop(f);
                        sleep(Duration::from_secs(60));
                    } else {
                        let _keep = f;
                        sleep(Duration::from_secs(60));
                    }
                }
                11 => {
                    stuck2.acquire();
                    sleep(Duration::from_secs(60));
                }
                12 => {
                    // a panic whose unwind joins (maybe a stuck task) and yields
                    let _y = YieldsOnDrop(1 + sub as usize);
                    let _j = JoinsOnDrop(if sub % 2 == 0 { take_one(&spool) } else { take_one(&tpool) });
                    if sub >= 2 {
                        sleep(Duration::from_millis(sub));
                    }
                    panic!("kind 12");
                }
                13 => {
                    // the cancel unwind runs a scope, a join and yields
                    let _y = YieldsOnDrop(1 + sub as usize);
                    let _s = ScopeOnDrop(sub as usize, take_one(&tpool));
                    let _j = JoinsOnDrop(take_one(&spool));
                    sleep(Duration::from_secs(60));
                }
                14 => {
                    // holds the mutex across a long sleep (cancelled there)
                    let mut n = mtx.lock();
                    *n += 1;
                    sleep(Duration::from_secs(60));
                }
                15 => {
                    // waits for the mutex (plain or interruptible), then sleeps
                    let n = if sub % 2 == 0 { Some(mtx.lock()) } else { mtx.lock_interruptible().ok() };
                    if let Some(mut n) = n {
                        *n += 1;
                        yield_now();
                    }
                    sleep(Duration::from_secs(60));
                }
                16 => {
                    // reads the channel until it closes or the wait is interrupted
                    while let Ok(Some(_)) = chan.pop_interruptible() {}
                    sleep(Duration::from_secs(60));
                }
                17 => {
                    // pushes a few messages, maybe closes the channel
                    for i in 0..sub {
                        let _ = chan.push(spindle_sync::Msg::new(i as u32));
                        yield_now();
                    }
                    if sub >= 2 {
                        chan.close();
                    }
                    sleep(Duration::from_secs(60));
                }
                _ => unreachable!(),
            }
        });
        if kind == 11 && rng.below(4) != 0 {
            stuck_pool.lock().unwrap().push(h);
        } else if rng.below(2) == 0 {
            pool.lock().unwrap().push(h);
        } else {
            main_handles.push(h);
        }
    }
    // a drop moment
    match rng.below(4) {
        0 => {}
        1 => std::thread::yield_now(),
        2 => std::thread::sleep(Duration::from_micros(rng.below(500))),
        _ => std::thread::sleep(Duration::from_millis(1 + rng.below(5))),
    }
    if std::env::var("SHUTDOWN_STRESS_VERBOSE").is_ok() {
        eprintln!("workers {workers} kind*10+sub {kinds:?}");
    }
    stage.set(format!("dropping exec: workers {workers} kinds {kinds:?}"));
    drop(exec);
    stage.set(format!("joining: workers {workers} kinds {kinds:?}"));
    let mut res = Vec::new();
    for h in main_handles {
        match h.join() {
            Ok(()) => res.push('o'),
            Err(JoinError::Cancelled { .. }) => res.push('c'),
            Err(JoinError::Panicked { .. }) => res.push('p'),
            Err(e) => panic!("seed {seed}: unexpected join {e:?}"),
        }
    }
    let mut left: Vec<_> = std::mem::take(&mut *pool.lock().unwrap());
    left.extend(std::mem::take(&mut *stuck_pool.lock().unwrap()));
    for h in left {
        match h.join() {
            Ok(()) | Err(JoinError::Cancelled { .. }) | Err(JoinError::Panicked { .. }) => {}
            Err(e) => panic!("seed {seed}: unexpected pool join {e:?}"),
        }
    }
    let (d, e) = (dropped.load(SeqCst), expected.load(SeqCst));
    assert!(d >= e, "seed {seed}: workers {workers} kinds {kinds:?}: dropped {d} < expected {e}");
    format!("{workers} {kinds:?} {res:?}")
}

#[test]
fn random_shutdowns_return_and_drop_what_they_must() {
    // The panics of kind 12 are expected: not reported.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&"kind 12") {
            report(info);
        }
    }));
    let rounds: u64 =
        std::env::var("SHUTDOWN_STRESS_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let base: u64 = std::env::var("SHUTDOWN_STRESS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    for r in 0..rounds {
        let seed = base + r;
        if std::env::var("SHUTDOWN_STRESS_VERBOSE").is_ok() {
            eprintln!("seed {seed}");
        }
        watchdog(&format!("shutdown_stress seed {seed}"), 20, move |s| one_round(seed, s));
    }
}
