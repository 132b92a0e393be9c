//! Channels on one thread: caller-owned messages, FIFO of messages and of
//! waiting fibers, message reuse, the raw trailing-payload form, and what
//! dropping a channel does to queued messages.

mod common;

use std::ptr::NonNull;
use std::sync::Arc;

use common::{fiber, watchdog, Counted, DropCounter};
use spindle_fiber::{Fiber, FiberError, FiberState, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, MsgHeader, RawChannel};

/// The flow: `try_pop` on empty is `None`; a fiber popping an empty
/// channel sleeps; running it while it sleeps is an error; a push wakes it
/// onto its run queue and it sees the message.
#[test]
fn a_fiber_sleeps_on_an_empty_channel_and_a_push_wakes_it() {
    watchdog("a_fiber_sleeps_on_an_empty_channel_and_a_push_wakes_it", 30, |stage| {
        let chan = Arc::new(Channel::<u64>::new());
        assert!(chan.try_pop().is_none());
        assert!(chan.is_empty());
        assert_eq!((chan.len(), chan.receivers()), (0, 0));

        let queue = RunQueue::<u64>::new(4);
        let rx = chan.clone();
        let f = fiber(Priority::NORMAL, move || rx.pop().unwrap().into_inner());
        queue.try_push(f.clone()).unwrap();

        stage.set("first run: the receiver should go to sleep");
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "{:?}", ran.outcome);
        assert_eq!(f.state(), FiberState::Sleeping);
        assert!(queue.is_empty());
        assert_eq!(chan.receivers(), 1);
        match f.run() {
            Err(FiberError::Sleeping(id)) => assert_eq!(id, f.id()),
            other => panic!("running a sleeping fiber gave {other:?}"),
        }

        chan.push(Msg::new(42)).unwrap();
        assert_eq!(f.state(), FiberState::Queued);
        assert_eq!(queue.len(), 1, "the push woke the receiver onto its queue");
        assert_eq!(queue.stats().wakes, 1);
        assert_eq!(chan.receivers(), 0);
        assert_eq!(chan.len(), 0, "the message went straight to the receiver");

        stage.set("second run: the woken receiver should return the message");
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Returned(42))), "{:?}", ran.outcome);
        assert!(chan.try_pop().is_none());
    });
}

/// Two messages already queued: the fiber takes both without sleeping.
#[test]
fn queued_messages_are_taken_without_sleeping() {
    watchdog("queued_messages_are_taken_without_sleeping", 30, |_stage| {
        let chan = Arc::new(Channel::<u64>::new());
        chan.push(Msg::new(1)).unwrap();
        chan.push(Msg::new(2)).unwrap();
        assert_eq!(chan.len(), 2);
        let rx = chan.clone();
        let f = fiber(Priority::NORMAL, move || {
            let a = rx.pop().unwrap().into_inner();
            let b = rx.pop().unwrap().into_inner();
            (a, b)
        });
        assert_eq!(f.run().unwrap().unwrap_returned(), (1, 2));
        assert_eq!(f.stats().sleeps, 0);
        assert!(chan.is_empty());
    });
}

/// Messages come out in push order; waiting receivers are served in the
/// order they started waiting, and are woken onto the queue in that order.
#[test]
fn messages_and_waiting_receivers_are_both_fifo() {
    const N: usize = 16;
    watchdog("messages_and_waiting_receivers_are_both_fifo", 30, |stage| {
        let chan = Arc::new(Channel::<usize>::new());
        for i in 0..100 {
            chan.push(Msg::new(i)).unwrap();
        }
        let got: Vec<usize> = std::iter::from_fn(|| chan.try_pop()).map(Msg::into_inner).collect();
        assert_eq!(got, (0..100).collect::<Vec<_>>());

        let queue = RunQueue::<(usize, usize)>::new(N);
        for i in 0..N {
            let rx = chan.clone();
            queue.try_push(fiber(Priority::NORMAL, move || (i, rx.pop().unwrap().into_inner()))).unwrap();
        }
        stage.set("putting the receivers to sleep");
        while let Some(ran) = queue.run_next() {
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)));
        }
        assert_eq!(chan.receivers(), N);
        // Messages 1000.. go to receivers 0.. in order.
        for i in 0..N {
            chan.push(Msg::new(1000 + i)).unwrap();
        }
        assert_eq!(chan.receivers(), 0);
        assert_eq!(queue.len(), N);
        stage.set("running the woken receivers");
        let results: Vec<(usize, usize)> = std::iter::from_fn(|| queue.run_next())
            .map(|ran| ran.outcome.unwrap().unwrap_returned())
            .collect();
        let expected: Vec<(usize, usize)> = (0..N).map(|i| (i, 1000 + i)).collect();
        assert_eq!(results, expected, "woken and served in the order they waited");
    });
}

/// A message handle is reused: pop it, change it in place, push it again.
/// The allocation is the same each time.
#[test]
fn a_message_is_reused_without_reallocating() {
    watchdog("a_message_is_reused_without_reallocating", 30, |_stage| {
        let chan = Channel::<[u64; 4]>::new();
        let mut m = Msg::new([0; 4]);
        let addr = &*m as *const [u64; 4];
        for round in 1..=100u64 {
            m[0] = round;
            m[3] = round * 2;
            chan.push(m).unwrap();
            m = chan.try_pop().expect("the message we pushed");
            assert_eq!(&*m as *const [u64; 4], addr, "round {round}: a new allocation");
            assert_eq!(*m, [round, 0, 0, round * 2]);
        }

        // Across a sleeping fiber: it gets the message, changes it, sends it
        // back on a second channel.
        let to_fiber = Arc::new(Channel::<String>::new());
        let back = Arc::new(Channel::<String>::new());
        let queue = RunQueue::<()>::new(1);
        let (rx, tx) = (to_fiber.clone(), back.clone());
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                for _ in 0..3 {
                    let mut m = rx.pop().unwrap();
                    m.push('!');
                    tx.push(m).unwrap();
                }
            }))
            .unwrap();
        let mut m = Msg::new(String::from("hi"));
        let addr = &*m as *const String;
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        for round in 0..3 {
            to_fiber.push(m).unwrap();
            assert_eq!(queue.len(), 1, "round {round}: the push woke the fiber");
            let ran = queue.run_next().unwrap();
            match ran.outcome {
                Ok(RunOutcome::Slept) => assert!(round < 2, "round {round}"),
                Ok(RunOutcome::Returned(())) => assert_eq!(round, 2),
                other => panic!("round {round}: unexpected outcome {other:?}"),
            }
            m = back.try_pop().expect("the fiber sent the message back");
            assert_eq!(&*m as *const String, addr, "round {round}: a new allocation");
        }
        assert_eq!(*m, "hi!!!");
        assert!(queue.run_next().is_none());
        assert_eq!(format!("{m:?}"), "Msg(\"hi!!!\")");
    });
}

/// A caller-managed block: the header directly followed by its payload
/// (`MsgHeader::init_trailing`), through the raw channel, to a fiber.
#[test]
fn raw_channel_carries_a_trailing_payload_block() {
    #[repr(C)]
    struct Block {
        hdr: MsgHeader,
        payload: [u8; 64],
    }

    watchdog("raw_channel_carries_a_trailing_payload_block", 30, |_stage| {
        let chan = Arc::new(RawChannel::new());
        let mut block = Box::new(Block { hdr: MsgHeader::new(std::ptr::null_mut(), 0), payload: [0; 64] });
        block.payload[..5].copy_from_slice(b"hello");
        block.payload[63] = 0xAB;
        let raw = Box::into_raw(block);
        // SAFETY: `payload` directly follows `hdr` in the repr(C) struct
        // (MsgHeader's size is a multiple of the payload's alignment), and
        // the header pointer is derived from the whole block, so that its
        // `buf` may reach the payload (one made from `&mut block.hdr` covers
        // the header only). Nothing touches the block through the `Box`
        // after this.
        unsafe {
            MsgHeader::init_trailing(std::ptr::addr_of_mut!((*raw).hdr), 64);
            assert_eq!((*raw).hdr.buf, std::ptr::addr_of_mut!((*raw).payload).cast::<u8>());
            assert_eq!((*raw).hdr.len, 64);
        }

        let queue = RunQueue::<(usize, Vec<u8>)>::new(1);
        let rx = chan.clone();
        queue
            .try_push(fiber(Priority::NORMAL, move || {
                let hdr = rx.pop().unwrap();
                // SAFETY: the header describes `len` readable payload bytes
                // that the test keeps alive and does not touch meanwhile.
                let bytes = unsafe {
                    let h = hdr.as_ref();
                    std::slice::from_raw_parts(h.buf, h.len).to_vec()
                };
                (hdr.as_ptr() as usize, bytes)
            }))
            .unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        assert_eq!(chan.receivers(), 1);
        // SAFETY: the block is a live, unmoved allocation pushed only here;
        // its header is the first field, so the pointers coincide.
        unsafe { chan.push(NonNull::new(raw as *mut MsgHeader).unwrap()) }.unwrap();
        let (addr, bytes) = queue.run_next().unwrap().outcome.unwrap().unwrap_returned();
        assert_eq!(addr, raw as usize, "the receiver got the very header we pushed");
        assert_eq!(&bytes[..5], b"hello");
        assert_eq!(bytes[63], 0xAB);
        assert_eq!(bytes.len(), 64);

        // Queued, then popped without waiting, in FIFO order.
        // SAFETY: as above; the block is popped before it is freed.
        unsafe {
            chan.push(NonNull::new(raw as *mut MsgHeader).unwrap()).unwrap();
            let mut second = MsgHeader::new(std::ptr::null_mut(), 0);
            let second_ptr = NonNull::from(&mut second);
            chan.push(second_ptr).unwrap();
            assert_eq!(chan.len(), 2);
            assert_eq!(chan.try_pop().map(NonNull::as_ptr), Some(raw as *mut MsgHeader));
            assert_eq!(chan.try_pop(), Some(second_ptr));
            assert!(chan.try_pop().is_none());
            drop(Box::from_raw(raw));
        }
    });
}

/// Dropping a raw channel with queued headers leaves them to their owners:
/// they stay valid and usable.
#[test]
fn dropping_a_raw_channel_leaves_queued_headers_to_their_owners() {
    let mut a = MsgHeader::new(std::ptr::null_mut(), 1);
    let mut b = MsgHeader::new(std::ptr::null_mut(), 2);
    {
        let chan = RawChannel::new();
        // SAFETY: both headers outlive the channel and are pushed only here.
        unsafe {
            chan.push(NonNull::from(&mut a)).unwrap();
            chan.push(NonNull::from(&mut b)).unwrap();
        }
        assert_eq!(chan.len(), 2);
    }
    // Reusable on another channel.
    let chan = RawChannel::new();
    // SAFETY: as above.
    unsafe { chan.push(NonNull::from(&mut b)) }.unwrap();
    // SAFETY: the popped header is `b`, alive in this frame.
    assert_eq!(chan.try_pop().map(|h| unsafe { h.as_ref().len }), Some(2));
    assert_eq!(a.len, 1);
}

/// Pushing a header that is still on a channel (queued there or on another
/// channel, or handed to a waiting receiver that has not returned it yet)
/// is refused with a panic that says what to do, and changes nothing: the
/// queue keeps its one message, and the header can be pushed again once it
/// is popped.
#[test]
fn pushing_a_header_that_is_on_a_channel_again_is_refused() {
    /// The refused push's panic message.
    fn refused(chan: &RawChannel, h: NonNull<MsgHeader>) -> String {
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `h` is alive; the push is refused before it links
            // anything or touches more than the link.
            unsafe { chan.push(h) }
        }))
        .expect_err("a second push of a header on a channel must be refused");
        err.downcast_ref::<&str>()
            .map(|m| m.to_string())
            .or_else(|| err.downcast_ref::<String>().cloned())
            .unwrap_or_default()
    }
    fn says_what_to_do(msg: &str) -> bool {
        msg.contains("on a channel already") && msg.contains("pop it")
    }

    watchdog("pushing_a_header_that_is_on_a_channel_again_is_refused", 30, |stage| {
        // One pointer for the whole test: no reference to the header is
        // made while a channel owns it.
        let h = NonNull::from(Box::leak(Box::new(MsgHeader::new(std::ptr::null_mut(), 7))));
        let chan = Arc::new(RawChannel::new());
        let other = RawChannel::new();
        stage.set("queued: pushed again on the same channel and on another");
        // SAFETY: `h` lives until the end of the test; nothing touches it
        // while a channel owns it.
        unsafe { chan.push(h) }.unwrap();
        for target in [&*chan, &other] {
            let msg = refused(target, h);
            assert!(says_what_to_do(&msg), "{msg}");
        }
        assert_eq!((chan.len(), other.len()), (1, 0));
        assert_eq!(chan.try_pop(), Some(h));
        assert!(chan.try_pop().is_none(), "the refused pushes linked nothing");

        stage.set("handed to a sleeping receiver that has not run yet");
        let queue = RunQueue::<usize>::new(1);
        let rx = chan.clone();
        queue.try_push(fiber(Priority::NORMAL, move || rx.pop().unwrap().as_ptr() as usize)).unwrap();
        assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
        // SAFETY: as above.
        unsafe { chan.push(h) }.unwrap(); // handed straight to the receiver
        assert!(chan.is_empty());
        let msg = refused(&other, h);
        assert!(says_what_to_do(&msg), "{msg}");
        let ran = queue.run_next().unwrap();
        assert!(matches!(ran.outcome, Ok(RunOutcome::Returned(p)) if p == h.as_ptr() as usize));

        stage.set("popped: pushed again");
        // SAFETY: as above.
        unsafe { other.push(h) }.unwrap();
        assert_eq!(other.try_pop(), Some(h));
        // SAFETY: the header came from `Box::leak` and no channel holds it.
        drop(unsafe { Box::from_raw(h.as_ptr()) });
    });
}

/// Dropping a channel that still holds messages drops their values, once.
#[test]
fn dropping_a_channel_drops_queued_messages() {
    let drops = DropCounter::default();
    let chan = Channel::<Counted>::new();
    for i in 0..5 {
        chan.push(Msg::new(drops.make(i))).unwrap();
    }
    let first = chan.try_pop().unwrap();
    assert_eq!(first.1, 0);
    assert_eq!(drops.drops(), 0);
    drop(chan);
    assert_eq!(drops.drops(), 4, "the four queued values are dropped with the channel");
    drop(first);
    assert_eq!(drops.drops(), 5);
}

/// A queued value whose drop panics does not stop the channel's drop: the
/// values queued behind it are still dropped (while the panic unwinds),
/// and the panic reaches whoever dropped the channel.
#[test]
fn a_panicking_message_drop_does_not_leak_the_rest_of_the_queue() {
    /// A counted value whose drop panics if `panics`.
    struct PanicsFirst {
        _counted: Counted,
        panics: bool,
    }
    impl Drop for PanicsFirst {
        fn drop(&mut self) {
            if self.panics {
                panic!("this message's drop panics");
            }
        }
    }
    let drops = DropCounter::default();
    let chan = Channel::<PanicsFirst>::new();
    for i in 0..5 {
        chan.push(Msg::new(PanicsFirst { _counted: drops.make(i), panics: i == 1 })).unwrap();
    }
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(chan)));
    assert!(dropped.is_err(), "the message's panic reaches the channel's dropper");
    assert_eq!(drops.drops(), 5, "every queued value is dropped, the ones behind the panic too");
}

/// A message's value is dropped exactly once whichever way it leaves:
/// `into_inner`, dropping the handle, or with the channel.
#[test]
fn message_values_are_dropped_exactly_once() {
    let drops = DropCounter::default();
    let chan = Channel::<Counted>::new();
    chan.push(Msg::new(drops.make(1))).unwrap();
    chan.push(Msg::new(drops.make(2))).unwrap();
    let v = chan.try_pop().unwrap().into_inner();
    assert_eq!((v.1, drops.drops()), (1, 0));
    drop(v);
    drop(chan.try_pop().unwrap());
    assert_eq!(drops.drops(), 2);
    drop(chan);
    assert_eq!(drops.drops(), 2);
}

/// A plain thread waits on a channel (it parks) and gets the message a
/// fiber pushes; a fiber gets the message a thread pushes.
#[test]
fn threads_and_fibers_exchange_messages() {
    watchdog("threads_and_fibers_exchange_messages", 30, |stage| {
        let to_thread = Arc::new(Channel::<u32>::new());
        let to_fiber = Arc::new(Channel::<u32>::new());
        let (rx, tx) = (to_thread.clone(), to_fiber.clone());
        let thread = std::thread::spawn(move || {
            let v = rx.pop().unwrap().into_inner();
            tx.push(Msg::new(v + 1)).unwrap();
            v
        });
        stage.set("waiting for the thread to wait on the channel");
        common::spin_until(|| to_thread.receivers() == 1);

        let queue = RunQueue::<u32>::new(1);
        let (tx, rx) = (to_thread.clone(), to_fiber.clone());
        let f = fiber(Priority::NORMAL, move || {
            tx.push(Msg::new(10)).unwrap();
            rx.pop().unwrap().into_inner()
        });
        queue.try_push(f.clone()).unwrap();
        stage.set("running the fiber; then waiting for the thread's reply");
        let ran = queue.run_next().unwrap();
        let v = match ran.outcome {
            // The reply may already be there.
            Ok(RunOutcome::Returned(v)) => v,
            Ok(RunOutcome::Slept) => {
                let popped =
                    queue.pop_timeout(std::time::Duration::from_secs(600)).expect("the reply wakes it");
                assert!(Fiber::ptr_eq(&popped, &f));
                queue.run_popped(popped).outcome.unwrap().unwrap_returned()
            }
            other => panic!("unexpected outcome {other:?}"),
        };
        assert_eq!(v, 11);
        assert_eq!(thread.join().unwrap(), 10);
    });
}

/// A message handed to a sleeping receiver that is then dropped before it
/// runs again is not lost: it goes to the next receiver, or back to the
/// front of the queue.
#[test]
fn a_message_handed_to_a_receiver_dropped_before_it_ran_is_given_back() {
    watchdog("a_message_handed_to_a_receiver_dropped_before_it_ran_is_given_back", 30, |stage| {
        let drops = DropCounter::default();
        let chan = Arc::new(Channel::<Counted>::new());
        let receiver = |chan: &Arc<Channel<Counted>>| {
            let rx = chan.clone();
            let f = fiber(Priority::NORMAL, move || rx.pop().unwrap().into_inner().1);
            assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
            f
        };

        stage.set("one receiver, handed a message, then dropped");
        let f = receiver(&chan);
        chan.push(Msg::new(drops.make(1))).unwrap();
        assert_eq!((f.state(), chan.len()), (FiberState::Ready, 0));
        chan.push(Msg::new(drops.make(2))).unwrap();
        drop(f);
        assert_eq!(drops.drops(), 0, "no message was dropped with the receiver");
        assert_eq!(chan.len(), 2);
        assert_eq!(chan.try_pop().unwrap().1, 1, "the given-back message is first again");
        assert_eq!(chan.try_pop().unwrap().1, 2);

        stage.set("two receivers: the first is handed a message and dropped, the second gets it");
        let (first, second) = (receiver(&chan), receiver(&chan));
        chan.push(Msg::new(drops.make(3))).unwrap();
        drop(first);
        assert_eq!(second.state(), FiberState::Ready, "the message was handed on");
        assert!(matches!(second.run(), Ok(RunOutcome::Returned(3))));
        assert_eq!(chan.receivers(), 0);

        stage.set("three receivers handed messages, dropped oldest first and newest first");
        for oldest_first in [true, false] {
            let mut rxs: Vec<_> = (0..3).map(|_| receiver(&chan)).collect();
            for i in 10..13 {
                chan.push(Msg::new(drops.make(i))).unwrap();
            }
            chan.push(Msg::new(drops.make(13))).unwrap(); // queued: nobody waits now
            if !oldest_first {
                rxs.reverse();
            }
            drop(rxs);
            let order: Vec<u64> = std::iter::from_fn(|| chan.try_pop().map(|m| m.1)).collect();
            assert_eq!(
                order,
                [10, 11, 12, 13],
                "push order, whatever the drop order (oldest first: {oldest_first})"
            );
        }
    });
}

/// `Debug` reads the counts under the lock and formats after it: the
/// formatter's writer is the caller's code, and one that uses the channel
/// (a logger reporting through it) would wait on the lock for good. (From
/// a review: it hung every time.)
#[test]
fn debug_into_a_writer_that_uses_the_channel_does_not_deadlock() {
    use std::fmt::Write as _;
    struct Sink<'a> {
        chan: &'a Channel<u32>,
        raw: &'a RawChannel,
        out: String,
    }
    impl std::fmt::Write for Sink<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let _ = (self.chan.len(), self.raw.len()); // the writer uses both
            self.out.push_str(s);
            Ok(())
        }
    }
    watchdog("debug_into_a_writer_that_uses_the_channel_does_not_deadlock", 10, |_stage| {
        let chan = Channel::<u32>::new();
        chan.push(Msg::new(1)).unwrap();
        let raw = RawChannel::new();
        let mut sink = Sink { chan: &chan, raw: &raw, out: String::new() };
        write!(sink, "{chan:?} {raw:?}").unwrap();
        assert!(sink.out.contains("messages: 1"), "{}", sink.out);
        assert!(sink.out.contains("RawChannel"), "{}", sink.out);
    });
}

thread_local! {
    static THREAD_CHANNEL: Channel<u32> = const { Channel::new() };
}

/// A fiber that sleeps in `pop` inside the `with` of a thread-local
/// channel gets out of the borrow by suspending, so the thread's exit can
/// drop the channel under it: the drop warns and leaves the fiber asleep
/// for good (DESIGN.md, "Known gaps"), where a `debug_assert` aborted the
/// process in a thread-local destructor. (From a review.)
#[test]
fn a_thread_local_channel_dropped_under_a_sleeping_fiber_does_not_abort() {
    watchdog("a_thread_local_channel_dropped_under_a_sleeping_fiber_does_not_abort", 30, |_stage| {
        let (tx, rx) = std::sync::mpsc::channel();
        let owner = std::thread::spawn(move || {
            let f = Fiber::new(Default::default()).unwrap();
            f.set_function(Priority::NORMAL, || THREAD_CHANNEL.with(|c| c.pop().unwrap().into_inner()))
                .unwrap();
            assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
            assert_eq!(THREAD_CHANNEL.with(|c| c.receivers()), 1);
            tx.send(f).unwrap();
            // The thread exits: THREAD_CHANNEL is dropped with the fiber in it.
        });
        let f: Fiber<u32> = rx.recv().unwrap();
        assert!(owner.join().is_ok(), "the thread's exit did not panic");
        assert_eq!(f.state(), FiberState::Sleeping, "asleep for good");
        // Pinned to a thread that is gone: dropping it here leaks its stack
        // (counted) instead of unwinding its wait into the freed channel.
        drop(f);
    });
}
