//! Timed waits of threads: `Semaphore::acquire_timeout`,
//! `Mutex::lock_timeout`, `Channel::pop_timeout`, and their `_until`
//! forms (a deadline instead of a duration). A wait that times out
//! takes nothing and leaves nothing behind; one handed what it waited for
//! as the timeout passes keeps it; nothing is lost or taken twice when
//! timeouts race releases, unlocks and pushes; in a fiber they panic with
//! the reason.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fiber, spin_until, watchdog};
use spindle_fiber::{Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, Mutex, Semaphore, TimedOut};

const SHORT: Duration = Duration::from_millis(20);
/// Longer than any test runs: a wait that must be ended by a waker.
const LONG: Duration = Duration::from_secs(600);

#[test]
fn a_timed_out_acquire_takes_nothing_and_leaves_no_waiter() {
    watchdog("a_timed_out_acquire_takes_nothing_and_leaves_no_waiter", 30, |_| {
        let sem = Semaphore::new(0);
        let start = Instant::now();
        assert!(!sem.acquire_timeout(SHORT));
        assert!(start.elapsed() >= SHORT, "it waited the whole timeout");
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
        // A token released later is there for the next taker.
        sem.release(1);
        assert!(sem.acquire_timeout(SHORT));
        assert_eq!(sem.available(), 0);
    });
}

#[test]
fn a_release_during_a_timed_acquire_hands_the_token_over() {
    watchdog("a_release_during_a_timed_acquire_hands_the_token_over", 30, |stage| {
        for timeout in [LONG, Duration::MAX] {
            let sem = Arc::new(Semaphore::new(0));
            let s = sem.clone();
            let taker = std::thread::spawn(move || s.acquire_timeout(timeout));
            stage.set(format!("{timeout:?}: waiting for the taker to wait"));
            spin_until(|| sem.waiters() == 1);
            sem.release(1);
            assert!(taker.join().unwrap(), "{timeout:?}: the token was handed over");
            assert_eq!((sem.available(), sem.waiters()), (0, 0));
        }
    });
}

/// A timed-out thread's node leaves the list: the next release goes to the
/// fiber that waited behind it. (The thread's timeout is meant to pass
/// after the fiber is queued behind it; on a machine too slow for that the
/// test still checks that nothing is left behind.)
#[test]
fn a_timed_out_thread_does_not_hold_up_a_fiber_behind_it() {
    watchdog("a_timed_out_thread_does_not_hold_up_a_fiber_behind_it", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let thread = std::thread::spawn(move || s.acquire_timeout(Duration::from_millis(300)));
        spin_until(|| sem.waiters() == 1);
        let queue = RunQueue::new(2);
        let s = sem.clone();
        queue.try_push(fiber(Priority::NORMAL, move || s.acquire())).unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        stage.set("the thread times out");
        assert!(!thread.join().unwrap(), "no token came for the thread");
        assert_eq!(sem.waiters(), 1, "only the fiber waits");
        sem.release(1);
        stage.set("the fiber takes the token");
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Returned(()))));
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
    });
}

/// Timeouts racing releases: every token released is taken exactly once
/// or still there, and no waiter is left.
#[test]
fn timeouts_racing_releases_lose_no_token() {
    const ROUNDS: usize = 200;
    watchdog("timeouts_racing_releases_lose_no_token", 120, |stage| {
        for round in 0..ROUNDS {
            stage.set(format!("round {round}"));
            let sem = Arc::new(Semaphore::new(0));
            let taken = Arc::new(AtomicUsize::new(0));
            let takers: Vec<_> = (0..3)
                .map(|i| {
                    let (sem, taken) = (sem.clone(), taken.clone());
                    std::thread::spawn(move || {
                        for k in 0..20 {
                            let timeout = Duration::from_micros(((round + i + k) % 7) as u64 * 20);
                            if sem.acquire_timeout(timeout) {
                                taken.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    })
                })
                .collect();
            let mut released = 0;
            for k in 0..30 {
                sem.release(1 + k % 2);
                released += 1 + k % 2;
                std::thread::yield_now();
            }
            for t in takers {
                t.join().unwrap();
            }
            assert_eq!(sem.waiters(), 0, "round {round}: a waiter was left behind");
            assert_eq!(
                taken.load(Ordering::SeqCst) + sem.available(),
                released,
                "round {round}: tokens taken plus tokens left"
            );
        }
    });
}

#[test]
fn a_timed_lock_waits_for_the_holder_or_gives_up() {
    watchdog("a_timed_lock_waits_for_the_holder_or_gives_up", 30, |stage| {
        let mutex = Arc::new(Mutex::new(0u32));
        let guard = mutex.lock();
        let m = mutex.clone();
        stage.set("a lock held for good: the timed lock gives up");
        assert!(std::thread::spawn(move || m.lock_timeout(SHORT).is_none()).join().unwrap());
        assert_eq!(mutex.waiters(), 0);
        let m = mutex.clone();
        let locker = std::thread::spawn(move || {
            let mut g = m.lock_timeout(LONG).expect("handed the lock");
            *g += 1;
        });
        stage.set("the holder unlocks: the timed lock gets it");
        spin_until(|| mutex.waiters() == 1);
        drop(guard);
        locker.join().unwrap();
        assert_eq!(*mutex.try_lock().expect("unlocked again"), 1);
    });
}

/// Timed lockers racing plain ones: the lock stays exclusive, every lock
/// taken is counted once, and it ends free with nobody waiting.
#[test]
fn timed_lockers_racing_keep_the_lock_exclusive() {
    watchdog("timed_lockers_racing_keep_the_lock_exclusive", 120, |stage| {
        for round in 0..100usize {
            stage.set(format!("round {round}"));
            let mutex = Arc::new(Mutex::new(0usize));
            let inside = Arc::new(AtomicBool::new(false));
            let got = Arc::new(AtomicUsize::new(0));
            let threads: Vec<_> = (0..3)
                .map(|i| {
                    let (mutex, inside, got) = (mutex.clone(), inside.clone(), got.clone());
                    std::thread::spawn(move || {
                        for k in 0..20 {
                            let guard = if i == 0 {
                                Some(mutex.lock())
                            } else {
                                mutex.lock_timeout(Duration::from_micros(((round + k) % 5) as u64 * 10))
                            };
                            if let Some(mut g) = guard {
                                assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                                *g += 1;
                                got.fetch_add(1, Ordering::SeqCst);
                                std::thread::yield_now();
                                inside.store(false, Ordering::SeqCst);
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(mutex.waiters(), 0, "round {round}");
            let g = mutex.try_lock().expect("the lock ends free");
            assert_eq!(*g, got.load(Ordering::SeqCst), "round {round}: every lock counted once");
        }
    });
}

#[test]
fn a_timed_pop_gets_a_message_a_close_or_times_out() {
    watchdog("a_timed_pop_gets_a_message_a_close_or_times_out", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        assert_eq!(chan.pop_timeout(SHORT).map(|m| m.map(Msg::into_inner)), Err(TimedOut));
        assert_eq!(chan.receivers(), 0, "a pop that timed out leaves no receiver");

        stage.set("a push during the wait");
        let c = chan.clone();
        let rx = std::thread::spawn(move || c.pop_timeout(LONG).map(|m| m.map(Msg::into_inner)));
        spin_until(|| chan.receivers() == 1);
        chan.push(Msg::new(7)).unwrap();
        assert_eq!(rx.join().unwrap(), Ok(Some(7)));

        stage.set("a close during the wait");
        let c = chan.clone();
        let rx = std::thread::spawn(move || c.pop_timeout(LONG).map(|m| m.map(Msg::into_inner)));
        spin_until(|| chan.receivers() == 1);
        chan.close();
        assert_eq!(rx.join().unwrap(), Ok(None));
        assert_eq!(chan.receivers(), 0);
    });
}

/// Timed receivers racing pushers: every message is received exactly once
/// or still queued, and no receiver is left.
#[test]
fn timed_pops_racing_pushes_lose_no_message() {
    const MESSAGES: usize = 60;
    watchdog("timed_pops_racing_pushes_lose_no_message", 120, |stage| {
        for round in 0..100usize {
            stage.set(format!("round {round}"));
            let chan = Arc::new(Channel::<usize>::new());
            let seen: Arc<Vec<AtomicUsize>> = Arc::new((0..MESSAGES).map(|_| AtomicUsize::new(0)).collect());
            let receivers: Vec<_> = (0..3)
                .map(|i| {
                    let (chan, seen) = (chan.clone(), seen.clone());
                    std::thread::spawn(move || {
                        for k in 0..30 {
                            let timeout = Duration::from_micros(((round + i + k) % 6) as u64 * 15);
                            if let Ok(Some(m)) = chan.pop_timeout(timeout) {
                                seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    })
                })
                .collect();
            for id in 0..MESSAGES {
                chan.push(Msg::new(id)).unwrap();
                if id % 3 == 0 {
                    std::thread::yield_now();
                }
            }
            for r in receivers {
                r.join().unwrap();
            }
            assert_eq!(chan.receivers(), 0, "round {round}: a receiver was left behind");
            while let Some(m) = chan.try_pop() {
                seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
            }
            for (id, n) in seen.iter().enumerate() {
                assert_eq!(n.load(Ordering::SeqCst), 1, "round {round}: message {id}");
            }
        }
    });
}

/// In a fiber, a timed wait panics with the reason and what to use
/// instead (no clock here could wake the fiber at the deadline).
#[test]
fn a_timed_wait_in_a_fiber_panics_with_the_reason() {
    watchdog("a_timed_wait_in_a_fiber_panics_with_the_reason", 30, |_| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || s.acquire_timeout(SHORT));
        match f.run() {
            Ok(RunOutcome::Panicked(p)) => {
                let msg = p.message().unwrap_or_default().to_owned();
                assert!(
                    msg.contains("Semaphore::acquire_timeout called in a fiber")
                        && msg.contains("timed waits are for threads")
                        && msg.contains("interrupt_after"),
                    "{msg}"
                );
            }
            other => panic!("expected the panic, got {other:?}"),
        }
        assert_eq!(sem.waiters(), 0);
    });
}

/// The `_until` forms: a deadline already past still takes what is there
/// now and otherwise returns at once; a future one waits until it
/// passes; a waker before it hands over what it waited for. One deadline
/// serves several waits.
#[test]
fn until_forms_wait_until_the_deadline_and_take_what_is_there() {
    watchdog("until_forms_wait_until_the_deadline_and_take_what_is_there", 30, |stage| {
        stage.set("past deadlines");
        let past = Instant::now();
        let sem = Semaphore::new(1);
        assert!(sem.acquire_until(past), "a token there now is taken");
        assert!(!sem.acquire_until(past), "none there: at once");
        let mutex = Mutex::new(5);
        let guard = mutex.lock_until(past).expect("a free lock is taken");
        std::thread::scope(|s| {
            s.spawn(|| assert!(mutex.lock_until(past).is_none(), "held: at once"));
        });
        drop(guard);
        let chan = Channel::new();
        assert_eq!(chan.pop_until(past).map(|m| m.map(Msg::into_inner)), Err(TimedOut));
        chan.push(Msg::new(3u32)).unwrap();
        assert_eq!(chan.pop_until(past).map(|m| m.map(Msg::into_inner)), Ok(Some(3)));
        assert_eq!((sem.waiters(), chan.receivers()), (0, 0), "nothing left behind");

        stage.set("one future deadline shared by three waits");
        let deadline = Instant::now() + SHORT;
        assert!(!sem.acquire_until(deadline));
        assert!(Instant::now() >= deadline, "the wait lasted until the deadline");
        let guard = mutex.lock();
        std::thread::scope(|s| {
            s.spawn(|| assert!(mutex.lock_until(deadline).is_none(), "past by now"));
        });
        drop(guard);
        assert_eq!(chan.pop_until(deadline).map(|m| m.map(Msg::into_inner)), Err(TimedOut));
        assert_eq!((sem.waiters(), mutex.waiters(), chan.receivers()), (0, 0, 0));

        stage.set("woken before the deadline");
        let far = Instant::now() + LONG;
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let taker = std::thread::spawn(move || s.acquire_until(far));
        spin_until(|| sem.waiters() == 1);
        sem.release(1);
        assert!(taker.join().unwrap(), "the token was handed over");

        let mutex = Arc::new(Mutex::new(0));
        let guard = mutex.lock();
        let m = mutex.clone();
        let locker = std::thread::spawn(move || m.lock_until(far).map(|mut g| std::mem::replace(&mut *g, 2)));
        spin_until(|| mutex.waiters() == 1);
        drop(guard);
        assert_eq!(locker.join().unwrap(), Some(0), "the lock was handed over");
        assert_eq!(*mutex.lock(), 2);

        let chan = Arc::new(Channel::<u32>::new());
        let c = chan.clone();
        let rx = std::thread::spawn(move || c.pop_until(far).map(|m| m.map(Msg::into_inner)));
        spin_until(|| chan.receivers() == 1);
        chan.push(Msg::new(9)).unwrap();
        assert_eq!(rx.join().unwrap(), Ok(Some(9)));
    });
}

/// The `_until` forms panic in a fiber as the `_timeout` forms do, naming
/// themselves.
#[test]
fn until_forms_in_a_fiber_panic_with_the_reason() {
    watchdog("until_forms_in_a_fiber_panic_with_the_reason", 30, |_| {
        let sem = Arc::new(Semaphore::new(0));
        let mutex = Arc::new(Mutex::new(()));
        let chan = Arc::new(Channel::<u32>::new());
        let deadline = Instant::now() + SHORT;
        type Wait = Box<dyn FnOnce() + Send>;
        let waits: [(&str, Wait); 3] = [
            ("Semaphore::acquire_until", {
                let sem = sem.clone();
                Box::new(move || {
                    let _ = sem.acquire_until(deadline);
                })
            }),
            ("Mutex::lock_until", {
                let mutex = mutex.clone();
                Box::new(move || drop(mutex.lock_until(deadline)))
            }),
            ("Channel::pop_until", {
                let chan = chan.clone();
                Box::new(move || drop(chan.pop_until(deadline)))
            }),
        ];
        for (name, wait) in waits {
            let f = fiber(Priority::NORMAL, wait);
            match f.run() {
                Ok(RunOutcome::Panicked(p)) => {
                    let msg = p.message().unwrap_or_default().to_owned();
                    assert!(
                        msg.contains(&format!("{name} called in a fiber")) && msg.contains("interrupt_at"),
                        "{name}: {msg}"
                    );
                }
                other => panic!("{name}: expected the panic, got {other:?}"),
            }
        }
        assert_eq!((sem.waiters(), mutex.waiters(), chan.receivers()), (0, 0, 0));
        assert!(!mutex.is_locked());
    });
}

/// `RawChannel::pop_until`: a past deadline with nothing there, a header
/// there now, a future deadline that passes, a closed channel, and the
/// panic naming it in a fiber. (From a review.)
#[test]
fn raw_pop_until_times_out_takes_and_panics_in_a_fiber() {
    watchdog("raw_pop_until_times_out_takes_and_panics_in_a_fiber", 30, |_| {
        let chan = spindle_sync::RawChannel::new();
        let past = Instant::now();
        assert_eq!(chan.pop_until(past), Err(TimedOut));
        let mut buf = [0u8; 4];
        let mut hdr = spindle_sync::MsgHeader::new(buf.as_mut_ptr(), buf.len());
        let p = std::ptr::NonNull::from(&mut hdr);
        // SAFETY: the header lives (unmoved) until popped below.
        unsafe { chan.push(p).unwrap() };
        assert_eq!(chan.pop_until(past), Ok(Some(p)));
        let start = Instant::now();
        assert_eq!(chan.pop_until(start + Duration::from_millis(20)), Err(TimedOut));
        assert!(start.elapsed() >= Duration::from_millis(20));
        chan.close();
        assert_eq!(chan.pop_until(past), Ok(None));

        let chan = Arc::new(spindle_sync::RawChannel::new());
        let c = chan.clone();
        let f = fiber(Priority::NORMAL, move || {
            let _ = c.pop_until(Instant::now() + Duration::from_millis(20));
        });
        match f.run() {
            Ok(RunOutcome::Panicked(p)) => {
                let msg = p.message().unwrap_or_default().to_owned();
                assert!(msg.contains("RawChannel::pop_until called in a fiber"), "{msg}");
            }
            other => panic!("expected the panic, got {other:?}"),
        }
    });
}

/// The `_until` forms in the destructor of a fiber dropped while
/// suspended (may_sleep false): allowed, they time out on the thread, as
/// the `_timeout` forms do (timed_waits_in_a_dropped_fibers_destructor).
/// (From a review.)
#[test]
fn until_forms_in_a_dropped_fibers_destructor() {
    watchdog("until_forms_in_a_dropped_fibers_destructor", 60, |_| {
        let sem = Arc::new(Semaphore::new(0));
        let m = Arc::new(Mutex::new(()));
        let chan = Arc::new(Channel::<u8>::new());
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        struct D(Arc<Semaphore>, Arc<Mutex<()>>, Arc<Channel<u8>>, Arc<std::sync::Mutex<Vec<String>>>);
        impl Drop for D {
            fn drop(&mut self) {
                let d = Instant::now() + Duration::from_millis(10);
                let a = self.0.acquire_until(d);
                let g = self.1.lock_until(d).is_some();
                let c = self.2.pop_until(d).map(|m| m.map(Msg::into_inner));
                let late = Instant::now() >= d;
                self.3.lock().unwrap().push(format!("{a} {g} {c:?} {late}"));
            }
        }
        let held = m.lock();
        let (s, mm, c, l) = (sem.clone(), m.clone(), chan.clone(), log.clone());
        let f = fiber(Priority::NORMAL, move || {
            let _d = D(s, mm, c, l);
            spindle_fiber::yield_now();
        });
        assert!(matches!(f.run(), Ok(RunOutcome::Yielded(0))));
        drop(f);
        drop(held);
        assert_eq!(*log.lock().unwrap(), vec!["false false Err(TimedOut) true".to_string()]);
        assert_eq!((sem.waiters(), m.waiters(), chan.receivers()), (0, 0, 0));
    });
}
