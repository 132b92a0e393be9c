//! Fibers that move between threads: migratable fibers (the unsafe opt-in)
//! resume correctly elsewhere; pinned fibers (the safe default) refuse to.

mod common;

use common::{with_watchdog, DropCounter};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};

use spindle_fiber::{
    current, current_id, in_fiber, leaked_stacks, yield_value, Fiber, FiberAttr, FiberError, FiberId,
    FiberState, Priority, RunOutcome, ThreadToken,
};

/// The calling thread's id, read through a call that is not inlined into a
/// function that suspends (the contract of `set_function_migratable`).
#[inline(never)]
fn thread_now() -> ThreadId {
    thread::current().id()
}

#[inline(never)]
fn fiber_now() -> Option<FiberId> {
    current().map(|c| c.id())
}

/// Serialises the tests that compare `leaked_stacks()` (a process-wide
/// count) before and after, so they do not see each other's leaks.
static LEAK_COUNT: Mutex<()> = Mutex::new(());

/// What the migrating fiber observed before and after its yield.
#[derive(Debug)]
struct Observed {
    before_thread: ThreadId,
    after_thread: ThreadId,
    before_fiber: Option<FiberId>,
    after_fiber: Option<FiberId>,
    local_sum: u64,
}

#[test]
fn a_migratable_fiber_yields_on_one_thread_and_resumes_on_another() {
    with_watchdog(30, "migrate_a_to_b", || {
        let (to_b, from_a) = mpsc::channel::<Fiber<Observed>>();
        let a = thread::spawn(move || {
            let fiber = Fiber::new(FiberAttr::new().name("traveller")).unwrap();
            // SAFETY: the function holds only Send values (integers, ids)
            // across its suspension, and reads thread-locals only through
            // the non-inlined helpers above.
            unsafe {
                fiber.set_function_migratable(Priority::NORMAL, || {
                    let before_thread = thread_now();
                    let before_fiber = fiber_now();
                    let values: Vec<u64> = (1..=10).collect();
                    yield_value(1);
                    Observed {
                        before_thread,
                        after_thread: thread_now(),
                        before_fiber,
                        after_fiber: fiber_now(),
                        local_sum: values.iter().sum(),
                    }
                })
            }
            .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(1)));
            assert!(current().is_none());
            let id = fiber.id();
            to_b.send(fiber).unwrap();
            (thread_now(), id)
        });
        let b = thread::spawn(move || {
            let fiber = from_a.recv().unwrap();
            let seen = fiber.run().unwrap().unwrap_returned();
            assert!(current().is_none(), "thread B is not left inside the fiber");
            (thread_now(), fiber.id(), seen, fiber.stats(), fiber.state())
        });
        let (a_id, fiber_id) = a.join().unwrap();
        let (b_id, fiber_id_b, seen, stats, state) = b.join().unwrap();
        assert_eq!(fiber_id, fiber_id_b);
        assert_ne!(a_id, b_id);
        assert_eq!(seen.before_thread, a_id, "first run on thread A");
        assert_eq!(seen.after_thread, b_id, "resumed on thread B");
        assert_eq!(seen.before_fiber, Some(fiber_id));
        assert_eq!(
            seen.after_fiber,
            Some(fiber_id),
            "current() right after migrating"
        );
        assert_eq!(seen.local_sum, 55, "the stack's contents moved with the fiber");
        assert_eq!(stats.migrations, 1);
        assert_eq!(stats.runs, 2);
        assert_eq!(stats.yields, 1);
        assert_eq!(state, FiberState::Finished);
    });
}

/// Runs every fiber that arrives in `inbox` once; passes it on to `next` if
/// it yielded, or reports it to `done` if it returned.
fn ping_pong_worker(
    inbox: mpsc::Receiver<Fiber<Vec<ThreadId>>>,
    next: mpsc::Sender<Fiber<Vec<ThreadId>>>,
    done: mpsc::Sender<(Vec<ThreadId>, Fiber<Vec<ThreadId>>)>,
) -> ThreadId {
    for fiber in inbox {
        match fiber.run().unwrap() {
            RunOutcome::Yielded(_) => next.send(fiber).unwrap(),
            RunOutcome::Returned(seen) => {
                done.send((seen, fiber)).unwrap();
                // Dropping `next` lets the other worker's loop end.
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    thread_now()
}

#[test]
fn a_migratable_fiber_ping_pongs_between_two_threads() {
    const HOPS: usize = 200;
    with_watchdog(60, "ping_pong", || {
        let (to_a, at_a) = mpsc::channel();
        let (to_b, at_b) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();

        let fiber = Fiber::new(FiberAttr::new().name("ping-pong")).unwrap();
        // SAFETY: only a Vec of ThreadIds (Send) is alive across the
        // suspensions; thread-locals are read through a non-inlined call.
        unsafe {
            fiber.set_function_migratable(Priority::NORMAL, || {
                let mut seen = Vec::with_capacity(HOPS + 1);
                for i in 0..HOPS {
                    seen.push(thread_now());
                    yield_value(i);
                }
                seen.push(thread_now());
                seen
            })
        }
        .unwrap();

        let done_a = done_tx.clone();
        let to_a_from_b = to_a.clone();
        let a = thread::spawn(move || ping_pong_worker(at_a, to_b, done_a));
        let b = thread::spawn(move || ping_pong_worker(at_b, to_a_from_b, done_tx));
        to_a.send(fiber).unwrap();
        drop(to_a);

        let (seen, fiber) = done_rx.recv().expect("the fiber returned on one of the workers");
        let a_id = a.join().unwrap();
        let b_id = b.join().unwrap();
        assert_eq!(seen.len(), HOPS + 1);
        for (i, t) in seen.iter().enumerate() {
            let expected = if i % 2 == 0 { a_id } else { b_id };
            assert_eq!(*t, expected, "run {i} happened on the wrong thread");
        }
        let stats = fiber.stats();
        assert_eq!(stats.runs, HOPS as u64 + 1);
        assert_eq!(stats.yields, HOPS as u64);
        assert_eq!(
            stats.migrations, HOPS as u64,
            "every run after the first changed thread"
        );
    });
}

#[test]
fn a_pinned_fiber_refuses_to_run_on_another_thread_and_still_works_on_its_own() {
    with_watchdog(30, "pinned_wrong_thread", || {
        let (to_b, at_b) = mpsc::channel::<Fiber<ThreadId>>();
        let (back_to_a, at_a) = mpsc::channel::<Fiber<ThreadId>>();
        let a = thread::spawn(move || {
            let fiber = Fiber::new(FiberAttr::new().name("homebody")).unwrap();
            fiber
                .set_function(Priority::NORMAL, || {
                    let before = thread_now();
                    yield_value(1);
                    let after = thread_now();
                    assert_eq!(before, after, "a pinned fiber resumed on another thread");
                    after
                })
                .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(1)));
            to_b.send(fiber).unwrap();
            let fiber = at_a.recv().unwrap();
            // Back home it continues where it left off.
            let ran_on = fiber.run().unwrap().unwrap_returned();
            assert_eq!(ran_on, thread_now());
            let stats = fiber.stats();
            assert_eq!(stats.runs, 2, "the refused run is not counted");
            assert_eq!(stats.migrations, 0);
            // Once finished it may take a new function and run anywhere.
            fiber.set_function(Priority::NORMAL, thread_now).unwrap();
            fiber
        });
        let fiber = at_b.recv().unwrap();
        let err = fiber.run().unwrap_err();
        assert!(
            matches!(err, FiberError::WrongThread(id) if id == fiber.id()),
            "{err:?}"
        );
        // The run made the fiber current before its pin check refused it,
        // and put back what was current (nothing, on this thread).
        assert!(
            spindle_fiber::current().is_none(),
            "a refused run left a fiber current"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("pinned to another thread (the one it started on"),
            "{msg}"
        );
        assert!(
            msg.contains("set_function_migratable"),
            "message says what to do: {msg}"
        );
        assert_eq!(
            fiber.state(),
            FiberState::Ready,
            "a refused run leaves it runnable"
        );
        assert!(matches!(
            fiber.set_function(Priority::NORMAL, thread_now),
            Err(FiberError::Busy(_))
        ));
        back_to_a.send(fiber).unwrap();

        let fiber = a.join().unwrap();
        // A new function is not pinned to the old function's thread.
        assert_eq!(fiber.run().unwrap().unwrap_returned(), thread_now());
    });
}

#[test]
fn a_migratable_fiber_dropped_on_another_thread_is_unwound_there() {
    with_watchdog(30, "migratable_drop_elsewhere", || {
        let _serial = LEAK_COUNT.lock().unwrap_or_else(|e| e.into_inner());
        let drops = Arc::new(AtomicUsize::new(0));
        let leaked_before = leaked_stacks();
        let d = drops.clone();
        let fiber = thread::spawn(move || {
            let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
            // SAFETY: the only local alive across the yield is a counter
            // holding an Arc (Send).
            unsafe {
                fiber.set_function_migratable(Priority::NORMAL, move || {
                    let _g = DropCounter(d);
                    yield_value(1);
                })
            }
            .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(1)));
            fiber
        })
        .join()
        .unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(fiber);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "unwound on the dropping thread");
        assert_eq!(leaked_stacks(), leaked_before);
    });
}

#[test]
fn a_suspended_pinned_fiber_dropped_on_another_thread_is_leaked_not_unwound() {
    with_watchdog(30, "pinned_drop_elsewhere", || {
        let _serial = LEAK_COUNT.lock().unwrap_or_else(|e| e.into_inner());
        let drops = Arc::new(AtomicUsize::new(0));
        let leaked_before = leaked_stacks();
        let d = drops.clone();
        let fiber = thread::spawn(move || {
            let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
            fiber
                .set_function(Priority::NORMAL, move || {
                    let _g = DropCounter(d);
                    yield_value(1);
                })
                .unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(1)));
            fiber
        })
        .join()
        .unwrap();
        drop(fiber);
        // Its locals may be thread-affine: they must not be dropped here.
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "a pinned fiber's locals were dropped elsewhere"
        );
        assert_eq!(leaked_stacks(), leaked_before + 1, "the leak is counted");
    });
}

#[test]
fn threads_racing_to_run_one_fiber_take_turns() {
    const YIELDS: usize = 2_000;
    with_watchdog(60, "racing_runs", || {
        let fiber = Fiber::new(FiberAttr::new().name("contended")).unwrap();
        // SAFETY: only integers are alive across the suspensions.
        unsafe {
            fiber.set_function_migratable(Priority::NORMAL, || {
                for i in 0..YIELDS {
                    yield_value(i);
                }
                YIELDS
            })
        }
        .unwrap();
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let fiber = fiber.clone();
                thread::spawn(move || {
                    let mut seen = Vec::new();
                    loop {
                        match fiber.run() {
                            Ok(RunOutcome::Yielded(v)) => seen.push(v),
                            Ok(RunOutcome::Returned(v)) => {
                                seen.push(v);
                                break;
                            }
                            Ok(other) => panic!("unexpected {other:?}"),
                            // The other thread is running it right now.
                            Err(FiberError::Running(_)) => std::hint::spin_loop(),
                            Err(FiberError::Finished(_)) => break,
                            Err(e) => panic!("unexpected error: {e}"),
                        }
                    }
                    seen
                })
            })
            .collect();
        let mut all = Vec::new();
        for r in racers {
            let seen = r.join().unwrap();
            assert!(
                seen.windows(2).all(|w| w[0] < w[1]),
                "each thread saw increasing values"
            );
            all.extend(seen);
        }
        all.sort_unstable();
        assert_eq!(all, (0..=YIELDS).collect::<Vec<_>>(), "every value exactly once");
        let stats = fiber.stats();
        assert_eq!(stats.runs, YIELDS as u64 + 1);
        assert_eq!(stats.yields, YIELDS as u64);
        assert!(stats.migrations <= YIELDS as u64);
    });
}

/// The library's own thread-local accesses are inlined into the caller (on
/// x86-64 Linux): here `run` (always inlined) and `yield_value` put them in
/// a fiber function that runs a fiber on thread X, moves to thread Y and
/// runs it again there. Every lookup must see the thread it runs on.
#[test]
fn a_migrating_fiber_that_runs_another_fiber_on_both_threads_keeps_current_right() {
    with_watchdog(60, "nested_run_in_a_migrating_fiber", || {
        for _ in 0..200 {
            let (to_y, from_x) = mpsc::channel::<Fiber<Vec<Option<FiberId>>>>();
            let x = thread::spawn(move || {
                let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
                // SAFETY: both functions hold only Send values (fibers, ids,
                // a Vec) across their suspensions and read no thread-local
                // of their own.
                unsafe {
                    outer
                        .set_function_migratable(Priority::NORMAL, || {
                            let inner = Fiber::new(FiberAttr::new().name("inner")).unwrap();
                            inner
                                .set_function_migratable(Priority::NORMAL, || {
                                    let a = current_id();
                                    yield_value(7);
                                    (a, current_id())
                                })
                                .unwrap();
                            let mut seen = vec![current_id()];
                            assert!(matches!(inner.run().unwrap(), RunOutcome::Yielded(7)));
                            seen.push(current_id());
                            yield_value(1); // moves to thread Y
                            seen.push(current_id());
                            let (a, b) = inner.run().unwrap().unwrap_returned();
                            seen.extend([a, b, current_id(), Some(inner.id())]);
                            seen
                        })
                        .unwrap();
                }
                assert!(matches!(outer.run().unwrap(), RunOutcome::Yielded(1)));
                assert!(!in_fiber(), "thread X is left inside a fiber");
                let id = outer.id();
                to_y.send(outer).unwrap();
                id
            });
            let y = thread::spawn(move || {
                let outer = from_x.recv().unwrap();
                let seen = outer.run().unwrap().unwrap_returned();
                assert!(!in_fiber(), "thread Y is left inside a fiber");
                seen
            });
            let outer = Some(x.join().unwrap());
            let seen = y.join().unwrap();
            let inner = seen[6];
            assert_eq!(
                seen,
                vec![outer, outer, outer, inner, inner, outer, inner],
                "current_id() at each step, outer {outer:?}, inner {inner:?}"
            );
        }
    });
}

/// A pinned fiber's refused run from inside another fiber, on another
/// thread: the run made the inner fiber current before its pin check, and
/// puts the outer one back.
#[test]
fn a_refused_run_inside_a_fiber_leaves_that_fiber_current() {
    with_watchdog(30, "refused_run_nested", || {
        let pinned = Fiber::new(FiberAttr::new().name("pinned")).unwrap();
        pinned
            .set_function(Priority::NORMAL, || {
                yield_value(1);
                2
            })
            .unwrap();
        assert!(matches!(pinned.run().unwrap(), RunOutcome::Yielded(1)));
        let pinned_id = pinned.id();

        let pinned = thread::spawn(move || {
            let outer = Fiber::new(FiberAttr::new().name("outer")).unwrap();
            let outer_id = outer.id();
            outer
                .set_function(Priority::NORMAL, move || {
                    let err = pinned.run().unwrap_err();
                    assert!(
                        matches!(err, FiberError::WrongThread(id) if id == pinned_id),
                        "{err:?}"
                    );
                    assert_eq!(fiber_now(), Some(outer_id), "the outer fiber is current again");
                    pinned
                })
                .unwrap();
            let pinned = outer.run().unwrap().unwrap_returned();
            assert_eq!(
                fiber_now(),
                None,
                "nothing is current on the thread after the outer run"
            );
            pinned
        })
        .join()
        .unwrap();
        // Back on its own thread it finishes.
        assert_eq!(pinned.run().unwrap().unwrap_returned(), 2);
    });
}

const LEAK_WARNING_CHILD: &str = "a_leaked_suspended_fiber_is_reported_once";

/// Leaking a suspended pinned fiber's stack (its last handle dropped on
/// another thread) says so on stderr, naming the fiber and what to do,
/// once per process: the mistake is otherwise silent. Checked in a child
/// process, whose stderr the test reads (and which has not warned yet).
#[test]
fn a_leaked_suspended_fiber_is_reported_once() {
    if common::is_child(LEAK_WARNING_CHILD) {
        for name in ["first-leak", "second-leak"] {
            let fiber = thread::spawn(move || {
                let fiber = Fiber::<()>::new(FiberAttr::new().name(name)).unwrap();
                fiber.set_function(Priority::NORMAL, || yield_value(1)).unwrap();
                assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(1)));
                fiber
            })
            .join()
            .unwrap();
            drop(fiber);
        }
        eprintln!("child leaked: {}", leaked_stacks());
        return;
    }
    let out = common::run_child(LEAK_WARNING_CHILD, 60);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", common::describe(&out));
    assert!(stderr.contains("child leaked: 2"), "{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("spindle-fiber:"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning for two leaks: {stderr}");
    let w = warnings[0];
    assert!(w.contains("'first-leak'") && w.contains("leaked"), "{w}");
    assert!(
        w.contains("own thread") && w.contains("set_function_migratable"),
        "{w}"
    );
}

/// What `runner_thread` gives: its token, where to send fibers, and where
/// each comes back with its run's outcome.
type Runner = (
    ThreadToken,
    mpsc::Sender<Fiber<ThreadId>>,
    mpsc::Receiver<(Fiber<ThreadId>, String)>,
);

/// A thread that runs the fibers sent to it, once each, and sends back
/// each run's outcome (the fiber with it), until the sender is dropped.
fn runner_thread() -> Runner {
    let (to_runner, inbox) = mpsc::channel::<Fiber<ThreadId>>();
    let (outbox, from_runner) = mpsc::channel();
    let (token_tx, token_rx) = mpsc::channel();
    thread::spawn(move || {
        token_tx.send(ThreadToken::current()).unwrap();
        for fiber in inbox {
            let outcome = format!("{:?}", fiber.run().map(|o| o.is_suspended()));
            outbox.send((fiber, outcome)).unwrap();
        }
    });
    (token_rx.recv().unwrap(), to_runner, from_runner)
}

#[test]
fn a_fiber_pinned_before_its_first_run_runs_only_on_that_thread() {
    with_watchdog(30, "pin_to", || {
        let (worker, to_worker, from_worker) = runner_thread();
        let fiber = Fiber::new(FiberAttr::new().name("sent")).unwrap();
        fiber
            .set_function(Priority::NORMAL, || {
                let first = thread_now();
                yield_value(1);
                assert_eq!(first, thread_now(), "a pinned fiber resumed on another thread");
                first
            })
            .unwrap();
        fiber.pin_to(worker).unwrap();
        assert!(!fiber.may_run_here(), "pinned to the worker, not to this thread");
        assert!(!fiber.is_pinned_here());

        // Here: refused before it starts, and left as it was.
        let err = fiber.run().unwrap_err();
        assert!(
            matches!(err, FiberError::WrongThread(id) if id == fiber.id()),
            "{err:?}"
        );
        assert!(err.to_string().contains("the one pin_to named"), "{err}");
        assert_eq!(fiber.state(), FiberState::Ready);
        assert_eq!(fiber.stats().runs, 0, "the refused run is not counted");

        // There: it starts, and stays pinned there.
        to_worker.send(fiber).unwrap();
        let (fiber, outcome) = from_worker.recv().unwrap();
        assert_eq!(outcome, "Ok(true)", "it yielded on the worker");
        assert!(matches!(fiber.run(), Err(FiberError::WrongThread(_))));
        // Pinning a started function to its own thread changes nothing;
        // to another thread, it is refused.
        fiber.pin_to(worker).unwrap();
        let err = fiber.pin_to(ThreadToken::current()).unwrap_err();
        assert!(
            matches!(err, FiberError::AlreadyStarted(id) if id == fiber.id()),
            "{err:?}"
        );
        assert!(err.to_string().contains("before the first run"), "{err}");
        to_worker.send(fiber).unwrap();
        let (fiber, outcome) = from_worker.recv().unwrap();
        assert_eq!(outcome, "Ok(false)", "it returned on the worker");
        assert_eq!(fiber.stats().migrations, 0);

        // Finished: its next function is not pinned to the worker.
        fiber.set_function(Priority::NORMAL, thread_now).unwrap();
        assert!(fiber.may_run_here());
        assert_eq!(fiber.run().unwrap().unwrap_returned(), thread_now());
    });
}

#[test]
fn pin_to_can_move_the_pin_before_the_first_run_and_set_function_clears_it() {
    let (worker, _to_worker, _from_worker) = runner_thread();
    let fiber = Fiber::new(FiberAttr::new()).unwrap();
    fiber.set_function(Priority::NORMAL, thread_now).unwrap();
    fiber.pin_to(worker).unwrap();
    fiber.pin_to(ThreadToken::current()).unwrap();
    assert!(fiber.may_run_here(), "the second pin_to moved the pin here");
    fiber.pin_to(worker).unwrap();
    fiber.set_function(Priority::NORMAL, thread_now).unwrap();
    assert!(fiber.may_run_here(), "set_function cleared the pin");
    assert_eq!(fiber.run().unwrap().unwrap_returned(), thread_now());
}

#[test]
fn pin_to_refuses_fibers_with_no_function_finished_or_migratable() {
    let here = ThreadToken::current();
    let fiber = Fiber::<ThreadId>::new(FiberAttr::new()).unwrap();
    assert!(matches!(fiber.pin_to(here), Err(FiberError::NoFunction(_))));
    fiber.set_function(Priority::NORMAL, thread_now).unwrap();
    assert_eq!(fiber.run().unwrap().unwrap_returned(), thread_now());
    assert!(matches!(fiber.pin_to(here), Err(FiberError::Finished(_))));
    // SAFETY: the function holds nothing across a suspension (it has none).
    unsafe { fiber.set_function_migratable(Priority::NORMAL, thread_now) }.unwrap();
    let err = fiber.pin_to(here).unwrap_err();
    assert!(
        matches!(err, FiberError::Migratable(id) if id == fiber.id()),
        "{err:?}"
    );
    assert!(err.to_string().contains("set_function_migratable"), "{err}");
    assert_eq!(
        fiber.state(),
        FiberState::Ready,
        "a refused pin_to leaves the fiber as it was"
    );
    assert_eq!(fiber.run().unwrap().unwrap_returned(), thread_now());
}
