//! Loom models of the run queue's parking protocol (`src/queue.rs`, module
//! docs), running the queue's own code.
//!
//! Run with:
//!
//! ```text
//! LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test --release -p spindle-run-queue --test loom
//! ```
//!
//! The queue normally locks with parking_lot, which loom cannot see; built
//! with `--cfg loom`, its private `sync` module puts loom's `Mutex` and
//! `Condvar` behind the same API, so `try_push`, `pop_timeout`, `close`, `requeue`
//! and the wake seam (`Schedule::schedule`) below are the real code, and so
//! is the fiber state machine they drive. Loom has no clock: a parked
//! popper waits until notified (the timeout is not modelled), so a lost
//! notification leaves it parked forever and loom reports a deadlock. The
//! priority heap is ordinary memory under the queue's lock.
//!
//! The fibers really run (on their own stacks, with stack switches that loom
//! does not see). Loom runs all its threads on one OS thread, but built with
//! `--cfg loom` spindle-fiber keeps its current-fiber word and thread id in
//! loom's thread-locals, one pair per model thread: a fiber pinned to one
//! model thread is refused on the others (`set_aside_reaches_parked_owner`).

#![cfg(loom)]

use std::time::Duration;

use loom::sync::{Arc, Mutex};
use loom::thread;
use spindle_fiber::{sleep, yield_now, Fiber, FiberAttr, FiberState, Priority, RunOutcome, Waiter};
use spindle_run_queue::RunQueue;

/// When `LOOM_MAX_PREEMPTIONS` is not set (exhaustive exploration takes far
/// longer than a CI run).
const DEFAULT_PREEMPTIONS: usize = 3;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(DEFAULT_PREEMPTIONS);
    }
    builder.check(f);
}

/// `model` one preemption below the bound the others use, but never below 2,
/// for `set_aside_wakes_every_parked_popper`: four model threads, whose
/// exploration at 3 takes minutes, and whose case takes two preemptions
/// (at 1 its check that the case was reached fails).
fn model_one_below(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    let bound = builder.preemption_bound.unwrap_or(DEFAULT_PREEMPTIONS);
    builder.preemption_bound = Some(bound.saturating_sub(1).max(2));
    builder.check(f);
}

/// Long enough that nothing times out; under loom it is not modelled anyway.
const FOREVER: Duration = Duration::from_secs(3600);

/// A `Ready` fiber with a small stack that runs `f`.
fn fiber(f: impl FnOnce() + Send + 'static) -> Fiber<()> {
    let fiber = Fiber::new(FiberAttr::new().stack_size(16 * 1024)).unwrap();
    // SAFETY: the models' functions hold no !Send value and no thread-local
    // reference across their suspension points.
    unsafe { fiber.set_function_migratable(Priority::NORMAL, f) }.unwrap();
    fiber
}

/// A fiber pinned to the calling (model) thread, asleep: pushed, run once
/// here by `run_next` (the safe `set_function` pins it to the thread of its
/// first run), it publishes its `Waiter` in the returned slot and sleeps.
/// Waking it puts it back onto `q` (its home), where only this thread may
/// pop it; when it runs again it returns.
fn pinned_sleeper(q: &RunQueue<()>) -> Arc<Mutex<Option<Waiter>>> {
    let slot: Arc<Mutex<Option<Waiter>>> = Arc::new(Mutex::new(None));
    let f = Fiber::new(FiberAttr::new().stack_size(16 * 1024)).unwrap();
    {
        let slot = slot.clone();
        f.set_function(Priority::NORMAL, move || {
            *slot.lock().unwrap() = Some(Waiter::current().unwrap());
            sleep();
        })
        .unwrap();
    }
    q.try_push(f).unwrap();
    assert!(matches!(q.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
    slot
}

/// A popper that may park before, during or after the push: it must get the
/// fiber (popper step 2 against pusher steps 1-2).
#[test]
fn push_reaches_parked_popper() {
    model(|| {
        let q: RunQueue<()> = RunQueue::new(4);
        let popper = {
            let q = q.clone();
            thread::spawn(move || q.pop_timeout(FOREVER).expect("a popper waiting forever gets the fiber"))
        };
        let f = fiber(|| {});
        let id = f.id();
        q.try_push(f).unwrap();
        let got = popper.join().unwrap();
        assert_eq!(got.id(), id);
        assert_eq!(got.state(), FiberState::Ready);
        assert!(q.is_empty());
        let s = q.stats();
        assert_eq!((s.pushes, s.pops), (1, 1));
    });
}

/// Two poppers, two pushers: each popper gets exactly one fiber, none is
/// lost or handed out twice, whatever order the parks and notifications
/// take.
#[test]
fn two_pushers_two_poppers() {
    model(|| {
        let q: RunQueue<()> = RunQueue::new(4);
        let poppers: Vec<_> = (0..2)
            .map(|_| {
                let q = q.clone();
                thread::spawn(move || q.pop_timeout(FOREVER).expect("every popper gets a fiber").id())
            })
            .collect();
        let (a, b) = (fiber(|| {}), fiber(|| {}));
        let ids = [a.id(), b.id()];
        let pusher = {
            let q = q.clone();
            thread::spawn(move || q.try_push(b).unwrap())
        };
        q.try_push(a).unwrap();
        pusher.join().unwrap();
        let mut got: Vec<_> = poppers.into_iter().map(|p| p.join().unwrap()).collect();
        got.sort();
        let mut want = ids.to_vec();
        want.sort();
        assert_eq!(got, want);
        assert!(q.is_empty());
    });
}

/// Two workers each pop once and run what they got; the fiber yields once.
/// The first run's `requeue` must reach the other worker, which may be
/// parked by then.
#[test]
fn requeue_after_yield_reaches_parked_worker() {
    model(|| {
        let q: RunQueue<()> = RunQueue::new(4);
        q.try_push(fiber(yield_now)).unwrap();
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let q = q.clone();
                thread::spawn(move || {
                    let f = q.pop_timeout(FOREVER).expect("each worker gets one run");
                    match q.run_popped(f).outcome.unwrap() {
                        RunOutcome::Yielded(_) => false,
                        RunOutcome::Returned(()) => true,
                        other => panic!("unexpected {other:?}"),
                    }
                })
            })
            .collect();
        let returned: Vec<bool> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        assert_eq!(returned.iter().filter(|&&r| r).count(), 1, "one run yielded, one returned");
        assert!(q.is_empty());
        let s = q.stats();
        assert_eq!((s.pushes, s.pops), (2, 2));
    });
}

/// A fiber sleeps on a one-slot wait list (a semaphore with one token to
/// give); a plain thread releases it. The wake goes through the fiber's
/// home (`Schedule::schedule`) back onto the queue, where the worker that
/// ran it is parked waiting for more work. The release may come before the
/// fiber links itself (it then does not sleep), between the link and the
/// stack switch (`RunningWoken`: the worker queues it) or after (`Sleeping`:
/// the waker queues it).
#[test]
fn wake_through_home_reaches_parked_worker() {
    #[derive(Default)]
    struct Sem {
        token: bool,
        waiter: Option<Waiter>,
    }
    model(|| {
        let q: RunQueue<()> = RunQueue::new(4);
        let sem = Arc::new(Mutex::new(Sem::default()));
        let f = {
            let sem = sem.clone();
            fiber(move || {
                let mut s = sem.lock().unwrap();
                if s.token {
                    s.token = false;
                    return;
                }
                s.waiter = Some(Waiter::current().unwrap());
                drop(s);
                sleep();
                let s = sem.lock().unwrap();
                assert!(s.waiter.is_none() && !s.token, "resumed without being woken");
            })
        };
        q.try_push(f).unwrap();
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                let mut runs = 0;
                loop {
                    let f = q.pop_timeout(FOREVER).expect("the woken fiber comes back");
                    runs += 1;
                    match q.run_popped(f).outcome.unwrap() {
                        RunOutcome::Slept => continue,
                        RunOutcome::Returned(()) => return runs,
                        other => panic!("unexpected {other:?}"),
                    }
                }
            })
        };
        let waker = thread::spawn(move || {
            let mut s = sem.lock().unwrap();
            match s.waiter.take() {
                Some(w) => {
                    drop(s);
                    w.wake();
                    true
                }
                None => {
                    s.token = true;
                    false
                }
            }
        });
        let woke = waker.join().unwrap();
        let runs = worker.join().unwrap();
        assert_eq!(runs, if woke { 2 } else { 1 }, "one run per wake, plus the first");
        assert!(q.is_empty());
        assert_eq!(q.stats().wakes, u64::from(woke));
    });
}

/// A fiber pinned to the thread that first ran it (the safe
/// `set_function`) sleeps; that thread then waits on the queue, and so does
/// another popper. A third thread wakes the fiber, which goes back onto the
/// queue with one notification: if the other popper takes it, it meets a
/// fiber it may not run, sets it aside, and must wake the owner (the
/// set-aside notifies every parked popper). The owner then gives the other
/// popper a fiber it may run, so that it finishes. Loom gives each model
/// thread its own thread id, so the pin is real here.
#[test]
fn set_aside_reaches_parked_owner() {
    // Some explored interleaving must have the other popper set the fiber
    // aside, or the model checked nothing new.
    static SET_ASIDE_SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    model(|| {
        let q: RunQueue<()> = RunQueue::new(4);
        // This (model) thread runs it first: it is pinned here now.
        let slot = pinned_sleeper(&q);
        let other = {
            let q = q.clone();
            thread::spawn(move || {
                let f = q.pop_timeout(FOREVER).expect("the other popper gets the fiber meant for it");
                assert!(
                    matches!(q.run_popped(f).outcome, Ok(RunOutcome::Returned(()))),
                    "the other popper ran only the fiber it may run"
                );
            })
        };
        let waker = thread::spawn(move || {
            slot.lock().unwrap().take().expect("the fiber published its waiter").wake();
        });
        let f = q.pop_timeout(FOREVER).expect("the owner gets its woken fiber");
        assert!(matches!(q.run_popped(f).outcome, Ok(RunOutcome::Returned(()))));
        // A fiber anyone may run, for the other popper.
        q.try_push(fiber(|| ())).unwrap();
        waker.join().unwrap();
        other.join().unwrap();
        let s = q.stats();
        assert_eq!(s.wakes, 1);
        assert!(s.wrong_thread <= 1, "{s:?}");
        if s.wrong_thread == 1 {
            SET_ASIDE_SEEN.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        assert!(q.is_empty());
    });
    assert!(
        SET_ASIDE_SEEN.load(std::sync::atomic::Ordering::Relaxed),
        "no explored interleaving set the fiber aside"
    );
}

/// One execution of the set-aside models below. Threads: the owner of a
/// pinned, sleeping fiber (the calling thread), `others` poppers that may run
/// only migratable fibers, and a waker that wakes the owner's fiber and then
/// pops (its first polls are `pop_timeout`'s spin phase, `try_pop_quiet`).
/// The wake puts the fiber back through its home (`Schedule::schedule` →
/// `Shared::insert`: pusher steps 1-2, one `notify_one`); a non-owner that
/// pops it sets it aside for the owner and must wake it. The owner, once it
/// has run its fiber, pushes one migratable fiber for each other popper and
/// the waker.
///
/// Returns whether this execution reached the case the models are for: when
/// the wake came, every other popper was parked ahead of the owner on the
/// condvar (loom's is FIFO: popper step 2 in that order), and the fiber was
/// set aside. Before the wake nothing has notified anyone, so the count of
/// parks is the count of parked poppers: the owner sees `others` before it
/// parks, the waker sees `others + 1` before it wakes the fiber. Which popper
/// set the fiber aside (one woken from step 2, or the waker in its spin
/// phase) is not observed here; removing either notification shows that
/// the models explore both (docs/loom.md).
fn owner_behind_parked_poppers(others: usize) -> bool {
    let q: RunQueue<()> = RunQueue::new(4);
    let slot = pinned_sleeper(&q);
    let poppers: Vec<_> = (0..others)
        .map(|_| {
            let q = q.clone();
            thread::spawn(move || {
                let f = q.pop_timeout(FOREVER).expect("every other popper gets a fiber it may run");
                assert!(
                    matches!(q.run_popped(f).outcome, Ok(RunOutcome::Returned(()))),
                    "another popper ran only a fiber it may run"
                );
            })
        })
        .collect();
    let waker = {
        let q = q.clone();
        thread::spawn(move || {
            let waiter = slot.lock().unwrap().take().expect("the fiber published its waiter");
            // Not kept while parked: a loom `Arc` dropped while unwinding
            // from loom's deadlock report aborts the process instead.
            drop(slot);
            let parked = q.stats().parks;
            waiter.wake();
            let f = q.pop_timeout(FOREVER).expect("the waker gets a fiber it may run");
            assert!(
                matches!(q.run_popped(f).outcome, Ok(RunOutcome::Returned(()))),
                "the waker ran only a fiber it may run"
            );
            parked
        })
    };
    let parked_ahead = q.stats().parks;
    let f = q.pop_timeout(FOREVER).expect("the owner gets its woken fiber");
    assert!(matches!(q.run_popped(f).outcome, Ok(RunOutcome::Returned(()))));
    // A fiber anyone may run for each of the other poppers and the waker.
    for _ in 0..=others {
        q.try_push(fiber(|| ())).unwrap();
    }
    let parked_at_wake = waker.join().unwrap();
    for p in poppers {
        p.join().unwrap();
    }
    let s = q.stats();
    assert_eq!(s.wakes, 1);
    assert!(s.wrong_thread <= 1, "{s:?}");
    assert!(q.is_empty());
    parked_ahead == others as u64 && parked_at_wake == others as u64 + 1 && s.wrong_thread == 1
}

/// The set-aside made in a popper's spin phase: `RunQueue::pop_timeout`'s
/// polls (`try_pop_quiet`) end in `Shared::finish_pop`, whose `notify_all`
/// runs when the pop set a fiber aside. (The set-aside made after parking,
/// in `pop_timeout`'s loop, has its own `notify_all`, under the lock; that
/// one is `set_aside_reaches_parked_owner`'s.) One other popper: three model
/// threads.
///
/// The interleaving that needs `finish_pop`'s notification: the other popper
/// and then the owner park (popper step 2); the wake's insert counts two
/// sleepers and notifies one, the other popper (pusher step 2); before that
/// popper takes the lock again (back to step 1), the waker's first poll
/// takes it, pops the fiber, may not run it and sets it aside. The other
/// popper then finds nothing it may run and parks again, and the waker's
/// next poll and its step 1 find nothing either: only `finish_pop`'s
/// notification, from the waker's spin phase, wakes the owner. Without it
/// every thread stays parked and loom reports the deadlock. (A `notify_one`
/// there would do in this shape, since the wake's notification took the
/// other popper off the condvar: `set_aside_wakes_every_parked_popper` is
/// the one that needs `notify_all`.)
#[test]
fn spin_phase_set_aside_reaches_parked_owner() {
    static SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    model(|| {
        if owner_behind_parked_poppers(1) {
            SEEN.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    assert!(
        SEEN.load(std::sync::atomic::Ordering::Relaxed),
        "no explored interleaving set the fiber aside with the owner parked behind the other popper"
    );
}

/// `notify_all` against `notify_one`. A pusher (`Shared::insert`, pusher
/// step 2) notifies one parked popper, since any of them may take its fiber;
/// a popper that sets a fiber aside must wake every parked popper, since it
/// cannot pick out the thread the fiber is for. Both set-aside notifications
/// are covered: `pop_timeout`'s in its loop (a popper woken from step 2
/// sets the fiber aside) and `Shared::finish_pop`'s (the waker's spin phase
/// does). Two other poppers: four model threads.
///
/// The interleaving that needs the `all`: both other poppers park, then the
/// owner; the wake's insert notifies the first other popper; it, or the
/// waker's first poll, sets the fiber aside. A `notify_one` there would wake
/// the second other popper, which is ahead of the owner: it finds nothing
/// it may run and parks again, as do the first one and the waker, and the
/// owner is never woken: loom reports the deadlock. With fewer poppers ahead
/// of the owner the two do not differ (the wake's own notification takes
/// the only one), hence the second other popper.
///
/// Run one preemption below the other models, at 2 in CI (`model_one_below`):
/// at 3 this model takes three to four minutes, at 2 about 7 to 10
/// seconds (docs/loom.md), and the interleavings above take two
/// preemptions.
#[test]
fn set_aside_wakes_every_parked_popper() {
    static SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    model_one_below(|| {
        if owner_behind_parked_poppers(2) {
            SEEN.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    assert!(
        SEEN.load(std::sync::atomic::Ordering::Relaxed),
        "no explored interleaving set the fiber aside with the owner parked behind both other poppers"
    );
}

/// Two poppers waiting without a deadline (`pop`) and a close: each may
/// reach the queue before or after it (and park, if before), and each
/// must return `None` (popper
/// step 2 against closer steps 1-2). A missed notification leaves one
/// parked forever, which loom reports as a deadlock.
#[test]
fn close_reaches_parked_poppers() {
    model(|| {
        let q: RunQueue<()> = RunQueue::new(4);
        let poppers: Vec<_> = (0..2)
            .map(|_| {
                let q = q.clone();
                thread::spawn(move || q.pop().is_none())
            })
            .collect();
        assert!(q.close());
        for p in poppers {
            assert!(p.join().unwrap(), "a closed, empty queue pops None");
        }
    });
}

/// A push and then a close, racing one popper that pops twice: the fiber
/// pushed before the close is never lost to it (the first pop gets it,
/// whether it parked before the push or not), and the second pop ends.
#[test]
fn a_push_before_close_still_reaches_the_popper() {
    model(|| {
        let q: RunQueue<()> = RunQueue::new(4);
        let popper = {
            let q = q.clone();
            thread::spawn(move || {
                let first = q.pop().map(|f| f.id());
                (first, q.pop().is_none())
            })
        };
        let f = fiber(|| {});
        let id = f.id();
        q.try_push(f).unwrap();
        q.close();
        assert_eq!(popper.join().unwrap(), (Some(id), true));
        assert!(q.is_empty());
    });
}
