//! Throughput check: many fibers yielding in a loop.
//!
//! ```text
//! cargo run --release -p spindle-executor --example yield_many -- [workers] [fibers] [yields]
//! ```
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| {
        a.parse::<usize>().unwrap_or_else(|_| {
            eprintln!("usage: yield_many [workers] [fibers] [yields] (whole numbers), got {a:?}");
            std::process::exit(2)
        })
    });
    let workers = args.next().unwrap_or(2);
    let fibers = args.next().unwrap_or(1000);
    let yields = args.next().unwrap_or(1000);
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
