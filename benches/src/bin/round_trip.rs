//! The run+yield round trip in a plain loop, spindle against raw
//! corosensei, side by side in one process.
//!
//! ```text
//! cargo run --release -p spindle-benches --bin round_trip [-- ROUNDS]
//! ```
//!
//! The criterion group `run_yield_round_trip` measures the same thing
//! through criterion's `iter`; this binary is the smallest loop that can
//! drive a fiber (no harness state live across the switch), so it shows
//! what the switch path itself costs. Each of ROUNDS (default 5) rounds
//! times 51 batches of 2 million round trips per contender, interleaved
//! batch by batch (corosensei, `run_mut`, `run`, corosensei, ...), so
//! that a slow spell of the machine hits the contenders alike. Per
//! contender it reports the fastest and the median batch; the ratios are
//! the medians, over the batches, of each batch's time divided by the
//! corosensei batch just before it.

use std::hint::black_box;
use std::time::Instant;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult};
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome, DEFAULT_STACK_SIZE};

const BATCH: u64 = 2_000_000;
const BATCHES: usize = 51;

/// Nanoseconds per round trip of one batch.
fn time_batch(batch: &mut dyn FnMut(u64)) -> f64 {
    let start = Instant::now();
    batch(BATCH);
    start.elapsed().as_nanos() as f64 / BATCH as f64
}

/// (fastest, median) of `v`.
fn fastest_and_median(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2])
}

fn main() {
    let rounds: usize = std::env::args().nth(1).map_or(5, |a| a.parse().expect("ROUNDS is a number"));

    let mut co: Coroutine<(), usize, (), DefaultStack> =
        Coroutine::with_stack(DefaultStack::new(DEFAULT_STACK_SIZE).unwrap(), |y, ()| loop {
            y.suspend(0);
        });
    let mut fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    fiber
        .set_function(Priority::NORMAL, || loop {
            yield_now();
        })
        .unwrap();
    let mut coro = |n| {
        for _ in 0..n {
            match co.resume(()) {
                CoroutineResult::Yield(v) => black_box(v),
                CoroutineResult::Return(()) => unreachable!(),
            };
        }
    };
    // The closures share the fiber; each borrows it only while it runs.
    let fiber = std::cell::RefCell::new(&mut fiber);
    let mut run_mut = |n| {
        let mut fiber = fiber.borrow_mut();
        for _ in 0..n {
            match fiber.run_mut() {
                Ok(RunOutcome::Yielded(v)) => black_box(v),
                other => panic!("expected a yield, got {other:?}"),
            };
        }
    };
    let mut run = |n| {
        let fiber = fiber.borrow();
        for _ in 0..n {
            match fiber.run() {
                Ok(RunOutcome::Yielded(v)) => black_box(v),
                other => panic!("expected a yield, got {other:?}"),
            };
        }
    };

    println!("ns per round trip: fastest batch / median batch; ratios: median of per-batch ratios");
    for round in 1..=rounds {
        let (mut c, mut m, mut r, mut m_ratio, mut r_ratio) = (vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..BATCHES {
            let tc = time_batch(&mut coro);
            let tm = time_batch(&mut run_mut);
            let tr = time_batch(&mut run);
            c.push(tc);
            m.push(tm);
            r.push(tr);
            m_ratio.push(tm / tc);
            r_ratio.push(tr / tc);
        }
        let (c, m, r) = (fastest_and_median(c), fastest_and_median(m), fastest_and_median(r));
        println!(
            "round {round}: corosensei {:.2} / {:.2}, spindle run_mut {:.2} / {:.2}, spindle run {:.2} / {:.2}; \
             run_mut ÷ corosensei {:.2}, run ÷ corosensei {:.2}",
            c.0,
            c.1,
            m.0,
            m.1,
            r.0,
            r.1,
            fastest_and_median(m_ratio).1,
            fastest_and_median(r_ratio).1,
        );
    }
}
