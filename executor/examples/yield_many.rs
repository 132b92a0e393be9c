//! Throughput check: many fibers yielding in a loop.
//!
//! ```text
//! cargo run --release -p spindle-executor --example yield_many -- [workers] [fibers] [yields]
//! ```
use std::time::Instant;

use spindle_executor::MAX_WORKERS;

fn usage(got: &str) -> ! {
    eprintln!(
        "usage: yield_many [workers] [fibers] [yields] (whole numbers: 1 to {MAX_WORKERS} workers, at least one \
         fiber and one yield), got {got}"
    );
    std::process::exit(2)
}

fn main() {
    let mut args =
        std::env::args().skip(1).map(|a| a.parse::<usize>().unwrap_or_else(|_| usage(&format!("{a:?}"))));
    let workers = args.next().unwrap_or(2);
    let fibers = args.next().unwrap_or(1000);
    let yields = args.next().unwrap_or(1000);
    if !(1..=MAX_WORKERS).contains(&workers) || fibers == 0 || yields == 0 {
        usage(&format!("{workers} workers, {fibers} fibers, {yields} yields"));
    }
    let exec = spindle_executor::Executor::builder().workers(workers).max_workers(workers).build();
    let t = Instant::now();
    let hs: Vec<_> = (0..fibers)
        .map(|_| {
            exec.spawn(move || {
                for _ in 0..yields {
                    spindle_executor::yield_now();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let el = t.elapsed();
    let total = (fibers * yields) as f64;
    println!(
        "{fibers} fibers x {yields} yields on {workers} workers: {el:?}, {:.1} ns per yield, {:.2} M yields/s",
        el.as_nanos() as f64 / total,
        total / el.as_secs_f64() / 1e6
    );
}
