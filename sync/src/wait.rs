//! Intrusive wait lists whose nodes live on the waiter's own stack.
//!
//! A fiber waits on one primitive at a time, and while it waits its stack is
//! suspended and intact: the node linking it into the wait list lives in the
//! frame of the waiting call, so waiting allocates nothing. Ordinary threads
//! wait the same way, parking on `std::thread::park`.
//!
//! # Sleep/wake protocol
//!
//! The list is guarded by the primitive's mutex. Sleeper (fiber or thread):
//!
//! 1. lock; check the condition (a token, a message); if met, take it, done;
//! 2. put a [`WaitNode`] on its own stack, holding a [`Waiter`] for the
//!    fiber (or the thread handle); a fiber sets its wait hook (waker step
//!    4) before linking it and clears it on every way out; link the node at
//!    the tail of the list;
//! 3. unlock;
//! 4. a fiber calls [`spindle_fiber::sleep_on`]; its runner then moves it
//!    `Running` → `Sleeping`, or, if a waker already came, finishes the
//!    wake itself; a thread parks until the node's `done` flag is set;
//! 5. once resumed, check `done`: `DONE`, read the value the waker left in
//!    the node; still `LINKED` (a spurious wake), check again under the lock
//!    and sleep again; `REVOKED` (after a refusal, the wait hook took the
//!    value back, waker step 4), under the lock take what is there now
//!    (even with an interrupt pending) or link the node again at the tail
//!    and sleep again.
//!
//! Waker:
//!
//! 1. lock; unlink the head node; take its `Waiter`/thread handle out of it;
//!    write the handed-over value into it; set `done` (Release): for a
//!    thread sleeper this is the waker's last touch of the node, which may
//!    vanish right after (a fiber's node stays until the fiber runs);
//! 2. unlock;
//! 3. wake: for a fiber, [`Waiter::try_wake`] moves `Sleeping` → `Locked`
//!    and hands it to its home, which queues it (`Ready` if it has none),
//!    or `Running` → `RunningWoken` when the sleeper is between its steps 3
//!    and 4 (its runner then queues it); for a thread, unpark;
//! 4. if the fiber's home refused it for good (shut down), now or at an
//!    earlier wake (then `try_wake` finds it `Ready` and holds it), the
//!    refusal holds the fiber (`Locked`, not run since); letting go of it
//!    runs the hook of the wait it is in ([`WaitHook`], set by step 2 in
//!    the sleeper's frame): lock, if the node was handed a value mark it
//!    `REVOKED`, take the value back and give it on ([`GiveBack`]), make
//!    the fiber `Ready`, unlock, and wake whoever got the value the same
//!    way (the refusal's drop: `try_wake`, then `take_back` of each
//!    further refusal, in a loop). Whoever else lets go of a refused fiber (a
//!    runner that finishes a deferred wake, another wake's refusal,
//!    `Fiber::abandon`, a handle's failing call on a fiber marked refused)
//!    runs the same hook, so a value handed over while someone else held
//!    the fiber is taken back too.
//!
//! The value and the unlinking happen under the lock, so each sleeper gets
//! exactly one value and a node is never on a list twice; the state machine
//! in `spindle-fiber` makes the race of sleeper step 4 with waker step 3 safe; `done` guards
//! threads against spurious unparks and fibers against spurious wakes (a
//! `Waiter` of the fiber that it kept from before, woken while it sleeps
//! here): a fiber resumed before `done` checks again under the lock and
//! sleeps again. The real wake may then find it queued or running and be
//! void; its `done` is what the fiber sees.

use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomPinned;
use std::pin::pin;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU8, Ordering};
use std::thread::Thread;
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};
use spindle_fiber::{Priority, WaitHook, WaitReason, WaitToken, Waiter};

/// Who sleeps on a node.
enum Sleeper {
    Fiber(Waiter),
    Thread(Thread),
}

/// [`WaitNode::done`]: on the list, waiting.
const LINKED: u8 = 0;
/// [`WaitNode::done`]: unlinked and handed its value.
const DONE: u8 = 1;
/// [`WaitNode::done`]: unlinked, its value taken back (a refused wake).
const REVOKED: u8 = 2;

/// A waiting fiber or thread, linked into a [`WaitList`].
pub(crate) struct WaitNode {
    /// List links; read and written under the owning primitive's lock.
    next: Cell<*const WaitNode>,
    prev: Cell<*const WaitNode>,
    /// Taken by the waker under the lock.
    sleeper: UnsafeCell<Option<Sleeper>>,
    /// Written by the waker under the lock, read by the sleeper after `done`.
    /// A pointer, not an address: a channel hands over a message and its
    /// provenance (a semaphore hands null).
    value: Cell<*mut ()>,
    /// [`LINKED`] while on the list; [`DONE`] once a waker unlinked it and
    /// handed it `value` (stored with Release; a thread sleeper's node is
    /// not touched again); [`REVOKED`] if, after a refusal, the fiber's wait
    /// hook took the value back (`take_back_hook`, run under the lock by
    /// whoever let go of the held fiber); [`LINKED`] again when the fiber
    /// relinks.
    done: AtomicU8,
    /// Priority to wake a fiber at, if the sleeper asked for one.
    wake_priority: Option<Priority>,
    _pinned: PhantomPinned,
}

impl WaitNode {
    fn for_current(wake_priority: Option<Priority>) -> WaitNode {
        // A fiber sleeps; so does a thread, and so does a fiber that cannot
        // sleep: one whose stack is being unwound because it was dropped (a
        // plain wait in a destructor, or after a `catch_unwind` of the
        // forced unwind; interruptible waits returned before this). A sleep
        // there would panic in a destructor (aborting) or restart the
        // unwind, so it blocks the dropping thread instead.
        let fiber = if spindle_fiber::may_sleep() { Waiter::current() } else { None };
        let sleeper = match fiber {
            Some(w) => Sleeper::Fiber(w),
            None => Sleeper::Thread(std::thread::current()),
        };
        WaitNode {
            next: Cell::new(ptr::null()),
            prev: Cell::new(ptr::null()),
            sleeper: UnsafeCell::new(Some(sleeper)),
            value: Cell::new(ptr::null_mut()),
            done: AtomicU8::new(LINKED),
            wake_priority,
            _pinned: PhantomPinned,
        }
    }
}

/// A FIFO of waiting nodes. Lives inside a primitive's lock-guarded state;
/// every method requires that lock.
pub(crate) struct WaitList {
    head: *const WaitNode,
    tail: *const WaitNode,
    len: usize,
}

// SAFETY: the list only holds pointers to nodes that stay valid while
// linked (their owners are blocked until unlinked); it is only touched
// under the owning primitive's mutex.
unsafe impl Send for WaitList {}

impl WaitList {
    pub(crate) const fn new() -> WaitList {
        WaitList { head: ptr::null(), tail: ptr::null(), len: 0 }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.head.is_null()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// # Safety
    /// `node` stays valid and unmoved until it is unlinked.
    unsafe fn push_back(&mut self, node: &WaitNode) {
        node.prev.set(self.tail);
        node.next.set(ptr::null());
        if self.tail.is_null() {
            self.head = node;
        } else {
            // SAFETY: the tail is a linked, valid node.
            unsafe { (*self.tail).next.set(node) };
        }
        self.tail = node;
        self.len += 1;
    }

    /// Unlinks `node`, which is on this list (an interrupted sleeper
    /// leaving, under the lock).
    ///
    /// # Safety
    /// `node` is linked on this list.
    unsafe fn remove(&mut self, node: &WaitNode) {
        let (prev, next) = (node.prev.get(), node.next.get());
        if prev.is_null() {
            self.head = next;
        } else {
            // SAFETY: linked nodes are valid.
            unsafe { (*prev).next.set(next) };
        }
        if next.is_null() {
            self.tail = prev;
        } else {
            // SAFETY: as above.
            unsafe { (*next).prev.set(prev) };
        }
        self.len -= 1;
    }

    /// Waker step 1: unlinks the head, hands it `value` and returns the
    /// wakeup to perform once the lock is released.
    #[must_use]
    pub(crate) fn pop_front(&mut self, value: *mut ()) -> Option<Wakeup> {
        if self.head.is_null() {
            return None;
        }
        // SAFETY: linked nodes are valid (push_back's contract).
        let node = unsafe { &*self.head };
        self.head = node.next.get();
        if self.head.is_null() {
            self.tail = ptr::null();
        } else {
            // SAFETY: as above.
            unsafe { (*self.head).prev.set(ptr::null()) };
        }
        self.len -= 1;
        // SAFETY: the sleeper does not touch `sleeper` while linked; we hold
        // the lock that linked it.
        let sleeper = unsafe { (*node.sleeper.get()).take() }.expect("a linked node has a sleeper");
        if let (Sleeper::Fiber(w), Some(p)) = (&sleeper, node.wake_priority) {
            w.set_priority(p);
        }
        node.value.set(value);
        // Last touch: after this store a thread sleeper may return and free
        // the node (a fiber sleeper, only once it runs: see `Wakeup`).
        // Release pairs with its Acquire load.
        node.done.store(DONE, Ordering::Release);
        Some(Wakeup { sleeper })
    }
}

/// A wakeup to deliver after the primitive's lock is released (waker step 3).
#[must_use = "a popped waiter sleeps forever unless woken"]
pub(crate) struct Wakeup {
    sleeper: Sleeper,
}

impl Wakeup {
    /// Waker step 3: wakes the sleeper. If a fiber's scheduler refuses it
    /// for good (it has shut down: nothing will run the fiber from there),
    /// step 4: letting go of the refusal runs the fiber's wait hook
    /// (`take_back_hook`), which takes the value back and hands it to the
    /// next waiter, who is woken the same way, and so on.
    #[inline]
    pub(crate) fn deliver(self) {
        match self.sleeper {
            Sleeper::Thread(t) => t.unpark(),
            // A refusal, dropped, lets go of the fiber through its wait
            // hook and wakes whoever the value goes on to, in a loop
            // (`RefusedWake`'s drop: no recursion for a row of refused
            // fibers).
            Sleeper::Fiber(w) => drop(w.try_wake()),
        }
    }
}

/// A fiber's wait hook (sleeper step 2, waker step 4): in the waiting
/// frame, beside the node, with what taking the value back needs.
#[repr(C)]
struct Hooked<S> {
    /// First: the fiber hands `take_back_hook` a pointer to it.
    hook: WaitHook,
    node: *const WaitNode,
    mutex: *const Mutex<S>,
    give_back: GiveBack<S>,
}

/// Waker step 4, run by whoever lets go of a fiber whose scheduler refused
/// it (see [`WaitHook`]): under the primitive's lock, takes back the value
/// if one was handed to this wait's node (marked [`REVOKED`]) and gives it
/// on, and lets the fiber go (`Ready`) before unlocking, so that a waker
/// that hands it a value later finds it `Ready` and marked refused (its
/// `try_wake` is refused in turn). Unparks a thread the value went to;
/// returns a fiber's waiter.
///
/// # Safety
/// `hook` is the `hook` of a `Hooked<S>` in the frame of a fiber suspended
/// in `wait` (the caller holds the fiber, so it stays suspended).
unsafe fn take_back_hook<S>(hook: NonNull<WaitHook>, let_go: &mut dyn FnMut()) -> Option<Waiter> {
    // SAFETY: the caller's contract; `hook` is the first field, and the
    // pointer was made from the whole struct (see `wait`).
    let me = unsafe { hook.cast::<Hooked<S>>().as_ref() };
    // SAFETY: the node and the primitive outlive the wait, which the
    // fiber cannot leave while it is held.
    let (node, mutex) = unsafe { (&*me.node, &*me.mutex) };
    let mut locked = mutex.lock();
    let next = if node.done.load(Ordering::Relaxed) == DONE {
        node.done.store(REVOKED, Ordering::Relaxed);
        (me.give_back)(&mut locked, node.value.replace(ptr::null_mut()))
    } else {
        // Still linked (no value yet: a later one finds the fiber refused),
        // or revoked already.
        None
    };
    let_go();
    drop(locked);
    match next?.sleeper {
        Sleeper::Thread(t) => {
            t.unpark();
            None
        }
        Sleeper::Fiber(w) => Some(w),
    }
}

/// Returns a value handed to a sleeper that will not take it (it unwound,
/// or its wake was refused) to the primitive's locked state: to the next
/// waiter (the wakeup to deliver once the lock is released), or kept.
pub(crate) type GiveBack<S> = fn(&mut S, *mut ()) -> Option<Wakeup>;

/// Links a revoked node again, at the tail, with a new waiter for the
/// current fiber (sleeper step 5, out of the common path).
///
/// # Safety
/// `node` is unlinked and stays pinned until it is unlinked again; the
/// caller holds the lock of `list`'s primitive.
#[cold]
#[inline(never)]
unsafe fn relink(node: &WaitNode, list: &mut WaitList) {
    let me = Waiter::current().expect("a fiber that slept has a waiter");
    // SAFETY: unlinked, so only we can see the node.
    unsafe { *node.sleeper.get() = Some(Sleeper::Fiber(me)) };
    node.done.store(LINKED, Ordering::Relaxed);
    // SAFETY: the caller's contract.
    unsafe { list.push_back(node) };
}

/// Guards a waiting frame against unwinding while its node is linked, and
/// against losing what a waker handed over.
///
/// A fiber being dropped is unwound by force. Asleep, it cannot be dropped
/// (its linked node holds a `Waiter`); but once a waker has unlinked the
/// node, handed it a value and woken the fiber, the fiber's last handle
/// may be dropped before it runs again: the unwind then starts from the
/// sleep, and the value (a token, a message) would go with the frame. The
/// guard gives it back to the primitive (`give_back`, under its lock), which
/// hands it to the next waiter or keeps it.
///
/// A dropped fiber's destructors (or code that catches the forced unwind)
/// that make a plain wait on a primitive block the dropping thread instead
/// of sleeping (`WaitNode::for_current`; interruptible ones return
/// `Interrupted` before linking a node: `dropped_fiber`), so no unwind
/// starts from a linked node's sleep. Should one ever (a bug), unwinding past `wait` would free a node
/// that is still on the list, so the process aborts instead, as Rust does
/// for a panic during a panic.
struct Linked<'a, S> {
    node: &'a WaitNode,
    mutex: &'a Mutex<S>,
    give_back: GiveBack<S>,
    /// A fiber sleeper's: its wait hook is cleared before the frame goes.
    token: Option<WaitToken>,
}

impl<S> Drop for Linked<'_, S> {
    fn drop(&mut self) {
        if let Some(t) = self.token {
            // SAFETY: on the fiber's own stack (its frame is unwinding).
            unsafe { t.leave_wait() };
        }
        let done = self.node.done.load(Ordering::Acquire);
        if done == LINKED {
            warn!(
                "spindle-sync: a fiber was unwound while waiting on a primitive; its wait node is \
                 still linked, aborting (this is a bug in spindle: please report it)"
            );
            std::process::abort();
        }
        // A revoked node's value went to someone else already.
        if done == DONE {
            let wakeup = (self.give_back)(&mut self.mutex.lock(), self.node.value.get());
            if let Some(w) = wakeup {
                w.deliver();
            }
        }
    }
}

/// Why an interruptible wait returned without what it waited for: the
/// fiber was interrupted ([`Waiter::interrupt`](spindle_fiber::Waiter::interrupt),
/// [`Fiber::interrupt`](spindle_fiber::Fiber::interrupt)) before a waker
/// came, or it is being dropped (its destructors run with no runner left,
/// so its waits end at once). Nothing was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the wait was interrupted (Waiter::interrupt or Fiber::interrupt, or the fiber is being \
             dropped) before it got what it waited for; nothing was taken: stop, or wait again (not in \
             a fiber being dropped: its waits end at once)",
        )
    }
}

impl std::error::Error for Interrupted {}

/// Why a timed wait returned without what it waited for: its timeout
/// passed first. Nothing was taken. Timed waits are for threads (see
/// [`Semaphore::acquire_timeout`](crate::Semaphore::acquire_timeout)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut;

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the timeout passed before the wait got what it waited for; nothing was taken: give up, or \
             wait again",
        )
    }
}

impl std::error::Error for TimedOut {}

/// The deadline of a timed wait `timeout` from now (`None`: too far to
/// represent, so no deadline). Panics, naming `what`, in a fiber that may
/// sleep: nothing in this crate could wake it at the deadline.
#[track_caller]
pub(crate) fn thread_deadline(timeout: std::time::Duration, what: &str) -> Option<Instant> {
    refuse_in_fiber(what);
    Instant::now().checked_add(timeout)
}

/// Panics, naming `what`, in a fiber that may sleep: a timed wait is for
/// threads (nothing in this crate could wake a fiber at its deadline).
#[track_caller]
pub(crate) fn refuse_in_fiber(what: &str) {
    refuse_in_fiber_instead(
        what,
        "the interruptible wait under your scheduler's deadline (spindle-executor: interrupt_after, \
         interrupt_at), or the try_ method in a loop of your own",
    );
}

/// [`refuse_in_fiber`], saying what a fiber uses `instead` (for a type
/// whose way round differs: a wait group has no `try_` method).
#[track_caller]
pub(crate) fn refuse_in_fiber_instead(what: &str, instead: &str) {
    if spindle_fiber::may_sleep() {
        panic!(
            "spindle_sync: {what} called in a fiber: a sleeping fiber can only be woken at a deadline \
             by its scheduler's clock, which this crate does not have, so timed waits are for threads. \
             In a fiber, use {instead}"
        );
    }
}

/// Whether the caller runs on a fiber whose stack is being unwound because
/// it was dropped (a destructor of that unwind, or code that caught it).
fn dropped_fiber() -> bool {
    spindle_fiber::in_fiber() && !spindle_fiber::may_sleep()
}

/// Sleeper steps 2 to 5: links a node for the current fiber or thread into
/// the list that `list` picks out of the locked state, unlocks, sleeps until
/// a waker hands it a value, and returns that value. If the sleeper unwinds
/// after the value was handed over (its fiber dropped before it ran again),
/// `give_back` returns the value to the locked state, and may hand it to
/// another waiter (woken once the lock is released); so does the fiber's
/// wait hook if its scheduler refuses it (`take_back_hook`). A fiber
/// whose value was taken back that way and that runs anyway starts over:
/// `take_now` (under the lock) takes what is there now, else it waits
/// again.
///
/// `INTERRUPTIBLE`: a fiber with an interrupt pending (taken before it
/// links its node, or when it wakes without a value) unlinks its node and
/// returns `Err(Interrupted)` instead; so does, at once, a fiber whose
/// stack is being unwound because it was dropped (a destructor that waits:
/// it has no runner left, so it is as good as cancelled, and its wait
/// could only block the dropping thread); a thread waits as before.
///
/// `deadline` (plain waits of threads only: the caller checks that it is
/// not a fiber that may sleep): once it passes with nothing handed over,
/// the thread takes its node off the list and returns `Err(Interrupted)`
/// (which the caller reports as a timeout).
#[track_caller]
#[inline]
pub(crate) fn wait<S, const INTERRUPTIBLE: bool>(
    mut guard: MutexGuard<'_, S>,
    list: impl Fn(&mut S) -> &mut WaitList,
    give_back: GiveBack<S>,
    take_now: impl Fn(&mut S) -> Option<*mut ()>,
    wake_priority: Option<Priority>,
    reason: &'static WaitReason,
    deadline: Option<Instant>,
) -> Result<*mut (), Interrupted> {
    debug_assert!(
        deadline.is_none() || !(INTERRUPTIBLE || spindle_fiber::may_sleep()),
        "a deadline is for a plain wait of a thread"
    );
    if INTERRUPTIBLE && (spindle_fiber::take_interrupt() || dropped_fiber()) {
        return Err(Interrupted);
    }
    let node = pin!(WaitNode::for_current(wake_priority));
    let mutex = MutexGuard::mutex(&guard);
    // A fiber's wait hook (waker step 4), set through a token (no
    // thread-local lookup) before the node is linked and cleared on every
    // way out (`leave_wait` below, and `Linked` when unwinding).
    let hooked = pin!(Hooked { hook: WaitHook::new(take_back_hook::<S>), node: &*node, mutex, give_back });
    let token = match
        // SAFETY: the node is not linked yet; only we can see it.
        unsafe { &*node.sleeper.get() }
    {
        Some(Sleeper::Fiber(w)) => Some(w.wait_token()),
        _ => None,
    };
    if let Some(t) = token {
        // SAFETY: on the stack of the fiber the token names (it made the
        // node's waiter); the hook stays in this frame until `leave_wait`,
        // which every way out of it calls (`Linked` when unwinding).
        // The pointer is made from the whole `Hooked` (its first field is
        // the hook): `take_back_hook` reads the other fields through it,
        // which a pointer made from a reference to the field alone may not
        // reach under Stacked Borrows.
        unsafe { t.enter_wait(NonNull::from(&*hooked).cast::<WaitHook>()) };
    }
    let is_fiber = token.is_some();
    let leave_wait = || {
        if let Some(t) = token {
            // SAFETY: as above.
            unsafe { t.leave_wait() }
        }
    };
    // SAFETY: the node is pinned in this frame, and this frame does not
    // return before the node is unlinked (we wait for `done` below), nor
    // unwind while it is linked (`Linked` aborts first).
    unsafe { list(&mut guard).push_back(&node) };
    let linked = Linked { node: &node, mutex, give_back, token };
    drop(guard);
    if is_fiber {
        // The node's own waiter is only woken after `done` is set. Any other
        // wake is spurious: a `Waiter` the fiber took earlier and kept (the
        // API is public), woken now. The node is still linked and still
        // holds its waiter, so the fiber sleeps again; the real wake then
        // finds it asleep or about to sleep (and its runner queues it), or
        // finds it queued or running after the spurious wake and is void:
        // `done` is then already set, which the fiber sees when it checks
        // under the lock. (Without the lock, that check and the waker's
        // look at the state could each miss the other's write.)
        loop {
            spindle_fiber::sleep_on(reason);
            if node.done.load(Ordering::Acquire) == DONE {
                // Before anything else: the hook points into this frame,
                // and from here the fiber may suspend elsewhere; whoever
                // lets go of it after a later refusal must not find this
                // wait's hook.
                leave_wait();
                break;
            }
            let mut locked = mutex.lock();
            let done = node.done.load(Ordering::Acquire);
            if done == DONE {
                leave_wait();
                break;
            }
            if done == REVOKED {
                // A waker handed us a value, then a wake of us was refused
                // (or we were abandoned), and whoever let go of us gave the
                // value to someone else through our wait hook.
                // Something ran us anyway: start over. What is there now
                // is ours, before an interrupt, as on the way in (an
                // interrupt stays pending then); else wait again, at the
                // tail, unless interrupted.
                if let Some(value) = take_now(&mut locked) {
                    drop(locked);
                    std::mem::forget(linked);
                    leave_wait();
                    return Ok(value);
                }
            }
            // Linked (or revoked: unlinked), and no waker can reach the
            // node while we hold the lock: an interrupt takes it off the
            // list (the node's waiter is dropped with the node).
            if INTERRUPTIBLE && spindle_fiber::take_interrupt() {
                if done == LINKED {
                    // SAFETY: the node is linked on this list.
                    unsafe { list(&mut locked).remove(&node) };
                }
                drop(locked);
                std::mem::forget(linked);
                leave_wait();
                return Err(Interrupted);
            }
            if done == REVOKED {
                // SAFETY: the node is this frame's, unlinked and pinned.
                unsafe { relink(&node, list(&mut locked)) };
            }
        }
    } else if let Some(deadline) = deadline {
        // A timed wait of a thread (timed sleeper steps T1 to T3 in
        // DESIGN.md, "Timed waits of threads").
        loop {
            // T1: handed what it waited for: done, as an untimed wait.
            if node.done.load(Ordering::Acquire) == DONE {
                break;
            }
            let now = Instant::now();
            if now < deadline {
                std::thread::park_timeout(deadline - now);
                continue;
            }
            // T2: the deadline passed. Under the lock, no waker can reach
            // the node: either one came first (`DONE`: the value is ours,
            // as if it came in time) or the node is still linked, and
            // leaving takes it off the list, so no waker ever hands it
            // anything.
            let mut locked = mutex.lock();
            if node.done.load(Ordering::Acquire) == DONE {
                break;
            }
            // SAFETY: linked (a thread's node is never revoked), on this
            // list, and we hold its primitive's lock.
            unsafe { list(&mut locked).remove(&node) };
            drop(locked);
            // T3: nothing was taken; the node (and the handle of this
            // thread in it) goes with the frame. A waker that took an
            // earlier look holds no reference to it: it only ever touches
            // nodes it unlinks under the lock.
            std::mem::forget(linked);
            return Err(Interrupted);
        }
    } else {
        while node.done.load(Ordering::Acquire) != DONE {
            std::thread::park();
        }
    }
    std::mem::forget(linked);
    Ok(node.value.get())
}
