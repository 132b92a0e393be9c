//! Priorities under saturation: with one worker and more runnable fibers
//! than it can run at once, higher priorities finish first.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::{fiber, watchdog, XorShift};
use spindle_fiber::{yield_now, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::Semaphore;

const LEVELS: [Priority; 3] = [Priority::HIGHEST, Priority::NORMAL, Priority::LOWEST];

/// Fibers of three priorities, pushed in a random interleaving, each
/// yielding many times: one worker finishes every high fiber before any
/// normal one and every normal one before any low one; fibers of one
/// priority share the worker round-robin and finish in push order.
#[test]
fn higher_priorities_finish_first_under_saturation() {
    const PER_LEVEL: usize = 32;
    const YIELDS: usize = 20;
    watchdog("higher_priorities_finish_first_under_saturation", 30, |stage| {
        let queue = RunQueue::<(Priority, usize)>::new(3 * PER_LEVEL);
        let finished = Arc::new(Mutex::new(Vec::new()));
        let mut order: Vec<(Priority, usize)> =
            LEVELS.iter().flat_map(|&p| (0..PER_LEVEL).map(move |i| (p, i))).collect();
        XorShift::new(7).shuffle(&mut order);
        for &(p, i) in &order {
            let done = finished.clone();
            queue
                .try_push(fiber(p, move || {
                    for _ in 0..YIELDS {
                        yield_now();
                    }
                    done.lock().unwrap().push((p, i));
                    (p, i)
                }))
                .unwrap();
        }

        stage.set("running the saturated queue on one worker");
        let mut returned = Vec::new();
        while let Some(ran) = queue.run_next() {
            match ran.outcome {
                Ok(RunOutcome::Yielded(_)) => {}
                Ok(RunOutcome::Returned(v)) => returned.push(v),
                other => panic!("unexpected outcome {other:?}"),
            }
        }
        assert_eq!(*finished.lock().unwrap(), returned);
        assert_eq!(returned.len(), 3 * PER_LEVEL);

        // Expected: by priority, then in push order within a priority.
        let mut expected = order.clone();
        expected.sort_by_key(|&(p, _)| std::cmp::Reverse(p));
        assert_eq!(returned, expected);
        let priorities: Vec<Priority> = returned.iter().map(|&(p, _)| p).collect();
        assert!(
            priorities.windows(2).all(|w| w[0] >= w[1]),
            "a lower priority finished before a higher one: {priorities:?}"
        );
    });
}

/// High-priority fibers woken from a semaphore by another thread, while low
/// ones keep the only worker busy, run to completion before any low fiber
/// finishes; `acquire_with_priority` raises fibers queued at the lowest
/// priority.
#[test]
fn woken_high_priority_fibers_overtake_busy_low_ones() {
    const LOW: usize = 8;
    const HIGH: usize = 8;
    const YIELDS: usize = 10;
    watchdog("woken_high_priority_fibers_overtake_busy_low_ones", 30, |stage| {
        let queue = RunQueue::<(char, usize)>::new(LOW + HIGH);
        let gate = Arc::new(Semaphore::new(0));
        let released = Arc::new(AtomicBool::new(false));
        let finished = Arc::new(Mutex::new(Vec::new()));

        for i in 0..HIGH {
            let (g, done) = (gate.clone(), finished.clone());
            // Half start high; half (the odd ones) start lowest and ask to
            // be woken high.
            let raised = i % 2 == 1;
            let start = if raised { Priority::LOWEST } else { Priority::HIGHEST };
            queue
                .try_push(fiber(start, move || {
                    if raised {
                        g.acquire_with_priority(Priority::HIGHEST);
                    } else {
                        g.acquire();
                    }
                    for _ in 0..YIELDS {
                        yield_now();
                    }
                    done.lock().unwrap().push(('H', i));
                    ('H', i)
                }))
                .unwrap();
        }
        stage.set("putting the high fibers to sleep on the gate");
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        }
        assert_eq!(gate.waiters(), HIGH);

        // The low fibers yield until the gate opened, then once more: by
        // then every high fiber is queued ahead of them. Their priority is
        // above the one the raised high fibers slept at.
        for i in 0..LOW {
            let (rel, done) = (released.clone(), finished.clone());
            queue
                .try_push(fiber(Priority(1), move || {
                    while !rel.load(Ordering::Acquire) {
                        yield_now();
                    }
                    yield_now();
                    done.lock().unwrap().push(('L', i));
                    ('L', i)
                }))
                .unwrap();
        }

        let (g, rel) = (gate.clone(), released.clone());
        let opener = thread::spawn(move || {
            g.release(HIGH);
            rel.store(true, Ordering::Release);
        });

        stage.set("running low fibers until another thread opens the gate");
        let mut returned = Vec::new();
        while returned.len() < LOW + HIGH {
            let f = queue.pop_timeout(Duration::from_secs(600)).expect("the low fibers keep the queue busy");
            match queue.run_popped(f).outcome {
                Ok(RunOutcome::Yielded(_) | RunOutcome::Slept) => {}
                Ok(RunOutcome::Returned(v)) => returned.push(v),
                other => panic!("unexpected outcome {other:?}"),
            }
        }
        opener.join().unwrap();
        assert!(queue.is_empty());
        assert_eq!(*finished.lock().unwrap(), returned);
        let kinds: String = returned.iter().map(|&(k, _)| k).collect();
        assert_eq!(kinds, "H".repeat(HIGH) + &"L".repeat(LOW), "finish order {returned:?}");
        // Within each kind, FIFO: the gate woke high fibers in the order
        // they slept (the HIGHEST ones first, then the raised ones).
        let high: Vec<usize> = returned[..HIGH].iter().map(|&(_, i)| i).collect();
        let evens = (0..HIGH).step_by(2);
        let odds = (1..HIGH).step_by(2);
        assert_eq!(high, evens.chain(odds).collect::<Vec<_>>());
        // The low fibers keep their round-robin order, starting wherever the
        // worker was in the round when the gate opened.
        let low: Vec<usize> = returned[HIGH..].iter().map(|&(_, i)| i).collect();
        let rotated: Vec<usize> = (0..LOW).map(|k| (low[0] + k) % LOW).collect();
        assert_eq!(low, rotated, "low fibers left their round-robin order");
    });
}
