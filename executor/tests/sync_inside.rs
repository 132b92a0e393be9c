//! `spindle-sync` primitives work unchanged between executor fibers (the
//! executor implements the fiber crate's wake seam).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{size, watchdog};
use spindle_executor::{spawn, Executor};
use spindle_sync::{Channel, Msg, Semaphore};

const MESSAGES: u64 = 10_000;

#[test]
fn semaphore_ping_pong_between_two_fibers() {
    watchdog("semaphore_ping_pong_between_two_fibers", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let ping = Arc::new(Semaphore::new(0));
        let pong = Arc::new(Semaphore::new(0));
        let turns = Arc::new(AtomicU64::new(0));
        let rounds = MESSAGES;
        stage.set(format!("{rounds} rounds of ping-pong"));
        let pinger = {
            let (ping, pong, turns) = (Arc::clone(&ping), Arc::clone(&pong), Arc::clone(&turns));
            exec.spawn(move || {
                for i in 0..rounds {
                    // Strict alternation: an odd count here means the other
                    // side ran twice in a row.
                    assert_eq!(turns.fetch_add(1, Ordering::SeqCst), 2 * i);
                    ping.release(1);
                    pong.acquire();
                }
            })
        };
        let ponger = {
            let (ping, pong, turns) = (Arc::clone(&ping), Arc::clone(&pong), Arc::clone(&turns));
            exec.spawn(move || {
                for i in 0..rounds {
                    ping.acquire();
                    assert_eq!(turns.fetch_add(1, Ordering::SeqCst), 2 * i + 1);
                    pong.release(1);
                }
            })
        };
        pinger.join().unwrap();
        ponger.join().unwrap();
        assert_eq!(turns.load(Ordering::SeqCst), 2 * rounds);
        assert_eq!(ping.available() + pong.available(), 0);
    });
}

#[test]
fn channel_producer_consumer_between_fibers() {
    watchdog("channel_producer_consumer_between_fibers", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let chan = Arc::new(Channel::<u64>::new());
        stage.set(format!("{MESSAGES} messages from one fiber to another"));
        let consumer = {
            let chan = Arc::clone(&chan);
            exec.spawn(move || {
                let mut sum = 0;
                for expected in 0..MESSAGES {
                    let v = chan.pop().unwrap().into_inner();
                    assert_eq!(v, expected, "FIFO from a single producer");
                    sum += v;
                }
                sum
            })
        };
        let producer = {
            let chan = Arc::clone(&chan);
            exec.spawn(move || {
                for i in 0..MESSAGES {
                    chan.push(Msg::new(i)).unwrap();
                    if i % 64 == 0 {
                        spindle_executor::yield_now();
                    }
                }
            })
        };
        producer.join().unwrap();
        assert_eq!(consumer.join().unwrap(), (0..MESSAGES).sum::<u64>());
        assert!(chan.is_empty());
    });
}

#[test]
fn channel_many_producers_many_consumers() {
    watchdog("channel_many_producers_many_consumers", 30, |stage| {
        let exec = Executor::builder().workers(2).build();
        let chan = Arc::new(Channel::<u64>::new());
        let producers = 4u64;
        let consumers = 4u64;
        let per_producer = size(2_500, 25_000) as u64;
        let total = producers * per_producer;
        assert_eq!(total % consumers, 0);
        stage.set(format!("{producers} producers, {consumers} consumers, {total} messages"));
        let sum = exec
            .block_on(move || {
                let cs: Vec<_> = (0..consumers)
                    .map(|_| {
                        let chan = Arc::clone(&chan);
                        spawn(move || {
                            (0..total / consumers).map(|_| chan.pop().unwrap().into_inner()).sum::<u64>()
                        })
                    })
                    .collect();
                let ps: Vec<_> = (0..producers)
                    .map(|p| {
                        let chan = Arc::clone(&chan);
                        spawn(move || {
                            for i in 0..per_producer {
                                chan.push(Msg::new(p * per_producer + i)).unwrap();
                            }
                        })
                    })
                    .collect();
                for p in ps {
                    p.join().unwrap();
                }
                cs.into_iter().map(|c| c.join().unwrap()).sum::<u64>()
            })
            .unwrap();
        assert_eq!(sum, (0..total).sum::<u64>());
    });
}

#[test]
fn semaphore_between_a_thread_and_fibers() {
    watchdog("semaphore_between_a_thread_and_fibers", 30, |stage| {
        // Fibers wait on a semaphore a plain thread releases, and the thread
        // waits (parks) on one the fibers release.
        let exec = Executor::builder().workers(2).build();
        let to_fibers = Arc::new(Semaphore::new(0));
        let to_thread = Arc::new(Semaphore::new(0));
        let n = 100;
        let hs: Vec<_> = (0..n)
            .map(|_| {
                let (rx, tx) = (Arc::clone(&to_fibers), Arc::clone(&to_thread));
                exec.spawn(move || {
                    rx.acquire();
                    tx.release(1);
                })
            })
            .collect();
        stage.set("releasing the fibers one by one from the thread");
        for _ in 0..n {
            to_fibers.release(1);
            to_thread.acquire();
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(to_fibers.available() + to_thread.available(), 0);
    });
}

/// Executor fibers on two workers take turns on a `spindle_sync::Mutex`,
/// holding it across yields; a cancelled fiber waiting in
/// `lock_interruptible` gives up without the lock.
#[test]
fn mutex_between_fibers_held_across_yields_and_a_cancelled_waiter() {
    watchdog("mutex_between_fibers_held_across_yields_and_a_cancelled_waiter", 60, |stage| {
        const FIBERS: u64 = 8;
        let rounds = size(200, 2_000) as u64;
        let exec = Executor::builder().workers(2).build();
        let counter = Arc::new(spindle_sync::Mutex::new(0u64));
        stage.set(format!("{FIBERS} fibers x {rounds} increments across yields"));
        let handles: Vec<_> = (0..FIBERS)
            .map(|_| {
                let counter = Arc::clone(&counter);
                exec.spawn(move || {
                    for _ in 0..rounds {
                        let mut n = counter.lock();
                        let seen = *n;
                        spindle_executor::yield_now();
                        *n = seen + 1;
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(*counter.lock(), FIBERS * rounds);

        stage.set("a cancelled waiter");
        let held = counter.lock();
        let waiter = {
            let counter = Arc::clone(&counter);
            exec.spawn(move || counter.lock_interruptible().is_ok())
        };
        common::wait_for(&stage, "the waiter asleep on the lock", || counter.waiters() == 1);
        waiter.cancel();
        // The wait returned `Interrupted`; no cancellation point follows.
        assert!(!waiter.join().unwrap(), "the cancelled waiter did not get the lock");
        assert_eq!(counter.waiters(), 0);
        drop(held);
        assert!(!counter.is_locked());
    });
}

/// Executor fibers read a channel until it is closed: the producer pushes
/// and closes, the consumers' `pop` returns `None` once the queue is
/// empty (those asleep at the close are woken with `None`).
#[test]
fn consumers_read_until_the_channel_is_closed() {
    watchdog("consumers_read_until_the_channel_is_closed", 60, |stage| {
        const CONSUMERS: u64 = 4;
        let exec = Executor::builder().workers(2).build();
        let chan = Arc::new(Channel::<u64>::new());
        let consumers: Vec<_> = (0..CONSUMERS)
            .map(|_| {
                let chan = Arc::clone(&chan);
                exec.spawn(move || {
                    let mut sum = 0;
                    while let Some(m) = chan.pop() {
                        sum += m.into_inner();
                    }
                    sum
                })
            })
            .collect();
        stage.set(format!("{MESSAGES} messages, then the close"));
        let producer = {
            let chan = Arc::clone(&chan);
            exec.spawn(move || {
                for i in 1..=MESSAGES {
                    chan.push(Msg::new(i)).unwrap();
                    if i % 100 == 0 {
                        spindle_executor::yield_now();
                    }
                }
                chan.close();
            })
        };
        producer.join().unwrap();
        let total: u64 = consumers.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, MESSAGES * (MESSAGES + 1) / 2);
        assert_eq!((chan.len(), chan.receivers()), (0, 0));
    });
}
