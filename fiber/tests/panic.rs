//! A panic inside a fiber comes back from `run`; the fiber is reusable and
//! the thread lives on.

mod common;

use common::{describe, is_child, run_child, with_watchdog, DropCounter};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spindle_fiber::{current, yield_now, Fiber, FiberAttr, FiberError, FiberState, Priority, RunOutcome};

#[test]
fn a_panic_comes_back_from_run_with_message_id_and_name() {
    with_watchdog(30, "panic_comes_back", || {
        let fiber = Fiber::new(FiberAttr::new().name("doomed")).unwrap();
        fiber
            .set_function(Priority::NORMAL, || -> u32 { panic!("boom") })
            .unwrap();
        let p = match fiber.run() {
            Ok(RunOutcome::Panicked(p)) => p,
            other => panic!("expected Panicked, got {other:?}"),
        };
        assert_eq!(p.message(), Some("boom"));
        assert_eq!(p.fiber, fiber.id());
        assert_eq!(p.name.as_deref(), Some("doomed"));
        let dbg = format!("{p:?}");
        assert!(dbg.contains("doomed") && dbg.contains("boom"), "{dbg}");

        // The thread is alive and not in a fiber any more.
        assert!(current().is_none());
        assert_eq!(fiber.state(), FiberState::Finished);
        assert!(matches!(fiber.run(), Err(FiberError::Finished(_))));

        // The fiber is reusable.
        fiber.set_function(Priority::NORMAL, || 7).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(7)));
        fiber
            .set_function(Priority::NORMAL, || {
                yield_now();
                8
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(8)));
    });
}

#[test]
fn formatted_and_non_string_payloads() {
    with_watchdog(30, "panic_payloads", || {
        let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
        let n = 41;
        fiber
            .set_function(Priority::NORMAL, move || panic!("answer is {}", n + 1))
            .unwrap();
        match fiber.run().unwrap() {
            RunOutcome::Panicked(p) => {
                assert_eq!(p.message(), Some("answer is 42"));
                assert_eq!(p.name, None);
            }
            other => panic!("expected Panicked, got {other:?}"),
        }

        fiber
            .set_function(Priority::NORMAL, || std::panic::panic_any(1234u32))
            .unwrap();
        match fiber.run().unwrap() {
            RunOutcome::Panicked(p) => {
                assert_eq!(p.message(), None);
                assert_eq!(p.payload.downcast_ref::<u32>(), Some(&1234));
            }
            other => panic!("expected Panicked, got {other:?}"),
        }
    });
}

#[test]
fn a_panic_after_yields_drops_the_locals_and_can_be_resumed_by_the_caller() {
    with_watchdog(30, "panic_after_yields", || {
        let drops = Arc::new(AtomicUsize::new(0));
        let fiber = Fiber::<()>::new(FiberAttr::new().name("late")).unwrap();
        let d = drops.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                let _guard = DropCounter(d);
                yield_now();
                yield_now();
                panic!("late failure");
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        let p = match fiber.run().unwrap() {
            RunOutcome::Panicked(p) => p,
            other => panic!("expected Panicked, got {other:?}"),
        };
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the unwind dropped the fiber's locals"
        );

        // The caller decides to propagate it.
        let payload = catch_unwind(AssertUnwindSafe(|| p.resume_unwind())).unwrap_err();
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"late failure"));
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "no second drop");
    });
}

#[test]
fn unwrap_returned_resumes_the_fibers_panic() {
    with_watchdog(30, "unwrap_returned_resumes", || {
        let fiber = Fiber::<i32>::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, || panic!("propagated"))
            .unwrap();
        let outcome = fiber.run().unwrap();
        let payload = catch_unwind(AssertUnwindSafe(|| outcome.unwrap_returned())).unwrap_err();
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"propagated"));
        fiber.set_function(Priority::NORMAL, || 3).unwrap();
        assert_eq!(fiber.run().unwrap().unwrap_returned(), 3);
    });
}

#[test]
fn many_panics_in_a_row_on_one_thread() {
    with_watchdog(60, "many_panics", || {
        let fiber = Fiber::<usize>::new(FiberAttr::new()).unwrap();
        for i in 0..100 {
            fiber
                .set_function(Priority::NORMAL, move || {
                    if i % 2 == 0 {
                        std::panic::panic_any(i)
                    }
                    i
                })
                .unwrap();
            match fiber.run().unwrap() {
                RunOutcome::Panicked(p) if i % 2 == 0 => {
                    assert_eq!(p.payload.downcast_ref::<usize>(), Some(&i))
                }
                RunOutcome::Returned(v) if i % 2 == 1 => assert_eq!(v, i),
                other => panic!("cycle {i}: unexpected {other:?}"),
            }
        }
    });
}

const PANIC_REPORT_CHILD: &str = "panic_report_names_the_fiber";

#[test]
fn panic_report_names_the_fiber() {
    if is_child(PANIC_REPORT_CHILD) {
        let fiber = Fiber::<()>::new(FiberAttr::new().name("reporter")).unwrap();
        eprintln!("child fiber id: {}", fiber.id());
        fiber
            .set_function(Priority::NORMAL, || panic!("reported panic"))
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Panicked(_)));
        return;
    }
    let out = run_child(PANIC_REPORT_CHILD, 60);
    let all = describe(&out);
    assert!(out.status.success(), "child failed:\n{all}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let id = stderr
        .lines()
        .find_map(|l| l.strip_prefix("child fiber id: "))
        .unwrap_or_else(|| panic!("child did not print its fiber id:\n{all}"))
        .to_owned();
    let expected = format!("panic in fiber 'reporter' ({id}):");
    assert!(
        stderr.contains(&expected),
        "expected {expected:?} in the panic report:\n{all}"
    );
    assert!(
        stderr.contains("reported panic"),
        "the usual panic message follows:\n{all}"
    );
}
