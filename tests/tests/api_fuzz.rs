//! Everything the public API allows, done to a handful of shared fibers by
//! several threads at once: random runs, `set_function`s, wakes,
//! interrupts, refused wakes and `take_back`, `abandon`, `pin_to`,
//! queueing on user schedulers that sometimes refuse, re-homing, handles
//! dropped (inside and outside `defer_releases`) and stolen for `run_mut`
//! and the exclusive-handle queue transitions (`mark_queued_mut`).
//! The fibers' bodies yield, sleep on published waiters, wait on a
//! semaphore (plainly and interruptibly), run nested fibers and suspend
//! with them suspended, catch forced unwinds, panic, and have destructors
//! that yield, wake themselves or look at the current fiber.
//!
//! What must hold: no call panics or aborts inside the library (a worker
//! thread that panics fails the test), nothing hangs (a watchdog fails the
//! test if no operation completes for a minute), and every kind of run
//! outcome happens (so the test exercises what it claims). Memory errors
//! are AddressSanitizer's to find: run it under ASan with the command in
//! DESIGN.md, "Model checking".
//!
//! `API_FUZZ_OPS` (default 400,000 operations in all) and `API_FUZZ_SEED`
//! change the run.

mod common;

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::{watchdog_with_progress, XorShift};
use spindle_fiber::{
    defer_releases, sleep, take_interrupt, yield_now, yield_value, Fiber, FiberAttr, Priority, RunOutcome,
    Schedule, ThreadToken, Waiter, Woken,
};
use spindle_sync::Semaphore;

/// A user scheduler: a plain queue, refusing wakes while `refuse` is set.
#[derive(Default)]
struct Home {
    queue: Mutex<VecDeque<Fiber<u64>>>,
    refuse: AtomicBool,
}

impl Schedule<u64> for Home {
    fn schedule<'w>(&self, woken: Woken<'w, u64>) -> Result<(), Woken<'w, u64>> {
        if self.refuse.load(Ordering::Relaxed) {
            return Err(woken);
        }
        let fiber = woken.into_queued();
        self.queue.lock().unwrap().push_back(fiber);
        Ok(())
    }
}

/// Run outcomes seen, by kind.
#[derive(Default)]
struct Outcomes {
    yielded: AtomicU64,
    returned: AtomicU64,
    slept: AtomicU64,
    panicked: AtomicU64,
    refused: AtomicU64,
}

impl Outcomes {
    fn count(&self, outcome: Result<RunOutcome<u64>, spindle_fiber::FiberError>) {
        let which = match outcome {
            Ok(RunOutcome::Yielded(_)) => &self.yielded,
            Ok(RunOutcome::Returned(_)) => &self.returned,
            Ok(RunOutcome::Slept) => &self.slept,
            Ok(RunOutcome::Panicked(_)) => &self.panicked,
            Err(_) => &self.refused,
        };
        which.fetch_add(1, Ordering::Relaxed);
    }

    fn summary(&self) -> String {
        format!(
            "yielded {}, returned {}, slept {}, panicked {}, refused {}",
            self.yielded.load(Ordering::Relaxed),
            self.returned.load(Ordering::Relaxed),
            self.slept.load(Ordering::Relaxed),
            self.panicked.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed)
        )
    }
}

struct World {
    slots: Vec<Mutex<Option<Fiber<u64>>>>,
    waiters: Mutex<Vec<Waiter>>,
    sem: Arc<Semaphore>,
    homes: [Arc<Home>; 2],
    ops: AtomicU64,
    max_ops: u64,
    outcomes: Outcomes,
    /// The worker threads, for `pin_to`.
    threads: Mutex<Vec<ThreadToken>>,
}

/// A local whose destructor does what destructors on a fiber's stack may
/// do: yield (not while panicking), wake its own fiber, read `current()`.
struct Noisy(u64);

impl Drop for Noisy {
    fn drop(&mut self) {
        match self.0 % 4 {
            0 if !std::thread::panicking() => yield_now(),
            1 => {
                if let Some(w) = Waiter::current() {
                    w.wake();
                }
            }
            2 => {
                let _ = spindle_fiber::current();
            }
            _ => {}
        }
    }
}

/// Gives a semaphore token back when dropped (also by an unwind).
struct Permit(Arc<Semaphore>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.release(1);
    }
}

fn body(world: Arc<World>, seed: u64) -> impl FnOnce() -> u64 + Send + 'static {
    move || {
        let mut rng = XorShift::new(seed);
        let _noisy = Noisy(rng.next_u64());
        let mut acc = 0u64;
        for _ in 0..rng.below(12) {
            match rng.below(9) {
                0 | 1 => yield_value(rng.below(5) as usize),
                2 => {
                    // Publish a waiter, then sleep until someone wakes it.
                    if let Some(w) = Waiter::current() {
                        world.waiters.lock().unwrap().push(w);
                        sleep();
                    }
                }
                3 => {
                    let sem = world.sem.clone();
                    if sem.acquire_interruptible().is_ok() {
                        let _permit = Permit(sem);
                        yield_now();
                    }
                }
                4 => {
                    // A nested fiber, maybe left suspended on this stack
                    // while this fiber suspends.
                    let child = Fiber::<u64>::new(FiberAttr::new().stack_size(32 * 1024)).unwrap();
                    let k = rng.below(3);
                    child
                        .set_function(Priority::NORMAL, move || {
                            let _noisy = Noisy(1 + k % 2);
                            for _ in 0..k {
                                yield_now();
                            }
                            k
                        })
                        .unwrap();
                    let _ = child.run();
                    yield_now();
                    if rng.below(2) == 0 {
                        let _ = child.run();
                    }
                }
                5 => {
                    // Catches the forced unwind of a drop, then returns.
                    if catch_unwind(AssertUnwindSafe(yield_now)).is_err() {
                        return 7;
                    }
                }
                6 => {
                    if take_interrupt() {
                        acc += 100;
                    }
                }
                7 => {
                    if rng.below(8) == 0 {
                        // No panic hook, no report: thousands of these
                        // would flood the test's output.
                        std::panic::resume_unwind(Box::new("a fuzzed panic"));
                    }
                }
                _ => {
                    let sem = world.sem.clone();
                    sem.acquire();
                    let _permit = Permit(sem);
                }
            }
            acc += 1;
        }
        acc
    }
}

/// Every 64 operations: wakes what waits, so that the fibers keep moving.
fn unstick(world: &World) {
    if world.sem.waiters() > 4 {
        world.sem.release(world.sem.waiters());
    }
    let waiters: Vec<Waiter> = {
        let mut w = world.waiters.lock().unwrap();
        if w.len() > 32 {
            w.drain(..).collect()
        } else {
            Vec::new()
        }
    };
    for w in waiters {
        w.wake();
    }
    for home in &world.homes {
        let queued: Vec<Fiber<u64>> = {
            let mut q = home.queue.lock().unwrap();
            if q.len() > 32 {
                q.drain(..).collect()
            } else {
                Vec::new()
            }
        };
        for fiber in queued {
            let _ = fiber.mark_dequeued();
            if fiber.may_run_here() {
                world.outcomes.count(fiber.run());
            }
        }
    }
}

fn worker(world: Arc<World>, seed: u64) {
    let mut rng = XorShift::new(seed);
    let slots = world.slots.len() as u64;
    world.threads.lock().unwrap().push(ThreadToken::current());
    while world.ops.fetch_add(1, Ordering::Relaxed) < world.max_ops {
        if rng.below(64) == 0 {
            unstick(&world);
        }
        let i = rng.below(slots) as usize;
        let Some(fiber) = world.slots[i].lock().unwrap().clone() else {
            let fresh = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
            *world.slots[i].lock().unwrap() = Some(fresh);
            continue;
        };
        match rng.below(16) {
            0..=3 => world.outcomes.count(fiber.run()),
            4 => {
                let _ =
                    fiber.set_function(Priority(rng.below(256) as u8), body(world.clone(), rng.next_u64()));
            }
            5 => {
                let waiter = {
                    let mut w = world.waiters.lock().unwrap();
                    let n = w.len() as u64;
                    (n > 0).then(|| w.swap_remove(rng.below(n) as usize))
                };
                if let Some(w) = waiter {
                    match rng.below(4) {
                        0 => w.wake(),
                        1 => w.interrupt(),
                        2 => {
                            w.set_priority(Priority(3));
                            let _ = w.try_wake();
                        }
                        _ => {
                            if let Err(mut refused) = w.try_wake() {
                                if let Some(next) = refused.take_back() {
                                    next.wake();
                                }
                            }
                        }
                    }
                }
            }
            6 => fiber.interrupt(),
            7 => {
                let _ = fiber.abandon();
            }
            8 => {
                let home: Arc<dyn Schedule<u64>> = world.homes[rng.below(2) as usize].clone();
                // Either form: `mark_queued_mut` on a second handle is the
                // shared call (a slot keeps one), which must answer alike.
                let queued = if rng.below(2) == 0 {
                    fiber.mark_queued(Some(&home))
                } else {
                    fiber.clone().mark_queued_mut(Some(&home))
                };
                if queued.is_ok() {
                    world.homes[0].queue.lock().unwrap().push_back(fiber.clone());
                }
            }
            9 => {
                let popped = world.homes[rng.below(2) as usize].queue.lock().unwrap().pop_front();
                if let Some(mut p) = popped {
                    let _ = if rng.below(2) == 0 { p.mark_dequeued() } else { p.mark_dequeued_mut() };
                    if rng.below(2) == 0 {
                        world.outcomes.count(p.run());
                    }
                }
            }
            10 => {
                let home: Arc<dyn Schedule<u64>> = world.homes[rng.below(2) as usize].clone();
                let _ = fiber.set_home(if rng.below(2) == 0 { Some(&home) } else { None });
            }
            11 => {
                // Drops the slot's handle, maybe the last one, on the
                // fiber's own thread (elsewhere it would only be leaked).
                if fiber.may_run_here() {
                    let old = world.slots[i].lock().unwrap().take();
                    if rng.below(2) == 0 {
                        defer_releases(|| drop(old));
                    } else {
                        drop(old);
                    }
                }
            }
            12 => {
                let home = &world.homes[rng.below(2) as usize];
                home.refuse.store(rng.below(3) == 0, Ordering::Relaxed);
            }
            13 => {
                // Pins an unstarted function to some worker (refused for
                // anything else).
                let to = {
                    let t = world.threads.lock().unwrap();
                    t[rng.below(t.len() as u64) as usize]
                };
                let _ = fiber.pin_to(to);
                let _ = fiber.stats();
                let _ = format!("{fiber:?}");
                let _ = fiber.wait_site();
            }
            14 => {
                let _ = fiber.waiter().try_wake();
            }
            _ => {
                // Takes the slot's handle, drops the shared clone, and runs
                // with `run_mut` (unique if nobody else holds one).
                let mut mine = world.slots[i].lock().unwrap().take();
                drop(fiber);
                if let Some(m) = mine.as_mut() {
                    // Sometimes a round trip through the exclusive-handle
                    // queue transitions first (plain stores when unique).
                    if rng.below(4) == 0 && m.mark_queued_mut(None).is_ok() {
                        let _ = m.mark_dequeued_mut();
                    }
                    world.outcomes.count(m.run_mut());
                }
                *world.slots[i].lock().unwrap() = mine;
            }
        }
    }
}

#[test]
fn shared_fibers_survive_everything_the_api_allows() {
    let max_ops =
        std::env::var("API_FUZZ_OPS").map_or(400_000, |v| v.parse().expect("API_FUZZ_OPS is a number"));
    let seed: u64 =
        std::env::var("API_FUZZ_SEED").map_or(0x9E37_79B9_7F4A_7C15, |v| v.parse().expect("a number"));
    let world = Arc::new(World {
        slots: (0..6).map(|_| Mutex::new(None)).collect(),
        waiters: Mutex::new(Vec::new()),
        sem: Arc::new(Semaphore::new(1)),
        homes: [Arc::new(Home::default()), Arc::new(Home::default())],
        ops: AtomicU64::new(0),
        max_ops,
        outcomes: Outcomes::default(),
        threads: Mutex::new(Vec::new()),
    });
    let (progress, status) = (world.clone(), world.clone());
    let summary = watchdog_with_progress(
        "shared_fibers_survive_everything_the_api_allows",
        60,
        move || format!("seed {seed}: {}", status.outcomes.summary()),
        move || progress.ops.load(Ordering::Relaxed),
        move |stage| {
            stage.set("fuzzing");
            let threads: Vec<_> = (1..=4u64)
                .map(|t| {
                    let world = world.clone();
                    std::thread::spawn(move || worker(world, seed.wrapping_mul(t)))
                })
                .collect();
            let panicked = threads.into_iter().map(|t| t.join()).filter(Result::is_err).count();
            assert_eq!(panicked, 0, "seed {seed}: a worker thread panicked inside the library");
            stage.set("dropping what is left");
            // Let the sleepers go, then drop every handle on this thread
            // (pinned ones elsewhere are leaked, as documented).
            world.sem.release(world.sem.waiters());
            for w in world.waiters.lock().unwrap().drain(..) {
                w.wake();
            }
            for home in &world.homes {
                home.queue.lock().unwrap().clear();
            }
            for slot in &world.slots {
                slot.lock().unwrap().take();
            }
            let o = &world.outcomes;
            let seen = [&o.yielded, &o.returned, &o.slept, &o.panicked].map(|c| c.load(Ordering::Relaxed));
            (seen, o.summary())
        },
    );
    let (seen, summary) = summary;
    println!("seed {seed}, {max_ops} operations: {summary}");
    assert!(seen.iter().all(|&n| n > 0), "seed {seed}: every kind of run outcome should occur ({summary})");
}
