//! Spawning more fibers than the kernel can map stacks for queues the extra
//! jobs instead of failing or crashing: each guarded stack costs two of
//! `vm.max_map_count`'s mappings (65,530 by default, about 32,000 stacks).
//! (Address-space limits are tested in `address_space.rs`: this test takes
//! its process to the mapping limit, where starting a child process or a
//! thread can fail.)

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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
        let limit = max_map_count();
        if limit > 200_000 {
            // Hundreds of thousands of fibers would take gigabytes here.
            eprintln!(
                "skipped: vm.max_map_count is {limit}; this test needs a limit near the default \
                 65,530 to reach it cheaply"
            );
            return;
        }
        let n = limit / 2 + 4_000;
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

        // Every started fiber stays asleep until the gate opens, so either
        // all of them start (the limit was not reached: a failure) or a
        // worker fails to map a stack and puts a job back.
        stage.set("waiting until a job waits for a stack (or every fiber started)");
        while exec.stats().stack_waits == 0 && started.load(Ordering::Relaxed) < n {
            std::thread::yield_now();
        }
        let at_limit = started.load(Ordering::Relaxed);
        assert!(
            exec.stats().stack_waits > 0,
            "all {n} fibers started at once: the mapping limit was not reached"
        );
        assert!(at_limit > 0 && at_limit < n, "{at_limit} of {n} started");

        stage.set(format!("{at_limit} of {n} started; releasing them all"));
        gate.release(n);
        let sum: usize = handles.into_iter().map(|h| h.join().expect("every fiber completes")).sum();
        assert_eq!(sum, n * (n - 1) / 2);
        assert_eq!(started.load(Ordering::Relaxed), n);
    });
}
