//! Scopes: fibers borrow from the caller, every one is finished before the
//! scope returns, and a panicking fiber makes the scope panic at the end.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{watchdog, Flag};
use spindle_executor::{yield_now, Executor, SpawnOptions};

#[test]
fn scoped_fibers_borrow_locals_and_all_finish_before_return() {
    watchdog("scoped_fibers_borrow_locals_and_all_finish_before_return", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let data: Vec<u64> = (1..=10_000).collect();
        let weights: [u64; 4] = [1, 2, 3, 4];
        let shared: &[u64] = &weights;
        let finished = AtomicUsize::new(0);
        const N: usize = 40;

        stage.set("scope with borrowing fibers, half of them never joined explicitly");
        let joined_sum = exec.scope(|s| {
            let chunk = data.len() / N;
            let handles: Vec<_> = data
                .chunks(chunk)
                .enumerate()
                .map(|(i, part)| {
                    let finished = &finished;
                    s.spawn(move || {
                        let mut acc = 0;
                        for (k, v) in part.iter().enumerate() {
                            acc += v * shared[(i + k) % shared.len()];
                            if k % 50 == 0 {
                                yield_now();
                            }
                        }
                        finished.fetch_add(1, Ordering::SeqCst);
                        acc
                    })
                })
                .collect();
            // Join only the even ones; the scope must wait for the rest.
            handles
                .into_iter()
                .enumerate()
                .filter(|(i, _)| i % 2 == 0)
                .map(|(_, h)| h.join().unwrap())
                .sum::<u64>()
        });
        assert_eq!(finished.load(Ordering::SeqCst), N, "every scoped fiber finished before scope returned");
        let chunk = data.len() / N;
        let expected: u64 = data
            .chunks(chunk)
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(i, part)| {
                part.iter().enumerate().map(|(k, v)| v * shared[(i + k) % shared.len()]).sum::<u64>()
            })
            .sum();
        assert_eq!(joined_sum, expected);
    });
}

#[test]
fn scoped_fibers_write_through_disjoint_mutable_borrows() {
    watchdog("scoped_fibers_write_through_disjoint_mutable_borrows", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let mut out = vec![0u64; 1000];
        let input: Vec<u64> = (0..1000).collect();
        stage.set("each fiber fills its own chunk");
        exec.scope(|s| {
            for (dst, src) in out.chunks_mut(100).zip(input.chunks(100)) {
                s.spawn(move || {
                    for (d, v) in dst.iter_mut().zip(src) {
                        *d = v * v;
                        yield_now();
                    }
                });
            }
        });
        assert!(out.iter().enumerate().all(|(i, v)| *v == (i * i) as u64));
    });
}

#[test]
fn scope_with_a_panicking_fiber_panics_at_the_end() {
    watchdog("scope_with_a_panicking_fiber_panics_at_the_end", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let finished = AtomicUsize::new(0);
        let body_returned = Flag::new();
        stage.set("a scope where one of eleven fibers panics");
        let result = catch_unwind(AssertUnwindSafe(|| {
            exec.scope(|s| {
                s.spawn_with(SpawnOptions::new().name("failing"), || {
                    yield_now();
                    panic!("scoped fiber fails");
                });
                for _ in 0..10 {
                    s.spawn(|| {
                        for _ in 0..10 {
                            yield_now();
                        }
                        finished.fetch_add(1, Ordering::SeqCst);
                    });
                }
                body_returned.set();
            })
        }));
        let payload = result.expect_err("the scope panics because a fiber did");
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        assert!(msg.contains("scope"), "unexpected panic message: {msg}");
        assert!(
            msg.contains("fiber 'failing'") && msg.contains("panicked: scoped fiber fails"),
            "the scope's panic names the fiber and its panic: {msg}"
        );
        assert!(body_returned.is_set(), "the scope panics at the end, after its body");
        assert_eq!(finished.load(Ordering::SeqCst), 10, "the other fibers still all finished first");
        stage.set("the executor still works after the scope panicked");
        assert_eq!(exec.block_on(|| 3).unwrap(), 3);
    });
}

#[test]
fn scope_whose_body_panics_still_waits_for_its_fibers() {
    watchdog("scope_whose_body_panics_still_waits_for_its_fibers", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let finished = AtomicUsize::new(0);
        stage.set("the scope body panics after spawning");
        let result = catch_unwind(AssertUnwindSafe(|| {
            exec.scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        for _ in 0..20 {
                            yield_now();
                        }
                        finished.fetch_add(1, Ordering::SeqCst);
                    });
                }
                panic!("scope body fails");
            })
        }));
        let payload = result.expect_err("the body's panic comes out of the scope");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"scope body fails"), "the body's own payload");
        assert_eq!(finished.load(Ordering::SeqCst), 8, "the fibers finished before the unwind left");
    });
}

#[test]
fn scope_where_the_panic_was_joined_and_handled_returns_normally() {
    watchdog("scope_where_the_panic_was_joined_and_handled_returns_normally", 30, |stage| {
        // A panic that the body joined and handled is not propagated again
        // (the scope's own documentation of its `unwound` flag: "unwound
        // without being joined"; std::thread::scope behaves the same way).
        let exec = Executor::builder().workers(2).build();
        stage.set("a scope that joins its panicking fiber");
        let result = catch_unwind(AssertUnwindSafe(|| {
            exec.scope(|s| {
                let h = s.spawn(|| -> u32 { panic!("handled by the body") });
                h.join().expect_err("the fiber panicked").panic_message().map(str::to_owned)
            })
        }));
        let seen = result.expect("a joined and handled panic does not make the scope panic");
        assert_eq!(seen.as_deref(), Some("handled by the body"));
    });
}

#[test]
fn scope_inside_a_fiber() {
    watchdog("scope_inside_a_fiber", 30, |stage| {
        let exec = Arc::new(Executor::builder().workers(2).build());
        stage.set("a fiber runs a scope on its own executor");
        let e = Arc::clone(&exec);
        let total = exec
            .block_on(move || {
                let local: Vec<u64> = (0..100).collect();
                let sum = AtomicUsize::new(0);
                e.scope(|s| {
                    for part in local.chunks(10) {
                        let sum = &sum;
                        s.spawn(move || {
                            yield_now();
                            sum.fetch_add(part.iter().sum::<u64>() as usize, Ordering::SeqCst);
                        });
                    }
                });
                drop(e);
                sum.load(Ordering::SeqCst)
            })
            .unwrap();
        assert_eq!(total, (0..100).sum::<usize>());
    });
}

/// Counts its drops; borrows the counter, so it may only be dropped while
/// the scope that made it is open.
struct CountsDrop<'a>(&'a AtomicUsize);

impl Drop for CountsDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_value_nobody_joined_is_dropped_before_the_scope_returns() {
    watchdog("a_value_nobody_joined_is_dropped_before_the_scope_returns", 30, |stage| {
        let drops = AtomicUsize::new(0);
        let exec = Executor::builder().workers(2).build();
        stage.set("a scoped fiber woken early from a long yield_timeout returns a borrowing value");
        exec.scope(|s| {
            let drops = &drops;
            let h = s.spawn(move || {
                // Woken early below; its timer must not keep the task alive.
                assert!(!spindle_executor::yield_timeout(std::time::Duration::from_secs(3600)));
                CountsDrop(drops)
            });
            // The handle's wake only ends a yield_timeout that has begun: retry until it took.
            common::wait_for(&stage, "the fiber to finish after its wake", || {
                h.wake();
                h.is_finished()
            });
            drop(h); // never joined: the handle's drop drops the finished value
        });
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the unjoined value was dropped before `scope` returned");
    });
}

#[test]
fn a_scope_whose_body_panics_inside_a_fiber_waits_on_the_same_worker() {
    watchdog("a_scope_whose_body_panics_inside_a_fiber_waits_on_the_same_worker", 30, |stage| {
        // One worker: the scoped fibers can only run if the scope's own
        // fiber sleeps while it waits for them.
        let exec = Executor::builder().workers(1).build();
        stage.set("a fiber opens a scope, spawns, and panics in the body");
        let done = Flag::new();
        let child_done = done.clone();
        let r = exec.block_on(move || {
            catch_unwind(AssertUnwindSafe(|| {
                spindle_executor::Handle::current().unwrap().scope(|s| {
                    s.spawn(|| {
                        yield_now();
                        child_done.set();
                    });
                    yield_now();
                    panic!("body fails");
                })
            }))
            .map_err(|p| p.downcast_ref::<&str>().copied())
        });
        assert_eq!(r.unwrap().unwrap_err(), Some("body fails"), "the body's panic comes out of the scope");
        assert!(done.is_set(), "the scoped fiber finished before the scope unwound");
    });
}

#[test]
fn a_scope_in_a_woken_fiber_that_is_dropped_still_waits_for_its_fibers() {
    watchdog("a_scope_in_a_woken_fiber_that_is_dropped_still_waits_for_its_fibers", 30, |stage| {
        use spindle_fiber::{Fiber, FiberAttr, FiberState, Priority, RunOutcome};
        let exec = Executor::builder().workers(1).build();
        let handle = exec.handle();
        let (quick_done, go, slow_done) = (Flag::new(), Flag::new(), Flag::new());
        let (q, g, d) = (quick_done.clone(), go.clone(), slow_done.clone());
        // The quick fiber ends only once the waiting fiber is asleep in its
        // scope: ended before, its token was taken without a sleep, the
        // fiber slept for the slow one, and nothing woke it (the test's
        // own race, seen twice in CI-like runs).
        let asleep = Flag::new();
        let a = asleep.clone();
        // A plain fiber (no executor) opens a scope over a local of its own
        // stack and waits in it.
        let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, move || {
                let local = [1u64, 2, 3];
                let local = &local;
                handle.scope(|s| {
                    s.spawn(move || {
                        while !a.is_set() {
                            yield_now();
                        }
                        q.set();
                    });
                    s.spawn(move || {
                        while !g.is_set() {
                            yield_now();
                        }
                        for _ in 0..100 {
                            yield_now();
                        }
                        assert_eq!(local.iter().sum::<u64>(), 6);
                        d.set();
                    });
                });
            })
            .unwrap();
        stage.set("the fiber waits in its scope");
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        asleep.set();
        stage.set("the quick scoped fiber ends and wakes the waiting fiber");
        while !(quick_done.is_set() && fiber.state() == FiberState::Ready) {
            std::thread::yield_now();
        }
        stage.set("dropping the woken fiber: its scope must wait for the slow fiber first");
        go.set();
        drop(fiber);
        assert!(slow_done.is_set(), "the scope was left while a scoped fiber still used its borrow");
    });
}

/// A scoped fiber asleep on a `spindle-sync` semaphore when its executor
/// shuts down: the shutdown completes its task as cancelled, but its stack,
/// which borrows the scope's data, is still suspended. The scope must not
/// return before that stack is unwound. Here the semaphore is released by a
/// thread-local destructor of the fiber's worker as that thread exits,
/// which unwinds the fiber there; a guard on its stack that borrows a local
/// of this frame must have run by the time `scope` returns. (The wake comes
/// from a thread-local destructor, so the test leans on the C library
/// running those at thread exit, while the fiber crate's own words are
/// still readable: glibc does. Where it did not, the scope would hang and
/// the watchdog would fail the test, not pass it.)
#[test]
fn a_scoped_fiber_asleep_at_shutdown_is_unwound_before_the_scope_returns() {
    use std::cell::RefCell;
    use std::sync::mpsc;

    use spindle_executor::sync::Semaphore;
    use spindle_executor::OnDeadlock;

    /// Releases its semaphore when dropped (at the worker thread's exit).
    struct Releaser(Arc<Semaphore>);
    impl Drop for Releaser {
        fn drop(&mut self) {
            self.0.release(1);
        }
    }
    thread_local! {
        static RELEASE_AT_EXIT: RefCell<Option<Releaser>> = const { RefCell::new(None) };
    }
    /// Counts its drop in a counter the scope's caller owns.
    struct Guard<'a>(&'a AtomicUsize);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    watchdog("a_scoped_fiber_asleep_at_shutdown_is_unwound_before_the_scope_returns", 60, |stage| {
        let exec = Executor::builder().workers(1).on_deadlock(OnDeadlock::Ignore).build();
        let handle = exec.handle();
        let (to_dropper, dropper_rx) = mpsc::channel::<Executor>();
        let dropper = std::thread::spawn(move || drop(dropper_rx.recv().unwrap()));
        let guard_drops = AtomicUsize::new(0);
        let sem = Arc::new(Semaphore::new(0));
        let mut exec = Some(exec);

        handle.scope(|s| {
            let (fiber_sem, drops) = (Arc::clone(&sem), &guard_drops);
            let h = s.spawn(move || {
                RELEASE_AT_EXIT.with(|r| *r.borrow_mut() = Some(Releaser(Arc::clone(&fiber_sem))));
                let _guard = Guard(drops);
                fiber_sem.acquire();
            });
            stage.set("waiting for the scoped fiber to sleep on the semaphore");
            while sem.waiters() == 0 {
                std::thread::yield_now();
            }
            stage.set("shutting the executor down on another thread");
            to_dropper.send(exec.take().unwrap()).unwrap();
            assert!(h.join().expect_err("the fiber never returns").is_cancelled());
            stage.set("scope waiting for the fiber's stack to be unwound");
        });
        assert_eq!(
            guard_drops.load(Ordering::SeqCst),
            1,
            "the scoped fiber's stack, which borrows this frame, was unwound before the scope returned"
        );
        dropper.join().unwrap();
    });
}

/// A value whose drop panics.
struct PanicsWhenDropped;

impl Drop for PanicsWhenDropped {
    fn drop(&mut self) {
        panic!("the value's drop panics");
    }
}

/// The message of a scope's panic.
fn scope_panic_message(result: std::thread::Result<()>) -> String {
    let payload = result.expect_err("the scope panics at its end");
    match (payload.downcast_ref::<String>(), payload.downcast_ref::<&str>()) {
        (Some(s), _) => s.clone(),
        (None, Some(s)) => (*s).to_owned(),
        (None, None) => "(not a string)".to_owned(),
    }
}

/// A scoped fiber's value whose drop panics, dropped by its handle while
/// the scope's body unwinds from a panic of its own (caught in the body):
/// the handle contains the second panic, and the scope still reports it
/// at its end (it returned normally).
#[test]
fn a_scoped_value_whose_drop_panics_in_a_handle_dropped_while_unwinding_is_reported() {
    watchdog(
        "a_scoped_value_whose_drop_panics_in_a_handle_dropped_while_unwinding_is_reported",
        30,
        |_stage| {
            let exec = Executor::builder().workers(1).build();
            let result = catch_unwind(AssertUnwindSafe(|| {
                exec.scope(|s| {
                    let h = s.spawn_with(SpawnOptions::new().name("bomb"), || PanicsWhenDropped);
                    while !h.is_finished() {
                        std::thread::yield_now();
                    }
                    let _ = catch_unwind(AssertUnwindSafe(move || {
                        let _handle = h;
                        panic!("the body's own panic, caught in the body");
                    }));
                })
            }));
            let msg = scope_panic_message(result);
            assert!(msg.contains("the value of fiber 'bomb' panicked when dropped"), "{msg}");
        },
    );
}

/// A scoped fiber's value whose drop panics, its handle dropped before the
/// fiber returns: the fiber drops the value as it returns, so the panic is
/// the fiber's own, and the scope reports that.
#[test]
fn a_scoped_value_whose_drop_panics_on_its_fiber_is_reported() {
    watchdog("a_scoped_value_whose_drop_panics_on_its_fiber_is_reported", 30, |_stage| {
        let exec = Executor::builder().workers(1).build();
        let gate = spindle_sync::Semaphore::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            exec.scope(|s| {
                let h = s.spawn_with(SpawnOptions::new().name("bomb"), || {
                    gate.acquire();
                    PanicsWhenDropped
                });
                drop(h);
                gate.release(1);
            })
        }));
        let msg = scope_panic_message(result);
        assert!(msg.contains("'bomb'") && msg.contains("the value's drop panics"), "{msg}");
    });
}
