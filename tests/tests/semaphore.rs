//! The semaphore on one thread: fibers sleep when there is no token, are
//! woken onto their run queue in FIFO order, and take the token handed to
//! them.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{fiber, named_fiber, sleepers_on, spin_until, watchdog, PanicsInSchedule};
use spindle_fiber::{Fiber, FiberError, FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::Semaphore;

/// The flow: `try_acquire` on zero tokens fails; a fiber acquiring
/// sleeps; running it while it sleeps is an error; `release(1)` wakes it
/// onto its run queue and it holds the token.
#[test]
fn a_fiber_sleeps_on_an_empty_semaphore_and_release_wakes_it() {
    watchdog("a_fiber_sleeps_on_an_empty_semaphore_and_release_wakes_it", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        assert!(!sem.try_acquire());
        assert_eq!((sem.available(), sem.waiters()), (0, 0));

        let queue = RunQueue::<&'static str>::new(4);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            s.acquire();
            "acquired"
        });
        queue.try_push(f.clone()).unwrap();

        stage.set("first run: the fiber should go to sleep");
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "{:?}", ran.outcome);
        assert_eq!(f.state(), FiberState::Sleeping);
        assert!(queue.is_empty(), "a sleeping fiber is not in the run queue");
        assert_eq!(sem.waiters(), 1);
        assert_eq!(f.stats().sleeps, 1);

        match f.run() {
            Err(FiberError::Sleeping(id)) => assert_eq!(id, f.id()),
            other => panic!("running a sleeping fiber gave {other:?}"),
        }
        assert_eq!(f.state(), FiberState::Sleeping, "the refused run changed nothing");

        sem.release(1);
        assert_eq!(f.state(), FiberState::Queued);
        assert_eq!(queue.len(), 1, "the wake pushed the fiber back on its queue");
        assert_eq!(queue.stats().wakes, 1);
        assert_eq!(sem.waiters(), 0);
        assert_eq!(sem.available(), 0, "the token went to the waiter, not to the pool");

        stage.set("second run: the woken fiber should return");
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Returned("acquired"))));
        assert!(Fiber::ptr_eq(&ran.fiber, &f));
        assert!(queue.is_empty());
        assert!(!sem.try_acquire(), "no token is left over");
    });
}

/// Available tokens are taken without sleeping.
#[test]
fn available_tokens_are_taken_without_sleeping() {
    watchdog("available_tokens_are_taken_without_sleeping", 30, |_stage| {
        let sem = Arc::new(Semaphore::new(0));
        sem.release(2);
        assert_eq!(sem.available(), 2);
        let queue = RunQueue::<u32>::new(4);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            s.acquire();
            s.acquire();
            2
        });
        queue.try_push(f.clone()).unwrap();
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Returned(2))));
        assert_eq!(f.stats().sleeps, 0);
        assert_eq!(sem.available(), 0);
        assert!(!sem.try_acquire());

        sem.release(1);
        assert!(sem.try_acquire());
        assert!(!sem.try_acquire());
        let initial = Semaphore::new(3);
        assert!(initial.try_acquire() && initial.try_acquire() && initial.try_acquire());
        assert!(!initial.try_acquire());
        assert_eq!(Semaphore::default().available(), 0);
    });
}

/// `release(2)` wakes two waiters, oldest first; the third waits on until
/// the next release; extra tokens stay available.
#[test]
fn release_wakes_waiters_in_fifo_order() {
    watchdog("release_wakes_waiters_in_fifo_order", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::<char>::new(8);
        let fibers: Vec<Fiber<char>> = ['a', 'b', 'c']
            .into_iter()
            .map(|name| {
                let s = sem.clone();
                named_fiber(&name.to_string(), Priority::NORMAL, move || {
                    s.acquire();
                    name
                })
            })
            .collect();
        for f in &fibers {
            queue.try_push(f.clone()).unwrap();
        }
        stage.set("putting a, b, c to sleep");
        for _ in 0..3 {
            assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        }
        assert_eq!(sem.waiters(), 3);

        sem.release(2);
        assert_eq!(sem.waiters(), 1);
        assert_eq!(sem.available(), 0);
        assert_eq!(queue.len(), 2);
        assert_eq!(fibers[2].state(), FiberState::Sleeping, "c waits for the next release");
        stage.set("running the two woken fibers");
        let order: Vec<char> = std::iter::from_fn(|| queue.run_next())
            .map(|ran| ran.outcome.unwrap().unwrap_returned())
            .collect();
        assert_eq!(order, ['a', 'b']);

        sem.release(3);
        assert_eq!(sem.waiters(), 0);
        assert_eq!(sem.available(), 2, "tokens beyond the waiters stay available");
        let ran = queue.run_next().unwrap();
        assert_eq!(ran.outcome.unwrap().unwrap_returned(), 'c');
        assert_eq!(queue.stats().wakes, 3);
    });
}

/// Many sleepers, one `release(1)` at a time: woken in the order they went
/// to sleep.
#[test]
fn single_releases_wake_many_sleepers_in_order() {
    const N: usize = 64;
    watchdog("single_releases_wake_many_sleepers_in_order", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        stage.set("putting all fibers to sleep");
        let queue = sleepers_on(&sem, N);
        stage.set("releasing one token at a time");
        for i in 0..N {
            sem.release(1);
            assert_eq!(queue.len(), 1);
            let ran = queue.run_next().unwrap();
            assert_eq!(ran.outcome.unwrap().unwrap_returned(), i);
        }
        assert_eq!((sem.waiters(), sem.available()), (0, 0));
    });
}

/// `acquire_with_priority`: a fiber that had to wait is woken at the given
/// priority, ahead of fibers already queued at a lower one. A fiber that
/// did not wait keeps its priority.
#[test]
fn acquire_with_priority_sets_the_woken_fibers_priority() {
    watchdog("acquire_with_priority_sets_the_woken_fibers_priority", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::<&'static str>::new(4);
        let s = sem.clone();
        let urgent = fiber(Priority::LOWEST, move || {
            s.acquire_with_priority(Priority::HIGHEST);
            "urgent"
        });
        queue.try_push(urgent.clone()).unwrap();
        stage.set("putting the urgent fiber to sleep");
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        assert_eq!(urgent.priority(), Priority::LOWEST, "unchanged while asleep");

        let normal = fiber(Priority::NORMAL, || "normal");
        queue.try_push(normal).unwrap();
        sem.release(1);
        assert_eq!(urgent.priority(), Priority::HIGHEST);
        let order: Vec<&str> = std::iter::from_fn(|| queue.run_next())
            .map(|ran| ran.outcome.unwrap().unwrap_returned())
            .collect();
        assert_eq!(order, ["urgent", "normal"]);

        // With a token available there is no wait and no priority change.
        sem.release(1);
        let s = sem.clone();
        let calm = fiber(Priority(5), move || {
            s.acquire_with_priority(Priority::HIGHEST);
            "calm"
        });
        assert_eq!(calm.run().unwrap().unwrap_returned(), "calm");
        assert_eq!(calm.priority(), Priority(5));
    });
}

/// Wakes are never refused for capacity: a woken fiber goes back even to a
/// queue that `try_push` considers full.
#[test]
fn a_wake_is_not_refused_by_a_full_queue() {
    watchdog("a_wake_is_not_refused_by_a_full_queue", 30, |_stage| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::<u8>::new(1);
        let s = sem.clone();
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                s.acquire();
                1
            }))
            .unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        queue.try_push(fiber(Priority::NORMAL, || 2)).unwrap();
        assert!(queue.try_push(fiber(Priority::NORMAL, || 3)).is_err(), "full for try_push");
        sem.release(1);
        assert_eq!(queue.len(), 2, "the woken fiber is back despite the capacity");
        let order: Vec<u8> = std::iter::from_fn(|| queue.run_next())
            .map(|ran| ran.outcome.unwrap().unwrap_returned())
            .collect();
        assert_eq!(order, [2, 1]);
    });
}

/// A fiber that sleeps more than once (the original's "woken before
/// sleeping" flag was never reset, which broke the second sleep).
#[test]
fn a_fiber_can_sleep_many_times() {
    const ROUNDS: usize = 1000;
    watchdog("a_fiber_can_sleep_many_times", 30, |_stage| {
        let sem = Arc::new(Semaphore::new(0));
        let queue = RunQueue::<usize>::new(1);
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            for _ in 0..ROUNDS {
                s.acquire();
            }
            ROUNDS
        });
        queue.try_push(f.clone()).unwrap();
        for round in 0..ROUNDS {
            let ran = queue.run_next().unwrap();
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "round {round}");
            assert!(queue.is_empty());
            sem.release(1);
        }
        assert_eq!(queue.run_next().unwrap().outcome.unwrap().unwrap_returned(), ROUNDS);
        assert_eq!(f.stats().sleeps, ROUNDS as u64);
        assert_eq!(queue.stats().wakes, ROUNDS as u64);
    });
}

/// Two fibers on one thread play ping-pong through two semaphores: every
/// round each sleeps once and wakes the other; the turns alternate exactly.
#[test]
fn two_fibers_ping_pong_on_one_thread() {
    const ROUNDS: usize = 2000;
    watchdog("two_fibers_ping_pong_on_one_thread", 30, |stage| {
        let ping = Arc::new(Semaphore::new(0));
        let pong = Arc::new(Semaphore::new(0));
        let log = Arc::new(Mutex::new(Vec::with_capacity(2 * ROUNDS)));
        let queue = RunQueue::<usize>::new(2);
        let (p, q, l) = (ping.clone(), pong.clone(), log.clone());
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                for r in 0..ROUNDS {
                    l.lock().unwrap().push(('A', r));
                    p.release(1);
                    q.acquire();
                }
                ROUNDS
            }))
            .unwrap();
        let (p, q, l) = (ping.clone(), pong.clone(), log.clone());
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                for r in 0..ROUNDS {
                    p.acquire();
                    l.lock().unwrap().push(('B', r));
                    q.release(1);
                }
                ROUNDS
            }))
            .unwrap();
        stage.set("running the ping-pong by hand");
        let returned = AtomicUsize::new(0);
        while let Some(ran) = queue.run_next() {
            match ran.outcome {
                Ok(RunOutcome::Slept) => {}
                Ok(RunOutcome::Returned(n)) => {
                    assert_eq!(n, ROUNDS);
                    returned.fetch_add(1, Ordering::Relaxed);
                }
                other => panic!("unexpected outcome {other:?}"),
            }
        }
        assert_eq!(returned.load(Ordering::Relaxed), 2, "both fibers finished");
        let log = log.lock().unwrap();
        let expected: Vec<(char, usize)> = (0..ROUNDS).flat_map(|r| [('A', r), ('B', r)]).collect();
        assert_eq!(*log, expected);
        assert_eq!((ping.available(), pong.available()), (0, 0));
        assert_eq!((ping.waiters(), pong.waiters()), (0, 0));
    });
}

/// Where a fiber keeps a `Waiter` of its own.
type Stash = Arc<Mutex<Option<spindle_fiber::Waiter>>>;

/// An empty semaphore, a queue holding one fiber that keeps a `Waiter` of
/// its own in the stash and then acquires a token, and the fiber.
fn acquirer_that_keeps_a_waiter() -> (Arc<Semaphore>, Stash, RunQueue<&'static str>, Fiber<&'static str>) {
    let sem = Arc::new(Semaphore::new(0));
    let stash = Arc::new(Mutex::new(None));
    let queue = RunQueue::<&'static str>::new(4);
    let (s, st) = (sem.clone(), stash.clone());
    let f = fiber(Priority::NORMAL, move || {
        *st.lock().unwrap() = spindle_fiber::Waiter::current();
        s.acquire();
        "acquired"
    });
    queue.try_push(f.clone()).unwrap();
    (sem, stash, queue, f)
}

/// A `Waiter` the fiber took earlier and kept (the API is public) may be
/// woken while the fiber sleeps in `acquire`: a spurious wakeup. The fiber
/// must go back to sleep with its wait node still linked, and take the
/// token when it is really released.
#[test]
fn a_stale_waiter_woken_during_acquire_is_a_spurious_wakeup() {
    watchdog("a_stale_waiter_woken_during_acquire_is_a_spurious_wakeup", 30, |stage| {
        let (sem, stash, queue, f) = acquirer_that_keeps_a_waiter();

        stage.set("first run: the fiber should go to sleep in acquire");
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        assert_eq!(sem.waiters(), 1);

        stage.set("the stale waiter's wake: the fiber runs and sleeps again");
        stash.lock().unwrap().take().expect("the fiber stashed a waiter").wake();
        assert_eq!(queue.len(), 1, "the spurious wake queued the fiber");
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "{:?}", ran.outcome);
        assert_eq!(f.state(), FiberState::Sleeping);
        assert_eq!(sem.waiters(), 1, "its wait node is still linked");

        stage.set("the real release: the fiber takes the token and returns");
        sem.release(1);
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Returned("acquired"))), "{:?}", ran.outcome);
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
    });
}

/// A dropped fiber's stack is unwound on the dropping thread, and a
/// destructor there that waits on a semaphore cannot put the fiber to
/// sleep (a suspension would only restart the unwind): it blocks the
/// dropping thread, as a thread's wait does, until a release. So does code
/// that catches the forced unwind and then waits. Before, both aborted the
/// process.
#[test]
fn a_wait_in_a_dropped_fibers_destructor_blocks_the_dropping_thread() {
    watchdog("a_wait_in_a_dropped_fibers_destructor_blocks_the_dropping_thread", 30, |stage| {
        struct AcquireOnDrop(Arc<Semaphore>, Arc<AtomicBool>);
        impl Drop for AcquireOnDrop {
            fn drop(&mut self) {
                self.0.acquire();
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let sem = Arc::new(Semaphore::new(0));
        let (destructor_done, caught_done) =
            (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let dropper = {
            let (sem, destructor_done, caught_done) =
                (sem.clone(), destructor_done.clone(), caught_done.clone());
            std::thread::spawn(move || {
                // A local whose destructor waits.
                let guard = AcquireOnDrop(sem.clone(), destructor_done);
                let f = fiber(Priority::NORMAL, move || {
                    let _guard = guard;
                    spindle_fiber::yield_now();
                    "unreachable"
                });
                assert!(matches!(f.run(), Ok(RunOutcome::Yielded(0))));
                // Unwound here: the destructor blocks this thread.
                drop(f);

                // Code that catches the forced unwind, then waits.
                let f = fiber(Priority::NORMAL, move || {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(spindle_fiber::yield_now));
                    sem.acquire();
                    caught_done.store(true, Ordering::SeqCst);
                    "unwound"
                });
                assert!(matches!(f.run(), Ok(RunOutcome::Yielded(0))));
                drop(f);
            })
        };
        for (what, done) in [("the destructor", &destructor_done), ("the caught unwind", &caught_done)] {
            stage.set(format!("the dropping thread blocks in {what}'s acquire"));
            spin_until(|| sem.waiters() == 1);
            assert!(!done.load(Ordering::SeqCst), "{what} waits for a token");
            sem.release(1);
            stage.set(format!("{what} takes the token and the drop goes on"));
            spin_until(|| done.load(Ordering::SeqCst));
        }
        dropper.join().unwrap();
        assert_eq!((sem.available(), sem.waiters()), (0, 0), "each wait took its token");
    });
}

/// The other order: a kept waiter wakes the sleeping fiber, and the real
/// release comes while the fiber is still queued from that wake, so the
/// real wake is void. The fiber must still see its token when it runs.
#[test]
fn a_real_release_while_the_fiber_is_queued_by_a_stale_wake_is_not_lost() {
    watchdog("a_real_release_while_the_fiber_is_queued_by_a_stale_wake_is_not_lost", 30, |_| {
        let (sem, stash, queue, f) = acquirer_that_keeps_a_waiter();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));

        stash.lock().unwrap().take().expect("the fiber stashed a waiter").wake();
        assert_eq!(f.state(), FiberState::Queued);
        sem.release(1);
        assert_eq!(queue.len(), 1, "the real wake found the fiber queued: void");
        assert_eq!((sem.available(), sem.waiters()), (0, 0), "the token went to the fiber's node");

        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Returned("acquired"))), "{:?}", ran.outcome);
        assert!(queue.is_empty());
    });
}

/// A token handed to a sleeping fiber that is then dropped before it runs
/// again is not lost: it goes to the next waiter, or back to the count.
#[test]
fn a_token_handed_to_a_fiber_dropped_before_it_ran_is_given_back() {
    watchdog("a_token_handed_to_a_fiber_dropped_before_it_ran_is_given_back", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let sleeper = |sem: &Arc<Semaphore>| {
            let s = sem.clone();
            let f = fiber(Priority::NORMAL, move || s.acquire());
            assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
            f
        };

        stage.set("one sleeper, woken (no run queue: it becomes Ready), then dropped");
        let f = sleeper(&sem);
        sem.release(1);
        assert_eq!(f.state(), FiberState::Ready);
        assert_eq!(sem.available(), 0, "the token went to the fiber");
        drop(f);
        assert_eq!(sem.available(), 1, "the dropped fiber's token is back");

        stage.set("two sleepers: the first is woken and dropped, the second gets its token");
        assert!(sem.try_acquire());
        let (first, second) = (sleeper(&sem), sleeper(&sem));
        sem.release(1);
        assert_eq!((first.state(), second.state()), (FiberState::Ready, FiberState::Sleeping));
        drop(first);
        assert_eq!(second.state(), FiberState::Ready, "the token was handed on");
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
        assert!(matches!(second.run(), Ok(RunOutcome::Returned(()))));
    });
}

/// A release that would wrap the token count panics instead, in every build.
#[test]
fn a_release_that_overflows_the_count_panics() {
    let sem = Semaphore::new(usize::MAX - 1);
    sem.release(1);
    assert_eq!(sem.available(), usize::MAX);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sem.release(1)));
    let msg = r.expect_err("the count would wrap");
    assert!(msg.downcast_ref::<String>().is_some_and(|m| m.contains("overflows")), "{msg:?}");
    assert_eq!(sem.available(), usize::MAX, "the count is unchanged");
}

/// A fiber asleep in `sem.acquire()` whose home panics when it is woken.
fn asleep_with_a_panicking_home(sem: &Arc<Semaphore>) -> Fiber<()> {
    let home: Arc<dyn spindle_fiber::Schedule<()>> = Arc::new(PanicsInSchedule);
    let fiber = Fiber::<()>::new(spindle_fiber::FiberAttr::new()).unwrap();
    let s = Arc::clone(sem);
    fiber.set_function(Priority::NORMAL, move || s.acquire()).unwrap();
    fiber.mark_queued(Some(&home)).unwrap();
    fiber.mark_dequeued().unwrap();
    assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
    fiber
}

/// A scheduler that panics in `schedule` (against the trait's contract):
/// `release(2)` unwinds at the first wake, and the token it had not handed
/// out yet is counted as available, not lost; the next release hands it to
/// a waiter still asleep, with its own; the token handed to the woken fiber
/// comes back when that fiber is dropped.
#[test]
fn a_release_whose_wake_panics_loses_no_token() {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    watchdog("a_release_whose_wake_panics_loses_no_token", 30, |_stage| {
        let sem = Arc::new(Semaphore::new(0));
        let fiber = asleep_with_a_panicking_home(&sem);
        // Two more waiters behind it, with no home (a wake leaves them Ready).
        let others: Vec<Fiber<()>> = (0..2)
            .map(|_| {
                let f = Fiber::<()>::new(spindle_fiber::FiberAttr::new()).unwrap();
                let s = Arc::clone(&sem);
                f.set_function(Priority::NORMAL, move || s.acquire()).unwrap();
                assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
                f
            })
            .collect();
        let released = catch_unwind(AssertUnwindSafe(|| sem.release(2)));
        assert!(released.is_err(), "the scheduler's panic comes out of release");
        assert_eq!(sem.available(), 1, "the token not handed out yet is counted");
        assert_eq!(sem.waiters(), 2);
        sem.release(1);
        assert_eq!((sem.available(), sem.waiters()), (0, 0), "both waiters got a token: the counted one too");
        for f in &others {
            assert!(matches!(f.run(), Ok(RunOutcome::Returned(()))));
        }
        drop(fiber);
        assert_eq!(sem.available(), 1, "the token handed to the dropped fiber is given back");
    });
}

/// `Debug` formats after the lock, as the channel's does: a writer that
/// uses the semaphore does not wait on the lock for good. (From a review.)
#[test]
fn debug_into_a_writer_that_uses_the_semaphore_does_not_deadlock() {
    use std::fmt::Write as _;
    struct Sink<'a>(&'a Semaphore, String);
    impl std::fmt::Write for Sink<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let _ = self.0.available();
            self.1.push_str(s);
            Ok(())
        }
    }
    watchdog("debug_into_a_writer_that_uses_the_semaphore_does_not_deadlock", 10, |_stage| {
        let sem = Semaphore::new(2);
        let mut sink = Sink(&sem, String::new());
        write!(sink, "{sem:?}").unwrap();
        assert!(sink.1.contains("tokens: 2"), "{}", sink.1);
    });
}

/// `release(1)` that finds tokens a panicking wake left counted while
/// waiters slept hands them out too, so it wakes several waiters: the
/// first one's unwind (a homeless fiber dropped while it slept, whose
/// destructor acquires here) waits until every token is placed, as for a
/// `release(n)`. (Found in a documentation check: this `release(1)` ran
/// without the deferral.)
#[test]
fn a_release_of_one_with_stranded_tokens_places_them_all_before_an_unwind() {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    struct AcquiresOnDrop(Arc<Semaphore>);
    impl Drop for AcquiresOnDrop {
        fn drop(&mut self) {
            self.0.acquire();
        }
    }
    watchdog("a_release_of_one_with_stranded_tokens_places_them_all_before_an_unwind", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        // P: its wake panics, which strands a token in the count.
        let p = asleep_with_a_panicking_home(&sem);
        // F: homeless, dropped while it sleeps; its destructor acquires.
        let f = Fiber::<()>::new(spindle_fiber::FiberAttr::new().stack_size(64 * 1024)).unwrap();
        let (s, d) = (Arc::clone(&sem), AcquiresOnDrop(Arc::clone(&sem)));
        // SAFETY: only `Arc`s live across the suspension.
        unsafe {
            f.set_function_migratable(Priority::NORMAL, move || {
                let _d = d;
                s.acquire();
            })
        }
        .unwrap();
        assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
        drop(f);
        // T: a thread behind them.
        let s = Arc::clone(&sem);
        let t = std::thread::spawn(move || s.acquire());
        spin_until(|| sem.waiters() == 3);
        assert!(catch_unwind(AssertUnwindSafe(|| sem.release(2))).is_err());
        assert_eq!((sem.available(), sem.waiters()), (1, 2), "one token stranded, F and T asleep");
        stage.set("release(1) with a stranded token: F's unwind must wait for T's token");
        sem.release(1);
        t.join().unwrap();
        // F's token came back when it unwound, and its destructor took it.
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
        drop(p);
        assert_eq!(sem.available(), 1, "P's token is given back when it is dropped");
    });
}
