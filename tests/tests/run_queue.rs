//! The priority run queue: capacity, priority order, FIFO among equals,
//! refusals that hand the fiber back, priority changes, parking pops.

mod common;

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{fiber, named_fiber, spin_until, watchdog, DropCounter, XorShift};
use spindle_fiber::{yield_now, Fiber, FiberError, FiberState, Priority, RunOutcome, ThreadToken};
use spindle_run_queue::{PushError, RunQueue};
use spindle_sync::Semaphore;

/// 256 fibers in a queue of capacity 256, many trials of random
/// priorities: the 257th push is refused as full and hands the fiber back,
/// pops come out by priority (FIFO among equals), an empty pop is `None`.
#[test]
fn full_queue_refuses_and_pops_come_out_by_priority() {
    const N: usize = 256;
    const TRIALS: usize = 50;
    let queue = RunQueue::<usize>::new(N);
    assert_eq!(queue.capacity(), N);
    // The fibers are created once and reused: never run, they stay Ready.
    let fibers: Vec<Fiber<usize>> = (0..N).map(|i| fiber(Priority::NORMAL, move || i)).collect();
    let extra = fiber(Priority::HIGHEST, || usize::MAX);
    let mut rng = XorShift::new(0x5eed_0003);
    let mut full_pushes = 0;

    for trial in 0..TRIALS {
        // Odd trials draw from 4 levels, to get many ties.
        let levels = if trial % 2 == 1 { 4 } else { 256 };
        let mut order: Vec<usize> = (0..N).collect();
        rng.shuffle(&mut order);
        let mut pushed = Vec::with_capacity(N); // (priority, push position, fiber index)
        for (pos, &i) in order.iter().enumerate() {
            let p = Priority(rng.below(levels) as u8);
            fibers[i].set_priority(p);
            queue.try_push(fibers[i].clone()).unwrap_or_else(|e| panic!("trial {trial}: push {pos}: {e}"));
            assert_eq!(fibers[i].state(), FiberState::Queued);
            pushed.push((p, pos, i));
        }
        assert_eq!(queue.len(), N);

        match queue.try_push(extra.clone()) {
            Err(PushError::Full(back)) => {
                assert!(Fiber::ptr_eq(&back, &extra), "the refused fiber is handed back");
                assert_eq!(back.state(), FiberState::Ready, "a refused fiber stays runnable");
            }
            other => panic!("trial {trial}: push into a full queue gave {other:?}"),
        }
        full_pushes += 1;
        // The refused fiber can be recovered through into_fiber too.
        let err = queue.try_push(extra.clone()).expect_err("the queue is still full");
        assert!(matches!(err, PushError::Full(_)), "{err:?}");
        assert!(Fiber::ptr_eq(&err.into_fiber(), &extra));
        full_pushes += 1;
        assert_eq!(queue.len(), N);

        // Expected: highest priority first, push order among equals.
        pushed.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut last = Priority::HIGHEST;
        for (k, &(p, _, i)) in pushed.iter().enumerate() {
            let popped = queue.try_pop().unwrap_or_else(|| panic!("trial {trial}: pop {k} was empty"));
            assert!(popped.priority() <= last, "trial {trial}: pop {k} went up in priority");
            last = popped.priority();
            assert!(
                Fiber::ptr_eq(&popped, &fibers[i]),
                "trial {trial}: pop {k}: expected fiber {i} at {p:?}, got {:?} at {:?}",
                popped.id(),
                popped.priority()
            );
            assert_eq!(popped.state(), FiberState::Ready, "a popped fiber is runnable");
        }
        assert!(queue.try_pop().is_none(), "trial {trial}: the queue should be empty");
        assert!(queue.is_empty());
    }

    let stats = queue.stats();
    assert_eq!(stats.pushes, (N * TRIALS) as u64);
    assert_eq!(stats.pops, (N * TRIALS) as u64);
    assert_eq!(stats.empty_pops, TRIALS as u64);
    assert_eq!(stats.full_pushes, full_pushes);
    assert_eq!(stats.wakes, 0);

    // The fibers still work after all that queueing.
    assert_eq!(fibers[7].run().unwrap().unwrap_returned(), 7);
    assert_eq!(extra.run().unwrap().unwrap_returned(), usize::MAX);
}

#[test]
fn an_empty_queue_pops_none_and_counts_it() {
    let queue = RunQueue::<()>::new(1);
    assert!(queue.try_pop().is_none());
    assert!(queue.run_next().is_none());
    assert!(queue.is_empty());
    assert_eq!(queue.len(), 0);
    let stats = queue.stats();
    assert_eq!((stats.pops, stats.empty_pops, stats.pushes), (0, 2, 0));
}

#[test]
#[should_panic(expected = "capacity of at least 1")]
fn a_zero_capacity_queue_is_refused() {
    let _ = RunQueue::<()>::new(0);
}

/// 128 fibers of equal priority, popped and re-pushed 128 times: every
/// round sees each fiber exactly once, in the same order.
#[test]
fn equal_priorities_pop_in_fifo_order_round_after_round() {
    const N: usize = 128;
    let queue = RunQueue::<usize>::new(N);
    let fibers: Vec<Fiber<usize>> = (0..N).map(|i| fiber(Priority::NORMAL, move || i)).collect();
    for f in &fibers {
        queue.try_push(f.clone()).unwrap();
    }
    let mut first_round: Option<Vec<usize>> = None;
    for round in 0..N {
        let mut seen = [false; N];
        let mut this_round = Vec::with_capacity(N);
        for k in 0..N {
            let f = queue.try_pop().unwrap_or_else(|| panic!("round {round}: pop {k} was empty"));
            let i = fibers.iter().position(|g| Fiber::ptr_eq(g, &f)).expect("a fiber we pushed");
            assert!(!seen[i], "round {round}: fiber {i} popped twice");
            seen[i] = true;
            this_round.push(i);
            queue.try_push(f).unwrap();
        }
        assert!(seen.iter().all(|&s| s), "round {round}: some fiber was not seen");
        match &first_round {
            None => {
                assert_eq!(this_round, (0..N).collect::<Vec<_>>(), "the first round is push order");
                first_round = Some(this_round);
            }
            Some(first) => assert_eq!(&this_round, first, "round {round} changed the order"),
        }
    }
    assert_eq!(queue.len(), N);
    assert_eq!(queue.stats().pushes, (N + N * N) as u64);
}

/// Fibers that yield are put back behind their equals by `run_next`: the
/// run order is round-robin.
#[test]
fn yielding_fibers_run_round_robin() {
    const N: usize = 64;
    const YIELDS: usize = 32;
    watchdog("yielding_fibers_run_round_robin", 30, |stage| {
        let queue = RunQueue::<usize>::new(N);
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..N {
            let log = log.clone();
            queue
                .try_push(fiber(Priority::NORMAL, move || {
                    for _ in 0..YIELDS {
                        log.lock().unwrap().push(i);
                        yield_now();
                    }
                    log.lock().unwrap().push(i);
                    i
                }))
                .unwrap();
        }
        stage.set("running the yielding fibers with run_next");
        let mut returned = Vec::new();
        while let Some(ran) = queue.run_next() {
            match ran.outcome {
                Ok(RunOutcome::Yielded(0)) => assert_eq!(ran.fiber.state(), FiberState::Queued),
                Ok(RunOutcome::Returned(i)) => {
                    assert_eq!(ran.fiber.state(), FiberState::Finished);
                    returned.push(i);
                }
                other => panic!("unexpected outcome {other:?}"),
            }
        }
        assert_eq!(returned, (0..N).collect::<Vec<_>>());
        let log = log.lock().unwrap();
        assert_eq!(log.len(), N * (YIELDS + 1));
        for (round, chunk) in log.chunks(N).enumerate() {
            assert_eq!(chunk, (0..N).collect::<Vec<_>>(), "round {round} is not round-robin");
        }
        let stats = queue.stats();
        assert_eq!(stats.pops, (N * (YIELDS + 1)) as u64);
        assert_eq!(stats.pushes, (N * (YIELDS + 1)) as u64);
    });
}

/// Pushing a fiber that is not runnable is refused with `NotReady`, the
/// fiber is handed back, and the queue is unchanged.
#[test]
fn fibers_that_are_not_runnable_are_refused() {
    watchdog("fibers_that_are_not_runnable_are_refused", 30, |_stage| {
        let queue = RunQueue::<&'static str>::new(8);

        // Without a function.
        let empty = Fiber::<&'static str>::new(Default::default()).unwrap();
        match queue.try_push(empty.clone()) {
            Err(e @ PushError::NotReady(_, FiberError::NoFunction(_))) => {
                let msg = e.to_string();
                let id = empty.id().to_string();
                assert_eq!(msg.matches(&id).count(), 1, "the fiber named once: {msg}");
                assert!(msg.contains("set_function"), "{msg}");
                assert!(Fiber::ptr_eq(&e.into_fiber(), &empty));
            }
            other => panic!("pushing a fiber without a function gave {other:?}"),
        }
        assert_eq!(empty.state(), FiberState::Empty);

        // Already queued: the same fiber twice.
        let twice = fiber(Priority::NORMAL, || "twice");
        queue.try_push(twice.clone()).unwrap();
        match queue.try_push(twice.clone()) {
            Err(e @ PushError::NotReady(_, FiberError::Queued(_))) => {
                let msg = e.to_string();
                assert!(msg.contains("in a queue already") && !msg.contains("running"), "{msg}");
                assert!(Fiber::ptr_eq(&e.into_fiber(), &twice));
            }
            other => panic!("pushing a queued fiber again gave {other:?}"),
        }
        assert_eq!(queue.len(), 1, "the second push must not add an entry");
        let popped = queue.try_pop().unwrap();
        assert!(Fiber::ptr_eq(&popped, &twice));
        assert!(queue.try_pop().is_none(), "the fiber was queued once only");

        // Finished.
        assert_eq!(twice.run().unwrap().unwrap_returned(), "twice");
        match queue.try_push(twice.clone()) {
            Err(PushError::NotReady(_, FiberError::Finished(_))) => {}
            other => panic!("pushing a finished fiber gave {other:?}"),
        }

        // Running: the fiber tries to push itself.
        let me_slot: Arc<Mutex<Option<Fiber<&'static str>>>> = Arc::default();
        let (slot, q) = (me_slot.clone(), queue.clone());
        let runner = fiber(Priority::NORMAL, move || {
            let me = slot.lock().unwrap().take().expect("the handle was stored");
            match q.try_push(me) {
                Err(PushError::NotReady(_, FiberError::Running(_))) => "refused while running",
                Err(_) => "refused for another reason",
                Ok(()) => "accepted while running",
            }
        });
        *me_slot.lock().unwrap() = Some(runner.clone());
        assert_eq!(runner.run().unwrap().unwrap_returned(), "refused while running");

        // Sleeping on a semaphore.
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let sleeper = fiber(Priority::NORMAL, move || {
            s.acquire();
            "woken"
        });
        assert!(matches!(sleeper.run().unwrap(), RunOutcome::Slept));
        match queue.try_push(sleeper.clone()) {
            Err(PushError::NotReady(_, FiberError::Sleeping(_))) => {}
            other => panic!("pushing a sleeping fiber gave {other:?}"),
        }
        assert_eq!(sleeper.state(), FiberState::Sleeping);
        sem.release(1);
        // It never reached a run queue, so the wake leaves it Ready.
        assert_eq!(sleeper.state(), FiberState::Ready);
        assert_eq!(sleeper.run().unwrap().unwrap_returned(), "woken");

        assert!(queue.is_empty());
        assert_eq!(queue.stats().full_pushes, 0);
    });
}

#[test]
fn a_push_error_says_what_happened() {
    let queue = RunQueue::<()>::new(1);
    queue.try_push(fiber(Priority::NORMAL, || ())).unwrap();
    let full = queue.try_push(fiber(Priority::NORMAL, || ())).unwrap_err();
    assert!(full.to_string().contains("full"), "{full}");
    let empty = Fiber::<()>::new(Default::default()).unwrap();
    let not_ready = RunQueue::<()>::new(1).try_push(empty).unwrap_err();
    assert!(not_ready.to_string().contains("set_function"), "{not_ready}");
    assert!(matches!(not_ready, PushError::NotReady(_, FiberError::NoFunction(_))), "{not_ready:?}");

    // A finished fiber: what to do before pushing it, not before running it.
    let done = fiber(Priority::NORMAL, || ());
    done.run().unwrap().unwrap_returned();
    let finished = RunQueue::<()>::new(1).try_push(done).unwrap_err();
    let msg = finished.to_string();
    assert!(matches!(finished, PushError::NotReady(_, FiberError::Finished(_))), "{finished:?}");
    assert!(msg.contains("set_function") && !msg.contains("running it"), "{msg}");

    // A fiber pushing itself from inside its own function: it is running.
    let queue = RunQueue::<String>::new(1);
    let me: Arc<Mutex<Option<Fiber<String>>>> = Default::default();
    let f = Fiber::<String>::new(Default::default()).unwrap();
    *me.lock().unwrap() = Some(f.clone());
    {
        let (queue, me) = (queue.clone(), me.clone());
        f.set_function(Priority::NORMAL, move || {
            let myself = me.lock().unwrap().take().unwrap();
            queue.try_push(myself).unwrap_err().to_string()
        })
        .unwrap();
    }
    let msg = f.run().unwrap().unwrap_returned();
    assert!(msg.contains("it is running") && msg.contains("yields"), "{msg}");
    assert!(!msg.contains("before running it"), "{msg}");
}

/// A fiber set aside for its own thread and then given a new priority
/// with `RunQueue::set_priority` moves at once, as any queued fiber does:
/// it goes back into the levels at its new one. (Found in review: it was
/// left set aside at its old level, so raising it did nothing.)
#[test]
fn set_priority_moves_a_set_aside_fiber() {
    let order = watchdog("a set-aside fiber given a new priority", 30, |_stage| {
        let queue: RunQueue<&'static str> = RunQueue::new(8);
        let a = fiber(Priority(10), || {
            yield_now();
            "a"
        });
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (back_tx, back_rx) = std::sync::mpsc::channel::<Vec<&'static str>>();
        let (q, a2) = (queue.clone(), a.clone());
        let owner = thread::spawn(move || {
            q.try_push(a2).unwrap();
            // Its first run pins `a` to this thread; it yields and is queued again.
            assert!(matches!(q.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(_))));
            back_tx.send(vec![]).unwrap();
            go_rx.recv().unwrap();
            let mut order = vec![];
            while let Some(ran) = q.run_next() {
                if let Ok(RunOutcome::Returned(n)) = ran.outcome {
                    order.push(n);
                }
            }
            back_tx.send(order).unwrap();
        });
        back_rx.recv().unwrap();
        // A pop on this thread sets `a` aside for its owner, at level 10.
        assert!(queue.try_pop().is_none());
        assert_eq!(queue.stats().wrong_thread, 1);
        // `e` waits at 100; `a` is raised above it.
        queue.try_push(fiber(Priority(100), || "e")).unwrap();
        queue.set_priority(&a, Priority(200));
        assert_eq!(queue.len(), 2);
        go_tx.send(()).unwrap();
        let order = back_rx.recv().unwrap();
        owner.join().unwrap();
        order
    });
    assert_eq!(order, ["a", "e"], "a was raised to 200, above e at 100");
}

/// `RunQueue::set_priority` moves a queued fiber at once (behind fibers
/// already at the new priority); `Fiber::set_priority` on a queued fiber
/// takes effect at its next push.
#[test]
fn set_priority_moves_a_queued_fiber() {
    let queue = RunQueue::<char>::new(8);
    let a = fiber(Priority::NORMAL, || 'a');
    let b = fiber(Priority::NORMAL, || 'b');
    let c = fiber(Priority::LOWEST, || 'c');
    let d = fiber(Priority::NORMAL, || 'd');
    for f in [&a, &b, &c, &d] {
        queue.try_push(f.clone()).unwrap();
    }
    // c from last to first.
    queue.set_priority(&c, Priority::HIGHEST);
    assert_eq!(c.priority(), Priority::HIGHEST);
    // a to the same priority: it goes behind b and d.
    queue.set_priority(&a, Priority::NORMAL);
    // d via the fiber itself: no move while queued.
    d.set_priority(Priority::LOWEST);
    assert_eq!(d.priority(), Priority::LOWEST);

    let order: Vec<char> =
        std::iter::from_fn(|| queue.try_pop()).map(|f| f.run().unwrap().unwrap_returned()).collect();
    assert_eq!(order, ['c', 'b', 'd', 'a']);

    // A fiber that is not queued just gets the new priority.
    let e = fiber(Priority::NORMAL, || 'e');
    queue.set_priority(&e, Priority(3));
    assert_eq!(e.priority(), Priority(3));
    assert!(queue.is_empty());

    // At its next push e's new priority counts.
    let f = fiber(Priority(1), || 'f');
    let g = fiber(Priority::LOWEST, || 'g');
    queue.try_push(g.clone()).unwrap();
    queue.try_push(f.clone()).unwrap();
    queue.try_push(e.clone()).unwrap();
    let order: Vec<char> =
        std::iter::from_fn(|| queue.try_pop()).map(|f| f.run().unwrap().unwrap_returned()).collect();
    assert_eq!(order, ['e', 'f', 'g']);
}

/// `run_popped` puts a yielded fiber back in one call, leaves a returned or
/// sleeping one out; `requeue` leaves a fiber that is not Ready alone.
#[test]
fn run_popped_requeues_only_yielded_fibers() {
    watchdog("run_popped_requeues_only_yielded_fibers", 30, |_stage| {
        let queue = RunQueue::<u32>::new(2);
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let f = fiber(Priority::NORMAL, move || {
            yield_now();
            s.acquire();
            7
        });
        queue.try_push(f.clone()).unwrap();

        let ran = queue.run_popped(queue.try_pop().unwrap());
        assert!(matches!(ran.outcome, Ok(RunOutcome::Yielded(0))));
        assert_eq!(queue.len(), 1, "a yielded fiber goes back");
        assert_eq!(f.state(), FiberState::Queued);

        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        assert!(queue.is_empty(), "a sleeping fiber belongs to the semaphore");
        assert!(matches!(queue.requeue(&f), Err(FiberError::Sleeping(_))));
        assert!(queue.is_empty(), "requeue leaves a sleeping fiber alone");
        assert_eq!(f.state(), FiberState::Sleeping);

        sem.release(1);
        assert_eq!(queue.len(), 1, "the wake brought it back");
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Returned(7))));
        assert!(Fiber::ptr_eq(&ran.fiber, &f));
        assert!(queue.is_empty());
        assert!(matches!(queue.requeue(&f), Err(FiberError::Finished(_))));
        assert!(queue.is_empty(), "requeue leaves a finished fiber alone");

        let stats = queue.stats();
        assert_eq!((stats.pushes, stats.pops, stats.wakes), (3, 3, 1));
    });
}

/// An idle `pop_timeout` parks and gives up after its timeout.
#[test]
fn pop_timeout_on_an_empty_queue_times_out() {
    watchdog("pop_timeout_on_an_empty_queue_times_out", 30, |_stage| {
        let queue = RunQueue::<()>::new(4);
        let timeout = Duration::from_millis(50);
        let start = Instant::now();
        assert!(queue.pop_timeout(timeout).is_none());
        let waited = start.elapsed();
        assert!(waited >= timeout, "returned after {waited:?}, before the {timeout:?} timeout");
        let stats = queue.stats();
        // It parks once, unless its polls (which yield the thread) already
        // took the whole timeout on a busy machine: then it does not park.
        assert!(stats.parks <= 1, "one park at most: {stats:?}");
        assert_eq!(stats.empty_pops, 1);
        assert_eq!(stats.pops, 0);

        // A queued fiber is returned at once.
        queue.try_push(fiber(Priority::NORMAL, || ())).unwrap();
        let popped = queue.pop_timeout(Duration::from_secs(3600)).expect("a queued fiber");
        assert_eq!(popped.state(), FiberState::Ready);
    });
}

/// A popper parked in `pop_timeout` gets a fiber pushed by another thread
/// while it waits.
#[test]
fn pop_timeout_returns_a_fiber_pushed_while_it_waits() {
    watchdog("pop_timeout_returns_a_fiber_pushed_while_it_waits", 30, |stage| {
        let queue = RunQueue::<u64>::new(4);
        let q = queue.clone();
        let popper = thread::spawn(move || {
            let f = q.pop_timeout(Duration::from_secs(600));
            let value = f.as_ref().map(|f| q.run_popped(f.clone()).outcome.unwrap().unwrap_returned());
            (f, value)
        });
        stage.set("waiting for the popper to park (stats().parks > 0)");
        spin_until(|| queue.stats().parks > 0);
        let pushed = fiber(Priority::NORMAL, || 99);
        queue.try_push(pushed.clone()).unwrap();
        stage.set("waiting for the parked popper to return the pushed fiber");
        let (popped, value) = popper.join().unwrap();
        let popped = popped.expect("the parked popper should get the pushed fiber, not time out");
        assert!(Fiber::ptr_eq(&popped, &pushed));
        assert_eq!(value, Some(99));
        let stats = queue.stats();
        assert_eq!((stats.pushes, stats.pops), (1, 1));
    });
}

/// `Duration::MAX` means "wait as long as it takes": the popper parks and
/// gets a fiber pushed later, instead of overflowing the deadline.
#[test]
fn pop_timeout_with_an_unbounded_timeout_waits_for_a_push() {
    watchdog("pop_timeout_with_an_unbounded_timeout_waits_for_a_push", 30, |stage| {
        let queue = RunQueue::<u64>::new(1);
        let q = queue.clone();
        let popper = thread::spawn(move || q.pop_timeout(Duration::MAX).is_some());
        stage.set("waiting for the popper to park (or to fail)");
        spin_until(|| queue.stats().parks > 0 || popper.is_finished());
        queue.try_push(fiber(Priority::NORMAL, || 1)).unwrap();
        stage.set("waiting for the parked popper to return the pushed fiber");
        match popper.join() {
            Ok(got) => assert!(got, "the popper should get the pushed fiber"),
            Err(_) => {
                panic!("pop_timeout(Duration::MAX) panicked instead of waiting (deadline overflow?)")
            }
        }
    });
}

/// Several parked poppers and as many pushes from another thread: every
/// fiber is popped once, no popper is left waiting for its full timeout.
#[test]
fn parked_poppers_each_get_one_fiber() {
    const POPPERS: usize = 4;
    watchdog("parked_poppers_each_get_one_fiber", 30, |stage| {
        let queue = RunQueue::<usize>::new(POPPERS);
        let poppers: Vec<_> = (0..POPPERS)
            .map(|_| {
                let q = queue.clone();
                thread::spawn(move || q.pop_timeout(Duration::from_secs(600)))
            })
            .collect();
        stage.set("waiting for all poppers to park");
        spin_until(|| queue.stats().parks >= POPPERS as u64);
        for i in 0..POPPERS {
            queue.try_push(fiber(Priority::NORMAL, move || i)).unwrap();
        }
        stage.set("waiting for every parked popper to get a fiber");
        let mut got: Vec<usize> = poppers
            .into_iter()
            .map(|p| {
                let f = p.join().unwrap().expect("each popper gets a fiber");
                f.run().unwrap().unwrap_returned()
            })
            .collect();
        got.sort_unstable();
        assert_eq!(got, (0..POPPERS).collect::<Vec<_>>());
    });
}

/// Dropping the last handle of a queue that still holds fibers releases
/// them (and whatever their functions captured).
#[test]
fn dropping_a_queue_releases_the_fibers_in_it() {
    let drops = DropCounter::default();
    let queue = RunQueue::<u64>::new(4);
    for i in 0..3 {
        let v = drops.make(i);
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                let v = v; // capture the whole value, not just its field
                v.1
            }))
            .unwrap();
    }
    assert_eq!(drops.drops(), 0);
    drop(queue);
    assert_eq!(
        drops.drops(),
        3,
        "the fibers left in a dropped queue (and their captured values) were leaked"
    );
}

/// A pinned fiber is not handed to a thread other than its own: it stays
/// in the queue, set aside, and its own thread runs it.
#[test]
fn a_pinned_fiber_popped_on_another_thread_goes_back_for_its_own() {
    watchdog("a_pinned_fiber_popped_on_another_thread_goes_back_for_its_own", 30, |stage| {
        let queue = RunQueue::<u32>::new(4);
        let f = fiber(Priority::NORMAL, || {
            spindle_fiber::yield_now();
            7
        });
        queue.try_push(f.clone()).unwrap();
        stage.set("first run, on this thread: the fiber is pinned here and yields");
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(0))));

        stage.set("another thread looks: the fiber is not handed to it");
        let other = queue.clone();
        let (popped, len_after) = std::thread::spawn(move || {
            let ran = other.run_next();
            (ran.is_some(), other.len())
        })
        .join()
        .unwrap();
        assert!(!popped, "a thread that may not run it does not get it");
        assert_eq!(len_after, 1, "it stays in the queue, set aside for its thread");
        assert_eq!(queue.stats().wrong_thread, 1);

        stage.set("its own thread runs it to the end");
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Returned(7))));
        assert!(queue.is_empty());
        assert_eq!(f.stats().migrations, 0);
    });
}

/// A thread parked on the queue gets a fiber pinned to it that was woken
/// into the queue, even when another thread's pop sees it first and sets
/// it aside: the set-aside's own notification wakes the owner, which the
/// wake did not.
///
/// Made deterministic: another popper parks first, then the owner, and
/// only then is the fiber woken. The wake notifies one parked popper, and
/// parking_lot's condvar wakes the one that has waited longest (its wait
/// queue is FIFO), so the other popper's pop meets the fiber first and sets
/// it aside every time, while the owner stays parked.
#[test]
fn a_parked_owner_wakes_for_a_fiber_set_aside_for_it() {
    watchdog("a_parked_owner_wakes_for_a_fiber_set_aside_for_it", 30, |stage| {
        let queue = RunQueue::<u32>::new(4);
        let sem = Arc::new(Semaphore::new(0));
        let owner_queue = queue.clone();
        let s = sem.clone();
        stage.set("the owner thread runs a fiber until it sleeps");
        let (slept_tx, slept_rx) = std::sync::mpsc::channel();
        let (park_tx, park_rx) = std::sync::mpsc::channel();
        let owner = thread::spawn(move || {
            let f = fiber(Priority::NORMAL, move || {
                s.acquire();
                5
            });
            owner_queue.try_push(f).unwrap();
            assert!(matches!(owner_queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
            slept_tx.send(()).unwrap();
            park_rx.recv().unwrap();
            // Parks: the woken fiber is only handed to this thread, and
            // only the set-aside's notification wakes it.
            let f = owner_queue.pop_timeout(Duration::from_secs(60)).expect("woken by the set-aside");
            owner_queue.run_popped(f).outcome.unwrap().unwrap_returned()
        });
        slept_rx.recv().unwrap();

        stage.set("another thread parks on the queue first");
        let other_queue = queue.clone();
        let other = thread::spawn(move || {
            let f = other_queue.pop_timeout(Duration::from_secs(60)).expect("a fiber it may run");
            other_queue.run_popped(f).outcome.unwrap().unwrap_returned()
        });
        // Counted under the queue's lock, which the wait releases only once
        // the thread is on the condvar's wait queue.
        spin_until(|| queue.stats().parks >= 1);
        stage.set("then the owner parks, behind it");
        park_tx.send(()).unwrap();
        spin_until(|| queue.stats().parks >= 2);
        assert_eq!(queue.stats().wrong_thread, 0);

        stage.set("the release wakes the fiber into the queue; the other popper's pop sets it aside");
        sem.release(1);
        assert_eq!(owner.join().unwrap(), 5);
        assert_eq!(
            queue.stats().wrong_thread,
            1,
            "the other popper, woken first, set the fiber aside for its parked owner"
        );

        stage.set("a fiber the other popper may run lets it go");
        queue.try_push(fiber(Priority::NORMAL, || 9)).unwrap();
        assert_eq!(other.join().unwrap(), 9, "the other popper was never handed the pinned fiber");
        assert!(queue.is_empty());
    });
}

/// A fiber set aside for its thread keeps its priority: its thread still
/// gets a higher-priority fiber pushed later first, and a lower one after.
#[test]
fn a_fiber_set_aside_keeps_its_place_by_priority() {
    watchdog("a_fiber_set_aside_keeps_its_place_by_priority", 30, |stage| {
        let queue = RunQueue::<&'static str>::new(8);
        let pinned = fiber(Priority(100), || {
            spindle_fiber::yield_now();
            "pinned"
        });
        queue.try_push(pinned).unwrap();
        stage.set("run the pinned fiber once here, then let another thread set it aside");
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(0))));
        let other = queue.clone();
        assert!(std::thread::spawn(move || other.try_pop().is_none()).join().unwrap());
        assert_eq!(queue.stats().wrong_thread, 1);

        queue.try_push(fiber(Priority(200), || "higher")).unwrap();
        queue.try_push(fiber(Priority(50), || "lower")).unwrap();
        let order: Vec<_> = std::iter::from_fn(|| queue.run_next())
            .map(|r| r.outcome.unwrap())
            .filter_map(|o| match o {
                RunOutcome::Returned(s) => Some(s),
                _ => None,
            })
            .collect();
        assert_eq!(order, ["higher", "pinned", "lower"]);
    });
}

/// A fiber set aside for its thread still takes its place in the queue:
/// it counts in `len()` and against the capacity.
#[test]
fn a_fiber_set_aside_counts_against_the_capacity() {
    watchdog("a_fiber_set_aside_counts_against_the_capacity", 30, |_stage| {
        let queue = RunQueue::<()>::new(1);
        queue
            .try_push(fiber(Priority::NORMAL, || {
                spindle_fiber::yield_now();
            }))
            .unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(0))));
        let other = queue.clone();
        assert!(std::thread::spawn(move || other.try_pop().is_none()).join().unwrap());
        assert_eq!((queue.len(), queue.stats().wrong_thread), (1, 1));
        match queue.try_push(fiber(Priority::NORMAL, || {})) {
            Err(PushError::Full(_)) => {}
            other => panic!("a full queue (one fiber set aside) accepted a push: {:?}", other.is_ok()),
        }
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Returned(()))));
        assert!(queue.is_empty());
    });
}

/// A fiber's previous home (a scheduler of the user's) whose last reference
/// the fiber held is dropped by `try_push` after the queue's lock: its drop
/// may use the queue. (It deadlocked when the drop ran under the lock.)
#[test]
fn a_home_replaced_by_a_push_is_dropped_outside_the_queue_lock() {
    use spindle_fiber::Schedule;

    struct Elsewhere {
        queue: RunQueue<()>,
        len_seen_on_drop: Arc<Mutex<Option<usize>>>,
    }
    impl Schedule<()> for Elsewhere {
        fn schedule<'w>(
            &self,
            fiber: spindle_fiber::Woken<'w, ()>,
        ) -> Result<(), spindle_fiber::Woken<'w, ()>> {
            drop(fiber.into_queued());
            Ok(())
        }
    }
    impl Drop for Elsewhere {
        fn drop(&mut self) {
            *self.len_seen_on_drop.lock().unwrap() = Some(self.queue.len());
        }
    }

    watchdog("a_home_replaced_by_a_push_is_dropped_outside_the_queue_lock", 30, |_stage| {
        let queue = RunQueue::<()>::new(4);
        let seen = Arc::new(Mutex::new(None));
        let f = fiber(Priority::NORMAL, || {});
        let elsewhere: Arc<dyn Schedule<()>> =
            Arc::new(Elsewhere { queue: queue.clone(), len_seen_on_drop: seen.clone() });
        assert!(f.set_home(Some(&elsewhere)).unwrap().is_none());
        drop(elsewhere); // the fiber holds its last reference now
        queue.try_push(f).unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            Some(1),
            "the old home was dropped by the push, after the fiber was in the queue"
        );
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Returned(()))));
    });
}

/// `mark_queued` and `set_home` hand back the home they replace (for the
/// caller to drop outside its locks), and nothing when the home is the same
/// or none is given.
#[test]
fn mark_queued_and_set_home_hand_back_the_home_they_replace() {
    use spindle_fiber::Schedule;

    let a = RunQueue::<()>::new(4);
    let b = RunQueue::<()>::new(4);
    let f = fiber(Priority::NORMAL, || {});
    a.try_push(f.clone()).unwrap();
    let f = a.try_pop().unwrap();
    let b_home: Arc<dyn Schedule<()>> = Arc::new(NoopHome);
    let replaced = f.set_home(Some(&b_home)).unwrap().expect("the fiber's home was queue a");
    drop(replaced);
    assert!(f.set_home(Some(&b_home)).unwrap().is_none(), "the same home is not replaced");
    assert!(f.mark_queued(None).unwrap().is_none(), "no home given keeps the one it has");
    f.mark_dequeued().unwrap();
    let replaced = f.set_home(None).unwrap().expect("set_home(None) hands back the home it clears");
    assert!(Arc::ptr_eq(&replaced, &b_home));
    b.try_push(f).unwrap();
    assert!(matches!(b.run_next().unwrap().outcome, Ok(RunOutcome::Returned(()))));

    struct NoopHome;
    impl Schedule<()> for NoopHome {
        fn schedule<'w>(
            &self,
            fiber: spindle_fiber::Woken<'w, ()>,
        ) -> Result<(), spindle_fiber::Woken<'w, ()>> {
            drop(fiber.into_queued());
            Ok(())
        }
    }
}

/// `set_function` on a fiber whose function never started, while another
/// thread pops it from a queue and pushes it back over and over: the
/// fiber is only ever `Ready`, `Locked` or `Queued` there, so the answer is
/// `Ok`, `Queued` or `Running` (locked by the push), never `Busy` ("suspended
/// in the middle of its function"), which a claim that judged a failed
/// attempt by a second, later load of the state could return.
#[test]
fn set_function_racing_a_queue_never_calls_an_unstarted_fiber_busy() {
    use std::sync::atomic::{AtomicBool, Ordering};

    watchdog("set_function_racing_a_queue_never_calls_an_unstarted_fiber_busy", 60, |stage| {
        let f = fiber(Priority::NORMAL, || 1u32);
        let queue = RunQueue::new(4);
        queue.try_push(f.clone()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let popper = {
            let (queue, stop) = (queue.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(mut f) = queue.try_pop() {
                        // Refused while `set_function` holds the fiber: retry.
                        while let Err(e) = queue.try_push(f) {
                            f = e.into_fiber();
                        }
                    }
                }
            })
        };
        stage.set("racing");
        // Until both outcomes were seen often (the popper may get little
        // time on a busy machine) and at least 200,000 attempts were made.
        let (mut ok, mut queued) = (0u64, 0u64);
        for i in 0u64.. {
            if i >= 200_000 && ok >= 100 && queued >= 100 {
                break;
            }
            match f.set_function(Priority::NORMAL, || 2) {
                Ok(()) => ok += 1,
                Err(FiberError::Queued(_) | FiberError::Running(_)) => queued += 1,
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    popper.join().unwrap();
                    panic!("attempt {i}: set_function on a fiber that never started returned {e:?} ({e})");
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        popper.join().unwrap();
    });
}

/// A pinned fiber that `run_popped` sends back from another thread enters
/// the queue again and is counted as a push: `pushes - pops` stays the
/// queue's length (it showed more pops than pushes on an empty queue).
#[test]
fn a_fiber_sent_back_by_run_popped_counts_as_a_push() {
    watchdog("a_fiber_sent_back_by_run_popped_counts_as_a_push", 30, |_stage| {
        let queue = RunQueue::<()>::new(4);
        queue
            .try_push(fiber(Priority::NORMAL, || {
                spindle_fiber::yield_now();
            }))
            .unwrap();
        // Runs once here: pinned to this thread, then requeued.
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(0))));
        let popped = queue.try_pop().expect("the yielded fiber");
        let other = queue.clone();
        let refused = std::thread::spawn(move || {
            matches!(other.run_popped(popped).outcome, Err(FiberError::WrongThread(_)))
        })
        .join()
        .unwrap();
        assert!(refused, "run_popped on another thread refuses a pinned fiber");
        let stats = queue.stats();
        assert_eq!(stats.pushes - stats.pops, queue.len() as u64, "{stats:?}, len {}", queue.len());
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Returned(()))));
        let stats = queue.stats();
        assert_eq!((stats.pushes, stats.pops, queue.len()), (3, 3, 0), "{stats:?}");
    });
}

/// `pop_timeout(Duration::ZERO)` on an empty queue is a `try_pop`: it does
/// not poll, and counts an empty pop, not a park (it counted a park that
/// never happened, after 64 polls that yielded the thread).
#[test]
fn pop_timeout_zero_is_a_try_pop() {
    let queue = RunQueue::<()>::new(4);
    for _ in 0..10 {
        assert!(queue.pop_timeout(Duration::ZERO).is_none());
    }
    let stats = queue.stats();
    assert_eq!((stats.parks, stats.empty_pops), (0, 10), "{stats:?}");
    queue.try_push(fiber(Priority::NORMAL, || ())).unwrap();
    assert!(queue.pop_timeout(Duration::ZERO).is_some(), "a queued fiber is popped");
}

/// Two threads setting one queued fiber's priority at once: the priority
/// the fiber reports and its place in the queue agree afterwards (the
/// priority was stored outside the queue's lock, so one call's priority
/// could end up with the other's place; about 7 rounds in 2000 showed it).
#[test]
fn concurrent_set_priority_keeps_priority_and_place_together() {
    use std::sync::Barrier;
    watchdog("concurrent_set_priority_keeps_priority_and_place_together", 60, |_stage| {
        for round in 0..2000 {
            let queue = RunQueue::<u32>::new(4);
            let f = fiber(Priority::NORMAL, || 1);
            queue.try_push(f.clone()).unwrap();
            queue.try_push(fiber(Priority(100), || 2)).unwrap();
            let barrier = Arc::new(Barrier::new(2));
            let setters: Vec<_> = [10u8, 200u8]
                .into_iter()
                .map(|p| {
                    let (queue, f, barrier) = (queue.clone(), f.clone(), barrier.clone());
                    thread::spawn(move || {
                        barrier.wait();
                        for _ in 0..50 {
                            queue.set_priority(&f, Priority(p));
                        }
                    })
                })
                .collect();
            for s in setters {
                s.join().unwrap();
            }
            let reported = f.priority();
            drop(f);
            let first = queue.run_next().unwrap().outcome.unwrap().unwrap_returned();
            // Above the probe's 100 it must come first, below it second.
            assert_eq!(
                first == 1,
                reported == Priority(200),
                "round {round}: the fiber reports {reported:?} but popped {}",
                if first == 1 { "before the probe" } else { "after it" }
            );
        }
    });
}

/// `Debug` of a run queue is one snapshot: its length and its counters
/// agree (`pushes - pops == len`) while another thread runs fibers.
#[test]
fn a_run_queues_debug_is_one_snapshot() {
    use std::sync::atomic::{AtomicBool, Ordering};
    watchdog("a_run_queues_debug_is_one_snapshot", 60, |_stage| {
        let queue = RunQueue::<()>::new(16);
        for _ in 0..8 {
            queue
                .try_push(fiber(Priority::NORMAL, || loop {
                    yield_now();
                }))
                .unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let runner = {
            let (queue, stop) = (queue.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    queue.run_next();
                }
            })
        };
        let number = |shown: &str, field: &str| -> u64 {
            let at = shown.find(&format!("{field}: ")).expect("the field is shown") + field.len() + 2;
            shown[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
        };
        for _ in 0..20_000 {
            let shown = format!("{queue:?}");
            let (len, pushes, pops) =
                (number(&shown, "len"), number(&shown, "pushes"), number(&shown, "pops"));
            assert_eq!(pushes - pops, len, "{shown}");
        }
        stop.store(true, Ordering::Relaxed);
        runner.join().unwrap();
    });
}

/// A full queue answers a fiber that could not be queued anyway with why
/// (`NotReady`), not with `Full`: making room would not help it. (From a
/// review: a finished or already queued fiber got `Full`, and the advice
/// to pop fibers first.)
#[test]
fn a_full_queue_reports_a_fiber_that_cannot_be_queued_as_not_ready() {
    let queue = RunQueue::<()>::new(1);
    let other = RunQueue::<()>::new(1);
    queue.try_push(fiber(Priority::NORMAL, || ())).unwrap();

    let finished = fiber(Priority::NORMAL, || ());
    finished.run().unwrap().unwrap_returned();
    match queue.try_push(finished.clone()) {
        Err(PushError::NotReady(back, FiberError::Finished(id))) => {
            assert!(Fiber::ptr_eq(&back, &finished));
            assert_eq!(id, finished.id());
        }
        other => panic!("a finished fiber pushed onto a full queue gave {other:?}"),
    }

    let queued = fiber(Priority::NORMAL, || ());
    other.try_push(queued.clone()).unwrap();
    let err = queue.try_push(queued).unwrap_err();
    assert!(matches!(err, PushError::NotReady(_, FiberError::Queued(_))), "{err:?}");
    assert_eq!(queue.stats().full_pushes, 0, "neither counts as a full push");

    // A runnable fiber is still refused as `Full`.
    let ready = fiber(Priority::NORMAL, || ());
    assert!(matches!(queue.try_push(ready), Err(PushError::Full(_))));
    assert_eq!(queue.stats().full_pushes, 1);
}

/// `Fiber::set_priority` on a queued fiber takes effect at its next push,
/// also for one set aside for its thread: it keeps the place of the level
/// it was queued at. (From a review: set aside, it was ranked by its new
/// priority at once.)
#[test]
fn a_set_aside_fiber_keeps_its_place_when_its_priority_changes() {
    let first = watchdog("a set-aside fiber's own priority change", 30, |_stage| {
        let queue: RunQueue<&'static str> = RunQueue::new(8);
        let x = fiber(Priority::NORMAL, || {
            yield_now();
            "x"
        });
        queue.try_push(x.clone()).unwrap();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (res_tx, res_rx) = std::sync::mpsc::channel::<&'static str>();
        let q = queue.clone();
        let owner = thread::spawn(move || {
            // x is pinned to this thread, yields and is queued again.
            assert!(matches!(q.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(0))));
            go_rx.recv().unwrap();
            let ran = q.run_next().unwrap();
            res_tx.send(ran.outcome.unwrap().unwrap_returned()).unwrap();
            while q.run_next().is_some() {}
        });
        spin_until(|| queue.stats().pushes >= 2);
        assert!(queue.try_pop().is_none(), "x is set aside for its thread");
        assert_eq!(queue.stats().wrong_thread, 1);
        queue.try_push(fiber(Priority(1), || "y")).unwrap();
        x.set_priority(Priority::LOWEST); // counts from its next push
        go_tx.send(()).unwrap();
        let first = res_rx.recv().unwrap();
        owner.join().unwrap();
        first
    });
    assert_eq!(first, "x", "x was queued at NORMAL and y at 1");
}

/// A worker's own pinned fiber that yields wakes none of the idle workers
/// parked on the queue: none of them may run it. (From a review: each
/// yield woke one, which set the fiber aside and so woke all of them; 2,000
/// yields woke the idle workers about 1,500 times.)
#[test]
fn yields_of_a_fiber_pinned_to_its_worker_wake_no_idle_worker() {
    const IDLE: usize = 4;
    const YIELDS: usize = 2000;
    watchdog("yields_of_a_fiber_pinned_to_its_worker_wake_no_idle_worker", 60, |stage| {
        let queue = RunQueue::<()>::new(64);
        let idle: Vec<_> = (0..IDLE)
            .map(|_| {
                let q = queue.clone();
                thread::spawn(move || loop {
                    let f = q.pop_timeout(Duration::from_secs(3600)).expect("no timeout");
                    let stop = f.name() == Some("stop");
                    let _ = q.run_popped(f);
                    if stop {
                        return;
                    }
                })
            })
            .collect();
        stage.set("waiting for the idle workers to park");
        spin_until(|| queue.stats().parks >= IDLE as u64);
        let before = queue.stats();
        let busy = named_fiber("busy", Priority::NORMAL, || {
            for _ in 0..YIELDS {
                yield_now();
            }
        });
        // Its first run here pins it to this thread.
        assert!(matches!(busy.run(), Ok(RunOutcome::Yielded(0))));
        queue.try_push(busy).unwrap();
        stage.set("running the pinned fiber on its own thread");
        loop {
            let f = queue.pop_timeout(Duration::from_secs(10)).expect("the pinned fiber is in the queue");
            if matches!(queue.run_popped(f).outcome, Ok(RunOutcome::Returned(()))) {
                break;
            }
        }
        let after = queue.stats();
        stage.set("stopping the idle workers");
        for _ in 0..IDLE {
            queue.try_push(named_fiber("stop", Priority::LOWEST, || ())).unwrap();
        }
        for t in idle {
            t.join().unwrap();
        }
        // None is woken for the fiber; a little slack for a wake-up that
        // has nothing to do with it (the workers park for an hour).
        let (woken, set_aside) = (after.parks - before.parks, after.wrong_thread - before.wrong_thread);
        assert!(woken < (YIELDS / 100) as u64, "idle workers were woken {woken} times: {after:?}");
        assert!(set_aside < (YIELDS / 100) as u64, "the fiber was set aside {set_aside} times: {after:?}");
    });
}

/// A fiber that `run_popped` sends back (popped on its own thread, run on
/// another) goes to the back of its level: fibers queued meanwhile at the
/// same priority come first. (From a review: it was set aside at once, and
/// set-aside fibers win ties as the oldest.)
#[test]
fn a_fiber_sent_back_by_run_popped_keeps_fifo_among_equals() {
    watchdog("a_fiber_sent_back_by_run_popped_keeps_fifo_among_equals", 30, |_stage| {
        let queue = RunQueue::<u32>::new(8);
        let x = named_fiber("x", Priority::NORMAL, || {
            yield_now();
            1
        });
        assert!(matches!(x.run(), Ok(RunOutcome::Yielded(0)))); // pinned here
        queue.try_push(x).unwrap();
        let x = queue.try_pop().expect("x, popped on its own thread");
        queue.try_push(named_fiber("y", Priority::NORMAL, || 2)).unwrap(); // y is in first
        let q = queue.clone();
        let outcome = thread::spawn(move || format!("{:?}", q.run_popped(x).outcome)).join().unwrap();
        assert!(outcome.contains("WrongThread"), "{outcome}");
        let first = queue.try_pop().unwrap();
        assert_eq!(first.name(), Some("y"), "y was queued before x came back");
        assert_eq!(queue.try_pop().unwrap().name(), Some("x"));
    });
}

/// `close` wakes every popper parked in `pop` (which otherwise waits for
/// ever), they return `None`, and later pushes are refused with the fiber
/// handed back and a message that says why.
#[test]
fn close_wakes_parked_poppers_and_refuses_new_fibers() {
    const POPPERS: usize = 3;
    watchdog("close_wakes_parked_poppers_and_refuses_new_fibers", 30, |stage| {
        let queue = RunQueue::<()>::new(4);
        let poppers: Vec<_> = (0..POPPERS)
            .map(|_| {
                let q = queue.clone();
                thread::spawn(move || q.pop().map(|f| f.id()))
            })
            .collect();
        stage.set("waiting for every popper to park");
        spin_until(|| queue.stats().parks >= POPPERS as u64);
        assert!(!queue.is_closed());
        assert!(queue.close(), "the first close closes");
        assert!(!queue.close(), "a second close finds it closed");
        assert!(queue.is_closed());
        stage.set("waiting for the parked poppers to return after close");
        for p in poppers {
            assert_eq!(p.join().unwrap(), None, "a closed, empty queue pops None");
        }
        let f = fiber(Priority::NORMAL, || ());
        let id = f.id();
        let err = queue.try_push(f).unwrap_err();
        assert!(matches!(err, PushError::Closed(_)), "{err:?}");
        assert!(err.to_string().contains("closed"), "{err}");
        let back = err.into_fiber();
        assert_eq!(back.id(), id);
        assert_eq!(back.state(), FiberState::Ready, "the refused fiber is untouched");
        assert!(queue.is_empty());
        assert!(format!("{queue:?}").contains("closed: true"), "{queue:?}");
        // Nothing waits on a closed queue, whatever the timeout.
        assert!(queue.pop_timeout(Duration::from_secs(600)).is_none());
    });
}

/// Closing does not lose what is in the queue or comes back to it: fibers
/// queued before the close are still popped, a fiber that yields after it
/// is requeued, a fiber asleep on a primitive is woken back into it, and
/// the worker loop ends only once all of them have returned.
#[test]
fn a_closed_queue_keeps_and_takes_back_its_fibers() {
    watchdog("a_closed_queue_keeps_and_takes_back_its_fibers", 30, |stage| {
        let queue = RunQueue::<&'static str>::new(4);
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                s.acquire();
                "sleeper"
            }))
            .unwrap();
        // The sleeper runs first (FIFO) and goes to sleep on the semaphore.
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        queue
            .try_push(fiber(Priority::NORMAL, || {
                yield_now();
                yield_now();
                "yielder"
            }))
            .unwrap();
        queue.close();
        // Woken after the close: it comes back to its home all the same.
        sem.release(1);
        assert_eq!(queue.len(), 2);
        stage.set("draining the closed queue");
        let mut returned = Vec::new();
        while let Some(f) = queue.pop() {
            if let Ok(RunOutcome::Returned(r)) = queue.run_popped(f).outcome {
                returned.push(r);
            }
        }
        returned.sort_unstable();
        assert_eq!(returned, ["sleeper", "yielder"]);
        assert!(queue.is_empty());
        let stats = queue.stats();
        assert_eq!(stats.wakes, 1);
        assert_eq!(stats.pushes, stats.pops, "{stats:?}");
    });
}

/// Worker threads that loop on `pop` until `None`, over fibers that
/// hand messages to each other through sync primitives: the worker that
/// sees the last fiber return closes the queue, and every worker stops.
#[test]
fn workers_stop_when_the_last_fiber_closes_the_queue() {
    const WORKERS: usize = 3;
    const FIBERS: usize = 12;
    watchdog("workers_stop_when_the_last_fiber_closes_the_queue", 60, |stage| {
        let queue = RunQueue::<usize>::new(FIBERS);
        let sem = Arc::new(Semaphore::new(1));
        let returned = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let (q, returned) = (queue.clone(), returned.clone());
                thread::spawn(move || {
                    let mut sum = 0;
                    while let Some(f) = q.pop() {
                        match q.run_popped(f).outcome {
                            Ok(RunOutcome::Returned(i)) => {
                                sum += i;
                                if returned.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1 == FIBERS {
                                    q.close();
                                }
                            }
                            Ok(RunOutcome::Panicked(p)) => panic!("{p}"),
                            Ok(_) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                    sum
                })
            })
            .collect();
        for i in 0..FIBERS {
            let sem = sem.clone();
            queue
                .try_push(fiber(Priority::NORMAL, move || {
                    for _ in 0..20 {
                        // One fiber at a time holds the token: the others sleep.
                        sem.acquire();
                        yield_now();
                        sem.release(1);
                    }
                    i
                }))
                .unwrap();
        }
        stage.set("waiting for the workers to stop after the last fiber returned");
        let total: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
        assert_eq!(total, (0..FIBERS).sum::<usize>());
        assert!(queue.is_closed() && queue.is_empty());
    });
}

/// Fibers pinned to the workers by turns before their first run
/// (`Fiber::pin_to`) each run only on their own worker, whichever worker
/// pops them: each worker runs exactly its share, and a fiber that yields
/// and sleeps comes back to the same thread.
#[test]
fn fibers_pinned_before_their_first_run_run_on_their_own_worker() {
    const WORKERS: usize = 2;
    const FIBERS: usize = 12;
    watchdog("fibers_pinned_before_their_first_run_run_on_their_own_worker", 60, |stage| {
        #[inline(never)]
        fn thread_now() -> thread::ThreadId {
            thread::current().id()
        }
        let queue = RunQueue::<(usize, thread::ThreadId)>::new(FIBERS);
        let sem = Arc::new(Semaphore::new(1));
        let returned = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (token_tx, token_rx) = std::sync::mpsc::channel();
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let (q, returned, token_tx) = (queue.clone(), returned.clone(), token_tx.clone());
                thread::spawn(move || {
                    token_tx.send((ThreadToken::current(), thread_now())).unwrap();
                    let mut ran = Vec::new();
                    while let Some(f) = q.pop() {
                        match q.run_popped(f).outcome {
                            Ok(RunOutcome::Returned(r)) => {
                                ran.push(r);
                                if returned.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1 == FIBERS {
                                    q.close();
                                }
                            }
                            Ok(RunOutcome::Panicked(p)) => panic!("{p}"),
                            Ok(_) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                    (thread_now(), ran)
                })
            })
            .collect();
        let tokens: Vec<(ThreadToken, thread::ThreadId)> = token_rx.iter().take(WORKERS).collect();
        stage.set("fibers pinned to the workers by turns");
        for i in 0..FIBERS {
            let sem = sem.clone();
            let f = fiber(Priority::NORMAL, move || {
                let first = thread_now();
                for _ in 0..5 {
                    // One fiber at a time holds the token: the others sleep.
                    sem.acquire();
                    yield_now();
                    sem.release(1);
                    assert_eq!(thread_now(), first, "a pinned fiber moved");
                }
                (i, first)
            });
            f.pin_to(tokens[i % WORKERS].0).unwrap();
            queue.try_push(f).unwrap();
        }
        stage.set("waiting for the workers to stop after the last fiber returned");
        for w in workers {
            let (me, ran) = w.join().unwrap();
            let index = tokens.iter().position(|&(_, id)| id == me).expect("a worker's token");
            let mut mine: Vec<usize> = ran
                .iter()
                .map(|&(i, on)| {
                    assert_eq!(on, me, "fiber {i} ran where its worker did");
                    i
                })
                .collect();
            mine.sort_unstable();
            let expected: Vec<usize> = (0..FIBERS).filter(|i| i % WORKERS == index).collect();
            assert_eq!(mine, expected, "worker {index} ran exactly the fibers pinned to it");
        }
        assert!(queue.is_closed() && queue.is_empty());
    });
}
