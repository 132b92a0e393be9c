//! What one store costs in a run+yield round trip: raw corosensei with 0
//! to 5 extra stores per round trip, next to spindle's `run_mut`, in one
//! process.
//!
//! ```text
//! cargo run --release -p spindle-benches --bin round_trip_stores [-- ROUNDS]
//! ```
//!
//! The round trip of raw corosensei is short enough that on some machines
//! it is bound by stores (its switch code and the caller's loop make nine
//! per round trip). If each added store adds a fixed time, the fitted
//! slope is that time, and `run_mut` placed on the fitted line says how
//! many stores' worth of work spindle's bookkeeping adds (the
//! current-fiber word, the state word, the run counter). BENCHMARKS.md,
//! "Why the round trip still misses 1.3x", has the figures and what they
//! mean for the target.
//!
//! The extra stores go to separate words of a heap record through
//! volatile writes, about half before the switch and half after it, as
//! spindle's do. Each of ROUNDS (default 3) rounds times 31 batches of 2
//! million round trips per contender, interleaved batch by batch, and
//! reports the median batch of each.

use std::hint::black_box;
use std::ptr::write_volatile;
use std::time::Instant;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult};
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome, DEFAULT_STACK_SIZE};

const BATCH: u64 = 2_000_000;
const BATCHES: usize = 31;

type Coro = Coroutine<(), usize, (), DefaultStack>;

/// Where the extra stores go: one word each, as a fiber's header fields.
#[derive(Default)]
struct Record {
    words: [u64; 8],
}

/// `n` round trips of `co`, with `STORES` extra stores per round trip.
/// One function per count (a const generic), so that each loop is as
/// tight as the compiler makes it.
#[inline(never)]
fn coro_with_stores<const STORES: usize>(co: &mut Coro, rec: &mut Record, n: u64) {
    let w = rec.words.as_mut_ptr();
    for i in 0..n {
        // SAFETY: `w` points to eight words; STORES is at most 5.
        unsafe {
            for k in 0..STORES.div_ceil(2) {
                write_volatile(w.add(k), i);
            }
        }
        match co.resume(()) {
            CoroutineResult::Yield(v) => black_box(v),
            CoroutineResult::Return(()) => unreachable!(),
        };
        // SAFETY: as above.
        unsafe {
            for k in STORES.div_ceil(2)..STORES {
                write_volatile(w.add(k), i);
            }
        }
    }
}

#[inline(never)]
fn spindle_run_mut(fiber: &mut Fiber<()>, n: u64) {
    for _ in 0..n {
        match fiber.run_mut() {
            Ok(RunOutcome::Yielded(v)) => black_box(v),
            other => panic!("expected a yield, got {other:?}"),
        };
    }
}

fn time_batch(batch: &mut dyn FnMut(u64)) -> f64 {
    let start = Instant::now();
    batch(BATCH);
    start.elapsed().as_nanos() as f64 / BATCH as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args().nth(1).map_or(3, |a| a.parse().expect("ROUNDS is a number"));

    // Boxed, as a fiber is: its coroutine is reached through a pointer.
    let mut co: Box<Coro> =
        Box::new(Coroutine::with_stack(DefaultStack::new(DEFAULT_STACK_SIZE).unwrap(), |y, ()| loop {
            y.suspend(0);
        }));
    let mut rec = Box::<Record>::default();
    let mut fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    fiber
        .set_function(Priority::NORMAL, || loop {
            yield_now();
        })
        .unwrap();

    let coro_loops: [fn(&mut Coro, &mut Record, u64); 6] = [
        coro_with_stores::<0>,
        coro_with_stores::<1>,
        coro_with_stores::<2>,
        coro_with_stores::<3>,
        coro_with_stores::<4>,
        coro_with_stores::<5>,
    ];
    println!("ns per round trip, median of {BATCHES} batches of {BATCH}");
    for round in 1..=rounds {
        let mut coro_times = vec![vec![]; coro_loops.len()];
        let mut spindle_times = vec![];
        for _ in 0..BATCHES {
            for (times, run) in coro_times.iter_mut().zip(coro_loops) {
                times.push(time_batch(&mut |n| run(&mut co, &mut rec, n)));
            }
            spindle_times.push(time_batch(&mut |n| spindle_run_mut(&mut fiber, n)));
        }
        let coro: Vec<f64> = coro_times.into_iter().map(median).collect();
        let spindle = median(spindle_times);
        // Least-squares slope of time against the number of stores, over
        // 1..=5: the loops with at least one store share one shape (the
        // coroutine pointer reloaded from the stack after the switch); with
        // none the compiler keeps it in a preserved register instead, a
        // different loop (see BENCHMARKS.md).
        let xs: Vec<(f64, f64)> = coro.iter().enumerate().skip(1).map(|(x, &y)| (x as f64, y)).collect();
        let n = xs.len() as f64;
        let mean_x = xs.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = xs.iter().map(|p| p.1).sum::<f64>() / n;
        let sxy: f64 = xs.iter().map(|(x, y)| (x - mean_x) * (y - mean_y)).sum();
        let sxx: f64 = xs.iter().map(|(x, _)| (x - mean_x).powi(2)).sum();
        let slope = sxy / sxx;
        let intercept = mean_y - slope * mean_x;
        let cells: Vec<String> = coro.iter().map(|t| format!("{t:.2}")).collect();
        println!(
            "round {round}: corosensei + 0..5 stores: {}; {slope:.3} ns per store (fit over 1..5, \
             intercept {intercept:.2}); spindle run_mut {spindle:.2} = corosensei + {:.1} stores by the fit",
            cells.join(" / "),
            (spindle - intercept) / slope,
        );
    }
}
