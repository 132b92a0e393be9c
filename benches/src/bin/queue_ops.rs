//! Run-queue operations in plain loops, interleaved batch by batch with a
//! `std::sync::Mutex<VecDeque>` peer, for comparing two builds of the
//! queue on a noisy machine.
//!
//! ```text
//! cargo run --release -p spindle-benches --bin queue_ops [-- ROUNDS]
//! ```
//!
//! The criterion groups `run_queue_push_pop_1thread` and
//! `yield_alternation` (bench `core`) measure the same operations against
//! more peers; this binary times 41 batches per contender and round,
//! interleaved (push+pop, the mutex peer, yield alternation, push+pop,
//! ...), and prints the fastest and the median batch of each:
//!
//! * push+pop: one `try_push` and one `try_pop` of an idle fiber on a
//!   queue that already holds 16, against a push and a pop of an integer
//!   on a `Mutex<VecDeque>` of 16 (one lock each, as the queue takes);
//! * yield alternation: `run_next` on a queue of two fibers that loop on
//!   `yield_now`, so one iteration is one pop, one run to the yield and
//!   one push back.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::Instant;

use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority};
use spindle_run_queue::RunQueue;

const BATCH: u64 = 1_000_000;
const BATCHES: usize = 41;
const RESIDENT: usize = 16;

/// Nanoseconds per iteration of one batch. (Each loop binary keeps its
/// own copy: called from a library crate, the batch closures are no longer
/// inlined into it, and `round_trip`'s `run_mut` ratio moved from
/// 1.72-1.81x to 1.95-2.05x that way, the two builds alternated.)
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

fn idle_fiber() -> Fiber<()> {
    let f = Fiber::new(FiberAttr::new()).unwrap();
    f.set_function(Priority::NORMAL, || ()).unwrap();
    f
}

fn main() {
    let rounds: usize = std::env::args().nth(1).map_or(3, |a| a.parse().expect("ROUNDS is a number"));

    let queue = RunQueue::new(64);
    for _ in 0..RESIDENT {
        queue.try_push(idle_fiber()).unwrap();
    }
    let mut hand = Some(idle_fiber());
    let mut push_pop = |n| {
        for _ in 0..n {
            queue.try_push(hand.take().unwrap()).unwrap();
            hand = queue.try_pop();
        }
    };

    let deque = Mutex::new((0..RESIDENT).collect::<VecDeque<usize>>());
    let mut mutex_deque = |n| {
        let mut x = 0;
        for _ in 0..n {
            deque.lock().unwrap().push_back(black_box(x));
            x = deque.lock().unwrap().pop_front().unwrap();
        }
        black_box(x);
    };

    let alternation = RunQueue::new(8);
    for _ in 0..2 {
        let f = Fiber::new(FiberAttr::new()).unwrap();
        f.set_function(Priority::NORMAL, || loop {
            yield_now();
        })
        .unwrap();
        alternation.try_push(f).unwrap();
    }
    let mut yield_alternation = |n| {
        for _ in 0..n {
            drop(black_box(alternation.run_next()));
        }
    };

    println!("ns per iteration: fastest batch / median batch");
    for round in 1..=rounds {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..BATCHES {
            a.push(time_batch(&mut push_pop));
            b.push(time_batch(&mut mutex_deque));
            c.push(time_batch(&mut yield_alternation));
        }
        let ((af, am), (bf, bm), (cf, cm)) =
            (fastest_and_median(a), fastest_and_median(b), fastest_and_median(c));
        println!(
            "round {round}: push+pop {af:.2} / {am:.2}, Mutex<VecDeque> {bf:.2} / {bm:.2} \
             (push+pop ÷ it {:.2}), yield alternation {cf:.2} / {cm:.2}",
            af / bf
        );
    }
}
