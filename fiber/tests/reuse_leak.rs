//! Many create/run/return/reuse cycles leave the number of memory mappings
//! and the resident set flat: stacks come back to the pool and nothing
//! leaks per fiber.
//!
//! This is the only test in its binary: other tests running in parallel
//! threads would map and unmap memory and disturb the measurement.

mod common;

use common::with_watchdog;
use std::time::Instant;

use spindle_fiber::{leaked_stacks, yield_now, Fiber, FiberAttr, Priority, RunOutcome, StackPool};

/// Cycles measured. The full count in debug builds too: it takes well under
/// a second there.
const CYCLES: usize = 100_000;
/// Cycles run before the first measurement, so that allocator arenas, the
/// stack pool and the thread's lazily created state exist already.
const WARM_UP: usize = 2_000;
/// Mappings that may appear for reasons unrelated to fibers (e.g. the
/// allocator growing an arena).
const MAPS_TOLERANCE: usize = 2;
/// Resident growth tolerated, in bytes. A leak of even 16 bytes per cycle
/// would exceed it.
const RSS_TOLERANCE: usize = 1 << 20;

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .expect("reading /proc/self/maps")
        .lines()
        .count()
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("reading /proc/self/statm");
    let resident: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages in /proc/self/statm");
    // SAFETY: sysconf has no preconditions.
    resident * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
}

/// One cycle: create a fiber, run a function that yields and returns, give
/// it a second function, run that to its return, drop the fiber.
fn cycle(i: usize) {
    let fiber = Fiber::new(FiberAttr::new()).expect("creating a fiber");
    fiber
        .set_function(Priority::NORMAL, move || {
            yield_now();
            i
        })
        .unwrap();
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(v) if v == i));
    fiber.set_function(Priority::NORMAL, move || i + 1).unwrap();
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(v) if v == i + 1));
}

#[test]
fn create_run_return_reuse_cycles_leave_mappings_and_rss_flat() {
    with_watchdog(300, "reuse_leak", || {
        let n = CYCLES;
        for i in 0..WARM_UP {
            cycle(i);
        }
        let leaked0 = leaked_stacks();
        let (maps0, rss0) = (mappings(), rss_bytes());
        let start = Instant::now();
        for i in 0..n {
            cycle(i);
        }
        let elapsed = start.elapsed();
        let (maps1, rss1) = (mappings(), rss_bytes());
        eprintln!(
            "{n} cycles in {elapsed:?}: mappings {maps0} -> {maps1}, RSS {} -> {} KiB",
            rss0 / 1024,
            rss1 / 1024
        );
        assert!(
            maps1 <= maps0 + MAPS_TOLERANCE,
            "mappings grew from {maps0} to {maps1} over {n} cycles: stacks are not reused"
        );
        assert!(
            rss1 <= rss0 + RSS_TOLERANCE,
            "RSS grew from {} KiB to {} KiB over {n} cycles: something leaks per fiber",
            rss0 / 1024,
            rss1 / 1024
        );
        assert_eq!(leaked_stacks(), leaked0, "no stack was leaked");
        // One fiber at a time: the pool holds the one stack they all share.
        assert!(StackPool::global().cached() <= 1, "{:?}", StackPool::global());
    });
}
