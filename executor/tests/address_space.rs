//! Under an address-space limit (`RLIMIT_AS`, in child processes): idle
//! cached fibers give their stacks up, a job waiting for a stack lets the
//! fibers that hold them run whatever its priority and is retried, a job
//! no stack can ever fit fails its join, and a build that cannot start its
//! threads leaves none behind.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{describe, watchdog};
use spindle_executor::{Executor, JoinError, SpawnOptions};
use spindle_fiber::Priority;
use spindle_sync::Semaphore;
use spindle_test_support::cap_address_space;

/// Set in a child process started by `run_child` to the test it runs.
const CHILD_ENV: &str = "SPINDLE_EXECUTOR_ADDRESS_SPACE_CHILD";

/// Whether this is the child process `run_child` started for `test`.
fn is_child(_test: &str) -> bool {
    common::is_child(CHILD_ENV)
}

/// Runs `test` alone in a child process (the parent's address space stays
/// unlimited) and checks that it passed.
fn run_child(test: &str) {
    let out = common::run_in_a_child_with(
        test,
        CHILD_ENV,
        // Deterministic room under the caps below: no allocator arena (a
        // 64 MiB reservation each) made after a cap, and thread stacks of
        // the usual size.
        &[("MALLOC_ARENA_MAX", "1"), ("RUST_MIN_STACK", "2097152")],
        // The global stack pool keeps idle stacks, as by default.
        &["SPINDLE_STACK_POOL"],
    );
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("child checked"),
        "the child failed:\n{}",
        describe(&out)
    );
}

const MIB: usize = 1 << 20;

/// Two unnamed fibers asleep on `gate`, each holding a stack, once both
/// have started.
fn two_holders(exec: &Executor, gate: &Arc<Semaphore>) -> Vec<spindle_executor::JoinHandle<()>> {
    let started = Arc::new(AtomicUsize::new(0));
    let holders = (0..2)
        .map(|_| {
            let (gate, started) = (gate.clone(), started.clone());
            exec.spawn(move || {
                started.fetch_add(1, Ordering::SeqCst);
                gate.acquire();
            })
        })
        .collect();
    while started.load(Ordering::SeqCst) < 2 {
        std::thread::yield_now();
    }
    holders
}

/// An executor of one worker with 64 MiB stacks whose worker caches two
/// idle fibers (two stacks), in a process whose address space has no room
/// for a third stack.
fn two_stacks_and_no_room() -> Executor {
    let exec = Executor::builder().workers(1).max_workers(1).stack_size(64 * MIB).build();
    // Everything but new stacks exists before the cap: the threads, the
    // worker's allocator arena, two stacks in the fibers it then caches.
    let gate = Arc::new(Semaphore::new(0));
    let holders = two_holders(&exec, &gate);
    gate.release(2);
    for h in holders {
        h.join().unwrap();
    }
    cap_address_space(32 * MIB as u64);
    exec
}

/// A named job (which never takes a worker's cached fiber) starts although
/// the worker's idle cached fibers hold the only stacks that fit: they
/// give them up.
#[test]
fn a_named_job_starts_once_idle_cached_fibers_give_up_their_stacks() {
    const NAME: &str = "a_named_job_starts_once_idle_cached_fibers_give_up_their_stacks";
    if !is_child(NAME) {
        return run_child(NAME);
    }
    watchdog(NAME, 30, |stage| {
        let exec = two_stacks_and_no_room();
        stage.set("a named job needs a stack of its own");
        let named = exec.spawn_with(SpawnOptions::new().name("named"), || 42);
        assert_eq!(named.join().unwrap(), 42);
        assert!(exec.stats().stack_waits == 0, "the worker gave up its idle stacks without a wait");
        stage.set("the cap is tight: a third fiber does not fit next to two");
        let gate = Arc::new(Semaphore::new(0));
        let three: Vec<_> = (0..3)
            .map(|_| {
                let gate = gate.clone();
                exec.spawn(move || gate.acquire())
            })
            .collect();
        while exec.stats().stack_waits == 0 {
            std::thread::yield_now();
        }
        gate.release(3);
        for h in three {
            h.join().unwrap();
        }
    });
    println!("child checked");
}

/// A highest-priority job that waits for a stack does not keep the
/// lower-priority fibers holding the stacks from running (and finishing).
#[test]
fn a_job_waiting_for_a_stack_lets_lower_priority_holders_run() {
    const NAME: &str = "a_job_waiting_for_a_stack_lets_lower_priority_holders_run";
    if !is_child(NAME) {
        return run_child(NAME);
    }
    watchdog(NAME, 30, |stage| {
        let exec = two_stacks_and_no_room();
        let gate = Arc::new(Semaphore::new(0));
        stage.set("two fibers hold the two stacks");
        let holders = two_holders(&exec, &gate);
        stage.set("a highest-priority job waits for a stack");
        let high = exec.spawn_with(SpawnOptions::new().priority(Priority::HIGHEST), || 7);
        while exec.stats().stack_waits == 0 {
            assert!(!high.is_finished(), "the job found a stack: the cap let a third one fit");
            std::thread::yield_now();
        }
        stage.set("the holders are woken; they must run, finish, and free a stack");
        gate.release(2);
        assert_eq!(high.join().unwrap(), 7);
        for h in holders {
            h.join().unwrap();
        }
    });
    println!("child checked");
}

/// A job whose stack cannot be mapped while no other fiber stack is
/// mapped anywhere (nothing could ever free one) fails its join, saying
/// why, instead of waiting forever.
#[test]
fn a_job_no_stack_can_ever_fit_fails_its_join() {
    const NAME: &str = "a_job_no_stack_can_ever_fit_fails_its_join";
    if !is_child(NAME) {
        return run_child(NAME);
    }
    watchdog(NAME, 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).stack_size(256 * MIB).build();
        cap_address_space(100 * MIB as u64);
        stage.set("a job whose 256 MiB stack does not fit under the cap");
        let err = exec.spawn(|| 1).join().unwrap_err();
        assert!(matches!(err, JoinError::NoStack { .. }), "{err:?}");
        let msg = err.to_string();
        for needle in ["never started", "RLIMIT_AS", "Builder::stack_size"] {
            assert!(msg.contains(needle), "{needle:?} missing from {msg:?}");
        }
        println!("{msg}");
        stage.set("the same job spawned in a scope and not joined");
        let scoped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            exec.scope(|s| {
                s.spawn(|| 1);
            })
        }));
        let Err(payload) = scoped else { panic!("the scope returned as if its fiber had run") };
        let msg = payload.downcast_ref::<String>().map(String::as_str).unwrap_or_default();
        assert!(msg.contains("no stack could be mapped"), "the scope's panic says what happened: {msg:?}");
    });
    println!("child checked");
}

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// An executor that cannot start all its worker threads (here: no address
/// space for their stacks) panics saying what to do, and leaves none of
/// the threads it did start behind.
#[test]
fn a_build_that_cannot_start_its_workers_panics_and_leaves_no_thread() {
    const NAME: &str = "a_build_that_cannot_start_its_workers_panics_and_leaves_no_thread";
    if !is_child(NAME) {
        return run_child(NAME);
    }
    let before = threads();
    // Room for a few 2 MiB thread stacks (and their guard), not for 64.
    cap_address_space(12 * MIB as u64);
    let built = std::panic::catch_unwind(|| Executor::builder().workers(64).max_workers(64).build());
    let Err(payload) = built else {
        panic!("64 worker threads fit under the cap: the test needs a tighter one");
    };
    let msg = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or_default();
    for needle in ["could not start worker thread", "Builder::workers", "ulimit"] {
        assert!(msg.contains(needle), "{needle:?} missing from {msg:?}");
    }
    // A joined thread leaves /proc/self/task shortly after its join
    // returns: wait (bounded) for the count to come back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while threads() != before {
        assert!(
            std::time::Instant::now() < deadline,
            "the threads started before the failure were not joined: {} now, {before} before",
            threads()
        );
        std::thread::yield_now();
    }
    println!("child checked: {msg}");
}

/// Once a job that waited for a stack has started, the workers cache idle
/// fibers again (consecutive jobs reuse one fiber): the pressure that made
/// them give their idle fibers up ends.
#[test]
fn the_fiber_cache_works_again_after_a_stack_wait() {
    const NAME: &str = "the_fiber_cache_works_again_after_a_stack_wait";
    if !is_child(NAME) {
        return run_child(NAME);
    }
    watchdog(NAME, 30, |stage| {
        let exec = two_stacks_and_no_room();
        let id = || exec.spawn(|| spindle_fiber::current().unwrap().id()).join().unwrap();
        assert_eq!(id(), id(), "consecutive jobs reuse a cached fiber");
        stage.set("a job waits for a stack");
        let gate = Arc::new(Semaphore::new(0));
        let holders = two_holders(&exec, &gate);
        let job = exec.spawn(|| 7);
        while exec.stats().stack_waits == 0 {
            std::thread::yield_now();
        }
        gate.release(2);
        assert_eq!(job.join().unwrap(), 7);
        for h in holders {
            h.join().unwrap();
        }
        stage.set("the cache after the wait");
        let ids: Vec<_> = (0..5).map(|_| id()).collect();
        assert!(ids.windows(2).any(|w| w[0] == w[1]), "the fiber cache stayed off after the wait: {ids:?}");
    });
    println!("child checked");
}

/// A worker whose job waits for a stack keeps trying it while a fiber of
/// its own keeps yielding: a stack freed elsewhere (here a `FiberStack`
/// the test holds) lets the job start.
#[test]
fn a_waiting_job_is_retried_while_a_fiber_keeps_yielding() {
    const NAME: &str = "a_waiting_job_is_retried_while_a_fiber_keeps_yielding";
    if !is_child(NAME) {
        return run_child(NAME);
    }
    watchdog(NAME, 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).stack_size(64 * MIB).build();
        assert_eq!(exec.spawn_with(SpawnOptions::new().name("warm"), || 1).join().unwrap(), 1);
        // A stack held outside the executor (the pool keeps the one of the
        // fiber above, for the poller below).
        let elsewhere = spindle_fiber::FiberStack::new(64 * MIB).unwrap();
        cap_address_space(32 * MIB as u64);
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let started = Arc::new(AtomicUsize::new(0));
        let (f, s) = (flag.clone(), started.clone());
        let poller = exec.spawn_with(SpawnOptions::new().name("poller"), move || {
            s.store(1, Ordering::SeqCst);
            while !f.load(Ordering::SeqCst) {
                spindle_executor::yield_now();
            }
        });
        while started.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        stage.set("a job that ends the poller waits for a stack");
        let f = flag.clone();
        let job = exec.spawn_with(SpawnOptions::new().name("job"), move || f.store(true, Ordering::SeqCst));
        while exec.stats().stack_waits == 0 {
            assert!(!job.is_finished(), "the job found a stack: the cap let one more fit");
            std::thread::yield_now();
        }
        stage.set("a stack is freed outside the executor");
        drop(elsewhere);
        job.join().unwrap();
        poller.join().unwrap();
    });
    println!("child checked");
}
