//! Dropping a fiber: a suspended fiber is unwound so its locals' destructors
//! run; an unstarted fiber's closure is dropped; its stack goes back to the
//! pool.

mod common;

use common::{describe, is_child, no_core_dumps, run_child, with_watchdog, DropCounter};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use spindle_fiber::{
    current, leaked_stacks, yield_now, yield_value, Fiber, FiberAttr, FiberId, Priority, RunOutcome,
    StackPool, Waiter,
};

/// Serialises the tests that compare `leaked_stacks()` (a process-wide
/// count) before and after with those that may leak a stack on purpose.
static LEAK_COUNT: Mutex<()> = Mutex::new(());

fn leak_count_lock() -> std::sync::MutexGuard<'static, ()> {
    LEAK_COUNT.lock().unwrap_or_else(|e| e.into_inner())
}

fn counter() -> Arc<AtomicUsize> {
    Arc::new(AtomicUsize::new(0))
}

#[test]
fn dropping_a_suspended_fiber_runs_its_locals_destructors() {
    let _serial = leak_count_lock();
    with_watchdog(30, "drop_suspended", || {
        let leaked_before = leaked_stacks();
        let drops = counter();
        let fiber = Fiber::<()>::new(FiberAttr::new().name("suspended")).unwrap();
        let d = drops.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                let _a = DropCounter(d.clone());
                let _b = DropCounter(d);
                yield_now();
                unreachable!("dropped while suspended");
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 2, "both locals dropped");
        assert!(current().is_none(), "the thread is not left inside the fiber");
        assert_eq!(
            leaked_stacks(),
            leaked_before,
            "the stack was unwound, not leaked"
        );
    });
}

#[test]
fn unwinding_drops_every_frame_innermost_first_with_current_naming_the_fiber() {
    with_watchdog(30, "drop_order", || {
        type Log = Arc<Mutex<Vec<(usize, Option<FiberId>)>>>;
        struct Logged(usize, Log);
        impl Drop for Logged {
            fn drop(&mut self) {
                self.1.lock().unwrap().push((self.0, current().map(|c| c.id())));
            }
        }
        #[inline(never)]
        fn nest(depth: usize, log: &Log) {
            let _here = Logged(depth, log.clone());
            if depth == 5 {
                yield_value(depth);
            } else {
                nest(depth + 1, log);
            }
        }
        let log: Log = Arc::default();
        let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
        let id = fiber.id();
        let l = log.clone();
        fiber.set_function(Priority::NORMAL, move || nest(1, &l)).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(5)));
        drop(fiber);
        let log = log.lock().unwrap().clone();
        let depths: Vec<usize> = log.iter().map(|&(d, _)| d).collect();
        assert_eq!(depths, vec![5, 4, 3, 2, 1], "innermost frame first");
        assert!(
            log.iter().all(|&(_, c)| c == Some(id)),
            "current() named the fiber during its unwind: {log:?}"
        );
        assert!(current().is_none());
    });
}

/// A fiber suspended in its function with one local whose drops are
/// counted (the returned counter).
fn suspended_with_a_local() -> (Fiber<()>, Arc<AtomicUsize>) {
    let drops = counter();
    let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    let d = drops.clone();
    fiber
        .set_function(Priority::NORMAL, move || {
            let _g = DropCounter(d);
            yield_now();
        })
        .unwrap();
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
    (fiber, drops)
}

/// Of two handles to a suspended fiber, dropping the first leaves it
/// alone; dropping the last unwinds it (its local dropped once, its stack
/// not leaked).
#[test]
fn the_last_handle_unwinds_the_fiber() {
    let _serial = leak_count_lock();
    with_watchdog(30, "last_handle", || {
        let leaked = leaked_stacks();
        let (fiber, drops) = suspended_with_a_local();
        let other = fiber.clone();
        assert!(Fiber::ptr_eq(&fiber, &other));
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "another handle keeps it alive");
        drop(other);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the last handle unwound the suspended fiber"
        );
        assert_eq!(leaked_stacks(), leaked, "its stack was unwound, not leaked");
    });
}

/// Of two handles to a suspended fiber, the one left after the other is
/// dropped can still finish it normally; dropping it afterwards drops
/// nothing twice.
#[test]
fn a_remaining_handle_finishes_the_fiber() {
    with_watchdog(30, "remaining_handle", || {
        let (fiber, drops) = suspended_with_a_local();
        let other = fiber.clone();
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "another handle keeps it alive");
        // The remaining handle can still finish it normally.
        assert!(matches!(other.run().unwrap(), RunOutcome::Returned(())));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        drop(other);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "no second drop");
    });
}

#[test]
fn an_unstarted_fibers_closure_is_dropped_with_the_fiber() {
    with_watchdog(30, "drop_unstarted", || {
        let drops = counter();
        let fiber = Fiber::<usize>::new(FiberAttr::new()).unwrap();
        let captured = DropCounter(drops.clone());
        fiber
            .set_function(Priority::NORMAL, move || {
                let _keep = &captured;
                1
            })
            .unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the captured value was dropped");
    });
}

#[test]
fn replacing_an_unstarted_function_drops_its_closure() {
    with_watchdog(30, "replace_unstarted", || {
        let drops = counter();
        let fiber = Fiber::<usize>::new(FiberAttr::new()).unwrap();
        let captured = DropCounter(drops.clone());
        fiber
            .set_function(Priority::NORMAL, move || {
                let _keep = &captured;
                1
            })
            .unwrap();
        fiber.set_function(Priority::NORMAL, || 2).unwrap();
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the replaced closure was dropped"
        );
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(2)));
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn a_function_that_ran_to_completion_drops_its_captures_exactly_once() {
    with_watchdog(30, "drop_once_after_return", || {
        let drops = counter();
        let fiber = Fiber::<usize>::new(FiberAttr::new()).unwrap();
        let captured = DropCounter(drops.clone());
        fiber
            .set_function(Priority::NORMAL, move || {
                let _moved = captured;
                yield_now();
                3
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(3)));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        fiber.set_function(Priority::NORMAL, || 4).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(4)));
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn a_dropped_fiber_gives_its_stack_back_to_its_pool() {
    static POOL: StackPool = StackPool::new(4);
    with_watchdog(30, "stack_back_to_pool", || {
        let attr = FiberAttr::new().stack_size(64 * 1024).pool(&POOL);
        assert_eq!(POOL.cached(), 0);

        // Suspended, then dropped: unwound, stack returned.
        let fiber = Fiber::<()>::new(attr.clone()).unwrap();
        fiber.set_function(Priority::NORMAL, yield_now).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        drop(fiber);
        assert_eq!(POOL.cached(), 1);

        // Taken again by the next fiber.
        let fiber = Fiber::<()>::new(attr.clone()).unwrap();
        assert_eq!(POOL.cached(), 0);
        // Unstarted, then dropped.
        fiber.set_function(Priority::NORMAL, || ()).unwrap();
        drop(fiber);
        assert_eq!(POOL.cached(), 1);

        // Never given a function.
        let a = Fiber::<()>::new(attr.clone()).unwrap();
        let b = Fiber::<()>::new(attr.clone()).unwrap();
        drop((a, b));
        assert_eq!(POOL.cached(), 2);

        // The pool keeps at most its capacity.
        let many: Vec<_> = (0..6).map(|_| Fiber::<()>::new(attr.clone()).unwrap()).collect();
        drop(many);
        assert_eq!(POOL.cached(), POOL.capacity());
    });
}

const WAITER_DURING_DROP_CHILD: &str = "a_destructor_that_takes_a_waiter_while_its_fiber_is_dropped";

/// A destructor on a suspended fiber's stack may take a `Waiter` for its
/// fiber (a synchronisation primitive used in `Drop` does). While the last
/// handle drops the fiber, that must neither resurrect nor drop the fiber a
/// second time. Run in a child process: the failure mode corrupts the heap.
#[test]
fn a_destructor_that_takes_a_waiter_while_its_fiber_is_dropped() {
    if is_child(WAITER_DURING_DROP_CHILD) {
        no_core_dumps();
        struct TakesWaiter(Arc<AtomicUsize>);
        impl Drop for TakesWaiter {
            fn drop(&mut self) {
                let waiter = Waiter::current();
                assert!(waiter.is_some(), "the destructor runs on the fiber being dropped");
                drop(waiter);
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        // Extra references to the fiber's name show how often the fiber's
        // header is dropped: exactly once is right.
        let name: Arc<str> = Arc::from("dropped-once");
        let keep = (name.clone(), name.clone());
        let drops = counter();
        let fiber = Fiber::<()>::new(FiberAttr::new().name(name)).unwrap();
        let d = drops.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                let _t = TakesWaiter(d);
                yield_now();
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(
            Arc::strong_count(&keep.0),
            2,
            "the fiber's header was dropped more than once"
        );
        println!("child survived");
        return;
    }
    let out = run_child(WAITER_DURING_DROP_CHILD, 60);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("child survived"),
        "Waiter::current() in a destructor that runs while the last handle drops a suspended \
         fiber took a reference on a fiber whose count had reached zero, and dropping that \
         Waiter dropped the fiber a second time (use after free):\n{}",
        describe(&out)
    );
}

const YIELD_IN_UNSTARTED_DROP_CHILD: &str = "a_yield_in_the_drop_of_an_unstarted_function_is_harmless";

/// Dropping a fiber whose function never started drops the closure on the
/// dropping thread's own stack, not on the fiber's. A `yield_now` there
/// (say, in a captured value's destructor) must behave as on an ordinary
/// thread, for a fresh fiber and for a reused one. Run in a child process:
/// the failure mode is a crash.
#[test]
fn a_yield_in_the_drop_of_an_unstarted_function_is_harmless() {
    if is_child(YIELD_IN_UNSTARTED_DROP_CHILD) {
        no_core_dumps();
        struct YieldsInDrop(Arc<AtomicBool>);
        impl Drop for YieldsInDrop {
            fn drop(&mut self) {
                yield_now();
                self.0.store(true, Ordering::SeqCst);
            }
        }
        for reused in [false, true] {
            let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
            if reused {
                // A function that ran to completion before the unstarted one.
                fiber.set_function(Priority::NORMAL, yield_now).unwrap();
                assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
                assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(())));
            }
            let done = Arc::new(AtomicBool::new(false));
            let captured = YieldsInDrop(done.clone());
            fiber
                .set_function(Priority::NORMAL, move || {
                    let _keep = &captured;
                })
                .unwrap();
            drop(fiber);
            assert!(
                done.load(Ordering::SeqCst),
                "the yield returned (reused: {reused})"
            );
            println!("child survived (reused: {reused})");
        }
        return;
    }
    let out = run_child(YIELD_IN_UNSTARTED_DROP_CHILD, 60);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child survived (reused: true)"),
        "yield_now() in the destructor of an unstarted function's capture crashed: the fiber's \
         drop names the fiber as current while no function of it runs, so the yield goes \
         through a null (fresh fiber) or stale (reused fiber) yielder pointer:\n{}",
        describe(&out)
    );
}

/// A fiber whose code catches the forced unwind around a suspension and
/// then suspends again (as a loop that catches its jobs' panics would):
/// corosensei restarts the unwind from there, without a runner. It logs
/// what `current()` says in its destructor.
fn catches_the_unwind_and_suspends_again(log: Arc<Mutex<Vec<Option<FiberId>>>>) -> Fiber<()> {
    let fiber = Fiber::<()>::new(FiberAttr::new().name("stubborn")).unwrap();
    fiber
        .set_function(Priority::NORMAL, move || {
            struct Logs(Arc<Mutex<Vec<Option<FiberId>>>>);
            impl Drop for Logs {
                fn drop(&mut self) {
                    self.0.lock().unwrap().push(current().map(|c| c.id()));
                }
            }
            let _logs = Logs(log);
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| yield_value(1)));
            drop(caught);
            yield_now();
        })
        .unwrap();
    fiber
}

#[test]
fn a_fiber_that_suspends_during_its_forced_unwind_stays_current_until_it_is_gone() {
    let _serial = leak_count_lock();
    with_watchdog(30, "suspend_during_unwind", || {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fiber = catches_the_unwind_and_suspends_again(log.clone());
        let id = fiber.id();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(1)));
        drop(fiber);
        assert_eq!(
            *log.lock().unwrap(),
            vec![Some(id)],
            "the destructor ran once, inside the fiber"
        );
        assert!(current().is_none(), "the thread is not left inside the fiber");
    });
}

#[test]
fn the_outer_fiber_stays_current_after_dropping_an_inner_one_that_suspends_while_unwinding() {
    let _serial = leak_count_lock();
    with_watchdog(30, "suspend_during_unwind_nested", || {
        let log = Arc::new(Mutex::new(Vec::new()));
        let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
        let outer_id = outer.id();
        let l = log.clone();
        outer
            .set_function(Priority::NORMAL, move || {
                let inner = catches_the_unwind_and_suspends_again(l);
                assert!(matches!(inner.run().unwrap(), RunOutcome::Yielded(1)));
                drop(inner);
                let seen = (current().map(|c| c.id()), Waiter::current().is_some());
                yield_value(42); // must suspend the outer fiber
                seen
            })
            .unwrap();
        assert!(matches!(outer.run().unwrap(), RunOutcome::Yielded(42)));
        let (seen, has_waiter) = outer.run().unwrap().unwrap_returned();
        assert_eq!(seen, Some(outer_id));
        assert!(has_waiter);
        assert!(current().is_none());
    });
}

#[test]
fn suspensions_during_a_forced_unwind_never_reach_the_outer_fiber() {
    let _serial = leak_count_lock();
    with_watchdog(30, "suspend_twice_during_unwind", || {
        let outer = Fiber::<&'static str>::new(FiberAttr::new().name("outer")).unwrap();
        outer
            .set_function(Priority::NORMAL, || {
                let inner = Fiber::<()>::new(FiberAttr::new().name("inner")).unwrap();
                inner
                    .set_function(Priority::NORMAL, || {
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| yield_value(1)));
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| yield_value(2)));
                        yield_value(3);
                    })
                    .unwrap();
                assert!(matches!(inner.run().unwrap(), RunOutcome::Yielded(1)));
                drop(inner);
                "returned"
            })
            .unwrap();
        assert!(matches!(outer.run(), Ok(RunOutcome::Returned("returned"))));
    });
}

#[test]
fn a_fiber_unwound_while_a_destructor_keeps_a_waiter_is_finished_when_woken_and_run() {
    use spindle_fiber::{FiberError, FiberState};
    with_watchdog(30, "zombie_waiter", || {
        let fiber = common::stackless_fiber("zombie");
        // It has no stack left: the error says so and what to do.
        match fiber.run() {
            Err(e @ FiberError::NoStack(_)) => assert!(e.to_string().contains("create a new fiber"), "{e}"),
            other => panic!("run of a fiber without a stack gave {other:?}"),
        }
        assert_eq!(fiber.state(), FiberState::Finished);
        assert!(
            current().is_none(),
            "the failed run left the thread outside any fiber"
        );
        // Its stack went back to the pool during the unwind: a new function
        // is refused with a clear error, and the fiber stays as it was.
        match fiber.set_function(Priority::NORMAL, || ()) {
            Err(e @ FiberError::NoStack(_)) => assert!(e.to_string().contains("create a new fiber"), "{e}"),
            other => panic!("set_function on a fiber without a stack gave {other:?}"),
        }
        assert_eq!(fiber.state(), FiberState::Finished);
        assert!(matches!(fiber.run(), Err(FiberError::NoStack(_))));
        let shown = format!("{fiber:?}");
        assert!(
            shown.contains("stack: \"gone\""),
            "Debug says the stack is gone: {shown}"
        );
    });
}

#[test]
fn a_dropped_fibers_destructors_run_current_but_may_not_sleep() {
    with_watchdog(30, "may_sleep_in_drop_unwind", || {
        // (in_fiber, may_sleep) as seen by a destructor on the fiber's stack.
        let seen = Arc::new(Mutex::new(Vec::new()));
        struct Records(Arc<Mutex<Vec<(bool, bool)>>>);
        impl Drop for Records {
            fn drop(&mut self) {
                self.0
                    .lock()
                    .unwrap()
                    .push((spindle_fiber::in_fiber(), spindle_fiber::may_sleep()));
            }
        }
        let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
        let s = seen.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                assert!(spindle_fiber::may_sleep(), "a running fiber may sleep");
                let _r = Records(s);
                yield_now();
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        drop(fiber);
        assert_eq!(
            *seen.lock().unwrap(),
            [(true, false)],
            "current, but unable to suspend"
        );
        assert!(!spindle_fiber::may_sleep(), "an ordinary thread");

        // The flag belongs to that unwind only: a reused fiber may sleep again.
        let fiber = Fiber::<bool>::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, spindle_fiber::may_sleep)
            .unwrap();
        assert!(fiber.run().unwrap().unwrap_returned());
    });
}

/// Tries to suspend from its destructor.
struct YieldsOnDrop(Arc<AtomicBool>);

impl Drop for YieldsOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        yield_now();
    }
}

#[test]
fn a_value_returned_after_a_caught_forced_unwind_cannot_suspend_into_the_dead_function() {
    let _serial = leak_count_lock();
    with_watchdog(30, "value_after_caught_forced_unwind", || {
        let dropped = Arc::new(AtomicBool::new(false));
        let fiber = Fiber::<YieldsOnDrop>::new(FiberAttr::new()).unwrap();
        let d = dropped.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                // Catches the forced unwind of the drop below, then returns
                // a value, which is discarded with the fiber still current.
                let _ = std::panic::catch_unwind(yield_now);
                YieldsOnDrop(d)
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        let leaked_before = leaked_stacks();
        // The value's `yield_now` finds no yielder (a panic, contained by
        // the drop) instead of switching into the function's dead frame.
        drop(fiber);
        assert!(dropped.load(Ordering::SeqCst), "the value was dropped");
        assert!(current().is_none(), "the thread is not left inside the fiber");
        assert_eq!(
            leaked_stacks(),
            leaked_before + 1,
            "the stack is leaked, not reused"
        );
    });
}

/// A fiber whose function (not started) captures a drop counter, then a
/// value whose destructor panics.
fn with_a_capture_that_panics_on_drop(drops: &Arc<AtomicUsize>) -> Fiber<()> {
    struct PanicsOnDrop;
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("closure capture dropped");
        }
    }
    let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    let (first, second) = (DropCounter(drops.clone()), PanicsOnDrop);
    fiber
        .set_function(Priority::NORMAL, move || {
            let _keep = (&first, &second);
        })
        .unwrap();
    fiber
}

#[test]
fn replacing_a_function_whose_closure_panics_on_drop_drops_each_capture_once() {
    let _serial = leak_count_lock();
    with_watchdog(30, "replace_panicking_closure", || {
        let drops = counter();
        let fiber = with_a_capture_that_panics_on_drop(&drops);
        let replaced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            fiber.set_function(Priority::NORMAL, || {})
        }));
        assert!(
            replaced.is_err(),
            "the capture's panic comes back from set_function"
        );
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the other capture was dropped once, not twice"
        );
        assert!(
            matches!(fiber.run(), Err(spindle_fiber::FiberError::NoStack(_))),
            "{:?}",
            fiber.run()
        );
        assert!(matches!(
            fiber.set_function(Priority::NORMAL, || {}),
            Err(spindle_fiber::FiberError::NoStack(_))
        ));
    });
}

#[test]
fn dropping_a_fiber_whose_unstarted_closure_panics_on_drop_leaks_and_counts_it() {
    let _serial = leak_count_lock();
    with_watchdog(30, "drop_panicking_unstarted_closure", || {
        let drops = counter();
        let fiber = with_a_capture_that_panics_on_drop(&drops);
        let leaked_before = leaked_stacks();
        drop(fiber); // the panic is contained by the drop
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the other capture was dropped once"
        );
        assert_eq!(leaked_stacks(), leaked_before + 1, "the leaked stack is counted");
    });
}

#[test]
fn two_threads_dropping_the_last_two_handles_at_once_unwind_the_fiber_once() {
    let _serial = leak_count_lock();
    with_watchdog(60, "last_two_handles_at_once", || {
        let leaked_before = leaked_stacks();
        let rounds = if cfg!(debug_assertions) { 2_000 } else { 10_000 };
        let drops = counter();
        // A spinning rendezvous per round (a futex wake would part them).
        let arrived = Arc::new(AtomicUsize::new(0));
        let meet = |arrived: &AtomicUsize, round: usize| {
            arrived.fetch_add(1, Ordering::SeqCst);
            while arrived.load(Ordering::SeqCst) < 2 * (round + 1) {
                std::hint::spin_loop();
            }
        };
        let (tx, rx) = std::sync::mpsc::channel::<Fiber<()>>();
        let other = {
            let arrived = arrived.clone();
            std::thread::spawn(move || {
                for (round, fiber) in rx.into_iter().enumerate() {
                    meet(&arrived, round);
                    drop(fiber);
                }
            })
        };
        for round in 0..rounds {
            let fiber = Fiber::<()>::new(FiberAttr::new().stack_size(16 * 1024)).unwrap();
            let d = drops.clone();
            // SAFETY: the function holds only a counter across its
            // suspension (Send, no thread-local reference).
            unsafe {
                fiber.set_function_migratable(Priority::NORMAL, move || {
                    let _local = DropCounter(d);
                    yield_now();
                })
            }
            .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
            tx.send(fiber.clone()).unwrap();
            meet(&arrived, round);
            drop(fiber); // races the other thread's drop of its handle
        }
        drop(tx);
        other.join().unwrap();
        // Whichever thread dropped last unwound the stack: once per round.
        assert_eq!(
            drops.load(Ordering::SeqCst),
            rounds,
            "every suspended fiber was unwound"
        );
        assert_eq!(leaked_stacks(), leaked_before, "no stack was leaked");
    });
}

#[test]
fn a_waiter_kept_by_a_destructor_and_dropped_on_another_thread_frees_the_fiber_safely() {
    with_watchdog(60, "kept_waiter_other_thread", || {
        let rounds = if cfg!(debug_assertions) { 500 } else { 5_000 };
        let (tx, rx) = std::sync::mpsc::channel::<Waiter>();
        // Drops each waiter as soon as it arrives, racing the end of the
        // `release` that unwound its fiber.
        let other = std::thread::spawn(move || rx.into_iter().count());
        for _ in 0..rounds {
            let fiber = Fiber::<()>::new(FiberAttr::new().stack_size(16 * 1024)).unwrap();
            let tx = tx.clone();
            fiber
                .set_function(Priority::NORMAL, move || {
                    struct SendsWaiter(std::sync::mpsc::Sender<Waiter>);
                    impl Drop for SendsWaiter {
                        fn drop(&mut self) {
                            let _ = self
                                .0
                                .send(Waiter::current().expect("unwound as the current fiber"));
                        }
                    }
                    let _s = SendsWaiter(tx);
                    yield_now();
                })
                .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
            drop(fiber); // unwound here; the other thread drops the last reference
        }
        drop(tx);
        assert_eq!(other.join().unwrap(), rounds, "every destructor sent its waiter");
    });
}

/// A fiber X drops an unstarted fiber F whose capture yields in its drop:
/// that yield suspends X (the capture is dropped on X's stack, X current).
/// Dropping X then unwinds it from inside F's drop; the unwind must go on
/// through X's frames, not be taken for a panic of F's capture and stopped
/// there, which ran X's code after `drop(f)` inside `drop(x)`.
#[test]
fn an_unwind_that_starts_in_an_unstarted_fibers_capture_drop_goes_on() {
    let _serial = leak_count_lock();
    struct YieldsInDrop;
    impl Drop for YieldsInDrop {
        fn drop(&mut self) {
            yield_now();
        }
    }
    with_watchdog(30, "unwind_from_capture_drop", || {
        let after_drop = Arc::new(AtomicBool::new(false));
        let x_locals = counter();
        let x = Fiber::<()>::new(FiberAttr::new().name("x")).unwrap();
        {
            let (after_drop, x_locals) = (after_drop.clone(), x_locals.clone());
            x.set_function(Priority::NORMAL, move || {
                let _local = DropCounter(x_locals);
                let f = Fiber::<()>::new(FiberAttr::new().name("f")).unwrap();
                let captured = YieldsInDrop;
                f.set_function(Priority::NORMAL, move || {
                    let _keep = &captured;
                })
                .unwrap();
                drop(f);
                after_drop.store(true, Ordering::SeqCst);
            })
            .unwrap();
        }
        assert!(
            matches!(x.run().unwrap(), RunOutcome::Yielded(0)),
            "x suspended inside f's drop"
        );
        let leaked_before = leaked_stacks();
        drop(x);
        assert!(
            !after_drop.load(Ordering::SeqCst),
            "x's code after `drop(f)` ran while x was being unwound"
        );
        assert_eq!(
            x_locals.load(Ordering::SeqCst),
            1,
            "x's locals were dropped by the unwind"
        );
        assert_eq!(
            leaked_stacks() - leaked_before,
            1,
            "f's stack, whose closure drop never finished, is leaked"
        );
    });
}

/// `mark_queued` and `set_home` hand back a home they replace only once the
/// fiber is out of `Locked` (dropped at once here): a scheduler dropped there (its last reference
/// was the fiber's) sees the fiber `Queued` or `Ready`, never locked.
#[test]
fn a_replaced_home_is_dropped_after_the_fiber_is_unlocked() {
    use spindle_fiber::{FiberState, Schedule};

    struct Recorder {
        fiber: Mutex<Option<Fiber<()>>>,
        seen: Arc<Mutex<Option<FiberState>>>,
    }
    impl Schedule<()> for Recorder {
        fn schedule<'w>(
            &self,
            fiber: spindle_fiber::Woken<'w, ()>,
        ) -> Result<(), spindle_fiber::Woken<'w, ()>> {
            drop(fiber.into_queued());
            Ok(())
        }
    }
    impl Drop for Recorder {
        fn drop(&mut self) {
            if let Some(f) = self.fiber.lock().unwrap().take() {
                *self.seen.lock().unwrap() = Some(f.state());
            }
        }
    }
    let recorder_home = |f: &Fiber<()>, seen: &Arc<Mutex<Option<FiberState>>>| -> Arc<dyn Schedule<()>> {
        Arc::new(Recorder {
            fiber: Mutex::new(Some(f.clone())),
            seen: seen.clone(),
        })
    };
    let other: Arc<dyn Schedule<()>> = Arc::new(Recorder {
        fiber: Mutex::new(None),
        seen: Arc::new(Mutex::new(None)),
    });

    let f = Fiber::<()>::new(FiberAttr::new()).unwrap();
    f.set_function(Priority::NORMAL, || ()).unwrap();
    for via_mark_queued in [true, false] {
        let seen = Arc::new(Mutex::new(None));
        let home = recorder_home(&f, &seen);
        f.set_home(Some(&home)).unwrap();
        drop(home); // the fiber holds its last reference now
        if via_mark_queued {
            f.mark_queued(Some(&other)).unwrap();
            assert_eq!(*seen.lock().unwrap(), Some(FiberState::Queued));
            f.mark_dequeued().unwrap();
        } else {
            f.set_home(Some(&other)).unwrap();
            assert_eq!(*seen.lock().unwrap(), Some(FiberState::Ready));
        }
    }
    f.set_home(None).unwrap();
    assert!(matches!(f.run().unwrap(), RunOutcome::Returned(())));
}

/// Dropping a fiber whose unstarted closure's capture panics when dropped,
/// with a payload that panics when dropped too, does not panic out of the
/// drop: both panics stay inside (the closure and its stack are leaked and
/// counted, the second payload is leaked).
#[test]
fn a_capture_whose_drop_panics_twice_does_not_panic_out_of_the_fibers_drop() {
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("Bomb dropped");
        }
    }
    struct DoubleBomb;
    impl Drop for DoubleBomb {
        fn drop(&mut self) {
            std::panic::panic_any(Bomb);
        }
    }
    let _serial = leak_count_lock();
    let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    let bomb = DoubleBomb;
    fiber.set_function(Priority::NORMAL, move || drop(bomb)).unwrap();
    let leaked = leaked_stacks();
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(fiber)));
    assert!(dropped.is_ok(), "a panic escaped the fiber's drop");
    assert_eq!(
        leaked_stacks(),
        leaked + 1,
        "the closure's stack is leaked and counted"
    );
}

/// A payload whose drop suspends the fiber that drops it (a `panic_any` of
/// a value whose `Drop` yields).
struct SuspendsWhoeverDrops;
impl Drop for SuspendsWhoeverDrops {
    fn drop(&mut self) {
        yield_now();
    }
}

/// Panics with a `SuspendsWhoeverDrops` payload when dropped.
struct PanicsWithAYieldingPayload;
impl Drop for PanicsWithAYieldingPayload {
    fn drop(&mut self) {
        std::panic::panic_any(SuspendsWhoeverDrops);
    }
}

/// Runs `body` in fiber X until its first suspension, drops X there, and
/// checks that X's forced unwind went through all its frames: its code
/// after the suspension never ran, and its local was dropped once.
fn dropped_while_suspended_in_a_payload_drop(name: &str, body: fn()) {
    static AFTER_RAN: AtomicBool = AtomicBool::new(false);
    let local_drops = counter();
    let x = Fiber::<()>::new(FiberAttr::new().name(name)).unwrap();
    let d = local_drops.clone();
    AFTER_RAN.store(false, Ordering::SeqCst);
    x.set_function(Priority::NORMAL, move || {
        let _local = DropCounter(d);
        body();
        AFTER_RAN.store(true, Ordering::SeqCst);
    })
    .unwrap();
    assert!(
        matches!(x.run().unwrap(), RunOutcome::Yielded(0)),
        "{name}: X suspends in the payload's drop"
    );
    drop(x);
    assert!(
        !AFTER_RAN.load(Ordering::SeqCst),
        "{name}: X's code after the suspension ran inside X's own drop (its forced unwind was caught)"
    );
    assert_eq!(
        local_drops.load(Ordering::SeqCst),
        1,
        "{name}: X's local dropped once"
    );
}

thread_local! {
    /// The name of fiber D in the test below, held weakly.
    static D_NAME: std::cell::RefCell<Option<std::sync::Weak<str>>> = const { std::cell::RefCell::new(None) };
}

/// A fiber X drops a suspended fiber D whose forced unwind is caught and
/// panics; the panic's payload, dropped by X, suspends X. Dropping X then
/// must unwind X, not let it go on inside its own drop, and D is still
/// freed.
#[test]
fn a_fiber_suspended_in_the_drop_of_a_contained_payload_is_unwound_when_dropped() {
    let _serial = leak_count_lock();
    with_watchdog(30, "payload_drop_suspends_release", || {
        dropped_while_suspended_in_a_payload_drop("X (release)", || {
            // D's name is counted: D is freed once dropped (the forced
            // unwind of X, passed on from D's release, once left D behind).
            let name: std::sync::Arc<str> = "D".into();
            D_NAME.with(|n| *n.borrow_mut() = Some(std::sync::Arc::downgrade(&name)));
            let d = Fiber::<PanicsWithAYieldingPayload>::new(FiberAttr::new().name(name)).unwrap();
            d.set_function(Priority::NORMAL, || {
                // Catches D's forced unwind and returns: the forced unwind
                // drops the value, whose drop panics with a payload that
                // suspends whoever drops it.
                let _ = std::panic::catch_unwind(yield_now);
                PanicsWithAYieldingPayload
            })
            .unwrap();
            assert!(matches!(d.run().unwrap(), RunOutcome::Yielded(0)));
            drop(d); // X suspends in here
        });
        let d_name = D_NAME
            .with(|n| n.borrow_mut().take())
            .expect("D was made on this thread");
        assert_eq!(d_name.strong_count(), 0, "D was not freed after X's unwind");
    });
}

/// The same through an unstarted fiber's closure: a capture whose drop
/// panics with a payload that suspends the dropping fiber.
#[test]
fn a_fiber_suspended_in_the_drop_of_a_captures_payload_is_unwound_when_dropped() {
    let _serial = leak_count_lock();
    with_watchdog(30, "payload_drop_suspends_unstarted", || {
        dropped_while_suspended_in_a_payload_drop("X (unstarted)", || {
            let f = Fiber::<()>::new(FiberAttr::new()).unwrap();
            let capture = PanicsWithAYieldingPayload;
            f.set_function(Priority::NORMAL, move || drop(capture)).unwrap();
            drop(f); // X suspends in here
        });
    });
}

const YIELD_IN_DROP_UNWIND_CHILD: &str =
    "a_destructor_that_yields_while_its_fiber_is_dropped_yields_the_thread";

/// A destructor on a dropped fiber's stack runs during the forced unwind,
/// with no runner to come back to. A `yield_now` or `yield_value` there
/// (a destructor that polls, or calls an executor's yield) yields the
/// thread and returns, as on an ordinary thread; it used to suspend, which
/// restarted the unwind inside the destructor and aborted the process.
/// Dropped on a thread and from inside an outer fiber, which the yield
/// must not suspend. Run in a child process: the failure mode is an abort.
#[test]
fn a_destructor_that_yields_while_its_fiber_is_dropped_yields_the_thread() {
    if is_child(YIELD_IN_DROP_UNWIND_CHILD) {
        no_core_dumps();
        struct YieldsWhileDropped(Arc<AtomicUsize>);
        impl Drop for YieldsWhileDropped {
            fn drop(&mut self) {
                for _ in 0..3 {
                    yield_now();
                }
                yield_value(7);
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        fn suspended(done: &Arc<AtomicUsize>) -> Fiber<()> {
            let fiber = Fiber::<()>::new(FiberAttr::new().name("polls in drop")).unwrap();
            let guard = YieldsWhileDropped(done.clone());
            fiber
                .set_function(Priority::NORMAL, move || {
                    let _guard = guard;
                    yield_now();
                })
                .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
            fiber
        }
        let _serial = leak_count_lock();
        let leaked_before = leaked_stacks();
        let done = counter();
        drop(suspended(&done));
        assert_eq!(done.load(Ordering::SeqCst), 1, "the destructor finished");

        let outer = Fiber::<&str>::new(FiberAttr::new().name("outer")).unwrap();
        let d = done.clone();
        outer
            .set_function(Priority::NORMAL, move || {
                drop(suspended(&d));
                "the outer fiber went on"
            })
            .unwrap();
        assert_eq!(
            outer.run().unwrap().unwrap_returned(),
            "the outer fiber went on",
            "the inner destructor's yields did not suspend the outer fiber"
        );
        assert_eq!(done.load(Ordering::SeqCst), 2);
        assert_eq!(
            leaked_stacks(),
            leaked_before,
            "both unwinds finished: no stack leaked"
        );
        println!("child survived");
        return;
    }
    let out = run_child(YIELD_IN_DROP_UNWIND_CHILD, 60);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("child survived"),
        "yield_now() in a destructor run by a dropped fiber's forced unwind did not return:\n{}",
        describe(&out)
    );
}

const SLEEP_IN_DROP_UNWIND_CHILD: &str =
    "a_destructor_that_sleeps_while_its_fiber_is_dropped_says_why_it_aborts";

/// `sleep` cannot turn into a thread's wait (a `Waiter` names the fiber),
/// so a destructor that sleeps during a dropped fiber's unwind still ends
/// the process (a panic inside a destructor during an unwind), but the
/// message says what happened and what to check.
#[test]
fn a_destructor_that_sleeps_while_its_fiber_is_dropped_says_why_it_aborts() {
    if is_child(SLEEP_IN_DROP_UNWIND_CHILD) {
        no_core_dumps();
        struct SleepsWhileDropped;
        impl Drop for SleepsWhileDropped {
            fn drop(&mut self) {
                spindle_fiber::sleep();
            }
        }
        let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, || {
                let _guard = SleepsWhileDropped;
                yield_now();
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        drop(fiber);
        println!("child survived");
        return;
    }
    let out = run_child(SLEEP_IN_DROP_UNWIND_CHILD, 60);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("may_sleep()"),
        "the abort names its cause:\n{}",
        describe(&out)
    );
}

/// A fiber that catches the forced unwind around its first yield, then
/// yields up to 1000 times, counting: each of those yields must restart
/// the unwind, so it counts one.
fn catches_the_unwind_then_polls(polls: &Arc<AtomicUsize>) -> Fiber<()> {
    let fiber = Fiber::<()>::new(FiberAttr::new().name("poller")).unwrap();
    let p = polls.clone();
    fiber
        .set_function(Priority::NORMAL, move || {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| yield_value(1)));
            for _ in 0..1000 {
                p.fetch_add(1, Ordering::SeqCst);
                yield_now();
            }
        })
        .unwrap();
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(1)));
    fiber
}

/// Code that caught a dropped fiber's forced unwind and yields restarts
/// the unwind, also when the dropping thread is panicking itself (a drop
/// during a panic, or from a destructor of another fiber being unwound),
/// where its yields cannot be told from a destructor's: they must not
/// turn into thread yields and let the code run on (a loop of them
/// would never end).
#[test]
fn a_yield_after_a_caught_forced_unwind_restarts_it_even_on_a_panicking_thread() {
    let _serial = leak_count_lock();
    with_watchdog(30, "caught_unwind_then_polls", || {
        let polls = counter();
        drop(catches_the_unwind_then_polls(&polls));
        assert_eq!(polls.load(Ordering::SeqCst), 1, "dropped on a quiet thread");

        let polls = counter();
        let fiber = catches_the_unwind_then_polls(&polls);
        let outer_panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _dropped_by_the_panic = fiber;
            panic!("an outer panic drops the fiber");
        }));
        assert!(outer_panic.is_err());
        assert_eq!(polls.load(Ordering::SeqCst), 1, "dropped during a panic");

        let polls = counter();
        struct DropsInner(Option<Fiber<()>>);
        impl Drop for DropsInner {
            fn drop(&mut self) {
                drop(self.0.take());
            }
        }
        let inner = catches_the_unwind_then_polls(&polls);
        let outer = Fiber::<()>::new(FiberAttr::new().name("outer")).unwrap();
        outer
            .set_function(Priority::NORMAL, move || {
                let _g = DropsInner(Some(inner));
                yield_now();
            })
            .unwrap();
        assert!(matches!(outer.run().unwrap(), RunOutcome::Yielded(0)));
        drop(outer);
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "dropped from a destructor of another fiber being unwound"
        );
    });
}

const SLEPT_PANICKING_CHILD: &str = "a_fiber_asleep_in_a_destructor_during_a_panic_is_leaked_when_dropped";

/// A fiber whose destructor goes to sleep while a panic unwinds it, and
/// that is then dropped before it wakes, is leaked (counted and reported
/// once), not force-unwound: that unwind would start inside the
/// destructor's cleanup and abort the process. (Found by a shutdown
/// stress test of the executor: a join in a destructor during a cancel
/// unwind, its fiber dropped by the final drain.) In a child process, so
/// that a regression's abort is the child's.
#[test]
fn a_fiber_asleep_in_a_destructor_during_a_panic_is_leaked_when_dropped() {
    struct SleepsOnDrop;
    impl Drop for SleepsOnDrop {
        fn drop(&mut self) {
            spindle_fiber::sleep();
        }
    }
    if is_child(SLEPT_PANICKING_CHILD) {
        no_core_dumps();
        let before = spindle_fiber::leaked_stacks();
        let fiber = Fiber::<()>::new(FiberAttr::new().name("sleeps-in-cleanup")).unwrap();
        fiber
            .set_function(Priority::NORMAL, || {
                let _s = SleepsOnDrop;
                panic!("the unwind that runs the sleeping destructor");
            })
            .unwrap();
        // The panic hook reports the panic; the destructor then sleeps.
        assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
        drop(fiber);
        eprintln!("child leaked: {}", spindle_fiber::leaked_stacks() - before);
        return;
    }
    let out = run_child(SLEPT_PANICKING_CHILD, 60);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(stderr.contains("child leaked: 1"), "{}", describe(&out));
    assert!(
        stderr.contains("'sleeps-in-cleanup'")
            && stderr.contains("asleep in a wait it began during an unwind"),
        "{}",
        describe(&out)
    );
}

const YIELDED_PANICKING_CHILD: &str =
    "a_fiber_that_yielded_in_a_destructor_during_a_panic_is_leaked_when_dropped";

/// A destructor that yields while a panic unwinds its fiber, and the
/// fiber dropped there (its run returned `Yielded` mid-unwind): a forced
/// unwind would start inside that destructor's cleanup and abort the
/// process, so the stack is leaked (counted, reported once) instead. It
/// aborted before the crate's panic hook started recording where a panic
/// began. In a child process, so that a regression's abort is the child's.
#[test]
fn a_fiber_that_yielded_in_a_destructor_during_a_panic_is_leaked_when_dropped() {
    struct YieldsOnDrop;
    impl Drop for YieldsOnDrop {
        fn drop(&mut self) {
            yield_now();
        }
    }
    if is_child(YIELDED_PANICKING_CHILD) {
        no_core_dumps();
        let before = leaked_stacks();
        let fiber = Fiber::<()>::new(FiberAttr::new().name("yields-in-cleanup")).unwrap();
        fiber
            .set_function(Priority::NORMAL, || {
                let _y = YieldsOnDrop;
                panic!("the unwind that runs the yielding destructor");
            })
            .unwrap();
        assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(0))));
        drop(fiber);
        eprintln!("child leaked: {}", leaked_stacks() - before);
        return;
    }
    let out = run_child(YIELDED_PANICKING_CHILD, 60);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(stderr.contains("child leaked: 1"), "{}", describe(&out));
    assert!(
        stderr.contains("'yields-in-cleanup'") && stderr.contains("inside the unwind of its own panic"),
        "{}",
        describe(&out)
    );
}

/// The same destructor, but the fiber is run on until its unwind ends:
/// the panic comes back, and the fiber reused for a function that only
/// yields is unwound normally when dropped (the mark of the earlier panic
/// does not outlive its function).
#[test]
fn a_fiber_run_to_the_end_of_its_unwind_is_unwound_normally_afterwards() {
    struct YieldsOnDrop(Arc<AtomicUsize>);
    impl Drop for YieldsOnDrop {
        fn drop(&mut self) {
            yield_now();
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let _serial = leak_count_lock();
    with_watchdog(
        60,
        "a_fiber_run_to_the_end_of_its_unwind_is_unwound_normally_afterwards",
        || {
            let before = leaked_stacks();
            let drops = Arc::new(AtomicUsize::new(0));
            let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
            let d = drops.clone();
            fiber
                .set_function(Priority::NORMAL, move || {
                    let _y = YieldsOnDrop(d);
                    panic!("unwinds through a yield");
                })
                .unwrap();
            assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(0))));
            assert!(
                std::thread::panicking(),
                "the fiber's unwind is this thread's until it ends"
            );
            assert!(matches!(fiber.run(), Ok(RunOutcome::Panicked(_))));
            assert!(!std::thread::panicking());
            assert_eq!(drops.load(Ordering::SeqCst), 1);

            let d = drops.clone();
            fiber
                .set_function(Priority::NORMAL, move || {
                    let _c = DropCounter(d);
                    loop {
                        yield_now();
                    }
                })
                .unwrap();
            assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(0))));
            drop(fiber);
            assert_eq!(
                drops.load(Ordering::SeqCst),
                2,
                "the local was dropped by the unwind"
            );
            assert_eq!(leaked_stacks(), before, "nothing leaked");
        },
    );
}

/// A panic the function catches itself is over: the fiber suspended later
/// is unwound when dropped on its thread, not leaked as if it were still
/// inside the panic.
#[test]
fn a_fiber_that_caught_its_own_panic_is_unwound_when_dropped() {
    let _serial = leak_count_lock();
    with_watchdog(
        60,
        "a_fiber_that_caught_its_own_panic_is_unwound_when_dropped",
        || {
            let before = leaked_stacks();
            let drops = Arc::new(AtomicUsize::new(0));
            let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
            let d = drops.clone();
            fiber
                .set_function(Priority::NORMAL, move || {
                    let _c = DropCounter(d);
                    let caught = std::panic::catch_unwind(|| panic!("caught inside the fiber"));
                    assert!(caught.is_err());
                    loop {
                        yield_now();
                    }
                })
                .unwrap();
            assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(0))));
            drop(fiber);
            assert_eq!(
                drops.load(Ordering::SeqCst),
                1,
                "the local was dropped by the unwind"
            );
            assert_eq!(leaked_stacks(), before, "nothing leaked");
        },
    );
}

const RESUMED_CHILD: &str = "an_unwind_started_by_resume_unwind_is_noted_too";

/// `std::panic::resume_unwind` calls no panic hook, so an unwind it starts
/// is not noted; the crate's `resume_unwind` and `Panic::resume_unwind`
/// (a nested fiber's panic passed on) note it, and a fiber dropped while
/// suspended in a yield inside that unwind is leaked, not force-unwound
/// into an abort (found in review: both aborted). In a child process.
#[test]
fn an_unwind_started_by_resume_unwind_is_noted_too() {
    struct YieldsOnDrop;
    impl Drop for YieldsOnDrop {
        fn drop(&mut self) {
            yield_now();
        }
    }
    if is_child(RESUMED_CHILD) {
        no_core_dumps();
        let before = leaked_stacks();
        let direct = Fiber::<()>::new(FiberAttr::new().name("resumes")).unwrap();
        direct
            .set_function(Priority::NORMAL, || {
                let _y = YieldsOnDrop;
                spindle_fiber::resume_unwind(Box::new("no hook for this one"));
            })
            .unwrap();
        assert!(matches!(direct.run(), Ok(RunOutcome::Yielded(0))));
        drop(direct);
        let outer = Fiber::<()>::new(FiberAttr::new().name("outer")).unwrap();
        outer
            .set_function(Priority::NORMAL, || {
                let _y = YieldsOnDrop;
                let inner = Fiber::<()>::new(FiberAttr::new().name("inner")).unwrap();
                inner
                    .set_function(Priority::NORMAL, || panic!("inner panics"))
                    .unwrap();
                match inner.run() {
                    Ok(RunOutcome::Panicked(p)) => p.resume_unwind(),
                    other => panic!("unexpected {other:?}"),
                }
            })
            .unwrap();
        assert!(matches!(outer.run(), Ok(RunOutcome::Yielded(0))));
        drop(outer);
        eprintln!("child leaked: {}", leaked_stacks() - before);
        return;
    }
    let out = run_child(RESUMED_CHILD, 60);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(stderr.contains("child leaked: 2"), "{}", describe(&out));
}
