//! `WaitGroup`: a wait ends once every other handle of the group is gone,
//! for waiting threads and fibers, with members that return, panic, are
//! dropped suspended or run on other threads.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{fiber, watchdog};
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome};
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
        drop(member);
        // This thread's wait ends the group. The fibers waiting ahead of
        // it run only after it returns (this thread runs their queue):
        // a wait must not depend on the waiters before it.
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
