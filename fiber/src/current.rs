//! The current fiber: a thread-local pointer that the runner sets just
//! before switching into a fiber and puts back just after the fiber
//! switches out ([`enter`], [`exit`]), and the free functions a fiber calls
//! on itself.
//!
//! # Thread-local access across stack switches
//!
//! A fiber may suspend on one thread and resume on another, and LLVM may
//! cache the address of a thread-local across a call within one function
//! (llvm/llvm-project#98479). Every access to the current-fiber word goes
//! through [`crate::tls`], whose reads and writes cannot be cached (see
//! there), so the library's own lookups are immune whichever function they
//! are inlined into. Besides, only the runner writes the word, just before
//! the switch in and just after the switch back (`release` does the same
//! around a forced unwind), and it cannot change threads in between: the
//! fiber side only reads it.

use std::panic::Location;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::defer::defer_releases;
use crate::fiber::Yielder;
use crate::header::{FiberId, Header, WaitReason};
use crate::state::{FiberState, WakeTransition};
use crate::tls;
use crate::Priority;

/// The current fiber's header, or null. Usable from a signal handler: a
/// plain thread-local read.
#[inline(always)]
pub(crate) fn current_header() -> *const Header {
    tls::current()
}

/// A process-unique id of the calling thread (never reused, never 0).
#[inline(always)]
pub(crate) fn thread_id() -> u64 {
    match tls::thread_id_word() {
        0 => assign_thread_id(),
        id => id,
    }
}

/// Runner side, just before switching into `h`: makes `h` the current
/// fiber. Returns the fiber that was current, for [`exit`].
///
/// `h` points at the fiber's whole allocation (the `Inner` it heads), not
/// just its header: code that finds the fiber through the current-fiber
/// word reaches the reference count beside the header (`Waiter::current`),
/// which a pointer made from a `&Header` may not do under Stacked Borrows.
#[inline(always)]
pub(crate) fn enter(h: NonNull<Header>) -> *const Header {
    tls::swap_current(h.as_ptr())
}

/// [`enter`], also returning this thread's id word (0 if the thread has no
/// id yet: see [`thread_id`]), in one thread-local access.
#[inline(always)]
pub(crate) fn enter_on_thread(h: NonNull<Header>) -> (*const Header, u64) {
    tls::swap_current_read_thread_id(h.as_ptr())
}

/// Runner side, once the fiber has switched out (yield, sleep, return,
/// panic): gives the thread back the fiber that [`enter`] found current.
///
/// # Safety
/// Called on the thread that made the `enter` that returned `prev` (a
/// runner does not change threads while the fiber it runs is switched in).
#[inline(always)]
pub(crate) unsafe fn exit(prev: *const Header) {
    // SAFETY: same thread, by the caller's contract.
    unsafe { tls::set_current(prev) }
}

#[cold]
#[inline(never)]
fn assign_thread_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    tls::set_thread_id(id);
    // First fiber run on this thread: make sure a stack overflow can be
    // reported here.
    crate::overflow::ensure_altstack();
    id
}

/// A thread, as a fiber is pinned to it: [`Fiber::pin_to`] pins a
/// function that has not run yet to the thread a token names, so that a
/// scheduler with several threads (your own workers over one run queue)
/// can spread pinned fibers over them instead of leaving each with
/// whichever thread first ran it.
///
/// Tokens are process-unique and never reused: a token of a thread that
/// has exited names no live thread, and a fiber pinned to it never runs
/// (dropping it is fine: its function never started).
///
/// ```
/// use spindle_fiber::ThreadToken;
///
/// let here = ThreadToken::current();
/// assert_eq!(here, ThreadToken::current());
/// let there = std::thread::spawn(ThreadToken::current).join().unwrap();
/// assert_ne!(here, there);
/// ```
///
/// [`Fiber::pin_to`]: crate::Fiber::pin_to
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ThreadToken(std::num::NonZeroU64);

impl ThreadToken {
    /// The calling thread's token. The first call on a thread (or its
    /// first fiber run) gives the thread its id, and, if it has no
    /// alternate signal stack yet, maps one for the stack-overflow report
    /// (64 KiB and a guard page, unmapped when the thread exits): a thread
    /// a fiber is pinned to will run fibers anyway.
    pub fn current() -> ThreadToken {
        ThreadToken(std::num::NonZeroU64::new(thread_id()).expect("thread ids are never 0"))
    }

    /// The raw id: the number spindle-fiber's thread checks compare.
    pub(crate) fn get(self) -> u64 {
        self.0.get()
    }
}

/// Identity of the fiber running on this thread.
///
/// ```
/// use spindle_fiber::{current, Fiber, FiberAttr, Priority};
///
/// assert!(current().is_none()); // an ordinary thread
/// let fiber = Fiber::new(FiberAttr::new().name("worker")).unwrap();
/// fiber.set_function(Priority::HIGHEST, || {
///     let me = current().unwrap();
///     (me.name().map(str::to_owned), me.priority())
/// }).unwrap();
/// let (name, prio) = fiber.run().unwrap().unwrap_returned();
/// assert_eq!(name.as_deref(), Some("worker"));
/// assert_eq!(prio, Priority::HIGHEST);
/// ```
#[derive(Debug, Clone)]
pub struct CurrentFiber {
    id: FiberId,
    name: Option<Arc<str>>,
    priority: Priority,
}

impl CurrentFiber {
    /// The fiber's id.
    pub fn id(&self) -> FiberId {
        self.id
    }
    /// The fiber's name, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
    /// The fiber's priority at the time of the call.
    pub fn priority(&self) -> Priority {
        self.priority
    }
}

/// The fiber running on this thread, or `None` on an ordinary thread.
pub fn current() -> Option<CurrentFiber> {
    let h = current_header();
    // SAFETY: a non-null current fiber is the header of the fiber that
    // `run` is running on this thread; `run` holds a reference to it.
    let h = unsafe { h.as_ref()? };
    Some(CurrentFiber {
        id: h.id,
        name: h.name.clone(),
        priority: h.priority(),
    })
}

/// Sets the priority of the fiber running on this thread; it takes effect
/// the next time the fiber is queued (after a yield or a wake). Returns
/// `false` on an ordinary thread.
pub fn set_current_priority(priority: Priority) -> bool {
    let h = current_header();
    // SAFETY: see `current`.
    match unsafe { h.as_ref() } {
        Some(h) => {
            h.priority.store(priority.0, Ordering::Relaxed);
            true
        }
        None => false,
    }
}

/// The id of the fiber running on this thread, or `None` on an ordinary
/// thread. Cheaper than [`current`] (no name is cloned).
pub fn current_id() -> Option<FiberId> {
    let h = current_header();
    // SAFETY: see `current`.
    unsafe { h.as_ref() }.map(|h| h.id)
}

/// Whether the caller runs on a fiber.
pub fn in_fiber() -> bool {
    !current_header().is_null()
}

/// Whether the caller can put its fiber to sleep ([`sleep`], or a wait
/// on a `spindle-sync` primitive): true inside a fiber's function, false
/// on an ordinary thread and while the stack of a dropped fiber is being
/// unwound. Destructors run then with the fiber current, but the fiber
/// has no runner to come back to: a yield there yields the thread (with
/// an exception: see [`yield_value`]), and a [`sleep`] panics (and the
/// process aborts: a panic in a destructor during an unwind; if the
/// dropping thread was itself panicking, the sleep restarts the unwind
/// instead, which aborts too). Code that
/// caught the unwind with `catch_unwind` and then suspends restarts it.
/// Code that must wait in a destructor (a scope waiting for the fibers it
/// spawned) blocks the thread instead when this is false.
///
/// It is true while a panic unwinds the fiber too. Suspending then leaves
/// the thread's panic count raised (`std::thread::panicking()` true for
/// whatever runs on the thread) until the fiber resumes and the unwind
/// ends, and a migratable fiber must not do it at all (see
/// [`Fiber::set_function_migratable`](crate::Fiber::set_function_migratable)).
///
/// ```
/// use spindle_fiber::{may_sleep, Fiber, FiberAttr, Priority};
///
/// assert!(!may_sleep()); // an ordinary thread
/// let fiber = Fiber::new(FiberAttr::new()).unwrap();
/// fiber.set_function(Priority::NORMAL, may_sleep).unwrap();
/// assert!(fiber.run().unwrap().unwrap_returned());
/// ```
pub fn may_sleep() -> bool {
    let h = current_header();
    // SAFETY: see `current`.
    unsafe { h.as_ref() }.is_some_and(|h| !h.unwinding_for_drop.load(Ordering::Relaxed))
}

/// Suspends the current fiber; `run` returns [`RunOutcome::Yielded`] with
/// `value`. On an ordinary thread this is [`std::thread::yield_now`].
///
/// In a destructor that runs while a dropped fiber's stack is unwound
/// (there is no runner to come back to: see [`may_sleep`]) it yields the
/// thread too, and `value` is discarded; that runs no other fiber, so a
/// destructor that polls for something a fiber of the same thread must do
/// polls forever. That holds when the thread dropping the fiber was not
/// panicking itself: if it was (the fiber is dropped during a panic, or
/// from a destructor of another fiber being unwound), such a yield cannot
/// be told apart from one made after a `catch_unwind` that caught the
/// unwind, and it suspends, which restarts the unwind: inside a
/// destructor that aborts the process. Code that caught the unwind and
/// yields restarts it, unless it yields from a destructor while a panic
/// of its own unwinds (the two look the same): that yield yields the
/// thread, and the panic goes on.
///
/// # Panics
///
/// In a fiber whose function is over: a destructor of its return value
/// that yields (there is no function left to suspend).
///
/// [`RunOutcome::Yielded`]: crate::RunOutcome::Yielded
#[inline]
pub fn yield_value(value: usize) {
    let h = current_header();
    if h.is_null() {
        std::thread::yield_now();
        return;
    }
    // SAFETY: `h` is the running fiber's header (see `current`).
    let yielder = unsafe { (*h).yielder.load(Ordering::Relaxed) } as *const Yielder;
    if yielder.is_null() {
        yield_without_yielder(h, value);
        return;
    }
    // SAFETY: the yielder was stored by this fiber's own function when it
    // started and lives at the root of this fiber's stack, which is the
    // stack we are running on.
    unsafe { (*yielder).suspend(value) };
}

/// Whether the caller is a destructor run by the forced unwind of its
/// dropped fiber, as far as that can be told (see
/// `Header::panicking_means_unwinding`; false when it cannot).
fn in_drop_unwind(h: &Header) -> bool {
    h.panicking_means_unwinding.load(Ordering::Relaxed) && std::thread::panicking()
}

/// A yield that found no yielder: the function is over (a panic), or the
/// dropped fiber's stack is being unwound (`release` moved the yielder
/// aside). In a destructor run by that unwind the thread yields instead: a
/// suspension there would restart the unwind inside the destructor, and a
/// panic in a destructor during an unwind aborts the process. Otherwise
/// (code that caught the forced unwind, or a destructor that cannot be
/// told from it) the suspension restarts the unwind, as corosensei does.
#[cold]
#[inline(never)]
fn yield_without_yielder(h: *const Header, value: usize) {
    // SAFETY: `h` is the running fiber's header (see `current`).
    let hr = unsafe { &*h };
    if in_drop_unwind(hr) {
        std::thread::yield_now();
        return;
    }
    let yielder = unwinding_yielder(hr);
    // SAFETY: as in `yield_value`; `release` moved it aside while this
    // function's stack is unwound, and cleared it when the function ended.
    unsafe { (*yielder).suspend(value) };
}

/// A sleep that found no yielder: as [`yield_without_yielder`], but a
/// sleep cannot become a thread's wait (its `Waiter` names the fiber), so
/// in a destructor run by the unwind it panics with the reason.
#[cold]
#[inline(never)]
#[track_caller]
fn sleep_without_yielder(h: &Header) -> *const Yielder {
    if in_drop_unwind(h) {
        panic!(
            "spindle_fiber: sleep in a destructor that runs while a dropped fiber's stack is \
             unwound: no runner is left to wake it, so the process aborts (a panic during an \
             unwind); check may_sleep() and wait with a thread primitive instead"
        )
    }
    unwinding_yielder(h)
}

/// The yielder `release` moved aside while it unwinds the dropped fiber's
/// stack; panics if there is none (the function is over).
#[cold]
#[inline(never)]
fn unwinding_yielder(h: &Header) -> *const Yielder {
    let yielder = h.drop_yielder.load(Ordering::Relaxed) as *const Yielder;
    if !h.unwinding_for_drop.load(Ordering::Relaxed) || yielder.is_null() {
        no_yielder();
    }
    yielder
}

#[cold]
#[inline(never)]
fn no_yielder() -> ! {
    panic!(
        "spindle_fiber: yield or sleep from a fiber whose function is not running (a value dropped \
         after the function returned): suspend only from inside the function"
    )
}

/// Suspends the current fiber so that whoever runs it can run others; the
/// same as `yield_value(0)`. On an ordinary thread it is
/// [`std::thread::yield_now`].
///
/// ```
/// use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome};
///
/// let fiber = Fiber::new(FiberAttr::new()).unwrap();
/// fiber.set_function(Priority::NORMAL, || {
///     fn deep(n: u32) { if n == 0 { yield_now() } else { deep(n - 1) } }
///     deep(10); // yield from anywhere in the call stack
///     "done"
/// }).unwrap();
/// assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(0)));
/// assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned("done")));
/// ```
#[inline]
pub fn yield_now() {
    yield_value(0)
}

/// A counted, type-erased reference to a fiber that is about to sleep or is
/// asleep, held by the wait list of a synchronisation primitive.
///
/// This is the seam between fibers and synchronisation primitives:
///
/// 1. the fiber takes `Waiter::current()`, publishes it in a wait list
///    (under the primitive's lock) and calls [`sleep`];
/// 2. a waker removes it from the list (under the same lock) and calls
///    [`Waiter::wake`], which makes the fiber runnable again: pushed onto
///    the scheduler it was last queued on, or `Ready` if it has none.
///
/// The wake may happen before the fiber has finished switching out; the
/// state machine resolves that race (DESIGN.md, "sleep/wake protocol").
///
/// A `Waiter` is `Send` and `Sync`: wakers run on any thread.
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<spindle_fiber::Waiter>();
/// ```
///
/// `CurrentFiber` is a plain snapshot, also `Send` and `Sync`:
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<spindle_fiber::CurrentFiber>();
/// ```
pub struct Waiter {
    header: NonNull<Header>,
    /// The generation of the function it was made for (see
    /// `Header::interrupt`): its `interrupt` reaches that function only.
    generation: u64,
}

// SAFETY: a Waiter only holds a counted reference; every operation on it
// goes through the header's atomics and the fiber's state machine.
unsafe impl Send for Waiter {}
// SAFETY: `&Waiter` only reads immutable header fields and reads or
// writes atomic ones (`set_priority`).
unsafe impl Sync for Waiter {}

impl Waiter {
    /// A waiter for the calling fiber, or `None` on an ordinary thread.
    pub fn current() -> Option<Waiter> {
        let h = NonNull::new(current_header() as *mut Header)?;
        // SAFETY: the header is alive (it is running); retain adds the
        // reference this Waiter owns.
        unsafe { (h.as_ref().vtable.retain)(h) };
        // SAFETY: as above.
        let generation = unsafe { h.as_ref() }.interrupt.load(Ordering::Relaxed) >> 1;
        Some(Waiter {
            header: h,
            generation,
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: we own a reference.
        unsafe { self.header.as_ref() }
    }

    /// The fiber's id.
    pub fn id(&self) -> FiberId {
        self.header().id
    }

    /// The fiber's priority.
    pub fn priority(&self) -> Priority {
        self.header().priority()
    }

    /// Sets the priority the fiber is scheduled at when woken.
    pub fn set_priority(&self, p: Priority) {
        self.header().priority.store(p.0, Ordering::Relaxed);
    }

    /// Interrupts the fiber's current or next interruptible wait: marks an
    /// interrupt pending, then wakes the fiber as [`wake`](Waiter::wake)
    /// does (a spurious wakeup for a wait that is not interruptible, which
    /// sleeps again). The fiber takes the mark with [`take_interrupt`];
    /// `spindle-sync`'s interruptible waits (`acquire_interruptible`,
    /// `pop_interruptible`) do, and return an error instead of waiting on.
    /// A mark nobody takes stays pending until the fiber is given a new
    /// function (or something that owns the mark clears it, as
    /// `spindle-executor`'s `interrupt_after` does when its deadline fired).
    ///
    /// ```
    /// use spindle_fiber::{take_interrupt, yield_now, Fiber, FiberAttr, Priority, RunOutcome, Waiter};
    ///
    /// let fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// fiber.set_function(Priority::NORMAL, || {
    ///     let me = Waiter::current().unwrap();
    ///     me.interrupt(); // running: only the mark stays
    ///     yield_now();
    ///     take_interrupt()
    /// }).unwrap();
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Yielded(_))));
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Returned(true))));
    /// ```
    ///
    /// A waiter kept past the function it was made for (the fiber was
    /// given a new function since, as an executor does when it reuses a
    /// fiber) interrupts nothing and does not wake it.
    pub fn interrupt(self) {
        if mark_interrupt(self.header(), Some(self.generation)) || self.is_current_generation() {
            self.wake();
        }
    }

    fn is_current_generation(&self) -> bool {
        self.header().interrupt.load(Ordering::Acquire) >> 1 == self.generation
    }

    /// A waiter made from a reference the caller already owns.
    ///
    /// # Safety
    /// `header` is a live fiber's header and the caller hands over one
    /// counted reference to it.
    pub(crate) unsafe fn from_owned(header: NonNull<Header>) -> Waiter {
        // SAFETY: the caller's contract.
        let generation = unsafe { header.as_ref() }.interrupt.load(Ordering::Acquire) >> 1;
        Waiter { header, generation }
    }

    /// Wakes the fiber (waker step 3 of the protocol). Never blocks on
    /// another thread, allocates nothing itself (the scheduler it hands the
    /// fiber to may: `spindle-run-queue` grows a priority level's buffer on
    /// its first use; and a refused wake, once a scheduler has shut down,
    /// may allocate this thread's list of deferred releases, see
    /// [`defer_releases`]), never panics. A wake that finds the
    /// fiber neither sleeping nor running (it was queued or made ready by
    /// another wake, or finished) is void. A stale waiter (a second waiter
    /// of one sleep, or one kept after the fiber moved on) that finds it
    /// sleeping or running ends its current or next sleep: a spurious
    /// wakeup, so code that sleeps checks its condition again. If this was
    /// the last reference to a suspended fiber, dropping it unwinds the
    /// fiber here, as dropping any last reference does.
    ///
    /// A wake the fiber's scheduler refuses (it has shut down) leaves the
    /// fiber `Ready`, in no queue, after the hook of the wait it is in
    /// ([`WaitHook`]) took back whatever a primitive handed it there. A
    /// waker that handed the fiber something uses
    /// [`try_wake`](Waiter::try_wake) instead, to hand it on from there.
    pub fn wake(self) {
        // A refusal is dropped: the fiber becomes `Ready`. Nothing was
        // handed over, so a fiber refused before is left as it is.
        let _ = self.wake_as(false);
    }

    /// Wakes the fiber as [`wake`](Waiter::wake) does, and says whether its
    /// scheduler refused it ([`Schedule::schedule`] returned it: the
    /// scheduler has shut down, so the fiber will not run from there).
    /// For wakers that handed the fiber something (a token, a message).
    ///
    /// [`Schedule::schedule`]: crate::Schedule::schedule
    ///
    /// # Errors
    ///
    /// [`RefusedWake`] if the scheduler refused the fiber. The fiber has
    /// been held since this wake took it out of its sleep, and stays held
    /// until that is let go of (its state reads `Locked`): no thread has
    /// run it or can, or unwind its stack. Letting go
    /// ([`RefusedWake::take_back`], or dropping it) runs the hook of the
    /// wait the fiber is in, which takes back what its primitive handed the
    /// fiber there and hands it on; the fiber is left `Ready`, in no
    /// queue, and, run again, finds nothing handed over and waits again.
    ///
    /// A fiber whose scheduler refused an earlier wake (a stale `Waiter`'s,
    /// an interrupt's) is already `Ready` in no queue, maybe still in its
    /// wait. This wake then finds it so, holds it, and returns a
    /// `RefusedWake` without asking the scheduler again; that lasts until
    /// the fiber is queued again ([`Fiber::mark_queued`](crate::Fiber::mark_queued))
    /// or given another home ([`Fiber::set_home`](crate::Fiber::set_home)).
    /// While this holds it, a
    /// `run` of it through a handle of its own fails with
    /// [`FiberError::Running`](crate::FiberError::Running). A wake that
    /// finds the fiber held by someone else returns `Ok`: whoever holds it
    /// queues it (it then runs and finds the value) or lets go of it
    /// through the same hook.
    pub fn try_wake(self) -> Result<(), RefusedWake> {
        self.wake_as(true)
    }

    /// Waker step 3. `take_back`: the caller handed the fiber something
    /// and takes it back from a refused fiber (see `try_wake`).
    #[inline(always)]
    fn wake_as(self, take_back: bool) -> Result<(), RefusedWake> {
        let h = self.header;
        std::mem::forget(self);
        // SAFETY: we own one reference, which is handed on (or comes back
        // on a refusal).
        unsafe {
            match h.as_ref().state.transition_to_woken() {
                WakeTransition::Owned => {
                    if (h.as_ref().vtable.finish_wake)(h) {
                        return Err(RefusedWake {
                            header: h,
                            held: true,
                        });
                    }
                }
                WakeTransition::Void if take_back && h.as_ref().home_refused.load(Ordering::Relaxed) => {
                    return wake_refused_before(h);
                }
                WakeTransition::Deferred | WakeTransition::Void => (h.as_ref().vtable.release)(h),
            }
        }
        Ok(())
    }
}

/// `try_wake` of a fiber whose home refused a wake of it before: the fiber
/// was found `Ready` (or in another state in which a wake is void) with
/// the mark set. A `Ready` fiber is held and the wake refused, as its home
/// would refuse it; if the fiber went back to sleep or runs meanwhile
/// (a handle of its own ran it), the wake is made again.
///
/// # Safety
/// The caller hands over one counted reference to the fiber.
#[cold]
#[inline(never)]
unsafe fn wake_refused_before(h: NonNull<Header>) -> Result<(), RefusedWake> {
    // SAFETY: the caller's reference keeps the header alive.
    let header = unsafe { h.as_ref() };
    match header.state.transition(FiberState::Ready, FiberState::Locked) {
        // Held: the mark is written only under the hold, so this reading
        // is exact. Cleared meanwhile (a new home, then dequeued): void.
        Ok(()) if header.home_refused.load(Ordering::Relaxed) => {
            return Err(RefusedWake {
                header: h,
                held: true,
            })
        }
        Ok(()) => header.state.store(FiberState::Ready),
        Err(FiberState::Sleeping | FiberState::Running) => {
            // SAFETY: the caller's reference goes to the waiter.
            return unsafe { Waiter::from_owned(h) }.wake_as(true);
        }
        Err(_) => {}
    }
    // SAFETY: the caller's reference.
    unsafe { (header.vtable.release)(h) };
    Ok(())
}

/// A wake that the fiber's scheduler refused for good (see
/// [`Waiter::try_wake`]). While it is held, the fiber is `Locked`, so
/// nothing runs it or unwinds it. Letting go of it
/// ([`take_back`](RefusedWake::take_back), or dropping it) runs the hook of
/// the wait the fiber is in, if that wait set one ([`WaitHook`]), which
/// takes back what its primitive handed the fiber and hands it on; the
/// fiber becomes `Ready`, in no queue (later value-handing wakes of it are
/// refused too, until it is queued again or given another home). Dropping
/// it then wakes whoever the value went on to, and only after that drops
/// the reference it holds (a last reference unwinds or leaks the fiber, as
/// any last reference does): a destructor on the fiber's stack that waits
/// for the value just handed on finds its waiter already woken.
///
/// Forgetting it (`mem::forget`) leaves the fiber held for good.
pub struct RefusedWake {
    header: NonNull<Header>,
    /// The fiber is still held (`Locked`): not let go of yet.
    held: bool,
}

// SAFETY: as for `Waiter`: a counted reference, used only through the
// header's atomics and the state machine.
unsafe impl Send for RefusedWake {}
// SAFETY: `&RefusedWake` only reads immutable header fields.
unsafe impl Sync for RefusedWake {}

impl RefusedWake {
    /// The fiber's id.
    pub fn id(&self) -> FiberId {
        // SAFETY: we own a reference.
        unsafe { self.header.as_ref() }.id
    }

    /// Lets go of the fiber through its wait's hook, as dropping this does,
    /// but returns the waiter of the fiber the hook handed the value on to
    /// instead of waking it: a waker that loops over refusals
    /// (`try_wake`, then `take_back` of each refusal) needs no recursion,
    /// however many refused fibers wait in a row. `None` if nothing was
    /// handed on, or if it was let go of already (a second call).
    ///
    /// The refusal keeps its reference to the fiber until it is dropped.
    /// Drop it only after waking the returned waiter (and those after it,
    /// in such a loop): if this is the fiber's last reference, the drop
    /// unwinds the fiber's stack on this thread, and a destructor there
    /// that waits for the value just handed on would wait for ever.
    ///
    /// ```
    /// # use spindle_fiber::{RefusedWake, Waiter};
    /// /// Wakes `first`, and whoever a refusal hands the value on to.
    /// fn wake_all_the_way(first: Waiter) {
    ///     let mut refused: Vec<RefusedWake> = Vec::new();
    ///     let mut next = Some(first);
    ///     while let Some(w) = next {
    ///         next = match w.try_wake() {
    ///             Ok(()) => None,
    ///             Err(mut r) => {
    ///                 let n = r.take_back();
    ///                 refused.push(r);
    ///                 n
    ///             }
    ///         };
    ///     }
    ///     drop(refused); // every waiter is woken: release the fibers now
    /// }
    /// ```
    #[must_use = "the fiber the value went on to sleeps until woken"]
    pub fn take_back(&mut self) -> Option<Waiter> {
        if !std::mem::replace(&mut self.held, false) {
            return None;
        }
        // SAFETY: we own a reference and held the state `Locked`; `held`
        // is cleared, so this is the one let-go.
        unsafe { let_go_refused(self.header) }
    }
}

impl Drop for RefusedWake {
    // Out of line: wakers drop refusals on their common path's cold side.
    #[cold]
    #[inline(never)]
    fn drop(&mut self) {
        /// Drops the refusal's reference when the chain is woken, or if a
        /// wake in it panics.
        struct Release(NonNull<Header>);
        impl Drop for Release {
            fn drop(&mut self) {
                // SAFETY: the refusal's reference, given up once, here.
                unsafe { (self.0.as_ref().vtable.release)(self.0) };
            }
        }
        // Let go and wake whoever the value went on to before the fiber
        // is released: a last reference's release unwinds the fiber here,
        // and a destructor on its stack may wait for that very value
        // (found in review: it waited for a wake this drop had not made
        // yet). Inside the scope, every release waits for the chain.
        let next = self.take_back();
        let release = Release(self.header);
        defer_releases(move || {
            let _release = release;
            wake_handing_over(next);
        });
    }
}

impl std::fmt::Debug for RefusedWake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: we own a reference.
        let h = unsafe { self.header.as_ref() };
        f.debug_struct("RefusedWake")
            .field("fiber", &h.id)
            .field("name", &h.name)
            .finish()
    }
}

/// What happened and what comes next:
///
/// ```
/// # use spindle_fiber::RefusedWake;
/// fn assert_error<E: std::error::Error + Send + Sync + 'static>() {}
/// assert_error::<RefusedWake>();
/// ```
impl std::fmt::Display for RefusedWake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: we own a reference.
        let h = unsafe { self.header.as_ref() };
        write!(f, "the scheduler of fiber {}", h.id)?;
        if let Some(name) = &h.name {
            write!(f, " ('{name}')")?;
        }
        f.write_str(
            " refused its wake for good (it has shut down): letting go of this refusal (drop it, or \
             take_back) hands what the wait was given to the next waiter and leaves the fiber Ready \
             in no queue",
        )
    }
}

impl std::error::Error for RefusedWake {}

/// Wakes `next` for a value handed to it, and whoever the value goes on to
/// after each refusal, in a loop; fibers whose last reference goes meanwhile
/// (a refused one, a woken one nobody holds) are released only once the
/// last waiter is woken ([`defer_releases`]).
pub(crate) fn wake_handing_over(mut next: Option<Waiter>) {
    if next.is_none() {
        return;
    }
    defer_releases(|| {
        while let Some(w) = next.take() {
            next = match w.try_wake() {
                Ok(()) => None,
                // Dropped here, its release deferred to the scope's end.
                Err(mut r) => r.take_back(),
            };
        }
    });
}

/// Lets go of a held fiber whose home refused it (or that is marked
/// `home_refused`): stores `Ready`, through the hook of the wait it is in if
/// it set one, which takes back what was handed to it there. Returns the
/// waiter of the fiber the value went on to, to be woken the same way.
///
/// # Safety
/// The caller holds the fiber's state `Locked` and a counted reference.
pub(crate) unsafe fn let_go_refused(h: NonNull<Header>) -> Option<Waiter> {
    // SAFETY: the caller's reference.
    let header = unsafe { h.as_ref() };
    // Written by the fiber before it went to sleep; ordered before this by
    // the state store that let the hold be taken.
    let Some(hook) = NonNull::new(header.wait_hook.load(Ordering::Relaxed)) else {
        header.state.store(FiberState::Ready);
        return None;
    };
    let mut let_go_done = false;
    let mut let_go = || {
        header.state.store(FiberState::Ready);
        let_go_done = true;
    };
    // SAFETY: the fiber is held, so it is suspended in the wait that set
    // the hook (it clears the hook before it leaves), whose frame keeps the
    // hook alive (`WaitToken::enter_wait`'s contract).
    let next = unsafe { (hook.as_ref().take_back)(hook, &mut let_go) };
    if !let_go_done {
        header.state.store(FiberState::Ready);
    }
    next
}

/// How a primitive takes back what it handed to a fiber in the fiber's
/// current wait, once the fiber's scheduler has refused it for good (see
/// [`Waiter::try_wake`]): a fiber that will never run from its scheduler
/// must not keep a token or message that a waiter behind it could take.
///
/// A fiber that waits sets one for the wait
/// ([`WaitToken::enter_wait`]), in the wait's frame, and clears it on every
/// way out ([`WaitToken::leave_wait`]). Whoever lets go of the fiber while
/// holding it after a refusal (a [`RefusedWake`], the runner that finishes
/// a deferred wake, a handle whose call found the fiber marked refused)
/// calls `take_back` with the fiber still held and a `let_go` closure that
/// makes it `Ready`.
///
/// `take_back` must, under the lock the primitive hands values over
/// under: take back the value if one was handed to the fiber in this wait
/// (and hand it on to the next waiter, or keep it), call `let_go` exactly
/// once, and then, after unlocking, unpark a thread it handed the value to
/// or return the waiter of a fiber it handed it to (the caller wakes it,
/// and takes back from it the same way if it is refused too). It must not
/// block on anything but that lock, nor panic. Calling `let_go` under the
/// lock is what closes the race with a hand-over that comes meanwhile: a
/// waker that hands the fiber a value before it finds the value here; one
/// that comes after finds the fiber `Ready` and marked refused, and its
/// [`try_wake`](Waiter::try_wake) is refused in turn.
#[repr(C)]
pub struct WaitHook {
    take_back: unsafe fn(NonNull<WaitHook>, &mut dyn FnMut()) -> Option<Waiter>,
}

impl WaitHook {
    /// A hook that runs `take_back` (its contract is on [`WaitHook`]).
    /// `take_back` gets a pointer to this hook: embed it first in a
    /// `#[repr(C)]` struct of the primitive's to reach the rest, and make
    /// the pointer given to [`WaitToken::enter_wait`] from the whole
    /// struct (`NonNull::from(&whole).cast::<WaitHook>()`): one made from a
    /// reference to the hook field alone may not reach the other fields.
    pub const fn new(
        take_back: unsafe fn(NonNull<WaitHook>, &mut dyn FnMut()) -> Option<Waiter>,
    ) -> WaitHook {
        WaitHook { take_back }
    }
}

impl std::fmt::Debug for WaitHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitHook").finish_non_exhaustive()
    }
}

/// The fiber a [`Waiter`] wakes, for setting its [`WaitHook`] from the
/// fiber's own stack without a thread-local lookup. Taken by the fiber
/// from a `Waiter` it made (`spindle-sync`'s waits keep one in their
/// frame).
///
/// It only names a fiber (it holds no reference: the `Waiter` it came
/// from does), and what it does is `unsafe` and bound to the fiber's own
/// stack, whatever thread that runs on. So it is `Send` and `Sync`: a
/// migratable fiber may keep one across a suspension
/// ([`Fiber::set_function_migratable`](crate::Fiber::set_function_migratable)).
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<spindle_fiber::WaitToken>();
/// ```
#[derive(Clone, Copy, Debug)]
pub struct WaitToken {
    header: NonNull<Header>,
}

// SAFETY: a WaitToken is a name; its only operations are unsafe, with
// contracts that bind them to the fiber's own stack.
unsafe impl Send for WaitToken {}
// SAFETY: as above (it has no `&self` operation).
unsafe impl Sync for WaitToken {}

impl Waiter {
    /// A token of the fiber this waiter wakes (see [`WaitToken`]).
    pub fn wait_token(&self) -> WaitToken {
        WaitToken { header: self.header }
    }
}

impl WaitToken {
    /// Sets the hook of the wait the fiber enters (see [`WaitHook`]).
    ///
    /// # Safety
    ///
    /// - The fiber is alive and this runs on its stack (it is the current
    ///   fiber: only the fiber writes its hook).
    /// - `hook` stays valid and in place until
    ///   [`leave_wait`](WaitToken::leave_wait), which the fiber calls on
    ///   every way out of the wait, unwinding included, before the hook
    ///   goes away and before it can wait anywhere else.
    /// - The hook's `take_back` keeps [`WaitHook`]'s contract: `let_go`
    ///   exactly once, under the primitive's lock, no panic, no blocking on
    ///   anything but that lock. A second `let_go` could let two runners
    ///   claim the fiber.
    /// - The hook, and everything `take_back` reaches through it, may be
    ///   used from another thread (whoever lets go of the fiber) while the
    ///   fiber is held.
    #[inline]
    pub unsafe fn enter_wait(self, hook: NonNull<WaitHook>) {
        // SAFETY: the caller's contract.
        unsafe { self.header.as_ref() }
            .wait_hook
            .store(hook.as_ptr(), Ordering::Relaxed);
    }

    /// Clears the hook set by [`enter_wait`](WaitToken::enter_wait).
    ///
    /// # Safety
    ///
    /// As for `enter_wait`: the fiber is alive and this runs on its stack.
    #[inline]
    pub unsafe fn leave_wait(self) {
        // SAFETY: the caller's contract.
        unsafe { self.header.as_ref() }
            .wait_hook
            .store(std::ptr::null_mut(), Ordering::Relaxed);
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        // SAFETY: we own one reference.
        unsafe { (self.header.as_ref().vtable.release)(self.header) }
    }
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("fiber", &self.header().id)
            .field("name", &self.header().name)
            .finish()
    }
}

/// Puts the current fiber to sleep: `run` returns [`RunOutcome::Slept`]
/// and the fiber stays asleep until a [`Waiter`] for it is woken.
///
/// Call it after publishing `Waiter::current()` where a waker will find it;
/// a fiber that sleeps with no waiter published sleeps forever.
///
/// # Panics
///
/// On an ordinary thread (there is nothing to put to sleep: threads wait
/// with their own primitives); in a fiber whose function is over (from a
/// destructor of its return value); in a destructor run while a dropped
/// fiber's stack is unwound ([`may_sleep`] is false there, and the process
/// then aborts: a panic in a destructor during an unwind).
///
/// [`RunOutcome::Slept`]: crate::RunOutcome::Slept
#[track_caller]
#[inline]
pub fn sleep() {
    static UNSPECIFIED: WaitReason = WaitReason("a waiter");
    sleep_on(&UNSPECIFIED)
}

/// Like [`sleep`], recording what the fiber waits on and the caller's
/// location, which [`Fiber::wait_site`](crate::Fiber::wait_site) reports.
///
/// # Panics
///
/// As [`sleep`].
#[track_caller]
#[inline]
pub fn sleep_on(reason: &'static WaitReason) {
    let h = current_header();
    assert!(
        !h.is_null(),
        "spindle_fiber::sleep called outside a fiber: a thread has nothing to put to sleep; wait \
         with a thread primitive (spindle-sync's types block a thread instead), or check in_fiber()"
    );
    // SAFETY: as in `yield_value`.
    let hr = unsafe { &*h };
    hr.wait_reason
        .store(reason as *const WaitReason as *mut WaitReason, Ordering::Release);
    hr.wait_location.store(
        Location::caller() as *const Location<'static> as *mut _,
        Ordering::Release,
    );
    let mut yielder = hr.yielder.load(Ordering::Relaxed) as *const Yielder;
    if yielder.is_null() {
        yielder = sleep_without_yielder(hr);
    }
    hr.sleep_request.store(true, Ordering::Relaxed);
    // A sleep inside a destructor during an unwind: if the fiber is dropped
    // before it wakes, it cannot be unwound (see `release`).
    let panicking = std::thread::panicking();
    hr.slept_panicking.store(panicking, Ordering::Relaxed);
    if !panicking && hr.panicked_on.load(Ordering::Relaxed) != 0 {
        // Not inside a panic's unwind, whatever began before: a panic the
        // function caught is over (see `Header::panicked_on`).
        hr.panicked_on.store(0, Ordering::Relaxed);
    }
    // SAFETY: as in `yield_value`.
    unsafe { (*yielder).suspend(crate::fiber::SLEEP_SIGNAL) };
}

/// Interrupter step 1 (DESIGN.md, "Interruptible waits"): marks an
/// interrupt pending, then a SeqCst fence, before the caller's wake looks
/// at the fiber's state.
///
/// The wake may find the fiber queued or ready (another wake came first)
/// and do nothing; the fiber then runs again and must see the mark. That
/// is a store-buffering pattern (here: mark, then load the state; there:
/// the runner's store of `Running`, then the fiber's load of the mark), so
/// both sides fence: either this load sees `Running` or a later state (and
/// the wake is deferred to, or reaches, a sleep that comes after it), or
/// the fiber's check after its fence sees the mark.
///
/// `generation`: mark only that function's run (`None`: whatever runs now).
/// Returns whether the mark is new.
pub(crate) fn mark_interrupt(h: &Header, generation: Option<u64>) -> bool {
    let mut cur = h.interrupt.load(Ordering::Relaxed);
    let new = loop {
        if generation.is_some_and(|g| cur >> 1 != g) || cur & 1 == 1 {
            break false;
        }
        match h
            .interrupt
            .compare_exchange_weak(cur, cur | 1, Ordering::Release, Ordering::Relaxed)
        {
            Ok(_) => break true,
            Err(actual) => cur = actual,
        }
    };
    std::sync::atomic::fence(Ordering::SeqCst);
    new
}

/// Takes the calling fiber's pending interrupt ([`Waiter::interrupt`],
/// [`Fiber::interrupt`](crate::Fiber::interrupt)): whether there was one.
/// `false` on an ordinary thread.
pub fn take_interrupt() -> bool {
    let h = current_header();
    // SAFETY: see `current`.
    let Some(h) = (unsafe { h.as_ref() }) else {
        return false;
    };
    // Pairs with the fence in `mark_interrupt` (see there).
    std::sync::atomic::fence(Ordering::SeqCst);
    // A plain load first: no locked instruction when none is pending.
    h.interrupt.load(Ordering::Acquire) & 1 == 1 && h.interrupt.fetch_and(!1, Ordering::Acquire) & 1 == 1
}

/// The scheduler word of the fiber running on this thread (see
/// [`Fiber::set_sched_data`](crate::Fiber::set_sched_data)), or `None` on an
/// ordinary thread.
pub fn current_sched_data() -> Option<usize> {
    let h = current_header();
    // SAFETY: see `current`.
    unsafe { h.as_ref() }.map(|h| h.sched_data.load(Ordering::Acquire))
}
