//! Structured concurrency: fibers that may borrow from the caller because
//! they are all joined before the scope returns.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spindle_sync::Semaphore;

use crate::executor::{Handle, JoinHandle, SpawnOptions};
use crate::task::{JoinError, TaskCell};

/// A scope to spawn borrowing fibers in; see [`Executor::scope`](crate::Executor::scope).
///
/// ```
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
pub struct Scope<'scope, 'env: 'scope> {
    handle: Handle,
    state: Arc<ScopeState>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

struct ScopeState {
    /// Fibers spawned in the scope and not yet done.
    pending: AtomicUsize,
    /// Released once per finished fiber.
    done: Semaphore,
    /// Scoped fibers that unwound (panic or cancellation) and whose join has
    /// not reported it.
    unwound: AtomicUsize,
}

/// Decrements the scope's count when the fiber's closure is gone (run,
/// unwound, or dropped without running).
struct Finish(Arc<ScopeState>);

impl Drop for Finish {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.unwound.fetch_add(1, Ordering::AcqRel);
        }
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
        self.0.done.release(1);
    }
}

/// A join handle of a scoped fiber.
pub struct ScopedJoinHandle<'scope, T> {
    inner: JoinHandle<T>,
    state: Arc<ScopeState>,
    _scope: PhantomData<&'scope ()>,
}

impl<T: Send> ScopedJoinHandle<'_, T> {
    /// Waits for the fiber; see [`JoinHandle::join`].
    #[track_caller]
    pub fn join(self) -> Result<T, JoinError> {
        let r = self.inner.join();
        if matches!(r, Err(JoinError::Panicked { .. } | JoinError::Cancelled { .. })) {
            // Reported here: the scope need not panic for it.
            self.state.unwound.fetch_sub(1, Ordering::AcqRel);
        }
        r
    }

    /// Whether the fiber has completed.
    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
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
        let body = move || {
            let _finish = finish;
            f()
        };
        // SAFETY: the closure may borrow data of lifetime 'scope. `scope`
        // does not return (nor unwind past its frame) before `pending` is
        // zero, i.e. before every such closure has been run or dropped
        // (`Finish` is dropped with the closure in every case). So the
        // borrows outlive every use, as with std::thread::scope.
        let task = unsafe { TaskCell::create(options.name.clone(), body) };
        self.handle.push(task.clone(), options_priority(&options));
        ScopedJoinHandle {
            inner: JoinHandle::from_parts(task, Arc::clone(&self.handle.shared)),
            state: Arc::clone(&self.state),
            _scope: PhantomData,
        }
    }
}

fn options_priority(o: &SpawnOptions) -> spindle_fiber::Priority {
    o.priority_value()
}

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
        }),
        _scope: PhantomData,
        _env: PhantomData,
    };
    // Waits for every scoped fiber, even if `f` panics.
    struct WaitAll<'a>(&'a ScopeState);
    impl Drop for WaitAll<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                // Unwinding (perhaps a fiber being force-unwound, which may
                // not suspend): block the thread, never the fiber.
                while self.0.pending.load(Ordering::Acquire) > 0 {
                    std::thread::yield_now();
                }
            } else {
                while self.0.pending.load(Ordering::Acquire) > 0 {
                    self.0.done.acquire();
                }
            }
        }
    }
    let result = {
        let _wait = WaitAll(&scope.state);
        f(&scope)
    };
    if scope.state.unwound.load(Ordering::Acquire) > 0 {
        panic!("a fiber spawned in a spindle-executor scope panicked or was cancelled, and was not joined");
    }
    result
}
