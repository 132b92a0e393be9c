//! A panic in a fiber surfaces as `JoinError::Panicked` carrying the
//! fiber's name and message, to a joining thread and to a joining fiber, and
//! leaves the executor usable.

mod common;

use common::{watchdog, Flag};
use spindle_executor::{yield_now, Executor, JoinError, SpawnOptions};

#[test]
fn panic_surfaces_to_a_joining_thread_with_name_and_message() {
    watchdog("panic_surfaces_to_a_joining_thread_with_name_and_message", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        stage.set("joining a named fiber that panics");
        let h = exec.spawn_with(SpawnOptions::new().name("exploder"), || -> u32 {
            yield_now();
            panic!("boom {}", 7)
        });
        let err = h.join().expect_err("the fiber panicked");
        match &err {
            JoinError::Panicked { name, .. } => assert_eq!(name.as_deref(), Some("exploder")),
            other => panic!("expected Panicked, got {other}"),
        }
        assert_eq!(err.panic_message(), Some("boom 7"));
        assert!(!err.is_cancelled() && !err.is_deadlock());
        let shown = err.to_string();
        assert!(shown.contains("exploder"), "Display names the fiber: {shown}");
        assert!(shown.contains("boom 7"), "Display carries the message: {shown}");
        assert!(shown.contains("panicked"), "Display says what happened: {shown}");
    });
}

#[test]
fn panic_surfaces_to_a_joining_fiber() {
    watchdog("panic_surfaces_to_a_joining_fiber", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        stage.set("a fiber joins a named fiber that panics");
        let inner = exec.spawn_with(SpawnOptions::new().name("inner-bomb"), || {
            yield_now();
            panic!("static message");
        });
        let seen = exec
            .block_on(move || {
                let err = inner.join().expect_err("the inner fiber panicked");
                let name = match &err {
                    JoinError::Panicked { name, .. } => name.as_deref().map(str::to_owned),
                    _ => None,
                };
                (name, err.panic_message().map(str::to_owned), err.to_string())
            })
            .expect("the joining fiber itself returns");
        assert_eq!(seen.0.as_deref(), Some("inner-bomb"));
        assert_eq!(seen.1.as_deref(), Some("static message"));
        assert!(seen.2.contains("inner-bomb") && seen.2.contains("static message"), "{}", seen.2);
    });
}

#[test]
fn unnamed_and_non_string_panics() {
    watchdog("unnamed_and_non_string_panics", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        stage.set("an unnamed fiber panics");
        let err = exec.spawn(|| panic!("anonymous")).join().expect_err("panicked");
        match &err {
            JoinError::Panicked { name, fiber, .. } => {
                assert!(name.is_none());
                assert!(err.to_string().contains(&fiber.to_string()), "Display shows the id: {err}");
            }
            other => panic!("expected Panicked, got {other}"),
        }
        assert_eq!(err.panic_message(), Some("anonymous"));

        stage.set("a fiber panics with a non-string payload");
        let err = exec
            .spawn_with(SpawnOptions::new().name("payload"), || std::panic::panic_any(42u32))
            .join()
            .expect_err("panicked");
        assert_eq!(err.panic_message(), None);
        match err {
            JoinError::Panicked { payload, name, .. } => {
                assert_eq!(name.as_deref(), Some("payload"));
                assert_eq!(payload.downcast_ref::<u32>(), Some(&42));
            }
            other => panic!("expected Panicked, got {other}"),
        }
    });
}

#[test]
fn panics_unwind_the_fiber_and_leave_the_executor_usable() {
    watchdog("panics_unwind_the_fiber_and_leave_the_executor_usable", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        stage.set("many fibers, every third panics");
        let flags: Vec<Flag> = (0..60).map(|_| Flag::new()).collect();
        let handles: Vec<_> = flags
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let guard = f.on_drop();
                exec.spawn(move || {
                    let _guard = guard;
                    yield_now();
                    if i % 3 == 0 {
                        panic!("fiber {i} fails");
                    }
                    i
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            match h.join() {
                Ok(v) => {
                    assert_ne!(i % 3, 0);
                    assert_eq!(v, i);
                }
                Err(e) => {
                    assert_eq!(i % 3, 0, "only every third fiber panics: {e}");
                    assert_eq!(e.panic_message(), Some(format!("fiber {i} fails").as_str()));
                }
            }
        }
        assert!(flags.iter().all(Flag::is_set), "every fiber's locals were dropped");
        stage.set("the executor still runs fibers");
        assert_eq!(exec.block_on(|| 1 + 1).unwrap(), 2);
        let stats = exec.stats();
        assert_eq!(stats.completed, stats.spawned, "{stats:?}");
    });
}

/// Spawns a job that captures `capture` and cancels it before it starts:
/// the only worker of `exec` is held busy (no suspension, no second worker
/// to scale up to) until the job is cancelled. Its closure, and with it
/// `capture`, is then dropped by the worker, unrun.
fn cancel_before_it_starts<C: Send + 'static>(exec: &Executor, capture: C) {
    let held = Flag::new();
    let release = Flag::new();
    let (fiber_held, fiber_release) = (held.clone(), release.clone());
    let blocker = exec.spawn(move || {
        fiber_held.set();
        while !fiber_release.is_set() {
            std::hint::spin_loop();
        }
    });
    while !held.is_set() {
        std::thread::yield_now();
    }
    let never_run = exec.spawn(move || drop(capture));
    never_run.cancel();
    release.set();
    blocker.join().unwrap();
    assert!(never_run.join().unwrap_err().is_cancelled());
}

/// Panics when dropped.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("Bomb dropped");
    }
}

#[test]
fn a_value_whose_drop_panics_leaves_the_worker_running() {
    watchdog("a_value_whose_drop_panics_leaves_the_worker_running", 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let go = std::sync::Arc::new(spindle_sync::Semaphore::new(0));
        let fiber_go = go.clone();
        stage.set("a fiber returns a value whose drop panics, after its handle is gone");
        let h = exec.spawn(move || {
            fiber_go.acquire();
            Bomb
        });
        drop(h); // the fiber drops the value as it returns: a panic of its own
        go.release(1);
        stage.set("the only worker still runs fibers");
        assert_eq!(exec.block_on(|| 1).unwrap(), 1);

        stage.set("a cancelled job whose closure's drop panics");
        cancel_before_it_starts(&exec, Bomb);
        assert_eq!(exec.block_on(|| 2).unwrap(), 2);
        drop(exec);
    });
}

/// A drop that panics with a payload whose own drop panics too
/// (`panic_any` of a `Bomb`).
struct DoubleBomb;

impl Drop for DoubleBomb {
    fn drop(&mut self) {
        std::panic::panic_any(Bomb);
    }
}

/// Three ways of dropping user code that panics with a payload whose drop
/// panics again: an unjoined value (dropped on its fiber: the fiber's own
/// panic, whose payload the worker then drops and contains), the payload
/// of an unjoined panic and the closure of a cancelled job (dropped by the
/// worker, which contains both panics, leaking the second payload). The
/// worker runs on.
#[test]
fn a_drop_whose_panic_payload_panics_when_dropped_leaves_the_worker_running() {
    watchdog("a_drop_whose_panic_payload_panics_when_dropped_leaves_the_worker_running", 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();

        stage.set("an unjoined value");
        let go = std::sync::Arc::new(spindle_sync::Semaphore::new(0));
        let fiber_go = go.clone();
        drop(exec.spawn(move || {
            fiber_go.acquire();
            DoubleBomb
        }));
        go.release(1);
        assert_eq!(exec.block_on(|| 1).unwrap(), 1, "the worker runs on after the value's drop");

        stage.set("the payload of an unjoined panic");
        let go = std::sync::Arc::new(spindle_sync::Semaphore::new(0));
        let fiber_go = go.clone();
        drop(exec.spawn(move || {
            fiber_go.acquire();
            std::panic::panic_any(Bomb);
        }));
        go.release(1);
        assert_eq!(exec.block_on(|| 2).unwrap(), 2, "the worker runs on after the payload's drop");

        stage.set("the closure of a cancelled job");
        cancel_before_it_starts(&exec, DoubleBomb);
        assert_eq!(exec.block_on(|| 3).unwrap(), 3, "the worker runs on after the closure's drop");
        stage.set("shutdown");
        drop(exec);
    });
}

/// A `JoinHandle` dropped while its thread unwinds from another panic,
/// holding a value whose drop panics: the value's panic is contained (a
/// second panic while unwinding would abort the process), and the
/// thread's own panic goes on.
#[test]
fn a_handle_dropped_while_its_thread_unwinds_contains_its_values_panicking_drop() {
    watchdog("a_handle_dropped_while_its_thread_unwinds_contains_its_values_panicking_drop", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let h = exec.spawn(|| Bomb);
        stage.set("waiting for the fiber to return its value");
        while !h.is_finished() {
            std::thread::yield_now();
        }
        stage.set("unwinding with the handle alive");
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _handle = h;
            std::panic::panic_any("the thread's own panic")
        }));
        let payload = unwound.expect_err("the thread's panic goes on");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"the thread's own panic"));
        assert_eq!(exec.block_on(|| 1).unwrap(), 1);
    });
}

/// A hand-driven fiber that drops the last reference to a task whose
/// panic nobody joined, with a payload whose drop suspends that fiber:
/// when the fiber is then dropped, its forced unwind goes on through its
/// frames (the task's drop used to catch it, and the fiber's code after
/// the drop ran inside its own drop).
#[test]
fn a_fiber_suspended_in_the_drop_of_a_tasks_payload_is_unwound_when_dropped() {
    use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    struct SuspendsWhoeverDrops;
    impl Drop for SuspendsWhoeverDrops {
        fn drop(&mut self) {
            spindle_fiber::yield_now();
        }
    }
    struct CountsDrops(Arc<AtomicUsize>);
    impl Drop for CountsDrops {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    watchdog("a_fiber_suspended_in_the_drop_of_a_tasks_payload_is_unwound_when_dropped", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let h = exec.spawn(|| std::panic::panic_any(SuspendsWhoeverDrops));
        stage.set("waiting for the fiber to panic");
        while !h.is_finished() {
            std::thread::yield_now();
        }
        // Its workers are joined: the handle holds the task's last reference.
        drop(exec);
        let (after_ran, local_drops) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let x = Fiber::<()>::new(FiberAttr::new().name("X")).unwrap();
        {
            let (after_ran, local) = (after_ran.clone(), CountsDrops(local_drops.clone()));
            x.set_function(Priority::NORMAL, move || {
                let _local = local;
                drop(h); // the payload's drop suspends X in here
                after_ran.store(true, Ordering::SeqCst);
            })
            .unwrap();
        }
        stage.set("running X until the payload's drop suspends it");
        assert!(matches!(x.run().unwrap(), RunOutcome::Yielded(0)), "X suspends in the payload's drop");
        drop(x);
        assert!(
            !after_ran.load(Ordering::SeqCst),
            "X's code after the drop ran inside X's own drop (its forced unwind was caught)"
        );
        assert_eq!(local_drops.load(Ordering::SeqCst), 1, "X's local was dropped once");
    });
}
