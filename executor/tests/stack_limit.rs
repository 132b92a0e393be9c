//! Spawning more fibers than the kernel can map stacks for queues the extra
//! jobs instead of failing or crashing: each guarded stack costs two of
//! `vm.max_map_count`'s mappings (65,530 by default, about 32,000 stacks).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::watchdog;
use spindle_executor::Executor;
use spindle_sync::Semaphore;

fn max_map_count() -> usize {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65_530)
}

#[test]
fn spawns_beyond_the_mapping_limit_wait_for_stacks() {
    watchdog("spawns_beyond_the_mapping_limit_wait_for_stacks", 120, |stage| {
        // Enough fibers that, all started and asleep at once, their stacks
        // would need more mappings than the kernel allows.
        let n = max_map_count() / 2 + 4_000;
        let exec = Executor::builder().workers(2).max_workers(2).stack_size(16 * 1024).build();
        let gate = Arc::new(Semaphore::new(0));
        let started = Arc::new(AtomicUsize::new(0));
        stage.set(format!("spawning {n} fibers that wait on a semaphore"));
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (gate, started) = (gate.clone(), started.clone());
                exec.spawn(move || {
                    started.fetch_add(1, Ordering::Relaxed);
                    gate.acquire();
                    i
                })
            })
            .collect();

        stage.set("waiting until no more fibers can start");
        let mut last = 0;
        let mut since = Instant::now();
        while started.load(Ordering::Relaxed) < n && since.elapsed() < Duration::from_millis(500) {
            let now = started.load(Ordering::Relaxed);
            if now != last {
                last = now;
                since = Instant::now();
            }
            std::thread::yield_now();
        }
        let at_limit = started.load(Ordering::Relaxed);
        assert!(at_limit > 0, "no fiber started");
        assert!(
            at_limit < n,
            "all {n} fibers started at once: the mapping limit was not reached ({at_limit} started)"
        );

        stage.set(format!("{at_limit} of {n} started; releasing them all"));
        gate.release(n);
        let sum: usize = handles.into_iter().map(|h| h.join().expect("every fiber completes")).sum();
        assert_eq!(sum, n * (n - 1) / 2);
        assert_eq!(started.load(Ordering::Relaxed), n);
    });
}
