//! Closing a channel: pushes are refused and handed back, receivers take
//! what was queued before and then get `None`, and receivers waiting at
//! the close (fibers and threads, interruptible or not, refused by their
//! scheduler or not) are woken with `None`. Nothing is lost: every message
//! pushed is received or handed back.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use common::{fiber, spin_until, watchdog, PanicsInSchedule, SlowRefuser};
use spindle_fiber::{FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Closed, Msg, MsgHeader, RawChannel};

/// Runs `f` once from a run queue of its own (its home from then on),
/// checks that it went to sleep, and drops the queue: a wake then finds
/// the queue gone and is refused.
fn asleep_with_its_queue_gone<T: Send + std::fmt::Debug + 'static>(f: &spindle_fiber::Fiber<T>) {
    let queue = RunQueue::new(1);
    queue.try_push(f.clone()).unwrap();
    let ran = queue.run_next().expect("the fiber was queued");
    assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "{:?}", ran.outcome);
}

/// Gives `f` the home `home` and runs it until it sleeps.
fn asleep_at_home(f: &spindle_fiber::Fiber<()>, home: &Arc<dyn spindle_fiber::Schedule<()>>) {
    f.set_home(Some(home)).unwrap();
    assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
}

/// Messages pushed before the close are still taken, in order; then `pop`,
/// `pop_interruptible` and `try_pop` say there is nothing (without
/// waiting), pushes come back in `Closed`, and a second close says it was
/// closed already.
#[test]
fn a_closed_channel_gives_out_what_was_queued_then_none() {
    watchdog("a_closed_channel_gives_out_what_was_queued_then_none", 30, |_| {
        let chan = Channel::new();
        assert!(!chan.is_closed());
        for i in 1..=3 {
            chan.push(Msg::new(i)).unwrap();
        }
        assert!(chan.close(), "this call closed it");
        assert!(!chan.close(), "closed already");
        assert!(chan.is_closed());
        let mut m = match chan.push(Msg::new(4)) {
            Err(Closed(m)) => m,
            Ok(()) => panic!("a closed channel queued a message"),
        };
        assert_eq!(*m, 4, "the refused message comes back");
        assert_eq!(chan.len(), 3, "and was not queued");
        *m = 5; // still the caller's to use
        assert_eq!(chan.pop().map(Msg::into_inner), Some(1));
        assert_eq!(chan.try_pop().map(Msg::into_inner), Some(2));
        assert_eq!(chan.pop_interruptible().unwrap().map(Msg::into_inner), Some(3));
        assert!(chan.pop().is_none());
        assert!(matches!(chan.pop_interruptible(), Ok(None)));
        assert!(chan.try_pop().is_none());
        assert_eq!(format!("{chan:?}"), "Channel { messages: 0, receivers: 0, closed: true }");
        let err = chan.push(m).unwrap_err();
        assert!(err.to_string().contains("closed channel"), "{err}");
        assert_eq!(err.into_inner().into_inner(), 5);
    });
}

/// Fibers (plain and interruptible) and a thread waiting on an empty
/// channel are all woken by the close, with `None`.
#[test]
fn closing_wakes_every_waiting_receiver_with_none() {
    watchdog("closing_wakes_every_waiting_receiver_with_none", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let queue = RunQueue::<bool>::new(4);
        let rx = chan.clone();
        let plain = fiber(Priority::NORMAL, move || rx.pop().is_none());
        let rx = chan.clone();
        let interruptible = fiber(Priority::NORMAL, move || matches!(rx.pop_interruptible(), Ok(None)));
        queue.try_push(plain.clone()).unwrap();
        queue.try_push(interruptible.clone()).unwrap();
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        }
        let rx = chan.clone();
        let thread = std::thread::spawn(move || rx.pop().is_none());
        stage.set("waiting for the thread to wait");
        spin_until(|| chan.receivers() == 3);

        stage.set("closing");
        assert!(chan.close());
        assert_eq!(chan.receivers(), 0);
        assert_eq!(plain.state(), FiberState::Queued, "woken onto its queue");
        assert_eq!(interruptible.state(), FiberState::Queued);
        assert!(thread.join().unwrap(), "the thread's pop returned None");
        let mut got = 0;
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Returned(true))), "{:?}", ran.outcome);
            got += 1;
        }
        assert_eq!(got, 2);
    });
}

/// A receiver whose scheduler refuses the close's wake (its run queue is
/// gone) is left ready, in no queue; the others are woken all the same,
/// and the refused one, run by hand, finds the channel closed.
#[test]
fn a_receiver_refused_at_the_close_does_not_stop_the_others() {
    watchdog("a_receiver_refused_at_the_close_does_not_stop_the_others", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let rx = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || rx.pop().is_none());
        asleep_with_its_queue_gone(&orphan);
        let rx = chan.clone();
        let thread = std::thread::spawn(move || rx.pop().is_none());
        stage.set("waiting for the thread to wait behind the orphan");
        spin_until(|| chan.receivers() == 2);
        stage.set("closing");
        assert!(chan.close());
        assert!(thread.join().unwrap(), "the thread behind the refused receiver was woken with None");
        assert_eq!(orphan.state(), FiberState::Ready, "refused: ready, in no queue");
        assert!(matches!(orphan.run(), Ok(RunOutcome::Returned(true))), "run by hand, it sees the close");
        assert_eq!((chan.len(), chan.receivers()), (0, 0));
    });
}

/// Producers on several threads push while consumer fibers on worker
/// threads and plain threads pop until `None`; one producer closes the
/// channel in the middle. Every message is received exactly once or
/// handed back to its producer: none is lost or seen twice, and every
/// receiver ends.
#[test]
fn a_close_racing_pushes_and_receivers_loses_nothing() {
    const PRODUCERS: usize = 3;
    const PER_PRODUCER: usize = 3_000;
    const FIBERS: usize = 4;
    const THREADS: usize = 2;
    watchdog("a_close_racing_pushes_and_receivers_loses_nothing", 120, |stage| {
        for round in 0..5 {
            stage.set(format!("round {round}"));
            let chan = Arc::new(Channel::<usize>::new());
            let seen =
                Arc::new((0..PRODUCERS * PER_PRODUCER).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>());
            let queue: Arc<RunQueue<()>> = Arc::new(RunQueue::new(FIBERS));
            for _ in 0..FIBERS {
                let (rx, seen) = (chan.clone(), seen.clone());
                queue
                    .try_push(fiber(Priority::NORMAL, move || {
                        while let Some(m) = rx.pop() {
                            seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
                        }
                    }))
                    .unwrap();
            }
            let finished = Arc::new(AtomicUsize::new(0));
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let (queue, finished) = (queue.clone(), finished.clone());
                    std::thread::spawn(move || {
                        while let Some(f) = queue.pop() {
                            if let Ok(RunOutcome::Returned(())) = queue.run_popped(f).outcome {
                                if finished.fetch_add(1, Ordering::SeqCst) + 1 == FIBERS {
                                    queue.close();
                                }
                            }
                        }
                    })
                })
                .collect();
            let threads: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (rx, seen) = (chan.clone(), seen.clone());
                    std::thread::spawn(move || {
                        while let Some(m) = rx.pop() {
                            seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
                        }
                    })
                })
                .collect();
            let producers: Vec<_> = (0..PRODUCERS)
                .map(|p| {
                    let chan = chan.clone();
                    std::thread::spawn(move || {
                        let mut refused = Vec::new();
                        for i in 0..PER_PRODUCER {
                            if p == 0 && i == PER_PRODUCER / 2 {
                                chan.close();
                            }
                            if let Err(Closed(m)) = chan.push(Msg::new(p * PER_PRODUCER + i)) {
                                refused.push(m.into_inner());
                            }
                        }
                        refused
                    })
                })
                .collect();
            let mut refused = Vec::new();
            for p in producers {
                refused.extend(p.join().unwrap());
            }
            for t in threads.into_iter().chain(workers) {
                t.join().unwrap();
            }
            for i in refused.iter().copied() {
                assert_eq!(
                    seen[i].load(Ordering::SeqCst),
                    0,
                    "round {round}: message {i} refused and received"
                );
                seen[i].fetch_add(1, Ordering::SeqCst);
            }
            assert!(refused.len() >= PER_PRODUCER / 2, "round {round}: pushes after the close were refused");
            for (i, n) in seen.iter().enumerate() {
                assert_eq!(
                    n.load(Ordering::SeqCst),
                    1,
                    "round {round}: message {i} received or refused once"
                );
            }
            assert_eq!((chan.len(), chan.receivers()), (0, 0));
        }
    });
}

/// The raw form: a refused header comes back in `Closed`, still the
/// caller's, and `pop` returns `None` once closed and empty.
#[test]
fn a_closed_raw_channel_hands_the_header_back() {
    let chan = RawChannel::new();
    let hdr = Box::leak(Box::new(spindle_sync::MsgHeader::new(std::ptr::null_mut(), 0)));
    let ptr = std::ptr::NonNull::from(&mut *hdr);
    chan.close();
    // SAFETY: a fresh header, alive until freed below.
    let back = unsafe { chan.push(ptr) }.unwrap_err().into_inner();
    assert_eq!(back, ptr);
    assert!(chan.pop().is_none());
    assert!(chan.try_pop().is_none());
    // SAFETY: never queued: ours, made by Box::leak.
    drop(unsafe { Box::from_raw(ptr.as_ptr()) });
}

/// A push hands its message to a receiver whose wake is then refused
/// (its scheduler shut down), and the channel closes while that wake is
/// in flight, with a live receiver waiting behind: the close tells the
/// live receiver `None`, and the refused message, given back after that,
/// waits in the channel, where `try_pop` finds it. Nothing is lost; a
/// reader that saw `None` does not see it (DESIGN.md, "Close": counting
/// hand-overs in flight to close this window was tried and rejected).
#[test]
fn a_message_given_back_by_a_refusal_racing_the_close_waits_in_the_channel() {
    watchdog("a_message_given_back_by_a_refusal_racing_the_close_waits_in_the_channel", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let rx = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || {
            let _ = rx.pop();
        });
        let home = Arc::new(SlowRefuser::default());
        let dyn_home: Arc<dyn spindle_fiber::Schedule<()>> = home.clone();
        asleep_at_home(&orphan, &dyn_home);
        let rx = chan.clone();
        let consumer = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(m) = rx.pop() {
                got.push(m.into_inner());
            }
            got
        });
        spin_until(|| chan.receivers() == 2);
        stage.set("pushing: handed to the orphan, its wake held in `schedule`");
        let tx = chan.clone();
        let producer = std::thread::spawn(move || tx.push(Msg::new(1)).is_ok());
        spin_until(|| home.entered.load(Ordering::SeqCst));
        stage.set("closing while the wake is in flight");
        assert!(chan.close());
        assert!(consumer.join().unwrap().is_empty(), "the live receiver is told None at the close");
        home.go.store(true, Ordering::SeqCst);
        assert!(producer.join().unwrap(), "the push was accepted");
        assert_eq!(chan.try_pop().map(Msg::into_inner), Some(1), "the refused message waits in the channel");
        assert_eq!(chan.receivers(), 0);
    });
}

/// The same race with nothing slowed down: a receiver whose run queue is
/// gone, a live thread behind it, and a push and a close on two threads.
/// Every accepted message reaches the live receiver or waits in the
/// channel; none is lost or seen twice.
#[test]
fn pushes_racing_a_close_with_a_refused_receiver_lose_nothing() {
    watchdog("pushes_racing_a_close_with_a_refused_receiver_lose_nothing", 120, |stage| {
        for round in 0..300 {
            stage.set(format!("round {round}"));
            let chan = Arc::new(Channel::<u32>::new());
            let rx = chan.clone();
            let orphan = fiber(Priority::NORMAL, move || {
                let _ = rx.pop();
            });
            asleep_with_its_queue_gone(&orphan);
            let rx = chan.clone();
            let consumer = std::thread::spawn(move || {
                let mut n = 0;
                while rx.pop().is_some() {
                    n += 1;
                }
                n
            });
            spin_until(|| chan.receivers() == 2);
            let go = Arc::new(Barrier::new(2));
            let (tx, go2) = (chan.clone(), go.clone());
            let producer = std::thread::spawn(move || {
                go2.wait();
                tx.push(Msg::new(1)).is_ok()
            });
            go.wait();
            chan.close();
            let pushed = producer.join().unwrap();
            let got = consumer.join().unwrap();
            let left = usize::from(chan.try_pop().is_some());
            assert_eq!(got + left, usize::from(pushed), "round {round}: received or left queued, once");
            assert!(chan.try_pop().is_none());
        }
    });
}

/// A receiver woken with a message (queued on its run queue) and dropped
/// before it runs, after the close told the other receivers `None`: the
/// unwind puts the message back into the channel (never lost, never freed
/// under anyone), where `try_pop` and `pop` still find it. The close
/// cannot wait for a woken receiver that may run much later; the docs say
/// so.
#[test]
fn a_message_given_back_after_the_close_waits_in_the_channel() {
    watchdog("a_message_given_back_after_the_close_waits_in_the_channel", 30, |_| {
        let chan = Arc::new(Channel::<u32>::new());
        let queue = RunQueue::new(1);
        let rx = chan.clone();
        queue.try_push(fiber(Priority::NORMAL, move || rx.pop().map(Msg::into_inner))).unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        chan.push(Msg::new(1)).unwrap(); // handed to the fiber, which is queued
        assert!(chan.close());
        assert!(chan.pop().is_none(), "closed and empty now");
        drop(queue); // the woken fiber is dropped before it ran: gives 1 back
        assert_eq!(chan.len(), 1);
        assert_eq!(chan.pop().map(Msg::into_inner), Some(1), "pop takes it before saying None");
        assert!(chan.pop().is_none());
    });
}

/// A receiver whose hand-over was taken back (its wake refused) and that
/// is run by hand after the close takes the queued message, then `None`.
#[test]
fn a_revoked_receiver_run_after_the_close_takes_the_queued_message() {
    watchdog("a_revoked_receiver_run_after_the_close_takes_the_queued_message", 30, |_| {
        let chan = Arc::new(Channel::<u32>::new());
        let rx = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || (rx.pop().map(Msg::into_inner), rx.pop().is_none()));
        asleep_with_its_queue_gone(&orphan);
        chan.push(Msg::new(5)).unwrap(); // refused: back to the queue
        assert_eq!(chan.len(), 1);
        chan.close();
        match orphan.run() {
            Ok(RunOutcome::Returned(r)) => assert_eq!(r, (Some(5), true)),
            other => panic!("{other:?}"),
        }
    });
}

/// Pushing a header that is still queued on another channel panics, as
/// documented, even when this channel is closed: handing it back as the
/// caller's would let the caller free a header another channel still
/// links (found in review).
#[test]
fn a_raw_push_of_a_queued_header_onto_a_closed_channel_panics() {
    let (a, b) = (RawChannel::new(), RawChannel::new());
    let h = std::ptr::NonNull::from(Box::leak(Box::new(MsgHeader::new(std::ptr::null_mut(), 0))));
    // SAFETY: a fresh header, alive until freed below.
    unsafe { a.push(h) }.unwrap();
    b.close();
    // SAFETY: as above (the push is refused before it touches anything).
    let pushed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { b.push(h) }.is_err()));
    assert!(pushed.is_err(), "a header queued on another channel was handed back as the caller's");
    assert_eq!(a.try_pop(), Some(h));
    // SAFETY: popped: ours again, made by Box::leak.
    drop(unsafe { Box::from_raw(h.as_ptr()) });
}

/// A push whose wake panics (its receiver's scheduler breaks the trait's
/// contract) leaves the channel usable: a later close tells the receiver
/// waiting behind that nothing will come. (The rejected in-flight count
/// once left this receiver asleep for good: DESIGN.md, "Close".)
#[test]
fn a_push_whose_wake_panics_still_lets_the_close_wake_the_others() {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    watchdog("a_push_whose_wake_panics_still_lets_the_close_wake_the_others", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let home: Arc<dyn spindle_fiber::Schedule<()>> = Arc::new(PanicsInSchedule);
        let rx = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || {
            let _ = rx.pop();
        });
        asleep_at_home(&orphan, &home);
        let rx = chan.clone();
        let thread = std::thread::spawn(move || rx.pop().map(Msg::into_inner));
        spin_until(|| chan.receivers() == 2);
        stage.set("pushing: the wake panics");
        let pushed = catch_unwind(AssertUnwindSafe(|| chan.push(Msg::new(1))));
        assert!(pushed.is_err(), "the scheduler's panic comes out of push");
        stage.set("closing: the thread behind must be told");
        assert!(chan.close());
        assert_eq!(thread.join().unwrap(), None);
        assert_eq!(chan.receivers(), 0);
        drop(orphan);
    });
}

/// Closes its channel and drains it when dropped.
struct ClosesAndDrains(Arc<Channel<u32>>);

impl Drop for ClosesAndDrains {
    fn drop(&mut self) {
        self.0.close();
        while self.0.pop().is_some() {}
    }
}

/// A refused receiver whose last reference goes when the push lets go of
/// it is unwound on the pushing thread; its destructor closes the channel
/// and drains it with `pop` (a thread wait there: a dropped fiber cannot
/// sleep). The drain finds the channel closed and empty and returns.
/// (Found in review of the rejected in-flight count, which kept the `pop`
/// waiting for the push, which waited for the `pop`: DESIGN.md, "Close".)
#[test]
fn a_refused_receiver_unwound_by_the_push_may_close_and_drain_the_channel() {
    watchdog("a_refused_receiver_unwound_by_the_push_may_close_and_drain_the_channel", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let (rx, guard) = (chan.clone(), ClosesAndDrains(chan.clone()));
        let orphan = fiber(Priority::NORMAL, move || {
            let _guard = guard;
            let _ = rx.pop();
        });
        asleep_with_its_queue_gone(&orphan);
        drop(orphan); // its wait node's waiter is its last reference now
        let rx = chan.clone();
        let thread = std::thread::spawn(move || rx.pop().map(Msg::into_inner));
        spin_until(|| chan.receivers() == 2);
        stage.set("pushing: refused, handed on to the thread; the orphan unwinds, closes and drains");
        chan.push(Msg::new(1)).unwrap();
        assert_eq!(thread.join().unwrap(), Some(1));
        assert!(chan.is_closed(), "the orphan's destructor closed it");
    });
}

/// A receiver with no run queue whose handle was dropped (its wait's
/// waiter is its last reference): the push's wake, accepted, releases it
/// on the pushing thread. Its unwind gives the message back first (its
/// wait's guard runs before its own destructors), then its destructor
/// closes the channel and drains it: the drain takes the message and then
/// gets `None`. (Found in review of the rejected in-flight count, under
/// which the drain waited for the push, which waited for it.)
#[test]
fn an_accepted_receiver_unwound_by_the_push_may_close_and_drain_the_channel() {
    struct CountsDrained(Arc<Channel<u32>>, Arc<AtomicUsize>);
    impl Drop for CountsDrained {
        fn drop(&mut self) {
            self.0.close();
            while self.0.pop().is_some() {
                self.1.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    watchdog("an_accepted_receiver_unwound_by_the_push_may_close_and_drain_the_channel", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let drained = Arc::new(AtomicUsize::new(0));
        let (rx, guard) = (chan.clone(), CountsDrained(chan.clone(), drained.clone()));
        let orphan = fiber(Priority::NORMAL, move || {
            let _guard = guard;
            let _ = rx.pop();
        });
        assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
        drop(orphan); // its wait node's waiter is its last reference now
        stage.set("pushing: the accepted wake releases the orphan, which closes and drains");
        chan.push(Msg::new(1)).unwrap();
        assert!(chan.is_closed());
        assert_eq!(drained.load(Ordering::SeqCst), 1, "the drain took the given-back message");
        assert!(chan.is_empty());
    });
}

/// A home that closes the channel inside the wake, then refuses the fiber.
struct ClosesThenRefuses(Arc<Channel<u32>>);

impl spindle_fiber::Schedule<()> for ClosesThenRefuses {
    fn schedule<'w>(&self, w: spindle_fiber::Woken<'w, ()>) -> Result<(), spindle_fiber::Woken<'w, ()>> {
        self.0.close();
        Err(w)
    }
}

/// Receivers, oldest first: one whose home closes the channel inside the
/// wake and refuses it, one with no run queue whose handle was dropped,
/// and a live thread. The close inside the wake tells the other two
/// `None`; the refusal's give-back then finds nobody waiting and queues
/// the message. Nothing hangs and nothing is lost.
#[test]
fn a_close_inside_the_wake_of_a_refused_push_loses_nothing() {
    watchdog("a_close_inside_the_wake_of_a_refused_push_loses_nothing", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let home: Arc<dyn spindle_fiber::Schedule<()>> = Arc::new(ClosesThenRefuses(chan.clone()));
        let rx = chan.clone();
        let refused = fiber(Priority::NORMAL, move || {
            let _ = rx.pop();
        });
        asleep_at_home(&refused, &home);
        let rx = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || {
            let _ = rx.pop();
        });
        assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
        drop(orphan);
        let rx = chan.clone();
        let thread = std::thread::spawn(move || rx.pop().map(Msg::into_inner));
        spin_until(|| chan.receivers() == 3);
        stage.set("pushing");
        chan.push(Msg::new(1)).unwrap();
        let got = thread.join().unwrap();
        let queued = chan.try_pop().map(Msg::into_inner);
        assert_eq!((got, queued), (None, Some(1)), "(the thread got, left queued in the closed channel)");
        drop(refused);
    });
}

/// A close whose wake of one receiver panics (its scheduler breaks the
/// trait's contract) still wakes every other receiver before the panic
/// comes out of `close`. (Found in review: the loop stopped at the panic,
/// and the receivers behind slept for good on the closed channel.)
#[test]
fn a_close_whose_wake_panics_still_wakes_the_others() {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    watchdog("a_close_whose_wake_panics_still_wakes_the_others", 30, |stage| {
        let chan = Arc::new(Channel::<u32>::new());
        let home: Arc<dyn spindle_fiber::Schedule<()>> = Arc::new(PanicsInSchedule);
        let rx = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || {
            let _ = rx.pop();
        });
        asleep_at_home(&orphan, &home);
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let rx = chan.clone();
                std::thread::spawn(move || rx.pop().is_none())
            })
            .collect();
        spin_until(|| chan.receivers() == 3);
        stage.set("closing: the first wake panics");
        let closed = catch_unwind(AssertUnwindSafe(|| chan.close()));
        assert!(closed.is_err(), "the scheduler's panic comes out of close");
        for t in threads {
            assert!(t.join().unwrap(), "a receiver behind the panicking wake was told None");
        }
        assert_eq!(chan.receivers(), 0);
        drop(orphan);
    });
}

/// Runs its closure when dropped.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// A receiver with no run queue whose handle was dropped, released (and
/// unwound) by the next push's wake on the pushing thread: its destructor
/// closes the channel and joins the consumer thread, which reads until
/// `None`. A shutdown written the ordinary way finishes. (Found in review
/// of the rejected in-flight count, under which the consumer's `pop`
/// waited for the push, which waited for the destructor: DESIGN.md,
/// "Close".)
#[test]
fn a_receiver_unwound_by_a_push_may_close_and_join_the_consumer() {
    watchdog("a_receiver_unwound_by_a_push_may_close_and_join_the_consumer", 30, |stage| {
        type Consumer = Arc<std::sync::Mutex<Option<std::thread::JoinHandle<Vec<u32>>>>>;
        let chan = Arc::new(Channel::<u32>::new());
        let consumer: Consumer = Arc::default();
        let (c, j) = (chan.clone(), consumer.clone());
        let guard = OnDrop(move || {
            c.close();
            let got = j.lock().unwrap().take().unwrap().join().unwrap();
            assert_eq!(got, [1], "the consumer got the message the unwind gave back, then None");
        });
        let rx = chan.clone();
        let orphan = fiber(Priority::NORMAL, move || {
            let _guard = guard;
            let _ = rx.pop();
        });
        assert!(matches!(orphan.run(), Ok(RunOutcome::Slept)));
        drop(orphan); // its wait node's waiter is its last reference now
        let rx = chan.clone();
        *consumer.lock().unwrap() = Some(std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(m) = rx.pop() {
                got.push(m.into_inner());
            }
            got
        }));
        spin_until(|| chan.receivers() == 2);
        stage.set("pushing: the orphan unwinds, closes the channel and joins the consumer");
        chan.push(Msg::new(1)).unwrap();
        assert!(consumer.lock().unwrap().is_none(), "the destructor joined the consumer");
    });
}

/// Producers on three threads push numbered messages while one of them
/// closes the channel part-way; receiver fibers on three worker threads
/// (plain and interruptible pops, interrupted at random) and two reader
/// threads read until `None`; one worker drops its run queue and its
/// fibers' handles part-way (their wakes are refused from then on). Every
/// message ends up exactly once: received, handed back in `Closed`, or
/// left queued in the closed channel (a late give-back). (From a review's
/// stress test; `CHANNEL_CLOSE_ROUNDS` sets the rounds, 8 by default.)
#[test]
fn every_message_is_counted_once_under_interrupts_a_close_and_dropped_queues() {
    use common::XorShift;
    use spindle_run_queue::RunQueue;
    use spindle_sync::Closed;
    const PRODUCERS: usize = 3;
    const PER: usize = 4_000;
    const WORKERS: usize = 3;
    const FIBERS: usize = 4;
    let rounds: usize = std::env::var("CHANNEL_CLOSE_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
    let progress = Arc::new(AtomicUsize::new(0));
    let p2 = progress.clone();
    common::watchdog_with_progress(
        "every_message_is_counted_once_under_interrupts_a_close_and_dropped_queues",
        30,
        String::new,
        move || p2.load(Ordering::SeqCst) as u64,
        move |stage| {
            for round in 0..rounds {
                stage.set(format!("round {round}"));
                progress.fetch_add(1, Ordering::SeqCst);
                let chan = Arc::new(Channel::<usize>::new());
                let seen = Arc::new((0..PRODUCERS * PER).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>());
                let workers: Vec<_> = (0..WORKERS)
                    .map(|w| {
                        let (chan, seen, progress) = (chan.clone(), seen.clone(), progress.clone());
                        std::thread::spawn(move || {
                            let mut rng = XorShift::new((round * 31 + w * 7 + 1) as u64);
                            let queue = RunQueue::<()>::new(FIBERS);
                            let mut mine = Vec::new();
                            for k in 0..FIBERS {
                                let (rx, seen) = (chan.clone(), seen.clone());
                                let f = fiber(Priority::NORMAL, move || {
                                    if k % 2 == 0 {
                                        while let Some(m) = rx.pop() {
                                            seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
                                        }
                                    } else {
                                        loop {
                                            match rx.pop_interruptible() {
                                                Ok(Some(m)) => {
                                                    seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
                                                }
                                                Ok(None) => break,
                                                Err(_) => spindle_fiber::yield_now(),
                                            }
                                        }
                                    }
                                });
                                mine.push(f.clone());
                                queue.try_push(f).unwrap();
                            }
                            // Worker 0 drops its queue (and handles) mid-way.
                            let drop_after = if w == 0 { Some(200 + rng.below(400)) } else { None };
                            let mut runs = 0u64;
                            let mut finished = 0;
                            while finished < FIBERS {
                                if drop_after.is_some_and(|d| runs >= d) {
                                    break;
                                }
                                if let Some(f) = queue.pop_timeout(std::time::Duration::from_millis(1)) {
                                    runs += 1;
                                    progress.fetch_add(1, Ordering::Relaxed);
                                    if let Ok(RunOutcome::Returned(())) = queue.run_popped(f).outcome {
                                        finished += 1;
                                    }
                                }
                                if rng.below(4) == 0 {
                                    mine[rng.below(FIBERS as u64) as usize].interrupt();
                                }
                            }
                            drop(mine);
                            drop(queue);
                        })
                    })
                    .collect();
                let threads: Vec<_> = (0..2)
                    .map(|_| {
                        let (rx, seen) = (chan.clone(), seen.clone());
                        std::thread::spawn(move || {
                            while let Some(m) = rx.pop() {
                                seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
                            }
                        })
                    })
                    .collect();
                let close_at = 1000 + (round * 397) % (PER - 1000);
                let producers: Vec<_> = (0..PRODUCERS)
                    .map(|p| {
                        let chan = chan.clone();
                        std::thread::spawn(move || {
                            let mut refused = Vec::new();
                            for i in 0..PER {
                                if p == 1 && i == close_at {
                                    chan.close();
                                }
                                if let Err(Closed(m)) = chan.push(Msg::new(p * PER + i)) {
                                    refused.push(m.into_inner());
                                }
                                if i % 8 == 0 {
                                    std::thread::yield_now();
                                }
                            }
                            refused
                        })
                    })
                    .collect();
                let mut refused = Vec::new();
                for p in producers {
                    refused.extend(p.join().unwrap());
                }
                let nrefused = refused.len();
                stage.set(format!("round {round}: joining receivers"));
                for t in threads.into_iter().chain(workers) {
                    t.join().unwrap();
                }
                for i in refused {
                    seen[i].fetch_add(1, Ordering::SeqCst);
                }
                let mut left = 0;
                while let Some(m) = chan.try_pop() {
                    left += 1;
                    seen[m.into_inner()].fetch_add(1, Ordering::SeqCst);
                }
                assert!(nrefused > 0, "round {round}: the close came before the last pushes");
                let bad: Vec<_> = seen
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| n.load(Ordering::SeqCst) != 1)
                    .map(|(i, n)| (i, n.load(Ordering::SeqCst)))
                    .collect();
                assert!(bad.is_empty(), "round {round}: {left} left queued; miscounted (id, times): {bad:?}");
            }
        },
    );
}
