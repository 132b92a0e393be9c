//! Throughput check: spawn and join many trivial fibers, from the main
//! thread and from a fiber inside the pool.
//!
//! ```text
//! cargo run --release -p spindle-executor --example spawn_many -- [workers] [fiber]
//! ```
//!
//! Workers default to 2. With `fiber` as the second argument, the run from
//! the main thread is cut to a single spawn (its line still prints), so
//! only the spawns from inside a fiber are measured.
use std::time::Instant;

fn main() {
    let usage = || -> ! {
        eprintln!(
            "usage: spawn_many [workers] [fiber]   (workers: a whole number from 1 to {}, default 2)",
            spindle_executor::MAX_WORKERS
        );
        std::process::exit(2)
    };
    let workers = match std::env::args().nth(1) {
        None => 2,
        Some(a) => a.parse().unwrap_or_else(|_| usage()),
    };
    if !(1..=spindle_executor::MAX_WORKERS).contains(&workers) {
        usage();
    }
    if std::env::args().nth(2).is_some_and(|a| a != "fiber") {
        usage();
    }
    let exec = spindle_executor::Executor::builder().workers(workers).max_workers(workers).build();
    let n = 1_000_000u64;

    let only_fiber = std::env::args().nth(2).is_some_and(|a| a == "fiber");
    let t = Instant::now();
    let n1 = if only_fiber { 1 } else { n };
    let hs: Vec<_> = (0..n1).map(|i| exec.spawn(move || i)).collect();
    let s: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
    let el = t.elapsed();
    assert_eq!(s, n1 * (n1 - 1) / 2);
    println!("from a thread: {n1} spawn+join in {el:?}: {:.2} M/s", n1 as f64 / el.as_secs_f64() / 1e6);

    let t = Instant::now();
    let s = exec
        .block_on(move || {
            let hs: Vec<_> = (0..n).map(|i| spindle_executor::spawn(move || i)).collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>()
        })
        .unwrap();
    let el = t.elapsed();
    assert_eq!(s, n * (n - 1) / 2);
    println!("from a fiber:  {n} spawn+join in {el:?}: {:.2} M/s", n as f64 / el.as_secs_f64() / 1e6);
    println!("{:?}", exec.stats());
}
