//! CPU hogs that never yield do not starve other fibers: on a pool of the
//! base size sysmon scales up, and with no room to scale a hog that calls
//! `yield_if_needed` is preempted once its time slice is over.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{wait_for, watchdog, Flag, Stage};
use spindle_executor::{yield_if_needed, Executor};

// The hogs spin until the test stops them, which it does only once the
// starved fiber has completed: a fiber that is starved for good leaves the
// test waiting, and the watchdog (30 s) fails it, naming the stage. They
// give up after `RUNAWAY` anyway, so that a failed test does not keep the
// cores busy for the rest of the binary; that bound plays no part in
// whether the test passes.
const RUNAWAY: Duration = Duration::from_secs(45);

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
                    while !stop.is_set() && start.elapsed() < RUNAWAY {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        wait_for(&stage, "both hogs to hold a worker", || hogging.load(Ordering::SeqCst) == 2);

        let spawned = Instant::now();
        let third = exec.spawn(move || 42);
        wait_for(&stage, "the third fiber to complete behind two spinning hogs", || third.is_finished());
        let took = spawned.elapsed();
        // Both hogs still spin: only a new worker can have run the third.
        let stats = exec.stats();
        stop.set();
        for h in hogs {
            h.join().unwrap();
        }
        assert_eq!(third.join().unwrap(), 42);
        assert!(stats.scale_ups >= 1, "through scaling: {stats:?}");
        eprintln!("third fiber completed {took:?} after its spawn; {stats:?}");
    });
}

#[test]
fn cooperative_preemption_on_a_single_worker() {
    watchdog("cooperative_preemption_on_a_single_worker", 30, |stage| {
        preempted_behind_a_hog(&stage, "a hog that only calls yield_if_needed", |stop| {
            let start = Instant::now();
            while !stop.is_set() && start.elapsed() < RUNAWAY {
                yield_if_needed();
            }
        });
    });
}

/// On a pool with no room to scale (so only `yield_if_needed` can let a
/// second fiber in), starts a fiber running `hog` (which loops until the
/// flag it is given is set) and checks that a second fiber completes
/// behind it while it still loops.
fn preempted_behind_a_hog(stage: &Stage, what: &str, hog: impl FnOnce(Flag) + Send + 'static) {
    let exec = Executor::builder().workers(1).max_workers(1).time_slice(Duration::from_millis(5)).build();
    let stop = Flag::new();
    let hogging = Flag::new();
    stage.set(format!("starting {what}"));
    let hog = {
        let (stop, hogging) = (stop.clone(), hogging.clone());
        exec.spawn(move || {
            hogging.set();
            hog(stop);
        })
    };
    wait_for(stage, "the hog to hold the only worker", || hogging.is_set());

    let second = exec.spawn(|| "ran");
    // The hog is still in its loop (it stops only after this): the
    // second fiber can only run because the hog's slice ran out.
    wait_for(stage, "the second fiber to complete behind the hog on the only worker", || {
        second.is_finished()
    });
    stop.set();
    hog.join().unwrap();
    assert_eq!(second.join().unwrap(), "ran");
    assert_eq!(exec.stats().peak_workers, 1, "no scaling was involved");
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

/// A fiber that keeps spawning keeps its worker's local deque full; a job
/// spawned from outside (into the worker's injector) must still run while
/// that goes on, not only once the spawning stops. One worker, so no other
/// worker can take it, and the spawner yields, so nothing looks stuck.
#[test]
fn a_fiber_that_keeps_spawning_does_not_starve_jobs_from_outside() {
    watchdog("a_fiber_that_keeps_spawning_does_not_starve_jobs_from_outside", 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let stop = Flag::new();
        let spawned = Arc::new(AtomicUsize::new(0));
        let flood = {
            let (stop, spawned) = (stop.clone(), spawned.clone());
            exec.spawn(move || {
                let started = Instant::now();
                while !stop.is_set() && started.elapsed() < RUNAWAY {
                    drop(spindle_executor::spawn(|| ()));
                    spawned.fetch_add(1, Ordering::Relaxed);
                    spindle_executor::yield_now();
                }
            })
        };
        stage.set("waiting for the flood of local spawns to start");
        while spawned.load(Ordering::Relaxed) < 1000 {
            std::thread::yield_now();
        }
        stage.set("a job spawned from outside, joined while the flood goes on");
        // The job reads the flood's count when it runs: it may run at the
        // flood's very next yield (its turn can come at any pick), and this
        // thread may read the count again before the flood spawns once
        // more, so the flood's spawns are counted around the job itself:
        // some before it ran, and more after it.
        let s = spawned.clone();
        let (answer, at_job) = exec.spawn(move || (42, s.load(Ordering::Relaxed))).join().unwrap();
        assert_eq!(answer, 42);
        assert!(at_job >= 1000, "the flood was spawning before the outside job ran");
        assert!(!flood.is_finished(), "the flood was still going when the outside job ran");
        wait_for(&stage, "the flood to go on spawning after the outside job ran", || {
            spawned.load(Ordering::Relaxed) > at_job
        });
        stop.set();
        flood.join().unwrap();
    });
}

/// The same with the hog's loop inside a fiber it drives by hand: the
/// nested fiber's `yield_if_needed` yields to the hog, and leaves the flag
/// for the hog's own check, which yields the worker. (From a review: the
/// nested fiber took the flag each time, so the hog never yielded and the
/// second fiber waited until the hog was done; the worker got away only
/// when sysmon set the flag between the two checks, after some seconds,
/// hence the shorter watchdog.)
#[test]
fn cooperative_preemption_through_a_nested_fiber() {
    use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
    watchdog("cooperative_preemption_through_a_nested_fiber", 10, |stage| {
        preempted_behind_a_hog(&stage, "a hog whose loop runs in a fiber it drives", |stop| {
            let start = Instant::now();
            let inner: Fiber<()> = Fiber::new(FiberAttr::new()).unwrap();
            inner
                .set_function(Priority::NORMAL, move || {
                    while !stop.is_set() && start.elapsed() < RUNAWAY {
                        yield_if_needed();
                    }
                })
                .unwrap();
            loop {
                match inner.run().unwrap() {
                    RunOutcome::Yielded(_) => yield_if_needed(),
                    RunOutcome::Returned(()) => break,
                    other => panic!("the nested fiber gave {other:?}"),
                }
            }
        });
    });
}
