//! Priorities under saturation: with one worker and a full queue, fibers of
//! a higher priority class all complete before any of a lower class runs.
//! The classes: `Priority::HIGH` and above, `Priority::LOW` and below, and
//! the levels between.

mod common;

use std::sync::{Arc, Mutex};

use common::{wait_for, watchdog, Flag};
use spindle_executor::{yield_now, Executor, Priority, SpawnOptions};
use spindle_sync::Semaphore;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    High,
    Normal,
    Low,
}

#[test]
fn higher_classes_complete_first_under_saturation() {
    watchdog("higher_classes_complete_first_under_saturation", 30, |stage| {
        let exec = Executor::builder().workers(1).max_workers(1).build();
        // The only worker is held by a fiber that spins on the gate (no
        // suspension point), so everything spawned meanwhile stays queued.
        let gate = Arc::new(Semaphore::new(0));
        let holding = Flag::new();
        let holder = {
            let (gate, holding) = (Arc::clone(&gate), holding.clone());
            exec.spawn(move || {
                holding.set();
                while !gate.try_acquire() {
                    std::hint::spin_loop();
                }
            })
        };
        wait_for(&stage, "the gate holder to take the worker", || holding.is_set());

        stage.set("queueing low, normal and high fibers, interleaved");
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        let (mut highs, mut normals, mut lows) = (0, 0, 0);
        for i in 0..600usize {
            let class = match i % 6 {
                0 | 3 => Class::Low,
                1 | 4 => Class::Normal,
                2 => Class::High,
                _ => Class::Low,
            };
            // Each class at both of its ends, alternately: the executor
            // orders by class, FIFO within one, whatever the level.
            let edge = (i / 6) % 2 == 0;
            let priority = match class {
                Class::High => {
                    highs += 1;
                    if edge {
                        Priority::HIGHEST
                    } else {
                        Priority::HIGH
                    }
                }
                Class::Normal => {
                    normals += 1;
                    if edge {
                        Priority(Priority::HIGH.0 - 1)
                    } else {
                        Priority(Priority::LOW.0 + 1)
                    }
                }
                Class::Low => {
                    lows += 1;
                    if edge {
                        Priority::LOW
                    } else {
                        Priority::LOWEST
                    }
                }
            };
            let order = Arc::clone(&order);
            handles.push(exec.spawn_with(SpawnOptions::new().priority(priority), move || {
                yield_now();
                order.lock().unwrap().push((class, i));
            }));
        }
        stage.set("opening the gate");
        gate.release(1);
        holder.join().unwrap();
        for h in handles {
            h.join().unwrap();
        }

        let order = order.lock().unwrap().clone();
        assert_eq!(order.len(), highs + normals + lows);
        let classes: Vec<Class> = order.iter().map(|&(c, _)| c).collect();
        let first_low = classes.iter().position(|&c| c == Class::Low).unwrap();
        let last_high = classes.iter().rposition(|&c| c == Class::High).unwrap();
        assert!(
            last_high < first_low,
            "every high-class fiber completed before any low-class one: last high at {last_high}, first low at {first_low}"
        );
        let mut sorted = classes.clone();
        sorted.sort();
        assert_eq!(classes, sorted, "completion order follows the classes: high, normal, low");
        // Within a class, FIFO: spawn order is kept.
        for class in [Class::High, Class::Normal, Class::Low] {
            let ids: Vec<usize> = order.iter().filter(|&&(c, _)| c == class).map(|&(_, i)| i).collect();
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "{class:?} fibers in spawn order: {ids:?}");
        }
    });
}

#[test]
fn a_high_priority_fiber_overtakes_a_queue_of_normal_ones() {
    watchdog("a_high_priority_fiber_overtakes_a_queue_of_normal_ones", 30, |stage| {
        // Spawned from a fiber on the only worker: nothing runs until it
        // parks in a join, so the whole batch is queued at once.
        let exec = Executor::builder().workers(1).max_workers(1).build();
        stage.set("a fiber queues 200 normal fibers, then one high");
        let order = exec
            .block_on(|| {
                let order = Arc::new(Mutex::new(Vec::new()));
                let mut hs = Vec::new();
                for i in 0..200usize {
                    let order = Arc::clone(&order);
                    hs.push(spindle_executor::spawn(move || order.lock().unwrap().push(i)));
                }
                let o = Arc::clone(&order);
                let handle = spindle_executor::Handle::current().unwrap();
                hs.push(handle.spawn_with(SpawnOptions::new().priority(Priority(200)), move || {
                    o.lock().unwrap().push(usize::MAX)
                }));
                for h in hs {
                    h.join().unwrap();
                }
                let v = order.lock().unwrap().clone();
                v
            })
            .unwrap();
        assert_eq!(order.len(), 201);
        assert_eq!(order[0], usize::MAX, "the high fiber (priority 200) ran first: {:?}", &order[..5]);
    });
}
