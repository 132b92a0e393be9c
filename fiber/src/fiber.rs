//! The fiber object: create, set a function, run to the next suspension,
//! reuse after return.

use std::any::Any;
use std::cell::UnsafeCell;
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::panic::Location;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use corosensei::{Coroutine, CoroutineResult};

use crate::current::{enter, enter_on_thread, exit, thread_id, ThreadToken};
use crate::error::FiberError;
use crate::header::{Counters, FiberId, FiberStats, Header, VTable};
use crate::stack::{FiberStack, StackPool, DEFAULT_STACK_SIZE};
use crate::state::{FiberState, SleepTransition, StateCell};
use crate::Priority;

/// What a fiber hands its runner when it suspends: the yielded value, so
/// that it travels in a register across the switch. A sleep suspends with
/// `SLEEP_SIGNAL` and sets the header's `sleep_request` flag: the runner
/// reads the flag only when it sees that value (a plain yield of it is
/// still a yield), so the common case tests a register, not memory.
pub(crate) type Yielder = corosensei::Yielder<(), usize>;
/// The value a sleeping fiber suspends with (see [`Yielder`]).
pub(crate) const SLEEP_SIGNAL: usize = usize::MAX - 0x51ee;
/// The coroutine returns the function's value, or the payload of a panic
/// caught at the fiber's root.
type Coro<T> = Coroutine<(), usize, std::thread::Result<T>, FiberStack>;

/// Creation attributes of a fiber.
///
/// ```
/// use spindle_fiber::{Fiber, FiberAttr};
/// let fiber = Fiber::<()>::new(FiberAttr::new().stack_size(64 * 1024).name("io")).unwrap();
/// assert_eq!(fiber.name(), Some("io"));
/// assert_eq!(fiber.stack_size(), 64 * 1024);
/// ```
#[derive(Clone)]
pub struct FiberAttr {
    stack_size: usize,
    name: Option<Arc<str>>,
    pool: &'static StackPool,
}

impl FiberAttr {
    /// Defaults: 128 KiB usable stack, no name, the global stack pool.
    pub fn new() -> FiberAttr {
        FiberAttr {
            stack_size: DEFAULT_STACK_SIZE,
            name: None,
            pool: StackPool::global(),
        }
    }

    /// Usable stack bytes (rounded up to whole pages); the guard page is extra.
    ///
    /// Anything from [`MIN_STACK_SIZE`](crate::MIN_STACK_SIZE) to
    /// [`MAX_STACK_SIZE`](crate::MAX_STACK_SIZE) is accepted ([`Fiber::new`]
    /// refuses the rest), but std's panic machinery alone needs about 8 KiB (32 KiB
    /// when `RUST_BACKTRACE` is set): a fiber that may panic, format or
    /// call deep library code wants more. So does a closure with captures
    /// of a few hundred bytes on the smallest stacks: up to 256 bytes it
    /// is kept on the fiber's stack (larger ones are boxed), and a debug
    /// build copies it there more than once. Overflowing aborts the process
    /// with a report naming the fiber.
    #[must_use = "FiberAttr is a builder: pass the returned value to Fiber::new"]
    pub fn stack_size(mut self, bytes: usize) -> FiberAttr {
        self.stack_size = bytes;
        self
    }

    /// A name shown in `Debug`, panic reports and the stack overflow report.
    #[must_use = "FiberAttr is a builder: pass the returned value to Fiber::new"]
    pub fn name(mut self, name: impl Into<Arc<str>>) -> FiberAttr {
        self.name = Some(name.into());
        self
    }

    /// The pool the stack is taken from and returned to.
    #[must_use = "FiberAttr is a builder: pass the returned value to Fiber::new"]
    pub fn pool(mut self, pool: &'static StackPool) -> FiberAttr {
        self.pool = pool;
        self
    }
}

impl Default for FiberAttr {
    fn default() -> FiberAttr {
        FiberAttr::new()
    }
}

impl fmt::Debug for FiberAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FiberAttr")
            .field("stack_size", &self.stack_size)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A panic that escaped a fiber's function, with the fiber it came from.
pub struct Panic {
    /// The fiber that panicked.
    pub fiber: FiberId,
    /// Its name, if any.
    pub name: Option<Arc<str>>,
    /// The payload given to `panic!`.
    pub payload: Box<dyn Any + Send>,
}

impl Panic {
    /// The panic message, if the payload is a string.
    pub fn message(&self) -> Option<&str> {
        if let Some(s) = self.payload.downcast_ref::<&'static str>() {
            Some(s)
        } else {
            self.payload.downcast_ref::<String>().map(String::as_str)
        }
    }

    /// Continues the unwind in the caller, as if the panic happened here
    /// (through [`resume_unwind`](crate::resume_unwind), which notes the
    /// unwind in a calling fiber).
    pub fn resume_unwind(self) -> ! {
        crate::report::resume_unwind(self.payload)
    }
}

impl fmt::Debug for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Panic")
            .field("fiber", &self.fiber)
            .field("name", &self.name)
            .field("message", &self.message())
            .finish()
    }
}

/// `fiber 'name' (#id) panicked: message`, as the panic report names the
/// fiber.
///
/// ```
/// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
///
/// let fiber = Fiber::<()>::new(FiberAttr::new().name("worker")).unwrap();
/// fiber.set_function(Priority::NORMAL, || panic!("out of cheese")).unwrap();
/// let RunOutcome::Panicked(p) = fiber.run().unwrap() else { unreachable!() };
/// assert_eq!(p.to_string(), format!("fiber 'worker' ({}) panicked: out of cheese", fiber.id()));
/// let _as_error: Box<dyn std::error::Error> = p; // and an error, for `?`
/// ```
impl fmt::Display for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "fiber '{name}' ({})", self.fiber)?,
            None => write!(f, "fiber {}", self.fiber)?,
        }
        match self.message() {
            Some(m) => write!(f, " panicked: {m}"),
            None => write!(f, " panicked with a payload that is not a string"),
        }
    }
}

/// A panic is an error: `?` carries it into a `Box<dyn Error>`.
impl std::error::Error for Panic {}

/// Why [`Fiber::run`] came back.
#[must_use = "a fiber's outcome says whether it can be run again"]
#[derive(Debug)]
pub enum RunOutcome<T> {
    /// The fiber yielded (with [`yield_value`](crate::yield_value)'s value,
    /// 0 for [`yield_now`](crate::yield_now)); run it again to continue.
    Yielded(usize),
    /// The function returned this value; the fiber may get a new function.
    Returned(T),
    /// The fiber went to sleep on a synchronisation primitive. It is now
    /// owned by that primitive's wait list: whoever wakes it puts it back
    /// on its run queue (or makes it `Ready` if it has none). A wake that
    /// came while it was switching out is finished by `run` itself, so by
    /// the time `Slept` is returned the fiber may already be back in its
    /// queue (or `Ready`).
    Slept,
    /// The function panicked; the fiber may get a new function. Call
    /// [`Panic::resume_unwind`] to propagate it. (Boxed: a `RunOutcome`
    /// stays small, and dropping one that is not a panic is a single test
    /// the compiler can inline into the caller's loop.)
    Panicked(Box<Panic>),
}

impl<T> RunOutcome<T> {
    /// The returned value.
    ///
    /// # Panics
    /// If the fiber did not return (a panic in the fiber is resumed here).
    #[track_caller]
    pub fn unwrap_returned(self) -> T {
        match self {
            RunOutcome::Returned(v) => v,
            RunOutcome::Panicked(p) => p.resume_unwind(),
            RunOutcome::Yielded(v) => panic!("expected the fiber to return, it yielded {v}"),
            RunOutcome::Slept => panic!("expected the fiber to return, it went to sleep"),
        }
    }

    /// Whether the function is suspended part-way rather than over: after
    /// a yield, `run` continues it; after a sleep, a wake makes it
    /// runnable again. Either way it needs no new function.
    pub fn is_suspended(&self) -> bool {
        matches!(self, RunOutcome::Yielded(_) | RunOutcome::Slept)
    }
}

/// Where a woken fiber goes: implemented by run queues and executors.
///
/// This trait is the only coupling between fibers and scheduling. A fiber
/// remembers the scheduler it was last queued on (see
/// [`Fiber::mark_queued`]); when a synchronisation primitive wakes it, it
/// hands itself to that scheduler. A scheduler that takes fibers by value
/// (a push, a pop) can use [`Fiber::mark_queued_mut`] and
/// [`Fiber::mark_dequeued_mut`] instead: the same transitions, without a
/// compare-and-swap when its handle is the fiber's only one.
///
/// A minimal scheduler: a FIFO behind a mutex, which refuses wakes once it
/// is closed.
///
/// ```
/// use std::collections::VecDeque;
/// use std::sync::{Arc, Mutex};
/// use spindle_fiber::{sleep, Fiber, FiberAttr, Priority, RunOutcome, Schedule, Waiter, Woken};
///
/// #[derive(Default)]
/// struct Fifo {
///     queue: Mutex<(VecDeque<Fiber<()>>, bool)>, // (fibers, closed)
/// }
///
/// impl Schedule<()> for Fifo {
///     fn schedule<'w>(&self, woken: Woken<'w, ()>) -> Result<(), Woken<'w, ()>> {
///         let mut q = self.queue.lock().unwrap();
///         if q.1 {
///             return Err(woken); // closed for good: the waker takes back what it handed over
///         }
///         q.0.push_back(woken.into_queued());
///         Ok(())
///     }
/// }
///
/// let fifo = Arc::new(Fifo::default());
/// let home: Arc<dyn Schedule<()>> = fifo.clone();
/// let slot = Arc::new(Mutex::new(None));
/// let fiber = Fiber::new(FiberAttr::new()).unwrap();
/// let s = slot.clone();
/// fiber.set_function(Priority::NORMAL, move || {
///     *s.lock().unwrap() = Waiter::current();
///     sleep();
/// }).unwrap();
/// fiber.mark_queued(Some(&home)).unwrap(); // as a push does: this is its home now
/// fiber.mark_dequeued().unwrap(); // and as a pop does
/// assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
///
/// slot.lock().unwrap().take().unwrap().wake(); // back to its home
/// let woken = fifo.queue.lock().unwrap().0.pop_front().unwrap();
/// woken.mark_dequeued().unwrap();
/// assert!(matches!(woken.run(), Ok(RunOutcome::Returned(()))));
/// ```
///
/// A scheduler is `Send + Sync + 'static`: fibers keep it as their home
/// and wakes call it from any thread, long after whoever queued them:
///
/// ```compile_fail,E0277
/// use spindle_fiber::{Schedule, Woken};
///
/// struct NotSync(std::cell::Cell<u8>);
/// impl Schedule<()> for NotSync {
///     fn schedule<'w>(&self, _fiber: Woken<'w, ()>) -> Result<(), Woken<'w, ()>> { Ok(()) }
/// }
/// ```
///
/// ```compile_fail,E0477
/// use spindle_fiber::{Schedule, Woken};
///
/// struct Borrowing<'a>(&'a u8);
/// impl<'a> Schedule<()> for Borrowing<'a> {
///     fn schedule<'w>(&self, _fiber: Woken<'w, ()>) -> Result<(), Woken<'w, ()>> { Ok(()) }
/// }
/// ```
pub trait Schedule<T>: Send + Sync + 'static {
    /// Takes a woken fiber and makes it runnable: the scheduler queues it
    /// with [`Woken::into_queued`] (which makes it `Queued`; do it under
    /// the lock of the queue it goes into, or before it becomes visible to
    /// whoever pops it). Called from whatever thread woke the fiber: must
    /// not block for long, must not panic (the waker, often a `release` or
    /// `push`, is not prepared for it), and must not drop the fiber on the
    /// floor (a dropped `Woken` leaves the fiber `Ready` in no queue).
    ///
    /// A scheduler that cannot take it, ever again (it has shut down),
    /// refuses: it returns the `Woken` (its lifetime `'w` makes the one
    /// this call was given the only one it can return). The fiber has been
    /// held since the wake took it (its state reads `Locked`), so no one
    /// has run it or can. It is marked refused. Whoever lets go of it (the
    /// waker's [`RefusedWake`](crate::RefusedWake) from
    /// [`Waiter::try_wake`], or the runner for a deferred wake) runs the
    /// hook of the wait it is in ([`WaitHook`](crate::WaitHook)), which
    /// takes back what that wait's primitive handed it (`spindle-sync`
    /// gives a token or message to the next waiter). The fiber then ends up
    /// `Ready` in no queue, and later value-handing wakes that find it so
    /// are refused without calling `schedule`, until it is queued again or
    /// given another home. Refuse only for good: the fiber, when it runs
    /// again, finds nothing handed over and waits again.
    ///
    /// It may be called from inside [`Fiber::run`], on the runner's thread
    /// (a wake that came while the fiber was switching out to sleep is
    /// finished there): queue the fiber, do not run it inline, or `run`
    /// reports [`RunOutcome::Slept`] for a fiber that has run on since. A
    /// refusal there is let go of by the runner, through the fiber's wait
    /// hook ([`WaitHook`](crate::WaitHook)), as a waker would.
    ///
    /// It runs inside the waker's call (a semaphore's `release`, a
    /// channel's `push` or `close`), which has not finished its own work
    /// yet: do not wait in it, in particular not on the primitive that
    /// woke the fiber.
    ///
    /// [`Waiter::try_wake`]: crate::Waiter::try_wake
    ///
    /// # Errors
    ///
    /// The `Woken`, untouched, if this scheduler refuses the fiber for
    /// good.
    fn schedule<'w>(&self, fiber: Woken<'w, T>) -> Result<(), Woken<'w, T>>;
}

/// A woken fiber on its way to its scheduler ([`Schedule::schedule`]).
///
/// The wake holds the fiber exclusively (its state reads `Locked`): nothing
/// can run it, queue it or take it out of a queue until the scheduler
/// queues it ([`into_queued`](Woken::into_queued)) or the wake is refused
/// and let go. Dropping it leaves the fiber `Ready`, in no queue.
///
/// The lifetime `'w` brands one call of `schedule`: it is invariant and
/// chosen by the caller, so a refusal can only hand back the `Woken` that
/// call was given. A scheduler cannot keep one past the call, nor answer a
/// wake with another fiber's `Woken` (or a later one of the same fiber),
/// which would make the waker let go of, and run the wait hook of, a fiber
/// that someone else still holds:
///
/// ```compile_fail,E0521
/// use std::sync::Mutex;
/// use spindle_fiber::{Schedule, Woken};
///
/// struct Swapper(Mutex<Option<Woken<'static, ()>>>);
/// impl Schedule<()> for Swapper {
///     fn schedule<'w>(&self, w: Woken<'w, ()>) -> Result<(), Woken<'w, ()>> {
///         match self.0.lock().unwrap().replace(w) {
///             Some(earlier) => Err(earlier),
///             None => Ok(()),
///         }
///     }
/// }
/// ```
///
/// `Woken` is `Send` and `Sync` where `Fiber` is:
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<spindle_fiber::Woken<'static, String>>();
/// ```
pub struct Woken<'w, T> {
    fiber: ManuallyDrop<Fiber<T>>,
    /// Invariant in `'w`.
    _brand: PhantomData<fn(&'w ()) -> &'w ()>,
}

impl<T> Woken<'_, T> {
    /// The fiber (its id, priority, scheduler word). Everything that
    /// would claim it (`run`, `mark_dequeued`, `set_function`, ...) fails
    /// while the wake holds it.
    pub fn fiber(&self) -> &Fiber<T> {
        &self.fiber
    }

    /// Makes the fiber `Queued` and hands it to the scheduler for its
    /// queue, whose poppers take it out with
    /// [`Fiber::mark_dequeued`].
    pub fn into_queued(self) -> Fiber<T> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: taken once; `me` is not dropped.
        let fiber = unsafe { ManuallyDrop::take(&mut me.fiber) };
        // Queued by its home: not refused (any more).
        fiber.header().home_refused.store(false, Ordering::Relaxed);
        fiber.header().state.store(FiberState::Queued);
        fiber
    }

    /// Gives up the hold without letting go of the reference: the caller
    /// holds the state `Locked` from here on.
    fn into_held(self) -> Fiber<T> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: taken once; `me` is not dropped.
        unsafe { ManuallyDrop::take(&mut me.fiber) }
    }
}

impl<T> Drop for Woken<'_, T> {
    fn drop(&mut self) {
        self.fiber.header().state.store(FiberState::Ready);
        // SAFETY: dropped once, here.
        unsafe { ManuallyDrop::drop(&mut self.fiber) };
    }
}

impl<T> fmt::Debug for Woken<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = self.fiber.header();
        f.debug_struct("Woken")
            .field("fiber", &h.id)
            .field("name", &h.name)
            .finish()
    }
}

/// The typed slot, owned exclusively by whoever holds the fiber's state.
struct Slot<T> {
    /// The current function's coroutine (it owns the stack meanwhile).
    coro: Option<Coro<T>>,
    /// The stack while no function is set.
    stack: Option<FiberStack>,
    /// The scheduler this fiber was last queued on.
    home: Option<Arc<dyn Schedule<T>>>,
    /// May the current function run on another thread than its first?
    migratable: bool,
    /// Thread of the current function's last run (`NO_PIN`: not started).
    /// A pinned fiber's function only ever runs there; whenever it is not
    /// `NO_PIN` it equals the header's `last_thread`.
    pin: u64,
    pool: &'static StackPool,
}

/// The one allocation behind every handle. Counted by hand rather than
/// through `Arc`: when the last reference goes, `release` must unwind a
/// suspended fiber while it still holds a reference (destructors on its
/// stack may take new ones), and only a decrement that returns the old
/// count tells exactly one dropper that it was the last.
#[repr(C)]
struct Inner<T> {
    /// First, so that a `NonNull<Header>` is also the `Inner`'s address.
    header: Header,
    /// Handles (`Fiber`s, `Waiter`s, queue entries). No weak references
    /// are ever made: a count of one held by a `&mut Fiber` is exclusive.
    refs: AtomicUsize,
    slot: UnsafeCell<Slot<T>>,
}

impl<T> Inner<T> {
    /// Takes one more reference.
    ///
    /// # Safety
    /// `ptr` is a live `Inner` the caller holds a reference to.
    #[inline]
    unsafe fn retain(ptr: NonNull<Inner<T>>) {
        // SAFETY: the caller's reference keeps it alive.
        let old = unsafe { ptr.as_ref() }.refs.fetch_add(1, Ordering::Relaxed);
        // As `Arc` does: a count this large means leaked handles by the
        // billion; wrapping would free a live fiber.
        if old > isize::MAX as usize {
            std::process::abort();
        }
    }
}

/// A stackful fiber that returns `T`.
///
/// `Fiber` is a cheap, clonable, reference-counted handle; its state machine makes
/// sure only one party runs, queues or rewrites it at a time. The fiber and
/// its stack are released when the last handle (including those held by run
/// queues and wait lists) is dropped; a fiber suspended mid-function is then
/// unwound, so destructors of its locals run. One exception: a suspended
/// fiber pinned to a thread (the default) whose last handle is dropped on
/// another thread cannot be unwound there, because its locals may be
/// `!Send`; its stack is leaked instead, its destructors never run, and
/// [`leaked_stacks`](crate::leaked_stacks) counts it. Drop such fibers on
/// their own thread, or let them finish first.
///
/// A handle is a counted reference, as an `Arc` is: a suspended fiber that
/// keeps a handle to itself on its own stack (a clone of its `Fiber`, or a
/// [`Waiter::current`](crate::Waiter::current) it never gave away) is a
/// reference cycle. Dropping every other handle then releases nothing: the
/// fiber stays suspended, its locals are never dropped and its stack stays
/// mapped (not counted by `leaked_stacks`). Give such handles away (to a
/// wait list, a queue) or drop them before suspending.
///
/// The unwind of a dropped fiber is a Rust unwind through its stack, and
/// aborts the process where any unwind would: a destructor on that stack
/// that panics (a panic during cleanup), or a suspension point inside an
/// `extern "C"` function (a frame that cannot unwind). Let such fibers
/// finish instead of dropping them suspended. A fiber whose code catches
/// the unwind and suspends again restarts it, so one that does so in a
/// loop (`loop { let _ = catch_unwind(|| job()); }` around jobs that
/// yield) makes the drop never return: rethrow a payload you did not
/// expect (a forced unwind's is not a panic of your jobs), or let the
/// fiber finish. In a build with
/// `panic = "abort"` there is no unwinding: a suspended fiber that is
/// dropped has its stack leaked and counted, as above.
///
/// ```
/// use spindle_fiber::{yield_value, Fiber, FiberAttr, Priority, RunOutcome};
///
/// let fiber = Fiber::new(FiberAttr::new()).unwrap();
/// fiber.set_function(Priority::NORMAL, || {
///     for i in 0..3 { yield_value(i) }
///     "done"
/// }).unwrap();
/// for i in 0..3 {
///     assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(v) if v == i));
/// }
/// assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned("done")));
/// assert!(fiber.run().is_err()); // finished: set a new function first
/// ```
///
/// # Threads
///
/// `Fiber<T>` is `Send` and `Sync` for `T: Send`. A function set with the
/// safe [`set_function`](Fiber::set_function) is *pinned*: once started, it
/// runs only on the thread that started it (elsewhere `run` returns
/// [`FiberError::WrongThread`]), because its suspended stack may hold `!Send`
/// values and thread-local references. A function set with the unsafe
/// [`set_function_migratable`](Fiber::set_function_migratable) may resume on
/// any thread. See DESIGN.md, "Soundness".
///
/// Do not suspend inside the lazy initializer of a `thread_local!`. std
/// assumes that an initializer cannot be interleaved with a `with` of the
/// same key on its thread; a fiber that yields there lets the thread (or
/// another fiber) initialize the key and borrow the value, which the
/// suspended initializer then replaces and frees when it finishes. This is
/// a known gap in the safety of the API (DESIGN.md, "Known gaps"), shared
/// with every stackful coroutine.
///
/// Do not suspend while `std::thread::panicking()` is true either: in a
/// destructor run by a panic's unwind, or inside a panic hook (a hook that
/// yields, or waits on a `spindle-sync` primitive). std counts panics per
/// thread: the runner's thread stays "panicking" until the fiber resumes,
/// and after a suspension inside a hook, the next panic on that thread
/// aborts the process. Not undefined behaviour, but nothing to rely on
/// (DESIGN.md, "Known gaps", "Suspending while unwinding"). Such a fiber
/// cannot be unwound by dropping it while it is suspended there (the
/// second unwind would abort the process): its last handle's drop leaks
/// its stack instead (counted by [`leaked_stacks`](crate::leaked_stacks)),
/// as far as spindle can tell. It cannot if a panic hook set later
/// replaced the crate's, or if the unwind was started with
/// `std::panic::resume_unwind` rather than
/// [`resume_unwind`](crate::resume_unwind): such a drop aborts the
/// process. Run the fiber until its run returns [`RunOutcome::Panicked`]
/// instead.
///
/// ```compile_fail,E0277
/// // Captured values must be Send: an Rc could be reached from two threads.
/// let rc = std::rc::Rc::new(1);
/// let f = spindle_fiber::Fiber::new(Default::default()).unwrap();
/// f.set_function(Default::default(), move || *rc).unwrap();
/// ```
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<spindle_fiber::Fiber<String>>();
/// ```
///
/// ```compile_fail,E0277
/// fn assert_send<T: Send>() {}
/// assert_send::<spindle_fiber::Fiber<std::rc::Rc<u8>>>();
/// ```
///
/// The value a function returns must be `Send` too (the fiber may be run,
/// and its value taken, on another thread than the one that made it), and
/// a function borrows nothing (`'static`: the fiber outlives the frame
/// that set it):
///
/// ```compile_fail,E0277
/// let f = spindle_fiber::Fiber::new(Default::default()).unwrap();
/// f.set_function(Default::default(), || std::rc::Rc::new(1)).unwrap();
/// ```
///
/// ```compile_fail,E0373
/// let v = vec![1];
/// let f = spindle_fiber::Fiber::new(Default::default()).unwrap();
/// f.set_function(Default::default(), || v.len()).unwrap();
/// ```
///
/// ```compile_fail,E0277
/// fn assert_sync<T: Sync>() {}
/// assert_sync::<spindle_fiber::Fiber<std::rc::Rc<u8>>>();
/// ```
///
/// The migratable opt-in asks the same of what the function captures:
///
/// ```compile_fail,E0277
/// let rc = std::rc::Rc::new(1);
/// let f = spindle_fiber::Fiber::new(Default::default()).unwrap();
/// // SAFETY: the function holds nothing across a suspension (it has none).
/// unsafe { f.set_function_migratable(Default::default(), move || *rc) }.unwrap();
/// ```
///
/// A fiber is invariant in `T`: it both takes a function returning `T`
/// and hands `T` out, so a handle must not be usable at another type
/// (a clone typed with a shorter lifetime could set a function whose value
/// another handle then reads as longer-lived):
///
/// ```compile_fail
/// use spindle_fiber::Fiber;
///
/// fn shorten<'a>(f: Fiber<&'static str>) -> Fiber<&'a str> {
///     f
/// }
/// ```
///
/// Errors are plain `Send + Sync` values:
///
/// ```
/// fn assert_send_sync<T: Send + Sync + 'static>() {}
/// assert_send_sync::<spindle_fiber::FiberError>();
/// assert_send_sync::<spindle_fiber::StackError>();
/// ```
pub struct Fiber<T = ()> {
    inner: NonNull<Inner<T>>,
    /// A counted share of the `Inner` (Send and Sync are stated below),
    /// invariant in `T` on purpose: the `UnsafeCell` in `Inner` makes it so
    /// already, but soundness should not rest on a field's type.
    _owns: PhantomData<OwnsInvariant<T>>,
}

/// `Fiber<T>`'s marker: a counted share of `Inner<T>`, invariant in `T`.
type OwnsInvariant<T> = (Arc<Inner<T>>, fn(T) -> T);

// SAFETY: all shared mutation goes through the state machine (atomics) or
// is confined to the exclusive owner of the state; the function captured
// is Send; a pinned function is only resumed or unwound on its own thread;
// values of T cross threads (returned to whoever runs it) so T: Send.
unsafe impl<T: Send> Send for Fiber<T> {}
// SAFETY: every `&self` method is guarded by the state machine.
unsafe impl<T: Send> Sync for Fiber<T> {}

impl<T: Send + 'static> Fiber<T> {
    const VTABLE: VTable = VTable {
        retain: Self::erased_retain,
        release: Self::erased_release,
        finish_wake: Self::erased_finish_wake,
    };

    /// Creates a fiber with no function, taking its stack from the pool.
    ///
    /// The first call in a process installs a signal handler and a panic
    /// hook (see the crate docs, "Process-wide side effects").
    ///
    /// # Errors
    ///
    /// [`FiberError::Stack`] if the stack size is below
    /// [`MIN_STACK_SIZE`](crate::MIN_STACK_SIZE) or above
    /// [`MAX_STACK_SIZE`](crate::MAX_STACK_SIZE), or if mapping a new stack
    /// fails (out of memory, or the `vm.max_map_count` limit).
    pub fn new(attr: FiberAttr) -> Result<Fiber<T>, FiberError> {
        crate::overflow::install();
        crate::report::install_panic_hook();
        let stack = attr.pool.take(attr.stack_size)?;
        let header = Header {
            id: FiberId::next(),
            name: attr.name,
            state: StateCell::new(FiberState::Empty),
            priority: AtomicU8::new(Priority::NORMAL.0),
            stack_size: stack.usable_size(),
            guard: stack.guard_range(),
            yielder: AtomicPtr::new(std::ptr::null_mut()),
            drop_yielder: AtomicPtr::new(std::ptr::null_mut()),
            last_thread: AtomicU64::new(0),
            pinned_to: AtomicU64::new(0),
            counters: Counters::default(),
            vtable: &Self::VTABLE,
            sched_data: AtomicUsize::new(0),
            wait_reason: AtomicPtr::new(std::ptr::null_mut()),
            wait_hook: AtomicPtr::new(std::ptr::null_mut()),
            home_refused: AtomicBool::new(false),
            wait_location: AtomicPtr::new(std::ptr::null_mut()),
            sleep_request: AtomicBool::new(false),
            interrupt: AtomicU64::new(0),
            unwinding_for_drop: AtomicBool::new(false),
            panicking_means_unwinding: AtomicBool::new(false),
            slept_panicking: AtomicBool::new(false),
            panicked_on: AtomicU64::new(0),
            stackless: AtomicBool::new(false),
        };
        let inner = Box::new(Inner {
            header,
            refs: AtomicUsize::new(1),
            slot: UnsafeCell::new(Slot {
                coro: None,
                stack: Some(stack),
                home: None,
                migratable: false,
                pin: NO_PIN,
                pool: attr.pool,
            }),
        });
        Ok(Fiber {
            inner: NonNull::from(Box::leak(inner)),
            _owns: PhantomData,
        })
    }

    /// Gives the fiber a function to run and the priority it is scheduled
    /// at. Allowed when the fiber is empty, finished, or has a function that
    /// has not started yet (which is dropped).
    ///
    /// The function is pinned to the thread that first runs it, or to the
    /// one [`pin_to`](Fiber::pin_to) names before that.
    ///
    /// The function and its result must be `Send + 'static` even if you
    /// only ever run the fiber on one thread: a `Fiber` handle may be sent
    /// elsewhere before the first run, and a fiber outlives the frame that
    /// created it. Share state with the driving loop through `Arc` and a
    /// lock or atomics rather than `Rc`/`RefCell`, and pass values in and
    /// out by yielding ([`yield_value`](crate::yield_value)) or through
    /// that shared state.
    ///
    /// # Errors
    ///
    /// [`FiberError::Busy`] while a started function is suspended (yielded
    /// or asleep), [`FiberError::Running`] or [`FiberError::Queued`] while
    /// it runs or waits in a queue,
    /// and [`FiberError::NoStack`] for a fiber that lost its stack when it
    /// was dropped mid-function. The fiber is left as it was, and `f` is
    /// dropped.
    ///
    /// # Panics
    ///
    /// If the function it replaces never started and a destructor of that
    /// closure's captures panics: the panic is passed on, the old stack is
    /// leaked (counted by [`leaked_stacks`](crate::leaked_stacks)), and the
    /// fiber is left finished without a stack (later calls return
    /// [`FiberError::NoStack`]).
    pub fn set_function<F>(&self, priority: Priority, f: F) -> Result<(), FiberError>
    where
        F: FnOnce() -> T + Send + 'static,
    {
        self.install(priority, f, false)
    }

    /// Like [`set_function`](Fiber::set_function), but the function may be
    /// resumed on any thread after a suspension.
    ///
    /// # Errors
    ///
    /// As [`set_function`](Fiber::set_function).
    ///
    /// # Safety
    ///
    /// Across every suspension point of `f` (a yield or a sleep, in `f` or
    /// anything it calls), the caller guarantees that:
    /// - no value that is not `Send` is alive on the fiber's stack (no `Rc`,
    ///   `RefCell` borrow guard, `MutexGuard` or other thread-affine value).
    ///   The one exception is the state of a wait on `spindle-sync`'s
    ///   primitives, which the wait keeps in its frame while the fiber
    ///   sleeps: it is not `Send` because it holds raw pointers to the
    ///   primitive and to the fiber, not because it is tied to a thread, and
    ///   it is written for fibers that move (a wait from a migratable fiber
    ///   is sound);
    /// - no reference into a thread-local is held (e.g. no suspension inside
    ///   a `LocalKey::with` closure), and thread-locals read after a
    ///   suspension are read through a function that is not inlined into
    ///   the one that suspended (llvm/llvm-project#98479);
    /// - the fiber does not suspend while `std::thread::panicking()` is
    ///   true: while it unwinds from a panic, or inside a panic hook, which
    ///   runs before the unwind (std counts panics per thread, and marks
    ///   the thread as being in a hook: a later panic there aborts).
    pub unsafe fn set_function_migratable<F>(&self, priority: Priority, f: F) -> Result<(), FiberError>
    where
        F: FnOnce() -> T + Send + 'static,
    {
        self.install(priority, f, true)
    }

    fn install<F>(&self, priority: Priority, f: F, migratable: bool) -> Result<(), FiberError>
    where
        F: FnOnce() -> T + Send + 'static,
    {
        // corosensei moves the function onto the fiber's stack and refuses
        // one over 1 KiB (a panic, with the state already claimed). It
        // aligns the stack pointer down for the function without a bounds
        // check, so an over-aligned closure (a capture of
        // `#[repr(align(1 << 20))]`, even a zero-sized one) would be
        // written below the guard page, into whatever is mapped there. A
        // large or over-aligned closure goes behind a Box (a Box is
        // pointer-aligned): one allocation, for those only (size and
        // alignment are known at compile time, so the branch is too).
        if std::mem::size_of::<F>() > MAX_INLINE_FUNCTION || std::mem::align_of::<F>() > MAX_INLINE_ALIGN {
            return self.install_sized(priority, Box::new(f), migratable);
        }
        self.install_sized(priority, f, migratable)
    }

    fn install_sized<F>(&self, priority: Priority, f: F, migratable: bool) -> Result<(), FiberError>
    where
        F: FnOnce() -> T + Send + 'static,
    {
        let h = self.header();
        // Claim from whichever of the three states the fiber is in, retrying
        // with what a failed compare-and-swap found: the state may move
        // between them meanwhile (a run queue's pop and push, a run that
        // finishes on another thread), and an error judged from a second,
        // later load could name a state the fiber was never in for us.
        let mut seen = h.state.load();
        let from = loop {
            match seen {
                FiberState::Empty | FiberState::Finished | FiberState::Ready => {
                    match h.state.transition(seen, FiberState::Locked) {
                        Ok(()) => break seen,
                        Err(found) => seen = found,
                    }
                }
                busy => return Err(self.busy_error(busy)),
            }
        };
        // SAFETY: we hold the state `Locked`.
        let slot = unsafe { self.slot() };
        if from == FiberState::Ready {
            if slot.coro.as_ref().is_some_and(|c| c.started()) {
                // SAFETY: we hold it `Locked`, and it was `Ready`.
                unsafe { self.let_go_ready() };
                return Err(FiberError::Busy(h.id));
            }
            // A function that never started: drop it (on any thread: F: Send).
            if let Some(mut c) = slot.coro.take() {
                if let Err(payload) = catch_unwind(AssertUnwindSafe(|| c.force_unwind())) {
                    // A capture's destructor panicked. The unwind dropped
                    // the other captures, but the coroutine still counts
                    // the closure as its own and would drop it all again.
                    // Leak it (and its stack) and pass the panic on; the
                    // fiber has no stack now.
                    let _ = ManuallyDrop::new(c);
                    crate::report::note_leaked_stack();
                    h.stackless.store(true, Ordering::Relaxed);
                    h.state.store(FiberState::Finished);
                    std::panic::resume_unwind(payload);
                }
                slot.stack = Some(c.into_stack());
            }
        }
        let Some(stack) = slot.stack.take() else {
            // A fiber unwound on drop while a destructor kept a reference
            // (see `release`): its stack went back to the pool.
            h.state.store(from);
            return Err(FiberError::NoStack(h.id));
        };
        let coro = Coroutine::with_stack(stack, move |y: &Yielder, ()| {
            // The runner made this fiber current before resuming it; this
            // runs before the first suspension (see current.rs).
            let me = crate::current::current_header();
            // SAFETY: as above, `me` is this fiber's header.
            unsafe {
                (*me)
                    .yielder
                    .store(y as *const Yielder as *mut (), Ordering::Relaxed)
            };
            // Panics are caught here, at the fiber's root, so that `run`
            // needs no landing pad around the switch. A forced unwind (a
            // suspended fiber being dropped) is caught here too and ends the
            // function like a return, which is what corosensei expects.
            let result = catch_unwind(AssertUnwindSafe(f));
            // The function is over. Its value may still be dropped with
            // this fiber current (corosensei discards it when a caught
            // forced unwind ends in a return): a suspension from its
            // destructor must find no yielder, not this dead frame's.
            // SAFETY: the header outlives the fiber's function.
            unsafe { (*me).yielder.store(std::ptr::null_mut(), Ordering::Relaxed) };
            // SAFETY: as above.
            unsafe { (*me).drop_yielder.store(std::ptr::null_mut(), Ordering::Relaxed) };
            // No unwind of this function is in progress now.
            // SAFETY: as above.
            unsafe { (*me).panicked_on.store(0, Ordering::Relaxed) };
            result
        });
        slot.coro = Some(coro);
        // The new function stores its yielder when it starts.
        h.yielder.store(std::ptr::null_mut(), Ordering::Relaxed);
        h.drop_yielder.store(std::ptr::null_mut(), Ordering::Relaxed);
        h.sleep_request.store(false, Ordering::Relaxed);
        // No wait is open now; a primitive that failed to clear its hook
        // (against `enter_wait`'s contract) leaves no dangling one behind.
        h.wait_hook.store(std::ptr::null_mut(), Ordering::Relaxed);
        // A new generation, no mark (published by the state store below).
        let generation = (h.interrupt.load(Ordering::Relaxed) >> 1).wrapping_add(1);
        h.interrupt.store(generation << 1, Ordering::Relaxed);
        h.unwinding_for_drop.store(false, Ordering::Relaxed);
        h.slept_panicking.store(false, Ordering::Relaxed);
        h.panicked_on.store(0, Ordering::Relaxed);
        h.panicking_means_unwinding.store(false, Ordering::Relaxed);
        h.pinned_to.store(0, Ordering::Relaxed);
        slot.migratable = migratable;
        slot.pin = NO_PIN;
        h.priority.store(priority.0, Ordering::Relaxed);
        h.state.store(FiberState::Ready);
        Ok(())
    }

    /// Runs the fiber on the calling thread until its next suspension point.
    ///
    /// Nesting is supported: a fiber may run another fiber; the inner one
    /// suspends back into the outer one, and [`current`](crate::current()) is
    /// right on both sides.
    ///
    /// Any handle may call `run`; a compare-and-swap on the fiber's state
    /// makes sure only one caller runs it at a time. A caller that owns the
    /// only handle can use [`run_mut`](Fiber::run_mut), which skips it.
    ///
    /// # Errors
    ///
    /// The fiber is not ready to run, and nothing happened:
    /// [`NoFunction`](FiberError::NoFunction) (set one first),
    /// [`Finished`](FiberError::Finished) (its function returned or
    /// panicked: set a new one), [`Running`](FiberError::Running),
    /// [`Queued`](FiberError::Queued), [`Sleeping`](FiberError::Sleeping)
    /// (someone else owns it now), [`WrongThread`](FiberError::WrongThread)
    /// (a pinned fiber on another thread than its own), or
    /// [`NoStack`](FiberError::NoStack). A panic in the fiber is not an
    /// error: it comes back as [`RunOutcome::Panicked`].
    // Always inlined: a library frame live across the stack switch costs a
    // mispredicted return on every round trip, and LLVM judges the body
    // too large to inline on its own (DESIGN.md, "Claiming a fiber").
    #[inline(always)]
    pub fn run(&self) -> Result<RunOutcome<T>, FiberError> {
        let h = self.header();
        if let Err(found) = h.state.transition(FiberState::Ready, FiberState::Running) {
            return Err(self.run_error(found));
        }
        // SAFETY: we moved the state from `Ready` to `Running`.
        unsafe { self.resume_claimed() }
    }

    /// The same as [`run`](Fiber::run), but faster when this handle is the
    /// only reference to the fiber (no clone, no [`Waiter`](crate::Waiter),
    /// not in a queue): `&mut self` and a reference count of one prove that
    /// nobody else can touch the fiber, so claiming it is a plain load and
    /// store instead of a compare-and-swap. With other references alive it
    /// simply calls `run`.
    ///
    /// This is the loop of a caller that drives its own fibers by hand:
    ///
    /// ```
    /// use spindle_fiber::{yield_value, Fiber, FiberAttr, Priority, RunOutcome};
    ///
    /// let mut fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// fiber.set_function(Priority::NORMAL, || { yield_value(7); 8 }).unwrap();
    /// assert!(matches!(fiber.run_mut().unwrap(), RunOutcome::Yielded(7)));
    /// assert!(matches!(fiber.run_mut().unwrap(), RunOutcome::Returned(8)));
    /// ```
    ///
    /// # Errors
    ///
    /// As [`run`](Fiber::run).
    #[inline(always)]
    pub fn run_mut(&mut self) -> Result<RunOutcome<T>, FiberError> {
        if !self.is_unique() {
            return self.run();
        }
        let h = self.header();
        match h.state.load() {
            FiberState::Ready => h.state.store(FiberState::Running),
            found => return Err(self.run_error(found)),
        }
        // SAFETY: the state was `Ready` and no one else can reach it.
        unsafe { self.resume_claimed() }
    }

    /// Switches into a claimed fiber and handles why it came back.
    ///
    /// # Safety
    /// The caller moved the state from `Ready` to `Running`.
    #[inline(always)]
    unsafe fn resume_claimed(&self) -> Result<RunOutcome<T>, FiberError> {
        let h = self.header();
        // Field by field, through the raw pointer: `change_thread` below
        // reaches `pin` again, which must not invalidate `coro`.
        let slot = self.slot_ptr();
        // SAFETY: we hold the state `Running`, so the slot is ours.
        let Some(coro) = (unsafe { (*slot).coro.as_mut() }) else {
            // Only a fiber whose suspended function was unwound while a
            // destructor kept a reference to it gets here (see `release`):
            // its function is over, and its stack is gone.
            h.state.store(FiberState::Finished);
            return Err(FiberError::NoStack(h.id));
        };
        // Make this fiber current (the overflow handler then knows whose
        // guard page to check) and read the thread's id in the same access.
        let (prev, me) = enter_on_thread(self.inner.cast());
        // `pin` is the thread of this function's last run (`NO_PIN`: none
        // yet), and then also `last_thread`: one compare covers the common
        // case (a thread with no id yet reads 0, which is never a pin).
        // SAFETY: as above.
        if unsafe { (*slot).pin } != me {
            // Out of line, and given nothing but `self`: a pointer into the
            // slot passed from here would be kept live across the caller's
            // loop (and spilled) instead of recomputed.
            // SAFETY: we hold the state `Running`.
            let moved = unsafe { self.change_thread() };
            if moved != ChangeThread::Moved {
                // SAFETY: the thread of `enter_on_thread`.
                unsafe { exit(prev) };
                if moved == ChangeThread::RefusedHeld {
                    // With the thread's own current fiber back: letting go
                    // may run a wait hook and wake other fibers.
                    // SAFETY: `change_thread` left it `Locked` for us.
                    unsafe { self.let_go_ready() };
                }
                // Built here, not returned by the call: an error written
                // through a pointer by a called function sends every
                // outcome of `run` through memory.
                return Err(FiberError::WrongThread(h.id));
            }
        }
        Counters::bump(&h.counters.runs);
        let result = coro.resume(());
        // Back on the runner's stack and thread, whatever the fiber did.
        // SAFETY: a runner does not change threads while the fiber is in.
        unsafe { exit(prev) };

        // The common case (a plain yield) is a register compare; sleeps,
        // returns and panics are handled out of line, which keeps the
        // caller's loop around `run` from spilling (DESIGN.md, "Claiming
        // a fiber to run it"). Every outcome is built here, not in a called
        // function, so that it stays in registers.
        Ok(match result {
            CoroutineResult::Yield(v) if v != SLEEP_SIGNAL => {
                h.state.transition_to_yielded();
                RunOutcome::Yielded(v)
            }
            CoroutineResult::Yield(v) => match self.switched_out_to_sleep() {
                true => RunOutcome::Slept,
                false => RunOutcome::Yielded(v),
            },
            CoroutineResult::Return(Ok(v)) => {
                self.finish();
                RunOutcome::Returned(v)
            }
            CoroutineResult::Return(Err(payload)) => {
                self.finish();
                RunOutcome::Panicked(Box::new(Panic {
                    fiber: h.id,
                    name: h.name.clone(),
                    payload,
                }))
            }
        })
    }

    /// A run on a thread that did not make this function's last run (or
    /// the function's first run): refused for a pinned function that has
    /// run already (`ChangeThread::Refused`, the state back to `Ready`, or
    /// `ChangeThread::RefusedHeld`, left `Locked` when a wake was deferred
    /// to this claim: the caller lets go of it once the thread's current
    /// fiber is back); otherwise
    /// counted as a migration if the fiber's last run, of any function, was
    /// on another thread, and remembered.
    ///
    /// # Safety
    /// The caller holds the state `Running`.
    #[cold]
    #[inline(never)]
    unsafe fn change_thread(&self) -> ChangeThread {
        let h = self.header();
        // Field by field: the caller holds a reference to `coro`.
        let slot = self.slot_ptr();
        // SAFETY: the caller holds the state `Running`, so the slot is ours.
        let (pin, migratable) = unsafe { ((*slot).pin, (*slot).migratable) };
        let me = thread_id();
        // Refused: a pinned function off its thread, or a function pinned
        // before its first run (`pin_to`) to another thread.
        let pinned_before_start = h.pinned_to.load(Ordering::Relaxed);
        if !migratable && (pin != NO_PIN || (pinned_before_start != 0 && pinned_before_start != me)) {
            // The claim made the fiber `Running` for a moment: a wake that
            // came meanwhile was deferred to this runner (`RunningWoken`).
            // The fiber did not run, so it is where it was: `Ready`, let go
            // of by the caller (once the thread's current fiber is back).
            if h.state
                .transition(FiberState::Running, FiberState::Ready)
                .is_err()
            {
                h.state.store(FiberState::Locked);
                return ChangeThread::RefusedHeld;
            }
            return ChangeThread::Refused;
        }
        let last = h.last_thread.load(Ordering::Relaxed);
        if last != me {
            if last != 0 {
                Counters::bump(&h.counters.migrations);
            }
            h.last_thread.store(me, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { (*slot).pin = me };
        if !migratable {
            h.pinned_to.store(me, Ordering::Relaxed);
        }
        ChangeThread::Moved
    }

    /// After the fiber suspended with `SLEEP_SIGNAL`: whether it went to
    /// sleep (else it yielded that value).
    #[cold]
    #[inline(never)]
    fn switched_out_to_sleep(&self) -> bool {
        let h = self.header();
        if !h.sleep_request.load(Ordering::Relaxed) {
            h.state.transition_to_yielded();
            return false;
        }
        // Set by `sleep_on` on this thread just before the switch.
        h.sleep_request.store(false, Ordering::Relaxed);
        Counters::bump(&h.counters.sleeps);
        match h.state.transition_to_sleeping() {
            SleepTransition::Asleep => {}
            // A waker came between the fiber publishing its waiter and the
            // switch: finish the wake for it (sleeper step 4).
            // SAFETY: we hold the state `Locked`.
            SleepTransition::AlreadyWoken => {
                // SAFETY: as above. Refused for good: its waker has moved
                // on, so the fiber's wait hook takes back what it was
                // handed, and the fiber is left `Ready`.
                if let Err(refused) = unsafe { self.clone().finish_wake_owned() } {
                    // SAFETY: the refusal hands the hold back to us.
                    unsafe { refused.let_go_refused_ready() };
                }
            }
        }
        true
    }

    /// The function returned or panicked: its stack goes back to the slot.
    #[cold]
    #[inline(never)]
    fn finish(&self) {
        // SAFETY: we still hold the state `Running`.
        let slot = unsafe { self.slot() };
        Counters::bump(&self.header().counters.ends);
        let coro = slot.coro.take().expect("finished fiber had a coroutine");
        slot.stack = Some(coro.into_stack());
        slot.pin = NO_PIN;
        self.header().pinned_to.store(0, Ordering::Relaxed);
        // The yielder was cleared by the function's root wrapper before its
        // last switch. No wait is open once the function is over (cleared in
        // case a primitive broke `enter_wait`'s contract).
        self.header()
            .wait_hook
            .store(std::ptr::null_mut(), Ordering::Relaxed);
        self.header().state.store(FiberState::Finished);
    }

    /// For schedulers: `Ready` → `Queued`, remembering `home` as the
    /// scheduler a wake sends the fiber back to (`None` keeps the home it
    /// has; [`set_home`](Fiber::set_home) clears it). Undo with
    /// [`mark_dequeued`](Fiber::mark_dequeued) if the fiber is not queued
    /// after all.
    ///
    /// Returns the home this replaced, if any. A scheduler that calls this
    /// under a lock of its own should drop the returned home only after
    /// releasing that lock (`fiber.mark_queued(h)?;` drops it at once): if
    /// this was the home's last reference, its drop runs whatever that
    /// scheduler owns, and that may take the same lock (as
    /// `RunQueue::try_push` does).
    ///
    /// # Errors
    ///
    /// The fiber is not `Ready` (running, queued, asleep, finished, or
    /// without a function); nothing changed.
    pub fn mark_queued(
        &self,
        home: Option<&Arc<dyn Schedule<T>>>,
    ) -> Result<Option<Arc<dyn Schedule<T>>>, FiberError> {
        let h = self.header();
        h.state
            .transition(FiberState::Ready, FiberState::Locked)
            .map_err(|s| self.run_error(s))?;
        // SAFETY: we hold the state `Locked`.
        let replaced = Self::replace_home(unsafe { self.slot() }, home);
        // Queued by someone: not refused (any more), whatever its home.
        h.home_refused.store(false, Ordering::Relaxed);
        h.state.store(FiberState::Queued);
        // The previous home is handed out only now: if this was its last
        // reference, its drop runs whatever it owns, which must not find
        // this fiber `Locked`.
        Ok(replaced)
    }

    /// Makes `home` the slot's home (`None` keeps the one it has) and hands
    /// back the home it replaced, for the caller to drop once the fiber is
    /// no longer `Locked`.
    fn replace_home(slot: &mut Slot<T>, home: Option<&Arc<dyn Schedule<T>>>) -> Option<Arc<dyn Schedule<T>>> {
        let home = home?;
        if slot.home.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, home)) {
            return None;
        }
        slot.home.replace(Arc::clone(home))
    }

    /// [`mark_queued`](Fiber::mark_queued) for a scheduler that holds this
    /// handle by value or `&mut` (a push that takes the fiber): when it is
    /// the fiber's only handle and no `Waiter` of it exists, nobody else can
    /// reach the state, and the transition is a plain load and store
    /// instead of a compare-and-swap. Otherwise it is `mark_queued`.
    ///
    /// ```
    /// use spindle_fiber::{Fiber, FiberAttr, FiberState, Priority};
    ///
    /// let mut fiber = Fiber::new(FiberAttr::new()).unwrap();
    /// fiber.set_function(Priority::NORMAL, || ()).unwrap();
    /// fiber.mark_queued_mut(None).unwrap();
    /// assert_eq!(fiber.state(), FiberState::Queued);
    /// assert!(fiber.mark_queued_mut(None).is_err()); // queued already
    /// fiber.mark_dequeued_mut().unwrap();
    /// assert_eq!(fiber.state(), FiberState::Ready);
    /// ```
    ///
    /// # Errors
    ///
    /// As [`mark_queued`](Fiber::mark_queued).
    #[inline]
    pub fn mark_queued_mut(
        &mut self,
        home: Option<&Arc<dyn Schedule<T>>>,
    ) -> Result<Option<Arc<dyn Schedule<T>>>, FiberError> {
        if !self.is_unique() {
            return self.mark_queued(home);
        }
        let h = self.header();
        match h.state.load() {
            FiberState::Ready => {}
            found => return Err(self.run_error(found)),
        }
        // SAFETY: the only handle, held exclusively, on a `Ready` fiber: no
        // one else can reach the slot (as `run_mut`).
        let replaced = Self::replace_home(unsafe { self.slot() }, home);
        h.home_refused.store(false, Ordering::Relaxed);
        h.state.store(FiberState::Queued);
        Ok(replaced)
    }

    /// For schedulers: sets the scheduler a wake sends this `Ready` fiber
    /// back to, without queueing it (e.g. after taking it from another
    /// worker's queue). Returns the home this replaced, if any, as
    /// [`mark_queued`](Fiber::mark_queued) does.
    ///
    /// # Errors
    ///
    /// The fiber is not `Ready`; nothing changed.
    pub fn set_home(
        &self,
        home: Option<&Arc<dyn Schedule<T>>>,
    ) -> Result<Option<Arc<dyn Schedule<T>>>, FiberError> {
        let h = self.header();
        h.state
            .transition(FiberState::Ready, FiberState::Locked)
            .map_err(|s| self.run_error(s))?;
        // SAFETY: we hold the state `Locked`.
        let slot = unsafe { self.slot() };
        let replaced = match (home, &slot.home) {
            (Some(new), Some(cur)) if Arc::ptr_eq(new, cur) => None,
            _ => {
                h.home_refused.store(false, Ordering::Relaxed);
                std::mem::replace(&mut slot.home, home.cloned())
            }
        };
        // Still refused (the same home): a value handed to it while this
        // held it is taken back (`let_go_ready`). With a new home, the
        // caller has it in hand and runs or queues it, and it finds the
        // value then.
        // SAFETY: we hold it `Locked`, and it was `Ready`.
        unsafe { self.let_go_ready() };
        // As in `mark_queued`: the previous home goes out unlocked.
        Ok(replaced)
    }

    /// Finishes a wake the caller owns (state `Locked`).
    ///
    /// Consumes the waker's reference: with a home it is handed to the
    /// scheduler. Without one, the fiber is left `Ready` and the reference
    /// is dropped here; if nobody else holds the fiber that was the last
    /// one, and the fiber is released on the waker's thread: unwound there
    /// if it may run there (its destructors run inside the wake), otherwise
    /// its stack is leaked and counted (`leaked_stacks`).
    ///
    /// # Errors
    ///
    /// The home refused the fiber for good: it comes back, still held
    /// (`Locked`: the caller lets go of it).
    ///
    /// # Safety
    /// The caller holds the state `Locked`.
    unsafe fn finish_wake_owned(self) -> Result<(), Fiber<T>> {
        // SAFETY: the caller holds `Locked`.
        let slot = unsafe { self.slot() };
        match slot.home.clone() {
            Some(home) => {
                let (me, me_id) = (self.inner, self.header().id);
                match home.schedule(Woken {
                    fiber: ManuallyDrop::new(self),
                    _brand: PhantomData,
                }) {
                    Ok(()) => Ok(()),
                    // The brand makes this call's `Woken` the only one a
                    // refusal can return. Checked all the same, at no cost
                    // to the common path: a lifetime can be forged with
                    // a known compiler hole (rust-lang/rust#25860), and a
                    // waker that took back a value from the wrong fiber
                    // would write to a stack it does not hold. The id
                    // too, not only the address: a scheduler can free this
                    // fiber inside the call and return a new fiber's
                    // `Woken` at the same address (ids are never reused).
                    // Another fiber's `Woken` is let go, and this wake
                    // counts as taken: whoever kept ours decides its fate.
                    Err(w) if w.fiber.inner == me && w.fiber.header().id == me_id => {
                        // Still held: later value-handing wakes that find it
                        // `Ready` are refused too (`Waiter::try_wake`),
                        // until it is queued again or given a new home.
                        w.fiber.header().home_refused.store(true, Ordering::Relaxed);
                        Err(w.into_held())
                    }
                    Err(other) => {
                        drop(other);
                        Ok(())
                    }
                }
            }
            None => {
                self.header().state.store(FiberState::Ready);
                Ok(())
            }
        }
    }

    unsafe fn erased_retain(h: NonNull<Header>) {
        // SAFETY: h is the header of a live Inner<T> (repr(C) first field)
        // the caller holds a reference to.
        unsafe { Inner::<T>::retain(h.cast()) }
    }

    unsafe fn erased_release(h: NonNull<Header>) {
        // SAFETY: the caller owns one reference.
        unsafe { release::<T>(h.cast()) }
    }

    /// True if the home refused the fiber: the caller then owns the
    /// reference again, and the state `Locked`.
    unsafe fn erased_finish_wake(h: NonNull<Header>) -> bool {
        // SAFETY: the caller owns one reference and holds `Locked`.
        let fiber = Fiber::<T> {
            inner: h.cast(),
            _owns: PhantomData,
        };
        // SAFETY: as above.
        match unsafe { fiber.finish_wake_owned() } {
            Ok(()) => false,
            Err(refused) => {
                // Still held since the wake took it: nothing has run the
                // fiber or touched its stack. The reference and the hold
                // go back to the caller.
                std::mem::forget(refused);
                true
            }
        }
    }
}

impl<T> Fiber<T> {
    /// Whether this is the only reference to the fiber. With `&mut self`,
    /// no other thread can make a new one meanwhile.
    #[inline]
    fn is_unique(&mut self) -> bool {
        // SAFETY: we own a reference.
        // No weak reference is ever made, so a count of one means exclusive.
        if unsafe { self.inner.as_ref() }.refs.load(Ordering::Relaxed) != 1 {
            return false;
        }
        // Pairs with the Release decrement of whoever dropped the last other
        // reference: everything it did to the fiber happens before what we
        // do next (the count is read Relaxed).
        std::sync::atomic::fence(Ordering::Acquire);
        true
    }

    /// Lets go of a `Ready` fiber this call held `Locked` without changing
    /// it: back to `Ready`, through its wait's hook if its home refused it
    /// (a value waker that found it held meanwhile left the value to
    /// whoever lets go of it: see `let_go_refused`).
    ///
    /// # Safety
    /// The caller holds the state `Locked`, and the fiber was `Ready`.
    #[inline]
    unsafe fn let_go_ready(&self) {
        let h = self.header();
        if !h.home_refused.load(Ordering::Relaxed) {
            h.state.store(FiberState::Ready);
            return;
        }
        // SAFETY: the caller's contract.
        unsafe { self.let_go_refused_ready() }
    }

    /// Lets go of a held fiber marked refused, through its wait hook
    /// (`let_go_refused`), and wakes whoever the hook handed a value on to;
    /// out of line.
    ///
    /// # Safety
    /// The caller holds the state `Locked`.
    #[cold]
    #[inline(never)]
    unsafe fn let_go_refused_ready(&self) {
        // SAFETY: the caller holds `Locked`; our handle is a reference.
        let next = unsafe { crate::current::let_go_refused(self.inner.cast()) };
        crate::current::wake_handing_over(next);
    }

    fn header(&self) -> &Header {
        // SAFETY: we own a reference.
        unsafe { &self.inner.as_ref().header }
    }

    /// # Safety
    /// The caller holds the fiber's state exclusively (see state.rs).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot(&self) -> &mut Slot<T> {
        // SAFETY: exclusivity is the caller's obligation.
        unsafe { &mut *self.slot_ptr() }
    }

    /// The slot, for field-by-field access where two parts of the code
    /// hold references to different fields.
    fn slot_ptr(&self) -> *mut Slot<T> {
        // SAFETY: our reference keeps `inner` alive.
        unsafe { self.inner.as_ref() }.slot.get()
    }

    /// For schedulers: `Queued` → `Ready` when taking the fiber out of a
    /// queue to run it (or handing it back).
    ///
    /// # Errors
    ///
    /// The fiber is not `Queued`; nothing changed:
    /// [`NotQueued`](FiberError::NotQueued) for one that is idle (ready,
    /// without a function, or finished), [`Running`](FiberError::Running)
    /// or [`Sleeping`](FiberError::Sleeping) for one that runs or sleeps.
    pub fn mark_dequeued(&self) -> Result<(), FiberError> {
        self.header()
            .state
            .transition(FiberState::Queued, FiberState::Ready)
            .map_err(|s| match s {
                FiberState::Ready | FiberState::Empty | FiberState::Finished => {
                    FiberError::NotQueued(self.header().id)
                }
                other => self.run_error(other),
            })
    }

    /// [`mark_dequeued`](Fiber::mark_dequeued) for a scheduler that holds
    /// this handle by value or `&mut` (a pop that hands the fiber out): a
    /// plain load and store when it is the fiber's only handle, as
    /// [`mark_queued_mut`](Fiber::mark_queued_mut).
    ///
    /// # Errors
    ///
    /// As [`mark_dequeued`](Fiber::mark_dequeued).
    #[inline]
    pub fn mark_dequeued_mut(&mut self) -> Result<(), FiberError> {
        if !self.is_unique() {
            return self.mark_dequeued();
        }
        let h = self.header();
        match h.state.load() {
            FiberState::Queued => {
                h.state.store(FiberState::Ready);
                Ok(())
            }
            FiberState::Ready | FiberState::Empty | FiberState::Finished => Err(FiberError::NotQueued(h.id)),
            other => Err(self.run_error(other)),
        }
    }

    /// For schedulers that shut down: lets go of a fiber they still hold,
    /// queued (`Queued`, taken out as [`mark_dequeued`](Fiber::mark_dequeued)
    /// does) or taken out to run (`Ready`), for good. The fiber is marked
    /// refused, as a wake its home refuses marks it (later value-handing
    /// wakes of it are refused too, until it is queued again or given
    /// another home), and let go
    /// of through the hook of the wait it is in ([`WaitHook`](crate::WaitHook)),
    /// so a token or message a primitive handed it goes to the next waiter
    /// or back to the primitive instead of staying with a fiber nobody will
    /// run. The fiber ends up `Ready`, in no queue: a handle of its own can
    /// still run it (it waits again).
    ///
    /// `spindle-run-queue` calls this for the fibers left in a queue whose
    /// last handle goes, and `spindle-executor` for the woken fibers its
    /// workers still hold at shutdown (not the sleeping ones, whose wakes
    /// its closed inboxes refuse); both abandon all of those before they
    /// drop any, inside [`defer_releases`](crate::defer_releases), since a
    /// released fiber may be unwound there and then, and a destructor on
    /// its stack may wait for what abandoning another hands on. Call it only on fibers the scheduler lets go
    /// of for good. Called on a fiber that is still in a live queue, it
    /// leaves it there (as [`mark_dequeued`](Fiber::mark_dequeued) would),
    /// and its next requeue or accepted wake clears the mark; until then a
    /// wake that hands it a value holds it for a moment to hand the value
    /// on, and a `run` of it from that queue in that moment fails with
    /// [`Running`](FiberError::Running) (the fiber is then `Ready` in no
    /// queue).
    ///
    /// # Errors
    ///
    /// The fiber is neither `Queued` nor `Ready` (it runs, sleeps, has no
    /// function or finished, or someone holds it for a moment); nothing
    /// changed. A sleeping fiber needs nothing: its next wake goes to its
    /// home, which refuses it.
    pub fn abandon(&self) -> Result<(), FiberError> {
        let h = self.header();
        let mut seen = h.state.load();
        loop {
            match seen {
                FiberState::Queued | FiberState::Ready => {
                    match h.state.transition(seen, FiberState::Locked) {
                        Ok(()) => break,
                        Err(found) => seen = found,
                    }
                }
                other => return Err(self.run_error(other)),
            }
        }
        h.home_refused.store(true, Ordering::Relaxed);
        // SAFETY: we hold it `Locked`.
        unsafe { self.let_go_refused_ready() };
        Ok(())
    }

    /// Whether [`run`](Fiber::run) on the calling thread would be allowed
    /// as far as threads go (it is not refused with
    /// [`WrongThread`](FiberError::WrongThread)): the function is
    /// migratable, has not run yet, or is pinned to this thread. For
    /// schedulers whose queues several threads pop.
    ///
    /// ```
    /// use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority};
    ///
    /// let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    /// fiber.set_function(Priority::NORMAL, || yield_now()).unwrap();
    /// assert!(fiber.may_run_here()); // not run yet
    /// fiber.run().unwrap(); // now pinned to this thread
    /// assert!(fiber.may_run_here());
    /// let f = fiber.clone();
    /// assert!(!std::thread::spawn(move || f.may_run_here()).join().unwrap());
    /// ```
    #[inline]
    pub fn may_run_here(&self) -> bool {
        match self.header().pinned_to.load(Ordering::Relaxed) {
            0 => true,
            // The id word as it is: a thread without an id yet (0) is not
            // the one a function is pinned to, and reading it assigns none.
            t => t == crate::tls::thread_id_word(),
        }
    }

    /// Whether the function is pinned to the calling thread (it has run
    /// here and is not migratable, or [`pin_to`](Fiber::pin_to) named this
    /// thread before its first run): no other thread may run it. A
    /// scheduler that queues it need not wake another thread for it.
    ///
    /// ```
    /// use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority};
    ///
    /// let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    /// fiber.set_function(Priority::NORMAL, || yield_now()).unwrap();
    /// assert!(!fiber.is_pinned_here()); // not run yet: any thread may
    /// fiber.run().unwrap();
    /// assert!(fiber.is_pinned_here());
    /// let f = fiber.clone();
    /// assert!(!std::thread::spawn(move || f.is_pinned_here()).join().unwrap());
    ///
    /// let fresh = Fiber::<()>::new(FiberAttr::new()).unwrap();
    /// fresh.set_function(Priority::NORMAL, || ()).unwrap();
    /// fresh.pin_to(spindle_fiber::ThreadToken::current()).unwrap();
    /// assert!(fresh.is_pinned_here()); // pinned here before any run
    /// ```
    pub fn is_pinned_here(&self) -> bool {
        match self.header().pinned_to.load(Ordering::Relaxed) {
            0 => false,
            t => t == crate::tls::thread_id_word(),
        }
    }

    /// Pins the fiber's function, which has not run yet, to the thread
    /// `thread` names: only that thread may run it, from its first run on,
    /// as if that thread had run it first. A scheduler with several
    /// threads uses it to spread pinned fibers over them (a run queue
    /// hands the fiber only to that thread). Sound for any function set
    /// with [`set_function`](Fiber::set_function): its captures are `Send`,
    /// so it may start on any thread, and it then stays there.
    ///
    /// Pinning again before the first run moves the pin; a new
    /// `set_function` clears it. Pinning a started function to the thread
    /// it is pinned to already does nothing.
    ///
    /// ```
    /// use spindle_fiber::{Fiber, FiberAttr, FiberError, Priority, ThreadToken};
    ///
    /// let fiber = Fiber::<u32>::new(FiberAttr::new()).unwrap();
    /// fiber.set_function(Priority::NORMAL, || 7).unwrap();
    /// let worker = std::thread::spawn(ThreadToken::current).join().unwrap();
    /// fiber.pin_to(worker).unwrap();
    /// assert!(!fiber.may_run_here());
    /// assert!(matches!(fiber.run(), Err(FiberError::WrongThread(id)) if id == fiber.id()));
    /// fiber.pin_to(ThreadToken::current()).unwrap();
    /// assert_eq!(fiber.run().unwrap().unwrap_returned(), 7);
    /// ```
    ///
    /// # Errors
    ///
    /// Nothing changes, and the error says why:
    /// [`AlreadyStarted`](FiberError::AlreadyStarted) if the function has
    /// run on another thread (it stays there, also while it sleeps);
    /// [`Migratable`](FiberError::Migratable) for a function set with
    /// [`set_function_migratable`](Fiber::set_function_migratable) (it may
    /// run anywhere); and, as [`run`](Fiber::run) says them, the errors
    /// for a fiber with no function, a finished one, one that is running
    /// or queued, and one without a stack.
    pub fn pin_to(&self, thread: ThreadToken) -> Result<(), FiberError> {
        let h = self.header();
        if let Err(found) = h.state.transition(FiberState::Ready, FiberState::Locked) {
            return match found {
                // Asleep, so started: pinned since its first run (the
                // header's `pinned_to`, 0 for a migratable function).
                FiberState::Sleeping => match h.pinned_to.load(Ordering::Relaxed) {
                    0 => Err(FiberError::Migratable(h.id)),
                    t if t == thread.get() => Ok(()),
                    _ => Err(FiberError::AlreadyStarted(h.id)),
                },
                _ => Err(self.run_error(found)),
            };
        }
        // SAFETY: we hold the state `Locked`.
        let slot = unsafe { self.slot() };
        let result = if slot.coro.is_none() {
            // Its function was unwound on drop while a destructor kept a
            // reference: no function, no stack (as `run` says).
            Err(FiberError::NoStack(h.id))
        } else if slot.migratable {
            Err(FiberError::Migratable(h.id))
        } else if slot.pin != NO_PIN {
            // Started: pinned to `slot.pin` since its first run.
            if slot.pin == thread.get() {
                Ok(())
            } else {
                Err(FiberError::AlreadyStarted(h.id))
            }
        } else {
            // Read by `change_thread` at the first run, and by
            // `may_run_here` (published by the state store below).
            h.pinned_to.store(thread.get(), Ordering::Relaxed);
            Ok(())
        };
        // Still refused (no home taken): as in `set_home`.
        // SAFETY: we hold it `Locked`, and it was `Ready`.
        unsafe { self.let_go_ready() };
        result
    }

    /// The fiber's process-unique id.
    pub fn id(&self) -> FiberId {
        self.header().id
    }

    /// The fiber's name, if any.
    pub fn name(&self) -> Option<&str> {
        self.header().name.as_deref()
    }

    /// Its priority.
    #[inline]
    pub fn priority(&self) -> Priority {
        self.header().priority()
    }

    /// Changes its priority. A queued fiber keeps its place until it is
    /// next pushed, unless its queue says otherwise.
    pub fn set_priority(&self, p: Priority) {
        self.header().priority.store(p.0, Ordering::Relaxed);
    }

    /// Where it is in its life (a snapshot).
    pub fn state(&self) -> FiberState {
        self.header().state.load()
    }

    /// Usable stack bytes: of the stack it has, or had (a fiber whose
    /// suspended function was unwound while a destructor kept a reference
    /// to it has none any more; its `Debug` says so).
    pub fn stack_size(&self) -> usize {
        self.header().stack_size
    }

    /// A snapshot of its counters.
    pub fn stats(&self) -> FiberStats {
        self.header().stats()
    }

    /// A word for the scheduler's own use (0 until set), e.g. a pointer
    /// to its per-task record. Spindle never interprets it.
    pub fn sched_data(&self) -> usize {
        self.header().sched_data.load(Ordering::Acquire)
    }

    /// Sets the scheduler word (see [`sched_data`](Fiber::sched_data)).
    pub fn set_sched_data(&self, data: usize) {
        self.header().sched_data.store(data, Ordering::Release);
    }

    /// What the fiber last went to sleep on and where (see
    /// [`sleep_on`](crate::sleep_on)); meaningful while it is
    /// [`Sleeping`](FiberState::Sleeping).
    pub fn wait_site(&self) -> Option<(&'static str, &'static Location<'static>)> {
        self.header().wait_site()
    }

    /// Whether the fiber's last sleep began while its thread was
    /// panicking: a destructor that waits during an unwind (its own, or
    /// one the unwind of its drop runs). Cleared by
    /// [`set_function`](Fiber::set_function).
    ///
    /// Such a fiber cannot be unwound by dropping it while it is still
    /// suspended: a second unwind starting inside a destructor that runs
    /// during cleanup aborts the process, so dropping its last handle
    /// leaks its stack instead (counted by
    /// [`leaked_stacks`](crate::leaked_stacks)) and the rest of its
    /// destructors never run. A scheduler that shuts down should run it
    /// (once something wakes it) until it finishes, not drop it.
    ///
    /// ```
    /// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
    ///
    /// struct SleepsOnDrop;
    /// impl Drop for SleepsOnDrop {
    ///     fn drop(&mut self) {
    ///         spindle_fiber::sleep(); // waits for a wake, here during a panic
    ///     }
    /// }
    ///
    /// let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    /// fiber
    ///     .set_function(Priority::NORMAL, || {
    ///         let _s = SleepsOnDrop;
    ///         panic!("unwinds through a destructor that sleeps");
    ///     })
    ///     .unwrap();
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Slept)));
    /// assert!(fiber.slept_while_panicking());
    /// // Woken and run to the end, not dropped: its unwind finishes.
    /// fiber.waiter().wake();
    /// assert!(matches!(fiber.run(), Ok(RunOutcome::Panicked(_))));
    /// ```
    pub fn slept_while_panicking(&self) -> bool {
        self.header().slept_panicking.load(Ordering::Relaxed)
    }

    /// Interrupts the fiber's current or next interruptible wait, as
    /// [`Waiter::interrupt`](crate::Waiter::interrupt) does: marks an
    /// interrupt pending ([`set_interrupt`](Fiber::set_interrupt)) and wakes
    /// the fiber (the wake goes to its scheduler, as any wake does).
    pub fn interrupt(&self) {
        self.set_interrupt();
        self.waiter().wake();
    }

    /// Marks an interrupt pending for the fiber's current function
    /// without waking the fiber: its next interruptible wait returns at
    /// once, or the one it sleeps in now returns once something wakes it
    /// (a [`waiter`](Fiber::waiter)). For schedulers that must mark the
    /// fiber while they know which function it runs (under a lock of their
    /// own) and wake it afterwards. Returns whether the mark is new (false:
    /// one was pending already, so a wake for it was made before).
    pub fn set_interrupt(&self) -> bool {
        crate::current::mark_interrupt(self.header(), None)
    }

    /// A [`Waiter`](crate::Waiter) for this fiber. Waking it is what a
    /// primitive's waker does; a fiber woken while it sleeps on something
    /// that did not hand it anything sees a spurious wakeup (primitives
    /// check again and sleep on, as they do for any stale waiter).
    ///
    /// Its [`interrupt`](crate::Waiter::interrupt) reaches the function
    /// the fiber has now, not a later one.
    pub fn waiter(&self) -> crate::Waiter {
        // A counted reference handed to the waiter: the header is the
        // first field of the `repr(C)` allocation.
        let me = ManuallyDrop::new(self.clone());
        // SAFETY: `me` owns one reference, which the waiter takes over.
        unsafe { crate::current::Waiter::from_owned(me.inner.cast()) }
    }

    /// Whether two handles refer to the same fiber.
    pub fn ptr_eq(a: &Fiber<T>, b: &Fiber<T>) -> bool {
        a.inner == b.inner
    }

    /// Whether the fiber is `Ready` now: `Ok`, or the error [`run`](Fiber::run)
    /// and [`mark_queued`](Fiber::mark_queued) would give for the state it
    /// is in. A snapshot: another handle may change the state at once. For
    /// schedulers that refuse a fiber for a reason of their own (a full
    /// queue) and would rather report a fiber that cannot be queued at all.
    ///
    /// ```
    /// use spindle_fiber::{Fiber, FiberAttr, FiberError, Priority};
    ///
    /// let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
    /// assert!(matches!(fiber.check_ready(), Err(FiberError::NoFunction(_))));
    /// fiber.set_function(Priority::NORMAL, || ()).unwrap();
    /// assert!(fiber.check_ready().is_ok());
    /// ```
    ///
    /// # Errors
    ///
    /// The fiber is not `Ready`: as for [`run`](Fiber::run).
    pub fn check_ready(&self) -> Result<(), FiberError> {
        match self.header().state.load() {
            FiberState::Ready => Ok(()),
            found => Err(self.run_error(found)),
        }
    }

    fn run_error(&self, found: FiberState) -> FiberError {
        let id = self.header().id;
        match found {
            FiberState::Empty => FiberError::NoFunction(id),
            FiberState::Finished if self.header().stackless.load(Ordering::Relaxed) => {
                FiberError::NoStack(id)
            }
            FiberState::Finished => FiberError::Finished(id),
            FiberState::Queued => FiberError::Queued(id),
            FiberState::Sleeping => FiberError::Sleeping(id),
            FiberState::Running | FiberState::RunningWoken | FiberState::Locked | FiberState::Ready => {
                FiberError::Running(id)
            }
        }
    }

    fn busy_error(&self, found: FiberState) -> FiberError {
        let id = self.header().id;
        match found {
            FiberState::Running | FiberState::RunningWoken | FiberState::Locked => FiberError::Running(id),
            FiberState::Queued => FiberError::Queued(id),
            // Asleep is always mid-function: `Sleeping`'s advice (wait for
            // the wake, then run it) would lead to `Busy` next.
            _ => FiberError::Busy(id),
        }
    }
}

impl<T> Clone for Fiber<T> {
    fn clone(&self) -> Fiber<T> {
        // SAFETY: we own a reference.
        unsafe { Inner::retain(self.inner) };
        Fiber {
            inner: self.inner,
            _owns: PhantomData,
        }
    }
}

impl<T> Drop for Fiber<T> {
    fn drop(&mut self) {
        // SAFETY: we own one reference.
        unsafe { release(self.inner) }
    }
}

/// What `change_thread` found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ChangeThread {
    /// The fiber may run on this thread (its pin now says so).
    Moved,
    /// Pinned to another thread: it is `Ready` again.
    Refused,
    /// Pinned to another thread, and a wake came during the claim: it is
    /// held `Locked` for the caller to let go of (`let_go_ready`).
    RefusedHeld,
}

/// `Slot::pin` of a function that has not run yet: never a thread id, and
/// not the 0 that a thread without an id reads either.
const NO_PIN: u64 = u64::MAX;

/// Largest function (closure with its captures) kept on the fiber's stack
/// itself; larger ones are boxed (corosensei's limit is 1 KiB). A debug
/// build copies the closure again to call it, so on a minimum-size stack
/// (4 KiB) a closure near this size overflows (see `FiberAttr::stack_size`).
const MAX_INLINE_FUNCTION: usize = 256;

/// Largest alignment of a function kept on the fiber's stack itself: the
/// stack alignment of the ABI, which corosensei keeps anyway. A function
/// aligned more strictly is boxed.
const MAX_INLINE_ALIGN: usize = 16;

/// Drops one reference. If it was the last one and the fiber is suspended
/// mid-function, the count is brought back to one while the stack is
/// unwound: destructors on that stack may call `current()` or
/// `Waiter::current()` (which takes a new reference) safely. Exactly one
/// dropper sees the count reach zero, however many drop at once.
///
/// # Safety
/// The caller owns one reference to the live `Inner` at `ptr`, and gives
/// it up.
unsafe fn release<T>(ptr: NonNull<Inner<T>>) {
    // SAFETY: our reference keeps it alive until the decrement.
    if unsafe { ptr.as_ref() }.refs.fetch_sub(1, Ordering::Release) != 1 {
        return;
    }
    // Pairs with the Release decrements of every other dropper: what they
    // did to the fiber happens before what we do now.
    std::sync::atomic::fence(Ordering::Acquire);
    // Inside `defer_releases` on this thread: the rest waits for the end
    // of the scope (nobody can reach the fiber meanwhile: no reference is
    // left, and none can be made).
    if crate::defer::defer_last(ptr.cast(), release_last_erased::<T>) {
        return;
    }
    // SAFETY: the count was one, and it is ours now.
    unsafe { release_last(ptr) }
}

/// [`release_last`] for a deferred release.
///
/// # Safety
/// As `release_last`, for the `Inner<T>` whose header `h` is.
unsafe fn release_last_erased<T>(h: NonNull<Header>) {
    // SAFETY: the caller's contract.
    unsafe { release_last::<T>(h.cast()) }
}

/// The last reference's part of [`release`]: unwinds a suspended fiber
/// (or leaks its stack) and frees it.
///
/// # Safety
/// The count of the live `Inner` at `ptr` went from one to zero, and the
/// caller is the one who saw it (and fenced).
unsafe fn release_last<T>(ptr: NonNull<Inner<T>>) {
    // SAFETY: the count was one: nobody else holds or can make a reference
    // (there are no weak ones), so the slot is ours.
    let inner = unsafe { ptr.as_ref() };
    let (unwind_here, pool) = {
        // SAFETY: as above; this borrow of the slot ends here.
        let slot = unsafe { &mut *inner.slot.get() };
        // The thread's id word, not `thread_id()`: a thread with no id yet
        // (0) cannot be a fiber's pin, and dropping a fiber should not give
        // it one (with the overflow handler's alternate stack).
        // Built with `panic = "abort"`, a forced unwind would abort the
        // process: the stack is leaked (and counted) instead.
        // A fiber that went to sleep while its thread was panicking (a
        // destructor that waits during an unwind) is suspended inside that
        // destructor's cleanup: a forced unwind from there escapes a
        // destructor during cleanup, which aborts the process. Its stack
        // is leaked instead (found by a shutdown stress test: a joiner in a
        // destructor during its cancel unwind, dropped by the final drain).
        // The same holds for a fiber that yielded there, as far as the
        // panic hook lets us tell (`Header::may_be_suspended_in_panic`).
        let unwind = cfg!(panic = "unwind")
            && slot.coro.as_ref().is_some_and(|c| c.started() && !c.done())
            && (slot.migratable || slot.pin == crate::tls::thread_id_word())
            && !inner.header.slept_panicking.load(Ordering::Relaxed)
            && !inner.header.may_be_suspended_in_panic();
        (unwind, slot.pool)
    };
    // The forced unwind of the fiber this runs on, if the unwind below
    // handed it back: resumed once this fiber is released (see
    // `drop_payload`).
    let mut resume = None;
    if unwind_here {
        // Ours again for the unwind.
        inner.refs.store(1, Ordering::Relaxed);
        let mut coro = {
            // SAFETY: as above.
            let slot = unsafe { &mut *inner.slot.get() };
            // The function is over, whatever the unwind does: the fiber is
            // bound to no thread any more (`may_run_here`).
            slot.pin = NO_PIN;
            slot.coro.take().expect("checked above")
        };
        inner.header.pinned_to.store(0, Ordering::Relaxed);
        // From here the fiber has no stack of its own, whatever the unwind
        // does: a `run` through a reference a destructor takes meanwhile
        // gets `NoStack`, and so does every later one. (If no reference is
        // left at the end, the flag is freed with the fiber.)
        inner.header.stackless.store(true, Ordering::Relaxed);
        // Unwind with this fiber current, so that code in destructors sees
        // where it runs. Code that catches the forced unwind may suspend
        // again (corosensei then restarts the unwind): the fiber side never
        // writes the current fiber, so it stays right until the unwind is
        // over.
        inner.header.unwinding_for_drop.store(true, Ordering::Relaxed);
        inner
            .header
            .panicking_means_unwinding
            .store(!std::thread::panicking(), Ordering::Relaxed);
        // Suspensions during the unwind find no yielder and take the cold
        // path, which yields the thread from a destructor (there is no
        // runner to come back to) and restarts the unwind otherwise
        // (`current.rs`, `yield_without_yielder`). It can tell the two
        // apart only if this thread is not panicking now (see the flag).
        let yielder = inner.header.yielder.swap(std::ptr::null_mut(), Ordering::Relaxed);
        inner.header.drop_yielder.store(yielder, Ordering::Relaxed);
        // The unwind runs destructors on the fiber's stack, maybe on a thread
        // that never ran a fiber (a migratable one dropped anywhere): give it
        // an alternate signal stack, or an overflow there goes unreported.
        crate::overflow::ensure_altstack();
        let prev = enter(ptr.cast());
        let unwound = catch_unwind(AssertUnwindSafe(|| coro.force_unwind()));
        // SAFETY: the same thread as `enter`.
        unsafe { exit(prev) };
        inner.header.unwinding_for_drop.store(false, Ordering::Relaxed);
        inner
            .header
            .panicking_means_unwinding
            .store(false, Ordering::Relaxed);
        let unwound = match unwound {
            Ok(()) => true,
            Err(payload) => {
                // Code that caught the forced unwind panicked instead: this
                // is a drop, so the panic stops here.
                resume = crate::report::drop_payload(payload);
                false
            }
        };
        let stack = if unwound && coro.done() {
            Some(coro.into_stack())
        } else {
            let _ = ManuallyDrop::new(coro);
            crate::report::note_leaked_stack();
            None
        };
        // The function is over either way. Written while we still hold a
        // reference (and before the Release below): if a destructor kept
        // one, another thread may free the fiber as soon as we let go.
        inner
            .header
            .yielder
            .store(std::ptr::null_mut(), Ordering::Relaxed);
        inner
            .header
            .drop_yielder
            .store(std::ptr::null_mut(), Ordering::Relaxed);
        // Give up the reference taken back above.
        if inner.refs.fetch_sub(1, Ordering::Release) != 1 {
            // A destructor kept a reference: the fiber lives on without a
            // function or stack (`run` and `set_function` return
            // `NoStack`), and whoever drops that
            // reference last frees it. From here on only locals: the stack
            // goes back to the (static) pool.
            if let Some(stack) = stack {
                pool.give(stack);
            }
            if let Some(payload) = resume {
                std::panic::resume_unwind(payload);
            }
            return;
        }
        std::sync::atomic::fence(Ordering::Acquire);
        if let Some(stack) = stack {
            // SAFETY: the count reached zero again: the slot is ours.
            unsafe { (*inner.slot.get()).stack = Some(stack) };
        }
    }
    // SAFETY: the last reference is gone; the allocation came from
    // `Box::new` in `Fiber::new`.
    drop(unsafe { Box::from_raw(ptr.as_ptr()) });
    if let Some(payload) = resume {
        std::panic::resume_unwind(payload);
    }
}

impl<T> Drop for Inner<T> {
    fn drop(&mut self) {
        let slot = self.slot.get_mut();
        if let Some(mut coro) = slot.coro.take() {
            if !coro.started() {
                // Never ran: drop the closure (it is Send, so any thread
                // will do). No current fiber: the closure's destructor does not run
                // inside the fiber.
                match catch_unwind(AssertUnwindSafe(|| coro.force_unwind())) {
                    Ok(()) => slot.stack = Some(coro.into_stack()),
                    Err(payload) => {
                        // A capture's destructor panicked (contained: a
                        // drop does not panic), or it suspended the fiber
                        // this drop runs in, and that fiber is being
                        // unwound now because it was dropped: that unwind
                        // must go on through the fiber's frames (as in
                        // `install`), or its code after this drop would
                        // run inside its own drop. Either way the closure
                        // and the stack are leaked.
                        let _ = ManuallyDrop::new(coro);
                        crate::report::note_leaked_stack();
                        if crate::report::unwinding_current_for_drop() {
                            std::panic::resume_unwind(payload);
                        }
                        if let Some(forced) = crate::report::drop_payload(payload) {
                            std::panic::resume_unwind(forced);
                        }
                    }
                }
            } else {
                // Suspended, and `release` could not unwind it here: a
                // pinned fiber's stack may hold values that must not be
                // touched from this thread. Leak the stack rather than run
                // its destructors on the wrong thread.
                let _ = ManuallyDrop::new(coro);
                crate::report::note_leaked_stack();
                crate::report::warn_suspended_fiber_leaked(&self.header);
            }
        }
        if let Some(stack) = slot.stack.take() {
            slot.pool.give(stack);
        }
    }
}

impl<T> fmt::Debug for Fiber<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = self.header();
        let mut d = f.debug_struct("Fiber");
        let state = h.state.load();
        d.field("id", &h.id)
            .field("name", &h.name)
            .field("state", &state)
            .field("priority", &h.priority())
            .field("stack_size", &h.stack_size);
        if state == FiberState::Sleeping {
            if let Some((what, at)) = h.wait_site() {
                d.field("waits_on", &format_args!("{what} at {at}"));
            }
        }
        if h.stackless.load(Ordering::Relaxed) {
            // Its function was unwound on drop (NoStack): its stack went
            // back to the pool, or was leaked if the unwind could not end.
            d.field("stack", &"gone");
        }
        d.finish()
    }
}
