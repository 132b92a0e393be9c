//! Loom models of spindle-sync: a channel's hand-over of a message (this
//! header), the mutex's state word (module `mutex_model`), a channel's
//! close against a refused hand-over (module `close_model`), a thread's
//! timed wait against a waker (module `timed_model`) and a wait group's
//! finish (module `wait_group_model`); docs/loom.md describes each.
//!
//! The hand-over: a message to a waiting receiver
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

/// Loom model of `Mutex`'s state word against its wait list
/// (sync/src/mutex.rs: `lock`, `take_or_mark`, `unlock`, `hand_on`,
/// `give_back`), mirrored line for line; the wait itself (link a node
/// under the waiters' lock, then wait for `done`) is modelled with a
/// parked thread, as the wait protocol's own steps are checked elsewhere.
/// Every execution must give the lock to one holder at a time (a loom
/// cell counts the holders' increments: overlapping holders are a data
/// race), end unlocked with nobody linked, and leave no locker asleep (a
/// lost wakeup is a deadlock, which loom reports).
mod mutex_model {
    use std::collections::VecDeque;

    use loom::cell::UnsafeCell;
    use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    const LOCKED: usize = 1;
    const WAITERS: usize = 2;

    struct Node {
        done: AtomicBool,
        thread: thread::Thread,
    }

    pub(super) struct M {
        state: AtomicUsize,
        waiters: Mutex<VecDeque<Arc<Node>>>,
        value: UnsafeCell<usize>,
    }

    /// How a locker that has to wait behaves once it is linked.
    #[derive(Clone, Copy)]
    pub(super) enum Waits {
        /// Until handed the lock.
        ForTheLock,
        /// Gives up at once (an interrupt): unlinks itself unless it was
        /// handed the lock already, which it then holds.
        GivesUp,
        /// Handed the lock, does not take it (a refused wake, or a fiber
        /// dropped before it ran again): `give_back` hands it on.
        RefusesTheHandOver,
    }

    impl M {
        pub(super) fn new() -> M {
            M { state: AtomicUsize::new(0), waiters: Mutex::new(VecDeque::new()), value: UnsafeCell::new(0) }
        }

        fn take_or_mark(&self) -> bool {
            let mut s = self.state.load(Ordering::Relaxed);
            loop {
                let new = if s & LOCKED == 0 {
                    s | LOCKED
                } else if s & WAITERS == 0 {
                    s | WAITERS
                } else {
                    return false;
                };
                match self.state.compare_exchange_weak(s, new, Ordering::Acquire, Ordering::Relaxed) {
                    Ok(_) => return s & LOCKED == 0,
                    Err(now) => s = now,
                }
            }
        }

        fn hand_on(&self, w: &mut VecDeque<Arc<Node>>) -> Option<Arc<Node>> {
            match w.pop_front() {
                Some(node) => {
                    // In the code's order: the wait list's `pop_front`
                    // sets `done` (wait.rs), then `hand_on` stores the
                    // state (mutex.rs).
                    node.done.store(true, Ordering::Release);
                    if w.is_empty() {
                        self.state.store(LOCKED, Ordering::Relaxed);
                    }
                    Some(node)
                }
                None => {
                    self.state.store(0, Ordering::Release);
                    None
                }
            }
        }

        /// `try_lock`: one CAS from 0, nothing else (a failed one leaves
        /// the word alone).
        pub(super) fn try_lock(&self) -> bool {
            self.state.compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_ok()
        }

        /// Returns whether the caller holds the lock.
        pub(super) fn lock(&self, waits: Waits) -> bool {
            if self.state.compare_exchange(0, LOCKED, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return true;
            }
            let mut w = self.waiters.lock().unwrap();
            if self.take_or_mark() {
                return true;
            }
            let node = Arc::new(Node { done: AtomicBool::new(false), thread: thread::current() });
            w.push_back(node.clone());
            drop(w);
            if let Waits::GivesUp = waits {
                let mut w = self.waiters.lock().unwrap();
                if !node.done.load(Ordering::Acquire) {
                    let i = w.iter().position(|n| Arc::ptr_eq(n, &node)).expect("still linked");
                    w.remove(i);
                    return false;
                }
                return true;
            }
            while !node.done.load(Ordering::Acquire) {
                thread::park();
            }
            if let Waits::RefusesTheHandOver = waits {
                let mut w = self.waiters.lock().unwrap();
                let wake = self.hand_on(&mut w);
                drop(w);
                if let Some(n) = wake {
                    n.thread.unpark();
                }
                return false;
            }
            true
        }

        pub(super) fn unlock(&self) {
            if self.state.compare_exchange(LOCKED, 0, Ordering::Release, Ordering::Relaxed).is_ok() {
                return;
            }
            let mut w = self.waiters.lock().unwrap();
            let wake = self.hand_on(&mut w);
            drop(w);
            if let Some(n) = wake {
                n.thread.unpark();
            }
        }

        /// The holder's work: an unsynchronised increment.
        pub(super) fn bump(&self) {
            // SAFETY: loom reports two holders' overlapping accesses.
            self.value.with_mut(|v| unsafe { *v += 1 });
        }

        pub(super) fn check_end(&self, bumps: usize) {
            // SAFETY: every other thread has been joined.
            assert_eq!(self.value.with(|v| unsafe { *v }), bumps, "every holder's increment counted");
            assert_eq!(self.state.load(Ordering::Relaxed), 0, "unlocked, no waiter mark left");
            assert!(self.waiters.lock().unwrap().is_empty(), "nobody left linked");
        }
    }
}

/// The main thread holds the lock while a plain locker and a second
/// locker of the given kind come, then unlocks; every holder bumps once.
fn mutex_model(second: mutex_model::Waits) {
    use mutex_model::{Waits, M};
    let bound = std::env::var("LOOM_MAX_PREEMPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(bound);
    builder.check(move || {
        let m = Arc::new(M::new());
        assert!(m.lock(Waits::ForTheLock));
        let lockers: Vec<_> = [Waits::ForTheLock, second]
            .into_iter()
            .map(|waits| {
                let m = m.clone();
                thread::spawn(move || {
                    let held = m.lock(waits);
                    if held {
                        m.bump();
                        m.unlock();
                    }
                    held
                })
            })
            .collect();
        m.bump();
        m.unlock();
        let held = lockers.into_iter().map(|t| usize::from(t.join().unwrap())).sum::<usize>();
        m.check_end(1 + held);
    });
}

/// A holder, a waiter behind it, and a thread trying the lock once: a
/// failed try changes nothing (no second holder, no hand-over while held).
#[test]
fn mutex_a_try_lock_racing_a_waiter_takes_the_lock_only_when_free() {
    use mutex_model::{Waits, M};
    let bound = std::env::var("LOOM_MAX_PREEMPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(bound);
    builder.check(|| {
        let m = Arc::new(M::new());
        assert!(m.lock(Waits::ForTheLock));
        let waiter = {
            let m = m.clone();
            thread::spawn(move || {
                assert!(m.lock(Waits::ForTheLock));
                m.bump();
                m.unlock();
            })
        };
        let trier = {
            let m = m.clone();
            thread::spawn(move || {
                let held = m.try_lock();
                if held {
                    m.bump();
                    m.unlock();
                }
                usize::from(held)
            })
        };
        m.bump();
        m.unlock();
        waiter.join().unwrap();
        let tried = trier.join().unwrap();
        m.check_end(2 + tried);
    });
}

#[test]
fn mutex_two_lockers_behind_a_holder_each_get_the_lock_once() {
    mutex_model(mutex_model::Waits::ForTheLock);
}

#[test]
fn mutex_a_waiter_that_gives_up_leaves_the_lock_to_the_others() {
    mutex_model(mutex_model::Waits::GivesUp);
}

#[test]
fn mutex_a_refused_hand_over_goes_on_to_the_next_waiter() {
    mutex_model(mutex_model::Waits::RefusesTheHandOver);
}

/// Loom model of `RawChannel::close` against a push whose hand-over is
/// refused (sync/src/channel.rs: `push`, `close`, `Synced::take_now`,
/// `wake_receivers_closed`, `Synced::give_back`), mirrored with a loom
/// mutex over the channel's state, and parked threads as receivers. A push
/// hands its message to the first waiter, an orphan whose scheduler
/// refuses the wake (the refusal gives the message back: to the next
/// waiter, or the queue); a live receiver reads until `None`, linked behind
/// the orphan or coming later; a closer closes. Checked: no receiver waits
/// for ever, and an accepted message is received once or left queued in
/// the closed channel (the late give-back DESIGN.md, "Close", documents),
/// never lost.
mod close_model {
    use std::collections::VecDeque;

    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::sync::{Arc, Mutex, MutexGuard};
    use loom::thread;

    const MESSAGE: usize = 7;
    /// A node's value: not handed yet.
    const WAITING: usize = 0;
    /// A node's value: woken with nothing (closed).
    const NOTHING: usize = 1;

    struct Node {
        value: AtomicUsize,
        thread: thread::Thread,
    }

    struct Synced {
        queue: VecDeque<usize>,
        waiters: VecDeque<Arc<Node>>,
        closed: bool,
    }

    pub(super) struct Chan {
        synced: Mutex<Synced>,
    }

    fn wake_receivers_closed<'a>(mut s: MutexGuard<'a, Synced>, chan: &'a Chan) {
        while let Some(node) = s.waiters.pop_front() {
            node.value.store(NOTHING, Ordering::Release);
            drop(s);
            node.thread.unpark();
            s = chan.synced.lock().unwrap();
        }
    }

    impl Chan {
        pub(super) fn new() -> Chan {
            Chan {
                synced: Mutex::new(Synced {
                    queue: VecDeque::new(),
                    waiters: VecDeque::new(),
                    closed: false,
                }),
            }
        }

        /// Returns whether the push was accepted (refused once closed).
        pub(super) fn push_to_a_refused_receiver(&self) -> bool {
            {
                let mut s = self.synced.lock().unwrap();
                if s.closed {
                    return false;
                }
                // Handed to the orphan, whose wake will be refused.
                drop(s.waiters.pop_front().expect("the orphan waits first"));
            }
            // The refusal's `give_back`.
            let mut s = self.synced.lock().unwrap();
            match s.waiters.pop_front() {
                Some(node) => {
                    node.value.store(MESSAGE, Ordering::Release);
                    drop(s);
                    node.thread.unpark();
                }
                None => s.queue.push_back(MESSAGE),
            }
            true
        }

        pub(super) fn close(&self) {
            let mut s = self.synced.lock().unwrap();
            s.closed = true;
            wake_receivers_closed(s, self);
        }

        /// `pop`: a message, or `None` once closed (`take_now`); else link
        /// and park.
        pub(super) fn pop(&self) -> Option<usize> {
            let node = {
                let mut s = self.synced.lock().unwrap();
                if let Some(m) = s.queue.pop_front() {
                    return Some(m);
                }
                if s.closed {
                    return None;
                }
                let node = Arc::new(Node { value: AtomicUsize::new(WAITING), thread: thread::current() });
                s.waiters.push_back(node.clone());
                node
            };
            loop {
                match node.value.load(Ordering::Acquire) {
                    WAITING => thread::park(),
                    NOTHING => return None,
                    m => return Some(m),
                }
            }
        }

        /// Links the orphan: a waiter no thread will run.
        pub(super) fn link_orphan(&self) {
            let node = Arc::new(Node { value: AtomicUsize::new(WAITING), thread: thread::current() });
            self.synced.lock().unwrap().waiters.push_back(node);
        }

        pub(super) fn left_queued(&self) -> usize {
            self.synced.lock().unwrap().queue.len()
        }
    }

    pub(super) fn model() {
        let bound = std::env::var("LOOM_MAX_PREEMPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(bound);
        builder.check(|| {
            let chan = Arc::new(Chan::new());
            chan.link_orphan();
            let receiver = {
                let chan = chan.clone();
                thread::spawn(move || {
                    let mut got = Vec::new();
                    while let Some(m) = chan.pop() {
                        got.push(m);
                    }
                    got
                })
            };
            let pusher = {
                let chan = chan.clone();
                thread::spawn(move || chan.push_to_a_refused_receiver())
            };
            chan.close();
            let accepted = pusher.join().unwrap();
            let got = receiver.join().unwrap();
            assert!(got.iter().all(|&m| m == MESSAGE));
            assert_eq!(
                got.len() + chan.left_queued(),
                usize::from(accepted),
                "an accepted message is received once or left queued, never lost"
            );
        });
    }
}

#[test]
fn a_close_racing_a_refused_hand_over_loses_no_message_and_wakes_every_receiver() {
    close_model::model();
}

/// A thread's timed wait against a waker (DESIGN.md, "Timed waits of
/// threads"), mirrored on a semaphore: the taker links its node under the
/// lock, parks once (loom's yield), and then its deadline passes: under
/// the lock it takes what a releaser handed over (`done`) or unlinks its
/// node (T2). The releaser hands its token to a linked node (unlinking it,
/// then `done`) or counts it. Every execution must end with the token
/// taken once or counted once, and no node linked. The `should_panic`
/// variant decides on the timeout from a look at `done` made before it
/// locks, and unlinks whatever it finds: loom must find the execution
/// where the token is handed over in between and lost.
mod timed_model {
    use loom::sync::atomic::{AtomicBool, Ordering};
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    struct State {
        tokens: usize,
        linked: bool,
    }

    struct World {
        state: Mutex<State>,
        /// The node's `done`: set by the releaser after unlinking it.
        done: AtomicBool,
    }

    pub(super) fn check(look_under_the_lock: bool) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let w = Arc::new(World {
                state: Mutex::new(State { tokens: 0, linked: false }),
                done: AtomicBool::new(false),
            });

            let releaser = {
                let w = w.clone();
                thread::spawn(move || {
                    let mut s = w.state.lock().unwrap();
                    if s.linked {
                        // Waker step 1: unlink, hand over, then `done`.
                        s.linked = false;
                        w.done.store(true, Ordering::Release);
                    } else {
                        s.tokens += 1;
                    }
                })
            };

            // The taker: sleeper steps 1-3.
            let mut got = {
                let mut s = w.state.lock().unwrap();
                if s.tokens > 0 {
                    s.tokens -= 1;
                    true
                } else {
                    s.linked = true;
                    false
                }
            };
            if !got {
                // T1: one park; the deadline passes after it.
                got = w.done.load(Ordering::Acquire);
                if !got {
                    thread::yield_now();
                    let early_look = w.done.load(Ordering::Acquire);
                    // T2.
                    let mut s = w.state.lock().unwrap();
                    let handed =
                        if look_under_the_lock { w.done.load(Ordering::Acquire) } else { early_look };
                    if handed {
                        got = true;
                    } else {
                        s.linked = false;
                    }
                }
            }

            releaser.join().unwrap();
            let s = w.state.lock().unwrap();
            assert!(!s.linked, "a node was left on the list");
            assert_eq!(usize::from(got) + s.tokens, 1, "the token was lost or taken twice");
        });
    }
}

#[test]
fn a_timed_out_thread_takes_a_token_handed_to_it_or_leaves_it_counted() {
    timed_model::check(true);
}

#[test]
#[should_panic(expected = "the token was lost or taken twice")]
fn a_timeout_decided_before_the_lock_loses_a_handed_token() {
    timed_model::check(false);
}

/// A wait group (sync/src/wait_group.rs, DESIGN.md "Wait group"): two
/// members each write their own cell and drop their handle; the test
/// thread drops its own and waits. The semaphore is a loom mutex and
/// condition variable; the group's count is the real atomic protocol. Every
/// execution must end with the waiter through and seeing both writes, and
/// the semaphore holding `OPEN` less the one token taken. With the drop's
/// `fetch_sub` only `Release` (no `Acquire` for the last member), the last
/// member's release no longer carries the other member's write, and loom
/// reports the read of that cell as a race.
mod wait_group_model {
    use super::*;
    use loom::sync::Condvar;

    const OPEN: usize = usize::MAX / 2;

    struct Group {
        count: AtomicUsize,
        tokens: Mutex<usize>,
        cv: Condvar,
        cells: [UnsafeCell<usize>; 2],
        drop_order: Ordering,
    }

    impl Group {
        /// Member steps 1-2.
        fn leave(&self) {
            if self.count.fetch_sub(1, self.drop_order) == 1 {
                *self.tokens.lock().unwrap() += OPEN;
                self.cv.notify_all();
            }
        }

        /// Waiter step 2: the semaphore's acquire.
        fn acquire(&self) {
            let mut tokens = self.tokens.lock().unwrap();
            while *tokens == 0 {
                tokens = self.cv.wait(tokens).unwrap();
            }
            *tokens -= 1;
        }
    }

    pub(super) fn check(drop_order: Ordering) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let g = Arc::new(Group {
                count: AtomicUsize::new(3),
                tokens: Mutex::new(0),
                cv: Condvar::new(),
                cells: [UnsafeCell::new(0), UnsafeCell::new(0)],
                drop_order,
            });
            let members: Vec<_> = (0..2)
                .map(|i| {
                    let g = g.clone();
                    thread::spawn(move || {
                        // SAFETY: only this member writes cell `i` before
                        // its drop; loom reports any access that races it.
                        g.cells[i].with_mut(|c| unsafe { *c = i + 1 });
                        g.leave();
                    })
                })
                .collect();
            // Waiter step 1 (its own handle), then step 2.
            g.leave();
            g.acquire();
            for (i, cell) in g.cells.iter().enumerate() {
                // SAFETY: as above; loom checks the order.
                let v = cell.with(|c| unsafe { *c });
                assert_eq!(v, i + 1, "the waiter missed a member's write");
            }
            for m in members {
                m.join().unwrap();
            }
            assert_eq!(*g.tokens.lock().unwrap(), OPEN - 1);
        });
    }
}

#[test]
fn a_wait_group_waiter_sees_every_members_work() {
    wait_group_model::check(Ordering::AcqRel);
}

#[test]
#[should_panic(expected = "Causality violation")]
fn a_wait_group_whose_last_drop_does_not_acquire_races_the_waiter() {
    wait_group_model::check(Ordering::Release);
}
