//! Cancellation: a cancelled fiber unwinds at its next suspension point with
//! its destructors run, and its join returns `JoinError::Cancelled`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{wait_for, watchdog, Flag};
use spindle_executor::{sleep, yield_now, Executor, JoinError, JoinHandle, SpawnOptions};
use spindle_sync::{Channel, Interrupted, Msg, Semaphore};

#[test]
fn cancel_a_fiber_looping_in_yield_now() {
    watchdog("cancel_a_fiber_looping_in_yield_now", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let dropped = Flag::new();
        let looping = Flag::new();
        let rounds = Arc::new(AtomicU64::new(0));
        let h = {
            let (guard, looping, rounds) = (dropped.on_drop(), looping.clone(), Arc::clone(&rounds));
            exec.spawn_with(SpawnOptions::new().name("looper"), move || {
                let _local = guard;
                looping.set();
                loop {
                    rounds.fetch_add(1, Ordering::Relaxed);
                    yield_now();
                }
            })
        };
        // A few rounds: the fiber is in its loop, between yields, when the
        // cancel comes.
        wait_for(&stage, "the fiber to loop through a few yields", || {
            looping.is_set() && rounds.load(Ordering::Relaxed) >= 3
        });
        assert!(!dropped.is_set(), "the local lives while the fiber loops");

        stage.set("cancelling and joining");
        h.cancel();
        let err = h.join().expect_err("a cancelled fiber has no value");
        assert!(err.is_cancelled(), "expected Cancelled, got {err}");
        match &err {
            JoinError::Cancelled { fiber, name } => {
                assert!(fiber.is_some(), "it had started");
                assert_eq!(name.as_deref(), Some("looper"));
            }
            other => panic!("expected Cancelled, got {other}"),
        }
        assert!(err.to_string().contains("looper"), "{err}");
        assert!(dropped.is_set(), "the fiber's local was dropped by the unwind");
        assert!(exec.stats().cancelled >= 1, "{:?}", exec.stats());
    });
}

#[test]
fn cancel_a_fiber_asleep_in_a_long_sleep() {
    watchdog("cancel_a_fiber_asleep_in_a_long_sleep", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let dropped = Flag::new();
        let sleeping = Flag::new();
        let h = {
            let (guard, sleeping) = (dropped.on_drop(), sleeping.clone());
            exec.spawn(move || {
                let _local = guard;
                sleeping.set();
                sleep(Duration::from_secs(60));
                "overslept"
            })
        };
        wait_for(&stage, "the fiber to go to sleep", || sleeping.is_set());

        // The sleep outlasts the watchdog: a join that returns at all was
        // woken by the cancel.
        stage.set("cancelling a 60 s sleep");
        h.cancel();
        let err = h.join().expect_err("a cancelled fiber has no value");
        assert!(err.is_cancelled(), "expected Cancelled, got {err}");
        assert!(dropped.is_set(), "the fiber's local was dropped by the unwind");
    });
}

#[test]
fn cancel_before_start_drops_the_closure_without_running_it() {
    watchdog("cancel_before_start_drops_the_closure_without_running_it", 30, |stage| {
        // One worker and no scaling: a hog holds it, so the victim stays
        // queued until it is cancelled.
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let release_hog = Flag::new();
        let hogging = Flag::new();
        let hog = {
            let (release_hog, hogging) = (release_hog.clone(), hogging.clone());
            exec.spawn(move || {
                hogging.set();
                while !release_hog.is_set() {
                    std::hint::spin_loop();
                }
            })
        };
        wait_for(&stage, "the hog to hold the only worker", || hogging.is_set());

        stage.set("spawning and cancelling a queued fiber");
        let ran = Flag::new();
        let captured_dropped = Flag::new();
        let victim = {
            let (ran, guard) = (ran.clone(), captured_dropped.on_drop());
            exec.spawn_with(SpawnOptions::new().name("victim"), move || {
                let _guard = guard;
                ran.set();
            })
        };
        victim.cancel();
        assert!(!victim.is_finished());
        release_hog.set();
        hog.join().unwrap();

        stage.set("joining the cancelled fiber");
        let err = victim.join().expect_err("a cancelled fiber has no value");
        match &err {
            JoinError::Cancelled { fiber, name } => {
                assert!(fiber.is_none(), "it never started: {err}");
                assert_eq!(name.as_deref(), Some("victim"));
            }
            other => panic!("expected Cancelled, got {other}"),
        }
        assert!(!ran.is_set(), "the closure never ran");
        assert!(captured_dropped.is_set(), "the closure's captured values were dropped");
    });
}

#[test]
fn cancel_a_fiber_asleep_on_a_semaphore_unwinds_it_when_woken() {
    watchdog("cancel_a_fiber_asleep_on_a_semaphore_unwinds_it_when_woken", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let sem = Arc::new(Semaphore::new(0));
        let dropped = Flag::new();
        let h = {
            let (sem, guard) = (Arc::clone(&sem), dropped.on_drop());
            exec.spawn(move || {
                let _local = guard;
                sem.acquire();
                // The next suspension point sees the cancellation (if the
                // wake itself did not unwind the fiber already).
                yield_now();
                "not cancelled"
            })
        };
        wait_for(&stage, "the fiber to wait on the semaphore", || sem.waiters() == 1);
        let handoffs = exec.stats().inbox_handoffs;
        h.cancel();
        // The cancel wakes the fiber to check its interrupt mark; a plain
        // wait takes no mark and goes back to sleep, still waiting.
        wait_for(&stage, "the cancel's wake to reach the fiber", || exec.stats().inbox_handoffs > handoffs);
        wait_for(&stage, "the fiber to wait on the semaphore again", || sem.waiters() == 1);
        assert!(!h.is_finished(), "the plain wait went back to sleep");
        assert!(!dropped.is_set());
        stage.set("releasing the semaphore");
        sem.release(1);
        let err = h.join().expect_err("cancelled");
        assert!(err.is_cancelled(), "{err}");
        assert!(dropped.is_set(), "the fiber's local was dropped by the unwind");
    });
}

/// Gives a semaphore token back when dropped (a lock guard, say).
struct Token<'a>(&'a Semaphore);

impl Drop for Token<'_> {
    fn drop(&mut self) {
        self.0.release(1);
    }
}

#[test]
fn cancelled_semaphore_waiter_does_not_lose_the_token() {
    watchdog("cancelled_semaphore_waiter_does_not_lose_the_token", 30, |stage| {
        // The semaphore is used as a lock: whoever acquires holds a guard
        // that releases on drop. Cancelling a waiter must not make the token
        // vanish: either the waiter never got it, or it got it and its guard
        // gave it back when it unwound.
        let exec = Executor::builder().workers(2).build();
        let sem = Arc::new(Semaphore::new(0));
        let h = {
            let sem = Arc::clone(&sem);
            exec.spawn(move || {
                sem.acquire();
                let _token = Token(&sem);
                yield_now();
            })
        };
        wait_for(&stage, "the fiber to wait on the semaphore", || sem.waiters() == 1);
        h.cancel();
        stage.set("handing the waiter the token");
        sem.release(1);
        let err = h.join().expect_err("cancelled");
        assert!(err.is_cancelled(), "{err}");
        assert_eq!(
            sem.available(),
            1,
            "the token handed to the cancelled waiter was lost (it unwound inside acquire)"
        );
    });
}

#[test]
fn cancelled_channel_receiver_does_not_lose_the_message() {
    watchdog("cancelled_channel_receiver_does_not_lose_the_message", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let chan = Arc::new(Channel::<u64>::new());
        let received = Arc::new(std::sync::Mutex::new(Vec::new()));
        let h = {
            let (chan, received) = (Arc::clone(&chan), Arc::clone(&received));
            exec.spawn(move || {
                let v = chan.pop().unwrap().into_inner();
                received.lock().unwrap().push(v);
                yield_now();
            })
        };
        wait_for(&stage, "the receiver to wait", || chan.receivers() == 1);
        h.cancel();
        stage.set("pushing one message to the cancelled receiver");
        chan.push(Msg::new(77)).unwrap();
        let err = h.join().expect_err("cancelled");
        assert!(err.is_cancelled(), "{err}");
        let delivered = received.lock().unwrap().contains(&77);
        let still_queued = chan.try_pop().map(Msg::into_inner) == Some(77);
        assert!(
            delivered || still_queued,
            "the message handed to the cancelled receiver vanished (it unwound inside pop)"
        );
    });
}

#[test]
fn cancel_after_completion_keeps_the_value() {
    watchdog("cancel_after_completion_keeps_the_value", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let h = exec.spawn(|| 99);
        wait_for(&stage, "the fiber to finish", || h.is_finished());
        h.cancel();
        h.wake();
        assert_eq!(h.join().unwrap(), 99);
    });
}

#[test]
fn cancel_many_yielding_fibers_at_once() {
    watchdog("cancel_many_yielding_fibers_at_once", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let flags: Vec<Flag> = (0..200).map(|_| Flag::new()).collect();
        let started = Arc::new(AtomicU64::new(0));
        let handles: Vec<_> = flags
            .iter()
            .map(|f| {
                let (guard, started) = (f.on_drop(), Arc::clone(&started));
                exec.spawn(move || {
                    let _g = guard;
                    started.fetch_add(1, Ordering::SeqCst);
                    loop {
                        yield_now();
                    }
                })
            })
            .collect();
        wait_for(&stage, "all fibers to loop", || started.load(Ordering::SeqCst) == 200);
        stage.set("cancelling all");
        for h in &handles {
            h.cancel();
        }
        for h in handles {
            assert!(h.join().expect_err("cancelled").is_cancelled());
        }
        assert!(flags.iter().all(Flag::is_set), "every fiber's local was dropped");
    });
}

/// A destructor that reaches a cancellation point (a yield, a sleep, a
/// join) while the cancel's own unwind runs it: the point does not unwind
/// a second time (which aborted the process: "panic in a destructor during
/// cleanup"), the destructor finishes, and the join reports the cancel.
/// The same at shutdown. In a child process, since the failure is an abort.
#[test]
fn a_destructor_that_yields_sleeps_or_joins_during_the_cancel_unwind() {
    const CHILD: &str = "SPINDLE_TEST_CANCEL_POINT_IN_DESTRUCTOR";
    let name = "a_destructor_that_yields_sleeps_or_joins_during_the_cancel_unwind";
    if std::env::var(CHILD).is_ok() {
        /// Reaches a cancellation point in its drop, then counts the drop.
        struct Guard(u8, Arc<AtomicU64>);
        impl Drop for Guard {
            fn drop(&mut self) {
                match self.0 {
                    0 => yield_now(),
                    1 => sleep(Duration::from_millis(1)),
                    _ => assert_eq!(spindle_executor::spawn(|| 7).join().unwrap(), 7),
                }
                self.1.fetch_add(1, Ordering::SeqCst);
            }
        }
        let exec = Executor::builder().workers(2).build();
        let drops = Arc::new(AtomicU64::new(0));
        for kind in 0..3u8 {
            let (d, started) = (drops.clone(), Arc::new(Semaphore::new(0)));
            let s = started.clone();
            let h = exec.spawn(move || {
                let _g = Guard(kind, d);
                s.release(1);
                loop {
                    sleep(Duration::from_millis(5));
                }
            });
            started.acquire();
            h.cancel();
            assert!(h.join().expect_err("cancelled").is_cancelled(), "kind {kind}");
        }
        assert_eq!(drops.load(Ordering::SeqCst), 3, "every destructor finished");
        {
            // One worker: a fiber that panics, and whose destructor cancels
            // and joins a fiber that only ever yields. The panic's unwind is
            // suspended in that join (the worker's thread counts as
            // panicking meanwhile), and the yielding fiber must still be
            // cancelled at its yields: the thread's panic count is not its.
            struct CancelAndJoin(Option<spindle_executor::JoinHandle<()>>, Arc<AtomicU64>);
            impl Drop for CancelAndJoin {
                fn drop(&mut self) {
                    let child = self.0.take().unwrap();
                    child.cancel();
                    assert!(child.join().expect_err("cancelled").is_cancelled());
                    self.1.fetch_add(1, Ordering::SeqCst);
                }
            }
            let one = Executor::builder().workers(1).build();
            let d = drops.clone();
            let h = one.spawn(move || {
                let child = spindle_executor::spawn(|| loop {
                    yield_now();
                });
                // Started, so the cancel reaches it at its yields (an
                // unstarted job is just dropped).
                while child.fiber_id().is_none() {
                    yield_now();
                }
                let _guard = CancelAndJoin(Some(child), d);
                panic!("the parent panics with a guard that cancels its child");
            });
            assert!(matches!(h.join(), Err(JoinError::Panicked { .. })));
            assert_eq!(drops.load(Ordering::SeqCst), 4, "the guard's join returned");

            // A cancelled fiber that panics on its own before reaching a
            // cancellation point: its destructor's yields (before and after
            // the suspension) find it unwinding already.
            let (d, go) = (drops.clone(), Arc::new(std::sync::atomic::AtomicBool::new(false)));
            let g = go.clone();
            let h = one.spawn(move || {
                let _guard = Guard(0, d);
                while !g.load(Ordering::SeqCst) {
                    std::hint::spin_loop();
                }
                panic!("a panic of its own, after the cancel");
            });
            while h.fiber_id().is_none() {
                std::thread::yield_now(); // started: a cancel then waits for a cancellation point
            }
            h.cancel();
            go.store(true, Ordering::SeqCst);
            assert!(matches!(h.join(), Err(JoinError::Panicked { .. })));
            assert_eq!(drops.load(Ordering::SeqCst), 5, "the destructor finished");
        }
        // And at shutdown: a fiber whose destructor yields, left running.
        let started = Arc::new(Semaphore::new(0));
        let (d, s) = (drops.clone(), started.clone());
        let h = exec.spawn(move || {
            let _g = Guard(0, d);
            s.release(1);
            loop {
                sleep(Duration::from_millis(5));
            }
        });
        started.acquire();
        drop(exec);
        assert!(h.join().expect_err("shut down").is_cancelled());
        assert_eq!(drops.load(Ordering::SeqCst), 6, "the destructor finished at shutdown");
        // And a fiber asleep in a join at shutdown, whose destructor
        // yields: the final drain completes the task it joins (asleep in a
        // plain wait nobody ends), which wakes it, and then drops it, so its
        // stack is unwound by the fiber's drop, with no runner. The yield
        // there yields the thread (it suspended, and the process aborted),
        // and `interrupt_after` runs its closure (it panicked). A joiner
        // that reached its join only after the shutdown began is cancelled
        // there instead (the case above): rounds until the drop path was
        // taken (the destructor sees `may_sleep()` false there).
        struct YieldsUnwoundByDrop(Arc<AtomicU64>, Arc<std::sync::atomic::AtomicBool>);
        impl Drop for YieldsUnwoundByDrop {
            fn drop(&mut self) {
                if !spindle_fiber::may_sleep() {
                    self.1.store(true, Ordering::SeqCst);
                }
                yield_now();
                spindle_executor::yield_if_needed();
                // Runs its closure (it panicked: "outside an executor
                // fiber", an abort here). Where this fiber is dropped it has
                // no runner left, and its interruptible waits do not block
                // (they blocked the thread, and shutdown with it, for good);
                // where it is cancelled, they end at the deadline or by the
                // shutdown's interrupt.
                let empty = Semaphore::new(0);
                let waits = spindle_executor::interrupt_after(Duration::from_millis(1), || {
                    [empty.acquire_interruptible(), empty.acquire_interruptible()]
                });
                assert_eq!(waits, [Err(Interrupted), Err(Interrupted)]);
                let one = Semaphore::new(1);
                assert_eq!(one.acquire_interruptible(), Ok(()), "a token that is there is taken");
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let by_drop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut rounds = 0;
        while !by_drop.load(Ordering::SeqCst) && rounds < 200 {
            rounds += 1;
            let one = Executor::builder().workers(1).max_workers(1).build();
            let (never, asleep) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
            let (n, a) = (never.clone(), asleep.clone());
            let t = one.spawn(move || {
                a.release(1);
                n.acquire();
            });
            let (d, b, a) = (drops.clone(), by_drop.clone(), asleep.clone());
            let j = one.spawn(move || {
                let _g = YieldsUnwoundByDrop(d, b);
                a.release(1);
                let _ = t.join();
            });
            asleep.acquire();
            asleep.acquire();
            drop(one);
            assert!(j.join().expect_err("shut down").is_cancelled());
            assert_eq!(drops.load(Ordering::SeqCst), 6 + rounds, "the joiner's destructor finished");
            drop(never);
        }
        assert!(by_drop.load(Ordering::SeqCst), "no round reached the drain's drop of the joiner");
        println!("child passed");
        return;
    }
    let out = common::run_in_a_child(name, CHILD);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("child passed"),
        "a cancellation point reached during the cancel's unwind must not abort:\n{}",
        common::describe(&out)
    );
}

/// A cancel reaches a fiber in an interruptible wait on a `spindle-sync`
/// primitive: the wait returns `Interrupted`, the fiber unwinds at its next
/// cancellation point, and the join reports the cancel. That holds for a
/// fiber asleep in the wait when the cancel comes and for one that reaches
/// the wait only after it (still running then); the token released later
/// is left in the semaphore.
#[test]
fn cancel_interrupts_an_interruptible_wait() {
    use spindle_sync::Interrupted;
    watchdog("cancel_interrupts_an_interruptible_wait", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        for asleep_first in [true, false] {
            let sem = Arc::new(Semaphore::new(0));
            let (dropped, started, go) = (Flag::new(), Flag::new(), Flag::new());
            let saw = Arc::new(AtomicU64::new(0));
            let h = {
                let (guard, started, go) = (dropped.on_drop(), started.clone(), go.clone());
                let (sem, saw) = (Arc::clone(&sem), Arc::clone(&saw));
                exec.spawn(move || {
                    let _local = guard;
                    started.set();
                    // Without a suspension point: still running at the cancel.
                    while !go.is_set() {
                        std::hint::spin_loop();
                    }
                    if sem.acquire_interruptible() == Err(Interrupted) {
                        saw.store(1, Ordering::SeqCst);
                    }
                    yield_now(); // a cancellation point
                    unreachable!("a cancelled fiber unwinds at yield_now");
                })
            };
            wait_for(&stage, "the fiber to start", || started.is_set());
            if asleep_first {
                go.set();
                wait_for(&stage, "the fiber to wait on the semaphore", || sem.waiters() == 1);
            }
            stage.set(format!("cancelling (asleep first: {asleep_first})"));
            h.cancel();
            go.set();
            match h.join() {
                Err(JoinError::Cancelled { .. }) => {}
                other => panic!("expected a cancel, got {:?}", other.err()),
            }
            assert_eq!(saw.load(Ordering::SeqCst), 1, "the wait returned Interrupted");
            assert!(dropped.is_set(), "the fiber's locals were dropped");
            sem.release(1);
            assert_eq!((sem.available(), sem.waiters()), (1, 0), "nothing waits for the token");
        }
    });
}

/// A cancelled fiber asleep in a plain wait (`acquire`, `pop`, `join`)
/// sleeps: it is woken at most once for the cancel (the wait sleeps
/// again), not over and over by its worker, and dropping the executor
/// then does not wait for it. (The worker used to re-interrupt it after
/// every sleep: a busy loop, and a drop that never returned.)
#[test]
fn a_cancelled_fiber_in_a_plain_wait_stays_asleep() {
    watchdog("a_cancelled_fiber_in_a_plain_wait_stays_asleep", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let sem = Arc::new(Semaphore::new(0));
        let chan = Arc::new(Channel::<u32>::new());
        let in_acquire = {
            let sem = Arc::clone(&sem);
            exec.spawn(move || sem.acquire())
        };
        let in_pop = {
            let chan = Arc::clone(&chan);
            exec.spawn(move || chan.pop().unwrap().into_inner())
        };
        wait_for(&stage, "both fibers to wait", || sem.waiters() == 1 && chan.receivers() == 1);
        in_acquire.cancel();
        in_pop.cancel();
        let handoffs = exec.stats().inbox_handoffs;
        // Not synchronisation: a window in which a busy loop of wakes
        // would make millions of handoffs.
        let window = std::time::Instant::now();
        while window.elapsed() < Duration::from_millis(100) {
            std::thread::yield_now();
        }
        let woken = exec.stats().inbox_handoffs - handoffs;
        assert!(woken <= 4, "the cancelled fibers were woken {woken} times while they waited");
        assert_eq!((sem.waiters(), chan.receivers()), (1, 1), "both still wait");
        stage.set("the acquire gets its token, then unwinds at its next cancellation point");
        sem.release(1);
        assert!(matches!(in_acquire.join(), Ok(())), "no cancellation point after the acquire");
        stage.set("dropping the executor with the fiber in the plain pop");
        drop(exec);
        assert!(in_pop.join().is_err_and(|e| e.is_cancelled()));
    });
}

/// A `Waiter` kept from an earlier task interrupts nothing in a later
/// task that runs on the same (reused) fiber.
#[test]
fn a_waiter_kept_from_an_earlier_task_does_not_interrupt_the_next() {
    use spindle_sync::Interrupted;
    watchdog("a_waiter_kept_from_an_earlier_task_does_not_interrupt_the_next", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let first = exec.spawn(|| spindle_fiber::Waiter::current().expect("in a fiber"));
        wait_for(&stage, "the first task to finish", || first.is_finished());
        let first_fiber = first.fiber_id();
        let kept = first.join().unwrap();
        let sem = Arc::new(Semaphore::new(0));
        let second = {
            let sem = Arc::clone(&sem);
            // The wait's outcome, and whether an interrupt mark is left: a
            // stray interrupt fails the test whether it ends the wait or
            // only marks the fiber after the token was handed over.
            exec.spawn(move || (sem.acquire_interruptible(), spindle_fiber::take_interrupt()))
        };
        wait_for(&stage, "the second task to wait", || sem.waiters() == 1);
        assert_eq!(second.fiber_id(), first_fiber, "the fiber was reused");
        kept.interrupt();
        sem.release(1);
        assert_eq!(
            second.join().unwrap(),
            (Ok::<(), Interrupted>(()), false),
            "the kept waiter neither interrupted the wait nor marked the fiber"
        );
    });
}

/// A join is a cancellation point, also one that fails at once because the
/// fiber joins its own handle: a cancelled fiber unwinds there rather than
/// get `JoinedItself` and go on. (From a review of the self-join check,
/// which first returned before the cancellation point.)
#[test]
fn a_cancelled_fiber_joining_its_own_handle_unwinds() {
    watchdog("a_cancelled_fiber_joining_its_own_handle_unwinds", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let (handle_tx, handle_rx) = std::sync::mpsc::channel::<JoinHandle<()>>();
        let (report_tx, report_rx) = std::sync::mpsc::channel::<&'static str>();
        let (go, started) = (Flag::new(), Flag::new());
        let handle = {
            let (go, started) = (go.clone(), started.clone());
            exec.spawn(move || {
                started.set();
                // No cancellation point until `go`.
                while !go.is_set() {
                    std::hint::spin_loop();
                }
                let me = handle_rx.recv().unwrap();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.join()));
                report_tx.send(if r.is_err() { "unwound" } else { "returned" }).unwrap();
                if let Err(unwind) = r {
                    std::panic::resume_unwind(unwind);
                }
            })
        };
        stage.set("waiting for the fiber to start");
        while !started.is_set() {
            std::hint::spin_loop();
        }
        handle.cancel();
        handle_tx.send(handle).unwrap();
        go.set();
        stage.set("waiting for the fiber's join of itself");
        assert_eq!(report_rx.recv().unwrap(), "unwound", "a join is a cancellation point");
        drop(exec);
    });
}
