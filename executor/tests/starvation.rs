//! CPU hogs that never yield do not starve other fibers: on a pool of the
//! base size sysmon scales up, and with no room to scale a hog that calls
//! `yield_if_needed` is preempted once its time slice is over.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{wait_for, wait_within, watchdog, Flag};
use spindle_executor::{yield_if_needed, Executor};

/// How long the hogs spin at most: the test sets their stop flag as soon as
/// the starved fiber completed, or after this bound (and then fails).
const HOG_BOUND: Duration = Duration::from_secs(5);
/// How soon the starved fiber must complete.
const COMPLETE_WITHIN: Duration = Duration::from_secs(2);

#[test]
fn two_non_yielding_hogs_do_not_starve_a_third_fiber() {
    watchdog("two_non_yielding_hogs_do_not_starve_a_third_fiber", 30, |stage| {
        let exec = Executor::builder().workers(2).max_workers(4).build();
        let stop = Flag::new();
        let hogging = Arc::new(AtomicUsize::new(0));
        stage.set("starting two hogs that spin until told to stop");
        let hogs: Vec<_> = (0..2)
            .map(|_| {
                let (stop, hogging) = (stop.clone(), Arc::clone(&hogging));
                exec.spawn(move || {
                    hogging.fetch_add(1, Ordering::SeqCst);
                    let start = Instant::now();
                    // Busy loop with no suspension point.
                    while !stop.is_set() && start.elapsed() < HOG_BOUND {
                        std::hint::spin_loop();
                    }
                    stop.is_set()
                })
            })
            .collect();
        wait_for(&stage, "both hogs to hold a worker", || hogging.load(Ordering::SeqCst) == 2);

        stage.set("a third fiber behind the hogs");
        let spawned = Instant::now();
        let third = exec.spawn(move || 42);
        let completed = wait_within(COMPLETE_WITHIN, || third.is_finished());
        let took = spawned.elapsed();
        stop.set();
        let stopped_by_flag: Vec<bool> = hogs.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            completed,
            "the third fiber did not complete within {COMPLETE_WITHIN:?} behind two hogs: {:?}",
            exec.stats()
        );
        assert_eq!(third.join().unwrap(), 42);
        assert_eq!(stopped_by_flag, [true, true], "the hogs were still spinning when it completed");
        let stats = exec.stats();
        assert!(stats.scale_ups >= 1, "through scaling: {stats:?}");
        eprintln!("third fiber completed {took:?} after its spawn; {stats:?}");
    });
}

#[test]
fn cooperative_preemption_on_a_single_worker() {
    watchdog("cooperative_preemption_on_a_single_worker", 30, |stage| {
        // No room to scale: only yield_if_needed can let the second fiber in.
        let exec = Executor::builder().workers(1).max_workers(1).time_slice(Duration::from_millis(5)).build();
        let stop = Flag::new();
        let hogging = Flag::new();
        let checks = Arc::new(AtomicUsize::new(0));
        stage.set("starting a hog that only calls yield_if_needed");
        let hog = {
            let (stop, hogging, checks) = (stop.clone(), hogging.clone(), Arc::clone(&checks));
            exec.spawn(move || {
                hogging.set();
                let start = Instant::now();
                while !stop.is_set() && start.elapsed() < HOG_BOUND {
                    checks.fetch_add(1, Ordering::Relaxed);
                    yield_if_needed();
                }
                stop.is_set()
            })
        };
        wait_for(&stage, "the hog to hold the only worker", || hogging.is_set());

        stage.set("a second fiber behind the hog");
        let second = exec.spawn(|| "ran");
        let completed = wait_within(COMPLETE_WITHIN, || second.is_finished());
        stop.set();
        let stopped_by_flag = hog.join().unwrap();
        assert!(
            completed,
            "the second fiber did not complete within {COMPLETE_WITHIN:?} on one worker: {:?}",
            exec.stats()
        );
        assert_eq!(second.join().unwrap(), "ran");
        assert!(stopped_by_flag, "the hog was still spinning when the second fiber completed");
        assert_eq!(exec.stats().peak_workers, 1, "no scaling was involved");
        assert!(checks.load(Ordering::Relaxed) > 0);
    });
}

#[test]
fn yield_if_needed_is_cheap_when_not_flagged() {
    watchdog("yield_if_needed_is_cheap_when_not_flagged", 30, |stage| {
        // A fiber that calls yield_if_needed in a short loop finishes well
        // within its time slice, so it never yields: nobody else runs on the
        // single worker in between.
        let exec = Executor::builder().workers(1).max_workers(1).time_slice(Duration::from_secs(10)).build();
        let other_ran = Flag::new();
        stage.set("a short loop of yield_if_needed");
        let o = other_ran.clone();
        let saw_other = exec
            .block_on(move || {
                let other = spindle_executor::spawn(move || o.set());
                let mut saw = false;
                for _ in 0..100_000 {
                    yield_if_needed();
                    saw |= other.is_finished();
                }
                let _ = other.join();
                saw
            })
            .unwrap();
        assert!(!saw_other, "yield_if_needed yielded although the time slice was not over");
        assert!(other_ran.is_set());
    });
}
