//! Wakes that a fiber's scheduler refuses for good (its run queue is gone,
//! its executor shut down): what the waker handed over (a token, a message)
//! is taken back and goes to the next waiter or back to the primitive, so
//! nothing is lost and waiters queued behind such a fiber are not starved.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{fiber, spin_until, watchdog, SlowRefuser};
use spindle_fiber::{Fiber, FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, Semaphore};

/// Runs `f` once from a run queue of its own (its home from then on), checks
/// that it went to sleep, and drops the queue: a wake then finds the queue
/// gone and is refused.
fn asleep_with_its_queue_gone<T: Send + std::fmt::Debug + 'static>(f: &Fiber<T>) {
    let queue = RunQueue::new(1);
    queue.try_push(f.clone()).unwrap();
    let ran = queue.run_next().expect("the fiber was queued");
    assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "{:?}", ran.outcome);
    drop(ran);
    drop(queue);
    assert_eq!(f.state(), FiberState::Sleeping);
}

#[test]
fn a_token_handed_to_a_fiber_whose_queue_is_gone_goes_to_the_next_waiter() {
    watchdog("a_token_handed_to_a_fiber_whose_queue_is_gone_goes_to_the_next_waiter", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let orphan = fiber(Priority::NORMAL, move || s.acquire());
        asleep_with_its_queue_gone(&orphan);

        let live = RunQueue::new(1);
        let s = sem.clone();
        live.try_push(fiber(Priority::NORMAL, move || s.acquire())).unwrap();
        assert!(matches!(live.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        assert_eq!(sem.waiters(), 2, "the orphan waits first, the live fiber behind it");

        stage.set("releasing one token: the orphan's wake is refused");
        sem.release(1);
        assert_eq!(orphan.state(), FiberState::Ready, "a refused fiber is left Ready, in no queue");
        assert_eq!(live.len(), 1, "the token went on to the live fiber, which was woken");
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
        assert!(matches!(live.run_next().unwrap().outcome, Ok(RunOutcome::Returned(()))));

        stage.set("running the orphan by hand: it waits again");
        assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
        assert_eq!(sem.waiters(), 1, "back on the list, having taken nothing");
        sem.release(1);
        assert_eq!(
            (sem.available(), sem.waiters()),
            (1, 0),
            "refused again (its queue is still gone): the token stays in the count"
        );
        stage.set("running the orphan again: it takes the token in the count");
        assert!(matches!(orphan.run(), Ok(RunOutcome::Returned(()))));
        assert_eq!(sem.available(), 0);
    });
}

#[test]
fn a_thread_waiting_behind_a_refused_fiber_gets_the_token() {
    watchdog("a_thread_waiting_behind_a_refused_fiber_gets_the_token", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let orphan = fiber(Priority::NORMAL, move || s.acquire());
        asleep_with_its_queue_gone(&orphan);

        let s = sem.clone();
        let thread = std::thread::spawn(move || s.acquire());
        stage.set("waiting for the thread to wait behind the orphan");
        spin_until(|| sem.waiters() == 2);
        stage.set("releasing one token: the thread behind the refused orphan must get it");
        sem.release(1);
        thread.join().unwrap();
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
        assert_eq!(orphan.state(), FiberState::Ready);
    });
}

/// A refused fiber in an interruptible wait, interrupted and then run by
/// hand with its token back in the count: it takes the token, as an
/// interruptible wait takes one that is there on the way in, and the
/// interrupt stays pending. (From a review: it returned `Interrupted`
/// with the token available.)
#[test]
fn a_refused_interruptible_wait_takes_a_token_that_is_there_before_an_interrupt() {
    watchdog("a_refused_interruptible_wait_takes_a_token_that_is_there_before_an_interrupt", 30, |_stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let orphan = fiber(Priority::NORMAL, move || {
            let first = s.acquire_interruptible();
            (first, spindle_fiber::take_interrupt())
        });
        asleep_with_its_queue_gone(&orphan);
        sem.release(1); // refused: the token goes back to the count
        assert_eq!(sem.available(), 1);
        orphan.interrupt(); // `Ready`: only the mark
        match orphan.run() {
            Ok(RunOutcome::Returned((first, pending))) => {
                assert_eq!(first, Ok(()), "the token that was there is taken");
                assert!(pending, "the interrupt is still pending");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(sem.available(), 0);
    });
}

/// A wake that hands nothing over (an interrupt of a plain wait) is
/// refused first: the orphan is left `Ready`, in no queue, still in its
/// wait. The release that then hands it the token must find it refused
/// too and pass the token on, for a fiber and for a channel receiver.
/// (Before, that wake found the fiber `Ready` and was void: the token or
/// message stayed with a fiber nobody would run, and the thread behind it
/// waited for ever.)
#[test]
fn a_value_for_a_fiber_refused_by_an_earlier_empty_wake_goes_to_the_next_waiter() {
    watchdog("a_value_for_a_fiber_refused_by_an_earlier_empty_wake_goes_to_the_next_waiter", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let orphan = fiber(Priority::NORMAL, move || s.acquire());
        asleep_with_its_queue_gone(&orphan);
        orphan.interrupt(); // a plain wait: a spurious wake, refused
        assert_eq!(orphan.state(), FiberState::Ready, "refused: ready, in no queue");
        assert_eq!(sem.waiters(), 1, "and still in its wait");

        let s = sem.clone();
        let thread = std::thread::spawn(move || s.acquire());
        stage.set("waiting for the thread to wait behind the orphan");
        spin_until(|| sem.waiters() == 2);
        stage.set("releasing one token: the thread behind the orphan must get it");
        sem.release(1);
        thread.join().unwrap();
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
        assert_eq!(orphan.state(), FiberState::Ready);

        stage.set("running the orphan by hand: it took nothing, so it waits again");
        assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
        assert_eq!(sem.waiters(), 1);
        sem.release(1);
        assert_eq!((sem.available(), sem.waiters()), (1, 0), "refused again: the token is counted");
        assert!(matches!(orphan.run(), Ok(RunOutcome::Returned(()))));
        assert_eq!(sem.available(), 0);

        stage.set("the same for a receiver on a channel");
        let chan = Arc::new(Channel::<u32>::new());
        let c = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || c.pop().unwrap().into_inner());
        asleep_with_its_queue_gone(&orphan);
        orphan.interrupt();
        chan.push(Msg::new(7)).unwrap();
        assert_eq!((chan.len(), chan.receivers()), (1, 0), "the message went back to the channel");
        assert!(matches!(orphan.run(), Ok(RunOutcome::Returned(7))), "run by hand, it takes it");
    });
}

#[test]
fn a_message_handed_to_a_refused_receiver_goes_to_the_next_one_or_back_to_the_channel() {
    watchdog(
        "a_message_handed_to_a_refused_receiver_goes_to_the_next_one_or_back_to_the_channel",
        30,
        |stage| {
            let chan = Arc::new(Channel::<u32>::new());
            let c = chan.clone();
            let orphan = fiber(Priority::NORMAL, move || c.pop().unwrap().into_inner());
            asleep_with_its_queue_gone(&orphan);

            stage.set("pushing with only the refused receiver waiting");
            chan.push(Msg::new(7)).unwrap();
            assert_eq!((chan.len(), chan.receivers()), (1, 0), "the message went back to the channel");
            assert_eq!(chan.try_pop().map(Msg::into_inner), Some(7));

            stage.set("running the orphan: it waits again");
            assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
            let c = chan.clone();
            let thread = std::thread::spawn(move || c.pop().unwrap().into_inner());
            spin_until(|| chan.receivers() == 2);
            stage.set("pushing with a thread waiting behind the refused receiver");
            chan.push(Msg::new(8)).unwrap();
            assert_eq!(thread.join().unwrap(), 8, "the thread behind the refused receiver got it");
            assert!(chan.is_empty());
        },
    );
}

/// The refusal was the fiber's last reference: it is unwound on this
/// thread (its own), from inside the wait whose value was taken back. Its
/// destructors run and the token is counted once, not given back twice.
#[test]
fn a_refused_fiber_unwound_by_the_waker_gives_nothing_back_twice() {
    watchdog("a_refused_fiber_unwound_by_the_waker_gives_nothing_back_twice", 30, |stage| {
        struct Bump(Arc<AtomicUsize>);
        impl Drop for Bump {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicUsize::new(0));
        let sem = Arc::new(Semaphore::new(0));
        let (s, d) = (sem.clone(), dropped.clone());
        let orphan = fiber(Priority::NORMAL, move || {
            let _bump = Bump(d);
            s.acquire();
        });
        asleep_with_its_queue_gone(&orphan);
        drop(orphan); // the wait list holds the last reference now

        stage.set("releasing one token to the refused fiber, which is then dropped here");
        sem.release(1);
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "the fiber was unwound here");
        assert_eq!((sem.available(), sem.waiters()), (1, 0), "the token counted once");
    });
}

/// Refusals in a row, one of them re-entering the release: the first
/// refused fiber is dropped inside the release (its last reference), and
/// its unwind releases a token of its own. The second refused fiber passes
/// both on; the thread behind them gets one, the count keeps the other.
#[test]
fn refused_fibers_in_a_row_one_releasing_as_it_unwinds_lose_nothing() {
    watchdog("refused_fibers_in_a_row_one_releasing_as_it_unwinds_lose_nothing", 30, |stage| {
        struct ReleaseOnDrop(Arc<Semaphore>);
        impl Drop for ReleaseOnDrop {
            fn drop(&mut self) {
                self.0.release(1);
            }
        }
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let first = fiber(Priority::NORMAL, move || {
            let _give = ReleaseOnDrop(s.clone());
            s.acquire();
        });
        asleep_with_its_queue_gone(&first);
        drop(first); // the wait list holds its last reference
        let s = sem.clone();
        let second = fiber(Priority::NORMAL, move || s.acquire());
        asleep_with_its_queue_gone(&second);
        let s = sem.clone();
        let thread = std::thread::spawn(move || s.acquire());
        stage.set("waiting for the thread to wait behind both fibers");
        spin_until(|| sem.waiters() == 3);
        stage.set("releasing one token past two refused fibers");
        sem.release(1);
        thread.join().unwrap();
        assert_eq!((sem.available(), sem.waiters()), (1, 0), "the unwound fiber's token is counted");
        assert!(matches!(second.run(), Ok(RunOutcome::Returned(()))), "it takes the counted token");
        assert_eq!(sem.available(), 0);
    });
}

/// A scheduler for the stale-wake test: a FIFO that refuses once closed.
#[derive(Default)]
struct Fifo(std::sync::Mutex<(std::collections::VecDeque<Fiber<()>>, bool)>);

impl spindle_fiber::Schedule<()> for Fifo {
    fn schedule<'w>(&self, w: spindle_fiber::Woken<'w, ()>) -> Result<(), spindle_fiber::Woken<'w, ()>> {
        let mut q = self.0.lock().unwrap();
        if q.1 {
            return Err(w);
        }
        q.0.push_back(w.into_queued());
        Ok(())
    }
}

/// A wake that is refused after the fiber already left the wait it was
/// for: a spurious wake (an interrupt of a plain wait) ran the fiber
/// between the waker's hand-over and its wake, the fiber took the token
/// and now sleeps in its next `acquire`. The refused waker must leave the
/// old node alone (it is gone; the new one may sit at the same address)
/// and take nothing back: the token was used once. (From a review: the
/// waker used to revoke the old node and count the token again.)
#[test]
fn a_refused_wake_of_a_fiber_that_left_the_wait_takes_nothing_back() {
    use std::sync::mpsc;
    use std::sync::Mutex;
    watchdog("a_refused_wake_of_a_fiber_that_left_the_wait_takes_nothing_back", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let acquired = Arc::new(AtomicUsize::new(0));
        let (fifo_a, fifo_f) = (Arc::new(Fifo::default()), Arc::new(Fifo::default()));
        let home_a: Arc<dyn spindle_fiber::Schedule<()>> = fifo_a.clone();
        let home_f: Arc<dyn spindle_fiber::Schedule<()>> = fifo_f.clone();
        let home_and_run = |f: &Fiber<()>, home: &Arc<dyn spindle_fiber::Schedule<()>>| {
            f.mark_queued(Some(home)).unwrap();
            f.mark_dequeued().unwrap();
            f.run().unwrap()
        };

        // Thread T owns fiber F, which acquires twice (pinned to T).
        let (to_t, t_rx) = mpsc::channel::<()>();
        let (t_tx, from_t) = mpsc::channel::<()>();
        let t = {
            let (sem, acquired, fifo_f, home_f) =
                (sem.clone(), acquired.clone(), fifo_f.clone(), home_f.clone());
            std::thread::spawn(move || {
                let f = fiber(Priority::NORMAL, move || {
                    sem.acquire();
                    acquired.fetch_add(1, Ordering::SeqCst);
                    sem.acquire();
                    acquired.fetch_add(1, Ordering::SeqCst);
                });
                t_rx.recv().unwrap();
                f.mark_queued(Some(&home_f)).unwrap();
                f.mark_dequeued().unwrap();
                assert!(matches!(f.run(), Ok(RunOutcome::Slept)), "F waits behind A");
                t_tx.send(()).unwrap();
                // Inside the release: F's node has the token, F is not woken yet.
                t_rx.recv().unwrap();
                f.interrupt(); // a spurious wake of a plain wait: F is queued
                let queued = fifo_f.0.lock().unwrap().0.pop_front().expect("F was queued");
                queued.mark_dequeued().unwrap();
                assert!(
                    matches!(f.run(), Ok(RunOutcome::Slept)),
                    "F took the token, sleeps in its second acquire"
                );
                fifo_f.0.lock().unwrap().1 = true; // F's scheduler shuts down
                t_tx.send(()).unwrap();
                t_rx.recv().unwrap(); // the release is over
                drop(f);
                t_tx.send(()).unwrap();
            })
        };

        // Fiber A, first in line, refused: its destructor (run when the
        // release drops its refusal, the last reference) lets T run F.
        struct Hook(mpsc::Sender<()>, Arc<Mutex<mpsc::Receiver<()>>>);
        impl Drop for Hook {
            fn drop(&mut self) {
                self.0.send(()).unwrap();
                self.1.lock().unwrap().recv().unwrap();
            }
        }
        let from_t = Arc::new(Mutex::new(from_t));
        let (s, hook) = (sem.clone(), Hook(to_t.clone(), from_t.clone()));
        let a = fiber(Priority::NORMAL, move || {
            let _hook = hook;
            s.acquire();
        });
        assert!(matches!(home_and_run(&a, &home_a), RunOutcome::Slept));
        fifo_a.0.lock().unwrap().1 = true;
        drop(a);
        to_t.send(()).unwrap();
        from_t.lock().unwrap().recv().unwrap();
        assert_eq!(sem.waiters(), 2);

        stage.set("releasing one token: A refused, F handed it, run by a spurious wake, then refused");
        sem.release(1);
        assert_eq!(acquired.load(Ordering::SeqCst), 1, "F took the one token");
        assert_eq!(sem.available(), 0, "and it was not counted again");
        to_t.send(()).unwrap();
        from_t.lock().unwrap().recv().unwrap();
        t.join().unwrap();
    });
}

/// A release hands the token to a fiber while another wake (one that
/// hands nothing over) holds it inside its home's `schedule`, which then
/// refuses it. The release finds the fiber held and leaves it to that
/// wake, whose letting go runs the fiber's wait hook: the token goes on to
/// the thread behind. (From a review: the token stayed with the fiber.)
#[test]
fn a_value_handed_over_while_a_refused_wake_holds_the_fiber_goes_on() {
    watchdog("a_value_handed_over_while_a_refused_wake_holds_the_fiber_goes_on", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let orphan = fiber(Priority::NORMAL, move || s.acquire());
        let home = Arc::new(SlowRefuser::default());
        let dyn_home: Arc<dyn spindle_fiber::Schedule<()>> = home.clone();
        orphan.set_home(Some(&dyn_home)).unwrap();
        assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
        let s = sem.clone();
        let thread = std::thread::spawn(move || s.acquire());
        stage.set("waiting for the thread to wait behind the orphan");
        spin_until(|| sem.waiters() == 2);
        let w = orphan.waiter();
        let empty = std::thread::spawn(move || w.wake());
        stage.set("waiting for the empty wake to hold the fiber in schedule");
        spin_until(|| home.entered.load(Ordering::SeqCst));
        assert_eq!(orphan.state(), FiberState::Locked);
        stage.set("releasing while the fiber is held");
        sem.release(1);
        home.go.store(true, Ordering::SeqCst);
        empty.join().unwrap();
        stage.set("the thread behind must get the token");
        thread.join().unwrap();
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
        assert_eq!(orphan.state(), FiberState::Ready);
    });
}

/// The same race without help, many times: an interrupt of the plain wait
/// (refused) and a release at once. Every token ends up in the count, never
/// with the fiber that nobody runs. Then the same with a handle's call that
/// fails and changes nothing but holds the fiber for a moment
/// (`set_function` on a busy fiber, `run` on the wrong thread), racing a
/// release to a fiber already refused.
#[test]
fn a_release_racing_a_refused_wake_or_a_failing_call_keeps_the_token() {
    use std::sync::atomic::AtomicBool;
    fn round(race: impl FnOnce(Fiber<()>, &AtomicBool) + Send + 'static, refuse_first: bool) -> bool {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let orphan = fiber(Priority::NORMAL, move || s.acquire());
        asleep_with_its_queue_gone(&orphan);
        if refuse_first {
            orphan.interrupt();
        }
        let start = Arc::new(AtomicBool::new(false));
        let (o, st) = (orphan.clone(), start.clone());
        let t = std::thread::spawn(move || race(o, &st));
        start.store(true, Ordering::Release);
        sem.release(1);
        t.join().unwrap();
        sem.available() == 1
    }
    watchdog("a_release_racing_a_refused_wake_or_a_failing_call_keeps_the_token", 120, |stage| {
        stage.set("an interrupt racing the release");
        for _ in 0..2000 {
            let kept = round(
                |o, start| {
                    spin_until(|| start.load(Ordering::Acquire));
                    o.interrupt();
                },
                false,
            );
            assert!(kept, "the token stayed with a refused fiber (interrupt)");
        }
        stage.set("a failing set_function racing the release");
        for _ in 0..1000 {
            let kept = round(
                |o, start| {
                    while !start.load(Ordering::Acquire) {
                        let _ = o.set_function(Priority::NORMAL, || ());
                    }
                    for _ in 0..64 {
                        let _ = o.set_function(Priority::NORMAL, || ());
                    }
                },
                true,
            );
            assert!(kept, "the token stayed with a refused fiber (set_function)");
        }
        stage.set("a run on the wrong thread racing the release");
        for _ in 0..1000 {
            let kept = round(
                |o, start| {
                    while !start.load(Ordering::Acquire) {
                        assert!(o.run().is_err());
                    }
                    for _ in 0..64 {
                        assert!(o.run().is_err());
                    }
                },
                true,
            );
            assert!(kept, "the token stayed with a refused fiber (run)");
        }
    });
}

/// A home that refuses every fiber (a shut-down scheduler).
struct Refuser;

impl spindle_fiber::Schedule<()> for Refuser {
    fn schedule<'w>(&self, w: spindle_fiber::Woken<'w, ()>) -> Result<(), spindle_fiber::Woken<'w, ()>> {
        Err(w)
    }
}

/// `set_home` with the same refusing home holds a refused fiber for a
/// moment; a release that hands it a token then finds it held and leaves
/// it to `set_home`, which must let go through the wait hook (the fiber
/// is still refused). (From a review: it stored `Ready` and the token
/// stayed with the fiber.)
#[test]
fn a_release_racing_a_set_home_to_the_same_refusing_home_keeps_the_token() {
    use std::sync::atomic::AtomicBool;
    watchdog("a_release_racing_a_set_home_to_the_same_refusing_home_keeps_the_token", 120, |_stage| {
        for _ in 0..2000 {
            let sem = Arc::new(Semaphore::new(0));
            let s = sem.clone();
            let orphan = fiber(Priority::NORMAL, move || s.acquire());
            let home: Arc<dyn spindle_fiber::Schedule<()>> = Arc::new(Refuser);
            orphan.set_home(Some(&home)).unwrap();
            assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
            orphan.interrupt(); // refused: `Ready`, marked, still in its wait
            let start = Arc::new(AtomicBool::new(false));
            let (o, st, h) = (orphan.clone(), start.clone(), home.clone());
            let t = std::thread::spawn(move || {
                while !st.load(Ordering::Acquire) {
                    let _ = o.set_home(Some(&h));
                }
                for _ in 0..64 {
                    let _ = o.set_home(Some(&h));
                }
            });
            start.store(true, Ordering::Release);
            sem.release(1);
            t.join().unwrap();
            assert_eq!(sem.available(), 1, "the token stayed with a refused fiber (set_home)");
        }
    });
}

/// A home that queues, and records which fiber was current when it was
/// called.
#[derive(Default)]
struct Recording {
    current: std::sync::Mutex<Vec<Option<spindle_fiber::FiberId>>>,
    queue: std::sync::Mutex<Vec<Fiber<()>>>,
}

impl spindle_fiber::Schedule<()> for Recording {
    fn schedule<'w>(&self, w: spindle_fiber::Woken<'w, ()>) -> Result<(), spindle_fiber::Woken<'w, ()>> {
        self.current.lock().unwrap().push(spindle_fiber::current_id());
        self.queue.lock().unwrap().push(w.into_queued());
        Ok(())
    }
}

/// A run on the wrong thread of a refused fiber holds it `Running` for a
/// moment; a release that comes then is deferred to that run, which lets
/// go of the fiber through its wait hook, and the hook wakes the next
/// waiter. That must happen with the thread's own current fiber (none)
/// back: the refused fiber is suspended on another thread, and code the
/// wake runs (a home's `schedule`, destructors) must not take it for its
/// own. (From a review: `schedule` saw the refused fiber as current, and a
/// scheduler that yielded there crashed the process.)
#[test]
fn a_wrong_thread_run_lets_go_of_a_refused_fiber_with_no_fiber_current() {
    use std::sync::atomic::AtomicBool;
    watchdog("a_wrong_thread_run_lets_go_of_a_refused_fiber_with_no_fiber_current", 120, |_stage| {
        for _ in 0..2000 {
            let sem = Arc::new(Semaphore::new(0));
            let s = sem.clone();
            let orphan = fiber(Priority::NORMAL, move || s.acquire());
            let dead: Arc<dyn spindle_fiber::Schedule<()>> = Arc::new(Refuser);
            orphan.set_home(Some(&dead)).unwrap();
            assert!(matches!(orphan.run(), Ok(RunOutcome::Slept))); // pinned here
            orphan.interrupt(); // refused: `Ready`, marked
            let rec = Arc::new(Recording::default());
            let live: Arc<dyn spindle_fiber::Schedule<()>> = rec.clone();
            let s = sem.clone();
            let next = fiber(Priority::NORMAL, move || s.acquire());
            next.set_home(Some(&live)).unwrap();
            assert!(matches!(next.run(), Ok(RunOutcome::Slept)));
            let start = Arc::new(AtomicBool::new(false));
            let (o, st) = (orphan.clone(), start.clone());
            let t = std::thread::spawn(move || {
                while !st.load(Ordering::Acquire) {
                    assert!(o.run().is_err());
                }
                for _ in 0..64 {
                    assert!(o.run().is_err());
                }
            });
            start.store(true, Ordering::Release);
            sem.release(1);
            t.join().unwrap();
            let current = rec.current.lock().unwrap().clone();
            assert_eq!(current, [None], "the next waiter was woken once, with no fiber current");
            let q = rec.queue.lock().unwrap().pop().unwrap();
            q.mark_dequeued().unwrap();
            assert!(matches!(q.run(), Ok(RunOutcome::Returned(()))));
        }
    });
}

/// A fiber woken for nothing (an interrupt of its plain wait) is queued
/// when its queue's last handle goes: the queue abandons it (`Ready`,
/// marked refused), so the token a release hands it next goes on to the
/// thread behind. With no handle left to the fiber and the release made on
/// another thread (where the fiber's stack can only leak), the token still
/// goes on. (From a review: the queue only took it out of `Queued`, and the
/// token stayed with it, or leaked with its stack.)
#[test]
fn a_fiber_its_queue_abandons_hands_on_the_next_token() {
    watchdog("a_fiber_its_queue_abandons_hands_on_the_next_token", 30, |stage| {
        for keep_handle in [true, false] {
            let sem = Arc::new(Semaphore::new(0));
            let s = sem.clone();
            let f = fiber(Priority::NORMAL, move || s.acquire());
            let queue = RunQueue::new(1);
            queue.try_push(f.clone()).unwrap();
            assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
            f.interrupt(); // a plain wait: queued for nothing
            assert_eq!(f.state(), FiberState::Queued);
            drop(queue);
            let kept = keep_handle.then(|| f.clone());
            drop(f);
            let s = sem.clone();
            let thread = std::thread::spawn(move || s.acquire());
            stage.set(format!("(handle kept: {keep_handle}) the thread waits behind the abandoned fiber"));
            spin_until(|| sem.waiters() == 2);
            stage.set(format!("(handle kept: {keep_handle}) the thread must get the released token"));
            let s = sem.clone();
            std::thread::spawn(move || s.release(1)).join().unwrap();
            thread.join().unwrap();
            assert_eq!((sem.available(), sem.waiters()), (0, 0));
            if let Some(f) = kept {
                assert_eq!(f.state(), FiberState::Ready);
            }
        }
    });
}

/// Waits on its semaphore when dropped: a destructor on a dropped fiber's
/// stack, unwound on the dropping thread, where the wait blocks the thread.
struct WaitsOnDrop(Arc<Semaphore>);

impl Drop for WaitsOnDrop {
    fn drop(&mut self) {
        self.0.acquire();
    }
}

/// A migratable fiber that holds a `WaitsOnDrop(gate)` and then runs `f`.
fn migratable_waiting_on_drop(
    priority: Priority,
    gate: &Arc<Semaphore>,
    f: impl FnOnce() + Send + 'static,
) -> Fiber<()> {
    let fiber = Fiber::new(spindle_fiber::FiberAttr::new().stack_size(64 * 1024)).unwrap();
    let gate = gate.clone();
    // SAFETY: only `Arc`s live across the suspension; no thread-locals.
    unsafe {
        fiber.set_function_migratable(priority, move || {
            let _waits = WaitsOnDrop(gate);
            f();
        })
    }
    .unwrap();
    fiber
}

/// A worker thread over `queue` until the queue is closed.
fn worker(queue: &RunQueue<()>) -> std::thread::JoinHandle<()> {
    let queue = queue.clone();
    std::thread::spawn(move || {
        while let Some(f) = queue.pop() {
            let _ = queue.run_popped(f);
        }
    })
}

/// A refused fiber whose wait node holds its last reference: letting go of
/// the refusal hands its token to the next waiter, and only then releases
/// (and so unwinds) the fiber, whose destructor waits for what that waiter
/// does with the token. (Found in review: the fiber was unwound first, on
/// the releasing thread, and its destructor waited for a wake that the
/// same thread had not made yet: the release never returned.)
#[test]
fn a_refused_fiber_is_unwound_only_after_the_next_waiter_is_woken() {
    watchdog("a_refused_fiber_is_unwound_only_after_the_next_waiter_is_woken", 30, |stage| {
        let (sem, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        // F: first in line, its queue gone, its node's waiter its last
        // reference. Its destructor waits for the gate.
        let s = sem.clone();
        let f = migratable_waiting_on_drop(Priority::NORMAL, &gate, move || s.acquire());
        let dead = RunQueue::new(1);
        dead.try_push(f).unwrap();
        assert!(matches!(dead.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        drop(dead);
        // W: second in line, on a live queue with a worker; with a token it
        // opens the gate.
        let live = RunQueue::new(1);
        let (s, g) = (sem.clone(), gate.clone());
        live.try_push(fiber(Priority::NORMAL, move || {
            s.acquire();
            g.release(1);
        }))
        .unwrap();
        let worker = worker(&live);
        spin_until(|| sem.waiters() == 2);
        stage.set("release(1): F refused, its token handed on to W, then F unwound here");
        sem.release(1);
        live.close();
        worker.join().unwrap();
        assert_eq!((sem.available(), gate.available()), (0, 0));
    });
}

/// The last handle of a queue abandons every fiber in it before it drops
/// any: a dropped fiber unwinds there, and its destructor may wait for what
/// abandoning a later one hands on. (Found in review: each fiber was
/// abandoned and dropped in turn, and the first one's destructor waited for
/// a token the second one still held.)
#[test]
fn a_dropped_queue_abandons_every_fiber_before_dropping_any() {
    watchdog("a_dropped_queue_abandons_every_fiber_before_dropping_any", 30, |stage| {
        let (sem_a, sem_b, gate) =
            (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let q = RunQueue::new(2);
        // F1, drained first (higher priority), waits for the gate when
        // unwound; F2 sleeps on `sem_b` ahead of W.
        let s = sem_a.clone();
        q.try_push(migratable_waiting_on_drop(Priority(200), &gate, move || s.acquire())).unwrap();
        let s = sem_b.clone();
        q.try_push(fiber(Priority(100), move || s.acquire())).unwrap();
        while let Some(ran) = q.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        }
        // W, on a live queue with a worker, opens the gate with a token of
        // `sem_b`, which only abandoning F2 hands on.
        let live = RunQueue::new(1);
        let (s, g) = (sem_b.clone(), gate.clone());
        live.try_push(fiber(Priority::NORMAL, move || {
            s.acquire();
            g.release(1);
        }))
        .unwrap();
        let worker = worker(&live);
        spin_until(|| sem_b.waiters() == 2);
        // Woken back into `q`, which now holds their last references.
        sem_a.release(1);
        sem_b.release(1);
        assert_eq!(q.len(), 2);
        stage.set("dropping the queue: F2's token must reach W before F1 is unwound");
        drop(q);
        live.close();
        worker.join().unwrap();
        // F1's token went back to `sem_a` (no one else waits there), F2's
        // to W, and W's gate release to F1's destructor.
        assert_eq!((sem_a.available(), sem_b.available(), gate.available()), (1, 0, 0));
    });
}

/// `release(2)` places both tokens (with waiters or in the count) before a
/// wake's unwinding runs destructors: the first wake drops a homeless
/// fiber's last reference, and the destructor that unwinds there acquires
/// a token of the same semaphore.
/// (Found in review: the second token was still in `release`'s hands, and
/// the release waited for itself.)
#[test]
fn a_release_hands_out_its_tokens_before_a_wake_runs_destructors() {
    watchdog("a_release_hands_out_its_tokens_before_a_wake_runs_destructors", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let s = sem.clone();
        let f = migratable_waiting_on_drop(Priority::NORMAL, &sem, move || s.acquire());
        // Run by hand: no home. Its node's waiter becomes its only reference.
        assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
        drop(f);
        let s = sem.clone();
        let thread = std::thread::spawn(move || s.acquire());
        spin_until(|| sem.waiters() == 2);
        stage.set("release(2), the homeless fiber first and a thread second");
        sem.release(2);
        stage.set("joining the thread that waited second");
        thread.join().unwrap();
        assert_eq!(sem.available(), 0);
    });
}

/// Acquires `n` tokens of its semaphore when dropped.
struct AcquiresOnDrop(Arc<Semaphore>, usize);

impl Drop for AcquiresOnDrop {
    fn drop(&mut self) {
        for _ in 0..self.1 {
            self.0.acquire();
        }
    }
}

/// A release of many tokens to a homeless fiber first (run by hand and
/// dropped while it slept: its wait node holds its last reference) and
/// threads behind it: the fiber's destructor, unwound by its wake, acquires
/// from the same semaphore, and finds its tokens handed out or counted
/// whatever the number of waiters. (Found in review: with the tokens handed
/// out eight at a time, nine waiters or eight with tokens to spare left the
/// release waiting for itself.)
#[test]
fn a_release_to_many_waiters_unwinds_a_woken_fiber_only_after_handing_out_every_token() {
    watchdog(
        "a_release_to_many_waiters_unwinds_a_woken_fiber_only_after_handing_out_every_token",
        60,
        |stage| {
            // (threads behind the fiber, tokens released, tokens its destructor takes)
            for (threads, n, takes) in [(1, 2, 1), (8, 10, 1), (7, 10, 2), (20, 22, 1)] {
                stage.set(format!(
                    "release({n}) to a fiber and {threads} threads, the destructor takes {takes}"
                ));
                let sem = Arc::new(Semaphore::new(0));
                let f = Fiber::<()>::new(spindle_fiber::FiberAttr::new().stack_size(64 * 1024)).unwrap();
                let (s, d) = (sem.clone(), AcquiresOnDrop(sem.clone(), takes));
                // SAFETY: only `Arc`s live across the suspension.
                unsafe {
                    f.set_function_migratable(Priority::NORMAL, move || {
                        let _d = d;
                        s.acquire();
                    })
                }
                .unwrap();
                assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
                drop(f);
                let waiting: Vec<_> = (0..threads)
                    .map(|_| {
                        let s = sem.clone();
                        std::thread::spawn(move || s.acquire())
                    })
                    .collect();
                spin_until(|| sem.waiters() == threads + 1);
                sem.release(n);
                for t in waiting {
                    t.join().unwrap();
                }
                // The fiber's own token came back to the count when it
                // unwound, and its destructor took from the count.
                assert_eq!(sem.available(), n - threads - takes, "release({n}), {threads} threads");
            }
        },
    );
}

/// A wake that drops a homeless fiber's last reference, first of two: the
/// fiber is unwound only after the second waiter, a thread its destructor
/// waits for, has been woken. (Found in review of a version that handed
/// the tokens out in a batch and then woke the batch in order: the first
/// wake unwound the fiber before the thread was woken, and the release
/// never returned. Handing out one token per wake, the unwinding fiber's
/// own token goes on to the thread, which is why this passes without the
/// deferral too.)
#[test]
fn a_woken_fiber_is_unwound_only_after_the_rest_of_the_release_is_woken() {
    watchdog("a_woken_fiber_is_unwound_only_after_the_rest_of_the_release_is_woken", 30, |stage| {
        let (sem, gate) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let s = sem.clone();
        let f = migratable_waiting_on_drop(Priority::NORMAL, &gate, move || s.acquire());
        assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
        drop(f);
        let (s, g) = (sem.clone(), gate.clone());
        let thread = std::thread::spawn(move || {
            s.acquire();
            g.release(1);
        });
        spin_until(|| sem.waiters() == 2);
        stage.set("release(2): the fiber's destructor waits for the thread woken second");
        sem.release(2);
        thread.join().unwrap();
        // The fiber's token came back when it unwound; the thread's gate
        // token went to the destructor.
        assert_eq!((sem.available(), gate.available()), (1, 0));
    });
}

/// A queue's drop abandons A, whose token goes on to C, asleep on the same
/// semaphore with this queue as its home and no handle but its wait node's:
/// the queue refuses C's wake, and C is released inside A's abandon. It is
/// unwound only after D, still to be abandoned, has handed its token on,
/// which C's destructor waits for. (Found in review: C was unwound inside
/// A's abandon and waited for D's token for ever.)
#[test]
fn a_sleeper_released_inside_an_abandon_waits_for_every_abandon() {
    watchdog("a_sleeper_released_inside_an_abandon_waits_for_every_abandon", 30, |stage| {
        let (s1, s2) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let q = RunQueue::new(4);
        let s = s1.clone();
        q.try_push(fiber(Priority(200), move || s.acquire())).unwrap(); // A
        let s = s1.clone();
        q.try_push(migratable_waiting_on_drop(Priority(150), &s2, move || s.acquire())).unwrap(); // C
        let s = s2.clone();
        q.try_push(fiber(Priority(100), move || s.acquire())).unwrap(); // D
        while let Some(ran) = q.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        }
        assert_eq!((s1.waiters(), s2.waiters()), (2, 1));
        s1.release(1); // to A, back in the queue
        s2.release(1); // to D, back in the queue
        assert_eq!(q.len(), 2);
        stage.set("dropping the queue: C's destructor waits for the token D's abandon hands on");
        drop(q);
        // A's token went to C and back (C unwound); D's to C's destructor.
        assert_eq!((s1.available(), s2.available()), (1, 0));
    });
}
