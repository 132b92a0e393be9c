//! Shutdown: dropping the executor while fibers sleep, join, yield or wait
//! in a queue does not hang, unwinds or drops them (destructors run) and
//! fails their joins with `Cancelled`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{wait_for, watchdog, Flag, Stage};
use spindle_executor::{sleep, yield_now, yield_timeout, Executor, Priority, SpawnOptions};
use spindle_fiber::Waiter;
use spindle_sync::Semaphore;

#[test]
fn drop_unwinds_fibers_asleep_in_sleep() {
    watchdog("drop_unwinds_fibers_asleep_in_sleep", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let flags: Vec<Flag> = (0..10).map(|_| Flag::new()).collect();
        let asleep = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let handles: Vec<_> = flags
            .iter()
            .map(|f| {
                let (guard, asleep) = (f.on_drop(), asleep.clone());
                exec.spawn(move || {
                    let _g = guard;
                    asleep.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    sleep(Duration::from_secs(60));
                })
            })
            .collect();
        // All ten started: each flag is then set by an unwind, not by a
        // job dropped before it ran.
        wait_for(&stage, "all ten sleepers to start", || {
            asleep.load(std::sync::atomic::Ordering::SeqCst) == 10
        });
        stage.set("dropping the executor");
        drop(exec);
        assert!(flags.iter().all(Flag::is_set), "every sleeper was unwound");
        for h in handles {
            assert!(h.join().expect_err("no value").is_cancelled());
        }
    });
}

#[test]
fn drop_unwinds_fibers_parked_in_join() {
    watchdog("drop_unwinds_fibers_parked_in_join", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let sleeper_dropped = Flag::new();
        let joiner_dropped = Flag::new();
        let joining = Flag::new();
        let sleeping = Flag::new();
        let sleeper = {
            let (guard, sleeping) = (sleeper_dropped.on_drop(), sleeping.clone());
            exec.spawn(move || {
                let _g = guard;
                sleeping.set();
                sleep(Duration::from_secs(60));
            })
        };
        let joiner = {
            let (guard, joining) = (joiner_dropped.on_drop(), joining.clone());
            exec.spawn(move || {
                let _g = guard;
                joining.set();
                let _ = sleeper.join();
            })
        };
        // Both started: the flags are set by unwinds, not by jobs dropped
        // before they ran.
        wait_for(&stage, "the sleeper to sleep and the joiner to join", || {
            sleeping.is_set() && joining.is_set()
        });
        stage.set("dropping the executor");
        drop(exec);
        assert!(sleeper_dropped.is_set(), "the joined sleeper was unwound");
        assert!(joiner_dropped.is_set(), "the fiber parked in join was unwound");
        assert!(joiner.join().expect_err("no value").is_cancelled());
    });
}

#[test]
fn drop_unwinds_fibers_parked_in_join_on_a_single_worker() {
    watchdog("drop_unwinds_fibers_parked_in_join_on_a_single_worker", 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let joiner_dropped = Flag::new();
        let joining = Flag::new();
        let sleeper = exec.spawn(|| sleep(Duration::from_secs(60)));
        let joiner = {
            let (guard, joining) = (joiner_dropped.on_drop(), joining.clone());
            exec.spawn(move || {
                let _g = guard;
                joining.set();
                let _ = sleeper.join();
            })
        };
        wait_for(&stage, "the joiner to start", || joining.is_set());
        // The joiner goes from the flag straight into `join` without
        // yielding, so on the only worker this probe runs once the joiner
        // is parked in `join`.
        let probe = exec.spawn(|| ());
        wait_for(&stage, "the probe to run behind the parked joiner", || probe.is_finished());
        assert!(!joiner.is_finished(), "the joiner waits for the 60 s sleeper");
        stage.set("dropping the executor");
        drop(exec);
        assert!(joiner_dropped.is_set(), "the fiber parked in join was unwound");
        assert!(joiner.join().expect_err("no value").is_cancelled());
    });
}

#[test]
fn drop_unwinds_yielding_fibers_and_drops_queued_jobs() {
    watchdog("drop_unwinds_yielding_fibers_and_drops_queued_jobs", 30, |stage| {
        // One worker: a high-priority fiber that keeps yielding always runs
        // before low-priority jobs, so those stay queued until shutdown.
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let yielder_dropped = Flag::new();
        let yielding = Flag::new();
        let yielder = {
            let (guard, yielding) = (yielder_dropped.on_drop(), yielding.clone());
            exec.spawn_with(SpawnOptions::new().priority(Priority::HIGHEST), move || {
                let _g = guard;
                yielding.set();
                loop {
                    yield_now();
                }
            })
        };
        wait_for(&stage, "the yielder to run", || yielding.is_set());
        stage.set("queueing low-priority jobs behind it");
        let queued: Vec<(Flag, Flag, _)> = (0..20)
            .map(|_| {
                let (ran, dropped) = (Flag::new(), Flag::new());
                let (r, guard) = (ran.clone(), dropped.on_drop());
                let h = exec.spawn_with(SpawnOptions::new().priority(Priority::LOWEST), move || {
                    let _g = guard;
                    r.set();
                });
                (ran, dropped, h)
            })
            .collect();
        stage.set("dropping the executor");
        drop(exec);
        assert!(yielder_dropped.is_set(), "the yielding fiber was unwound");
        assert!(yielder.join().expect_err("no value").is_cancelled());
        for (ran, dropped, h) in queued {
            assert!(!ran.is_set(), "a queued job never ran");
            assert!(dropped.is_set(), "its closure was dropped");
            assert!(h.join().expect_err("no value").is_cancelled());
        }
    });
}

#[test]
fn drop_fails_a_join_blocked_on_another_thread() {
    watchdog("drop_fails_a_join_blocked_on_another_thread", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let asleep = Flag::new();
        let h = {
            let asleep = asleep.clone();
            exec.spawn(move || {
                asleep.set();
                sleep(Duration::from_secs(60));
            })
        };
        wait_for(&stage, "the fiber to sleep", || asleep.is_set());
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let joiner = std::thread::spawn(move || {
            tid_tx.send(common::current_tid()).unwrap();
            h.join().map_err(|e| e.is_cancelled())
        });
        let tid = tid_rx.recv().unwrap();
        // The thread goes from the send straight into `join`: once it is
        // blocked in the kernel, it is blocked there.
        wait_for(&stage, "the joining thread to block in join", || common::thread_blocked(tid));
        stage.set("dropping the executor while a thread joins");
        drop(exec);
        stage.set("the joining thread returns");
        assert_eq!(joiner.join().unwrap(), Err(true));
    });
}

#[test]
fn drop_with_everything_at_once() {
    watchdog("drop_with_everything_at_once", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let flags: Vec<Flag> = (0..300).map(|_| Flag::new()).collect();
        let gate = Arc::new(Semaphore::new(0));
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        stage.set("sleepers, yielders, joiners and queued jobs");
        let mut handles = Vec::new();
        for (i, f) in flags.iter().enumerate() {
            let (guard, started) = (f.on_drop(), Arc::clone(&started));
            let h = match i % 3 {
                0 => exec.spawn(move || {
                    let _g = guard;
                    started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    sleep(Duration::from_secs(60));
                }),
                1 => exec.spawn(move || {
                    let _g = guard;
                    started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    loop {
                        yield_now();
                    }
                }),
                _ => {
                    let inner = exec.spawn(|| sleep(Duration::from_secs(60)));
                    exec.spawn(move || {
                        let _g = guard;
                        started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = inner.join();
                    })
                }
            };
            handles.push(h);
        }
        wait_for(&stage, "everything to start", || {
            started.load(std::sync::atomic::Ordering::SeqCst) == flags.len()
        });
        // And some that cannot start before shutdown: they wait on a gate
        // that is never opened, behind the yielders.
        for _ in 0..50 {
            let gate = Arc::clone(&gate);
            drop(exec.spawn_with(SpawnOptions::new().priority(Priority::LOWEST), move || gate.acquire()));
        }
        stage.set("dropping the executor");
        drop(exec);
        let missing: Vec<usize> = (0..flags.len()).filter(|&i| !flags[i].is_set()).collect();
        assert!(missing.is_empty(), "fibers whose locals were not dropped: {missing:?}");
        for h in handles {
            assert!(h.join().expect_err("no value").is_cancelled());
        }
    });
}

/// A semaphore with one fiber of a pool of `workers` asleep on it in a
/// plain `acquire`, left there by the pool's shutdown (its join says
/// cancelled), and a `Waiter` of the fiber, taken by the fiber before it
/// waited (a stale one for its wait).
fn asleep_at_shutdown_with_a_waiter(stage: &Stage, workers: usize) -> (Arc<Semaphore>, Waiter) {
    let exec = Executor::builder().workers(workers).build();
    let sem = Arc::new(Semaphore::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let h = {
        let sem = Arc::clone(&sem);
        exec.spawn(move || {
            tx.send(Waiter::current().unwrap()).unwrap();
            sem.acquire()
        })
    };
    let waiter = rx.recv().unwrap();
    wait_for(stage, "the fiber to wait on the semaphore", || sem.waiters() == 1);
    stage.set("dropping the executor with a fiber asleep on a semaphore");
    drop(exec);
    assert!(h.join().expect_err("no value").is_cancelled());
    (sem, waiter)
}

#[test]
fn waking_a_fiber_after_shutdown_is_harmless() {
    watchdog("waking_a_fiber_after_shutdown_is_harmless", 30, |stage| {
        // (The waiter is dropped at once: the fiber's last reference is then
        // the one its wait node holds.)
        let sem = asleep_at_shutdown_with_a_waiter(&stage, 1).0;
        stage.set("releasing the semaphore after shutdown");
        let leaked = spindle_fiber::leaked_stacks();
        sem.release(1);
        // Handed to the fiber, which no thread will run again: its inbox
        // refused the wake, the release took the token back, and the fiber
        // was dropped where it was woken (its stack leaked on this thread
        // rather than unwound off its own).
        assert_eq!(sem.waiters(), 0, "the release took the fiber off the list");
        assert_eq!(sem.available(), 1, "the refused fiber's token came back to the count");
        assert!(spindle_fiber::leaked_stacks() > leaked, "the fiber's stack was leaked, not unwound here");
        assert!(sem.try_acquire(), "the token can be taken");
    });
}

/// A fiber left asleep on a semaphore by a shutdown sits at the head of its
/// wait list; the thread waiting behind it gets the next token, which the
/// fiber's refused wake gives on (it used to keep it, and the thread waited
/// for good).
#[test]
fn a_thread_waiting_behind_a_fiber_left_asleep_at_shutdown_gets_the_token() {
    watchdog("a_thread_waiting_behind_a_fiber_left_asleep_at_shutdown_gets_the_token", 30, |stage| {
        a_thread_behind_a_fiber_left_asleep_at_shutdown_gets_the_token(&stage, false);
    });
}

/// The same with a wake that hands nothing over first (a stale waiter):
/// the fiber's inbox refuses it, which leaves the fiber ready, in no queue
/// and still in its wait; the release that hands it the token next is
/// refused too and gives it on.
#[test]
fn a_thread_behind_a_fiber_woken_for_nothing_after_shutdown_gets_the_token() {
    watchdog("a_thread_behind_a_fiber_woken_for_nothing_after_shutdown_gets_the_token", 30, |stage| {
        a_thread_behind_a_fiber_left_asleep_at_shutdown_gets_the_token(&stage, true);
    });
}

fn a_thread_behind_a_fiber_left_asleep_at_shutdown_gets_the_token(stage: &Stage, woken_for_nothing: bool) {
    let (sem, waiter) = asleep_at_shutdown_with_a_waiter(stage, 2);
    if woken_for_nothing {
        waiter.wake();
    } else {
        drop(waiter);
    }
    let thread = {
        let sem = Arc::clone(&sem);
        std::thread::spawn(move || sem.acquire())
    };
    wait_for(stage, "the thread to wait behind the fiber", || sem.waiters() == 2);
    stage.set("releasing one token: the thread behind the fiber must get it");
    sem.release(1);
    thread.join().unwrap();
    assert_eq!((sem.available(), sem.waiters()), (0, 0));
}

/// The final drain cancels a fiber asleep in `join` (on a fiber asleep on
/// a semaphore nobody releases) and drops it, so its stack is unwound on
/// the worker; a destructor there that sleeps (`Duration::MAX`: until
/// woken, cancelled or shut down) must return at once rather than block
/// the worker that the shutdown waits for. (From a review: it slept the
/// worker thread for good, and the executor's drop never returned.)
#[test]
fn a_destructor_that_sleeps_in_a_fiber_dropped_by_the_final_drain_returns() {
    watchdog("a_destructor_that_sleeps_in_a_fiber_dropped_by_the_final_drain_returns", 30, |stage| {
        struct SleepsOnDrop(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for SleepsOnDrop {
            fn drop(&mut self) {
                sleep(Duration::MAX);
                assert!(!yield_timeout(Duration::MAX), "not woken: shut down");
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let sem = Arc::new(Semaphore::new(0));
        let stuck = {
            let sem = Arc::clone(&sem);
            exec.spawn(move || sem.acquire())
        };
        wait_for(&stage, "the first fiber to wait on the semaphore", || sem.waiters() == 1);
        let dropped = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let joiner = {
            let guard = SleepsOnDrop(dropped.clone());
            exec.spawn(move || {
                let _guard = guard;
                let _ = stuck.join();
            })
        };
        // One worker: once this has run, the joiner is asleep in `join`.
        exec.spawn(|| ()).join().unwrap();
        stage.set("dropping the executor: the drain unwinds the joiner, whose destructor sleeps");
        drop(exec);
        assert!(joiner.join().expect_err("no value").is_cancelled());
        assert_eq!(dropped.load(std::sync::atomic::Ordering::SeqCst), 1, "the destructor ran to its end");
    });
}

#[test]
fn dropping_the_executor_inside_its_own_fiber_returns() {
    watchdog("dropping_the_executor_inside_its_own_fiber_returns", 30, |stage| {
        let exec = Arc::new(Executor::builder().workers(2).build());
        let go = Arc::new(Semaphore::new(0));
        let (last, fiber_go) = (Arc::clone(&exec), Arc::clone(&go));
        let h = exec.spawn(move || {
            fiber_go.acquire();
            stage.set("the fiber drops the last reference to its own executor");
            drop(last);
            "the drop returned"
        });
        drop(exec);
        go.release(1);
        assert_eq!(h.join().unwrap(), "the drop returned");
    });
}

#[test]
fn spawns_racing_the_drop_all_complete() {
    watchdog("spawns_racing_the_drop_all_complete", 60, |stage| {
        for round in 0..common::size(20, 100) {
            stage.set(format!("round {round}: a thread spawns while the executor is dropped"));
            let exec = Executor::builder().workers(2).build();
            let handle = exec.handle();
            let started = Flag::new();
            let spawner_started = started.clone();
            let spawner = std::thread::spawn(move || {
                let mut joins = Vec::new();
                for i in 0..200 {
                    joins.push(handle.spawn(move || i));
                    if i == 10 {
                        spawner_started.set();
                    }
                }
                joins
            });
            while !started.is_set() {
                std::thread::yield_now();
            }
            drop(exec);
            stage.set(format!("round {round}: joining every spawn (each returns or is cancelled)"));
            for (i, j) in spawner.join().unwrap().into_iter().enumerate() {
                match j.join() {
                    Ok(v) => assert_eq!(v, i),
                    Err(e) => assert!(e.is_cancelled(), "{e}"),
                }
            }
        }
    });
}

#[test]
fn a_joiner_woken_during_the_final_drain_has_its_join_completed() {
    watchdog("a_joiner_woken_during_the_final_drain_has_its_join_completed", 60, |stage| {
        for round in 0..common::size(10, 50) {
            stage.set(format!("round {round}: 'b' joins 'a', which waits forever on a semaphore"));
            let exec = Executor::builder().workers(2).max_workers(2).build();
            let handle = exec.handle();
            let never = Arc::new(Semaphore::new(0));
            let asleep = Flag::new();
            let a_asleep = asleep.clone();
            let a = exec.spawn(move || {
                a_asleep.set();
                never.acquire();
            });
            let joining = Flag::new();
            let b_joining = joining.clone();
            let b = exec.spawn(move || {
                b_joining.set();
                a.join().is_ok()
            });
            while !(asleep.is_set() && joining.is_set()) {
                std::thread::yield_now();
            }
            // The drain completes 'a' (cancelled), which wakes 'b', maybe
            // after 'b's worker has drained for the last time.
            drop(exec);
            stage.set(format!("round {round}: joining 'b' after the drop"));
            match b.join() {
                Ok(a_ok) => assert!(!a_ok, "'a' cannot have finished"),
                Err(e) => assert!(e.is_cancelled(), "{e}"),
            }
            // Every task is counted as completed, including one completed
            // for a fiber woken into a closed inbox.
            let stats = handle.stats();
            assert_eq!((stats.spawned, stats.completed), (2, 2), "{stats:?}");
        }
    });
}

/// Shutdown interrupts a fiber in an interruptible wait: the wait returns
/// `Interrupted`, the fiber unwinds at its next cancellation point (its
/// locals dropped), and its join reports the cancel.
#[test]
fn drop_interrupts_fibers_in_interruptible_waits() {
    use spindle_sync::Channel;
    watchdog("drop_interrupts_fibers_in_interruptible_waits", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let chan = Arc::new(Channel::<u32>::new());
        let (dropped, interrupted) = (Flag::new(), Flag::new());
        let h = {
            let (chan, guard, interrupted) = (Arc::clone(&chan), dropped.on_drop(), interrupted.clone());
            exec.spawn(move || {
                let _local = guard;
                if chan.pop_interruptible().is_err() {
                    interrupted.set();
                }
                yield_now(); // a cancellation point
            })
        };
        wait_for(&stage, "the fiber to wait", || chan.receivers() == 1);
        drop(exec);
        assert!(h.join().is_err_and(|e| e.is_cancelled()));
        assert!(interrupted.is_set(), "the wait returned Interrupted");
        assert!(dropped.is_set(), "the fiber was unwound, its locals dropped");
        assert_eq!(chan.receivers(), 0);
    });
}

/// A fiber waiting in a scope for scoped fibers asleep in `sleep`, at
/// shutdown: the scoped fibers are cancelled, and so is the scope's owner,
/// whose join says `Cancelled` (it said the fiber panicked, with a panic
/// report, because the scope found cancelled fibers nobody joined).
#[test]
fn a_fiber_waiting_in_a_scope_at_shutdown_is_cancelled() {
    watchdog("a_fiber_waiting_in_a_scope_at_shutdown_is_cancelled", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let asleep = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let owner = {
            let asleep = asleep.clone();
            exec.spawn(move || {
                let data = [1, 2, 3];
                spindle_executor::Handle::current().unwrap().scope(|s| {
                    for x in &data {
                        let asleep = asleep.clone();
                        s.spawn(move || {
                            asleep.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            sleep(Duration::from_secs(60));
                            *x
                        });
                    }
                });
                0
            })
        };
        wait_for(&stage, "the scoped fibers to sleep", || {
            asleep.load(std::sync::atomic::Ordering::SeqCst) == 3
        });
        stage.set("dropping the executor, then joining the scope's owner");
        let joiner = std::thread::spawn(move || owner.join());
        drop(exec);
        let err = joiner.join().unwrap().expect_err("the owner was shut down");
        assert!(err.is_cancelled(), "the scope's owner ends as cancelled, not: {err}");
    });
}

/// A fiber asleep in `join` at shutdown, whose joined task (asleep in a
/// plain wait nobody ends) sits on another worker (in most rounds, with
/// two workers and stealing): that worker's drain
/// completes the task as cancelled and wakes the joiner, and the joiner is
/// unwound on its own worker, its destructors run, before the drop
/// returns. Each worker used to close its inbox as soon as it was empty,
/// so a joiner woken after its own worker closed was leaked (its
/// destructors never ran): most rounds with two workers.
#[test]
fn a_joiner_woken_by_another_workers_drain_is_unwound_on_its_own() {
    watchdog("a_joiner_woken_by_another_workers_drain_is_unwound_on_its_own", 60, |stage| {
        // Rounds whose joiner was unwound by a drain (its destructors see
        // `may_sleep()` false), not cancelled at its join before it slept.
        let by_drain = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for round in 0..common::size(20, 40) {
            stage.set(format!("round {round}: a joiner and the task it joins, asleep at shutdown"));
            let exec = Executor::builder().workers(2).max_workers(2).build();
            let never = Arc::new(Semaphore::new(0));
            let (asleep, dropped) = (Arc::new(Semaphore::new(0)), Flag::new());
            let (n, a) = (never.clone(), asleep.clone());
            let t = exec.spawn(move || {
                a.release(1);
                n.acquire();
            });
            struct SetsOnDrop(Flag, Arc<std::sync::atomic::AtomicUsize>);
            impl Drop for SetsOnDrop {
                fn drop(&mut self) {
                    if !spindle_fiber::may_sleep() {
                        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    self.0.set();
                }
            }
            let (d, b, a) = (dropped.clone(), by_drain.clone(), asleep.clone());
            let j = exec.spawn(move || {
                let _guard = SetsOnDrop(d, b);
                a.release(1);
                let _ = t.join();
            });
            asleep.acquire();
            asleep.acquire();
            stage.set(format!("round {round}: dropping the executor"));
            drop(exec);
            assert!(j.join().expect_err("shut down").is_cancelled());
            assert!(
                dropped.is_set(),
                "round {round}: the joiner's destructors did not run (its stack leaked)"
            );
            drop(never);
        }
        assert!(
            by_drain.load(std::sync::atomic::Ordering::SeqCst) > 0,
            "no round's joiner was unwound by a drain (each was cancelled before it slept)"
        );
    });
}

/// A fiber a task drives by hand, dropped while suspended on a worker
/// thread with no shutdown under way: a timed wait in its destructor
/// sleeps the thread, as on any thread. (From a review: the fix for the
/// final drain made it return at once there too.)
#[test]
fn a_destructor_that_sleeps_in_a_fiber_dropped_by_a_task_sleeps() {
    use spindle_fiber::{Fiber, FiberAttr, RunOutcome};
    watchdog("a_destructor_that_sleeps_in_a_fiber_dropped_by_a_task_sleeps", 30, |_stage| {
        struct SleepsOnDrop(Arc<std::sync::Mutex<Option<(Duration, bool)>>>);
        impl Drop for SleepsOnDrop {
            fn drop(&mut self) {
                let t = std::time::Instant::now();
                sleep(Duration::from_millis(20));
                let slept = t.elapsed();
                let timed_out = yield_timeout(Duration::from_millis(1));
                *self.0.lock().unwrap() = Some((slept, timed_out));
            }
        }
        let exec = Executor::builder().workers(1).build();
        let (slept, timed_out) = exec
            .block_on(|| {
                let out = Arc::new(std::sync::Mutex::new(None));
                let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
                let guard = SleepsOnDrop(out.clone());
                fiber
                    .set_function(Priority::NORMAL, move || {
                        let _guard = guard;
                        spindle_fiber::yield_now();
                    })
                    .unwrap();
                assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(_))));
                drop(fiber); // unwound here, on the worker
                let got = out.lock().unwrap().take();
                got.expect("the destructor ran")
            })
            .unwrap();
        assert!(slept >= Duration::from_millis(20), "sleep(20 ms) returned after {slept:?}");
        assert!(timed_out, "yield_timeout ran out: nothing woke it");
    });
}

/// After a shutdown, a stale waiter's wake (refused) and a release at the
/// same time, many rounds: the token always ends up in the count, not
/// with the fiber nobody runs. (From a review: it stayed with the fiber in
/// most rounds when the two overlapped.)
#[test]
fn a_release_racing_a_stale_wake_after_shutdown_keeps_the_token() {
    use std::sync::atomic::{AtomicBool, Ordering};
    watchdog("a_release_racing_a_stale_wake_after_shutdown_keeps_the_token", 120, |stage| {
        for round in 0..200 {
            stage.set(format!("round {round}"));
            let (sem, waiter) = asleep_at_shutdown_with_a_waiter(&stage, 1);
            let (ready, go) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
            let (r, g) = (ready.clone(), go.clone());
            let t = std::thread::spawn(move || {
                r.store(true, Ordering::Release);
                while !g.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                waiter.wake();
            });
            while !ready.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            go.store(true, Ordering::Release);
            sem.release(1);
            t.join().unwrap();
            assert_eq!(sem.available(), 1, "round {round}: the token stayed with the shut-down fiber");
        }
    });
}

/// A fiber woken for nothing during the final drain (a destructor of a
/// fiber the drain unwinds wakes it with a kept waiter) is abandoned with
/// the rest: the token a release hands it after shutdown comes back to the
/// count. (From a review: the drain dropped it `Ready` and unmarked, and
/// the token went down with its leaked stack.)
#[test]
fn a_fiber_woken_for_nothing_during_the_final_drain_hands_back_a_later_token() {
    use std::sync::atomic::{AtomicBool, Ordering};
    struct WakeOnDrop(Option<Waiter>, Arc<AtomicBool>);
    impl Drop for WakeOnDrop {
        fn drop(&mut self) {
            if let Some(w) = self.0.take() {
                w.wake();
                self.1.store(true, Ordering::SeqCst);
            }
        }
    }
    watchdog("a_fiber_woken_for_nothing_during_the_final_drain_hands_back_a_later_token", 60, |stage| {
        let exec = Executor::builder().workers(1).build();
        let sem = Arc::new(Semaphore::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let asleep = {
            let sem = Arc::clone(&sem);
            exec.spawn(move || {
                tx.send(Waiter::current().unwrap()).unwrap();
                sem.acquire()
            })
        };
        let stale = rx.recv().unwrap();
        wait_for(&stage, "the fiber to wait on the semaphore", || sem.waiters() == 1);
        // Asleep for good with no waiter published: the drain unwinds it
        // on the worker, and its destructor wakes the first fiber.
        let (fired, started) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let waker = {
            let (fired, started) = (fired.clone(), started.clone());
            exec.spawn(move || {
                let _g = WakeOnDrop(Some(stale), fired);
                started.store(true, Ordering::SeqCst);
                loop {
                    spindle_fiber::sleep();
                }
            })
        };
        wait_for(&stage, "the waking fiber to start", || started.load(Ordering::SeqCst));
        stage.set("dropping the executor");
        drop(exec);
        assert!(asleep.join().is_err() && waker.join().is_err());
        assert!(fired.load(Ordering::SeqCst), "the destructor woke the fiber during the drain");
        assert_eq!(sem.waiters(), 1, "still in its wait");
        stage.set("releasing one token after shutdown");
        sem.release(1);
        assert_eq!((sem.available(), sem.waiters()), (1, 0), "the token came back to the count");
    });
}

/// The name of the worker thread the caller runs on, as an index.
fn worker_index() -> Option<usize> {
    std::thread::current().name()?.strip_prefix("spindle-worker-")?.parse().ok()
}

/// Spawns `f` so that it starts on worker `want`: spawns until a job
/// starts there (a started fiber stays on its worker).
fn spawn_on<T: Send + 'static>(
    exec: &Executor,
    want: usize,
    f: impl FnOnce() -> T + Send + 'static,
) -> spindle_executor::JoinHandle<Option<T>> {
    let f = Arc::new(std::sync::Mutex::new(Some(f)));
    loop {
        let (f2, (tx, rx)) = (f.clone(), std::sync::mpsc::channel());
        let h = exec.spawn(move || {
            if worker_index() != Some(want) {
                tx.send(false).unwrap();
                return None;
            }
            let f = f2.lock().unwrap().take().unwrap();
            tx.send(true).unwrap();
            Some(f())
        });
        if rx.recv().unwrap() {
            return h;
        }
        let _ = h.join();
    }
}

/// The final drain completes every task it collected before it drops (and
/// so unwinds) any of their fibers: a destructor of one that joins another
/// task of the same worker finds it completed. (From a review: worker 0's
/// drain woke a fiber asleep in `join` into worker 1's inbox; worker 1's
/// drain unwound it first, and its destructor's join of a sibling that only
/// that drain would complete blocked the worker for good: the executor's
/// drop hung in most rounds.)
#[test]
fn a_destructor_joining_a_sibling_during_the_final_drain_returns() {
    struct JoinsOnDrop(Option<spindle_executor::JoinHandle<Option<()>>>);
    impl Drop for JoinsOnDrop {
        fn drop(&mut self) {
            let _ = self.0.take().unwrap().join();
        }
    }
    watchdog("a_destructor_joining_a_sibling_during_the_final_drain_returns", 120, |stage| {
        for round in 0..30 {
            stage.set(format!("round {round}: setting up"));
            let exec = Executor::builder().workers(2).max_workers(2).build();
            let (s1, s2) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
            // C on worker 0 and B on worker 1, asleep on semaphores nobody releases.
            let c = {
                let s1 = s1.clone();
                spawn_on(&exec, 0, move || s1.acquire())
            };
            let b = {
                let s2 = s2.clone();
                spawn_on(&exec, 1, move || s2.acquire())
            };
            // A on worker 1: asleep in a join on C, with a guard that joins B.
            let joining = Flag::new();
            let _a = {
                let (joining, guard) = (joining.clone(), JoinsOnDrop(Some(b)));
                spawn_on(&exec, 1, move || {
                    let _guard = guard;
                    joining.set();
                    let _ = c.join();
                })
            };
            wait_for(&stage, "B and C asleep, A in its join", || {
                s1.waiters() == 1 && s2.waiters() == 1 && joining.is_set()
            });
            // Something else ran on worker 1 after A set its flag: A is asleep.
            let _ = spawn_on(&exec, 1, || ()).join();
            stage.set(format!("round {round}: dropping the executor (A's guard joins B in the drain)"));
            drop(exec);
        }
    });
}

/// A fiber left asleep in a plain wait at shutdown and woken later by a
/// thread-local destructor of its worker's thread is unwound there, after
/// the worker's loop: a destructor of it that sleeps returns at once, as in
/// the final drain, rather than keep the thread (and so the executor's
/// drop, which joins it) waiting. (From a review: `sleep(Duration::MAX)`
/// there hung the drop.)
#[test]
fn a_destructor_that_sleeps_after_its_workers_loop_returns() {
    struct ReleasesOnDrop(Arc<Semaphore>);
    impl Drop for ReleasesOnDrop {
        fn drop(&mut self) {
            self.0.release(1);
        }
    }
    thread_local! {
        static RELEASER: std::cell::RefCell<Option<ReleasesOnDrop>> = const { std::cell::RefCell::new(None) };
    }
    struct SleepsOnDrop(Flag);
    impl Drop for SleepsOnDrop {
        fn drop(&mut self) {
            sleep(Duration::MAX);
            assert!(!yield_timeout(Duration::MAX), "not woken: shut down");
            self.0.set();
        }
    }
    watchdog("a_destructor_that_sleeps_after_its_workers_loop_returns", 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let sem = Arc::new(Semaphore::new(0));
        let dropped = Flag::new();
        let task = {
            let (sem, guard) = (sem.clone(), SleepsOnDrop(dropped.clone()));
            exec.spawn(move || {
                RELEASER.with(|r| *r.borrow_mut() = Some(ReleasesOnDrop(sem.clone())));
                let _guard = guard;
                sem.acquire(); // a plain wait: the shutdown leaves the fiber asleep here
            })
        };
        wait_for(&stage, "the fiber to wait on the semaphore", || sem.waiters() == 1);
        stage.set("dropping the executor: the worker thread's exit wakes and unwinds the fiber");
        drop(exec);
        assert!(task.join().expect_err("no value").is_cancelled());
        assert!(dropped.is_set(), "the destructor ran to its end");
    });
}

/// Once the executor has shut down, its stats say no worker is active
/// (they kept the count from before the shutdown).
#[test]
fn no_worker_is_active_after_the_drop() {
    watchdog("no_worker_is_active_after_the_drop", 30, |_stage| {
        let exec = Executor::builder().workers(3).build();
        let handle = exec.handle();
        assert_eq!(handle.stats().workers, 3);
        drop(exec);
        let stats = handle.stats();
        assert_eq!(stats.workers, 0, "{stats:?}");
        assert_eq!(stats.peak_workers, 3, "{stats:?}");
    });
}

/// Joins a task when dropped.
struct JoinsOnDrop(Option<spindle_executor::JoinHandle<()>>);

impl Drop for JoinsOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

/// A fiber run by hand on a worker and dropped while it sleeps in a join:
/// its wait holds its last reference, so the wake that completes the task
/// it joins releases (unwinds) it, and its destructor joins `on_drop`.
fn hand_run_joiner(joins: spindle_executor::JoinHandle<()>, on_drop: spindle_executor::JoinHandle<()>) {
    let j = spindle_fiber::Fiber::<()>::new(spindle_fiber::FiberAttr::new().stack_size(64 * 1024)).unwrap();
    j.set_function(spindle_fiber::Priority::NORMAL, move || {
        let _g = JoinsOnDrop(Some(on_drop));
        let _ = joins.join();
    })
    .unwrap();
    assert!(matches!(j.run(), Ok(spindle_fiber::RunOutcome::Slept)));
    drop(j);
}

/// The final drain completes the tasks asleep at shutdown one by one; a
/// completion whose wake releases a joiner nobody else holds unwinds it
/// only once the batch is completed, so its destructor's join of another
/// task of the batch returns. (Found in review: it was unwound inside the
/// first completion and waited for the second for ever; the executor's
/// drop hung.) One pair of joiners per completion order.
#[test]
fn a_joiner_released_by_the_drain_joins_another_drained_task() {
    watchdog("a_joiner_released_by_the_drain_joins_another_drained_task", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let block = Arc::new(spindle_sync::Semaphore::new(0));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let b = block.clone();
                exec.spawn(move || b.acquire())
            })
            .collect();
        wait_for(&stage, "the four tasks to sleep", || block.waiters() == 4);
        let mut tasks = tasks.into_iter();
        let (t1, t2, t3, t4) =
            (tasks.next().unwrap(), tasks.next().unwrap(), tasks.next().unwrap(), tasks.next().unwrap());
        exec.spawn(move || {
            hand_run_joiner(t1, t2);
            hand_run_joiner(t4, t3);
        })
        .join()
        .unwrap();
        stage.set("dropping the executor: the drain completes the four tasks");
        drop(exec);
    });
}

/// A cancelled fiber whose destructor joins a task that only the final
/// drain completes (asleep in a plain wait nobody signals) sleeps in that
/// join during its cancel unwind. The drain completes the joined task,
/// which wakes the joiner, and then runs it to the end of its unwind
/// instead of dropping it: dropped, it could not be unwound (a second
/// unwind from inside a destructor running during cleanup aborts the
/// process), so its stack was leaked and the rest of its destructors never
/// ran. (Found by the randomized shutdown stress test, seed 66; before
/// that it aborted the process.) With one worker and with two, where the
/// joined task's completion wakes the joiner into another worker's inbox.
#[test]
fn a_destructor_joining_during_the_cancel_unwind_finishes_its_unwind_in_the_final_drain() {
    struct JoinsOnDrop(Option<spindle_executor::JoinHandle<Option<()>>>, Flag);
    impl Drop for JoinsOnDrop {
        fn drop(&mut self) {
            let joined = self.0.take().unwrap().join();
            assert!(
                matches!(joined, Err(spindle_executor::JoinError::Cancelled { .. })),
                "the joined task is completed as cancelled: {joined:?}"
            );
            self.1.set();
        }
    }
    watchdog(
        "a_destructor_joining_during_the_cancel_unwind_finishes_its_unwind_in_the_final_drain",
        120,
        |stage| {
            for (round, (workers, stuck_on, joiner_on)) in
                [(1, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)].into_iter().cycle().take(12).enumerate()
            {
                stage.set(format!("round {round}: {workers} workers, setting up"));
                let exec = Executor::builder().workers(workers).max_workers(workers).build();
                let stuck = Arc::new(Semaphore::new(0));
                let a = {
                    let stuck = stuck.clone();
                    spawn_on(&exec, stuck_on, move || stuck.acquire())
                };
                let (asleep, joined, unwound) = (Flag::new(), Flag::new(), Flag::new());
                let c = {
                    let guard = JoinsOnDrop(Some(a), joined.clone());
                    let (asleep, unwound) = (asleep.clone(), unwound.on_drop());
                    spawn_on(&exec, joiner_on, move || {
                        // Dropped last: the unwind went past the guard's join.
                        let _unwound = unwound;
                        let _guard = guard;
                        asleep.set();
                        sleep(Duration::MAX);
                    })
                };
                wait_for(&stage, "A asleep on the semaphore, C about to sleep", || {
                    stuck.waiters() == 1 && asleep.is_set()
                });
                stage.set(format!("round {round}: dropping the executor (C's guard joins A in its unwind)"));
                drop(exec);
                assert!(joined.is_set(), "round {round}: the guard's join returned");
                assert!(unwound.is_set(), "round {round}: C's unwind went on past the guard");
                assert!(matches!(c.join(), Err(spindle_executor::JoinError::Cancelled { .. })));
            }
        },
    );
}

/// A fiber driven by hand inside a task, whose destructor joins a task
/// that only the final drain completes (asleep in a plain wait nobody
/// signals), is dropped (so unwound, unable to suspend) by its owner's
/// cancel unwind at shutdown. Its join cannot sleep, and waiting as a
/// thread would block the worker that shutdown needs: the join returns
/// `Cancelled` at once (shutdown cancels the joined task). Before, the
/// executor's drop hung, with one worker and with two. (Found by the
/// randomized shutdown stress test, seed 3051.)
#[test]
fn a_join_in_a_dropped_hand_run_fiber_during_shutdown_does_not_block_the_worker() {
    struct JoinsOnDrop(Option<spindle_executor::JoinHandle<()>>, Flag);
    impl Drop for JoinsOnDrop {
        fn drop(&mut self) {
            let joined = self.0.take().unwrap().join();
            assert!(
                matches!(joined, Err(spindle_executor::JoinError::Cancelled { .. })),
                "the joined task is cancelled by the shutdown: {joined:?}"
            );
            self.1.set();
        }
    }
    watchdog("a_join_in_a_dropped_hand_run_fiber_during_shutdown_does_not_block_the_worker", 120, |stage| {
        for (round, workers) in [1, 2].into_iter().cycle().take(8).enumerate() {
            stage.set(format!("round {round}: {workers} workers, setting up"));
            let exec = Executor::builder().workers(workers).max_workers(workers).build();
            let stuck = Arc::new(Semaphore::new(0));
            let s = {
                let stuck = stuck.clone();
                exec.spawn(move || stuck.acquire())
            };
            let (ran, joined) = (Flag::new(), Flag::new());
            let t = {
                let (ran, guard) = (ran.clone(), JoinsOnDrop(Some(s), joined.clone()));
                exec.spawn(move || {
                    let f = spindle_fiber::Fiber::<()>::new(spindle_fiber::FiberAttr::new()).unwrap();
                    f.set_function(Priority::NORMAL, move || {
                        let _guard = guard;
                        spindle_fiber::yield_now();
                    })
                    .unwrap();
                    assert!(matches!(f.run(), Ok(spindle_fiber::RunOutcome::Yielded(_))));
                    ran.set();
                    // Cancelled by the shutdown: the unwind drops `f`.
                    sleep(Duration::MAX);
                })
            };
            wait_for(&stage, "S asleep on the semaphore, the hand-run fiber suspended", || {
                stuck.waiters() == 1 && ran.is_set()
            });
            stage.set(format!("round {round}: dropping the executor (the dropped fiber's guard joins S)"));
            drop(exec);
            assert!(joined.is_set(), "round {round}: the guard's join returned");
            assert!(matches!(t.join(), Err(spindle_executor::JoinError::Cancelled { .. })));
        }
    });
}

/// On one worker, a fiber whose destructor joins during a panic's unwind
/// leaves the thread panicking (std counts panics per thread); a second
/// fiber that then sleeps in a join looks, to spindle-fiber, as if it had
/// gone to sleep mid-unwind, and dropping it would leak it. Both joins
/// wait for tasks asleep in plain waits that only the final drain
/// completes. The drain runs both to the end: the first finishes its
/// unwind, the second unwinds as cancelled at its join (not in the
/// `sleep` after it, which, run without its task, slept the worker
/// thread: seed 81 of the randomized shutdown stress test).
#[test]
fn a_fiber_that_slept_while_another_was_stuck_mid_unwind_is_unwound_in_the_final_drain() {
    struct JoinsOnDrop(Option<spindle_executor::JoinHandle<()>>);
    impl Drop for JoinsOnDrop {
        fn drop(&mut self) {
            let _ = self.0.take().unwrap().join();
        }
    }
    watchdog(
        "a_fiber_that_slept_while_another_was_stuck_mid_unwind_is_unwound_in_the_final_drain",
        120,
        |stage| {
            for round in 0..5 {
                stage.set(format!("round {round}: setting up"));
                let exec = Executor::builder().workers(1).max_workers(1).build();
                let stuck = Arc::new(Semaphore::new(0));
                let stuck_task = || {
                    let stuck = stuck.clone();
                    exec.spawn(move || stuck.acquire())
                };
                let (a1, a2) = (stuck_task(), stuck_task());
                let (c_unwound, b_unwound, b_slept) = (Flag::new(), Flag::new(), Flag::new());
                let c = {
                    let (guard, unwound) = (JoinsOnDrop(Some(a1)), c_unwound.on_drop());
                    exec.spawn(move || {
                        let _unwound = unwound;
                        let _guard = guard;
                        panic!("a panic whose unwind joins a task that never finishes");
                    })
                };
                let b = {
                    let (unwound, slept) = (b_unwound.on_drop(), b_slept.clone());
                    exec.spawn(move || {
                        let _unwound = unwound;
                        slept.set();
                        let _ = a2.join();
                        sleep(Duration::from_secs(3600));
                    })
                };
                wait_for(&stage, "both stuck tasks asleep, B in its join", || {
                    stuck.waiters() == 2 && b_slept.is_set()
                });
                stage.set(format!("round {round}: dropping the executor"));
                drop(exec);
                assert!(c_unwound.is_set(), "round {round}: C's unwind went on past its guard's join");
                assert!(b_unwound.is_set(), "round {round}: B was unwound");
                // The drain completes both tasks (as cancelled) before it
                // runs their fibers on: a joiner cannot wait for a fiber
                // that may never be woken.
                assert!(matches!(c.join(), Err(spindle_executor::JoinError::Cancelled { .. })));
                assert!(matches!(b.join(), Err(spindle_executor::JoinError::Cancelled { .. })));
            }
        },
    );
}

/// In the final drain, a fiber whose destructor yields (the executor's
/// `yield_now`) during its cancel unwind until another fiber of its worker
/// has been dropped is run once per pass, not in a loop: the rest of the
/// pass drops that other fiber (whose task the drain took), its
/// destructor sets the flag, and the yielding fiber's unwind finishes.
/// (Found in review: the first version ran such a fiber again and again
/// before the rest of the pass, and the executor's drop never returned.)
#[test]
fn a_destructor_yielding_in_the_drain_until_another_fiber_is_dropped_finishes() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Mutex;
    struct JoinsOnDrop(Option<spindle_executor::JoinHandle<()>>);
    impl Drop for JoinsOnDrop {
        fn drop(&mut self) {
            let _ = self.0.take().unwrap().join();
        }
    }
    /// Yields until the flag is set.
    struct YieldsUntil(Arc<AtomicBool>);
    impl Drop for YieldsUntil {
        fn drop(&mut self) {
            while !self.0.load(SeqCst) {
                yield_now();
            }
        }
    }
    struct WakesG(Arc<Mutex<Option<Waiter>>>);
    impl Drop for WakesG {
        fn drop(&mut self) {
            if let Some(w) = self.0.lock().unwrap().take() {
                w.wake();
            }
        }
    }
    struct Sets(Arc<AtomicBool>);
    impl Drop for Sets {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
        }
    }
    watchdog("a_destructor_yielding_in_the_drain_until_another_fiber_is_dropped_finishes", 60, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let stuck = Arc::new(Semaphore::new(0));
        let a = {
            let stuck = stuck.clone();
            exec.spawn(move || stuck.acquire())
        };
        let flag = Arc::new(AtomicBool::new(false));
        let g_waiter: Arc<Mutex<Option<Waiter>>> = Arc::new(Mutex::new(None));
        // G: asleep in a bare `spindle_fiber::sleep` (a wait the shutdown
        // does not interrupt) before anything is stuck mid-unwind.
        let (g_asleep, g_unwound) = (Flag::new(), Flag::new());
        let g = {
            let (flag, gw, asleep, unwound) =
                (flag.clone(), g_waiter.clone(), g_asleep.clone(), g_unwound.on_drop());
            exec.spawn(move || {
                let _unwound = unwound;
                let _sets = Sets(flag);
                loop {
                    *gw.lock().unwrap() = Some(Waiter::current().unwrap());
                    asleep.set();
                    spindle_fiber::sleep();
                    if gw.lock().unwrap().is_none() {
                        break; // woken by `WakesG`, not spuriously
                    }
                }
                sleep(Duration::MAX);
            })
        };
        let j = exec.spawn(|| sleep(Duration::MAX));
        // F: cancelled by the shutdown in its join of J; its unwind joins
        // the stuck task A (the drain completes it), then wakes G, then
        // yields until G's destructor has run.
        let (f_asleep, f_unwound) = (Flag::new(), Flag::new());
        let f = {
            let (flag, asleep, gw, unwound) =
                (flag.clone(), f_asleep.clone(), g_waiter.clone(), f_unwound.on_drop());
            exec.spawn(move || {
                let _unwound = unwound;
                let _yields = YieldsUntil(flag);
                let _wakes_g = WakesG(gw);
                let _joins = JoinsOnDrop(Some(a));
                asleep.set();
                let _ = j.join();
            })
        };
        wait_for(&stage, "A, F and G asleep", || {
            stuck.waiters() == 1 && f_asleep.is_set() && g_asleep.is_set()
        });
        // Something else ran on the one worker since: F and G switched out.
        let _ = exec.spawn(|| ()).join();
        stage.set("dropping the executor");
        drop(exec);
        assert!(g_unwound.is_set(), "G was unwound");
        assert!(f_unwound.is_set(), "F's unwind finished");
        assert!(f.join().is_err() && g.join().is_err());
    });
}

/// A fiber whose panic payload's `Drop` panics, finished by the final
/// drain after its task was completed early (a destructor of its panic's
/// unwind joined a task asleep in a plain wait): the outcome is dropped
/// contained, as the task's own drop contains what it holds, so the
/// worker goes on and a fiber joining the first one is unwound too.
/// (Found in review: the payload was dropped uncontained and the panic
/// killed the worker thread in its drain.)
#[test]
fn a_panicking_payload_of_a_fiber_finished_in_the_drain_is_contained() {
    struct JoinsOnDrop(Option<spindle_executor::JoinHandle<()>>);
    impl Drop for JoinsOnDrop {
        fn drop(&mut self) {
            let _ = self.0.take().unwrap().join();
        }
    }
    struct PanicsOnDrop;
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                panic!("the payload's drop panics");
            }
        }
    }
    watchdog("a_panicking_payload_of_a_fiber_finished_in_the_drain_is_contained", 60, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();
        let stuck = Arc::new(Semaphore::new(0));
        let a = {
            let stuck = stuck.clone();
            exec.spawn(move || stuck.acquire())
        };
        let c_unwound = Flag::new();
        let c = {
            let unwound = c_unwound.on_drop();
            exec.spawn(move || {
                let _unwound = unwound;
                let _joins = JoinsOnDrop(Some(a));
                std::panic::panic_any(PanicsOnDrop);
            })
        };
        let (d_unwound, d_joining) = (Flag::new(), Flag::new());
        let d = {
            let (unwound, joining) = (d_unwound.on_drop(), d_joining.clone());
            exec.spawn(move || {
                let _unwound = unwound;
                joining.set();
                let _ = c.join();
                sleep(Duration::MAX);
            })
        };
        wait_for(&stage, "A asleep, D joining C", || stuck.waiters() == 1 && d_joining.is_set());
        let _ = exec.spawn(|| ()).join();
        stage.set("dropping the executor");
        drop(exec);
        assert!(c_unwound.is_set(), "C's unwind finished");
        assert!(d_unwound.is_set(), "D was unwound: the worker survived the payload's drop");
        assert!(matches!(d.join(), Err(spindle_executor::JoinError::Cancelled { .. })));
    });
}

/// Two executors, each dropped inside a fiber of the other: A's fiber
/// drops B, whose shutdown unwinds B's fiber holding the last `Executor`
/// A. Each shutdown ran on the other's only worker and waited for the
/// other's worker to go quiet, for good (found in review). A drop on any
/// executor's worker now hands the shutdown to a thread of its own.
#[test]
fn executors_dropped_inside_each_others_fibers_shut_down() {
    watchdog("executors_dropped_inside_each_others_fibers_shut_down", 60, |stage| {
        let a = Executor::builder().workers(1).max_workers(1).build();
        let b = Executor::builder().workers(1).max_workers(1).build();
        let ha = a.handle();
        let started = Flag::new();
        let s = started.clone();
        // B's fiber owns A; B's shutdown unwinds it (sleep is a
        // cancellation point), which drops A on B's worker.
        let b_fiber = b.spawn(move || {
            let _a = a;
            s.set();
            sleep(Duration::from_secs(600));
        });
        wait_for(&stage, "B's fiber to hold A", || started.is_set());
        stage.set("a fiber of A drops B");
        let dropper = ha.spawn(move || {
            drop(b);
            1u8
        });
        assert_eq!(dropper.join().unwrap(), 1);
        stage.set("B's fiber is cancelled");
        assert!(b_fiber.join().unwrap_err().is_cancelled());
    });
}

/// An executor dropped inside one of its own fibers refuses spawns from
/// the moment `drop` returns, as the docs say of a dropped executor (the
/// shutdown thread set the flag a little later, and spawns in between ran:
/// found in review, 165 of 200 rounds).
#[test]
fn spawns_after_an_in_fiber_drop_are_cancelled() {
    watchdog("spawns_after_an_in_fiber_drop_are_cancelled", 60, |stage| {
        for round in 0..50 {
            stage.set(format!("round {round}"));
            let exec = Executor::builder().workers(1).build();
            let handle = exec.handle();
            let slot = Arc::new(parking_lot::Mutex::new(Some(exec)));
            let (s, h) = (slot.clone(), handle.clone());
            let ran = Flag::new();
            let r = ran.clone();
            let dropper = handle.spawn(move || {
                drop(s.lock().take());
                h.spawn(move || r.set()).join().map_err(|e| e.is_cancelled())
            });
            match dropper.join() {
                Ok(late) => assert_eq!(late, Err(true), "round {round}: the late spawn's join"),
                // Cancelled itself first (the shutdown is under way).
                Err(e) => assert!(e.is_cancelled(), "round {round}: {e:?}"),
            }
            assert!(!ran.is_set(), "round {round}: a spawn made after the drop ran");
        }
    });
}

/// A fiber run by hand inside a task sleeps in a join, is let go of, and
/// is woken on the only worker during the shutdown: its destructor then
/// waits for a task that only that worker's final drain can complete.
/// `join` returns `Cancelled` at once there; `wait_timeout` waited for the
/// whole timeout and held the shutdown (found in review).
#[test]
fn a_wait_in_a_destructor_on_a_shutting_down_worker_does_not_hold_the_shutdown() {
    use spindle_executor::JoinHandle;
    use spindle_fiber::{Fiber, FiberAttr, RunOutcome};
    for use_wait_timeout in [false, true] {
        let name = "a_wait_in_a_destructor_on_a_shutting_down_worker_does_not_hold_the_shutdown";
        watchdog(name, 60, move |stage| {
            let exec = Executor::builder().workers(1).max_workers(1).build();
            let gate = Arc::new(Semaphore::new(0));
            let g = gate.clone();
            let t2: JoinHandle<()> = exec.spawn(move || g.acquire());
            let t1 = exec.spawn(|| sleep(Duration::from_secs(600)));
            let waited = Flag::new();
            struct WaitsInDrop(Option<JoinHandle<()>>, Flag, bool);
            impl Drop for WaitsInDrop {
                fn drop(&mut self) {
                    let h = self.0.take().unwrap();
                    if self.2 {
                        assert!(!h.wait_timeout(Duration::from_secs(3600)));
                    } else {
                        assert!(h.join().unwrap_err().is_cancelled());
                    }
                    self.1.set();
                }
            }
            let (w, asleep) = (waited.clone(), Flag::new());
            let a = asleep.clone();
            exec.spawn(move || {
                let hand = Fiber::<()>::new(FiberAttr::new().name("hand")).unwrap();
                hand.set_function(Priority::NORMAL, move || {
                    let _w = WaitsInDrop(Some(t2), w, use_wait_timeout);
                    let _ = t1.join();
                })
                .unwrap();
                assert!(matches!(hand.run(), Ok(RunOutcome::Slept)));
                a.set();
            })
            .join()
            .unwrap();
            assert!(asleep.is_set());
            wait_for(&stage, "T2 at its gate", || gate.waiters() == 1);
            stage.set(format!("dropping the executor (wait_timeout: {use_wait_timeout})"));
            drop(exec);
            assert!(waited.is_set(), "the destructor's wait returned");
        });
    }
}
