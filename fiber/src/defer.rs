//! Deferred releases: while [`defer_releases`] runs on a thread, a fiber
//! whose last reference is dropped there is not unwound or freed at once;
//! the thread does it when the scope ends, in the order they came.
//!
//! Dropping a fiber's last reference can run arbitrary code: a suspended
//! fiber's stack is unwound there and then, and its destructors may wait
//! for something. A waker that wakes several fibers, or a scheduler that
//! lets go of several, can drop such a reference in the middle of its
//! work; a destructor that waits for what the rest of that work hands out
//! then waits for ever (found in review: a semaphore's `release(n)`, a run
//! queue's drop, a chain of refused wakes, an executor's final drain).
//! Inside a scope, the work finishes first.

use std::cell::Cell;
use std::collections::VecDeque;
use std::ptr::NonNull;

use crate::header::Header;

/// A release deferred: the fiber's header and what finishes its release.
type Deferred = (NonNull<Header>, unsafe fn(NonNull<Header>));

/// This thread's scopes: how deep, and what waits for the outermost end
/// (null while nothing does: the list is allocated when a scope first
/// defers something and freed when the outermost end has released it).
///
/// Nothing here has a destructor, so the thread-local has none either and
/// stays usable while the thread's other thread-locals are destroyed: a
/// queue or semaphore dropped by a thread-local destructor still gets its
/// scope (found in review: with a list that had a destructor, registered
/// after the user's thread-locals and so destroyed before them, every scope
/// opened during the thread's exit was silently off, and the hangs it
/// prevents came back).
struct Scopes {
    depth: Cell<usize>,
    deferred: Cell<*mut VecDeque<Deferred>>,
}

#[cfg(not(loom))]
std::thread_local! {
    static SCOPES: Scopes = const { Scopes { depth: Cell::new(0), deferred: Cell::new(std::ptr::null_mut()) } };
}

// Under loom, each model thread has its own (loom runs them all on one OS
// thread).
#[cfg(loom)]
loom::thread_local! {
    static SCOPES: Scopes = Scopes { depth: Cell::new(0), deferred: Cell::new(std::ptr::null_mut()) };
}

/// Runs `f`; a fiber whose last reference is dropped on this thread while
/// `f` runs is released (its suspended stack unwound, its memory freed)
/// only after `f` has returned or unwound, in the order the references
/// were dropped. Scopes nest: the outermost one releases. A release may
/// open a scope of its own (a destructor on the released fiber's stack
/// that releases semaphore tokens, say): that one is outermost again, and
/// releases what it deferred itself before the next fiber of the outer
/// list is released.
///
/// If `f` panics, the deferred fibers are released while the thread
/// unwinds, as fibers in a `Vec` dropped by the panic would be: a
/// destructor on such a fiber's stack that suspends then aborts the process
/// (see [`yield_value`](crate::yield_value)), where it would not have
/// without the scope.
///
/// For code that wakes or lets go of several fibers in a row (a
/// synchronisation primitive's release of many tokens, a scheduler that
/// shuts down): a wake can drop a fiber's last reference, and its
/// destructors, run there, may wait for what the rest of the loop hands
/// out. Inside a scope they run once everything is handed out.
///
/// `f` must not suspend the calling fiber (yield, sleep, or wait on a
/// primitive): the scope belongs to the thread, so a fiber that suspends
/// inside it leaves the thread deferring its releases until the fiber
/// comes back, and if it never does (dropped while suspended there: its
/// own release is then deferred behind its own scope) the thread's scope
/// count stays raised for good, as below. If the fiber comes back on another thread, the first
/// thread's scope count stays raised for good: every fiber whose last
/// reference is dropped there from then on is deferred and never unwound
/// or freed (leaked, also when the thread exits); the second thread's
/// scope count is not touched. Nothing is unsound either way; releases
/// are late, or leak.
///
/// ```
/// use spindle_fiber::{defer_releases, yield_now, Fiber, FiberAttr, Priority};
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
///
/// struct SetOnDrop(Arc<AtomicBool>);
/// impl Drop for SetOnDrop {
///     fn drop(&mut self) { self.0.store(true, Ordering::SeqCst) }
/// }
///
/// let dropped = Arc::new(AtomicBool::new(false));
/// let fiber = Fiber::new(FiberAttr::new()).unwrap();
/// let d = SetOnDrop(dropped.clone());
/// fiber.set_function(Priority::NORMAL, move || { let _d = d; yield_now() }).unwrap();
/// fiber.run().unwrap();
/// defer_releases(|| {
///     drop(fiber); // the last reference: its stack would be unwound here
///     assert!(!dropped.load(Ordering::SeqCst));
/// });
/// assert!(dropped.load(Ordering::SeqCst)); // unwound when the scope ended
/// ```
pub fn defer_releases<R>(f: impl FnOnce() -> R) -> R {
    /// Ends the scope, on return or unwind.
    struct End {
        thread: u64,
    }
    impl Drop for End {
        fn drop(&mut self) {
            if crate::tls::thread_id_word() != self.thread {
                // `f` suspended and came back elsewhere: this thread's
                // count is not ours to lower (see above).
                return;
            }
            if leave_scope() {
                release_deferred();
            }
        }
    }
    let thread = crate::current::thread_id();
    let _end = enter_scope().then(|| End { thread });
    f()
}

// The scope count is read and written only in these out-of-line functions,
// which do not suspend: `f` may (against the contract) suspend and come
// back on another thread, and a thread-local's address that the compiler
// kept across that would be the first thread's (llvm/llvm-project#98479;
// see tls.rs).

/// Opens a scope on this thread; false if the thread-local is gone.
#[inline(never)]
fn enter_scope() -> bool {
    SCOPES.try_with(|s| s.depth.set(s.depth.get() + 1)).is_ok()
}

/// Closes a scope on this thread; true if it was the outermost.
#[inline(never)]
fn leave_scope() -> bool {
    SCOPES
        .try_with(|s| {
            let depth = s.depth.get() - 1;
            s.depth.set(depth);
            depth == 0
        })
        .unwrap_or(false)
}

/// Releases what the outermost scope deferred, in order. The list is taken
/// out first: a release that opens a scope of its own (a destructor that
/// releases semaphore tokens, say) ends that scope with only what it
/// deferred itself, not the rest of this list, so releases do not nest on
/// the stack however many there are (found in review: a thousand queued
/// fibers whose captures released two tokens each overflowed the thread's
/// stack, and one whose destructor waited for a later one's hung).
#[inline(never)] // as `enter_scope`: it reads the thread-local
fn release_deferred() {
    /// The taken list: its rest is released if a release unwinds (as a
    /// `Vec` of fibers dropped during a panic would be); then it is freed.
    struct Taken(VecDeque<Deferred>);
    impl Drop for Taken {
        fn drop(&mut self) {
            while let Some((h, finish)) = self.0.pop_front() {
                // SAFETY: `defer_last` took the last reference's place for it.
                unsafe { finish(h) };
            }
        }
    }
    let Ok(list) = SCOPES.try_with(|s| s.deferred.replace(std::ptr::null_mut())) else {
        return;
    };
    if list.is_null() {
        return;
    }
    // SAFETY: made by `Box::into_raw` in `defer_last`, and taken out of the
    // thread-local just now, so owned here alone.
    let mut taken = Taken(*unsafe { Box::from_raw(list) });
    while let Some((h, finish)) = taken.0.pop_front() {
        // SAFETY: `defer_last` took the last reference's place for it.
        unsafe { finish(h) };
    }
}

/// Called by `release` on the last reference: keeps it for the end of the
/// scope if one is open on this thread (true), else false (release now).
///
/// Whoever calls this with `true` returned has handed over the last
/// reference's work: `finish(h)` runs it later, on this thread.
///
/// Out of line, as the scope functions above: `release` is generic, so it
/// is compiled into callers (a fiber's code among them) that may suspend
/// and come back on another thread, and an inlined thread-local access
/// there could use the first thread's address.
#[inline(never)]
pub(crate) fn defer_last(h: NonNull<Header>, finish: unsafe fn(NonNull<Header>)) -> bool {
    // The common case (no scope open) reads one word.
    if SCOPES.try_with(|s| s.depth.get()).unwrap_or(0) == 0 {
        return false;
    }
    defer_last_slow(h, finish);
    true
}

/// [`defer_last`] with a scope open (just checked, on this thread):
/// queues the release, allocating the list on the scope's first one.
#[cold]
#[inline(never)]
fn defer_last_slow(h: NonNull<Header>, finish: unsafe fn(NonNull<Header>)) {
    // Reachable: `defer_last` has just read it on this thread.
    let _ = SCOPES.try_with(|s| {
        let mut list = s.deferred.get();
        if list.is_null() {
            list = Box::into_raw(Box::default());
            s.deferred.set(list);
        }
        // SAFETY: the thread's own list, reached only through this
        // thread-local and never while another access holds it.
        unsafe { (*list).push_back((h, finish)) };
    });
}
