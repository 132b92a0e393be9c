//! `spindle-executor` against its peers on 2 workers, measured side by side
//! in one run.
//!
//! ```text
//! cargo bench -p spindle-benches --bench executor
//! ```
//!
//! Groups (each holds spindle and its peers):
//!
//! * `spawn_join_100k`: 100,000 trivial spawns, then 100,000 joins, per
//!   iteration: from a fiber inside the pool (`block_on` that spawns and
//!   joins) and from the main thread; against tokio multi-thread (from a
//!   task inside the pool, and from `block_on` on the main thread), `may`
//!   (`go!` + `join`, from a coroutine and from the main thread, in chunks
//!   of 10,000 live coroutines: each of its guarded stacks costs two of the
//!   kernel's `vm.max_map_count` mappings, so 1,000,000 at once cannot
//!   exist; its coroutine pool is set to 10,000 so stacks are reused), and
//!   rayon (`scope` + `spawn`, closures without stacks).
//! * `yield_1000x1000`: 1,000 fibers each yielding 1,000 times, per
//!   iteration, against tokio multi-thread `yield_now` and `may`
//!   `yield_now`.
//!
//! Every pool has exactly 2 workers (spindle cannot scale up here); each pool
//! is built just before its benchmark and shut down right after, so it does
//! not disturb the others (may's workers cannot be shut down: its
//! benchmarks run last in each group).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use spindle_executor::Executor;

const WORKERS: usize = 2;
/// Spawns+joins per iteration.
const SPAWNS: u64 = 100_000;
/// Live coroutines at once in the `may` spawn benchmarks.
const MAY_CHUNK: u64 = 10_000;
const YIELDERS: usize = 1_000;
const YIELDS: usize = 1_000;

fn spindle_executor() -> Executor {
    Executor::builder().workers(WORKERS).max_workers(WORKERS).build()
}

fn tokio_multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(WORKERS).build().unwrap()
}

fn may_config() {
    // Must come before may's first use in this process; every may
    // benchmark here wants the same values. A coroutine pool as large as a
    // chunk lets may reuse its stacks, as spindle reuses its pooled ones
    // (with may's default pool of 1,000, every coroutine beyond it maps and
    // unmaps a fresh stack).
    may::config().set_workers(WORKERS).set_pool_capacity(MAY_CHUNK as usize);
}

/// Spawns `n` trivial coroutines and joins them, at most `MAY_CHUNK` alive
/// at once.
fn may_spawn_join(n: u64) -> u64 {
    let mut sum = 0;
    let mut start = 0;
    while start < n {
        let end = (start + MAY_CHUNK).min(n);
        // may's `go!` is unsafe to call inside: the coroutines keep no
        // thread-local references across their (absent) suspensions.
        let hs: Vec<_> = (start..end).map(|i| may::go!(move || black_box(i))).collect();
        sum += hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>();
        start = end;
    }
    sum
}

fn spawn_join(c: &mut Criterion) {
    let mut g = c.benchmark_group("spawn_join_100k");
    g.throughput(Throughput::Elements(SPAWNS)).sampling_mode(SamplingMode::Flat);
    let expected = SPAWNS * (SPAWNS - 1) / 2;

    {
        let exec = spindle_executor();
        g.bench_function("spindle_from_fiber", |b| {
            b.iter(|| {
                let sum = exec
                    .block_on(|| {
                        let hs: Vec<_> =
                            (0..SPAWNS).map(|i| spindle_executor::spawn(move || black_box(i))).collect();
                        hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>()
                    })
                    .unwrap();
                assert_eq!(sum, expected);
            });
        });
        g.bench_function("spindle_from_thread", |b| {
            b.iter(|| {
                let hs: Vec<_> = (0..SPAWNS).map(|i| exec.spawn(move || black_box(i))).collect();
                let sum: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
                assert_eq!(sum, expected);
            });
        });
    }

    {
        let rt = tokio_multi_thread();
        g.bench_function("tokio_from_task", |b| {
            b.iter(|| {
                let sum = rt
                    .block_on(rt.spawn(async {
                        let hs: Vec<_> =
                            (0..SPAWNS).map(|i| tokio::spawn(async move { black_box(i) })).collect();
                        let mut sum = 0;
                        for h in hs {
                            sum += h.await.unwrap();
                        }
                        sum
                    }))
                    .unwrap();
                assert_eq!(sum, expected);
            });
        });
        g.bench_function("tokio_from_block_on", |b| {
            b.iter(|| {
                let sum = rt.block_on(async {
                    let hs: Vec<_> = (0..SPAWNS).map(|i| tokio::spawn(async move { black_box(i) })).collect();
                    let mut sum = 0;
                    for h in hs {
                        sum += h.await.unwrap();
                    }
                    sum
                });
                assert_eq!(sum, expected);
            });
        });
    }

    {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(WORKERS).build().unwrap();
        g.bench_function("rayon_scope_spawn", |b| {
            b.iter(|| {
                pool.scope(|s| {
                    for i in 0..SPAWNS {
                        s.spawn(move |_| {
                            black_box(i);
                        });
                    }
                });
            });
        });
    }

    may_config();
    g.bench_function("may_from_coroutine", |b| {
        b.iter(|| {
            // See may_spawn_join for the safety note on `go!`.
            let sum = may::go!(|| may_spawn_join(SPAWNS)).join().unwrap();
            assert_eq!(sum, expected);
        });
    });
    g.bench_function("may_from_thread", |b| {
        b.iter(|| assert_eq!(may_spawn_join(SPAWNS), expected));
    });

    g.finish();
}

fn yield_heavy(c: &mut Criterion) {
    let mut g = c.benchmark_group("yield_1000x1000");
    g.throughput(Throughput::Elements((YIELDERS * YIELDS) as u64)).sampling_mode(SamplingMode::Flat);

    {
        let exec = spindle_executor();
        g.bench_function("spindle", |b| {
            b.iter(|| {
                let hs: Vec<_> = (0..YIELDERS)
                    .map(|_| {
                        exec.spawn(|| {
                            for _ in 0..YIELDS {
                                spindle_executor::yield_now();
                            }
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().unwrap();
                }
            });
        });
    }

    {
        let rt = tokio_multi_thread();
        g.bench_function("tokio", |b| {
            b.iter(|| {
                rt.block_on(async {
                    let hs: Vec<_> = (0..YIELDERS)
                        .map(|_| {
                            tokio::spawn(async {
                                for _ in 0..YIELDS {
                                    tokio::task::yield_now().await;
                                }
                            })
                        })
                        .collect();
                    for h in hs {
                        h.await.unwrap();
                    }
                });
            });
        });
    }

    may_config();
    g.bench_function("may", |b| {
        b.iter(|| {
            // may's `go!` is unsafe to call inside: the coroutines keep no
            // thread-local references across their suspensions.
            let hs: Vec<_> = (0..YIELDERS)
                .map(|_| {
                    may::go!(|| {
                        for _ in 0..YIELDS {
                            may::coroutine::yield_now();
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        });
    });

    g.finish();
}

fn config() -> Criterion {
    // Two noisy cores; each iteration is a whole batch (tens of ms), so
    // flat sampling with fewer, longer samples; medians are quoted.
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(8))
        .noise_threshold(0.05)
}

criterion_group! {
    name = benches;
    config = config();
    targets = spawn_join, yield_heavy
}
criterion_main!(benches);
