//! Timed waits of threads under stress (from a review): spurious unparks,
//! `release(n)` batches while refused fibers pass tokens on through their
//! wait hooks to timed threads, timed lockers, timed receivers and a close.
mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{fiber, watchdog, XorShift};
use spindle_fiber::{FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, Mutex, Semaphore, TimedOut};

fn tiny(rng: &mut XorShift) -> Duration {
    match rng.below(4) {
        0 => Duration::ZERO,
        1 => Duration::from_nanos(rng.below(2000)),
        _ => Duration::from_micros(rng.below(300)),
    }
}

/// Spurious unparks of every waiter thread from a thread of its own.
fn unparker(threads: Vec<std::thread::Thread>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            for t in &threads {
                t.unpark();
            }
            std::thread::yield_now();
        }
    })
}

#[test]
fn semaphore_tokens_conserved_with_timed_threads_batches_and_refused_fibers() {
    watchdog("semaphore_tokens_conserved_with_timed_threads_batches_and_refused_fibers", 120, |stage| {
        for round in 0..40u64 {
            stage.set(format!("round {round}"));
            const K: usize = 3;
            let sem = Arc::new(Semaphore::new(K));
            let held = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            // Orphans: fibers asleep on the semaphore whose queue is gone
            // (their wakes are refused and hand the token on).
            let mut orphans = Vec::new();
            // Take all tokens so orphans can sleep first.
            for _ in 0..K {
                assert!(sem.try_acquire());
            }
            for _ in 0..2 {
                let s = sem.clone();
                let f = fiber(Priority::NORMAL, move || s.acquire());
                let q = RunQueue::new(1);
                q.try_push(f.clone()).unwrap();
                assert!(matches!(q.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
                drop(q);
                orphans.push(f);
            }
            let mut ts = Vec::new();
            for i in 0..4u64 {
                let (s, h, st) = (sem.clone(), held.clone(), stop.clone());
                ts.push(std::thread::spawn(move || {
                    let mut rng = XorShift::new(round * 100 + i + 1);
                    let mut got = 0u64;
                    while !st.load(Ordering::Relaxed) {
                        if s.acquire_timeout(tiny(&mut rng)) {
                            let now = h.fetch_add(1, Ordering::SeqCst) + 1;
                            assert!(now <= K, "{now} tokens held at once, {K} exist");
                            got += 1;
                            h.fetch_sub(1, Ordering::SeqCst);
                            s.release(1);
                        }
                    }
                    got
                }));
            }
            let up = unparker(ts.iter().map(|t| t.thread().clone()).collect(), stop.clone());
            // Give the tokens back in a batch (races the timed takers and
            // the refused orphans at the head of the list).
            std::thread::yield_now();
            sem.release(K);
            std::thread::sleep(Duration::from_millis(30));
            stop.store(true, Ordering::Relaxed);
            for t in ts {
                t.join().unwrap();
            }
            up.join().unwrap();
            // Orphans that are Ready (refused) hold nothing; run them by hand:
            // each either takes a token or waits again.
            let mut orphan_tokens = 0;
            for o in &orphans {
                if o.state() == FiberState::Ready {
                    match o.run() {
                        Ok(RunOutcome::Returned(())) => orphan_tokens += 1,
                        Ok(RunOutcome::Slept) => {}
                        other => panic!("{other:?}"),
                    }
                }
            }
            let waiting = sem.waiters();
            assert_eq!(
                sem.available() + orphan_tokens,
                K,
                "round {round}: tokens after the round (orphans took {orphan_tokens}, {waiting} waiting)"
            );
            // Release the still-waiting orphans' hold: give them tokens to finish.
            sem.release(waiting);
            for o in &orphans {
                if o.state() == FiberState::Ready {
                    let _ = o.run();
                }
            }
        }
    });
}

#[test]
fn mutex_exclusive_with_timed_threads() {
    watchdog("mutex_exclusive_with_timed_threads", 120, |stage| {
        for round in 0..40u64 {
            stage.set(format!("round {round}"));
            let m = Arc::new(Mutex::new(0u64));
            let inside = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let total = Arc::new(AtomicUsize::new(0));
            let mut ts = Vec::new();
            for i in 0..4u64 {
                let (m, inside, st, total) = (m.clone(), inside.clone(), stop.clone(), total.clone());
                ts.push(std::thread::spawn(move || {
                    let mut rng = XorShift::new(round * 100 + i + 7);
                    while !st.load(Ordering::Relaxed) {
                        let g = if i == 0 { Some(m.lock()) } else { m.lock_timeout(tiny(&mut rng)) };
                        if let Some(mut g) = g {
                            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                            *g += 1;
                            total.fetch_add(1, Ordering::SeqCst);
                            if rng.below(4) == 0 {
                                std::thread::yield_now();
                            }
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                }));
            }
            let up = unparker(ts.iter().map(|t| t.thread().clone()).collect(), stop.clone());
            std::thread::sleep(Duration::from_millis(30));
            stop.store(true, Ordering::Relaxed);
            for t in ts {
                t.join().unwrap();
            }
            up.join().unwrap();
            let g = m.try_lock().expect("unlocked at the end");
            assert_eq!(*g as usize, total.load(Ordering::SeqCst));
        }
    });
}

#[test]
fn channel_messages_once_with_timed_receivers_and_close() {
    watchdog("channel_messages_once_with_timed_receivers_and_close", 120, |stage| {
        for round in 0..40u64 {
            stage.set(format!("round {round}"));
            let chan = Arc::new(Channel::<u64>::new());
            let received = Arc::new(parking_lot_free::Counts::default());
            const N: u64 = 2000;
            let mut rs = Vec::new();
            for i in 0..3u64 {
                let (c, r) = (chan.clone(), received.clone());
                rs.push(std::thread::spawn(move || {
                    let mut rng = XorShift::new(round * 100 + i + 13);
                    loop {
                        match c.pop_timeout(tiny(&mut rng)) {
                            Ok(Some(m)) => r.add(m.into_inner()),
                            Ok(None) => {
                                assert!(c.is_closed(), "Ok(None) on an open channel");
                                return;
                            }
                            Err(TimedOut) => {}
                        }
                    }
                }));
            }
            let up =
                unparker(rs.iter().map(|t| t.thread().clone()).collect(), Arc::new(AtomicBool::new(false)));
            drop(up); // detached: stops when the process exits
            for v in 0..N {
                chan.push(Msg::new(v)).unwrap();
                if v % 97 == 0 {
                    std::thread::yield_now();
                }
            }
            chan.close();
            for r in rs {
                r.join().unwrap();
            }
            let mut left = 0;
            while let Some(m) = chan.try_pop() {
                received.add(m.into_inner());
                left += 1;
            }
            let _ = left;
            received.check(N);
        }
    });
}

mod parking_lot_free {
    use std::sync::atomic::{AtomicU64, Ordering};
    #[derive(Default)]
    pub struct Counts {
        count: AtomicU64,
        sum: AtomicU64,
    }
    impl Counts {
        pub fn add(&self, v: u64) {
            self.count.fetch_add(1, Ordering::SeqCst);
            self.sum.fetch_add(v, Ordering::SeqCst);
        }
        pub fn check(&self, n: u64) {
            assert_eq!(self.count.load(Ordering::SeqCst), n);
            assert_eq!(self.sum.load(Ordering::SeqCst), n * (n - 1) / 2);
        }
    }
}

/// Timed waits in the destructors of a fiber dropped while suspended
/// (may_sleep false there: allowed): they time out, and one that is
/// handed a token by another thread takes it.
#[test]
fn timed_waits_in_a_dropped_fibers_destructor() {
    watchdog("timed_waits_in_a_dropped_fibers_destructor", 60, |_| {
        let sem = Arc::new(Semaphore::new(0));
        let m = Arc::new(Mutex::new(()));
        let chan = Arc::new(Channel::<u8>::new());
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        struct D(Arc<Semaphore>, Arc<Mutex<()>>, Arc<Channel<u8>>, Arc<std::sync::Mutex<Vec<String>>>);
        impl Drop for D {
            fn drop(&mut self) {
                let a = self.0.acquire_timeout(Duration::from_millis(10));
                let g = self.1.lock_timeout(Duration::from_millis(10)).is_some();
                let c = self.2.pop_timeout(Duration::from_millis(10)).map(|m| m.map(Msg::into_inner));
                // Now one that a thread hands a token to.
                let b = self.0.acquire_timeout(Duration::from_secs(30));
                self.3.lock().unwrap().push(format!("{a} {g} {c:?} {b}"));
            }
        }
        let held = m.lock();
        let (s, mm, c, l) = (sem.clone(), m.clone(), chan.clone(), log.clone());
        let f = fiber(Priority::NORMAL, move || {
            let _d = D(s, mm, c, l);
            spindle_fiber::yield_now();
        });
        assert!(matches!(f.run(), Ok(RunOutcome::Yielded(0))));
        let s2 = sem.clone();
        let releaser = std::thread::spawn(move || {
            while s2.waiters() == 0 {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(50));
            s2.release(1);
        });
        drop(f);
        releaser.join().unwrap();
        drop(held);
        assert_eq!(*log.lock().unwrap(), vec!["false false Err(TimedOut) true".to_string()]);
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
    });
}
