//! The run queue and the `spindle-sync` primitives against their peers,
//! measured side by side in one run.
//!
//! ```text
//! cargo bench -p spindle-benches --bench core
//! ```
//!
//! Groups (each holds spindle and its peers):
//!
//! * `run_queue_push_pop_1thread`: one push and one pop on a queue that
//!   already holds 16 entries, against a `crossbeam-channel` bounded channel
//!   and a `parking_lot::Mutex<VecDeque>` (both carrying plain integers).
//! * `run_queue_push_pop_2threads`: the same, with two threads each pushing
//!   and popping on one shared queue; one iteration is one push+pop pair
//!   done by either thread (wall time / total pairs).
//! * `semaphore_ping_pong`: two fibers on one thread hand a token back and
//!   forth through two semaphores, hand-driven by a `run_next` loop, against
//!   tokio current-thread (`Notify`, and `Semaphore`) and `may` with one
//!   worker (`Semphore`). One iteration is one round trip.
//! * `channel_ping_pong`: the same with two `Channel<u64>` and one reused
//!   `Msg` (nothing allocates), against tokio current-thread mpsc (unbounded,
//!   and bounded to 1) and `may` mpsc with one worker.
//! * `channel_ping_pong_2threads`: the channel ping-pong with two worker
//!   threads running a shared run queue (`pop_timeout` + `run_popped`), so
//!   every handoff may cross threads, against `crossbeam-channel` and
//!   `std::sync::mpsc` between two OS threads.
//! * `yield_alternation`: two fibers alternating by `yield_now` through one
//!   run queue on one thread, against `may` with one worker and tokio
//!   current-thread `yield_now`. One iteration is one yield (one switch
//!   from one fiber to the other).
//! * `mutex_uncontended`: lock and unlock on one thread with nobody
//!   waiting, against `std::sync::Mutex`, `parking_lot::Mutex` and tokio's
//!   `Mutex` (inside one `block_on`). One iteration is one lock+unlock.
//! * `mutex_handoff`: two fibers on one thread each lock, yield while
//!   holding the lock, and unlock, so every lock waits and every unlock
//!   hands the lock to the other fiber; against tokio current-thread
//!   (`Mutex`, `yield_now` while holding) and `may` with one worker
//!   (`may::sync::Mutex`). One iteration is one hand-off.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use parking_lot::Mutex;
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, Semaphore};

/// Entries resident in the queue during the push+pop benchmarks, so that a
/// pop never finds it empty and the heap is not trivially small.
const RESIDENT: usize = 16;
const QUEUE_CAPACITY: usize = 64;

/// A fiber with a function that never runs: something to push and pop.
fn idle_fiber() -> Fiber<()> {
    let f = Fiber::new(FiberAttr::new()).unwrap();
    f.set_function(Priority::NORMAL, || ()).unwrap();
    f
}

/// Single-threaded tokio runtime, as used by every current-thread peer.
fn tokio_current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().build().unwrap()
}

/// Two fresh fibers for a pair that runs through a queue (pooled stacks:
/// no mapping).
fn two_fibers() -> (Fiber<u64>, Fiber<u64>) {
    (Fiber::new(FiberAttr::new()).unwrap(), Fiber::new(FiberAttr::new()).unwrap())
}

/// Runs every fiber of `queue` on this thread until the queue is empty.
fn drain(queue: &RunQueue<u64>) -> u64 {
    let mut result = 0;
    while let Some(ran) = queue.run_next() {
        match ran.outcome {
            Ok(RunOutcome::Returned(v)) => result = result.max(v),
            Ok(_) => {}
            Err(e) => panic!("fiber failed: {e}"),
        }
    }
    result
}

fn push_pop_1thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("run_queue_push_pop_1thread");

    g.bench_function("spindle_run_queue", |b| {
        let q = RunQueue::new(QUEUE_CAPACITY);
        for _ in 0..RESIDENT {
            q.try_push(idle_fiber()).unwrap();
        }
        let mut hand = Some(idle_fiber());
        b.iter(|| {
            q.try_push(hand.take().unwrap()).unwrap();
            hand = q.try_pop();
        });
    });

    g.bench_function("crossbeam_channel", |b| {
        let (tx, rx) = crossbeam_channel::bounded::<usize>(QUEUE_CAPACITY);
        for i in 0..RESIDENT {
            tx.send(i).unwrap();
        }
        let mut hand = RESIDENT;
        b.iter(|| {
            tx.send(hand).unwrap();
            hand = black_box(rx.recv().unwrap());
        });
    });

    g.bench_function("mutex_vecdeque", |b| {
        let q = Mutex::new(VecDeque::<usize>::with_capacity(QUEUE_CAPACITY));
        q.lock().extend(0..RESIDENT);
        let mut hand = RESIDENT;
        b.iter(|| {
            q.lock().push_back(hand);
            hand = black_box(q.lock().pop_front().unwrap());
        });
    });

    g.finish();
}

/// Runs `work` `iters / 2` times (rounded up) on each of two threads from a
/// common start line, each thread owning one of `hands`. Returns the wall
/// time of the slower thread, scaled to exactly `iters` calls, and the hands.
fn two_threads<H: Send>(iters: u64, hands: [H; 2], work: &(impl Fn(&mut H) + Sync)) -> (Duration, [H; 2]) {
    let per_thread = iters.div_ceil(2);
    let start_line = Barrier::new(2);
    let mut done: Vec<(Duration, H)> = std::thread::scope(|s| {
        let threads: Vec<_> = hands
            .into_iter()
            .map(|mut hand| {
                let start_line = &start_line;
                s.spawn(move || {
                    start_line.wait();
                    let start = Instant::now();
                    for _ in 0..per_thread {
                        work(&mut hand);
                    }
                    (start.elapsed(), hand)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let (d1, h1) = done.pop().unwrap();
    let (d0, h0) = done.pop().unwrap();
    let wall = d0.max(d1).mul_f64(iters as f64 / (2 * per_thread) as f64);
    (wall, [h0, h1])
}

fn push_pop_2threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("run_queue_push_pop_2threads");

    g.bench_function("spindle_run_queue", |b| {
        let q = RunQueue::new(QUEUE_CAPACITY);
        for _ in 0..RESIDENT {
            q.try_push(idle_fiber()).unwrap();
        }
        // Each thread holds one fiber: pushes it, pops one. The queue never
        // holds fewer than RESIDENT fibers, so a pop never fails.
        let mut hands = Some([Some(idle_fiber()), Some(idle_fiber())]);
        b.iter_custom(|iters| {
            let work = |hand: &mut Option<Fiber<()>>| {
                q.try_push(hand.take().unwrap()).unwrap();
                *hand = q.try_pop();
            };
            let (wall, h) = two_threads(iters, hands.take().unwrap(), &work);
            hands = Some(h);
            wall
        });
    });

    g.bench_function("crossbeam_channel", |b| {
        let (tx, rx) = crossbeam_channel::bounded::<usize>(QUEUE_CAPACITY);
        for i in 0..RESIDENT {
            tx.send(i).unwrap();
        }
        let mut hands = Some([RESIDENT, RESIDENT + 1]);
        b.iter_custom(|iters| {
            let work = |hand: &mut usize| {
                tx.send(*hand).unwrap();
                *hand = rx.recv().unwrap();
            };
            let (wall, h) = two_threads(iters, hands.take().unwrap(), &work);
            hands = Some(h);
            wall
        });
    });

    g.bench_function("mutex_vecdeque", |b| {
        let q = Mutex::new(VecDeque::<usize>::with_capacity(QUEUE_CAPACITY));
        q.lock().extend(0..RESIDENT);
        let mut hands = Some([RESIDENT, RESIDENT + 1]);
        b.iter_custom(|iters| {
            let work = |hand: &mut usize| {
                q.lock().push_back(*hand);
                *hand = q.lock().pop_front().unwrap();
            };
            let (wall, h) = two_threads(iters, hands.take().unwrap(), &work);
            hands = Some(h);
            wall
        });
    });

    g.finish();
}

/// Nanoseconds since `start`, as a fiber's return value.
fn nanos_since(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

fn semaphore_ping_pong(c: &mut Criterion) {
    let mut g = c.benchmark_group("semaphore_ping_pong");

    g.bench_function("spindle", |b| {
        let q = RunQueue::<u64>::new(4);
        let ping = Arc::new(Semaphore::new(0));
        let pong = Arc::new(Semaphore::new(0));
        b.iter_custom(|iters| {
            // The queue holds the only handles, as when a user pushes
            // fibers and lets them run (stacks come from the pool).
            let (pinger, ponger) = two_fibers();
            let (tx, rx) = (ping.clone(), pong.clone());
            pinger
                .set_function(Priority::NORMAL, move || {
                    let start = Instant::now();
                    for _ in 0..iters {
                        tx.release(1);
                        rx.acquire();
                    }
                    nanos_since(start)
                })
                .unwrap();
            let (rx, tx) = (ping.clone(), pong.clone());
            ponger
                .set_function(Priority::NORMAL, move || {
                    for _ in 0..iters {
                        rx.acquire();
                        tx.release(1);
                    }
                    0
                })
                .unwrap();
            q.try_push(pinger).unwrap();
            q.try_push(ponger).unwrap();
            Duration::from_nanos(drain(&q))
        });
    });

    g.bench_function("tokio_notify", |b| {
        let rt = tokio_current_thread();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let (ping, pong) =
                    (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
                let (tx, rx) = (ping.clone(), pong.clone());
                let pinger = tokio::spawn(async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        tx.notify_one();
                        rx.notified().await;
                    }
                    start.elapsed()
                });
                let ponger = tokio::spawn(async move {
                    for _ in 0..iters {
                        ping.notified().await;
                        pong.notify_one();
                    }
                });
                ponger.await.unwrap();
                pinger.await.unwrap()
            })
        });
    });

    g.bench_function("tokio_semaphore", |b| {
        let rt = tokio_current_thread();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let ping = Arc::new(tokio::sync::Semaphore::new(0));
                let pong = Arc::new(tokio::sync::Semaphore::new(0));
                let (tx, rx) = (ping.clone(), pong.clone());
                let pinger = tokio::spawn(async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        tx.add_permits(1);
                        rx.acquire().await.unwrap().forget();
                    }
                    start.elapsed()
                });
                let ponger = tokio::spawn(async move {
                    for _ in 0..iters {
                        ping.acquire().await.unwrap().forget();
                        pong.add_permits(1);
                    }
                });
                ponger.await.unwrap();
                pinger.await.unwrap()
            })
        });
    });

    g.bench_function("may_1_worker", |b| {
        may::config().set_workers(1);
        b.iter_custom(|iters| {
            let ping = Arc::new(may::sync::Semphore::new(0));
            let pong = Arc::new(may::sync::Semphore::new(0));
            let (tx, rx) = (ping.clone(), pong.clone());
            // may's `go!` is unsafe to call inside: the coroutines keep no
            // thread-local references across their suspensions.
            let pinger = may::go!(move || {
                let start = Instant::now();
                for _ in 0..iters {
                    tx.post();
                    rx.wait();
                }
                start.elapsed()
            });
            let ponger = may::go!(move || {
                for _ in 0..iters {
                    ping.wait();
                    pong.post();
                }
            });
            ponger.join().unwrap();
            pinger.join().unwrap()
        });
    });

    g.finish();
}

/// The pinger and ponger of the spindle channel ping-pong: one `Msg`
/// allocated per run, then passed back and forth.
fn channel_pair(
    iters: u64,
    ping: &Arc<Channel<u64>>,
    pong: &Arc<Channel<u64>>,
) -> (impl FnOnce() -> u64 + Send + 'static, impl FnOnce() -> u64 + Send + 'static) {
    let (tx, rx) = (ping.clone(), pong.clone());
    let pinger = move || {
        let mut msg = Msg::new(0u64);
        let start = Instant::now();
        for _ in 0..iters {
            tx.push(msg).unwrap();
            msg = rx.pop().unwrap();
        }
        assert_eq!(*msg, iters);
        nanos_since(start)
    };
    let (rx, tx) = (ping.clone(), pong.clone());
    let ponger = move || {
        for _ in 0..iters {
            let mut msg = rx.pop().unwrap();
            *msg += 1;
            tx.push(msg).unwrap();
        }
        0
    };
    (pinger, ponger)
}

fn channel_ping_pong(c: &mut Criterion) {
    let mut g = c.benchmark_group("channel_ping_pong");

    g.bench_function("spindle", |b| {
        let q = RunQueue::<u64>::new(4);
        let (ping, pong) = (Arc::new(Channel::new()), Arc::new(Channel::new()));
        b.iter_custom(|iters| {
            let (pinger, ponger) = two_fibers();
            let (ping_fn, pong_fn) = channel_pair(iters, &ping, &pong);
            pinger.set_function(Priority::NORMAL, ping_fn).unwrap();
            ponger.set_function(Priority::NORMAL, pong_fn).unwrap();
            q.try_push(pinger).unwrap();
            q.try_push(ponger).unwrap();
            Duration::from_nanos(drain(&q))
        });
    });

    g.bench_function("tokio_mpsc_unbounded", |b| {
        let rt = tokio_current_thread();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let (tx, mut ping_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
                let (pong_tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
                let pinger = tokio::spawn(async move {
                    let start = Instant::now();
                    let mut v = 0;
                    for _ in 0..iters {
                        tx.send(v).unwrap();
                        v = rx.recv().await.unwrap();
                    }
                    assert_eq!(v, iters);
                    start.elapsed()
                });
                let ponger = tokio::spawn(async move {
                    for _ in 0..iters {
                        let v = ping_rx.recv().await.unwrap();
                        pong_tx.send(v + 1).unwrap();
                    }
                });
                ponger.await.unwrap();
                pinger.await.unwrap()
            })
        });
    });

    g.bench_function("tokio_mpsc_bounded_1", |b| {
        let rt = tokio_current_thread();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let (tx, mut ping_rx) = tokio::sync::mpsc::channel::<u64>(1);
                let (pong_tx, mut rx) = tokio::sync::mpsc::channel::<u64>(1);
                let pinger = tokio::spawn(async move {
                    let start = Instant::now();
                    let mut v = 0;
                    for _ in 0..iters {
                        tx.send(v).await.unwrap();
                        v = rx.recv().await.unwrap();
                    }
                    assert_eq!(v, iters);
                    start.elapsed()
                });
                let ponger = tokio::spawn(async move {
                    for _ in 0..iters {
                        let v = ping_rx.recv().await.unwrap();
                        pong_tx.send(v + 1).await.unwrap();
                    }
                });
                ponger.await.unwrap();
                pinger.await.unwrap()
            })
        });
    });

    g.bench_function("may_mpsc_1_worker", |b| {
        may::config().set_workers(1);
        b.iter_custom(|iters| {
            let (tx, ping_rx) = may::sync::mpsc::channel::<u64>();
            let (pong_tx, rx) = may::sync::mpsc::channel::<u64>();
            // may's `go!` is unsafe to call inside: the coroutines keep no
            // thread-local references across their suspensions.
            let pinger = may::go!(move || {
                let start = Instant::now();
                let mut v = 0;
                for _ in 0..iters {
                    tx.send(v).unwrap();
                    v = rx.recv().unwrap();
                }
                assert_eq!(v, iters);
                start.elapsed()
            });
            let ponger = may::go!(move || {
                for _ in 0..iters {
                    let v = ping_rx.recv().unwrap();
                    pong_tx.send(v + 1).unwrap();
                }
            });
            ponger.join().unwrap();
            pinger.join().unwrap()
        });
    });

    g.finish();
}

fn channel_ping_pong_2threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("channel_ping_pong_2threads");

    g.bench_function("spindle_2_workers", |b| {
        let q = RunQueue::<u64>::new(4);
        let (ping, pong) = (Arc::new(Channel::new()), Arc::new(Channel::new()));
        b.iter_custom(|iters| {
            let (ping_fn, pong_fn) = channel_pair(iters, &ping, &pong);
            let pinger = Fiber::new(FiberAttr::new()).unwrap();
            let ponger = Fiber::new(FiberAttr::new()).unwrap();
            // SAFETY: across their suspensions (the channel pops) the two
            // functions hold only `Send` values (`Arc<Channel<u64>>`,
            // `Msg<u64>`, integers and an `Instant`), hold no reference into
            // a thread-local and read no thread-local themselves.
            unsafe {
                pinger.set_function_migratable(Priority::NORMAL, ping_fn).unwrap();
                ponger.set_function_migratable(Priority::NORMAL, pong_fn).unwrap();
            }
            q.try_push(pinger).unwrap();
            q.try_push(ponger).unwrap();
            let finished = AtomicUsize::new(0);
            let elapsed = AtomicU64::new(0);
            std::thread::scope(|s| {
                for _ in 0..2 {
                    s.spawn(|| {
                        while finished.load(Ordering::Acquire) < 2 {
                            let Some(fiber) = q.pop_timeout(Duration::from_millis(1)) else { continue };
                            match q.run_popped(fiber).outcome {
                                Ok(RunOutcome::Returned(ns)) => {
                                    elapsed.fetch_max(ns, Ordering::Relaxed);
                                    finished.fetch_add(1, Ordering::Release);
                                }
                                Ok(_) => {}
                                Err(e) => panic!("fiber failed: {e}"),
                            }
                        }
                    });
                }
            });
            Duration::from_nanos(elapsed.into_inner())
        });
    });

    g.bench_function("crossbeam_channel_threads", |b| {
        b.iter_custom(|iters| {
            threads_ping_pong(
                iters,
                crossbeam_channel::unbounded::<u64>,
                |tx, v| tx.send(v).unwrap(),
                |rx| rx.recv().unwrap(),
            )
        });
    });

    g.bench_function("std_mpsc_threads", |b| {
        b.iter_custom(|iters| {
            threads_ping_pong(
                iters,
                std::sync::mpsc::channel::<u64>,
                |tx, v| tx.send(v).unwrap(),
                |rx| rx.recv().unwrap(),
            )
        });
    });

    g.finish();
}

/// `iters` round trips between this thread and a scoped one over two
/// channels made by `channel`: a value goes out, comes back one higher.
fn threads_ping_pong<S: Send, R: Send>(
    iters: u64,
    channel: impl Fn() -> (S, R),
    send: impl Fn(&S, u64) + Sync,
    recv: impl Fn(&R) -> u64 + Sync,
) -> Duration {
    let (tx, ping_rx) = channel();
    let (pong_tx, rx) = channel();
    let (send, recv) = (&send, &recv);
    std::thread::scope(|s| {
        s.spawn(move || {
            for _ in 0..iters {
                let v = recv(&ping_rx);
                send(&pong_tx, v + 1);
            }
        });
        let start = Instant::now();
        let mut v = 0;
        for _ in 0..iters {
            send(&tx, v);
            v = recv(&rx);
        }
        assert_eq!(v, iters);
        start.elapsed()
    })
}

fn yield_alternation(c: &mut Criterion) {
    let mut g = c.benchmark_group("yield_alternation");

    // Each side yields `iters` times: 2 * iters switches, so the time of
    // one iteration (one yield) is half the elapsed time.
    g.bench_function("spindle", |b| {
        let q = RunQueue::<u64>::new(4);
        b.iter_custom(|iters| {
            let (first, second) = two_fibers();
            first
                .set_function(Priority::NORMAL, move || {
                    let start = Instant::now();
                    for _ in 0..iters {
                        yield_now();
                    }
                    nanos_since(start)
                })
                .unwrap();
            second
                .set_function(Priority::NORMAL, move || {
                    for _ in 0..iters {
                        yield_now();
                    }
                    0
                })
                .unwrap();
            q.try_push(first).unwrap();
            q.try_push(second).unwrap();
            Duration::from_nanos(drain(&q)) / 2
        });
    });

    g.bench_function("tokio_current_thread", |b| {
        let rt = tokio_current_thread();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let first = tokio::spawn(async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        tokio::task::yield_now().await;
                    }
                    start.elapsed()
                });
                let second = tokio::spawn(async move {
                    for _ in 0..iters {
                        tokio::task::yield_now().await;
                    }
                });
                second.await.unwrap();
                first.await.unwrap() / 2
            })
        });
    });

    g.bench_function("may_1_worker", |b| {
        may::config().set_workers(1);
        b.iter_custom(|iters| {
            // may's `go!` is unsafe to call inside: the coroutines keep no
            // thread-local references across their suspensions.
            let first = may::go!(move || {
                let start = Instant::now();
                for _ in 0..iters {
                    may::coroutine::yield_now();
                }
                start.elapsed()
            });
            let second = may::go!(move || {
                for _ in 0..iters {
                    may::coroutine::yield_now();
                }
            });
            second.join().unwrap();
            first.join().unwrap() / 2
        });
    });

    g.finish();
}

fn mutex_uncontended(c: &mut Criterion) {
    let mut g = c.benchmark_group("mutex_uncontended");

    g.bench_function("spindle", |b| {
        let m = spindle_sync::Mutex::new(0u64);
        b.iter(|| *black_box(&m).lock() += 1);
    });

    g.bench_function("std_mutex", |b| {
        let m = std::sync::Mutex::new(0u64);
        b.iter(|| *black_box(&m).lock().unwrap() += 1);
    });

    g.bench_function("parking_lot_mutex", |b| {
        let m = Mutex::new(0u64);
        b.iter(|| *black_box(&m).lock() += 1);
    });

    g.bench_function("tokio_mutex", |b| {
        let rt = tokio_current_thread();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let m = tokio::sync::Mutex::new(0u64);
                let start = Instant::now();
                for _ in 0..iters {
                    *black_box(&m).lock().await += 1;
                }
                start.elapsed()
            })
        });
    });

    g.finish();
}

fn mutex_handoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("mutex_handoff");

    // Each side locks `iters` times; every lock but the first waits for
    // the other side's unlock: 2 * iters hand-offs, so one iteration (one
    // hand-off) is half the elapsed time.
    g.bench_function("spindle", |b| {
        let q = RunQueue::<u64>::new(4);
        let m = Arc::new(spindle_sync::Mutex::new(0u64));
        b.iter_custom(|iters| {
            let (first, second) = two_fibers();
            let m1 = m.clone();
            first
                .set_function(Priority::NORMAL, move || {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let mut n = m1.lock();
                        yield_now();
                        *n += 1;
                    }
                    nanos_since(start)
                })
                .unwrap();
            let m2 = m.clone();
            second
                .set_function(Priority::NORMAL, move || {
                    for _ in 0..iters {
                        let mut n = m2.lock();
                        yield_now();
                        *n += 1;
                    }
                    0
                })
                .unwrap();
            q.try_push(first).unwrap();
            q.try_push(second).unwrap();
            Duration::from_nanos(drain(&q)) / 2
        });
    });

    g.bench_function("tokio_current_thread", |b| {
        let rt = tokio_current_thread();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let m = Arc::new(tokio::sync::Mutex::new(0u64));
                let m1 = m.clone();
                let first = tokio::spawn(async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let mut n = m1.lock().await;
                        tokio::task::yield_now().await;
                        *n += 1;
                    }
                    start.elapsed()
                });
                let second = tokio::spawn(async move {
                    for _ in 0..iters {
                        let mut n = m.lock().await;
                        tokio::task::yield_now().await;
                        *n += 1;
                    }
                });
                second.await.unwrap();
                first.await.unwrap() / 2
            })
        });
    });

    g.bench_function("may_1_worker", |b| {
        may::config().set_workers(1);
        b.iter_custom(|iters| {
            let m = Arc::new(may::sync::Mutex::new(0u64));
            let m1 = m.clone();
            // may's `go!` is unsafe to call inside: the coroutines keep no
            // thread-local references across their suspensions.
            let first = may::go!(move || {
                let start = Instant::now();
                for _ in 0..iters {
                    let mut n = m1.lock().unwrap();
                    may::coroutine::yield_now();
                    *n += 1;
                }
                start.elapsed()
            });
            let second = may::go!(move || {
                for _ in 0..iters {
                    let mut n = m.lock().unwrap();
                    may::coroutine::yield_now();
                    *n += 1;
                }
            });
            second.join().unwrap();
            first.join().unwrap() / 2
        });
    });

    g.finish();
}

fn config() -> Criterion {
    // Two noisy cores: many samples, long measurements; medians are quoted.
    Criterion::default()
        .sample_size(100)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5))
        .noise_threshold(0.05)
}

criterion_group! {
    name = benches;
    config = config();
    targets = push_pop_1thread, push_pop_2threads, semaphore_ping_pong, channel_ping_pong,
        channel_ping_pong_2threads, yield_alternation, mutex_uncontended, mutex_handoff
}
criterion_main!(benches);
