//! Per-task records: the join slot, cancellation, the executor-level sleep
//! slot. One allocation per task, type-erased for the queues the same way
//! fibers are (a `repr(C)` head plus a vtable).

use std::any::Any;
use std::cell::UnsafeCell;
use std::fmt;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use spindle_fiber::{FiberId, StackError, Waiter};
use spindle_sync::Semaphore;

use crate::scope::Finish;

/// A fiber's panic payload, as [`JoinError::Panicked`] carries it.
///
/// `Sync` although the payload (a `Box<dyn Any + Send>`) is not: a shared
/// reference only gives out the message and values of `Sync` types, and
/// the payload itself goes out by value. So `JoinError` is `Send + Sync`
/// and works with `?` into `Box<dyn Error + Send + Sync>` or `anyhow`.
pub struct PanicPayload(Box<dyn Any + Send>);

// SAFETY: through `&PanicPayload` the boxed value is only asked its type
// (`Any::type_id`, which reads no data) and lent out as `&T` for `T: Sync`
// (or as the `&str` of a `&'static str` or `String` payload); every other
// access takes the payload by value. Sharing the wrapper between threads
// therefore never shares a `!Sync` value.
unsafe impl Sync for PanicPayload {}

impl PanicPayload {
    pub(crate) fn new(payload: Box<dyn Any + Send>) -> PanicPayload {
        PanicPayload(payload)
    }

    /// The panic message, if the payload is a string (`panic!` with a
    /// message gives one).
    pub fn message(&self) -> Option<&str> {
        self.downcast_ref::<&'static str>()
            .copied()
            .or_else(|| self.downcast_ref::<String>().map(String::as_str))
    }

    /// The payload as a `T`, if it is one. `T` must be `Sync`: a
    /// `PanicPayload` is shared between threads, and a `&T` of a `!Sync`
    /// payload reached from two of them would be a data race:
    ///
    /// ```compile_fail,E0277
    /// fn peek(p: &spindle_executor::PanicPayload) {
    ///     let _ = p.downcast_ref::<std::cell::Cell<u8>>();
    /// }
    /// ```
    pub fn downcast_ref<T: Any + Sync>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }

    /// Whether the payload is a `T`.
    pub fn is<T: Any>(&self) -> bool {
        self.0.is::<T>()
    }

    /// The payload itself, e.g. for [`std::panic::resume_unwind`].
    pub fn into_inner(self) -> Box<dyn Any + Send> {
        self.0
    }
}

impl fmt::Debug for PanicPayload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PanicPayload").field(&self.message()).finish()
    }
}

/// Why [`JoinHandle::join`](crate::JoinHandle::join) did not return the fiber's value.
///
/// `Send + Sync + 'static`, so `?` converts it into the usual boxed errors:
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// fn answer() -> Result<u32, Box<dyn std::error::Error + Send + Sync>> {
///     let exec = spindle_executor::Executor::builder().workers(1).build();
///     Ok(exec.block_on(|| 42)?)
/// }
/// assert_eq!(answer().unwrap(), 42);
/// ```
#[non_exhaustive]
pub enum JoinError {
    /// The fiber panicked.
    Panicked {
        /// The fiber.
        fiber: FiberId,
        /// Its name, if any.
        name: Option<Arc<str>>,
        /// The panic payload.
        payload: PanicPayload,
    },
    /// The fiber was cancelled ([`JoinHandle::cancel`](crate::JoinHandle::cancel) or executor shutdown)
    /// and unwound. (At shutdown, a fiber the final drain drops is unwound
    /// just after its join is failed, before the shutdown completes (before
    /// the executor's drop returns, unless it was dropped on an executor's
    /// thread, where the shutdown runs on a thread of its own);
    /// one asleep in a plain wait on a `spindle-sync` primitive is not
    /// unwound by the shutdown at all: see [`Executor`](crate::Executor).)
    Cancelled {
        /// The fiber, if it had started.
        fiber: Option<FiberId>,
        /// Its name, if any.
        name: Option<Arc<str>>,
    },
    /// The joiner would wait forever: nothing is runnable, no timer is
    /// pending, and the remaining fibers all sleep. The report lists them.
    Deadlock {
        /// The sleeping fibers, what each waits on and where (the first 64
        /// by name, the rest counted).
        report: String,
    },
    /// The fiber joined its own handle (it had been handed it, say through
    /// a channel): it would wait for its own end forever. The join fails at
    /// once, and the fiber goes on; the handle is let go, as after any
    /// failed join.
    JoinedItself {
        /// The fiber.
        fiber: FiberId,
        /// Its name, if any.
        name: Option<Arc<str>>,
    },
    /// The job never started: no stack could be mapped for its fiber, and
    /// no fiber stack that could be freed was left in the process (or the
    /// mapping was refused outright, not for lack of memory).
    NoStack {
        /// Its name, if any.
        name: Option<Arc<str>>,
        /// Why the stack could not be mapped.
        error: StackError,
    },
}

impl JoinError {
    /// The panic message, if this is a panic with a string payload.
    pub fn panic_message(&self) -> Option<&str> {
        match self {
            JoinError::Panicked { payload, .. } => payload.message(),
            _ => None,
        }
    }

    /// Whether the fiber was cancelled.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, JoinError::Cancelled { .. })
    }

    /// Whether the join was failed by deadlock detection.
    pub fn is_deadlock(&self) -> bool {
        matches!(self, JoinError::Deadlock { .. })
    }
}

fn describe(fiber: Option<&FiberId>, name: &Option<Arc<str>>) -> String {
    match (name, fiber) {
        (Some(n), Some(id)) => format!("fiber '{n}' ({id})"),
        (Some(n), None) => format!("fiber '{n}' (not started)"),
        (None, Some(id)) => format!("fiber {id}"),
        (None, None) => "a fiber that had not started".to_owned(),
    }
}

impl fmt::Display for JoinError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JoinError::Panicked { fiber, name, .. } => {
                write!(f, "{} panicked", describe(Some(fiber), name))?;
                if let Some(m) = self.panic_message() {
                    write!(f, ": {m}")?;
                }
                Ok(())
            }
            JoinError::Cancelled { fiber, name } => {
                write!(
                    f,
                    "{} was cancelled before it finished (by a cancel on its handle, or by the \
                     executor's shutdown)",
                    describe(fiber.as_ref(), name)
                )
            }
            JoinError::NoStack { name, error } => {
                match name {
                    Some(n) => write!(f, "fiber '{n}'")?,
                    None => f.write_str("a fiber")?,
                }
                write!(
                    f,
                    " never started: no stack could be mapped for it, and no fiber that could free \
                     one was left ({error}; the executor's stack size is Builder::stack_size)"
                )
            }
            JoinError::JoinedItself { fiber, name } => write!(
                f,
                "{} joined its own handle: a fiber cannot wait for its own end (join it from another \
                 fiber or a thread, or drop the handle to let the fiber run on its own)",
                describe(Some(fiber), name)
            ),
            JoinError::Deadlock { report } => write!(
                f,
                "deadlock: the joined fiber can never finish (nothing runnable, no timer pending) \
                 (if a thread outside the executor will wake it, raise Builder::deadlock_grace or \
                 use OnDeadlock::Report); sleeping fibers:\n{report}"
            ),
        }
    }
}

/// The variant, then the message (`Display`), so that an `unwrap` of a
/// join reads as a sentence and still says which case it was:
/// `Panicked: fiber 'worker' (#3) panicked: oops`.
impl fmt::Debug for JoinError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let variant = match self {
            JoinError::Panicked { .. } => "Panicked",
            JoinError::Cancelled { .. } => "Cancelled",
            JoinError::Deadlock { .. } => "Deadlock",
            JoinError::JoinedItself { .. } => "JoinedItself",
            JoinError::NoStack { .. } => "NoStack",
        };
        write!(f, "{variant}: {self}")
    }
}

impl std::error::Error for JoinError {}

/// The payload a cancelled fiber unwinds with.
pub(crate) struct Cancelled;

/// Executor-level sleep: whoever takes the waiter (the timer or a wake)
/// wakes the fiber.
#[derive(Default)]
pub(crate) struct SleepSlot {
    pub(crate) waiter: Option<Waiter>,
    pub(crate) timed_out: bool,
    /// Incremented per sleep; a timer fires only the sleep it was set for.
    pub(crate) generation: u64,
}

/// The erased head of every task. The function pointers are monomorphised
/// for the task's value and closure types.
pub(crate) struct TaskHead {
    vtable: &'static TaskVTable,
    /// The fiber the task runs on, once started (0: not yet).
    pub(crate) started_fiber: AtomicU64,
    pub(crate) name: Option<Arc<str>>,
    /// Set by `cancel`; read by workers before running and by the fiber at
    /// executor suspension points.
    pub(crate) cancelled: AtomicBool,
    /// Set when the fiber is known to be unwinding: its cancel unwind
    /// starts, a cancellation point finds it unwinding from a panic, or
    /// the worker sees it switch out mid-unwind (see `ops::check_cancel`);
    /// cleared by the worker when it resumes the fiber on a thread that is
    /// not panicking (the unwind was caught).
    pub(crate) unwinding: AtomicBool,
    /// Set once when the task is complete (value or error stored).
    pub(crate) finished: AtomicBool,
    /// Set when the `JoinHandle` is dropped: the value is then dropped by
    /// the handle's drop or by the fiber that made it, never left for the
    /// last reference (which may be a worker thread, outside any fiber).
    /// Also set by a `join` that took a finished task's outcome, which
    /// tells the handle's drop that nothing is left.
    pub(crate) detached: AtomicBool,
    /// Set when a handle dropped on a panicking thread contained a panic
    /// of the value's drop: a scope reports it.
    pub(crate) value_drop_panicked: AtomicBool,
    /// Released once on completion, and by deadlock detection.
    pub(crate) done: Semaphore,
    /// Boxed: errors are rare and the head stays small.
    pub(crate) error: Mutex<Option<Box<JoinError>>>,
    pub(crate) sleep: Mutex<SleepSlot>,
    /// `interrupt_after` calls of the task's fiber whose deadline has
    /// fired and that have not returned yet: while there is one, the worker
    /// interrupts the fiber whenever it sleeps (deadlines are sticky).
    pub(crate) fired_deadlines: AtomicUsize,
}

struct TaskVTable {
    retain: unsafe fn(NonNull<TaskHead>),
    release: unsafe fn(NonNull<TaskHead>),
    /// Runs the closure (once) and stores its value.
    run_job: unsafe fn(NonNull<TaskHead>),
    /// Drops the closure without running it.
    drop_job: unsafe fn(NonNull<TaskHead>),
}

/// The part of a task its `JoinHandle<T>` reads: a prefix of every
/// `TaskCell<T, F>` (both `repr(C)`).
#[repr(C)]
pub(crate) struct TaskPrefix<T> {
    head: TaskHead,
    pub(crate) result: Mutex<Option<T>>,
}

/// A task: one allocation holding its head, its value slot and its closure.
///
/// Whatever the task still holds when the last reference goes (a closure
/// that never ran, a panic payload) is dropped then, wherever that is
/// (often a worker thread, outside any fiber), so its destructors are
/// contained: a panic there is reported by the panic hook and goes no
/// further. A value is never left for the last reference: `join` takes it,
/// or the handle's drop or the fiber drops it (see `TaskHead::detached`).
#[repr(C)]
pub(crate) struct TaskCell<T, F> {
    head: TaskHead,
    result: Mutex<Option<T>>,
    /// Taken once, by the worker that starts the task (or drops it).
    job: UnsafeCell<Option<F>>,
    /// A scoped task's scope: told the task is over only once everything
    /// above has been dropped (`Drop` below), since `T` and `F` may borrow
    /// what the scope protects.
    scope: Option<Finish>,
}

impl<T: Send, F: FnOnce() -> T + Send> TaskCell<T, F> {
    const VTABLE: TaskVTable = TaskVTable {
        retain: Self::retain,
        release: Self::release,
        run_job: Self::run_job,
        drop_job: Self::drop_job,
    };

    /// A new task and the typed handle to it.
    ///
    /// # Safety
    /// If `F` or `T` borrow anything, the caller keeps it alive until the
    /// task itself is dropped (the erased `TaskRef` hides those lifetimes),
    /// which `scope` tells through [`Finish::done`].
    pub(crate) unsafe fn create(name: Option<Arc<str>>, f: F, scope: Option<Finish>) -> TaskRef {
        let cell: Arc<TaskCell<T, F>> = Arc::new(TaskCell {
            head: TaskHead {
                vtable: &Self::VTABLE,
                started_fiber: AtomicU64::new(0),
                name,
                cancelled: AtomicBool::new(false),
                unwinding: AtomicBool::new(false),
                finished: AtomicBool::new(false),
                detached: AtomicBool::new(false),
                value_drop_panicked: AtomicBool::new(false),
                done: Semaphore::new(0),
                error: Mutex::new(None),
                sleep: Mutex::new(SleepSlot::default()),
                fired_deadlines: AtomicUsize::new(0),
            },
            result: Mutex::new(None),
            job: UnsafeCell::new(Some(f)),
            scope,
        });
        let raw: *const TaskCell<T, F> = Arc::into_raw(cell);
        // SAFETY: Arc::into_raw is never null; the head is the first field.
        TaskRef(unsafe { NonNull::new_unchecked(raw as *mut TaskHead) }, PhantomData)
    }

    unsafe fn retain(h: NonNull<TaskHead>) {
        // SAFETY: h is the head of a live Arc<TaskCell<T, F>>.
        unsafe { Arc::increment_strong_count(h.as_ptr() as *const Self) }
    }

    unsafe fn release(h: NonNull<TaskHead>) {
        // SAFETY: the caller owns one strong reference.
        unsafe { drop(Arc::from_raw(h.as_ptr() as *const Self)) }
    }

    unsafe fn run_job(h: NonNull<TaskHead>) {
        // SAFETY: h is the head of a live TaskCell<T, F>; the job slot is
        // touched only by the one worker that starts or drops the task.
        let cell = unsafe { &*(h.as_ptr() as *const Self) };
        // SAFETY: as above: this worker is the only one touching the slot.
        let f = unsafe { (*cell.job.get()).take() }.expect("a task's closure runs once");
        let value = f();
        *cell.result.lock() = Some(value);
        // Nobody will join it: drop it here, on the fiber, where a `Drop`
        // that waits (joins another task, say) puts this fiber to sleep.
        // Left in the cell, it would be dropped with the last reference,
        // often by the worker after the fiber ends: a wait there blocks the
        // worker thread, and with it every fiber pinned to that worker,
        // possibly the very one the wait is for (found by an adversarial
        // run). Either this look or the handle's drop takes the value: the
        // handle sets `detached` before it locks `result`, so if its lock
        // came first, this look (after ours) sees the flag.
        if cell.head.detached.load(Ordering::Relaxed) {
            let value = cell.result.lock().take();
            drop(value);
        }
    }

    unsafe fn drop_job(h: NonNull<TaskHead>) {
        // SAFETY: as in run_job.
        let cell = unsafe { &*(h.as_ptr() as *const Self) };
        // SAFETY: as in run_job.
        let job = unsafe { (*cell.job.get()).take() };
        // On a worker thread, outside any fiber: a panicking destructor of
        // the closure's captures must not take the worker down, nor may
        // the drop of its panic's payload.
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| drop(job))) {
            if let Some(forced) = drop_payload(payload) {
                std::panic::resume_unwind(forced);
            }
        }
    }
}

/// Drops a caught panic's payload without letting a panic of its own drop
/// (`panic_any` of a value whose `Drop` panics) escape: that second
/// payload is leaked. A worker contains the first panic of a closure's or
/// a panic payload's drop this way, and a handle dropped on a panicking
/// thread that of a value's drop; neither must die of the second.
///
/// One unwind is handed back instead: a payload whose drop suspended the
/// running fiber, which was then dropped, comes back with that fiber's
/// forced unwind, which the caller must resume (`resume_unwind`) once its
/// own bookkeeping is done, so that it goes on through the fiber's frames
/// (its code after this drop would otherwise run inside its own drop).
#[must_use = "a forced unwind handed back must be resumed"]
pub(crate) fn drop_payload(payload: Box<dyn Any + Send>) -> Option<Box<dyn Any + Send>> {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        if unwinding_current_for_drop() {
            return Some(again);
        }
        std::mem::forget(again);
    }
    None
}

/// Whether an unwind just caught must be passed on because it is the
/// running fiber's forced unwind: the fiber is being unwound because it
/// was dropped (it cannot sleep), and the thread is not unwinding from
/// another panic (passing it on would abort).
fn unwinding_current_for_drop() -> bool {
    spindle_fiber::in_fiber() && !spindle_fiber::may_sleep() && !std::thread::panicking()
}

impl<T, F> Drop for TaskCell<T, F> {
    fn drop(&mut self) {
        // A panic, or a cancel that unwound a started fiber, nobody joined
        // (a job cancelled before it started did not unwind), or a job that
        // never started for want of a stack: a scope reports each at its
        // end, as `std::thread::scope` does a panic.
        let unwound = matches!(
            self.head.error.get_mut().as_deref(),
            Some(
                JoinError::Panicked { .. }
                    | JoinError::Cancelled { fiber: Some(_), .. }
                    | JoinError::NoStack { .. }
            )
        );
        let (result, job, error) =
            (self.result.get_mut().take(), self.job.get_mut().take(), self.head.error.get_mut().take());
        // For the scope's final panic: what happened to it.
        let what = match (&self.scope, &error) {
            (Some(_), Some(e)) if unwound => Some(e.to_string()),
            _ => None,
        };
        // Contained (see the type's docs); the panic hook has reported it.
        let mut forced_unwind = None;
        let panicked = match catch_unwind(AssertUnwindSafe(|| drop((result, job, error)))) {
            Ok(()) => false,
            // A drop above suspended the fiber this runs on, which was
            // then dropped: its forced unwind goes on (after the scope is
            // told, below), as in `drop_payload`.
            Err(payload) if unwinding_current_for_drop() => {
                forced_unwind = Some(payload);
                false
            }
            Err(payload) => {
                forced_unwind = drop_payload(payload);
                true
            }
        };
        // A value's drop that its handle contained (see `JoinHandle`'s drop).
        let value_panicked = self.head.value_drop_panicked.load(Ordering::Relaxed);
        if let Some(scope) = self.scope.take() {
            let what = match (what, panicked, value_panicked) {
                (Some(w), _, _) => Some(w),
                (None, _, true) => Some(match &self.head.name {
                    Some(n) => format!("the value of fiber '{n}' panicked when dropped"),
                    None => "a fiber's value panicked when dropped".to_owned(),
                }),
                (None, true, false) => Some(match &self.head.name {
                    Some(n) => format!("what fiber '{n}' left (its closure or panic) panicked when dropped"),
                    None => "what a fiber left (its closure or panic) panicked when dropped".to_owned(),
                }),
                (None, false, false) => None,
            };
            // Only now: nothing of the task's can touch the scope's borrows.
            scope.done(what);
        }
        if let Some(payload) = forced_unwind {
            std::panic::resume_unwind(payload);
        }
    }
}

/// A counted, type-erased reference to a task.
pub(crate) struct TaskRef(NonNull<TaskHead>, PhantomData<TaskHead>);

// SAFETY: TaskHead's fields are Sync (atomics, mutexes, a semaphore); the
// typed part is only touched through the JoinHandle<T> and the fiber.
unsafe impl Send for TaskRef {}
// SAFETY: as above.
unsafe impl Sync for TaskRef {}

impl TaskRef {
    /// Runs the task's closure and stores its value.
    ///
    /// # Safety
    /// Called once, by the worker that started the task.
    pub(crate) unsafe fn run_job(&self) {
        // SAFETY: the caller's contract.
        unsafe { (self.vtable.run_job)(self.0) }
    }

    /// Drops the task's closure without running it (cancelled or shut down
    /// before it started).
    ///
    /// # Safety
    /// Called by the worker that holds the task's job, instead of running it.
    pub(crate) unsafe fn drop_job(&self) {
        // SAFETY: the caller's contract.
        unsafe { (self.vtable.drop_job)(self.0) }
    }

    /// The task's value slot (the typed part a `JoinHandle<T>` reads).
    ///
    /// # Safety
    /// The task was created as a `TaskCell<T, _>` of this `T`.
    pub(crate) unsafe fn result<T>(&self) -> &Mutex<Option<T>> {
        // SAFETY: TaskCell<T, F> starts with the fields of TaskPrefix<T>
        // (both repr(C)). Only the field is borrowed, through a raw place:
        // a reference to a whole `TaskPrefix<T>` would also cover its
        // trailing padding, which in the cell may be the closure slot
        // (`job`) that the worker writes while the handle looks (Stacked
        // and Tree Borrows count the reference's creation as a read of all
        // the bytes it covers).
        unsafe { &*std::ptr::addr_of!((*self.0.as_ptr().cast::<TaskPrefix<T>>()).result) }
    }

    /// The address `into_raw` gives for this task (without a reference).
    pub(crate) fn as_raw(&self) -> usize {
        self.0.as_ptr() as usize
    }

    /// The raw pointer, keeping the reference (for a fiber's sched word).
    pub(crate) fn into_raw(self) -> usize {
        let p = self.0.as_ptr() as usize;
        std::mem::forget(self);
        p
    }

    /// # Safety
    /// `raw` came from `into_raw` and is consumed.
    pub(crate) unsafe fn from_raw(raw: usize) -> TaskRef {
        // SAFETY: the caller's contract.
        TaskRef(unsafe { NonNull::new_unchecked(raw as *mut TaskHead) }, PhantomData)
    }

    /// A new counted reference from a raw one that stays held elsewhere.
    ///
    /// # Safety
    /// `raw` came from `into_raw` and its reference is still held.
    pub(crate) unsafe fn clone_raw(raw: usize) -> TaskRef {
        // SAFETY: the caller's contract; the original stays owned elsewhere.
        let borrowed = std::mem::ManuallyDrop::new(unsafe { TaskRef::from_raw(raw) });
        TaskRef::clone(&borrowed)
    }

    /// # Safety
    /// `raw` came from `into_raw` and its reference is still held elsewhere.
    pub(crate) unsafe fn borrow_raw<'a>(raw: usize) -> &'a TaskHead {
        // SAFETY: the caller's contract.
        unsafe { &*(raw as *const TaskHead) }
    }

    /// Stores the outcome and wakes the joiner.
    pub(crate) fn complete(&self, error: Option<JoinError>) {
        if let Some(e) = error {
            *self.error.lock() = Some(Box::new(e));
        }
        self.finished.store(true, Ordering::Release);
        self.done.release(1);
    }
}

impl Clone for TaskRef {
    fn clone(&self) -> TaskRef {
        // SAFETY: we own a strong reference.
        unsafe { (self.vtable.retain)(self.0) };
        TaskRef(self.0, PhantomData)
    }
}

impl Drop for TaskRef {
    fn drop(&mut self) {
        // SAFETY: we own a strong reference.
        unsafe { (self.vtable.release)(self.0) }
    }
}

impl std::ops::Deref for TaskRef {
    type Target = TaskHead;
    fn deref(&self) -> &TaskHead {
        // SAFETY: we own a strong reference.
        unsafe { self.0.as_ref() }
    }
}
