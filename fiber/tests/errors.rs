//! Errors: every refusal is an enum variant whose message says what
//! happened and what to do; stack sizes that cannot be mapped are refused.

mod common;

use common::{child_passed, describe, is_child, run_child, with_watchdog};
use std::error::Error;
use std::sync::mpsc;

use spindle_fiber::{
    Fiber, FiberAttr, FiberError, FiberState, Priority, RunOutcome, StackError, StackPool, MAX_STACK_SIZE,
};

#[test]
fn a_zero_stack_size_is_too_small() {
    let err = Fiber::<()>::new(FiberAttr::new().stack_size(0)).unwrap_err();
    let minimum = match &err {
        FiberError::Stack(StackError::TooSmall {
            requested: 0,
            minimum,
        }) => *minimum,
        other => panic!("expected Stack(TooSmall), got {other:?}"),
    };
    assert!(minimum > 0);
    let msg = err.to_string();
    assert!(msg.contains("0 bytes is too small"), "{msg}");
    assert!(
        msg.contains(&format!("at least {minimum} bytes")),
        "message says what to do: {msg}"
    );
    // Transparent: the message is the stack error's, and no source repeats
    // it for error reporters that walk the chain.
    assert_eq!(
        msg,
        StackError::TooSmall {
            requested: 0,
            minimum
        }
        .to_string()
    );
    assert!(err.source().is_none());
    // Errors are plain values: copied, compared, no allocation to drop
    // (so dropping a `run` result is free unless it holds a panic).
    let copy = err;
    assert_eq!(copy, err);
    assert!(!std::mem::needs_drop::<FiberError>());
    assert!(!std::mem::needs_drop::<StackError>());

    // Just below the minimum is refused too; the minimum itself is accepted.
    let below = Fiber::<()>::new(FiberAttr::new().stack_size(minimum - 1)).unwrap_err();
    assert!(
        matches!(below, FiberError::Stack(StackError::TooSmall { .. })),
        "{below:?}"
    );
    let at = Fiber::<()>::new(FiberAttr::new().stack_size(minimum)).unwrap();
    assert!(at.stack_size() >= minimum);
    // A panic needs more than the minimum: the message says so.
    assert!(msg.contains("a fiber that may panic needs about 8 KiB"), "{msg}");
}

const MIN_STACK_CHILD: &str = "a_fiber_on_the_minimum_stack_runs_yields_and_returns";

/// In a child process: an overflow would abort it (a sanitizer's larger
/// frames can make one), not the whole test binary.
#[test]
fn a_fiber_on_the_minimum_stack_runs_yields_and_returns() {
    if is_child(MIN_STACK_CHILD) {
        let fiber = Fiber::new(FiberAttr::new().stack_size(spindle_fiber::MIN_STACK_SIZE)).unwrap();
        fiber
            .set_function(Priority::NORMAL, || {
                spindle_fiber::yield_value(3);
                4
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(3)));
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(4)));
        return;
    }
    let out = run_child(MIN_STACK_CHILD, 60);
    assert!(child_passed(&out), "{}", describe(&out));
}

#[test]
fn a_stack_size_beyond_the_maximum_is_too_large() {
    for requested in [MAX_STACK_SIZE + 1, usize::MAX / 2, usize::MAX] {
        let err = Fiber::<()>::new(FiberAttr::new().stack_size(requested)).unwrap_err();
        match &err {
            FiberError::Stack(StackError::TooLarge {
                requested: r,
                maximum,
            }) => {
                assert_eq!(*r, requested);
                assert_eq!(*maximum, MAX_STACK_SIZE);
            }
            other => panic!("expected Stack(TooLarge) for {requested}, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&format!("{requested} bytes is too large")), "{msg}");
        assert!(msg.contains(&format!("at most {MAX_STACK_SIZE} bytes")), "{msg}");
        assert!(msg.contains("check the unit"), "message says what to do: {msg}");
    }
}

#[test]
fn the_stack_pool_refuses_the_same_sizes() {
    let pool = StackPool::new(2);
    assert!(matches!(pool.take(0), Err(StackError::TooSmall { .. })));
    assert!(matches!(
        pool.take(MAX_STACK_SIZE + 1),
        Err(StackError::TooLarge { .. })
    ));
    assert_eq!(pool.cached(), 0);
}

#[test]
fn errors_are_std_errors_that_cross_threads() {
    fn make() -> Result<Fiber<()>, Box<dyn Error + Send + Sync + 'static>> {
        Ok(Fiber::new(FiberAttr::new().stack_size(0))?)
    }
    let err = make().unwrap_err();
    assert!(err.to_string().contains("too small"), "{err}");
    let fiber_err = err.downcast::<FiberError>().expect("a FiberError inside the box");
    assert!(matches!(*fiber_err, FiberError::Stack(_)));
}

#[test]
fn running_a_fiber_that_runs_on_another_thread_is_refused() {
    with_watchdog(30, "run_while_running_elsewhere", || {
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let fiber = Fiber::new(FiberAttr::new().name("busy")).unwrap();
        fiber
            .set_function(Priority::NORMAL, move || {
                started_tx.send(()).unwrap();
                // Block the runner's thread inside the fiber.
                release_rx.recv().unwrap();
                "released"
            })
            .unwrap();
        let runner = {
            let fiber = fiber.clone();
            std::thread::spawn(move || fiber.run().unwrap().unwrap_returned())
        };
        started_rx.recv().unwrap();
        assert_eq!(fiber.state(), FiberState::Running);
        let err = fiber.run().unwrap_err();
        assert!(
            matches!(err, FiberError::Running(id) if id == fiber.id()),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("already running"), "{msg}");
        assert!(msg.contains("wait until it has suspended"), "{msg}");
        assert!(matches!(
            fiber.set_function(Priority::NORMAL, || "replaced"),
            Err(FiberError::Running(_))
        ));
        release_tx.send(()).unwrap();
        assert_eq!(runner.join().unwrap(), "released");
        assert_eq!(fiber.state(), FiberState::Finished);
    });
}

#[test]
fn a_queued_fiber_refuses_run_and_set_function_until_dequeued() {
    with_watchdog(30, "queued_errors", || {
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        // Only a runnable fiber can be queued.
        assert!(matches!(fiber.mark_queued(None), Err(FiberError::NoFunction(_))));
        fiber.set_function(Priority::NORMAL, || 1).unwrap();
        fiber.mark_queued(None).unwrap();
        assert_eq!(fiber.state(), FiberState::Queued);
        let err = fiber.run().unwrap_err();
        assert!(
            matches!(err, FiberError::Queued(id) if id == fiber.id()),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("is in a run queue"), "{msg}");
        assert!(
            msg.contains("pop it from the queue"),
            "message says what to do: {msg}"
        );
        assert!(matches!(
            fiber.set_function(Priority::NORMAL, || 2),
            Err(FiberError::Queued(_))
        ));
        fiber.mark_dequeued().unwrap();
        assert_eq!(fiber.state(), FiberState::Ready);
        assert!(
            matches!(fiber.mark_dequeued(), Err(FiberError::NotQueued(_))),
            "not queued twice"
        );
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(1)));
        assert!(matches!(fiber.mark_queued(None), Err(FiberError::Finished(_))));
        assert!(
            matches!(fiber.mark_dequeued(), Err(FiberError::NotQueued(_))),
            "a finished fiber is not queued either"
        );
    });
}

/// `mark_queued_mut` and `mark_dequeued_mut` (plain stores when the handle
/// is the fiber's only one) give the same answers as `mark_queued` and
/// `mark_dequeued` in every state, whether the handle is the only one or
/// shared (then they are those calls), and with a `Waiter` alive (a
/// counted reference: not unique either).
#[test]
fn the_exclusive_handle_transitions_answer_as_the_shared_ones() {
    with_watchdog(30, "mark_mut", || {
        for shared in [false, true] {
            let mut fiber = Fiber::new(FiberAttr::new()).unwrap();
            let other = shared.then(|| fiber.clone());
            assert!(matches!(
                fiber.mark_queued_mut(None),
                Err(FiberError::NoFunction(_))
            ));
            assert!(matches!(fiber.mark_dequeued_mut(), Err(FiberError::NotQueued(_))));
            fiber.set_function(Priority::NORMAL, || 1).unwrap();
            assert!(matches!(fiber.mark_dequeued_mut(), Err(FiberError::NotQueued(_))));
            assert!(fiber.mark_queued_mut(None).unwrap().is_none());
            assert_eq!(fiber.state(), FiberState::Queued);
            assert!(matches!(fiber.mark_queued_mut(None), Err(FiberError::Queued(_))));
            assert!(matches!(fiber.run(), Err(FiberError::Queued(_))));
            fiber.mark_dequeued_mut().unwrap();
            assert_eq!(fiber.state(), FiberState::Ready);
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(1)));
            assert!(matches!(
                fiber.mark_queued_mut(None),
                Err(FiberError::Finished(_))
            ));
            assert!(matches!(fiber.mark_dequeued_mut(), Err(FiberError::NotQueued(_))));
            drop(other);
        }

        // Asleep, its waiter held elsewhere: refused, and the waiter's wake
        // still makes it `Ready` (the state was not touched).
        let (waiter_tx, waiter_rx) = mpsc::channel();
        let mut fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, move || {
                waiter_tx.send(spindle_fiber::Waiter::current().unwrap()).unwrap();
                spindle_fiber::sleep();
                2
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        let waiter = waiter_rx.recv().unwrap();
        assert!(matches!(
            fiber.mark_queued_mut(None),
            Err(FiberError::Sleeping(_))
        ));
        assert!(matches!(fiber.mark_dequeued_mut(), Err(FiberError::Sleeping(_))));
        waiter.wake();
        assert_eq!(fiber.state(), FiberState::Ready);
        fiber.mark_queued_mut(None).unwrap();
        fiber.mark_dequeued_mut().unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(2)));
    });
}

#[test]
fn every_message_names_the_fiber_and_says_what_to_do() {
    let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    let id = fiber.id();
    let cases = [
        (FiberError::NoFunction(id), "set_function"),
        (FiberError::Finished(id), "set_function"),
        (FiberError::Busy(id), "let it run to completion"),
        (FiberError::Running(id), "wait until it has suspended"),
        (FiberError::Queued(id), "pop it from the queue"),
        (FiberError::Sleeping(id), "leave it until a wake"),
        (FiberError::WrongThread(id), "set_function_migratable"),
        (
            FiberError::WrongThread(id),
            "pin_to this thread before its first run",
        ),
        (
            FiberError::AlreadyStarted(id),
            "call pin_to after set_function and before the first run",
        ),
        (
            FiberError::Migratable(id),
            "pin_to is for functions set with set_function",
        ),
        (FiberError::NotQueued(id), "only a scheduler that queued it"),
        (FiberError::NoStack(id), "create a new fiber"),
    ];
    for (err, advice) in cases {
        let msg = err.to_string();
        assert!(msg.starts_with(&format!("fiber {id} ")), "{msg}");
        assert!(msg.contains(advice), "{err:?}: {msg:?} lacks {advice:?}");
        assert!(err.source().is_none());
    }
}

const ENOMEM_CHILD: &str = "out_of_memory_names_the_map_count_limit";

#[test]
fn out_of_memory_names_the_map_count_limit() {
    if is_child(ENOMEM_CHILD) {
        // Cap this (child) process's address space just above what it uses,
        // so a large stack cannot be mapped.
        spindle_test_support::cap_address_space(256 << 20);
        let err = Fiber::<()>::new(FiberAttr::new().stack_size(512 << 20)).unwrap_err();
        let bytes = match &err {
            FiberError::Stack(StackError::OutOfMemory { bytes, .. }) => *bytes,
            other => panic!("expected Stack(OutOfMemory), got {other:?}"),
        };
        assert!(bytes > 512 << 20, "the guard page is included: {bytes}");
        let msg = err.to_string();
        for needle in [
            "out of memory (ENOMEM)",
            "limited to",
            "RLIMIT_AS",
            "vm.max_map_count",
            "sysctl",
            "smaller stacks",
        ] {
            assert!(msg.contains(needle), "{needle:?} missing from {msg:?}");
        }
        // A pool's idle stacks are unmapped to make room: one idle 160 MiB
        // stack and a new 160 MiB one do not both fit under the cap.
        let pool = spindle_fiber::StackPool::new(8);
        pool.give(pool.take(160 << 20).expect("one 160 MiB stack fits"));
        assert_eq!(pool.cached(), 1);
        let other = pool
            .take((160 << 20) + 4096)
            .expect("the idle stack is unmapped to make room");
        assert_eq!(pool.cached(), 0, "the idle stack was released");
        drop(other);
        println!("child checked: {msg}");
        return;
    }
    let out = run_child(ENOMEM_CHILD, 60);
    assert!(out.status.success(), "child failed:\n{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("child checked:"),
        "the child did not reach its checks:\n{}",
        describe(&out)
    );
}
