//! Nesting: a fiber runs another fiber inside itself.
//!
//! The library supports nesting: the inner fiber suspends back into the
//! outer one, and `current()` names whichever fiber is running.

mod common;

use common::{with_watchdog, DropCounter};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spindle_fiber::{current, yield_value, Fiber, FiberAttr, FiberError, FiberId, Priority, RunOutcome};

fn current_id() -> Option<FiberId> {
    current().map(|c| c.id())
}

#[test]
fn inner_fiber_yields_to_the_outer_fiber_and_current_stays_right() {
    with_watchdog(30, "nested_yield_and_current", || {
        let inner = Fiber::new(FiberAttr::new().name("inner")).unwrap();
        let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
        let (inner_id, outer_id) = (inner.id(), outer.id());

        inner
            .set_function(Priority::NORMAL, move || {
                let c = current().unwrap();
                assert_eq!(c.id(), inner_id);
                assert_eq!(c.name(), Some("inner"));
                yield_value(1);
                assert_eq!(current_id(), Some(inner_id), "inner after its first yield");
                yield_value(2);
                assert_eq!(current_id(), Some(inner_id), "inner after its second yield");
                "inner done"
            })
            .unwrap();

        outer
            .set_function(Priority::NORMAL, move || {
                let mut log = Vec::new();
                assert_eq!(current_id(), Some(outer_id));
                // The inner fiber's yield comes back here, not to the thread.
                match inner.run().unwrap() {
                    RunOutcome::Yielded(v) => log.push(v),
                    other => panic!("inner: {other:?}"),
                }
                assert_eq!(current_id(), Some(outer_id), "outer after inner yielded");
                assert_eq!(current().unwrap().name(), Some("outer"));
                // Now the outer fiber yields to the thread, the inner one
                // stays suspended inside it.
                yield_value(100);
                assert_eq!(current_id(), Some(outer_id), "outer after its own yield");
                match inner.run().unwrap() {
                    RunOutcome::Yielded(v) => log.push(v),
                    other => panic!("inner: {other:?}"),
                }
                assert_eq!(current_id(), Some(outer_id));
                let r = inner.run().unwrap().unwrap_returned();
                assert_eq!(r, "inner done");
                assert_eq!(current_id(), Some(outer_id), "outer after inner returned");
                assert!(matches!(inner.run(), Err(FiberError::Finished(id)) if id == inner_id));
                log
            })
            .unwrap();

        assert_eq!(current_id(), None);
        // The thread sees only the outer fiber's own yield.
        assert!(matches!(outer.run().unwrap(), RunOutcome::Yielded(100)));
        assert_eq!(current_id(), None, "thread after the outer fiber yielded");
        let log = outer.run().unwrap().unwrap_returned();
        assert_eq!(log, vec![1, 2]);
        assert_eq!(current_id(), None, "thread after the outer fiber returned");
    });
}

#[test]
fn running_a_fiber_from_inside_itself_is_refused() {
    with_watchdog(30, "run_self_from_inside", || {
        let fiber = Fiber::new(FiberAttr::new().name("selfish")).unwrap();
        let me = fiber.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                let err = me.run().unwrap_err();
                let busy = me.set_function(Priority::NORMAL, || unreachable!()).unwrap_err();
                (
                    err.to_string(),
                    matches!(err, FiberError::Running(id) if id == me.id()),
                    busy,
                )
            })
            .unwrap();
        let (msg, is_running, busy) = fiber.run().unwrap().unwrap_returned();
        assert!(is_running, "expected FiberError::Running, got: {msg}");
        assert!(msg.contains("already running"), "{msg}");
        assert!(
            msg.contains("never do either from inside the fiber"),
            "message says what to do: {msg}"
        );
        assert!(matches!(busy, FiberError::Running(_)), "{busy:?}");
        // Refusing did not disturb the fiber: it returned normally.
        assert_eq!(fiber.state(), spindle_fiber::FiberState::Finished);
    });
}

#[test]
fn an_inner_fiber_cannot_run_the_fiber_that_runs_it() {
    with_watchdog(30, "inner_runs_outer", || {
        let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
        let outer_handle = outer.clone();
        outer
            .set_function(Priority::NORMAL, move || {
                let inner = Fiber::new(FiberAttr::new().name("inner")).unwrap();
                let target = outer_handle.clone();
                inner
                    .set_function(Priority::NORMAL, move || {
                        matches!(target.run(), Err(FiberError::Running(_)))
                    })
                    .unwrap();
                inner.run().unwrap().unwrap_returned()
            })
            .unwrap();
        assert!(
            outer.run().unwrap().unwrap_returned(),
            "inner got Err(Running) for its runner"
        );
    });
}

#[test]
fn deep_nesting_keeps_current_right_at_every_level() {
    with_watchdog(30, "deep_nesting", || {
        /// Runs a chain of `depth` fibers, each inside the previous one;
        /// returns the ids seen by each level before and after its child ran.
        fn level(depth: usize) -> Vec<(FiberId, FiberId)> {
            let fiber = Fiber::new(FiberAttr::new().stack_size(256 * 1024)).unwrap();
            let id = fiber.id();
            fiber
                .set_function(Priority::NORMAL, move || {
                    let before = current_id().unwrap();
                    let mut seen = if depth > 1 { level(depth - 1) } else { Vec::new() };
                    // A yield at every level goes to the level just above.
                    yield_value(depth);
                    seen.push((before, current_id().unwrap()));
                    seen
                })
                .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(d) if d == depth));
            let seen = fiber.run().unwrap().unwrap_returned();
            let (before, after) = *seen.last().unwrap();
            assert_eq!((before, after), (id, id));
            seen
        }
        let seen = level(8);
        assert_eq!(seen.len(), 8);
        let mut ids: Vec<_> = seen.iter().map(|&(b, _)| b).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 8, "each level saw its own fiber");
        assert_eq!(current_id(), None);
    });
}

#[test]
fn a_panic_in_an_inner_fiber_comes_back_to_the_outer_fiber() {
    with_watchdog(30, "nested_panic", || {
        let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
        let outer_id = outer.id();
        outer
            .set_function(Priority::NORMAL, move || {
                let inner = Fiber::<()>::new(FiberAttr::new().name("inner")).unwrap();
                inner
                    .set_function(Priority::NORMAL, || panic!("inner fiber fails"))
                    .unwrap();
                let p = match inner.run().unwrap() {
                    RunOutcome::Panicked(p) => p,
                    other => panic!("expected a panic, got {other:?}"),
                };
                assert_eq!(current_id(), Some(outer_id), "outer after inner panicked");
                (p.fiber == inner.id(), p.message().map(str::to_owned))
            })
            .unwrap();
        let (right_fiber, msg) = outer.run().unwrap().unwrap_returned();
        assert!(right_fiber);
        assert_eq!(msg.as_deref(), Some("inner fiber fails"));
    });
}

#[test]
fn dropping_a_suspended_inner_fiber_inside_the_outer_one_unwinds_it() {
    with_watchdog(30, "nested_drop", || {
        let dropped = Arc::new(AtomicUsize::new(0));
        let seen_during_drop = Arc::new(AtomicUsize::new(0));
        let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
        let outer_id = outer.id();
        let (d, s) = (dropped.clone(), seen_during_drop.clone());
        outer
            .set_function(Priority::NORMAL, move || {
                let inner = Fiber::<()>::new(FiberAttr::new().name("inner")).unwrap();
                let inner_id = inner.id();
                let (d2, s2) = (d.clone(), s.clone());
                inner
                    .set_function(Priority::NORMAL, move || {
                        struct Probe(Arc<AtomicUsize>, FiberId);
                        impl Drop for Probe {
                            fn drop(&mut self) {
                                if current_id() == Some(self.1) {
                                    self.0.fetch_add(1, Ordering::SeqCst);
                                }
                            }
                        }
                        let _counter = DropCounter(d2);
                        let _probe = Probe(s2, inner_id);
                        yield_value(1);
                        unreachable!("the inner fiber is dropped, not resumed");
                    })
                    .unwrap();
                assert!(matches!(inner.run().unwrap(), RunOutcome::Yielded(1)));
                assert_eq!(d.load(Ordering::SeqCst), 0);
                drop(inner);
                assert_eq!(d.load(Ordering::SeqCst), 1, "inner locals dropped");
                assert_eq!(current_id(), Some(outer_id), "outer after dropping inner");
            })
            .unwrap();
        outer.run().unwrap().unwrap_returned();
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        assert_eq!(
            seen_during_drop.load(Ordering::SeqCst),
            1,
            "current() named the inner fiber while its locals were dropped"
        );
        assert_eq!(current_id(), None);
    });
}

#[test]
fn the_outer_fiber_stays_current_through_yields_after_dropping_a_suspended_inner_one() {
    with_watchdog(30, "nested_drop_yield", || {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
        let outer_id = outer.id();
        let log = seen.clone();
        outer
            .set_function(Priority::NORMAL, move || {
                let inner = Fiber::<()>::new(FiberAttr::new().name("inner")).unwrap();
                let log2 = log.clone();
                inner
                    .set_function(Priority::NORMAL, move || {
                        struct LogsInDrop(Arc<std::sync::Mutex<Vec<Option<FiberId>>>>);
                        impl Drop for LogsInDrop {
                            fn drop(&mut self) {
                                self.0.lock().unwrap().push(current_id());
                            }
                        }
                        let _guard = LogsInDrop(log2);
                        yield_value(1);
                        unreachable!("the inner fiber is dropped, not resumed");
                    })
                    .unwrap();
                let inner_id = inner.id();
                assert!(matches!(inner.run().unwrap(), RunOutcome::Yielded(1)));
                drop(inner);
                assert_eq!(current_id(), Some(outer_id), "outer after dropping inner");
                spindle_fiber::yield_now();
                assert_eq!(current_id(), Some(outer_id), "outer after its own yield");
                inner_id
            })
            .unwrap();
        assert!(matches!(outer.run().unwrap(), RunOutcome::Yielded(0)));
        assert_eq!(current_id(), None, "the thread is not left inside a fiber");
        let inner_id = outer.run().unwrap().unwrap_returned();
        assert_eq!(current_id(), None);
        assert_eq!(*seen.lock().unwrap(), vec![Some(inner_id)]);
    });
}
