//! Structured concurrency: fibers that may borrow from the caller because
//! they are all joined before the scope returns.

use std::fmt;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spindle_sync::Semaphore;

use crate::executor::{Handle, JoinHandle, SpawnOptions};
use crate::task::{JoinError, TaskCell};

/// A scope to spawn borrowing fibers in; see [`Executor::scope`](crate::Executor::scope).
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// use spindle_executor::Executor;
///
/// let exec = Executor::builder().workers(2).build();
/// let data = vec![1, 2, 3, 4];
/// let mut total = 0;
/// exec.scope(|s| {
///     let halves: Vec<_> = data.chunks(2).map(|c| s.spawn(move || c.iter().sum::<i32>())).collect();
///     total = halves.into_iter().map(|h| h.join().unwrap()).sum();
/// });
/// assert_eq!(total, 10);
/// ```
///
/// A scoped fiber may run on any worker: what it captures and returns must
/// be `Send`, as with `spawn`:
///
/// ```compile_fail,E0277
/// let exec = spindle_executor::Executor::builder().workers(1).build();
/// let c = std::cell::Cell::new(0);
/// exec.scope(|s| {
///     s.spawn(|| c.set(1));
/// });
/// ```
///
/// ```compile_fail,E0277
/// let exec = spindle_executor::Executor::builder().workers(1).build();
/// exec.scope(|s| {
///     let _ = s.spawn(|| std::rc::Rc::new(1)).join();
/// });
/// ```
///
/// It may borrow what outlives the scope, not the scope body's own locals
/// (the body returns before the fibers are joined):
///
/// ```compile_fail,E0373
/// let exec = spindle_executor::Executor::builder().workers(1).build();
/// exec.scope(|s| {
///     let local = vec![1u8];
///     s.spawn(|| local.len());
/// });
/// ```
///
/// And its join handle cannot leave the scope, by return or otherwise:
///
/// ```compile_fail
/// let exec = spindle_executor::Executor::builder().workers(1).build();
/// let data = vec![1u8];
/// let handle = exec.scope(|s| s.spawn(|| data.len()));
/// ```
///
/// ```compile_fail,E0521
/// let exec = spindle_executor::Executor::builder().workers(1).build();
/// let data = vec![1u8];
/// let mut out = Vec::new();
/// exec.scope(|s| {
///     out.push(s.spawn(|| data.len()));
/// });
/// ```
pub struct Scope<'scope, 'env: 'scope> {
    handle: Handle,
    state: Arc<ScopeState>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("pending", &self.state.pending.load(std::sync::atomic::Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

struct ScopeState {
    /// Fibers spawned in the scope whose tasks are not yet dropped.
    pending: AtomicUsize,
    /// Released once per dropped task.
    done: Semaphore,
    /// Scoped fibers that unwound (panic or cancellation) and whose join
    /// did not report it, or whose value panicked when dropped.
    unwound: AtomicUsize,
    /// What happened to the first of them, for the scope's panic.
    first_unwound: parking_lot::Mutex<Option<String>>,
}

/// A scoped task's hold on its scope, given up by the task when it is
/// dropped, after its value and closure (see `TaskCell`): only then can
/// nothing of the task's reach the borrows the scope protects. As with
/// `std::thread::scope`, a task kept alive forever (a leaked
/// `ScopedJoinHandle`) keeps its scope waiting forever.
pub(crate) struct Finish(Arc<ScopeState>);

impl Finish {
    /// The task is gone; `unwound`: it unwound or its value panicked when
    /// dropped, and no join reported it (what happened, for the report).
    pub(crate) fn done(self, unwound: Option<String>) {
        if let Some(what) = unwound {
            self.0.first_unwound.lock().get_or_insert(what);
            self.0.unwound.fetch_add(1, Ordering::AcqRel);
        }
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
        self.0.done.release(1);
    }
}

/// A join handle of a scoped fiber.
pub struct ScopedJoinHandle<'scope, T> {
    inner: JoinHandle<T>,
    _scope: PhantomData<&'scope ()>,
}

impl<T: Send> ScopedJoinHandle<'_, T> {
    /// Waits for the fiber; see [`JoinHandle::join`]. A panic or
    /// cancellation returned here is reported: the scope need not panic
    /// for it.
    ///
    /// # Errors
    ///
    /// As [`JoinHandle::join`]: the fiber panicked or was cancelled, never
    /// started (no stack), deadlock detection failed the join, or the
    /// fiber joined its own handle ([`JoinError::JoinedItself`]).
    #[track_caller]
    pub fn join(self) -> Result<T, JoinError> {
        self.inner.join()
    }

    /// Waits at most `timeout` for the fiber; see
    /// [`JoinHandle::wait_timeout`].
    #[track_caller]
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> bool {
        self.inner.wait_timeout(timeout)
    }

    /// Waits until `deadline` for the fiber; see [`JoinHandle::wait_until`].
    #[track_caller]
    pub fn wait_until(&self, deadline: std::time::Instant) -> bool {
        self.inner.wait_until(deadline)
    }

    /// Whether the fiber has completed.
    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }

    /// Asks the fiber to stop; see [`JoinHandle::cancel`].
    pub fn cancel(&self) {
        self.inner.cancel()
    }

    /// Ends a [`sleep`](crate::sleep), [`sleep_until`](crate::sleep_until)
    /// or [`yield_timeout`](crate::yield_timeout) of the fiber early; see
    /// [`JoinHandle::wake`].
    pub fn wake(&self) {
        self.inner.wake()
    }

    /// The id of the fiber running the task, once it has started; see
    /// [`JoinHandle::fiber_id`] (fibers are reused).
    pub fn fiber_id(&self) -> Option<spindle_fiber::FiberId> {
        self.inner.fiber_id()
    }
}

impl<T> fmt::Debug for ScopedJoinHandle<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ScopedJoinHandle").field(&self.inner).finish()
    }
}

impl<'scope> Scope<'scope, '_> {
    /// Spawns a fiber that may borrow anything that outlives the scope.
    pub fn spawn<F, T>(&'scope self, f: F) -> ScopedJoinHandle<'scope, T>
    where
        F: FnOnce() -> T + Send + 'scope,
        T: Send + 'scope,
    {
        self.spawn_with(SpawnOptions::default(), f)
    }

    /// Like [`spawn`](Scope::spawn), with a name and priority.
    pub fn spawn_with<F, T>(&'scope self, options: SpawnOptions, f: F) -> ScopedJoinHandle<'scope, T>
    where
        F: FnOnce() -> T + Send + 'scope,
        T: Send + 'scope,
    {
        self.state.pending.fetch_add(1, Ordering::AcqRel);
        let finish = Finish(Arc::clone(&self.state));
        // SAFETY: the closure and its value may borrow data of lifetime
        // 'scope. `scope` does not return (nor unwind past its frame)
        // before `pending` is zero, i.e. before every scoped task has been
        // dropped, and a task calls `Finish::done` only after dropping its
        // closure and any value nobody took. Once started, the closure
        // lives on the fiber's stack, not in the task: what keeps the task
        // (and so `Finish`) alive until that stack is done is the task
        // reference the fiber's function holds (`runner` in
        // `Worker::start`), dropped only when the function returns or its
        // stack is unwound. A shutdown that completes a sleeping scoped
        // fiber's task as cancelled therefore still waits for its stack
        // (test `a_scoped_fiber_asleep_at_shutdown_is_unwound_before_the_scope_returns`).
        // So the borrows outlive every use, as with std::thread::scope.
        let task = unsafe { TaskCell::create(options.name.clone(), f, Some(finish)) };
        self.handle.push(task.clone(), options_priority(&options));
        ScopedJoinHandle {
            inner: JoinHandle::from_parts(task, Arc::clone(&self.handle.shared)),
            _scope: PhantomData,
        }
    }
}

fn options_priority(o: &SpawnOptions) -> spindle_fiber::Priority {
    o.priority_value()
}

/// What a scope's owner waits on, in deadlock reports.
static SCOPE_WAIT: spindle_fiber::WaitReason =
    spindle_fiber::WaitReason("the end of a scope's fibers (Executor::scope)");

#[track_caller]
pub(crate) fn scope<'env, F, R>(handle: &Handle, f: F) -> R
where
    F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> R,
{
    let scope = Scope {
        handle: handle.clone(),
        state: Arc::new(ScopeState {
            pending: AtomicUsize::new(0),
            done: Semaphore::new(0),
            unwound: AtomicUsize::new(0),
            first_unwound: parking_lot::Mutex::new(None),
        }),
        _scope: PhantomData,
        _env: PhantomData,
    };
    // The body's unwind, if any, is caught first and resumed once every
    // scoped fiber is done: waiting while unwinding would leave this thread
    // "panicking" for every fiber that runs on it meanwhile.
    let result = catch_unwind(AssertUnwindSafe(|| f(&scope)));
    let state = &scope.state;
    // Waits by blocking the thread if the wait below is itself unwound (a
    // woken fiber dropped before it ran again is unwound from its sleep):
    // `scope` must not be left while scoped fibers may use the borrows.
    struct WaitWhileUnwinding<'a>(&'a ScopeState);
    impl Drop for WaitWhileUnwinding<'_> {
        fn drop(&mut self) {
            while self.0.pending.load(Ordering::Acquire) > 0 {
                std::thread::yield_now();
            }
        }
    }
    let unwinding = WaitWhileUnwinding(state);
    if spindle_fiber::in_fiber() && !spindle_fiber::may_sleep() {
        // The stack of a dropped fiber being unwound, which cannot suspend:
        // block the thread (the scoped fibers must finish elsewhere).
        while state.pending.load(Ordering::Acquire) > 0 {
            std::thread::yield_now();
        }
    } else if spindle_fiber::in_fiber() {
        // A fiber sleeps (its worker runs the scoped fibers meanwhile).
        while state.pending.load(Ordering::Acquire) > 0 {
            state.done.acquire_for(&SCOPE_WAIT);
        }
    } else if state.pending.load(Ordering::Acquire) > 0 {
        // A thread blocks, visible to deadlock detection.
        let shared = &scope.handle.shared;
        shared.blocked_scopes.fetch_add(1, Ordering::AcqRel);
        shared.blocked_generation.fetch_add(1, Ordering::AcqRel);
        shared.sysmon_unparker.unpark();
        while state.pending.load(Ordering::Acquire) > 0 {
            state.done.acquire_for(&SCOPE_WAIT);
        }
        shared.blocked_scopes.fetch_sub(1, Ordering::AcqRel);
    }
    std::mem::forget(unwinding);
    match result {
        // Noted for spindle-fiber (the sleep above cleared the panic's
        // mark): a destructor that yields in this unwind must not lead to
        // an abort if the fiber is dropped there.
        Err(payload) => spindle_fiber::resume_unwind(payload),
        Ok(_) if state.unwound.load(Ordering::Acquire) > 0 => {
            // A scope in a fiber that was cancelled, or whose executor is
            // shutting down (which cancels the scoped fibers too), ends as
            // cancelled: its join says `Cancelled`, not that it panicked.
            crate::ops::check_cancel();
            let n = state.unwound.load(Ordering::Acquire);
            let first = state.first_unwound.lock().take().unwrap_or_default();
            let more = if n > 1 { format!(" (and {} more)", n - 1) } else { String::new() };
            panic!(
                "a fiber spawned in a spindle-executor scope panicked, was cancelled or never started, \
                 and was not joined: {first}{more} (join its ScopedJoinHandle to handle that outcome \
                 yourself)"
            )
        }
        Ok(r) => r,
    }
}
