//! Helpers shared by the workspace behaviour tests: the watchdog and child
//! process runner of `spindle-test-support`, a drop counter, a tiny
//! deterministic PRNG and a fiber constructor.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::Semaphore;
#[allow(unused_imports)] // each test binary uses a subset
pub use spindle_test_support::{
    describe, run_child_watched, watchdog, watchdog_with_progress, watchdog_with_status, Stage,
};

/// Spins (yielding the thread) until `cond` holds. Not a sleep: it waits
/// for a state, and the caller's watchdog bounds it.
pub fn spin_until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        std::thread::yield_now();
    }
}

/// Counts drops of the values it hands out.
#[derive(Clone, Default)]
pub struct DropCounter(Arc<AtomicUsize>);

/// A value that bumps its [`DropCounter`] when dropped.
#[derive(Debug)]
pub struct Counted(Arc<AtomicUsize>, pub u64);

impl DropCounter {
    /// A value whose drop is counted here.
    pub fn make(&self, v: u64) -> Counted {
        Counted(Arc::clone(&self.0), v)
    }

    /// Drops counted so far.
    pub fn drops(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A tiny deterministic PRNG (xorshift64*), enough for shuffles and random
/// priorities.
pub struct XorShift(u64);

impl XorShift {
    /// A generator from a seed (0 is replaced by a fixed non-zero seed).
    pub fn new(seed: u64) -> XorShift {
        XorShift(if seed == 0 { 0x9E37_79B9_7F4A_7C15 } else { seed })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Shuffles `v` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// A fiber with a small stack, running `f` at `priority`, pinned to the
/// thread that first runs it.
pub fn fiber<T, F>(priority: Priority, f: F) -> Fiber<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let fiber = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).expect("creating a fiber");
    fiber.set_function(priority, f).expect("setting the fiber's function");
    fiber
}

/// `n` fibers on a new run queue, each acquiring `sem` then returning its
/// index, run until every one of them sleeps on `sem` (in index order).
pub fn sleepers_on(sem: &Arc<Semaphore>, n: usize) -> RunQueue<usize> {
    let queue = RunQueue::new(n);
    for i in 0..n {
        let s = sem.clone();
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                s.acquire();
                i
            }))
            .unwrap();
    }
    while let Some(ran) = queue.run_next() {
        assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
    }
    assert_eq!(sem.waiters(), n);
    queue
}

/// A named fiber with a small stack, running `f` at `priority`, pinned to
/// the thread that first runs it.
pub fn named_fiber<T, F>(name: &str, priority: Priority, f: F) -> Fiber<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let fiber = Fiber::new(FiberAttr::new().name(name).stack_size(64 * 1024)).expect("creating a fiber");
    fiber.set_function(priority, f).expect("setting the fiber's function");
    fiber
}

/// A home that refuses every fiber, the first time only after `go`: it
/// holds the first wake inside `schedule` (the fiber `Locked`) while the
/// test does something else (another wake, a close).
#[derive(Default)]
pub struct SlowRefuser {
    pub entered: std::sync::atomic::AtomicBool,
    pub go: std::sync::atomic::AtomicBool,
}

impl spindle_fiber::Schedule<()> for SlowRefuser {
    fn schedule<'w>(&self, w: spindle_fiber::Woken<'w, ()>) -> Result<(), spindle_fiber::Woken<'w, ()>> {
        if !self.entered.swap(true, Ordering::SeqCst) {
            spin_until(|| self.go.load(Ordering::SeqCst));
        }
        Err(w)
    }
}

/// A scheduler that breaks `Schedule`'s contract: it panics in `schedule`.
pub struct PanicsInSchedule;

impl spindle_fiber::Schedule<()> for PanicsInSchedule {
    fn schedule<'w>(&self, _fiber: spindle_fiber::Woken<'w, ()>) -> Result<(), spindle_fiber::Woken<'w, ()>> {
        panic!("schedule panics");
    }
}
