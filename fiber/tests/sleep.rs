//! The sleep/wake seam without a run queue: a fiber publishes a `Waiter`,
//! sleeps, and becomes `Ready` again when the waiter is woken.

mod common;

use common::{with_watchdog, DropCounter};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use spindle_fiber::{
    current, sleep, yield_now, Fiber, FiberAttr, FiberError, FiberState, Priority, RunOutcome, Schedule,
    WaitHook, Waiter, Woken,
};
use std::ptr::NonNull;

type Slot = Arc<Mutex<Option<Waiter>>>;

/// A fiber function that publishes its waiter in `slot`, sleeps, and
/// returns `value` once woken.
fn sleeper(slot: Slot, value: u32) -> impl FnOnce() -> u32 + Send + 'static {
    move || {
        let w = Waiter::current().expect("a waiter inside a fiber");
        assert_eq!(Some(w.id()), current().map(|c| c.id()));
        *slot.lock().unwrap() = Some(w);
        sleep();
        value
    }
}

fn take(slot: &Slot) -> Waiter {
    slot.lock()
        .unwrap()
        .take()
        .expect("the fiber published its waiter")
}

#[test]
fn a_sleeping_fiber_is_woken_by_its_waiter() {
    with_watchdog(30, "sleep_and_wake", || {
        let slot: Slot = Arc::default();
        let fiber = Fiber::new(FiberAttr::new().name("sleepy")).unwrap();
        fiber
            .set_function(Priority::NORMAL, sleeper(slot.clone(), 7))
            .unwrap();

        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        assert_eq!(fiber.state(), FiberState::Sleeping);
        assert!(current().is_none());

        // Asleep: running it is refused, and so is a new function.
        let err = fiber.run().unwrap_err();
        assert!(
            matches!(err, FiberError::Sleeping(id) if id == fiber.id()),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("asleep"), "{msg}");
        assert!(
            msg.contains("leave it until a wake"),
            "message says what to do: {msg}"
        );
        // A new function is refused as for any fiber in the middle of
        // its function (`Sleeping`'s advice, wait for the wake and run it,
        // would only lead to `Busy` next).
        let err = fiber.set_function(Priority::NORMAL, || 0).unwrap_err();
        assert!(matches!(err, FiberError::Busy(_)), "{err:?}");
        assert_eq!(fiber.state(), FiberState::Sleeping);

        let waiter = take(&slot);
        assert_eq!(waiter.id(), fiber.id());
        assert!(format!("{waiter:?}").contains("sleepy"), "{waiter:?}");
        waiter.wake();
        // No run queue: the fiber is simply runnable again.
        assert_eq!(fiber.state(), FiberState::Ready);
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(7)));

        let s = fiber.stats();
        assert_eq!((s.runs, s.sleeps, s.yields), (2, 1, 0));
    });
}

#[test]
fn a_waiter_woken_from_another_thread() {
    with_watchdog(30, "wake_from_other_thread", || {
        let slot: Slot = Arc::default();
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, sleeper(slot.clone(), 9))
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        let waiter = take(&slot);
        std::thread::spawn(move || waiter.wake()).join().unwrap();
        assert_eq!(fiber.state(), FiberState::Ready);
        // A pinned fiber is still run on its own thread after the wake.
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(9)));
    });
}

#[test]
fn a_wake_before_the_fiber_switched_out_leaves_it_ready() {
    with_watchdog(30, "wake_before_switch", || {
        let fiber = Fiber::new(FiberAttr::new().name("early")).unwrap();
        let me = fiber.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                // The wake lands while the fiber is still running.
                Waiter::current().unwrap().wake();
                let during = me.state();
                sleep();
                (during, "continued")
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        assert_eq!(
            fiber.state(),
            FiberState::Ready,
            "already woken: runnable at once"
        );
        let (during, word) = fiber.run().unwrap().unwrap_returned();
        assert_eq!(during, FiberState::RunningWoken);
        assert_eq!(word, "continued");
        assert_eq!(fiber.stats().sleeps, 1);
    });
}

/// A wake that comes before the fiber sleeps, followed by a yield instead
/// of a sleep, is void: it does not carry over to end the fiber's next
/// sleep at once.
#[test]
fn a_wake_followed_by_a_yield_instead_of_a_sleep_is_void() {
    with_watchdog(30, "wake_then_yield", || {
        let slot: Slot = Arc::default();
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        let s = slot.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                Waiter::current().unwrap().wake();
                yield_now();
                *s.lock().unwrap() = Some(Waiter::current().unwrap());
                sleep();
                1
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert_eq!(fiber.state(), FiberState::Ready);
        assert!(
            matches!(fiber.run().unwrap(), RunOutcome::Slept),
            "the earlier wake did not end the later sleep"
        );
        assert_eq!(fiber.state(), FiberState::Sleeping);
        take(&slot).wake();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(1)));
    });
}

#[test]
fn sleeping_several_times() {
    with_watchdog(30, "sleep_repeatedly", || {
        let slot: Slot = Arc::default();
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        let s = slot.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                let mut n = 0;
                for _ in 0..10 {
                    *s.lock().unwrap() = Some(Waiter::current().unwrap());
                    sleep();
                    n += 1;
                }
                n
            })
            .unwrap();
        for _ in 0..10 {
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
            assert_eq!(fiber.state(), FiberState::Sleeping);
            take(&slot).wake();
        }
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(10)));
        assert_eq!(fiber.stats().sleeps, 10);
    });
}

#[test]
fn a_sleeping_fiber_whose_waiter_is_dropped_is_unwound_with_its_last_handle() {
    with_watchdog(30, "drop_sleeper", || {
        let drops = Arc::new(AtomicUsize::new(0));
        let slot: Slot = Arc::default();
        let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
        let (d, s) = (drops.clone(), slot.clone());
        fiber
            .set_function(Priority::NORMAL, move || {
                let _g = DropCounter(d);
                *s.lock().unwrap() = Some(Waiter::current().unwrap());
                sleep();
            })
            .unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        drop(fiber);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "the waiter keeps the fiber alive"
        );
        drop(take(&slot));
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the last reference unwound it");
    });
}

#[test]
fn outside_a_fiber_there_is_no_waiter_and_sleep_panics() {
    assert!(Waiter::current().is_none());
    let err = std::panic::catch_unwind(sleep).unwrap_err();
    let msg = err.downcast_ref::<&str>().copied().unwrap_or_default();
    assert!(msg.contains("outside a fiber"), "{msg:?}");
}

/// A run queue stand-in: collects the fibers a wake hands back.
#[derive(Default)]
struct Collect(Mutex<Vec<Fiber<u32>>>);

impl Schedule<u32> for Collect {
    fn schedule<'w>(&self, fiber: Woken<'w, u32>) -> Result<(), Woken<'w, u32>> {
        assert_eq!(fiber.fiber().state(), FiberState::Locked, "held by the wake");
        let fiber = fiber.into_queued();
        assert_eq!(fiber.state(), FiberState::Queued);
        self.0.lock().unwrap().push(fiber);
        Ok(())
    }
}

#[test]
fn a_woken_fiber_goes_back_to_the_scheduler_it_was_queued_on() {
    with_watchdog(30, "wake_to_home", || {
        let home = Arc::new(Collect::default());
        let home_dyn: Arc<dyn Schedule<u32>> = home.clone();
        let slot: Slot = Arc::default();
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, sleeper(slot.clone(), 3))
            .unwrap();
        fiber.mark_queued(Some(&home_dyn)).unwrap();
        fiber.mark_dequeued().unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        assert!(home.0.lock().unwrap().is_empty());

        take(&slot).wake();
        let woken = home
            .0
            .lock()
            .unwrap()
            .pop()
            .expect("the wake scheduled the fiber");
        assert!(Fiber::ptr_eq(&woken, &fiber));
        assert_eq!(fiber.state(), FiberState::Queued);
        woken.mark_dequeued().unwrap();
        assert!(matches!(woken.run().unwrap(), RunOutcome::Returned(3)));
    });
}

#[test]
fn an_early_wake_with_a_home_schedules_the_fiber_at_once() {
    with_watchdog(30, "early_wake_to_home", || {
        let home = Arc::new(Collect::default());
        let home_dyn: Arc<dyn Schedule<u32>> = home.clone();
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber
            .set_function(Priority::NORMAL, || {
                Waiter::current().unwrap().wake();
                sleep();
                4
            })
            .unwrap();
        fiber.mark_queued(Some(&home_dyn)).unwrap();
        fiber.mark_dequeued().unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        assert_eq!(fiber.state(), FiberState::Queued);
        let woken = home.0.lock().unwrap().pop().expect("scheduled by the runner");
        woken.mark_dequeued().unwrap();
        assert!(matches!(woken.run().unwrap(), RunOutcome::Returned(4)));
    });
}

/// Wakes that do not belong to a sleep in progress are void: a second
/// waiter of one sleep, a waiter kept after the fiber yielded, and one kept
/// after it returned. None of them panics in the waker, changes the fiber's
/// state or schedules it. The fiber has a home, so a wake taken for a real
/// one would hand it to the home (without one, a wake stores `Ready`, which
/// a void wake of a `Ready` fiber could not be told from).
#[test]
fn wakes_outside_a_sleep_are_void() {
    with_watchdog(30, "void_wakes", || {
        let home = Arc::new(Collect::default());
        let home_dyn: Arc<dyn Schedule<u32>> = home.clone();
        let scheduled = || home.0.lock().unwrap().len();
        let first: Slot = Arc::default();
        let second: Slot = Arc::default();
        let fiber = Fiber::new(FiberAttr::new().name("void-wakes")).unwrap();
        let (a, b) = (first.clone(), second.clone());
        fiber
            .set_function(Priority::NORMAL, move || {
                *a.lock().unwrap() = Waiter::current();
                *b.lock().unwrap() = Waiter::current();
                sleep();
                // A waiter kept across a yield.
                *a.lock().unwrap() = Waiter::current();
                yield_now();
                // And one kept past the end of the function.
                *b.lock().unwrap() = Waiter::current();
                7
            })
            .unwrap();
        fiber.mark_queued(Some(&home_dyn)).unwrap();
        fiber.mark_dequeued().unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
        assert_eq!(scheduled(), 0);

        take(&first).wake();
        assert_eq!(fiber.state(), FiberState::Queued, "the first wake woke it");
        assert_eq!(scheduled(), 1, "the first wake scheduled it on its home");
        take(&second).wake();
        assert_eq!(
            fiber.state(),
            FiberState::Queued,
            "the second waiter of that sleep is void"
        );
        assert_eq!(
            scheduled(),
            1,
            "the second waiter of that sleep scheduled nothing"
        );
        let woken = home.0.lock().unwrap().pop().unwrap();
        assert!(Fiber::ptr_eq(&woken, &fiber));
        drop(woken);
        fiber.mark_dequeued().unwrap();

        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
        assert_eq!(fiber.state(), FiberState::Ready);
        take(&first).wake();
        assert_eq!(fiber.state(), FiberState::Ready, "a wake after a yield is void");
        assert_eq!(scheduled(), 0, "a wake after a yield scheduled nothing");

        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(7)));
        take(&second).wake();
        assert_eq!(
            fiber.state(),
            FiberState::Finished,
            "a wake after the return is void"
        );
        assert_eq!(scheduled(), 0, "a wake after the return scheduled nothing");
        assert_eq!(fiber.stats().sleeps, 1);
    });
}

/// A scheduler that has shut down: refuses every fiber. With `pokes`, it
/// first tries to take the fiber out of its hold and run it, as a holder
/// of another handle could.
struct ShutDown {
    pokes: bool,
}

impl Schedule<u32> for ShutDown {
    fn schedule<'w>(&self, fiber: Woken<'w, u32>) -> Result<(), Woken<'w, u32>> {
        if self.pokes {
            assert!(fiber.fiber().mark_dequeued().is_err(), "held by the wake");
            assert!(fiber.fiber().run().is_err(), "held by the wake");
        }
        Err(fiber)
    }
}

/// Runs a sleeper once with `home` as its home; returns its waiter.
fn asleep_with_home(fiber: &Fiber<u32>, home: ShutDown) -> Waiter {
    let slot: Slot = Arc::default();
    fiber
        .set_function(Priority::NORMAL, sleeper(slot.clone(), 5))
        .unwrap();
    let home: Arc<dyn Schedule<u32>> = Arc::new(home);
    fiber.mark_queued(Some(&home)).unwrap();
    fiber.mark_dequeued().unwrap();
    assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
    take(&slot)
}

#[test]
fn a_refused_wake_holds_the_fiber_until_the_refusal_is_dropped() {
    with_watchdog(30, "refused_wake", || {
        let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        let waiter = asleep_with_home(&fiber, ShutDown { pokes: false });
        let refused = waiter.try_wake().expect_err("the home refuses");
        assert_eq!(refused.id(), fiber.id());
        assert!(format!("{refused:?}").contains("RefusedWake"));
        assert_eq!(fiber.state(), FiberState::Locked, "held while the refusal is");
        assert!(matches!(fiber.run(), Err(FiberError::Running(_))));
        assert!(fiber.mark_dequeued().is_err(), "nobody can take it meanwhile");
        drop(refused);
        assert_eq!(fiber.state(), FiberState::Ready);
        assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(5))));
    });
}

/// The scheduler gets the fiber held: nothing, not even the scheduler
/// itself, can take it out or run it before it is queued or refused.
#[test]
fn a_woken_fiber_is_held_until_queued_or_refused() {
    with_watchdog(30, "woken_is_held", || {
        let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        let waiter = asleep_with_home(&fiber, ShutDown { pokes: true });
        assert!(waiter.try_wake().is_err(), "refused");
        assert_eq!(fiber.state(), FiberState::Ready);
        assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(5))));
    });
}

#[test]
fn a_plain_wake_that_is_refused_leaves_the_fiber_ready() {
    with_watchdog(30, "refused_plain_wake", || {
        let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        asleep_with_home(&fiber, ShutDown { pokes: false }).wake();
        assert_eq!(fiber.state(), FiberState::Ready);
        assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(5))));
    });
}

/// A wake that handed nothing over was refused: the fiber is `Ready` in no
/// queue, still in its sleep. A later `try_wake` (a waker that handed it
/// something) is refused too, without asking the home again, until the
/// fiber has another home; a plain `wake` of it stays void.
#[test]
fn a_value_wake_of_a_fiber_refused_before_is_refused_too() {
    with_watchdog(30, "refused_before", || {
        let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        let waiter = asleep_with_home(&fiber, ShutDown { pokes: false });
        fiber.waiter().wake(); // refused, nothing handed over
        assert_eq!(fiber.state(), FiberState::Ready);

        fiber.waiter().wake();
        assert_eq!(fiber.state(), FiberState::Ready, "a plain wake of it is void");

        let refused = waiter.try_wake().expect_err("refused as its home refused");
        assert_eq!(refused.id(), fiber.id());
        assert_eq!(fiber.state(), FiberState::Locked, "held while the refusal is");
        assert!(matches!(fiber.run(), Err(FiberError::Running(_))));
        drop(refused);
        assert_eq!(fiber.state(), FiberState::Ready);

        fiber.set_home(None).unwrap();
        assert!(fiber.waiter().try_wake().is_ok(), "a new home: no longer refused");
        assert_eq!(fiber.state(), FiberState::Ready);
        assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(5))));

        // Queued again (by a scheduler that takes it): no longer refused.
        let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        let waiter = asleep_with_home(&fiber, ShutDown { pokes: false });
        fiber.waiter().wake(); // refused
        fiber.mark_queued(None).unwrap();
        fiber.mark_dequeued().unwrap();
        assert!(waiter.try_wake().is_ok(), "queued again: no longer refused");
        assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(5))));
    });
}

/// The hook of the wait a fiber is in runs when a refused fiber is let
/// go of, with the fiber still held: by a dropped `RefusedWake`, and by the
/// runner that finishes a deferred wake its home refuses. Not once the
/// fiber left the wait.
#[test]
fn letting_go_of_a_refused_fiber_runs_its_wait_hook() {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    static HELD: AtomicUsize = AtomicUsize::new(0);
    static FIBER: Mutex<Option<Fiber<u32>>> = Mutex::new(None);
    unsafe fn hook(_: NonNull<WaitHook>, let_go: &mut dyn FnMut()) -> Option<Waiter> {
        let fiber = FIBER.lock().unwrap();
        if fiber.as_ref().is_some_and(|f| f.state() == FiberState::Locked) {
            HELD.fetch_add(1, Ordering::SeqCst);
        }
        drop(fiber);
        CALLS.fetch_add(1, Ordering::SeqCst);
        let_go();
        None
    }
    // Sleeps with a hook set; with `wake_first`, wakes itself first (the
    // wake is deferred to the runner). Then leaves the wait and sleeps
    // again without a hook.
    fn hooked_sleeper(slot: Slot, wake_first: bool) -> impl FnOnce() -> u32 + Send + 'static {
        move || {
            let me = Waiter::current().unwrap();
            let token = me.wait_token();
            let hook = WaitHook::new(hook);
            // SAFETY: on this fiber's stack; `hook` stays in this frame
            // until `leave_wait` below.
            unsafe { token.enter_wait(NonNull::from(&hook)) };
            if wake_first {
                me.wake();
            } else {
                *slot.lock().unwrap() = Some(me);
            }
            sleep();
            // SAFETY: as above.
            unsafe { token.leave_wait() };
            *slot.lock().unwrap() = Some(Waiter::current().unwrap());
            sleep();
            7
        }
    }
    with_watchdog(30, "wait_hook", || {
        for wake_first in [false, true] {
            CALLS.store(0, Ordering::SeqCst);
            HELD.store(0, Ordering::SeqCst);
            let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
            let slot: Slot = Arc::default();
            fiber
                .set_function(Priority::NORMAL, hooked_sleeper(slot.clone(), wake_first))
                .unwrap();
            *FIBER.lock().unwrap() = Some(fiber.clone());
            let home: Arc<dyn Schedule<u32>> = Arc::new(ShutDown { pokes: false });
            fiber.mark_queued(Some(&home)).unwrap();
            fiber.mark_dequeued().unwrap();
            assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
            if !wake_first {
                let refused = take(&slot).try_wake().expect_err("refused");
                assert_eq!(CALLS.load(Ordering::SeqCst), 0, "not before it is let go of");
                drop(refused);
            }
            assert_eq!(
                CALLS.load(Ordering::SeqCst),
                1,
                "the hook ran (wake_first: {wake_first})"
            );
            assert_eq!(HELD.load(Ordering::SeqCst), 1, "with the fiber held");
            assert_eq!(fiber.state(), FiberState::Ready, "and let go");

            assert!(
                matches!(fiber.run(), Ok(RunOutcome::Slept)),
                "out of the hooked wait"
            );
            let next = take(&slot).try_wake().expect_err("refused again").take_back();
            assert!(next.is_none(), "no hook, nothing handed on");
            assert_eq!(CALLS.load(Ordering::SeqCst), 1, "no hook once it left the wait");
            assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(7))));
            FIBER.lock().unwrap().take();
        }
    });
}

/// `abandon`: a scheduler that shuts down lets go of a queued or ready
/// fiber for good: it is `Ready`, marked refused (a later value-handing
/// wake is refused), and a fiber in another state is left alone.
#[test]
fn an_abandoned_fiber_is_ready_and_refused() {
    with_watchdog(30, "abandon", || {
        let empty = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        assert!(empty.abandon().is_err(), "no function: nothing to let go of");
        assert_eq!(empty.state(), FiberState::Empty);

        let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        let slot: Slot = Arc::default();
        fiber
            .set_function(Priority::NORMAL, sleeper(slot.clone(), 5))
            .unwrap();
        let home: Arc<dyn Schedule<u32>> = Arc::new(ShutDown { pokes: false });
        fiber.mark_queued(Some(&home)).unwrap();
        fiber.mark_dequeued().unwrap();
        assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
        assert!(
            matches!(fiber.abandon(), Err(FiberError::Sleeping(_))),
            "asleep: its home refuses it"
        );
        let waiter = take(&slot);

        fiber.waiter().wake(); // refused: `Ready`
        fiber.set_home(None).unwrap(); // a new home: no longer refused
        assert!(fiber.waiter().try_wake().is_ok());
        fiber.mark_queued(Some(&home)).unwrap();
        fiber.abandon().unwrap();
        assert_eq!(fiber.state(), FiberState::Ready, "out of the queue");
        let refused = waiter.try_wake().expect_err("marked refused");
        drop(refused);
        assert!(
            matches!(fiber.run(), Ok(RunOutcome::Returned(5))),
            "a handle can still run it"
        );
    });
}

/// A wake that its home accepts (`Woken::into_queued`) clears the refused
/// mark: a fiber abandoned while it was still in a live queue is refused
/// only until it is queued again.
#[test]
fn a_wake_its_home_accepts_clears_the_refused_mark() {
    with_watchdog(30, "accepted_wake_clears_mark", || {
        let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
        let slot: Slot = Arc::default();
        let s = slot.clone();
        fiber
            .set_function(Priority::NORMAL, move || {
                for _ in 0..2 {
                    *s.lock().unwrap() = Some(Waiter::current().unwrap());
                    sleep();
                }
                5
            })
            .unwrap();
        let home = Arc::new(Collect(Mutex::new(Vec::new())));
        let dyn_home: Arc<dyn Schedule<u32>> = home.clone();
        fiber.mark_queued(Some(&dyn_home)).unwrap();
        fiber.mark_dequeued().unwrap();
        assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
        let first = take(&slot);
        fiber.waiter().wake(); // accepted: queued in `Collect`
        let queued = home.0.lock().unwrap().pop().expect("queued");
        queued.abandon().unwrap(); // as on a fiber still in a live queue
        assert!(fiber.waiter().try_wake().is_err(), "marked refused");
        assert!(
            matches!(fiber.run(), Ok(RunOutcome::Slept)),
            "on into its second sleep"
        );
        take(&slot).wake(); // its home accepts this wake
        let queued = home.0.lock().unwrap().pop().expect("queued again");
        queued.mark_dequeued().unwrap();
        assert!(
            first.try_wake().is_ok(),
            "the mark was cleared when its home queued it"
        );
        assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(5))));
    });
}
