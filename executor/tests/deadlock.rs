//! Deadlock detection: a thread joining a fiber that can never finish gets
//! `JoinError::Deadlock` with a report of every sleeping fiber, what it
//! waits on and where; a pending timer is not a deadlock.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{wait_for, watchdog};
use spindle_executor::{sleep, Executor, SpawnOptions};
use spindle_sync::Semaphore;

#[test]
fn two_fibers_waiting_on_each_other_are_reported() {
    watchdog("two_fibers_waiting_on_each_other_are_reported", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let to_left = Arc::new(Semaphore::new(0));
        let to_right = Arc::new(Semaphore::new(0));
        // Where each fiber waits, as "file:line" of its acquire call.
        let sites = Arc::new(Mutex::new(Vec::new()));

        stage.set("spawning 'left' and 'right', each waiting for the other");
        let left = {
            let (mine, theirs, sites) = (Arc::clone(&to_left), Arc::clone(&to_right), Arc::clone(&sites));
            exec.spawn_with(SpawnOptions::new().name("left"), move || {
                sites.lock().unwrap().push(format!("{}:{}:", file!(), line!() + 1));
                mine.acquire();
                theirs.release(1);
            })
        };
        let right = {
            let (mine, theirs, sites) = (Arc::clone(&to_right), Arc::clone(&to_left), Arc::clone(&sites));
            exec.spawn_with(SpawnOptions::new().name("right"), move || {
                sites.lock().unwrap().push(format!("{}:{}:", file!(), line!() + 1));
                mine.acquire();
                theirs.release(1);
            })
        };
        wait_for(&stage, "both fibers to wait", || to_left.waiters() == 1 && to_right.waiters() == 1);

        stage.set("joining 'left' from the test thread");
        let err = left.join().expect_err("'left' can never finish");
        assert!(err.is_deadlock(), "expected a deadlock error, got: {err}");
        let report = err.to_string();
        eprintln!("{report}");
        assert!(report.contains("'left'"), "the report names 'left':\n{report}");
        assert!(report.contains("'right'"), "the report names 'right':\n{report}");
        assert!(report.contains("semaphore"), "the report says what they wait on:\n{report}");
        let sites = sites.lock().unwrap().clone();
        assert_eq!(sites.len(), 2);
        for site in &sites {
            assert!(report.contains(site.as_str()), "the report shows the wait site {site}:\n{report}");
        }
        assert!(exec.stats().deadlocks >= 1, "{:?}", exec.stats());

        stage.set("joining 'right' from the test thread: detected again");
        let err = right.join().expect_err("'right' can never finish either");
        assert!(err.is_deadlock(), "expected a deadlock error, got: {err}");
        assert!(exec.stats().deadlocks >= 2, "{:?}", exec.stats());

        stage.set("the executor still runs fibers after a deadlock report");
        assert_eq!(exec.block_on(|| 5).unwrap(), 5);

        // The two fibers stay asleep on their semaphores; shutdown must not
        // wait for them (they may be leaked, as documented).
        stage.set("dropping the executor with two fibers asleep on semaphores");
        drop(exec);
    });
}

#[test]
fn a_pending_timer_is_not_a_deadlock() {
    watchdog("a_pending_timer_is_not_a_deadlock", 30, |stage| {
        // A grace period well inside the timer: detection does look.
        let exec = Executor::builder().workers(2).deadlock_grace(Duration::from_millis(20)).build();
        stage.set("joining a fiber asleep on a timer");
        let h = exec.spawn(|| {
            sleep(Duration::from_millis(300));
            "woke"
        });
        assert_eq!(h.join().expect("a sleeping fiber is not deadlocked"), "woke");
        assert_eq!(exec.stats().deadlocks, 0);
    });
}

#[test]
fn a_fiber_joining_a_fiber_that_waits_forever_is_reported_by_name() {
    watchdog("a_fiber_joining_a_fiber_that_waits_forever_is_reported_by_name", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let never = Arc::new(Semaphore::new(0));
        stage.set("'waiter' waits on a semaphore nobody releases; 'joiner' joins it");
        let waiter = {
            let never = Arc::clone(&never);
            exec.spawn_with(SpawnOptions::new().name("waiter"), move || never.acquire())
        };
        let joiner = exec.spawn_with(SpawnOptions::new().name("joiner"), move || waiter.join().is_ok());
        let err = joiner.join().expect_err("the joiner can never finish");
        let report = err.to_string();
        assert!(err.is_deadlock(), "{report}");
        assert!(report.contains("'waiter'") && report.contains("'joiner'"), "{report}");
        assert!(report.contains("deadlock.rs:"), "wait sites point into this file:\n{report}");
        assert!(
            report.contains("a join (JoinHandle::join)") && report.contains("a semaphore"),
            "each fiber's wait is named for what it waits on:\n{report}"
        );
        drop(exec);
    });
}

#[test]
fn a_yield_timeout_woken_early_leaves_no_timer_behind() {
    watchdog("a_yield_timeout_woken_early_leaves_no_timer_behind", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        stage.set("a fiber in a one-hour yield_timeout, woken at once");
        let napper = exec.spawn(|| spindle_executor::yield_timeout(Duration::from_secs(3600)));
        while !napper.is_finished() {
            napper.wake();
            std::thread::yield_now();
        }
        assert!(!napper.join().unwrap(), "woken, not timed out");
        // A pending timer turns deadlock detection off; the finished
        // sleep's must be gone.
        stage.set("joining a fiber that waits on a semaphore nobody releases");
        let never = Arc::new(Semaphore::new(0));
        let stuck = exec.spawn(move || never.acquire());
        assert!(stuck.join().unwrap_err().is_deadlock());
    });
}

#[test]
fn a_fiber_fed_by_a_thread_outside_is_not_failed_within_the_grace_period() {
    watchdog("a_fiber_fed_by_a_thread_outside_is_not_failed_within_the_grace_period", 30, |stage| {
        // Detection cannot see the thread; the grace period covers it.
        let exec = Executor::builder().workers(2).deadlock_grace(Duration::from_secs(10)).build();
        let sem = Arc::new(Semaphore::new(0));
        let feeder_sem = Arc::clone(&sem);
        let feeder = std::thread::spawn(move || {
            while feeder_sem.waiters() == 0 {
                std::thread::yield_now();
            }
            // The behaviour under test: a producer that stays quiet for a
            // while (far longer than the two looks the old detection took).
            std::thread::sleep(Duration::from_millis(200));
            feeder_sem.release(1);
        });
        stage.set("joining a fiber that waits for a plain thread");
        let h = exec.spawn(move || sem.acquire());
        h.join().expect("the thread fed the fiber; no deadlock");
        assert_eq!(exec.stats().deadlocks, 0);
        feeder.join().unwrap();
    });
}

#[test]
fn report_only_prints_and_lets_the_join_wait() {
    watchdog("report_only_prints_and_lets_the_join_wait", 30, |stage| {
        let exec = Arc::new(
            Executor::builder()
                .workers(1)
                .deadlock_grace(Duration::from_millis(20))
                .on_deadlock(spindle_executor::OnDeadlock::Report)
                .build(),
        );
        let sem = Arc::new(Semaphore::new(0));
        let (fiber_sem, watcher_sem, watcher_exec) = (Arc::clone(&sem), Arc::clone(&sem), Arc::clone(&exec));
        stage.set("a thread joins a fiber that looks deadlocked until the report is out");
        // Releases the fiber once the report was made: the join must still be waiting then.
        let watcher = std::thread::spawn(move || {
            while watcher_exec.stats().deadlocks == 0 {
                std::thread::yield_now();
            }
            watcher_sem.release(1);
        });
        let h = exec.spawn(move || {
            fiber_sem.acquire();
            "released after the report"
        });
        assert_eq!(h.join().unwrap(), "released after the report");
        assert_eq!(exec.stats().deadlocks, 1, "reported once for the episode");
        watcher.join().unwrap();
    });
}

#[test]
fn ignore_turns_detection_off() {
    watchdog("ignore_turns_detection_off", 30, |stage| {
        let exec = Executor::builder()
            .workers(1)
            .deadlock_grace(Duration::from_millis(10))
            .on_deadlock(spindle_executor::OnDeadlock::Ignore)
            .build();
        let sem = Arc::new(Semaphore::new(0));
        let fiber_sem = Arc::clone(&sem);
        let h = exec.spawn(move || fiber_sem.acquire());
        let joiner = std::thread::spawn(move || h.join().is_ok());
        stage.set("a thread joins a fiber that looks deadlocked, for well past the grace period");
        while sem.waiters() == 0 {
            std::thread::yield_now();
        }
        // The behaviour under test is that nothing happens with time: wait
        // out many grace periods.
        std::thread::sleep(Duration::from_millis(300));
        assert!(!joiner.is_finished(), "the join was not failed");
        assert_eq!(exec.stats().deadlocks, 0);
        sem.release(1);
        assert!(joiner.join().unwrap(), "the join returns once the fiber can go on");
    });
}

#[test]
fn abort_prints_the_report_then_aborts() {
    const CHILD: &str = "SPINDLE_TEST_DEADLOCK_ABORT";
    let name = "abort_prints_the_report_then_aborts";
    if std::env::var(CHILD).is_ok() {
        let exec = Executor::builder()
            .workers(1)
            .deadlock_grace(Duration::from_millis(10))
            .on_deadlock(spindle_executor::OnDeadlock::Abort)
            .build();
        let never = Arc::new(Semaphore::new(0));
        let h = exec.spawn_with(SpawnOptions::new().name("stuck"), move || never.acquire());
        let _ = h.join();
        eprintln!("the join returned");
        return;
    }
    {
        // Through the shell, to turn core dumps off for the aborting child;
        // killed if it hangs instead of aborting.
        let out = common::run_in_a_child(name, CHILD);
        let stderr = String::from_utf8_lossy(&out.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(6), "the child should abort (SIGABRT):\n{stderr}");
        assert!(stderr.contains("deadlock detected") && stderr.contains("'stuck'"), "{stderr}");
        assert!(!stderr.contains("the join returned"), "{stderr}");
    }
}

/// A thread waiting in `scope` for a fiber that waits forever is reported
/// (once per episode: a scope cannot be failed, so it keeps waiting), and
/// the scope returns once the fiber is let go.
#[test]
fn a_scope_waiting_for_a_fiber_that_waits_forever_is_reported() {
    watchdog("a_scope_waiting_for_a_fiber_that_waits_forever_is_reported", 30, |stage| {
        let exec = Executor::builder().workers(1).deadlock_grace(Duration::from_millis(50)).build();
        let never = Semaphore::new(0);
        let handle = exec.handle();
        std::thread::scope(|threads| {
            threads.spawn(|| {
                // Lets the scoped fiber go once the deadlock was reported,
                // and a few sysmon rounds later (a second report would be
                // a bug; deadlock detection looks at least every 10 ms).
                while handle.stats().deadlocks == 0 {
                    std::thread::yield_now();
                }
                let reported = std::time::Instant::now();
                while reported.elapsed() < Duration::from_millis(200) {
                    std::thread::yield_now();
                }
                never.release(1);
            });
            stage.set("a scope waits for a fiber that waits on a semaphore nobody releases until reported");
            exec.scope(|s| {
                s.spawn_with(SpawnOptions::new().name("forever"), || never.acquire());
            });
        });
        assert_eq!(exec.stats().deadlocks, 1, "reported once for the one episode");
    });
}

/// A thread that blocks in a join after a scope's deadlock was reported
/// starts a new episode: its join is failed too (it was left waiting when
/// the scope's report closed the episode).
#[test]
fn a_join_made_after_a_scope_was_reported_is_failed() {
    watchdog("a_join_made_after_a_scope_was_reported_is_failed", 30, |stage| {
        let exec = Executor::builder().workers(1).deadlock_grace(Duration::from_millis(50)).build();
        let (never, never_g) = (Semaphore::new(0), Arc::new(Semaphore::new(0)));
        let g = {
            let never_g = Arc::clone(&never_g);
            exec.spawn_with(SpawnOptions::new().name("g"), move || never_g.acquire())
        };
        wait_for(&stage, "g to wait", || never_g.waiters() == 1);
        std::thread::scope(|threads| {
            threads.spawn(|| {
                exec.scope(|s| {
                    s.spawn_with(SpawnOptions::new().name("forever"), || never.acquire());
                });
            });
            wait_for(&stage, "the scope's deadlock report", || exec.stats().deadlocks == 1);
            stage.set("joining g after the scope was reported");
            let err = g.join().expect_err("g can never finish");
            assert!(err.is_deadlock(), "{err}");
            assert_eq!(exec.stats().deadlocks, 2, "the join's episode was reported on its own");
            never.release(1);
        });
    });
}

/// A thread blocked in a join and one waiting in a scope, stuck together:
/// one report, which fails the join and names the scope; the scope keeps
/// waiting, and is not reported again.
#[test]
fn a_join_and_a_scope_stuck_together_are_reported_once() {
    watchdog("a_join_and_a_scope_stuck_together_are_reported_once", 30, |stage| {
        let exec = Executor::builder().workers(1).deadlock_grace(Duration::from_millis(50)).build();
        let never = Arc::new(Semaphore::new(0));
        let h = {
            let never = Arc::clone(&never);
            exec.spawn_with(SpawnOptions::new().name("joined"), move || never.acquire())
        };
        wait_for(&stage, "the joined fiber to wait", || never.waiters() == 1);
        let (scope_tid, body_done) = (std::sync::atomic::AtomicU32::new(0), common::Flag::new());
        std::thread::scope(|threads| {
            threads.spawn(|| {
                scope_tid.store(common::current_tid(), std::sync::atomic::Ordering::SeqCst);
                exec.scope(|s| {
                    s.spawn_with(SpawnOptions::new().name("scoped"), || never.acquire());
                    body_done.set();
                });
            });
            // The join must find the scope's thread blocked already: one
            // that blocked after the report would be an episode of its own.
            wait_for(&stage, "the scoped fiber to wait and the scope's thread to block", || {
                never.waiters() == 2
                    && body_done.is_set()
                    && common::thread_blocked(scope_tid.load(std::sync::atomic::Ordering::SeqCst))
            });
            stage.set("joining from this thread");
            let err = h.join().expect_err("the joined fiber can never finish");
            let report = err.to_string();
            assert!(err.is_deadlock(), "{report}");
            assert!(report.contains("'scoped'") && report.contains("'joined'"), "{report}");
            assert!(
                report.contains("wait in Executor::scope"),
                "the report names the scope's wait:\n{report}"
            );
            // Not synchronisation: a window for a second report of the same
            // stuck state (grace period 50 ms) to show up.
            let window = std::time::Instant::now();
            while window.elapsed() < Duration::from_millis(300) {
                std::thread::yield_now();
            }
            assert_eq!(exec.stats().deadlocks, 1, "one stuck state, one report");
            never.release(2);
        });
    });
}

/// A deadlock among many fibers is reported with the first 64 by name and
/// the rest counted: every failed join carries a copy of the report.
#[test]
fn a_report_of_many_sleeping_fibers_is_bounded() {
    watchdog("a_report_of_many_sleeping_fibers_is_bounded", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let never = Arc::new(Semaphore::new(0));
        stage.set("100 fibers asleep on a semaphore nobody releases");
        let handles: Vec<_> = (0..100)
            .map(|_| {
                let never = Arc::clone(&never);
                exec.spawn(move || never.acquire())
            })
            .collect();
        wait_for(&stage, "all 100 to wait", || never.waiters() == 100);
        stage.set("joining one of them");
        let mut handles = handles.into_iter();
        let err = handles.next().unwrap().join().expect_err("it can never finish");
        assert!(err.is_deadlock(), "expected a deadlock error, got: {err}");
        let report = err.to_string();
        assert_eq!(report.matches(" waits on ").count(), 64, "64 fibers by name:\n{report}");
        assert!(report.contains("... and 36 more sleeping fibers"), "the rest counted:\n{report}");
        drop(handles);
        drop(exec);
    });
}

/// A fiber waiting in a scope is reported at the caller's `scope` call, not
/// at a line inside spindle (`scope` and its inner wait pass the caller's
/// location on).
#[test]
fn a_fiber_waiting_in_a_scope_is_reported_at_the_callers_line() {
    watchdog("a_fiber_waiting_in_a_scope_is_reported_at_the_callers_line", 30, |stage| {
        let exec = Executor::builder().workers(1).deadlock_grace(Duration::from_millis(50)).build();
        let never = Arc::new(Semaphore::new(0));
        let site = Arc::new(Mutex::new(String::new()));
        let h = {
            let (never, site) = (Arc::clone(&never), Arc::clone(&site));
            exec.spawn_with(SpawnOptions::new().name("owner"), move || {
                let handle = spindle_executor::Handle::current().unwrap();
                *site.lock().unwrap() = format!("{}:{}:", file!(), line!() + 1);
                handle.scope(|s| {
                    s.spawn(|| never.acquire());
                });
            })
        };
        stage.set("joining a fiber whose scope waits for a fiber that waits forever");
        let err = h.join().expect_err("the scope can never end");
        assert!(err.is_deadlock(), "{err}");
        let report = err.to_string();
        let site = site.lock().unwrap().clone();
        assert!(
            report.lines().any(|l| l.contains("'owner'") && l.contains("scope") && l.contains(&site)),
            "the owner's wait is reported at {site}:\n{report}"
        );
        never.release(1);
    });
}

/// A long time slice does not delay deadlock detection: sysmon used to nap
/// half a slice while the pool was busy at its maximum, and a deadlock
/// that formed during that nap (a worker that parks does not wake sysmon)
/// went unseen until it ended: half an hour with a one-hour slice.
#[test]
fn a_long_time_slice_does_not_delay_deadlock_detection() {
    watchdog("a_long_time_slice_does_not_delay_deadlock_detection", 30, |stage| {
        let exec = Executor::builder()
            .workers(1)
            .max_workers(1)
            .time_slice(Duration::from_secs(3600))
            .deadlock_grace(Duration::from_millis(100))
            .build();
        let never = Arc::new(Semaphore::new(0));
        let joining = common::Flag::new();
        stage.set("a fiber busy while the test thread starts its join, then asleep for good");
        let (n, j) = (Arc::clone(&never), joining.clone());
        let stuck = exec.spawn(move || {
            // Busy when the join below wakes sysmon, which then picks its
            // nap with the pool busy at its maximum (not synchronisation:
            // the spin after the flag only keeps the fiber busy past that
            // look).
            while !j.is_set() {
                std::hint::spin_loop();
            }
            common::spin_for(Duration::from_millis(50));
            n.acquire();
        });
        stage.set("joining the fiber that can never finish (before the fix: a 30-minute nap)");
        joining.set();
        let err = stuck.join().expect_err("it can never finish");
        assert!(err.is_deadlock(), "expected a deadlock error, got: {err}");
    });
}

/// A fiber that joins its own handle (sent to it through a channel) would
/// wait forever, and deadlock detection, which looks at threads' joins,
/// would not see it: the join fails at once with `JoinedItself`, naming
/// the fiber, and the fiber goes on. (From a review: it slept for good.)
#[test]
fn a_fiber_joining_its_own_handle_fails_at_once() {
    watchdog("a_fiber_joining_its_own_handle_fails_at_once", 30, |stage| {
        let exec = Executor::builder().workers(1).build();
        let (handle_tx, handle_rx) = std::sync::mpsc::channel::<spindle_executor::JoinHandle<()>>();
        let (report_tx, report_rx) = std::sync::mpsc::channel::<String>();
        let handle = exec.spawn_with(SpawnOptions::new().name("narcissus"), move || {
            let me = handle_rx.recv().unwrap();
            let report = match me.join() {
                Err(e @ spindle_executor::JoinError::JoinedItself { .. }) => e.to_string(),
                other => format!("joining itself gave {other:?}"),
            };
            report_tx.send(report).unwrap();
        });
        let id = handle.fiber_id();
        stage.set("handing the fiber its own handle; waiting for its report (a hang: it sleeps in the join)");
        handle_tx.send(handle).unwrap();
        let report = report_rx.recv().unwrap();
        assert!(report.contains("joined its own handle"), "{report}");
        assert!(report.contains("narcissus"), "the report names the fiber: {report}");
        if let Some(id) = id {
            assert!(report.contains(&id.to_string()), "the report has the fiber's id: {report}");
        }
        drop(exec);
    });
}
