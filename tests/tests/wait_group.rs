//! `WaitGroup`: a wait ends once every other handle of the group is gone,
//! for waiting threads and fibers, with members that return, panic, are
//! dropped suspended or run on other threads.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{fiber, spin_until, watchdog};
use spindle_fiber::{yield_now, Fiber, FiberAttr, FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Interrupted, WaitGroup};

/// A thread's wait returns only after every member thread has dropped its
/// handle, and sees everything they did before.
#[test]
fn a_thread_waits_for_member_threads() {
    watchdog("a_thread_waits_for_member_threads", 60, |_| {
        let group = WaitGroup::new();
        let log = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let (member, log) = (group.clone(), log.clone());
                std::thread::spawn(move || {
                    log.lock().unwrap().push(i);
                    drop(member);
                })
            })
            .collect();
        group.wait();
        let mut seen = log.lock().unwrap().clone();
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2, 3], "every member's work is visible after the wait");
        for t in threads {
            t.join().unwrap();
        }
    });
}

/// A fiber waiting on a run queue sleeps while members remain and is woken
/// by the last member's end: the members here are fibers on the same
/// queue that yield a few times first.
#[test]
fn a_fiber_sleeps_until_the_member_fibers_end() {
    watchdog("a_fiber_sleeps_until_the_member_fibers_end", 60, |_| {
        let queue = RunQueue::new(8);
        let group = WaitGroup::new();
        let ended = Arc::new(AtomicUsize::new(0));
        for i in 0..3 {
            let (member, ended) = (group.clone(), ended.clone());
            queue
                .try_push(fiber(Priority::NORMAL, move || {
                    let _member = member;
                    for _ in 0..=i {
                        yield_now();
                    }
                    ended.fetch_add(1, Ordering::SeqCst);
                }))
                .unwrap();
        }
        let (seen, waiter_saw) = (ended.clone(), Arc::new(AtomicUsize::new(usize::MAX)));
        let saw = waiter_saw.clone();
        // The waiter runs first (higher priority) and has to sleep.
        let waiter = fiber(Priority::HIGH, move || {
            group.wait();
            saw.store(seen.load(Ordering::SeqCst), Ordering::SeqCst);
        });
        queue.try_push(waiter).unwrap();
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "the waiter sleeps while members live");
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Yielded(_) | RunOutcome::Returned(()))));
        }
        assert_eq!(
            waiter_saw.load(Ordering::SeqCst),
            3,
            "the waiter returned, after all three members ended"
        );
    });
}

/// A member whose function panics counts as done: the unwind drops the
/// captured handle. So does a member fiber dropped while suspended, whose
/// stack is unwound.
#[test]
fn panicked_and_dropped_members_count_as_done() {
    watchdog("panicked_and_dropped_members_count_as_done", 60, |_| {
        let group = WaitGroup::new();
        let member = group.clone();
        let panicker: Fiber<()> = fiber(Priority::NORMAL, move || {
            let _member = member;
            panic!("a member panics");
        });
        let member = group.clone();
        let suspended: Fiber<()> = fiber(Priority::NORMAL, move || {
            let _member = member;
            yield_now();
            unreachable!("never run again");
        });
        assert_eq!(group.count(), 3);
        assert!(matches!(panicker.run(), Ok(RunOutcome::Panicked(_))));
        assert_eq!(group.count(), 2, "the panic's unwind dropped the member's handle");
        assert!(matches!(suspended.run(), Ok(RunOutcome::Yielded(_))));
        assert_eq!(group.count(), 2, "a suspended member still holds its handle");
        drop(suspended);
        assert_eq!(group.count(), 1, "dropping the suspended fiber unwound its handle");
        assert!(group.wait_timeout(Duration::from_secs(30)), "nothing is left to wait for");
    });
}

/// Several waiters, threads and fibers, all get through once the group
/// is done, each on its own: none waits for another to run.
#[test]
fn every_waiter_gets_through() {
    watchdog("every_waiter_gets_through", 60, |_| {
        let queue: RunQueue<()> = RunQueue::new(8);
        let group = WaitGroup::new();
        let member = group.clone();
        let through = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            let (g, t) = (group.clone(), through.clone());
            queue
                .try_push(fiber(Priority::NORMAL, move || {
                    g.wait();
                    t.fetch_add(1, Ordering::SeqCst);
                }))
                .unwrap();
        }
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        }
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (g, t) = (group.clone(), through.clone());
                std::thread::spawn(move || {
                    g.wait();
                    t.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        // The threads have left the group (they wait, or are about to):
        // with `member` gone, this thread's wait ends the group. The
        // fibers waiting ahead of it run only after it returns (this
        // thread runs their queue): a wait must not depend on the waiters
        // before it.
        spin_until(|| group.count() == 2);
        drop(member);
        group.wait();
        for t in threads {
            t.join().unwrap();
        }
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Returned(()))));
        }
        assert_eq!(through.load(Ordering::SeqCst), 5, "three fibers and two threads got through");
    });
}

/// An interrupted `wait_interruptible` returns `Interrupted` and gives up
/// its handle; the group goes on without it.
#[test]
fn an_interrupted_waiter_leaves_the_group() {
    watchdog("an_interrupted_waiter_leaves_the_group", 60, |_| {
        let group = WaitGroup::new();
        let g = group.clone();
        let waiter: Fiber<Result<(), Interrupted>> = fiber(Priority::NORMAL, move || g.wait_interruptible());
        assert!(matches!(waiter.run(), Ok(RunOutcome::Slept)));
        assert_eq!(group.count(), 1, "the waiter gave up its handle as it began to wait");
        waiter.interrupt();
        assert!(matches!(waiter.run(), Ok(RunOutcome::Returned(Err(Interrupted)))));
        let member = group.clone();
        assert!(!group.clone().wait_timeout(Duration::from_millis(1)), "a member is still alive");
        drop(member);
        assert!(group.wait_timeout(Duration::from_secs(30)));
    });
}

/// `wait_timeout` in a fiber panics naming itself and what a fiber uses
/// instead (not the semaphore it is built on, nor a `try_` method a group
/// does not have); the unwind gives up the fiber's handle.
#[test]
fn a_timed_wait_in_a_fiber_panics_naming_the_group() {
    watchdog("a_timed_wait_in_a_fiber_panics_naming_the_group", 60, |_| {
        let group = WaitGroup::new();
        let g = group.clone();
        let waiter: Fiber<bool> = fiber(Priority::NORMAL, move || g.wait_timeout(Duration::from_secs(30)));
        match waiter.run() {
            Ok(RunOutcome::Panicked(p)) => {
                let msg = p.message().unwrap_or_default().to_owned();
                assert!(
                    msg.contains("WaitGroup::wait_timeout called in a fiber")
                        && msg.contains("WaitGroup::wait_interruptible")
                        && !msg.contains("Semaphore")
                        && !msg.contains("try_"),
                    "{msg}"
                );
            }
            other => panic!("expected the panic, got {other:?}"),
        }
        assert_eq!(group.count(), 1, "the unwind gave up the fiber's handle");
        assert!(group.wait_timeout(Duration::from_secs(30)));
    });
}

/// A group that is done wins over a pending interrupt: the waiter that
/// ends the group gets `Ok`, and the interrupt stays pending for its next
/// interruptible wait (as the rustdoc says).
#[test]
fn a_done_group_wins_over_a_pending_interrupt() {
    watchdog("a_done_group_wins_over_a_pending_interrupt", 60, |_| {
        let group = WaitGroup::new();
        let waiter: Fiber<(Result<(), Interrupted>, bool)> =
            fiber(Priority::NORMAL, move || (group.wait_interruptible(), spindle_fiber::take_interrupt()));
        assert!(waiter.set_interrupt());
        assert!(matches!(waiter.run(), Ok(RunOutcome::Returned((Ok(()), true)))));
    });
}

/// A fiber waiter whose run queue is gone has its wake refused when the
/// group finishes: the waiters behind it, a fiber and a thread, get
/// through all the same, and the refused fiber, run again by hand, gets
/// through too.
#[test]
fn a_waiter_whose_run_queue_is_gone_holds_up_no_one() {
    watchdog("a_waiter_whose_run_queue_is_gone_holds_up_no_one", 60, |_| {
        let group = WaitGroup::new();
        let g = group.clone();
        let orphan: Fiber<()> = fiber(Priority::NORMAL, move || g.wait());
        {
            let gone = RunQueue::new(1);
            gone.try_push(orphan.clone()).unwrap();
            assert!(matches!(gone.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        }
        assert_eq!(orphan.state(), FiberState::Sleeping);
        let live = RunQueue::new(1);
        let g = group.clone();
        live.try_push(fiber(Priority::NORMAL, move || g.wait())).unwrap();
        assert!(matches!(live.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        let g = group.clone();
        let thread = std::thread::spawn(move || g.wait());
        let member = group.clone();
        drop(group);
        spin_until(|| member.count() == 1); // the thread has left too
        drop(member);
        thread.join().unwrap();
        assert!(matches!(live.run_next().unwrap().outcome, Ok(RunOutcome::Returned(()))));
        assert_eq!(orphan.state(), FiberState::Ready, "its wake was refused");
        assert!(matches!(orphan.run(), Ok(RunOutcome::Returned(()))));
    });
}

/// Fiber waiters woken by the group's end and dropped before they run
/// (their queue goes with them) give their tokens back; a thread waiting
/// behind them gets through.
#[test]
fn waiters_dropped_once_woken_hold_up_no_one() {
    watchdog("waiters_dropped_once_woken_hold_up_no_one", 60, |_| {
        let group = WaitGroup::new();
        let queue = RunQueue::new(2);
        for _ in 0..2 {
            let g = group.clone();
            queue.try_push(fiber(Priority::NORMAL, move || g.wait())).unwrap();
        }
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        }
        let g = group.clone();
        let thread = std::thread::spawn(move || g.wait());
        drop(group);
        spin_until(|| queue.len() == 2); // the group is done: both woken
        drop(queue);
        thread.join().unwrap();
    });
}

/// Waits in the destructors of a fiber being dropped suspended: an
/// interruptible one ends at once (the group is not done), a plain one
/// blocks the dropping thread until the last member, a thread, lets go.
#[test]
fn waits_in_a_dropped_fiber() {
    watchdog("waits_in_a_dropped_fiber", 60, |_| {
        struct WaitsOnDrop {
            group: Option<WaitGroup>,
            interruptible: bool,
            entered: Arc<AtomicBool>,
            saw: Arc<Mutex<Option<Result<(), Interrupted>>>>,
        }
        impl Drop for WaitsOnDrop {
            fn drop(&mut self) {
                let group = self.group.take().unwrap();
                self.entered.store(true, Ordering::SeqCst);
                let r = if self.interruptible {
                    group.wait_interruptible()
                } else {
                    group.wait();
                    Ok(())
                };
                *self.saw.lock().unwrap() = Some(r);
            }
        }
        type Saw = Arc<Mutex<Option<Result<(), Interrupted>>>>;
        let group = WaitGroup::new();
        // A fiber suspended with a `WaitsOnDrop` on its stack.
        let suspended = |interruptible: bool| -> (Fiber<()>, Arc<AtomicBool>, Saw) {
            let (entered, saw) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(None)));
            let guard = WaitsOnDrop {
                group: Some(group.clone()),
                interruptible,
                entered: entered.clone(),
                saw: saw.clone(),
            };
            let f = fiber(Priority::NORMAL, move || {
                let _guard = guard;
                yield_now();
                unreachable!("dropped suspended");
            });
            assert!(matches!(f.run(), Ok(RunOutcome::Yielded(_))));
            (f, entered, saw)
        };
        let (interruptible, _, saw_interrupted) = suspended(true);
        let (plain, entered, saw) = suspended(false);
        drop(interruptible);
        assert_eq!(*saw_interrupted.lock().unwrap(), Some(Err(Interrupted)), "no wait in a dropped fiber");

        let member = group.clone();
        drop(group);
        let left = Arc::new(AtomicBool::new(false));
        let l = left.clone();
        let last = std::thread::spawn(move || {
            spin_until(|| entered.load(Ordering::SeqCst));
            l.store(true, Ordering::SeqCst);
            drop(member);
        });
        drop(plain); // blocks in the destructor's wait until `last` lets go
        assert!(left.load(Ordering::SeqCst), "the dropped fiber's wait returned before the last member left");
        assert_eq!(*saw.lock().unwrap(), Some(Ok(())));
        last.join().unwrap();
    });
}

/// Members on other threads' fibers: each worker thread runs its own
/// pinned fibers, and the main thread's wait ends after every one.
#[test]
fn a_thread_waits_for_fibers_on_other_threads() {
    watchdog("a_thread_waits_for_fibers_on_other_threads", 60, |_| {
        let group = WaitGroup::new();
        let ended = Arc::new(AtomicUsize::new(0));
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let (member, ended) = (group.clone(), ended.clone());
                std::thread::spawn(move || {
                    let fibers: Vec<Fiber<()>> = (0..4)
                        .map(|_| {
                            let (m, e) = (member.clone(), ended.clone());
                            let f = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
                            f.set_function(Priority::NORMAL, move || {
                                let _m = m;
                                yield_now();
                                e.fetch_add(1, Ordering::SeqCst);
                            })
                            .unwrap();
                            f
                        })
                        .collect();
                    drop(member);
                    for f in &fibers {
                        while f.run().is_ok() {}
                    }
                })
            })
            .collect();
        group.wait();
        assert_eq!(ended.load(Ordering::SeqCst), 8);
        for w in workers {
            w.join().unwrap();
        }
    });
}

/// `count` and `Debug` say how many handles are alive.
#[test]
fn count_and_debug_show_the_live_handles() {
    let group = WaitGroup::default();
    let a = group.clone();
    let b = a.clone();
    assert_eq!(group.count(), 3);
    assert_eq!(format!("{b:?}"), "WaitGroup { count: 3 }");
    drop(a);
    drop(b);
    assert_eq!(group.count(), 1);
}
