//! Throughput check: spawn and join many trivial fibers.
use std::time::Instant;
fn main() {
    let workers = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let exec = spindle_executor::Executor::builder()
        .workers(workers)
        .max_workers(workers)
        .build();
    let n = 1_000_000u64;
    let t = Instant::now();
    let hs: Vec<_> = (0..n).map(|i| exec.spawn(move || i)).collect();
    let spawned = t.elapsed();
    let s: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
    let el = t.elapsed();
    assert_eq!(s, n * (n - 1) / 2);
    println!(
        "{n} spawn+join in {el:?} (spawn phase {spawned:?}): {:.2} M/s; {:?}",
        n as f64 / el.as_secs_f64() / 1e6,
        exec.stats()
    );
}
