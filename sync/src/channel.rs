//! Unbounded FIFO channels whose messages are caller-owned ("msghdr" style).
//!
//! A channel is two FIFOs, at least one of them empty: messages waiting for
//! a receiver, and receivers (fibers or threads) waiting for a message.
//! Neither allocates inside the channel: waiting receivers are linked through
//! a node on their own stack (see `wait.rs`), and messages through a
//! [`MsgHeader`] that the caller owns.
//!
//! * [`Channel<T>`] is the safe form: a message is a [`Msg<T>`], an owning
//!   handle to a caller-allocated header + value. The channel holds the
//!   handle while the message is queued and gives it back on pop, so a
//!   handle can be reused for the next message without allocating again.
//! * [`RawChannel`] is the `unsafe` form for callers that manage memory
//!   themselves, e.g. a header followed by its payload in one block
//!   ([`MsgHeader::init_trailing`]).

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use spindle_fiber::WaitReason;

use crate::wait::{refuse_in_fiber, thread_deadline, wait, Interrupted, TimedOut, WaitList, Wakeup};

static WAIT_REASON: WaitReason = WaitReason("a channel");

/// The `next` of a header that is not queued on any channel (null ends a
/// queue). Never the address of a header: no allocation lives at the
/// alignment itself.
const NOT_QUEUED: *mut MsgHeader = NonNull::<MsgHeader>::dangling().as_ptr();

/// The `next` of a header handed straight to a waiting receiver, until that
/// receiver's `pop` returns it (so that a push of it meanwhile is refused
/// too). Never dereferenced; not a header's address either.
const HANDED: *mut MsgHeader = NOT_QUEUED.wrapping_byte_add(1);

/// The header of a channel message: a link for the channel's queue and the
/// location of the payload (like a `struct iovec`).
#[repr(C)]
pub struct MsgHeader {
    /// Next queued message ([`NOT_QUEUED`] while the header is not queued,
    /// [`HANDED`] while a receiver's `pop` is returning it);
    /// written only by the channel, under its lock. Atomic (Relaxed) only
    /// so that `push`'s check of a header wrongly queued on another channel
    /// is not itself a data race.
    next: AtomicPtr<MsgHeader>,
    /// The channel's push count when this header was pushed: its place in
    /// the FIFO when a dropped receiver gives it back. Written by the
    /// channel under its lock.
    seq: AtomicU64,
    /// Payload address.
    pub buf: *mut u8,
    /// Payload length in bytes.
    pub len: usize,
}

// SAFETY: the link is atomic and only written under a channel's lock;
// buf/len are plain data whose meaning is the owner's.
unsafe impl Send for MsgHeader {}

impl MsgHeader {
    /// A header describing the payload at `buf` of `len` bytes.
    pub const fn new(buf: *mut u8, len: usize) -> MsgHeader {
        MsgHeader { next: AtomicPtr::new(NOT_QUEUED), seq: AtomicU64::new(0), buf, len }
    }

    /// Initialises the header at `this` for a payload of `len` bytes that
    /// directly follows it in memory, as in
    ///
    /// ```
    /// use spindle_sync::MsgHeader;
    ///
    /// #[repr(C)]
    /// struct MyMessage {
    ///     hdr: MsgHeader,
    ///     payload: [u8; 256],
    /// }
    ///
    /// let mut msg = MyMessage { hdr: MsgHeader::new(std::ptr::null_mut(), 0), payload: [0; 256] };
    /// // A pointer to the whole message, so that the header's pointer may
    /// // reach the payload too (`&mut msg.hdr` covers the header only).
    /// let whole: *mut MyMessage = &mut msg;
    /// // SAFETY: `payload` directly follows `hdr` in the repr(C) struct, and
    /// // the header pointer is derived from `whole`.
    /// unsafe { MsgHeader::init_trailing(std::ptr::addr_of_mut!((*whole).hdr), 256) };
    /// assert_eq!(msg.hdr.buf, msg.payload.as_mut_ptr());
    /// ```
    ///
    /// # Safety
    /// `this` is properly aligned and valid for writes of a header, and valid (same allocation,
    /// and a pointer whose provenance covers them: derive it from a pointer
    /// to the whole block, not from a reference to the header field) for
    /// the `len` bytes directly after the header, which the header's `buf`
    /// then points to. The header is not on a channel (its link is
    /// overwritten).
    pub unsafe fn init_trailing(this: *mut MsgHeader, len: usize) {
        // SAFETY: the caller guarantees `this` is writable; the payload
        // address is one header past it, inside the same allocation.
        unsafe { this.write(MsgHeader::new(this.add(1) as *mut u8, len)) }
    }
}

impl fmt::Debug for MsgHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MsgHeader").field("buf", &self.buf).field("len", &self.len).finish()
    }
}

/// Lock-guarded state: at least one of the two FIFOs is empty.
struct Synced {
    head: *mut MsgHeader,
    tail: *mut MsgHeader,
    messages: usize,
    /// Pushes so far: each header's `seq`.
    pushes: u64,
    receivers: WaitList,
    /// Set once by `close`: pushes are refused, and a receiver that finds
    /// no message gets none instead of waiting.
    closed: bool,
}

// SAFETY: the message pointers are only dereferenced under the lock; the
// messages are Send (RawChannel::push's contract, Msg<T>: T: Send).
unsafe impl Send for Synced {}

impl Synced {
    /// A message handed to a receiver that will not take it (a fiber
    /// unwound before it ran again, or one whose scheduler refused it: its
    /// wait hook): to the next receiver, or back into the queue
    /// where its push put it. It is older than every message queued the
    /// usual way (messages are handed over only while none is queued), so
    /// it goes in front of those, behind any given back earlier that were
    /// pushed before it (`seq`): a short walk over given-back messages
    /// only.
    fn give_back(&mut self, handed: *mut ()) -> Option<Wakeup> {
        let msg = handed.cast::<MsgHeader>();
        if msg.is_null() {
            // Woken by `close` with no message: nothing to hand on (every
            // receiver is woken the same way).
            return None;
        }
        if let Some(wakeup) = self.receivers.pop_front(handed) {
            return Some(wakeup);
        }
        // SAFETY: the header was pushed under push's contract and never
        // reached its receiver, so it is still the channel's; queued
        // headers are valid until popped.
        unsafe {
            let seq = (*msg).seq.load(Ordering::Relaxed);
            let (mut prev, mut cur) = (ptr::null_mut::<MsgHeader>(), self.head);
            while !cur.is_null() && (*cur).seq.load(Ordering::Relaxed) < seq {
                prev = cur;
                cur = (*cur).next.load(Ordering::Relaxed);
            }
            (*msg).next.store(cur, Ordering::Relaxed);
            match prev.is_null() {
                true => self.head = msg,
                false => (*prev).next.store(msg, Ordering::Relaxed),
            }
            if cur.is_null() {
                self.tail = msg;
            }
        }
        self.messages += 1;
        None
    }

    fn pop_message(&mut self) -> Option<NonNull<MsgHeader>> {
        let head = NonNull::new(self.head)?;
        // SAFETY: queued headers are valid until popped (push's contract).
        // Load and store, not a swap: the lock is held.
        unsafe {
            self.head = head.as_ref().next.load(Ordering::Relaxed);
            head.as_ref().next.store(NOT_QUEUED, Ordering::Relaxed);
        }
        if self.head.is_null() {
            self.tail = ptr::null_mut();
        }
        self.messages -= 1;
        Some(head)
    }

    /// What a receiver takes now without waiting: the oldest message, or,
    /// with none queued, null if the channel is closed (no message will
    /// come, but for a late give-back: DESIGN.md, "Close").
    fn take_now(&mut self) -> Option<*mut ()> {
        match self.pop_message() {
            Some(m) => Some(m.as_ptr().cast()),
            None => self.closed.then_some(ptr::null_mut()),
        }
    }
}

/// A push onto a closed channel: the message was not queued, and comes
/// back here ([`into_inner`](Closed::into_inner)).
///
/// ```
/// use spindle_sync::{Channel, Closed, Msg};
///
/// let chan = Channel::new();
/// chan.close();
/// let Err(Closed(msg)) = chan.push(Msg::new(7)) else { panic!("a closed channel takes nothing") };
/// assert_eq!(*msg, 7); // handed back, to reuse or drop
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Closed<M>(pub M);

impl<M> Closed<M> {
    /// The message that was not queued.
    pub fn into_inner(self) -> M {
        self.0
    }
}

impl<M> fmt::Debug for Closed<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Closed(..)")
    }
}

impl<M> fmt::Display for Closed<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "pushing on a closed channel: the message was not queued (Closed::into_inner hands it back)",
        )
    }
}

impl<M> std::error::Error for Closed<M> {}

/// An unbounded FIFO of caller-owned messages, identified by their headers.
///
/// `push` never waits for a receiver and allocates nothing itself (a woken
/// receiver fiber goes back to its run queue, which may grow a buffer the
/// first time a priority level is used). As with
/// [`Semaphore::release`](crate::Semaphore::release), a woken receiver fiber with no
/// other reference and no run queue is dropped inside `push`: unwound there
/// (its destructors run) on its own thread or if it may migrate, else its
/// stack leaks, with the message it was handed. `pop` waits (a fiber sleeps, a thread parks)
/// until a message arrives, or the channel is closed (then `None`). A
/// message pushed while receivers
/// wait is handed straight to the one that waited longest; if that
/// receiver's run queue or executor refuses its wake or abandons it (gone
/// or shut down), the receiver's wait hook takes the message back and
/// hands it to the next receiver, or queues it.
///
/// The caller owns every message: here, a header with its payload in one
/// heap block, pushed as a raw pointer and taken back from the pointer
/// that `pop` returns.
///
/// ```
/// use std::ptr::NonNull;
/// use spindle_sync::{MsgHeader, RawChannel};
///
/// #[repr(C)]
/// struct Block {
///     hdr: MsgHeader,
///     payload: [u8; 5],
/// }
///
/// let chan = RawChannel::new();
/// let hdr = MsgHeader::new(std::ptr::null_mut(), 0);
/// let block = Box::into_raw(Box::new(Block { hdr, payload: *b"hello" }));
/// // SAFETY: the payload follows the header in the block `block` points to.
/// unsafe { MsgHeader::init_trailing(std::ptr::addr_of_mut!((*block).hdr), 5) };
/// // SAFETY: the block stays put and is not pushed elsewhere until popped.
/// unsafe { chan.push(NonNull::new(block.cast::<MsgHeader>()).unwrap()) }.unwrap();
///
/// let hdr = chan.pop().unwrap(); // here at once: a message is queued
/// // SAFETY: `buf`/`len` describe the payload of the block we pushed.
/// let payload = unsafe { std::slice::from_raw_parts(hdr.as_ref().buf, hdr.as_ref().len) };
/// assert_eq!(payload, b"hello");
/// // SAFETY: the header is the first field of the Box'd block: ours again.
/// drop(unsafe { Box::from_raw(hdr.as_ptr().cast::<Block>()) });
/// ```
pub struct RawChannel {
    synced: Mutex<Synced>,
}

impl RawChannel {
    /// An empty channel.
    pub const fn new() -> RawChannel {
        RawChannel {
            synced: Mutex::new(Synced {
                head: ptr::null_mut(),
                tail: ptr::null_mut(),
                messages: 0,
                pushes: 0,
                receivers: WaitList::new(),
                closed: false,
            }),
        }
    }

    /// Queues a message, or hands it to the longest-waiting receiver.
    ///
    /// # Errors
    ///
    /// [`Closed`] with the header if the channel is closed: nothing is
    /// queued, and the header is the caller's again.
    ///
    /// # Panics
    /// If the header is on a channel already (pushed, and not popped yet):
    /// pop it before pushing it again. Nothing is queued then. This is a
    /// check of an earlier push that has returned; two pushes of one header
    /// at the same moment (onto two channels, from two threads) break the
    /// contract below and are not caught.
    ///
    /// # Safety
    /// The header is properly aligned and was initialised by
    /// [`MsgHeader::new`] or [`MsgHeader::init_trailing`] (and may since
    /// have been pushed and popped, any number of times). From the push
    /// until it is popped (or the channel is dropped), the channel owns it:
    /// it stays valid and is not moved, and the caller neither reads nor
    /// writes it nor holds a reference to it (the channel's drop writes to
    /// the headers still queued, so they must outlive the channel or be
    /// popped first). The message it describes may be accessed from
    /// whichever thread pops it (it is Send). No other push of the same
    /// header runs at the same time (the check above cannot see one).
    pub unsafe fn push(&self, msg: NonNull<MsgHeader>) -> Result<(), Closed<NonNull<MsgHeader>>> {
        let mut synced = self.synced.lock();
        // SAFETY: the header is valid (the caller's contract); the link is
        // atomic, so this read is no race even for a header wrongly queued
        // on another channel (or being handed to a receiver). Checked
        // before the closed flag: a header still on another channel must
        // not come back as the caller's (found in review).
        if unsafe { msg.as_ref().next.load(Ordering::Relaxed) } != NOT_QUEUED {
            drop(synced);
            panic!(
                "spindle-sync: RawChannel::push of a header that is on a channel already (queued, or \
                 being handed to a receiver): pop it before pushing it again"
            );
        }
        if synced.closed {
            return Err(Closed(msg));
        }
        synced.pushes += 1;
        // SAFETY: as above; the channel owns the header from here.
        unsafe { msg.as_ref().seq.store(synced.pushes, Ordering::Relaxed) };
        if !synced.receivers.is_empty() {
            // Marked before the hand-over, never after: once `pop_front`
            // publishes the node's `done`, the receiver may return at once
            // (a thread checks `done` without the lock), mark the header
            // unqueued and push it elsewhere, so the header is not ours to
            // write any more. `done`'s Release orders this store before the
            // receiver's.
            // SAFETY: as above; the receiver's `pop` marks it unqueued.
            unsafe { msg.as_ref().next.store(HANDED, Ordering::Relaxed) };
            let wakeup = synced.receivers.pop_front(msg.as_ptr().cast()).expect("a receiver is waiting");
            #[cfg(test)]
            tests::after_handoff();
            drop(synced);
            // A refusal gives the message back (to the next receiver, or
            // the queue) before `deliver` returns.
            wakeup.deliver();
            return Ok(());
        }
        // SAFETY: the caller hands us the header until it is popped.
        unsafe { msg.as_ref().next.store(ptr::null_mut(), Ordering::Relaxed) };
        match NonNull::new(synced.tail) {
            // SAFETY: the tail is a queued, valid header.
            Some(tail) => unsafe { tail.as_ref().next.store(msg.as_ptr(), Ordering::Relaxed) },
            None => synced.head = msg.as_ptr(),
        }
        synced.tail = msg.as_ptr();
        synced.messages += 1;
        Ok(())
    }

    /// Takes the oldest message, waiting for one if the channel is empty;
    /// `None` once the channel is closed and empty (a receiver waiting
    /// when it closes is woken with `None`).
    #[track_caller]
    #[inline]
    pub fn pop(&self) -> Option<NonNull<MsgHeader>> {
        match self.pop_inner::<false>(None) {
            Ok(m) => m,
            Err(Interrupted) => unreachable!("a plain pop is not interruptible"),
        }
    }

    /// Like [`pop`](RawChannel::pop), but a fiber's wait ends early if the
    /// fiber is interrupted; see [`Channel::pop_interruptible`].
    ///
    /// # Errors
    ///
    /// [`Interrupted`] if the fiber was interrupted before a message came
    /// (or the channel closed), or, with none there and the channel open,
    /// at once in a fiber being dropped. `Ok(None)`: the channel is closed
    /// and empty (taken before a pending interrupt is looked at, except
    /// by a receiver already waiting when the close began: see
    /// [`Channel::pop_interruptible`]).
    #[track_caller]
    #[inline]
    pub fn pop_interruptible(&self) -> Result<Option<NonNull<MsgHeader>>, Interrupted> {
        self.pop_inner::<true>(None)
    }

    /// Like [`pop`](RawChannel::pop), for a thread that waits at most
    /// `timeout`; see [`Channel::pop_timeout`].
    ///
    /// # Errors
    ///
    /// [`TimedOut`] if no message came (and the channel did not close)
    /// before the timeout passed.
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep), as [`Channel::pop_timeout`].
    #[track_caller]
    pub fn pop_timeout(&self, timeout: Duration) -> Result<Option<NonNull<MsgHeader>>, TimedOut> {
        let deadline = thread_deadline(timeout, "RawChannel::pop_timeout");
        self.pop_inner::<false>(deadline).map_err(|Interrupted| TimedOut)
    }

    /// Like [`pop_timeout`](RawChannel::pop_timeout), with a deadline
    /// instead of a duration; see [`Channel::pop_until`].
    ///
    /// # Errors
    ///
    /// [`TimedOut`] if no message came (and the channel did not close) by
    /// `deadline`.
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep), as [`Channel::pop_timeout`].
    #[track_caller]
    pub fn pop_until(&self, deadline: Instant) -> Result<Option<NonNull<MsgHeader>>, TimedOut> {
        refuse_in_fiber("RawChannel::pop_until");
        self.pop_inner::<false>(Some(deadline)).map_err(|Interrupted| TimedOut)
    }

    #[track_caller]
    #[inline]
    fn pop_inner<const INTERRUPTIBLE: bool>(
        &self,
        deadline: Option<Instant>,
    ) -> Result<Option<NonNull<MsgHeader>>, Interrupted> {
        let mut synced = self.synced.lock();
        if let Some(now) = synced.take_now() {
            return Ok(NonNull::new(now.cast()));
        }
        // Woken by a push with its message, or by `close` with null.
        let handed = wait::<_, INTERRUPTIBLE>(
            synced,
            |s| &mut s.receivers,
            Synced::give_back,
            Synced::take_now,
            None,
            &WAIT_REASON,
            deadline,
        )?;
        let Some(handed) = NonNull::new(handed.cast::<MsgHeader>()) else {
            return Ok(None);
        };
        // SAFETY: the pusher handed this header to us (or `take_now` popped
        // it); it is ours now.
        unsafe { handed.as_ref().next.store(NOT_QUEUED, Ordering::Relaxed) };
        Ok(Some(handed))
    }

    /// Closes the channel: from now on pushes are refused (the message is
    /// handed back, [`Closed`]), receivers take the messages still queued
    /// and then get `None` instead of waiting, and every receiver waiting
    /// now is woken with `None`. Returns whether this call closed it
    /// (`false`: it was closed already). Callable from any thread, fiber
    /// or not.
    pub fn close(&self) -> bool {
        let mut synced = self.synced.lock();
        if synced.closed {
            return false;
        }
        // No push hands a message over after this, and the receivers
        // waiting now found the queue empty: tell them nothing will come.
        synced.closed = true;
        Self::wake_receivers_closed(synced);
        true
    }

    /// Whether the channel is closed.
    pub fn is_closed(&self) -> bool {
        self.synced.lock().closed
    }

    /// Wakes every waiting receiver with null (nothing will come), one
    /// lock hold each, the wakes delivered outside the lock. In a scope: a
    /// receiver whose last reference a wake drops is unwound only once
    /// every receiver is woken (DESIGN.md, "Deferred releases"). A wake
    /// that panics (a scheduler breaking `Schedule`'s contract) does not
    /// stop the others, which would sleep for good on the closed channel:
    /// the first panic is resumed once every receiver is woken (found in
    /// review).
    fn wake_receivers_closed(mut synced: parking_lot::MutexGuard<'_, Synced>) {
        let mut first_panic = None;
        spindle_fiber::defer_releases(|| {
            while let Some(wakeup) = synced.receivers.pop_front(ptr::null_mut()) {
                parking_lot::MutexGuard::unlocked(&mut synced, || {
                    let woken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wakeup.deliver()));
                    if let Err(payload) = woken {
                        first_panic.get_or_insert(payload);
                    }
                });
            }
            drop(synced);
        });
        if let Some(payload) = first_panic {
            std::panic::resume_unwind(payload);
        }
    }

    /// Takes the oldest message if there is one.
    pub fn try_pop(&self) -> Option<NonNull<MsgHeader>> {
        self.synced.lock().pop_message()
    }

    /// Messages queued now.
    pub fn len(&self) -> usize {
        self.synced.lock().messages
    }

    /// Whether no message is queued now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Receivers waiting now.
    pub fn receivers(&self) -> usize {
        self.synced.lock().receivers.len()
    }
}

impl Default for RawChannel {
    fn default() -> RawChannel {
        RawChannel::new()
    }
}

impl fmt::Debug for RawChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One look under the lock (the two counts of the same moment), then
        // format without it: the formatter's writer is the caller's code,
        // which may use this channel.
        let (messages, receivers, closed) = self.counts();
        f.debug_struct("RawChannel")
            .field("messages", &messages)
            .field("receivers", &receivers)
            .field("closed", &closed)
            .finish()
    }
}

impl RawChannel {
    /// Messages, receivers and whether it is closed, read in one lock hold.
    fn counts(&self) -> (usize, usize, bool) {
        let s = self.synced.lock();
        (s.messages, s.receivers.len(), s.closed)
    }
}

impl Drop for RawChannel {
    /// Queued headers stay their owners' memory: the channel marks each one
    /// as no longer queued (so that it may be pushed again, elsewhere) and
    /// forgets it. Receivers borrow the channel while they wait, so none is
    /// left, except a fiber that suspended inside the `with` of a
    /// thread-local channel that its thread's exit now drops (DESIGN.md,
    /// "Known gaps"): it is left asleep for good, and said so.
    fn drop(&mut self) {
        let synced = self.synced.get_mut();
        if !synced.receivers.is_empty() {
            warn!(
                "spindle-sync: a channel was dropped with {} fiber(s) waiting on it (a thread-local \
                 channel whose thread exited while a fiber slept in it); they are never woken",
                synced.receivers.len()
            );
        }
        while synced.pop_message().is_some() {}
    }
}

/// A message header and its value in one caller-owned allocation.
#[repr(C)]
struct MsgBlock<T> {
    hdr: MsgHeader,
    value: T,
}

/// An owning handle to a channel message: one allocation holding the
/// [`MsgHeader`] and a `T`. Allocate it once, push it, get it back from
/// `pop`, change it in place and push it again: the channel never allocates.
///
/// ```
/// use spindle_sync::{Channel, Msg};
///
/// let chan = Channel::new();
/// chan.push(Msg::new(41)).unwrap();
/// let mut m = chan.try_pop().unwrap();
/// *m += 1;
/// chan.push(m).unwrap(); // the same allocation again
/// assert_eq!(*chan.try_pop().unwrap(), 42);
/// ```
pub struct Msg<T> {
    block: Box<MsgBlock<T>>,
}

impl<T> Msg<T> {
    /// Allocates a message holding `value`.
    pub fn new(value: T) -> Msg<T> {
        Msg { block: Box::new(MsgBlock { hdr: MsgHeader::new(ptr::null_mut(), 0), value }) }
    }

    /// The value, consuming the message.
    pub fn into_inner(self) -> T {
        self.block.value
    }

    fn into_header(self) -> NonNull<MsgHeader> {
        let raw = Box::into_raw(self.block);
        // SAFETY: `hdr` is the first field of a repr(C) struct, so the
        // header pointer is the block pointer.
        unsafe {
            (*raw).hdr.buf = ptr::addr_of_mut!((*raw).value) as *mut u8;
            (*raw).hdr.len = std::mem::size_of::<T>();
            NonNull::new_unchecked(raw as *mut MsgHeader)
        }
    }

    /// # Safety
    /// `hdr` came from `into_header` of a `Msg<T>` of the same `T`.
    unsafe fn from_header(hdr: NonNull<MsgHeader>) -> Msg<T> {
        // SAFETY: the caller's contract.
        Msg { block: unsafe { Box::from_raw(hdr.as_ptr() as *mut MsgBlock<T>) } }
    }
}

/// [`Msg::new`]: `chan.push(7.into())`.
impl<T> From<T> for Msg<T> {
    fn from(value: T) -> Msg<T> {
        Msg::new(value)
    }
}

// SAFETY: `&Msg<T>` gives out `&T` only; the header inside is touched by a
// channel only while the channel owns the message (it is not shared then).
unsafe impl<T: Sync> Sync for Msg<T> {}

impl<T> Deref for Msg<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.block.value
    }
}

impl<T> DerefMut for Msg<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.block.value
    }
}

impl<T: fmt::Debug> fmt::Debug for Msg<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Msg").field(&self.block.value).finish()
    }
}

/// A typed, safe channel of [`Msg<T>`] handles, for fibers and threads.
///
/// Dropping the channel drops the messages still queued (no receiver can
/// be waiting, since a receiver borrows the channel, except a fiber
/// suspended inside the `with` of a thread-local channel that its thread's
/// exit drops: it is never woken; see DESIGN.md, "Known gaps"). A fiber that cannot sleep,
/// because its stack is being unwound after its last handle was dropped,
/// waits in `pop` like a thread, blocking the dropping thread. A message
/// handed to a sleeping receiver is its own from then on: if the receiver
/// is dropped before it runs again, the unwind puts the message back into
/// the queue at its place by push order (or hands it to the next
/// receiver); if its stack
/// cannot be unwound (a pinned fiber whose last handle is dropped on
/// another thread: the stack is leaked), the message is lost with it.
///
/// Order: first in, first out, messages put back by dropped receivers
/// included (each goes back to its place by push order).
///
/// ```
/// use std::sync::Arc;
/// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
/// use spindle_run_queue::RunQueue;
/// use spindle_sync::{Channel, Msg};
///
/// let chan = Arc::new(Channel::<&str>::new());
/// let queue = RunQueue::new(4);
/// let fiber = Fiber::new(FiberAttr::new()).unwrap();
/// let rx = chan.clone();
/// fiber.set_function(Priority::NORMAL, move || rx.pop().unwrap().into_inner()).unwrap();
/// queue.try_push(fiber).unwrap();
///
/// assert!(matches!(queue.run_next().unwrap().outcome, Ok(RunOutcome::Slept)));
/// chan.push(Msg::new("hello")).unwrap(); // hands the message over, wakes the fiber
/// let ran = queue.run_next().unwrap();
/// assert!(matches!(ran.outcome, Ok(RunOutcome::Returned("hello"))));
/// ```
pub struct Channel<T> {
    raw: RawChannel,
    /// Owns queued `Msg<T>`s (for the drop check), and is invariant in
    /// `T`: a covariant channel would let `&Channel<&'static str>` be used
    /// as `&Channel<&'a str>`, push a short-lived reference, and pop it
    /// back as `'static`.
    _holds: PhantomData<HoldsInvariant<T>>,
}

/// `Channel<T>`'s marker: owns `Msg<T>`s, invariant in `T`.
type HoldsInvariant<T> = (Msg<T>, fn(T) -> T);

// SAFETY: the channel moves Msg<T> between threads: T must be Send. It
// never hands out references to queued values.
unsafe impl<T: Send> Send for Channel<T> {}
// SAFETY: as above; all access goes through the raw channel's lock.
unsafe impl<T: Send> Sync for Channel<T> {}

impl<T> Channel<T> {
    /// An empty channel.
    pub const fn new() -> Channel<T> {
        Channel { raw: RawChannel::new(), _holds: PhantomData }
    }

    /// Queues a message, or hands it to the longest-waiting receiver. Never
    /// waits for a receiver and allocates nothing itself (see
    /// [`RawChannel`] for what a wake may do here).
    ///
    /// # Errors
    ///
    /// [`Closed`] with the message if the channel is closed
    /// ([`close`](Channel::close)): nothing is queued.
    pub fn push(&self, msg: Msg<T>) -> Result<(), Closed<Msg<T>>> {
        // SAFETY: the header is the heap block of a Msg we now own; it stays
        // put until popped (converted back to a Msg) or dropped with the
        // channel (see Drop); T: Send for any channel shared across threads.
        // A header refused by a closed channel is ours again.
        unsafe { self.raw.push(msg.into_header()).map_err(|Closed(h)| Closed(Msg::from_header(h))) }
    }

    /// Takes the oldest message, waiting if there is none: a fiber sleeps
    /// (and is pushed back on its run queue when a message arrives), a
    /// thread parks. `None` once the channel is closed and every message
    /// pushed before has been taken: a receiver waiting when the channel
    /// closes is woken with `None`, so `while let Some(m) = chan.pop()`
    /// reads until the sender closes. (A message can come back after the
    /// close: one handed to a receiver whose scheduler refused the wake
    /// (it had shut down) while the channel closed, or to a receiver fiber
    /// that was woken but dropped before it ran. It goes back into the
    /// channel, where `pop` and `try_pop` still find it; a reader that saw
    /// `None` before does not. Nothing is lost or freed: the channel's
    /// drop drops it.)
    ///
    /// ```
    /// # std::thread::spawn(|| { // a watchdog: a hang fails the example
    /// #     std::thread::sleep(std::time::Duration::from_secs(60));
    /// #     eprintln!("watchdog: this example did not finish within 60 s");
    /// #     std::process::exit(1)
    /// # });
    /// use std::sync::Arc;
    /// use spindle_sync::{Channel, Msg};
    ///
    /// let chan = Arc::new(Channel::<u32>::new());
    /// let rx = chan.clone();
    /// let reader = std::thread::spawn(move || {
    ///     let mut sum = 0;
    ///     while let Some(m) = rx.pop() {
    ///         sum += m.into_inner();
    ///     }
    ///     sum // the channel closed
    /// });
    /// for i in 1..=4 {
    ///     chan.push(Msg::new(i)).unwrap();
    /// }
    /// chan.close();
    /// assert_eq!(reader.join().unwrap(), 10);
    /// ```
    #[track_caller]
    #[inline]
    pub fn pop(&self) -> Option<Msg<T>> {
        // SAFETY: only Msg<T> headers are pushed on this channel.
        self.raw.pop().map(|h| unsafe { Msg::from_header(h) })
    }

    /// Closes the channel: from now on [`push`](Channel::push) refuses
    /// messages (handing them back in [`Closed`]), receivers take the
    /// messages still queued and then get `None` instead of waiting, and
    /// every receiver waiting now is woken with `None`. Returns whether this
    /// call closed it (`false`: it was closed already). There is no
    /// reopening. Callable from any thread, fiber or not; a channel is also
    /// closed in effect when it is dropped (no receiver can be waiting
    /// then).
    pub fn close(&self) -> bool {
        self.raw.close()
    }

    /// Whether the channel is closed.
    pub fn is_closed(&self) -> bool {
        self.raw.is_closed()
    }

    /// Like [`pop`](Channel::pop), but a fiber's wait ends early if the
    /// fiber is interrupted ([`Waiter::interrupt`], [`Fiber::interrupt`];
    /// an interrupt made before the wait counts too, once): then no message
    /// is taken. A message that is queued is taken even with an interrupt
    /// pending. A thread waits as in `pop`. A fiber that is being dropped
    /// (a destructor run by the unwind of its suspended stack, or code that
    /// caught that unwind: [`may_sleep`](spindle_fiber::may_sleep) is
    /// false) does not wait: it takes a message if one is queued, else
    /// `Ok(None)` if the channel is closed, else returns `Interrupted`, and
    /// so does every retry (do not loop on it there: use `pop`, which
    /// blocks the thread, if the message must be had). On a closed, empty
    /// channel `Ok(None)` comes first, before a pending interrupt (except
    /// for a receiver interrupted while it waits and the close is still
    /// waking the others: it gets `Interrupted`, and a retry `Ok(None)`).
    ///
    /// ```
    /// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
    /// use spindle_sync::{Channel, Interrupted, Msg};
    /// use std::sync::Arc;
    ///
    /// let chan = Arc::new(Channel::<u32>::new());
    /// let fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// let rx = chan.clone();
    /// fiber
    ///     .set_function(Priority::NORMAL, move || {
    ///         let first = rx.pop_interruptible().map(|m| m.map(Msg::into_inner));
    ///         let second = rx.pop_interruptible().map(|m| m.map(Msg::into_inner));
    ///         (first, second)
    ///     })
    ///     .unwrap();
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
    /// fiber.interrupt(); // the first wait ends without a message
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Slept))); // the second waits
    /// chan.push(Msg::new(7)).unwrap();
    /// match fiber.run() {
    ///     Ok(RunOutcome::Returned(got)) => assert_eq!(got, (Err(Interrupted), Ok(Some(7)))),
    ///     other => panic!("{other:?}"),
    /// }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Interrupted`] if the fiber was interrupted before a message came
    /// (or the channel closed), or, with none there and the channel open,
    /// at once in a fiber being dropped. `Ok(None)`: the channel is closed
    /// and empty, as for [`pop`](Channel::pop).
    ///
    /// [`Waiter::interrupt`]: spindle_fiber::Waiter::interrupt
    /// [`Fiber::interrupt`]: spindle_fiber::Fiber::interrupt
    #[track_caller]
    #[inline]
    pub fn pop_interruptible(&self) -> Result<Option<Msg<T>>, Interrupted> {
        // SAFETY: as in `pop`.
        self.raw.pop_interruptible().map(|h| h.map(|h| unsafe { Msg::from_header(h) }))
    }

    /// Like [`pop`](Channel::pop), for a thread that waits at most
    /// `timeout`. A message handed to it as the timeout passes is still
    /// taken; one not taken stays for the other receivers. `Ok(None)`: the
    /// channel is closed and empty, as for `pop`. A duration too long to
    /// add to the current time waits as `pop` does.
    ///
    /// ```
    /// use spindle_sync::{Channel, Msg, TimedOut};
    /// use std::time::Duration;
    ///
    /// let chan = Channel::new();
    /// assert_eq!(chan.pop_timeout(Duration::from_millis(10)).map(|m| m.map(Msg::into_inner)), Err(TimedOut));
    /// chan.push(Msg::new(7)).unwrap();
    /// assert_eq!(chan.pop_timeout(Duration::from_millis(10)).map(|m| m.map(Msg::into_inner)), Ok(Some(7)));
    /// chan.close();
    /// assert!(matches!(chan.pop_timeout(Duration::from_millis(10)), Ok(None)));
    /// ```
    ///
    /// # Errors
    ///
    /// [`TimedOut`] if no message came (and the channel did not close)
    /// before the timeout passed.
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep), as
    /// [`Semaphore::acquire_timeout`](crate::Semaphore::acquire_timeout)
    /// does: a fiber uses [`pop_interruptible`](Channel::pop_interruptible)
    /// under its scheduler's deadline.
    #[track_caller]
    pub fn pop_timeout(&self, timeout: Duration) -> Result<Option<Msg<T>>, TimedOut> {
        let deadline = thread_deadline(timeout, "Channel::pop_timeout");
        match self.raw.pop_inner::<false>(deadline) {
            // SAFETY: as in `pop`.
            Ok(h) => Ok(h.map(|h| unsafe { Msg::from_header(h) })),
            Err(Interrupted) => Err(TimedOut),
        }
    }

    /// Like [`pop_timeout`](Channel::pop_timeout), with a deadline instead
    /// of a duration. A deadline already past still takes a message that
    /// is there now (and `Ok(None)` from a closed, empty channel).
    ///
    /// ```
    /// use spindle_sync::{Channel, Msg, TimedOut};
    /// use std::time::{Duration, Instant};
    ///
    /// let chan = Channel::new();
    /// let deadline = Instant::now() + Duration::from_millis(10);
    /// assert_eq!(chan.pop_until(deadline).map(|m| m.map(Msg::into_inner)), Err(TimedOut));
    /// chan.push(Msg::new(7)).unwrap();
    /// assert_eq!(chan.pop_until(deadline).map(|m| m.map(Msg::into_inner)), Ok(Some(7)));
    /// ```
    ///
    /// # Errors
    ///
    /// [`TimedOut`] if no message came (and the channel did not close) by
    /// `deadline`.
    ///
    /// # Panics
    ///
    /// In a fiber (one that may sleep), as [`pop_timeout`](Channel::pop_timeout).
    #[track_caller]
    pub fn pop_until(&self, deadline: Instant) -> Result<Option<Msg<T>>, TimedOut> {
        refuse_in_fiber("Channel::pop_until");
        match self.raw.pop_inner::<false>(Some(deadline)) {
            // SAFETY: as in `pop`.
            Ok(h) => Ok(h.map(|h| unsafe { Msg::from_header(h) })),
            Err(Interrupted) => Err(TimedOut),
        }
    }

    /// Takes the oldest message if there is one (on a closed channel too:
    /// [`is_closed`](Channel::is_closed) tells an empty open channel from a
    /// finished one).
    pub fn try_pop(&self) -> Option<Msg<T>> {
        // SAFETY: as in `pop`.
        self.raw.try_pop().map(|h| unsafe { Msg::from_header(h) })
    }

    /// Messages queued now.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether no message is queued now.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// Receivers waiting now.
    pub fn receivers(&self) -> usize {
        self.raw.receivers()
    }
}

impl<T> Default for Channel<T> {
    fn default() -> Channel<T> {
        Channel::new()
    }
}

impl<T> fmt::Debug for Channel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // As for `RawChannel`: one look, then format without the lock.
        let (messages, receivers, closed) = self.raw.counts();
        f.debug_struct("Channel")
            .field("messages", &messages)
            .field("receivers", &receivers)
            .field("closed", &closed)
            .finish()
    }
}

impl<T> Drop for Channel<T> {
    /// Messages still queued are dropped with their values. If one of
    /// those drops panics, the rest are still dropped while the panic
    /// unwinds (a second panic then aborts, as for a `Vec`).
    fn drop(&mut self) {
        /// Drops what is still queued when a message's drop unwinds.
        struct Rest<'a, T>(&'a Channel<T>);
        impl<T> Drop for Rest<'_, T> {
            fn drop(&mut self) {
                while let Some(m) = self.0.try_pop() {
                    drop(m);
                }
            }
        }
        let rest = Rest(self);
        while let Some(m) = rest.0.try_pop() {
            drop(m);
        }
        std::mem::forget(rest);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::ptr::{self, NonNull};
    use std::sync::atomic::Ordering;
    use std::sync::{mpsc, Arc};
    use std::thread;
    use std::time::{Duration, Instant};

    use super::{MsgHeader, RawChannel};

    thread_local! {
        /// Run by `push` on this thread right after it handed a message to
        /// a waiting receiver, with the channel's lock still held.
        static AFTER_HANDOFF: RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
    }

    pub(super) fn after_handoff() {
        AFTER_HANDOFF.with(|hook| {
            if let Some(f) = hook.borrow_mut().as_mut() {
                f()
            }
        });
    }

    /// A receiver owns a handed message as soon as its wait ends, and may
    /// push it onto another channel at once: the pusher, stalled right
    /// after the hand-over, must write nothing to the header afterwards
    /// (a late "handed" mark used to overwrite the link of the other
    /// channel's queue).
    #[test]
    fn a_receiver_may_push_a_handed_message_elsewhere_at_once() {
        let a = Arc::new(RawChannel::new());
        let b = Arc::new(RawChannel::new());
        let msg = NonNull::from(Box::leak(Box::new(MsgHeader::new(ptr::null_mut(), 0))));
        let (done_tx, done_rx) = mpsc::channel();
        let receiver = {
            let (a, b) = (a.clone(), b.clone());
            // The pointer crosses as an address: the message is the
            // receiver's once popped.
            thread::spawn(move || {
                let h = a.pop().unwrap();
                // SAFETY: popped, so ours; it stays valid until the test
                // frees it after both channels are done with it.
                unsafe { b.push(h) }.unwrap();
                done_tx.send(()).unwrap();
            })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while a.receivers() == 0 {
            assert!(Instant::now() < deadline, "the receiver never waited on the channel");
            thread::yield_now();
        }
        let receiver_thread = receiver.thread().clone();
        AFTER_HANDOFF.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                // The wakeup comes after this hook; unparks of our own
                // (allowed at any time) let the receiver see `done` now.
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    receiver_thread.unpark();
                    match done_rx.recv_timeout(Duration::from_millis(1)) {
                        Ok(()) => return,
                        Err(_) => assert!(
                            Instant::now() < deadline,
                            "the receiver did not return from pop while the pusher was stalled after the \
                             hand-over"
                        ),
                    }
                }
            }))
        });
        // SAFETY: a fresh header, valid until freed below.
        unsafe { a.push(msg) }.unwrap();
        AFTER_HANDOFF.with(|hook| hook.borrow_mut().take());
        receiver.join().unwrap();
        // SAFETY: the header is alive; its link is atomic.
        let link = unsafe { msg.as_ref().next.load(Ordering::Relaxed) };
        if !link.is_null() {
            // `b`'s queue now ends in that link: its drop would follow it.
            std::mem::forget(b);
            panic!(
                "push wrote to the header after handing it over: its link on the other channel is {link:p}"
            );
        }
        assert_eq!(b.try_pop(), Some(msg));
        assert!(b.try_pop().is_none() && a.try_pop().is_none());
        // SAFETY: popped from both channels: ours again, made by Box::leak.
        drop(unsafe { Box::from_raw(msg.as_ptr()) });
    }
}
