//! Loom model of a channel's hand-over of a message to a waiting receiver
//! (`RawChannel::push` with a receiver waiting; sync/src/wait.rs, waker
//! step 1), mirrored line for line: the real `push` needs a real wait list
//! and a parked thread, which loom cannot run.
//!
//! Run with:
//!
//! ```text
//! LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test --release -p spindle-sync --test loom
//! ```
//!
//! The pusher marks the header `HANDED`, writes the node's `value` and
//! publishes `done` (Release) under channel X's lock. A thread receiver
//! checks `done` (Acquire) without the lock; once it sees it, the header is
//! its own: it marks it not queued and pushes it onto channel Y at once,
//! which links it as Y's last message (a null link). Every execution must
//! end with the link null and the value handed over. With the pusher's mark
//! stored after `done` (the order fixed in `177b335`), executions exist in
//! which the late mark makes Y refuse the push or overwrites Y's link; the
//! `should_panic` variant checks that the model finds one.

#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

/// The header's link: not on any channel.
const NOT_QUEUED: usize = 1;
/// The header's link: handed to a receiver whose `pop` has not returned.
const HANDED: usize = 2;
/// The header's link: the last message of a queue.
const END: usize = 0;
/// The message, as the node's `value` sees it.
const MESSAGE: usize = 0x4d;

struct Header {
    next: AtomicUsize,
}

struct Node {
    /// Written by the pusher under X's lock, read by the receiver after
    /// `done`: a loom cell, so an unordered access is reported as a race.
    value: UnsafeCell<usize>,
    done: AtomicBool,
}

struct World {
    hdr: Header,
    node: Node,
    /// Channel X's lock (the pusher's side) and channel Y's queue head.
    x: Mutex<()>,
    y: Mutex<Option<usize>>,
}

fn model(mark_before_done: bool) {
    let bound = std::env::var("LOOM_MAX_PREEMPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(bound);
    builder.check(move || {
        let w = Arc::new(World {
            // Pushed by the caller of `push`: not queued yet.
            hdr: Header { next: AtomicUsize::new(NOT_QUEUED) },
            node: Node { value: UnsafeCell::new(0), done: AtomicBool::new(false) },
            x: Mutex::new(()),
            y: Mutex::new(None),
        });

        let pusher = {
            let w = w.clone();
            thread::spawn(move || {
                let _x = w.x.lock().unwrap();
                if mark_before_done {
                    w.hdr.next.store(HANDED, Ordering::Relaxed);
                }
                // `WaitList::pop_front`: the value, then `done` (Release) as
                // the last touch of the node.
                // SAFETY: loom checks this access against the receiver's.
                w.node.value.with_mut(|v| unsafe { *v = MESSAGE });
                w.node.done.store(true, Ordering::Release);
                if !mark_before_done {
                    w.hdr.next.store(HANDED, Ordering::Relaxed);
                }
            })
        };

        // The receiver, a thread: `wait` returns once it sees `done`
        // (its park loop; loom's yield stands for the park).
        while !w.node.done.load(Ordering::Acquire) {
            thread::yield_now();
        }
        // SAFETY: loom checks this access against the pusher's.
        let value = w.node.value.with(|v| unsafe { *v });
        assert_eq!(value, MESSAGE, "the receiver got the message");
        // `pop_inner`: the header is the receiver's now.
        w.hdr.next.store(NOT_QUEUED, Ordering::Relaxed);
        // `push` onto Y: refused if the header looks queued, else linked
        // as Y's only message.
        {
            let mut y = w.y.lock().unwrap();
            let found = w.hdr.next.load(Ordering::Relaxed);
            assert_eq!(
                found, NOT_QUEUED,
                "a write after the hand-over: the popped message was refused by the next push as queued"
            );
            w.hdr.next.store(END, Ordering::Relaxed);
            *y = Some(MESSAGE);
        }

        pusher.join().unwrap();
        assert_eq!(*w.y.lock().unwrap(), Some(MESSAGE));
        assert_eq!(
            w.hdr.next.load(Ordering::Relaxed),
            END,
            "a write after the hand-over: Y's link is overwritten"
        );
    });
}

#[test]
fn a_handed_message_is_the_receivers_once_it_sees_done() {
    model(true);
}

#[test]
#[should_panic(expected = "a write after the hand-over")]
fn a_mark_stored_after_done_can_overwrite_the_next_channels_link() {
    model(false);
}
