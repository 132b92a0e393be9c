//! Interruptible waits: `Semaphore::acquire_interruptible` and
//! `Channel::pop_interruptible` end early when the fiber is interrupted
//! (`Fiber::interrupt`, `Waiter::interrupt`), take nothing then, and lose
//! nothing when an interrupt and a release or push race; plain waits are
//! not interrupted.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{fiber, watchdog, XorShift};
use spindle_fiber::{take_interrupt, FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Interrupted, Msg, Semaphore};

#[test]
fn an_interrupted_acquire_returns_without_a_token_and_leaves_the_list() {
    watchdog("an_interrupted_acquire_returns_without_a_token_and_leaves_the_list", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::new(4);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || s.acquire_interruptible());
        queue.try_push(f.clone()).unwrap();
        stage.set("the fiber waits");
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        assert_eq!(sem.waiters(), 1);

        stage.set("interrupted: woken onto its queue, the wait ends without a token");
        f.interrupt();
        assert_eq!(f.state(), FiberState::Queued, "the interrupt woke it onto its run queue");
        match queue.run_next().unwrap().outcome {
            Ok(RunOutcome::Returned(r)) => assert_eq!(r, Err(Interrupted)),
            other => panic!("expected an interrupted wait, got {other:?}"),
        }
        assert_eq!(sem.waiters(), 0, "the interrupted fiber left the wait list");
        sem.release(1);
        assert_eq!(sem.available(), 1, "a later release is not handed to the departed fiber");
    });
}

#[test]
fn an_interrupt_before_the_wait_ends_the_next_one_once_and_a_free_token_wins() {
    watchdog("an_interrupt_before_the_wait_ends_the_next_one_once_and_a_free_token_wins", 30, |_| {
        let sem = Arc::new(Semaphore::new(1));
        let queue = RunQueue::new(4);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            spindle_fiber::yield_now();
            // A token is there: taken, the interrupt stays pending.
            let first = s.acquire_interruptible();
            // None now: the pending interrupt ends this wait at once.
            let second = s.acquire_interruptible();
            // Taken once: this one waits.
            let third = s.acquire_interruptible();
            (first, second, third, take_interrupt())
        });
        queue.try_push(f.clone()).unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(_))));
        f.interrupt(); // the fiber is queued, not waiting: only the mark stays
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        sem.release(1);
        match queue.run_next().unwrap().outcome {
            Ok(RunOutcome::Returned(r)) => assert_eq!(r, (Ok(()), Err(Interrupted), Ok(()), false)),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn a_plain_acquire_is_not_interrupted_and_the_interrupt_stays_pending() {
    watchdog("a_plain_acquire_is_not_interrupted_and_the_interrupt_stays_pending", 30, |_| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::new(4);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            s.acquire();
            take_interrupt()
        });
        queue.try_push(f.clone()).unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        f.interrupt();
        // A spurious wake for the plain wait: it sleeps again.
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        assert_eq!(sem.waiters(), 1);
        sem.release(1);
        match queue.run_next().unwrap().outcome {
            Ok(RunOutcome::Returned(pending)) => assert!(pending, "the interrupt was still pending"),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn a_new_function_starts_with_no_interrupt_pending() {
    let f = fiber(Priority::NORMAL, take_interrupt);
    f.interrupt();
    f.set_function(Priority::NORMAL, take_interrupt).unwrap();
    assert!(matches!(f.run(), Ok(RunOutcome::Returned(false))));
    assert!(!take_interrupt(), "an ordinary thread has no interrupt");
}

#[test]
fn an_interrupted_pop_takes_no_message_and_a_later_push_is_kept() {
    watchdog("an_interrupted_pop_takes_no_message_and_a_later_push_is_kept", 30, |_| {
        let chan = Arc::new(Channel::<u32>::new());
        let queue = RunQueue::new(4);
        let rx = chan.clone();
        let f = fiber(Priority::NORMAL, move || {
            rx.pop_interruptible().map(|m| m.expect("the channel is open").into_inner())
        });
        queue.try_push(f.clone()).unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        assert_eq!(chan.receivers(), 1);
        f.interrupt();
        match queue.run_next().unwrap().outcome {
            Ok(RunOutcome::Returned(r)) => assert_eq!(r, Err(Interrupted)),
            other => panic!("{other:?}"),
        }
        assert_eq!(chan.receivers(), 0);
        chan.push(Msg::new(5)).unwrap();
        assert_eq!(chan.try_pop().map(Msg::into_inner), Some(5), "the message waited in the channel");
    });
}

/// An interrupt and a release (or push) race from two threads while the
/// fiber waits, over many rounds: every token and message ends up either
/// with the fiber (its wait returned it) or still in the primitive, never
/// both and never neither.
#[test]
fn interrupts_racing_releases_and_pushes_lose_nothing() {
    const ROUNDS: usize = 2_000;
    watchdog("interrupts_racing_releases_and_pushes_lose_nothing", 120, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let chan = Arc::new(Channel::<usize>::new());
        let queue = RunQueue::new(4);
        let (got_tokens, got_messages, interrupted) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mut rng = XorShift::new(0x5eed);
        let mut left = 0;
        for round in 0..ROUNDS {
            stage.set(format!("round {round}"));
            let use_channel = rng.below(2) == 0;
            let (s, c, t, m, i) =
                (sem.clone(), chan.clone(), got_tokens.clone(), got_messages.clone(), interrupted.clone());
            let f = fiber(Priority::NORMAL, move || {
                let r = if use_channel {
                    c.pop_interruptible().map(|m| m.expect("the channel is open").into_inner())
                } else {
                    s.acquire_interruptible().map(|()| 0)
                };
                match r {
                    Ok(_) if use_channel => m.fetch_add(1, Ordering::SeqCst),
                    Ok(_) => t.fetch_add(1, Ordering::SeqCst),
                    Err(Interrupted) => i.fetch_add(1, Ordering::SeqCst),
                };
                // An interrupt that came after the wait ended stays pending.
                let _ = take_interrupt();
            });
            queue.try_push(f.clone()).unwrap();
            assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
            let (s, c, f2) = (sem.clone(), chan.clone(), f.clone());
            // Both start together; one of them dawdles a little, at random.
            let start = Arc::new(std::sync::Barrier::new(2));
            let (delay_signal, delay_interrupt) = match rng.below(2) {
                0 => (rng.below(400), 0),
                _ => (0, rng.below(400)),
            };
            let spin = |n: u64| (0..n).for_each(|_| std::hint::spin_loop());
            let b = start.clone();
            let signaller = std::thread::spawn(move || {
                b.wait();
                spin(delay_signal);
                if use_channel {
                    c.push(Msg::new(round)).unwrap();
                } else {
                    s.release(1);
                }
            });
            let b = start.clone();
            let interrupter = std::thread::spawn(move || {
                b.wait();
                spin(delay_interrupt);
                f2.interrupt()
            });
            // Woken by one or both: run it until it returns, while they
            // may still be signalling.
            loop {
                match queue.pop_timeout(std::time::Duration::from_secs(10)) {
                    Some(fib) => {
                        if let Ok(RunOutcome::Returned(())) = queue.run_popped(fib).outcome {
                            break;
                        }
                    }
                    None => panic!("round {round}: the fiber was never woken"),
                }
            }
            signaller.join().unwrap();
            interrupter.join().unwrap();
            // What the fiber did not take is still there: count it, and
            // empty the primitives for the next round.
            assert_eq!(sem.waiters() + chan.receivers(), 0);
            left += usize::from(sem.try_acquire()) + usize::from(chan.try_pop().is_some());
            assert_eq!((sem.available(), chan.len()), (0, 0), "one signal per round");
        }
        let taken = got_tokens.load(Ordering::SeqCst) + got_messages.load(Ordering::SeqCst);
        assert_eq!(taken + left, ROUNDS, "every token and message accounted for");
        assert_eq!(interrupted.load(Ordering::SeqCst), left, "each interrupted wait left its signal behind");
        // Not an assertion (timing decides the mix), but the mix is the point.
        eprintln!("{} of {ROUNDS} waits interrupted", interrupted.load(Ordering::SeqCst));
    });
}

/// A `Waiter` made during one function interrupts that function only: once
/// the fiber has a new function, it neither marks nor wakes it.
#[test]
fn a_waiter_from_an_earlier_function_interrupts_nothing() {
    let sem = Arc::new(Semaphore::new(0));
    let slot = Arc::new(std::sync::Mutex::new(None));
    let k = slot.clone();
    let f = fiber(Priority::NORMAL, move || {
        *k.lock().unwrap() = spindle_fiber::Waiter::current();
        (Ok(()), false)
    });
    assert!(matches!(f.run(), Ok(RunOutcome::Returned(_))));
    let kept = slot.lock().unwrap().take().expect("the first function's waiter");
    let s = sem.clone();
    f.set_function(Priority::NORMAL, move || (s.acquire_interruptible(), take_interrupt())).unwrap();
    assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
    kept.interrupt();
    assert_eq!(f.state(), FiberState::Sleeping, "not woken");
    sem.release(1);
    assert!(matches!(f.run(), Ok(RunOutcome::Returned((Ok(()), false)))));
}

/// A destructor run while a dropped fiber's stack is unwound has no runner
/// to come back to: its interruptible waits do not wait (they blocked the
/// dropping thread, for good if nothing came). What is there is taken;
/// otherwise they return `Interrupted`, as a cancelled fiber's do.
#[test]
fn interruptible_waits_in_a_dropped_fibers_destructor_do_not_wait() {
    watchdog("interruptible_waits_in_a_dropped_fibers_destructor_do_not_wait", 30, |stage| {
        type Seen = Arc<std::sync::Mutex<Vec<String>>>;
        struct WaitsOnDrop(Arc<Semaphore>, Arc<Channel<u32>>, Seen);
        impl Drop for WaitsOnDrop {
            fn drop(&mut self) {
                let mut seen = self.2.lock().unwrap();
                seen.push(format!("{:?}", self.0.acquire_interruptible()));
                seen.push(format!("{:?}", self.0.acquire_interruptible()));
                seen.push(format!(
                    "{:?}",
                    self.1.pop_interruptible().map(|m| m.expect("the channel is open").into_inner())
                ));
                seen.push(format!(
                    "{:?}",
                    self.1.pop_interruptible().map(|m| m.expect("the channel is open").into_inner())
                ));
            }
        }
        let (sem, chan) = (Arc::new(Semaphore::new(1)), Arc::new(Channel::new()));
        chan.push(Msg::new(7)).unwrap();
        let seen: Seen = Arc::default();
        let guard = WaitsOnDrop(sem.clone(), chan.clone(), seen.clone());
        let f = fiber(Priority::NORMAL, move || {
            let _guard = guard;
            spindle_fiber::yield_now();
        });
        assert!(matches!(f.run(), Ok(RunOutcome::Yielded(0))));
        stage.set("dropping the suspended fiber: its destructor waits on the semaphore and the channel");
        drop(f);
        assert_eq!(
            *seen.lock().unwrap(),
            ["Ok(())", "Err(Interrupted)", "Ok(7)", "Err(Interrupted)"],
            "the token and the message that were there are taken; the waits for more end at once"
        );
        assert_eq!((sem.waiters(), sem.available()), (0, 0));
        assert_eq!(chan.len(), 0);
    });
}
