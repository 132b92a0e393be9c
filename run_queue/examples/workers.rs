//! Your own worker threads over a run queue, with the safe API only.
//!
//! ```text
//! cargo run --release -p spindle-run-queue --example workers
//! ```
//!
//! One producer fiber sends numbers down a channel and closes it; consumer
//! fibers sum them until the channel is closed and empty, yielding now and
//! then, and report their sums on a second channel
//! that the main thread (an ordinary thread) reads. A semaphore of credits
//! bounds how far the producer runs ahead: it sleeps when they run out and
//! a consumer's release wakes it, and consumers sleep on the empty channel
//! until a push wakes them, so the queue's wake count is rarely zero. Every
//! fiber is set up with the safe `set_function`, so it is pinned to one
//! worker for good. Left alone, that would be whichever worker ran it
//! first (on two cores one worker often takes them all); here each worker
//! hands out its `ThreadToken` when it starts, and the main thread pins
//! the fibers to the workers by turns with `Fiber::pin_to` before pushing
//! them (a worker that pops a fiber pinned to another sets it aside for
//! that one). That spreads the fibers, not necessarily the work: the
//! consumers race for one channel, and on a busy machine one worker's
//! consumers can take nearly every number (the run counts show it). The
//! workers keep popping until every fiber has finished, and only then
//! stop: the worker that sees the last fiber end closes the queue, and
//! every worker's `pop` returns `None` (a worker that stopped earlier would
//! strand the fibers pinned to it). Migratable fibers, set with the
//! `unsafe` `set_function_migratable`, may run on any worker.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome, ThreadToken};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, Semaphore};

const WORKERS: usize = 2;
const CONSUMERS: usize = 6;
const NUMBERS: u64 = 10_000;
/// Numbers the producer may push before a consumer has taken them.
const CREDITS: usize = 32;

fn main() {
    if std::env::args().len() > 1 {
        eprintln!("usage: workers (takes no arguments)");
        std::process::exit(2);
    }
    let queue = RunQueue::new(CONSUMERS + 1);
    let numbers = Arc::new(Channel::<u64>::new());
    let sums = Arc::new(Channel::<u64>::new());
    let credits = Arc::new(Semaphore::new(CREDITS));

    // The workers start first and say who they are: each fiber is pinned
    // to one of them before it is pushed.
    let finished = Arc::new(AtomicUsize::new(0));
    let (token_tx, token_rx) = std::sync::mpsc::channel();
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (queue, finished, token_tx) = (queue.clone(), finished.clone(), token_tx.clone());
            std::thread::spawn(move || {
                let me = ThreadToken::current();
                token_tx.send(me).unwrap();
                let mut runs = 0u64;
                // Until the queue is closed, not until it looks empty: a
                // sleeping fiber is in no queue, and may be pinned to this
                // thread. `pop` parks while there is nothing to run.
                while let Some(fiber) = queue.pop() {
                    runs += 1;
                    // The worker that sees the last fiber end closes the
                    // queue: no fiber can come back to it now, and every
                    // worker's `pop` returns `None`.
                    let ended = || {
                        if finished.fetch_add(1, Ordering::AcqRel) + 1 == CONSUMERS + 1 {
                            queue.close();
                        }
                    };
                    match queue.run_popped(fiber).outcome {
                        Ok(RunOutcome::Returned(())) => ended(),
                        Ok(RunOutcome::Panicked(p)) => {
                            eprintln!("worker {w}: {p}");
                            ended();
                        }
                        // Yielded: back in the queue; slept: a wake puts it back.
                        Ok(_) => {}
                        Err(e) => panic!("worker {w}: {e}"),
                    }
                }
                (me, runs)
            })
        })
        .collect();

    let tokens: Vec<ThreadToken> = token_rx.iter().take(WORKERS).collect();
    // Pins a fiber to the next worker by turns, counting each worker's.
    let mut pinned = [0usize; WORKERS];
    let mut turn = 0;
    let mut pin = |fiber: &Fiber| {
        let w = turn % WORKERS;
        turn += 1;
        fiber.pin_to(tokens[w]).unwrap();
        pinned[w] += 1;
    };

    // The producer: every number, then it closes the channel.
    let producer = Fiber::new(FiberAttr::new().name("producer")).unwrap();
    let (tx, credit) = (numbers.clone(), credits.clone());
    producer
        .set_function(Priority::HIGHEST, move || {
            for n in 1..=NUMBERS {
                // Sleeps while the consumers are `CREDITS` numbers behind;
                // the first release wakes it back onto the queue.
                credit.acquire();
                tx.push(Msg::new(n)).expect("open until the producer closes it");
            }
            // Consumers take what is queued, then `pop` gives them `None`.
            tx.close();
        })
        .unwrap();
    pin(&producer);
    queue.try_push(producer).unwrap();

    for i in 0..CONSUMERS {
        let consumer = Fiber::new(FiberAttr::new().name(format!("consumer {i}"))).unwrap();
        let (rx, out, credit) = (numbers.clone(), sums.clone(), credits.clone());
        consumer
            .set_function(Priority::NORMAL, move || {
                let mut sum = 0;
                // `pop` puts the fiber to sleep while the channel is empty;
                // the producer's push (or its close) wakes it back onto the
                // queue.
                while let Some(n) = rx.pop().map(Msg::into_inner) {
                    credit.release(1);
                    sum += n;
                    if n % 64 == 0 {
                        yield_now(); // give the other consumers a turn
                    }
                }
                out.push(Msg::new(sum)).unwrap();
            })
            .unwrap();
        pin(&consumer);
        queue.try_push(consumer).unwrap();
    }

    // An ordinary thread waits on the same channel type: it parks.
    let total: u64 = (0..CONSUMERS).map(|_| sums.pop().unwrap().into_inner()).sum();
    let runs: Vec<(ThreadToken, u64)> = workers.into_iter().map(|w| w.join().unwrap()).collect();

    let stats = queue.stats();
    println!("{WORKERS} workers, {} fibers, {NUMBERS} numbers", CONSUMERS + 1);
    for (w, (me, r)) in runs.iter().enumerate() {
        let mine = pinned[tokens.iter().position(|t| t == me).expect("every worker sent its token")];
        println!("worker {w}: {mine} fibers pinned to it, {r} fiber runs");
    }
    println!(
        "queue: {} pushes, {} wakes, {} pops, {} set aside for their own thread",
        stats.pushes, stats.wakes, stats.pops, stats.wrong_thread
    );
    assert_eq!(total, NUMBERS * (NUMBERS + 1) / 2, "every number was summed once");
    assert!(queue.is_empty());
    println!("ok: the sums add up to {total}");
}
