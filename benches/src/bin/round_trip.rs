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
//! times 21 batches of 10 million round trips for each contender, the
//! contenders interleaved, and reports per contender the fastest batch and
//! the median batch; the ratio line divides spindle's by corosensei's,
//! round by round. On a noisy machine the fastest batch is the steadier
//! figure: noise only ever adds time.

use std::hint::black_box;
use std::time::Instant;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult};
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome, DEFAULT_STACK_SIZE};

const BATCH: u64 = 10_000_000;
const BATCHES: usize = 21;

/// (fastest, median) nanoseconds per round trip over `BATCHES` batches.
fn measure(mut batch: impl FnMut(u64)) -> (f64, f64) {
    let mut per_trip: Vec<f64> = (0..BATCHES)
        .map(|_| {
            let start = Instant::now();
            batch(BATCH);
            start.elapsed().as_nanos() as f64 / BATCH as f64
        })
        .collect();
    per_trip.sort_by(f64::total_cmp);
    (per_trip[0], per_trip[BATCHES / 2])
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

    println!("ns per round trip: fastest batch / median batch");
    for round in 1..=rounds {
        let coro = measure(|n| {
            for _ in 0..n {
                match co.resume(()) {
                    CoroutineResult::Yield(v) => black_box(v),
                    CoroutineResult::Return(()) => unreachable!(),
                };
            }
        });
        let run_mut = measure(|n| {
            for _ in 0..n {
                match fiber.run_mut() {
                    Ok(RunOutcome::Yielded(v)) => black_box(v),
                    other => panic!("expected a yield, got {other:?}"),
                };
            }
        });
        let run = measure(|n| {
            for _ in 0..n {
                match fiber.run() {
                    Ok(RunOutcome::Yielded(v)) => black_box(v),
                    other => panic!("expected a yield, got {other:?}"),
                };
            }
        });
        println!(
            "round {round}: corosensei {:.2} / {:.2}, spindle run_mut {:.2} / {:.2}, spindle run {:.2} / {:.2}; \
             run_mut ÷ corosensei {:.2} (fastest) {:.2} (median), run ÷ corosensei {:.2} / {:.2}",
            coro.0,
            coro.1,
            run_mut.0,
            run_mut.1,
            run.0,
            run.1,
            run_mut.0 / coro.0,
            run_mut.1 / coro.1,
            run.0 / coro.0,
            run.1 / coro.1,
        );
    }
}
