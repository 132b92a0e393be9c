//! Timers: `sleep` and `yield_timeout` inside executor fibers, and early
//! wakeups through `JoinHandle::wake`.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{wait_for, wait_within, watchdog, Flag};
use spindle_executor::{sleep, yield_timeout, Executor};

#[test]
fn sleep_lasts_at_least_its_duration() {
    watchdog("sleep_lasts_at_least_its_duration", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        stage.set("a fiber sleeps 20 ms");
        let slept = exec
            .block_on(|| {
                let start = Instant::now();
                sleep(Duration::from_millis(20));
                start.elapsed()
            })
            .unwrap();
        assert!(slept >= Duration::from_millis(20), "slept only {slept:?}");
    });
}

#[test]
fn sleeping_fibers_free_the_worker() {
    watchdog("sleeping_fibers_free_the_worker", 30, |stage| {
        // One worker: a fiber asleep for a minute must not hold it.
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let asleep = Flag::new();
        let a = asleep.clone();
        let sleeper = exec.spawn(move || {
            a.set();
            sleep(Duration::from_secs(60));
        });
        wait_for(&stage, "the sleeper to start", || asleep.is_set());
        stage.set("50 more fibers, each sleeping 1 ms, on the same worker");
        let hs: Vec<_> = (0..50u64)
            .map(|i| {
                exec.spawn(move || {
                    sleep(Duration::from_millis(1));
                    i
                })
            })
            .collect();
        assert_eq!(hs.into_iter().map(|h| h.join().unwrap()).sum::<u64>(), (0..50).sum());
        assert!(!sleeper.is_finished(), "they all ran while the first one slept");
        sleeper.cancel();
        assert!(sleeper.join().unwrap_err().is_cancelled());
    });
}

#[test]
fn overdue_timers_fire_in_deadline_order() {
    watchdog("overdue_timers_fire_in_deadline_order", 30, |stage| {
        // One worker, held by a hog while every deadline passes: sysmon
        // finds the timers overdue together (their deadlines are a
        // microsecond apart), and the order in which the woken fibers then
        // run is the order in which their timers fired.
        let exec = Executor::builder().workers(1).max_workers(1).build();
        // The order means something only if every fiber went to sleep
        // before the first deadline: the hog checks that when it takes the
        // worker (all sleepers have suspended by then), and a round in which
        // the machine stalled for the whole margin is run again with a
        // wider one. The test fails only if every round stalled.
        for margin_ms in [50u64, 500, 4_000] {
            stage.set(format!("a round with a {margin_ms} ms margin"));
            let base = Instant::now() + Duration::from_millis(margin_ms);
            // Microseconds apart, well under the sysmon interval: sysmon
            // finds several (or all) due at one look.
            let last_deadline = base + Duration::from_micros(10);
            let woke = Arc::new(std::sync::Mutex::new(Vec::new()));
            let asleep = Arc::new(AtomicUsize::new(0));
            // Spawned latest deadline first.
            let sleepers: Vec<_> = (1..=10u64)
                .rev()
                .map(|k| {
                    let (woke, asleep) = (Arc::clone(&woke), Arc::clone(&asleep));
                    exec.spawn(move || {
                        asleep.fetch_add(1, Ordering::SeqCst);
                        spindle_executor::sleep_until(base + Duration::from_micros(k));
                        woke.lock().unwrap().push(k);
                    })
                })
                .collect();
            let holding = Flag::new();
            let hog = {
                let (asleep, holding) = (Arc::clone(&asleep), holding.clone());
                exec.spawn(move || {
                    // Let every sleeper reach its sleep (one worker: each
                    // goes from the count straight to sleep_until).
                    while asleep.load(Ordering::SeqCst) < 10 {
                        spindle_executor::yield_now();
                    }
                    let on_time = Instant::now() < base;
                    holding.set();
                    // Hold the worker, without suspending, until every
                    // deadline is past.
                    while Instant::now() <= last_deadline {
                        std::hint::spin_loop();
                    }
                    on_time
                })
            };
            wait_for(&stage, "the hog to hold the worker", || holding.is_set());
            let on_time = hog.join().unwrap();
            for h in sleepers {
                h.join().unwrap();
            }
            if on_time {
                let woke = woke.lock().unwrap().clone();
                assert_eq!(woke, (1..=10).collect::<Vec<_>>(), "deadline order");
                return;
            }
        }
        panic!(
            "in every round the sleepers went to sleep after the first deadline: the machine is too loaded"
        );
    });
}

#[test]
fn yield_timeout_woken_early_returns_false() {
    watchdog("yield_timeout_woken_early_returns_false", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let waiting = Flag::new();
        let h = {
            let waiting = waiting.clone();
            exec.spawn(move || {
                waiting.set();
                yield_timeout(Duration::from_secs(60))
            })
        };
        wait_for(&stage, "the fiber to start waiting", || waiting.is_set());
        // The flag is set just before the wait: wake until the fiber is out
        // (a wake before it waits has no effect).
        wait_for(&stage, "the woken fiber to finish", || {
            h.wake();
            h.is_finished()
        });
        // Finished within the watchdog's 30 s: woken, long before its 60 s.
        assert!(!h.join().unwrap(), "woken early, so not a timeout");
    });
}

#[test]
fn yield_timeout_that_runs_out_returns_true() {
    watchdog("yield_timeout_that_runs_out_returns_true", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        stage.set("a fiber waits 15 ms without a wakeup");
        let (timed_out, waited) = exec
            .block_on(|| {
                let start = Instant::now();
                let t = yield_timeout(Duration::from_millis(15));
                (t, start.elapsed())
            })
            .unwrap();
        assert!(timed_out, "nobody woke it");
        assert!(waited >= Duration::from_millis(15), "waited only {waited:?}");
    });
}

#[test]
fn yield_timeout_repeated_wakeups() {
    watchdog("yield_timeout_repeated_wakeups", 30, |stage| {
        // A fiber waits with a long timeout again and again; every wait is
        // ended by a wake, none by the timer.
        let exec = Executor::builder().workers(2).build();
        let rounds = Arc::new(AtomicUsize::new(0));
        const ROUNDS: usize = 50;
        let h = {
            let rounds = Arc::clone(&rounds);
            exec.spawn(move || {
                let mut timeouts = 0;
                for _ in 0..ROUNDS {
                    rounds.fetch_add(1, Ordering::SeqCst);
                    if yield_timeout(Duration::from_secs(60)) {
                        timeouts += 1;
                    }
                }
                timeouts
            })
        };
        wait_for(&stage, "all rounds to be woken", || {
            h.wake();
            h.is_finished()
        });
        assert_eq!(h.join().unwrap(), 0, "no wait ran out");
        assert_eq!(rounds.load(Ordering::SeqCst), ROUNDS);
    });
}

/// A wake through a stale `Waiter` (one taken outside the sleep, as a
/// synchronisation primitive may keep one) is spurious for `sleep` and
/// `yield_timeout`: only the timer, `JoinHandle::wake`, a cancel or
/// shutdown end them. Here the fiber wakes a waiter of itself just before
/// it waits, so the wake arrives while it is still running.
#[test]
fn a_stale_wake_before_the_wait_does_not_end_it() {
    watchdog("a_stale_wake_before_the_wait_does_not_end_it", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        stage.set("yield_timeout after a wake of a stale waiter");
        let timed_out = exec
            .block_on(|| {
                spindle_fiber::Waiter::current().unwrap().wake();
                yield_timeout(Duration::from_millis(20))
            })
            .unwrap();
        assert!(timed_out, "the stale wake ended the wait instead of the timer");
        stage.set("sleep after a wake of a stale waiter");
        let slept = exec
            .block_on(|| {
                let start = Instant::now();
                spindle_fiber::Waiter::current().unwrap().wake();
                sleep(Duration::from_millis(20));
                start.elapsed()
            })
            .unwrap();
        assert!(slept >= Duration::from_millis(20), "the stale wake cut the sleep to {slept:?}");
    });
}

/// The same with the stale wake coming from another thread, before or
/// during the wait (whichever it is, the wait ends only by its timer).
#[test]
fn a_stale_wake_from_another_thread_does_not_end_the_wait() {
    watchdog("a_stale_wake_from_another_thread", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        for round in 0..20 {
            stage.set(format!("round {round}: a thread wakes a stale waiter of a waiting fiber"));
            let (tx, rx) = std::sync::mpsc::channel();
            let h = exec.spawn(move || {
                tx.send(spindle_fiber::Waiter::current().unwrap()).unwrap();
                yield_timeout(Duration::from_millis(5))
            });
            rx.recv().unwrap().wake();
            assert!(h.join().unwrap(), "round {round}: the stale wake ended the wait");
        }
    });
}

#[test]
fn a_sleep_too_long_for_a_deadline_lasts_until_cancelled() {
    watchdog("a_sleep_too_long_for_a_deadline_lasts_until_cancelled", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let asleep = Flag::new();
        let h = {
            let asleep = asleep.clone();
            exec.spawn(move || {
                asleep.set();
                // `now + Duration::MAX` overflows: no panic, a deadline that
                // never comes.
                sleep(Duration::MAX);
            })
        };
        wait_for(&stage, "the fiber to go to sleep", || asleep.is_set());
        h.cancel();
        assert!(h.join().unwrap_err().is_cancelled(), "cancelled, not panicked");
    });
}

/// The timer that wakes a sleeping fiber gives up its reference to the
/// fiber's task before the wake, so it is never the last one: a panic
/// payload nobody joined is dropped by a worker, never on the sysmon thread
/// (where a `Drop` that blocks would stop every timer). Before, the woken
/// fiber often finished first and the timer's reference was the last. (A
/// panic payload, not a value: a value nobody joins is dropped on its own
/// fiber once its handle is gone, wherever the last reference is.)
#[test]
fn a_woken_sleepers_unjoined_panic_payload_is_not_dropped_on_sysmon() {
    use std::sync::Mutex;

    struct RecordsDropThread(Arc<Mutex<Vec<String>>>);
    impl Drop for RecordsDropThread {
        fn drop(&mut self) {
            let name = std::thread::current().name().unwrap_or("?").to_owned();
            self.0.lock().unwrap().push(name);
        }
    }
    watchdog("a_woken_sleepers_unjoined_panic_payload_is_not_dropped_on_sysmon", 60, |stage| {
        let exec = Executor::builder().workers(2).build();
        let threads = Arc::new(Mutex::new(Vec::new()));
        const ROUNDS: usize = 100;
        stage.set("detached fibers that sleep, then panic with a payload nobody joins");
        for _ in 0..ROUNDS {
            let t = threads.clone();
            drop(exec.spawn(move || {
                sleep(Duration::from_micros(200));
                std::panic::panic_any(RecordsDropThread(t))
            }));
        }
        while threads.lock().unwrap().len() < ROUNDS {
            std::thread::yield_now();
        }
        let threads = threads.lock().unwrap();
        assert!(
            threads.iter().all(|t| t != "spindle-sysmon"),
            "panic payloads dropped on sysmon: {} of {ROUNDS}",
            threads.iter().filter(|t| *t == "spindle-sysmon").count()
        );
    });
}

/// `interrupt_after` gives an interruptible wait a deadline: a wait that
/// nothing ends returns `Interrupted` once it passes (not before), one
/// that gets its token first returns it, and a deadline that fired while
/// no wait took it does not reach a later wait.
#[test]
fn interrupt_after_gives_an_interruptible_wait_a_deadline() {
    use spindle_executor::interrupt_after;
    use spindle_sync::{Interrupted, Semaphore};
    watchdog("interrupt_after_gives_an_interruptible_wait_a_deadline", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let sem = Arc::new(Semaphore::new(0));

        stage.set("a wait nobody ends, with a 20 ms deadline");
        let s = Arc::clone(&sem);
        let (waited, result) = exec
            .block_on(move || {
                let start = Instant::now();
                let r = interrupt_after(Duration::from_millis(20), || s.acquire_interruptible());
                (start.elapsed(), r)
            })
            .unwrap();
        assert_eq!(result, Err(Interrupted));
        assert!(waited >= Duration::from_millis(20), "interrupted after {waited:?}, before its deadline");
        assert_eq!(sem.waiters(), 0);

        stage.set("a wait that gets its token before a long deadline");
        sem.release(1);
        let s = Arc::clone(&sem);
        let r =
            exec.block_on(move || interrupt_after(Duration::from_secs(3600), || s.acquire_interruptible()));
        assert_eq!(r.unwrap(), Ok(()));

        stage.set("a deadline that fires while no wait takes it is cleared at the end");
        let s = Arc::clone(&sem);
        let later = exec.spawn(move || {
            interrupt_after(Duration::from_millis(1), || {
                // Busy past the deadline, reaching no interruptible wait,
                // until the timer has fired.
                yield_past_deadline(Instant::now(), Duration::from_millis(1));
            });
            // A later wait is not interrupted by it: the release below
            // ends it.
            s.acquire_interruptible()
        });
        wait_for(&stage, "the later wait", || sem.waiters() == 1);
        sem.release(1);
        assert_eq!(later.join().unwrap(), Ok(()));
    });
}

/// Outside an executor fiber `interrupt_after` refuses: a thread's waits
/// cannot be interrupted.
#[test]
#[should_panic(expected = "interrupt_after called outside an executor fiber")]
fn interrupt_after_on_a_thread_panics() {
    spindle_executor::interrupt_after(Duration::from_millis(1), || ());
}

/// Yields (timed waits of 1 ms) until sysmon has fired the deadline that
/// lies `d` after the `interrupt_after` call begun no later than `begun`,
/// with no other deadline fired in that call: a timed yield begun after
/// that deadline either times out, which shows sysmon fired every timer
/// due before it (timers fire in deadline order), or ends early, which
/// only that deadline's interrupt does. Polled, not assumed.
fn yield_past_deadline(begun: Instant, d: Duration) {
    loop {
        let after_deadline = begun.elapsed() >= d;
        yield_timeout(Duration::from_millis(1));
        if after_deadline {
            return;
        }
    }
}

/// Yields until sysmon has fired every timer due by `deadline`, whatever
/// interrupts a nested call's fired deadline sends the calling fiber
/// meanwhile: a fiber spawned to sleep until just after `deadline` is
/// woken by sysmon only after those timers (timers fire in deadline
/// order). Polled, not assumed.
fn yield_until_fired(deadline: Instant) {
    let fired = Flag::new();
    let f = fired.clone();
    drop(spindle_executor::spawn(move || {
        spindle_executor::sleep_until(deadline + Duration::from_millis(1));
        f.set();
    }));
    while !fired.is_set() {
        spindle_executor::yield_now();
    }
}

/// A nested `interrupt_after` that fired keeps an enclosing deadline's
/// interrupt when that has fired too: the enclosing call's next wait is
/// interrupted at once. (The inner call used to clear the shared mark, so
/// the outer wait slept on past its deadline.)
#[test]
fn a_nested_interrupt_after_keeps_the_enclosing_deadlines_interrupt() {
    use spindle_executor::interrupt_after;
    use spindle_sync::{Channel, Interrupted};
    watchdog("a_nested_interrupt_after_keeps_the_enclosing_deadlines_interrupt", 30, |_| {
        let exec = Executor::builder().workers(1).build();
        let (inner, outer) = exec
            .block_on(|| {
                let chan = Channel::<u32>::new(); // nobody sends
                interrupt_after(Duration::from_millis(30), || {
                    let outer_begun = Instant::now();
                    let inner = interrupt_after(Duration::from_millis(5), || {
                        let r =
                            chan.pop_interruptible().map(|m| m.expect("the channel is open").into_inner());
                        // Until the outer deadline has fired, still inside
                        // the inner call, in no interruptible wait.
                        yield_until_fired(outer_begun + Duration::from_millis(30));
                        r
                    });
                    (inner, chan.pop_interruptible().map(|m| m.expect("the channel is open").into_inner()))
                })
            })
            .unwrap();
        assert_eq!(inner, Err(Interrupted));
        assert_eq!(outer, Err(Interrupted), "the outer deadline's interrupt reached its wait");
    });
}

/// A loop that retries a timed wait stops once its fiber is cancelled:
/// `interrupt_after` is a cancellation point. (Before, every wait was
/// interrupted at once and the loop spun, so the join never returned.)
#[test]
fn a_timed_wait_retry_loop_stops_when_cancelled() {
    use spindle_executor::interrupt_after;
    use spindle_sync::Channel;
    watchdog("a_timed_wait_retry_loop_stops_when_cancelled", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let chan = Arc::new(Channel::<u32>::new());
        let rounds = Arc::new(AtomicUsize::new(0));
        let h = {
            let (chan, rounds) = (Arc::clone(&chan), Arc::clone(&rounds));
            exec.spawn(move || loop {
                let _ = interrupt_after(Duration::from_millis(200), || chan.pop_interruptible());
                rounds.fetch_add(1, Ordering::SeqCst);
            })
        };
        wait_for(&stage, "the loop to wait", || chan.receivers() == 1);
        h.cancel();
        assert!(h.join().is_err_and(|e| e.is_cancelled()));
        assert!(rounds.load(Ordering::SeqCst) <= 2, "the loop stopped at its next round");
    });
}

/// A deadline is sticky for its call: once it has passed, every
/// interruptible wait inside that `interrupt_after` returns `Interrupted`,
/// whatever nested calls with their own deadlines did meanwhile (deadlines
/// at equal times, three levels, a wait that already took the mark).
#[test]
fn a_passed_deadline_interrupts_every_wait_in_its_call() {
    use spindle_executor::interrupt_after;
    use spindle_sync::{Channel, Interrupted, Msg};
    fn wait(chan: &Channel<u32>) -> Result<u32, Interrupted> {
        chan.pop_interruptible().map(|m| m.expect("the channel is open").into_inner())
    }
    watchdog("a_passed_deadline_interrupts_every_wait_in_its_call", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        stage.set("the same deadline twice, nested: the inner wait takes the one mark");
        let got = exec
            .block_on(|| {
                let chan = Channel::<u32>::new(); // nobody sends
                interrupt_after(Duration::from_millis(10), || {
                    let inner = interrupt_after(Duration::from_millis(10), || wait(&chan));
                    (inner, wait(&chan), wait(&chan))
                })
            })
            .unwrap();
        assert_eq!(got, (Err(Interrupted), Err(Interrupted), Err(Interrupted)));

        stage.set("three levels: short, long, short; the innermost outlives the outermost deadline");
        let got = exec
            .block_on(|| {
                let chan = Channel::<u32>::new();
                interrupt_after(Duration::from_millis(10), || {
                    let outermost_begun = Instant::now();
                    interrupt_after(Duration::from_secs(3600), || {
                        interrupt_after(Duration::from_millis(5), || {
                            // Until the outermost deadline has fired.
                            yield_until_fired(outermost_begun + Duration::from_millis(10))
                        });
                    });
                    wait(&chan)
                })
            })
            .unwrap();
        assert_eq!(got, Err(Interrupted), "the outermost deadline had passed");

        stage.set("after the call returns, waits are not interrupted");
        let chan = std::sync::Arc::new(Channel::<u32>::new());
        let first = Flag::new();
        let (c, f) = (std::sync::Arc::clone(&chan), first.clone());
        let h = exec.spawn(move || {
            let timed = interrupt_after(Duration::from_millis(5), || wait(&c));
            f.set();
            (timed, wait(&c))
        });
        wait_for(&stage, "the wait after the call", || first.is_set() && chan.receivers() == 1);
        chan.push(Msg::new(7)).unwrap();
        assert_eq!(h.join().unwrap(), (Err(Interrupted), Ok(7)));
    });
}

/// `JoinHandle::wait_timeout` from a thread and from a fiber: false while
/// the task waits at its gate (the task keeps running, the handle stays
/// usable), true once it completed, and `join` then returns the value at
/// once. A task waiting for itself gets false at once.
#[test]
fn wait_timeout_reports_completion_from_threads_and_fibers() {
    use spindle_executor::sync::Semaphore;
    watchdog("wait_timeout_reports_completion_from_threads_and_fibers", 60, |stage| {
        let exec = Executor::builder().workers(2).build();
        for in_fiber in [false, true] {
            stage.set(format!("in a fiber: {in_fiber}"));
            let gate = Arc::new(Semaphore::new(0));
            let g = gate.clone();
            let task = exec.spawn(move || {
                g.acquire();
                7u32
            });
            let check = move || {
                let start = Instant::now();
                let early = task.wait_timeout(Duration::from_millis(20));
                let waited = start.elapsed();
                gate.release(1);
                let done = task.wait_timeout(Duration::from_secs(60));
                let again = task.wait_timeout(Duration::from_millis(1));
                (early, waited, done, again, task.join())
            };
            let (early, waited, done, again, value) =
                if in_fiber { exec.block_on(check).unwrap() } else { check() };
            assert!(!early, "in a fiber: {in_fiber}: the task was still at its gate");
            assert!(waited >= Duration::from_millis(20), "in a fiber: {in_fiber}: waited {waited:?}");
            assert!(done && again, "in a fiber: {in_fiber}");
            assert_eq!(value.unwrap(), 7);
        }
        stage.set("a task that waits for itself");
        let slot: Arc<parking_lot::Mutex<Option<spindle_executor::JoinHandle<bool>>>> = Default::default();
        let (s, started) = (slot.clone(), Flag::new());
        let st = started.clone();
        let me = exec.spawn(move || {
            st.set();
            loop {
                if let Some(h) = s.lock().as_ref() {
                    return h.wait_timeout(Duration::from_secs(60));
                }
                spindle_executor::yield_now();
            }
        });
        wait_for(&stage, "the self-waiting task to start", || started.is_set());
        // The handle goes where the task can see it; the task keeps its own
        // copy of nothing else, so `join` below uses the slot's.
        *slot.lock() = Some(me);
        let finished =
            wait_within(Duration::from_secs(30), || slot.lock().as_ref().is_some_and(|h| h.is_finished()));
        assert!(finished, "the self-wait returned");
        let h = slot.lock().take().unwrap();
        assert!(!h.join().unwrap(), "a task waiting for itself gets false at once");
    });
}

/// A cancelled fiber unwinds in `wait_timeout`; in a fiber that is not an
/// executor's (driven by hand) it panics with the reason.
#[test]
fn wait_timeout_is_a_cancellation_point() {
    use spindle_executor::sync::Semaphore;
    watchdog("wait_timeout_is_a_cancellation_point", 60, |stage| {
        let exec = Executor::builder().workers(2).build();
        let gate = Arc::new(Semaphore::new(0));
        let g = gate.clone();
        let blocked = exec.spawn(move || g.acquire());
        let waiting = Flag::new();
        let w = waiting.clone();
        let waiter = exec.spawn(move || {
            w.set();
            blocked.wait_timeout(Duration::from_secs(600))
        });
        wait_for(&stage, "the waiter to wait", || waiting.is_set());
        waiter.cancel();
        stage.set("the cancelled waiter unwinds");
        assert!(waiter.join().unwrap_err().is_cancelled());

        stage.set("a fiber driven by hand");
        let g = gate.clone();
        let blocked = exec.spawn(move || g.acquire());
        let fiber = spindle_fiber::Fiber::new(spindle_fiber::FiberAttr::new()).unwrap();
        fiber
            .set_function(spindle_fiber::Priority::NORMAL, move || {
                blocked.wait_timeout(Duration::from_secs(600))
            })
            .unwrap();
        match fiber.run() {
            Ok(spindle_fiber::RunOutcome::Panicked(p)) => {
                let msg = p.message().unwrap_or_default().to_owned();
                assert!(msg.contains("in a fiber that is not an executor's"), "{msg}");
            }
            other => panic!("expected the panic, got {other:?}"),
        }
        gate.release(2);
    });
}

/// `interrupt_at`: one deadline shared by two waits in a row. The first
/// takes the token that is there, the second, which nobody ends, is
/// interrupted once the deadline passes (not before it). On a thread it
/// refuses as `interrupt_after` does, naming itself.
#[test]
fn interrupt_at_shares_one_deadline_between_waits() {
    use spindle_executor::interrupt_at;
    use spindle_sync::{Interrupted, Semaphore};
    watchdog("interrupt_at_shares_one_deadline_between_waits", 30, |_| {
        let exec = Executor::builder().workers(1).build();
        let sem = Arc::new(Semaphore::new(1));
        let s = Arc::clone(&sem);
        let (deadline, first, second, ended) = exec
            .block_on(move || {
                let deadline = Instant::now() + Duration::from_millis(20);
                let first = interrupt_at(deadline, || s.acquire_interruptible());
                let second = interrupt_at(deadline, || s.acquire_interruptible());
                (deadline, first, second, Instant::now())
            })
            .unwrap();
        assert_eq!((first, second), (Ok(()), Err(Interrupted)));
        assert!(ended >= deadline, "interrupted {:?} before its deadline", deadline - ended);
        assert_eq!(sem.waiters(), 0);

        let refused = std::panic::catch_unwind(|| interrupt_at(Instant::now(), || ()));
        let msg = refused.expect_err("a thread cannot be interrupted");
        let msg = msg.downcast_ref::<String>().map(String::as_str).unwrap_or_default();
        assert!(msg.contains("interrupt_at called outside an executor fiber"), "{msg}");
    });
}

/// `JoinHandle::wait_until` from a thread and from a fiber: false at a
/// deadline passed while the task waits at its gate, true once it has
/// completed; a deadline already past only looks on a thread.
#[test]
fn wait_until_reports_completion_from_threads_and_fibers() {
    use spindle_executor::sync::Semaphore;
    watchdog("wait_until_reports_completion_from_threads_and_fibers", 60, |stage| {
        let exec = Executor::builder().workers(2).build();
        for in_fiber in [false, true] {
            stage.set(format!("in a fiber: {in_fiber}"));
            let gate = Arc::new(Semaphore::new(0));
            let g = gate.clone();
            let task = exec.spawn(move || {
                g.acquire();
                7u32
            });
            let check = move || {
                let deadline = Instant::now() + Duration::from_millis(20);
                let early = task.wait_until(deadline);
                let ended = Instant::now();
                gate.release(1);
                let done = task.wait_until(Instant::now() + Duration::from_secs(60));
                (early, ended >= deadline, done, task.join())
            };
            let (early, waited_out, done, value) =
                if in_fiber { exec.block_on(check).unwrap() } else { check() };
            assert!(!early, "in a fiber: {in_fiber}: the task was still at its gate");
            assert!(waited_out, "in a fiber: {in_fiber}: returned before the deadline");
            assert!(done, "in a fiber: {in_fiber}");
            assert_eq!(value.unwrap(), 7);
        }
        stage.set("a deadline already past, on a thread");
        let gate = Arc::new(Semaphore::new(0));
        let g = gate.clone();
        let task = exec.spawn(move || g.acquire());
        assert!(!task.wait_until(Instant::now()));
        gate.release(1);
        assert!(task.wait_until(Instant::now() + Duration::from_secs(60)));
        assert!(task.wait_until(Instant::now()), "finished: true whatever the deadline");
    });
}

/// `interrupt_at` with a deadline already past: a token there now is
/// taken; with none, the wait is interrupted (at sysmon's next tick; the
/// watchdog fails a wait that is never interrupted). (From a review.)
#[test]
fn interrupt_at_with_a_past_deadline_interrupts() {
    watchdog("interrupt_at_with_a_past_deadline_interrupts", 30, |_| {
        let exec = Executor::builder().workers(1).build();
        let (first, second) = exec
            .block_on(|| {
                let sem = spindle_executor::sync::Semaphore::new(1);
                let past = Instant::now();
                let first = spindle_executor::interrupt_at(past, || sem.acquire_interruptible());
                let second = spindle_executor::interrupt_at(past, || sem.acquire_interruptible());
                (first, second)
            })
            .unwrap();
        assert_eq!((first, second), (Ok(()), Err(spindle_executor::sync::Interrupted)));
    });
}

/// `wait_until` is a cancellation point, and in a fiber driven by hand it
/// panics naming itself (as `interrupt_at` and the sync `_until` forms do).
#[test]
fn wait_until_is_a_cancellation_point_and_names_itself_in_a_hand_driven_fiber() {
    watchdog("wait_until_is_a_cancellation_point_and_names_itself_in_a_hand_driven_fiber", 60, |stage| {
        let exec = Executor::builder().workers(2).build();
        let gate = Arc::new(spindle_executor::sync::Semaphore::new(0));
        let g = gate.clone();
        let blocked = exec.spawn(move || g.acquire());
        let waiting = Flag::new();
        let w = waiting.clone();
        let waiter = exec.spawn(move || {
            w.set();
            blocked.wait_until(Instant::now() + Duration::from_secs(600))
        });
        wait_for(&stage, "the waiter to wait", || waiting.is_set());
        waiter.cancel();
        stage.set("the cancelled waiter unwinds");
        assert!(waiter.join().unwrap_err().is_cancelled());

        stage.set("a fiber driven by hand");
        let g = gate.clone();
        let blocked = exec.spawn(move || g.acquire());
        let fiber = spindle_fiber::Fiber::new(spindle_fiber::FiberAttr::new()).unwrap();
        fiber
            .set_function(spindle_fiber::Priority::NORMAL, move || {
                blocked.wait_until(Instant::now() + Duration::from_secs(600))
            })
            .unwrap();
        match fiber.run() {
            Ok(spindle_fiber::RunOutcome::Panicked(p)) => {
                let msg = p.message().unwrap_or_default().to_owned();
                assert!(msg.contains("in a fiber that is not an executor's"), "{msg}");
                assert!(msg.contains("wait_until"), "{msg}");
            }
            other => panic!("expected the panic, got {other:?}"),
        }
        gate.release(2);
    });
}

/// `ScopedJoinHandle::wait_until`, from the scope's thread.
#[test]
fn scoped_wait_until_reports_completion() {
    watchdog("scoped_wait_until_reports_completion", 30, |_| {
        let exec = Executor::builder().workers(2).build();
        let gate = spindle_executor::sync::Semaphore::new(0);
        let (early, late) = exec.scope(|s| {
            let h = s.spawn(|| gate.acquire());
            let early = h.wait_until(Instant::now() + Duration::from_millis(20));
            gate.release(1);
            let late = h.wait_until(Instant::now() + Duration::from_secs(60));
            (early, late)
        });
        assert!(!early && late);
    });
}

/// `wait_until` from a fiber of another executor: that executor's clock
/// ends the wait.
#[test]
fn wait_until_from_a_fiber_of_another_executor() {
    watchdog("wait_until_from_a_fiber_of_another_executor", 30, |_| {
        let a = Executor::builder().workers(1).build();
        let b = Executor::builder().workers(1).build();
        let gate = Arc::new(spindle_executor::sync::Semaphore::new(0));
        let g = gate.clone();
        let task = a.spawn(move || g.acquire());
        let (early, waited) = b
            .block_on(move || {
                let deadline = Instant::now() + Duration::from_millis(20);
                let early = task.wait_until(deadline);
                (early, Instant::now() >= deadline)
            })
            .unwrap();
        assert!(!early && waited);
        gate.release(1);
    });
}
