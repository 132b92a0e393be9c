//! `Debug` output of the public types: each says what state it is in, in
//! terms a user can act on (ids, counts, names), and never blocks.

mod common;

use std::sync::Arc;

use common::fiber;
use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome, StackPool};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, MsgHeader, RawChannel, Semaphore};

#[test]
fn fibers_show_id_name_state_and_priority() {
    let f = Fiber::<()>::new(FiberAttr::new().name("worker").stack_size(64 * 1024)).unwrap();
    let shown = format!("{f:?}");
    for part in [&format!("{:?}", f.id()), "\"worker\"", "Empty", "stack_size: 65536"] {
        assert!(shown.contains(part), "{shown} lacks {part}");
    }
    assert!(format!("{:?}", FiberAttr::new().name("n")).contains("\"n\""));
    let pool = StackPool::new(3);
    assert_eq!(format!("{pool:?}"), "StackPool { capacity: 3, cached: 0 }");
}

#[test]
fn queues_and_primitives_show_their_counts() {
    let queue = RunQueue::<()>::new(2);
    queue.try_push(fiber(Priority::NORMAL, || {})).unwrap();
    let shown = format!("{queue:?}");
    assert!(shown.contains("len: 1") && shown.contains("capacity: 2"), "{shown}");

    let full = RunQueue::<()>::new(1);
    full.try_push(fiber(Priority::NORMAL, || {})).unwrap();
    let refused = fiber(Priority::NORMAL, || {});
    let id = refused.id();
    let err = full.try_push(refused).unwrap_err();
    assert_eq!(format!("{err:?}"), format!("Full({id:?})"));

    let sem = Arc::new(Semaphore::new(2));
    assert_eq!(format!("{sem:?}"), "Semaphore { tokens: 2, waiters: 0 }");
    let s = sem.clone();
    let waiter = fiber(Priority::NORMAL, move || {
        s.acquire();
        s.acquire();
        s.acquire();
    });
    assert!(matches!(waiter.run(), Ok(RunOutcome::Slept)));
    assert_eq!(format!("{sem:?}"), "Semaphore { tokens: 0, waiters: 1 }");
    sem.release(1);

    let chan = Channel::new();
    chan.push(Msg::new(7u8)).unwrap();
    assert_eq!(format!("{chan:?}"), "Channel { messages: 1, receivers: 0, closed: false }");
    let msg = chan.try_pop().unwrap();
    assert!(format!("{msg:?}").contains('7'), "{msg:?}");
    let raw = RawChannel::new();
    assert_eq!(format!("{raw:?}"), "RawChannel { messages: 0, receivers: 0, closed: false }");
    let hdr = MsgHeader::new(std::ptr::null_mut(), 5);
    assert!(format!("{hdr:?}").contains("len: 5"), "{hdr:?}");
}
