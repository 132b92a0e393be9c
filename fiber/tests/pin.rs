//! `Fiber::pin_to` at the edges: nested runs, unstarted drops, sleeping
//! and stackless fibers, and races with runs on two threads.

mod common;

use common::{stackless_fiber, with_watchdog};

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;

use spindle_fiber::{
    current, current_id, sleep, yield_value, Fiber, FiberAttr, FiberError, FiberState, Priority, RunOutcome,
    ThreadToken, Waiter,
};

fn other_thread_token() -> ThreadToken {
    thread::spawn(ThreadToken::current).join().unwrap()
}

/// A fiber pinned (before its first run) to another thread, run by a
/// fiber nested inside another: refused, and the outer fiber is current
/// again afterwards.
#[test]
fn nested_run_of_a_fiber_pinned_elsewhere_is_refused_and_restores_current() {
    let elsewhere = other_thread_token();
    let inner = Fiber::<u32>::new(FiberAttr::new()).unwrap();
    inner.set_function(Priority::NORMAL, || 5).unwrap();
    inner.pin_to(elsewhere).unwrap();
    let outer = Fiber::<bool>::new(FiberAttr::new()).unwrap();
    let inner2 = inner.clone();
    outer
        .set_function(Priority::NORMAL, move || {
            let me = current_id();
            let refused = matches!(inner2.run(), Err(FiberError::WrongThread(_)));
            refused && current_id() == me
        })
        .unwrap();
    assert!(outer.run().unwrap().unwrap_returned());
    assert!(current().is_none());
    assert_eq!(inner.state(), FiberState::Ready);
    assert_eq!(inner.stats().runs, 0);
    // Pinned here instead: runs.
    inner.pin_to(ThreadToken::current()).unwrap();
    assert_eq!(inner.run().unwrap().unwrap_returned(), 5);
}

/// A fiber pinned to another thread and dropped unstarted here: its
/// closure is dropped (it is Send), nothing leaks.
#[test]
fn a_fiber_pinned_elsewhere_dropped_unstarted_drops_its_closure() {
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = Flag(dropped.clone());
    let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    fiber
        .set_function(Priority::NORMAL, move || {
            let _f = &flag;
        })
        .unwrap();
    fiber.pin_to(other_thread_token()).unwrap();
    drop(fiber);
    assert!(dropped.load(Ordering::SeqCst));
}

/// `pin_to` on a sleeping (hence started) fiber: pinned to its thread
/// already, so the same thread is a no-op and another is `AlreadyStarted`,
/// as for a started fiber that is `Ready`.
#[test]
fn pin_to_on_a_sleeping_fiber_answers_as_for_a_started_one() {
    static STASH: Mutex<Option<Waiter>> = Mutex::new(None);
    let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    fiber
        .set_function(Priority::NORMAL, || {
            *STASH.lock().unwrap() = Waiter::current();
            sleep();
        })
        .unwrap();
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
    let err = fiber.pin_to(other_thread_token()).unwrap_err();
    assert!(
        matches!(err, FiberError::AlreadyStarted(id) if id == fiber.id()),
        "{err:?}"
    );
    fiber.pin_to(ThreadToken::current()).unwrap();
    assert_eq!(fiber.state(), FiberState::Sleeping, "pin_to left it asleep");
    STASH.lock().unwrap().take().unwrap().wake();
    // Now Ready and started: the same answers.
    assert!(matches!(
        fiber.pin_to(other_thread_token()),
        Err(FiberError::AlreadyStarted(_))
    ));
    fiber.pin_to(ThreadToken::current()).unwrap();
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(())));
}

/// A fiber whose function was unwound on drop while a destructor kept a
/// waiter has no function and no stack: `pin_to` should say `NoStack`, as
/// `run` and `set_function` do, and leave it unpinned.
#[test]
fn pin_to_on_a_stackless_fiber_says_no_stack() {
    let fiber = stackless_fiber("stackless");
    let r = fiber.pin_to(other_thread_token());
    let (run, here) = (fiber.run(), fiber.may_run_here());
    assert!(matches!(run, Err(FiberError::NoStack(_))), "{run:?}");
    assert!(
        matches!(r, Err(FiberError::NoStack(_))),
        "pin_to on a stackless fiber gave {r:?} (may_run_here now {here})"
    );
    assert!(here, "a refused pin_to pinned nothing");
}

/// Races: one thread moves the pin of fresh fibers back and forth
/// between two runner threads while both try to run them. Whoever
/// starts a function must be the thread it was pinned to at that moment,
/// and every later resume must be on the same thread. After a start,
/// pin_to to the other thread must fail with AlreadyStarted.
#[test]
fn pin_to_races_with_runs_on_two_threads() {
    with_watchdog(60, "pin_to_races_with_runs_on_two_threads", pin_to_races);
}

fn pin_to_races() {
    const ROUNDS: usize = 1000;
    let (ta_tx, ta_rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let slot: Arc<Mutex<Option<Fiber<u64>>>> = Arc::new(Mutex::new(None));
    let violations = Arc::new(AtomicUsize::new(0));
    let started_on = Arc::new(AtomicU64::new(0));
    let mut runners = Vec::new();
    for _ in 0..2 {
        let (slot, stop, ta_tx) = (slot.clone(), stop.clone(), ta_tx.clone());
        runners.push(thread::spawn(move || {
            ta_tx.send(ThreadToken::current()).unwrap();
            let mut runs = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let f = slot.lock().unwrap().clone();
                if let Some(f) = f {
                    match f.run() {
                        Ok(RunOutcome::Yielded(_)) | Ok(RunOutcome::Returned(_)) => runs += 1,
                        Ok(RunOutcome::Panicked(p)) => panic!("{p}"),
                        _ => {}
                    }
                }
                std::hint::spin_loop();
            }
            runs
        }));
    }
    let tokens: Vec<ThreadToken> = ta_rx.iter().take(2).collect();
    for round in 0..ROUNDS {
        let f = Fiber::<u64>::new(FiberAttr::new()).unwrap();
        let (v, s) = (violations.clone(), started_on.clone());
        f.set_function(Priority::NORMAL, move || {
            let me = ThreadToken::current();
            s.fetch_add(1, Ordering::SeqCst);
            for i in 0..3 {
                yield_value(i);
                if ThreadToken::current() != me {
                    v.fetch_add(1, Ordering::SeqCst);
                }
            }
            7
        })
        .unwrap();
        f.pin_to(tokens[round % 2]).unwrap();
        *slot.lock().unwrap() = Some(f.clone());
        // Move the pin back and forth while the runners try.
        let mut last_ok = tokens[round % 2];
        let mut i = 0;
        loop {
            let t = tokens[(round + i) % 2];
            i += 1;
            match f.pin_to(t) {
                Ok(()) => last_ok = t,
                Err(FiberError::AlreadyStarted(_)) => {
                    assert_ne!(t, last_ok, "AlreadyStarted for the thread it was pinned to");
                }
                Err(FiberError::Running(_)) => {}
                Err(FiberError::Finished(_)) => break,
                Err(e) => panic!("{e:?}"),
            }
            std::hint::spin_loop();
        }
        *slot.lock().unwrap() = None;
        assert_eq!(f.stats().migrations, 0);
        assert_eq!(f.stats().runs, 4);
    }
    stop.store(true, Ordering::Relaxed);
    let runs: Vec<u64> = runners.into_iter().map(|r| r.join().unwrap()).collect();
    assert_eq!(
        runs.iter().sum::<u64>(),
        4 * ROUNDS as u64,
        "every run of every fiber counted: {runs:?}"
    );
    assert_eq!(violations.load(Ordering::SeqCst), 0);
}
