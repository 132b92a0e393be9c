//! Work stealing: fibers spawned from one fiber end up running on every
//! worker, and a worker takes jobs queued on a busy worker.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{size, wait_for, watchdog, Flag};
use spindle_executor::{spawn, yield_now, Executor};

/// Loops that wait for stealing give up after this, long after the
/// watchdog (30 s) has failed the test, so that a failed test does not keep
/// a core busy for the rest of the binary.
const RUNAWAY: Duration = Duration::from_secs(45);

/// A little work, so that a fiber is not over before others look for jobs.
fn busy_work(seed: u64) -> u64 {
    (0..200u64).fold(seed, |acc, x| acc.wrapping_mul(31).wrapping_add(x))
}

fn worker_name() -> String {
    std::thread::current().name().unwrap_or("<unnamed>").to_owned()
}

#[test]
fn fibers_spawned_from_one_fiber_run_on_every_worker() {
    watchdog("fibers_spawned_from_one_fiber_run_on_every_worker", 30, |stage| {
        // max_workers == workers: no scaling, so "every worker" is exactly
        // spindle-worker-0 and spindle-worker-1.
        let exec = Executor::builder().workers(2).max_workers(2).build();
        let n = size(2_000, 10_000);
        let seen = Arc::new(Mutex::new(BTreeSet::new()));
        let started = Arc::new(AtomicUsize::new(0));
        stage.set("one fiber spawns, waits for stealing, then joins");
        let (s, st, stage) = (Arc::clone(&seen), Arc::clone(&started), stage.clone());
        let total = exec
            .block_on(move || {
                let handles: Vec<_> = (0..n)
                    .map(|i| {
                        let (s, st) = (Arc::clone(&s), Arc::clone(&st));
                        spawn(move || {
                            st.fetch_add(1, Ordering::SeqCst);
                            s.lock().unwrap().insert(worker_name());
                            let mut acc = busy_work(i as u64);
                            for _ in 0..3 {
                                yield_now();
                                acc = busy_work(acc);
                            }
                            acc
                        })
                    })
                    .collect();
                // Spawns from a fiber go to its worker's own queue, so every
                // job starts there. Keep this worker busy (no yield) until
                // more than half have started: only the other worker can
                // have started them, so it stole them from this one.
                let more_than_half = n / 2 + n / 8;
                // A plain spin (`wait_for` would yield, and this worker could
                // then start its own jobs itself), until the other worker
                // has stolen enough; if it never does, the watchdog fails
                // the test at this stage.
                stage.set("the spawner's worker spins until the other worker started its jobs");
                let start = Instant::now();
                while st.load(Ordering::SeqCst) < more_than_half && start.elapsed() < RUNAWAY {
                    std::hint::spin_loop();
                }
                stage.set("joining every fiber");
                handles.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add)
            })
            .unwrap();
        let expected = (0..n as u64)
            .map(|i| (0..3).fold(busy_work(i), |acc, _| busy_work(acc)))
            .fold(0, u64::wrapping_add);
        assert_eq!(total, expected, "every fiber's result was joined");
        assert_eq!(started.load(Ordering::SeqCst), n);
        let seen = seen.lock().unwrap().clone();
        let expected_names: BTreeSet<String> =
            ["spindle-worker-0", "spindle-worker-1"].map(String::from).into();
        assert_eq!(seen, expected_names, "fibers ran on every worker (and only on workers)");
        // The other worker started more than n/2 + n/8 jobs, every one of
        // them taken from the spawner's queue, and each job counts, not
        // each steal (a steal takes a batch; counted once per batch, this
        // read 53 with 2,000 jobs).
        let stats = exec.stats();
        assert!(stats.steals >= (n / 2) as u64, "steals counted per job: {stats:?}");
    });
}

#[test]
fn fibers_spawned_from_one_fiber_spread_over_four_workers() {
    watchdog("fibers_spawned_from_one_fiber_spread_over_four_workers", 30, |stage| {
        // More workers than cores. Stealing may legitimately take a whole
        // queue from a worker the OS has not scheduled yet, so the fiber
        // spawns waves of short fibers until every worker ran one of them
        // (bounded by the watchdog).
        let exec = Executor::builder().workers(4).max_workers(4).build();
        let seen = Arc::new(Mutex::new(BTreeSet::new()));
        stage.set("one fiber spawns waves until four distinct workers were seen");
        let s = Arc::clone(&seen);
        let waves = exec
            .block_on(move || {
                let mut waves = 0;
                let start = Instant::now();
                loop {
                    waves += 1;
                    let handles: Vec<_> = (0..400u64)
                        .map(|i| {
                            let s = Arc::clone(&s);
                            spawn(move || {
                                s.lock().unwrap().insert(worker_name());
                                yield_now();
                                busy_work(i)
                            })
                        })
                        .collect();
                    let sum = handles.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add);
                    assert_eq!(sum, (0..400).map(busy_work).fold(0, u64::wrapping_add));
                    if s.lock().unwrap().len() >= 4 || start.elapsed() >= RUNAWAY {
                        break waves;
                    }
                }
            })
            .unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 4, "every worker ran a fiber ({waves} waves): {seen:?}");
        assert!(seen.iter().all(|n| n.starts_with("spindle-worker-")), "{seen:?}");
    });
}

/// A worker kept busy by a fiber that yields over and over still steals
/// now and then: a job queued on a worker whose fiber then blocks its
/// thread runs on the other worker. Here the blocked fiber waits for that
/// very job, so without the steal the two would wait for each other (with
/// no worker to spare). (From a review: the job waited out the whole
/// block.)
#[test]
fn a_worker_running_a_yielding_fiber_still_steals_a_job_behind_a_blocked_worker() {
    use std::sync::atomic::AtomicU64;
    use std::sync::mpsc;
    watchdog("a_worker_running_a_yielding_fiber_still_steals_a_job_behind_a_blocked_worker", 60, |stage| {
        fn tid() -> u64 {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            std::thread::current().id().hash(&mut h);
            h.finish() | 1
        }
        for attempt in 1..=50 {
            stage.set(format!("attempt {attempt}: a blocker and a poller on the two workers"));
            let exec = Executor::builder().workers(2).max_workers(2).build();
            let (b_tid, p_tid) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
            let (same, done) = (Flag::new(), Flag::new());
            let blocker = {
                let (b_tid, p_tid, same, done) = (b_tid.clone(), p_tid.clone(), same.clone(), done.clone());
                exec.spawn(move || {
                    b_tid.store(tid(), Ordering::SeqCst);
                    while p_tid.load(Ordering::SeqCst) == 0 {
                        yield_now();
                    }
                    if p_tid.load(Ordering::SeqCst) == b_tid.load(Ordering::SeqCst) {
                        same.set();
                        return true;
                    }
                    let (tx, rx) = mpsc::channel();
                    // Into this worker's own queue; then block the thread on it.
                    let _job = spawn(move || tx.send(()).unwrap());
                    let ran = rx.recv_timeout(Duration::from_secs(20)).is_ok();
                    done.set();
                    ran
                })
            };
            wait_for(&stage, "the blocker to start", || b_tid.load(Ordering::SeqCst) != 0);
            let poller = {
                let (p_tid, same, done) = (p_tid.clone(), same.clone(), done.clone());
                exec.spawn(move || {
                    p_tid.store(tid(), Ordering::SeqCst);
                    while !done.is_set() && !same.is_set() {
                        yield_now();
                    }
                })
            };
            let ran = blocker.join().unwrap();
            poller.join().unwrap();
            if same.is_set() {
                continue;
            }
            assert!(ran, "the job queued behind the blocked worker never ran: {:?}", exec.stats());
            return;
        }
        panic!("could not get the blocker and the poller onto different workers in 50 attempts");
    });
}
