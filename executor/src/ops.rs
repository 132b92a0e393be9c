//! Functions a fiber calls on its executor.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use spindle_fiber::WaitReason;

use crate::executor::{Handle, JoinHandle};
use crate::task::{Cancelled, TaskHead, TaskRef};
use crate::worker::current_worker;

static SLEEPING: WaitReason = WaitReason("a timer (sleep)");
static YIELD_TIMEOUT: WaitReason = WaitReason("a wakeup or timer (yield_timeout)");

/// The executor task of the calling fiber, if it is one (and not a fiber
/// nested inside one).
pub(crate) fn current_task() -> Option<(usize, &'static crate::worker::WorkerCtx)> {
    let w = current_worker()?;
    let me = spindle_fiber::current_id()?.as_u64();
    let ws = w.me();
    if ws.hot.running_fiber.load(Ordering::Relaxed) != me {
        return None;
    }
    let raw = ws.hot.running_task.load(Ordering::Relaxed);
    (raw != 0).then_some((raw, w))
}

fn task_head(raw: usize) -> &'static TaskHead {
    // SAFETY: `raw` is the running fiber's TaskRef, held in its sched word
    // until the fiber finishes, which is after any call made from it.
    unsafe { TaskRef::borrow_raw(raw) }
}

/// Unwinds the calling fiber if its task was cancelled or its executor is
/// shutting down. Not while the fiber is unwinding already (a destructor
/// that yields, sleeps or joins during a panic's or the cancel's own
/// unwind): a second unwind from a destructor would abort the process. The
/// thread's panic count alone cannot say so: it is the worker's, and
/// another fiber suspended in the middle of an unwind raises it too.
pub(crate) fn check_cancel() {
    if let Some((raw, w)) = current_task() {
        let task = task_head(raw);
        if task.cancelled.load(Ordering::Acquire) || w.shared.shutdown.load(Ordering::Acquire) {
            // The thread is panicking, and it is this fiber's doing: the
            // fiber is known to be unwinding (its cancel unwind, a check
            // like this one before, or the worker saw it switch out
            // mid-unwind), or the thread was not panicking when the worker
            // resumed it. (Not panicking, the next point cancels: after a
            // `catch_unwind`, say; the worker clears a stale mark at the
            // next resume.) One case is not told apart: this fiber's own
            // panic while another fiber on this worker is stuck mid-unwind
            // (DESIGN.md, "Cancellation, scopes, shutdown").
            if std::thread::panicking() {
                if task.unwinding.load(Ordering::Relaxed) {
                    return;
                }
                if !w.me().hot.panicking_at_resume.load(Ordering::Relaxed) {
                    task.unwinding.store(true, Ordering::Relaxed);
                    return;
                }
            }
            task.unwinding.store(true, Ordering::Relaxed);
            spindle_fiber::resume_unwind(Box::new(Cancelled));
        }
    }
}

/// Spawns a fiber on the executor whose worker thread runs the caller (see
/// [`Handle::current`]).
///
/// # Panics
/// Off an executor's worker threads (it works in the executor's fibers, and
/// in code a worker runs outside them, such as the drop of a cancelled
/// job's captures); use [`Executor::spawn`](crate::Executor::spawn) or a
/// [`Handle`] there. That includes a destructor of a fiber dropped
/// outside its worker's loop (a worker's thread-local destructor that
/// wakes it after shutdown; [`Handle::current`] is `None` there), where the
/// panic, during an unwind, aborts the process: keep a [`Handle`] for
/// spawns from destructors.
pub fn spawn<F, T>(f: F) -> JoinHandle<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    Handle::current()
        .expect(
            "spindle_executor::spawn called off an executor's worker threads: spawn with Executor::spawn, or \
             through a Handle (Executor::handle)",
        )
        .spawn(f)
}

/// Lets other fibers run; the caller goes to the back of its worker's
/// queue for its priority class. On an ordinary thread, yields the thread,
/// and so it does in a destructor run while a dropped fiber's stack is
/// unwound (see [`spindle_fiber::yield_value`]). In a fiber driven by hand
/// inside an executor fiber, it yields to that driver, as
/// `spindle_fiber::yield_now` does, and is no cancellation point.
/// A cancelled fiber unwinds here (unlike `spindle_fiber::yield_now`,
/// which knows nothing of cancellation). To leave the queue until woken
/// instead ([`JoinHandle::wake`](crate::JoinHandle::wake)) or a timeout,
/// see [`yield_timeout`] (Tarantool's name; it sleeps, it does not stay
/// runnable); to sleep for a time, [`sleep`].
#[inline]
pub fn yield_now() {
    spindle_fiber::yield_now();
    // A cancel that came before the yield is seen here too.
    check_cancel();
}

/// Yields if the calling fiber has run past its time slice (10 ms by
/// default, flagged by sysmon, which looks every half slice, at most 10 ms
/// apart: the flag comes one to one and a half slices after the worker
/// last switched). Costs a
/// thread-local read and a relaxed swap otherwise: call it in long loops.
///
/// In a fiber driven by hand inside an executor fiber, it yields that
/// fiber to its driver and leaves the flag set: the executor fiber yields
/// at its own next check, and until then each check in the hand-driven
/// fiber yields to its driver again.
pub fn yield_if_needed() {
    if let Some(w) = current_worker() {
        let preempt = &w.me().hot.preempt;
        if preempt.swap(false, Ordering::Relaxed) {
            if current_task().is_none() {
                // Not the worker's own fiber: its yield goes to its driver,
                // not to the worker, so the flag stays for the driver
                // (taken here, it starved the worker's other fibers).
                preempt.store(true, Ordering::Relaxed);
            }
            yield_now();
        }
    }
}

/// Puts the calling fiber to sleep for `d`. Outside an executor's fiber (on
/// a thread, or in a fiber something else runs) the thread sleeps. (Not
/// `spindle_fiber::sleep`, which waits for a `Waiter`.) Timers fire at
/// their deadline: the sysmon thread wakes for the earliest one (its
/// interval does not round them), and the fiber then runs when its worker
/// next picks it. A `d` too
/// large for a deadline (`Duration::MAX`) sleeps until woken
/// ([`JoinHandle::wake`](crate::JoinHandle::wake)), cancelled or shut
/// down, and while it sleeps its timer keeps deadlock detection off, as
/// any pending timer does. A cancelled fiber unwinds here; where it cannot
/// (in a destructor running during its unwind, or while a shutdown drops
/// it), a cancel or shutdown ends the sleep at once.
#[track_caller]
pub fn sleep(d: Duration) {
    if timed_wait(deadline_after(d), &SLEEPING).is_none() && !dropped_on_a_worker() {
        std::thread::sleep(d);
    }
}

/// In a fiber whose stack a worker thread unwinds because it was dropped,
/// while its executor shuts down (the final drain drops what it
/// cancelled) or once the worker's loop is over (a thread-local destructor
/// of the exiting thread woke it): the timed waits (`sleep`,
/// `sleep_until`, `yield_timeout`) return at once there, as they do for a
/// fiber that was shut down, instead of blocking the worker's thread,
/// which the shutdown waits for. (A fiber dropped on a worker at any other
/// time, one a task drove by hand, sleeps the thread as on any thread.)
fn dropped_on_a_worker() -> bool {
    spindle_fiber::in_fiber()
        && !spindle_fiber::may_sleep()
        && (current_worker().is_some_and(|w| w.shared.shutdown.load(Ordering::Acquire))
            || crate::worker::worker_loop_over())
}

/// `now + d`, or, for a `d` too large to add (`Duration::MAX`), a deadline
/// so far ahead that it never comes.
fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).or_else(|| now.checked_add(Duration::from_secs(1 << 32))).unwrap_or(now)
}

/// Puts the calling fiber to sleep until `deadline` (a thread sleeps); with
/// a deadline already past, the fiber sleeps until sysmon's next tick.
/// Fibers whose deadlines have passed are woken in deadline order, even
/// when one sysmon tick finds several (test
/// `overdue_timers_fire_in_deadline_order`). A cancelled fiber unwinds
/// here.
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// use std::time::{Duration, Instant};
/// use spindle_executor::{sleep_until, Executor};
///
/// let exec = Executor::builder().workers(1).build();
/// let deadline = Instant::now() + Duration::from_millis(5);
/// let woke = exec.block_on(move || { sleep_until(deadline); Instant::now() }).unwrap();
/// assert!(woke >= deadline);
/// ```
#[track_caller]
pub fn sleep_until(deadline: Instant) {
    if timed_wait(deadline, &SLEEPING).is_none() && !dropped_on_a_worker() {
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
    }
}

/// Sleeps until woken by [`JoinHandle::wake`] or until `d` passes
/// (Tarantool's `fiber_yield_timeout`). Returns `true` if the time ran out.
/// On an ordinary thread, or in a fiber something other than the executor
/// runs (one driven by hand inside an executor fiber), the thread sleeps
/// for `d` and it returns `true`. A cancelled
/// fiber unwinds here; where it cannot (a destructor running during its
/// unwind, or at shutdown), a cancel or shutdown ends the wait at once,
/// as a wake does (`false`).
#[track_caller]
pub fn yield_timeout(d: Duration) -> bool {
    match timed_wait(deadline_after(d), &YIELD_TIMEOUT) {
        Some(timed_out) => timed_out,
        // Ended by the shutdown, as a wake ends it: not timed out.
        None if dropped_on_a_worker() => false,
        None => {
            std::thread::sleep(d);
            true
        }
    }
}

/// Sleeps in the task's sleep slot until the timer (at `deadline`) or a
/// wake takes the waiter. `None` outside an executor fiber.
#[track_caller]
fn timed_wait(deadline: Instant, reason: &'static WaitReason) -> Option<bool> {
    let (raw, w) = current_task()?;
    check_cancel();
    let task = task_head(raw);
    let generation = {
        let mut slot = task.sleep.lock();
        slot.generation += 1;
        slot.timed_out = false;
        slot.waiter = spindle_fiber::Waiter::current();
        slot.generation
    };
    // SAFETY: the fiber's sched word holds the reference (see task_head).
    let task_ref = unsafe { TaskRef::clone_raw(raw) };
    let timer = w.shared.timers.add(deadline, generation, task_ref);
    w.shared.sysmon_unparker.unpark();
    // A cancel between publishing the waiter and here wakes us at once, and
    // so does a shutdown: a fiber unwinding for it (a destructor that
    // sleeps) may register its timer after the shutdown fired every timer,
    // and sysmon may have stopped before its deadline. (The shutdown sets
    // its flag before it fires the timers, under the timers' lock: if this
    // reads it unset, the firing finds this timer.)
    if task.cancelled.load(Ordering::Acquire) || w.shared.shutdown.load(Ordering::SeqCst) {
        if let Some(waiter) = task.sleep.lock().waiter.take() {
            waiter.wake();
        }
    }
    let timed_out = loop {
        spindle_fiber::sleep_on(reason);
        let slot = task.sleep.lock();
        // Every wake that ends this sleep (the timer, `JoinHandle::wake`,
        // a cancel, shutdown) takes the waiter out of the slot under this
        // lock first. Finding it still there, the wake came through some
        // other `Waiter` of this fiber (a stale one, kept by a
        // synchronisation primitive or a user): spurious, so sleep again.
        // The waiter stays published, so a real wake from here on finds
        // the fiber running (and is deferred to its next sleep) or asleep.
        if slot.waiter.is_none() {
            break slot.timed_out;
        }
    };
    if !timed_out {
        // Ended early: the timer is still set (unless shutdown took it).
        w.shared.timers.remove(timer);
    }
    check_cancel();
    Some(timed_out)
}

/// Runs `f` with a deadline: once `d` has passed and for as long as `f`
/// runs, every interruptible wait of the calling fiber
/// ([`Semaphore::acquire_interruptible`], [`Mutex::lock_interruptible`],
/// [`Channel::pop_interruptible`]) returns [`Interrupted`](spindle_sync::Interrupted): the one it is in
/// when the deadline passes, and each one it enters afterwards (a token
/// or message already there is still taken). That is how waits are given
/// a timeout, and nested calls each keep their own deadline. Plain waits
/// (`acquire`, `pop`) are not interrupted. When `f` returns, the deadline
/// is disarmed; an interrupt it made that no wait took is cleared, so
/// later waits are not interrupted (the interrupt mark is one bit: one
/// made by a `Waiter` meanwhile is cleared with it; a cancel still takes
/// effect). It is a cancellation point itself, so a loop that retries a
/// timed wait stops once the fiber is cancelled.
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// use std::time::Duration;
/// use spindle_executor::{interrupt_after, Executor};
/// use spindle_executor::sync::{Channel, Interrupted, Msg};
///
/// let exec = Executor::builder().workers(1).build();
/// let got = exec
///     .block_on(|| {
///         let chan = Channel::<u32>::new(); // nobody sends
///         interrupt_after(Duration::from_millis(5), || chan.pop_interruptible().map(|m| m.expect("the channel is open").into_inner()))
///     })
///     .unwrap();
/// assert_eq!(got, Err(Interrupted));
/// ```
///
/// In a destructor run while a dropped fiber's stack is unwound, or in
/// code that caught that unwind, in any fiber (at shutdown, say:
/// [`spindle_fiber::may_sleep`] is false there), `f` runs as
/// if its deadline had passed: its interruptible waits take what is there
/// or return `Interrupted` at once, as they do in such a destructor
/// anyway, and its plain waits block the thread. (Panicking there would
/// abort the process: a panic in a destructor during an unwind.)
///
/// # Panics
///
/// Outside a fiber of a `spindle-executor` executor (a thread cannot be
/// interrupted: its waits would ignore the deadline; it has timed waits
/// of its own, such as `Semaphore::acquire_timeout`), except in a fiber
/// whose stack is being unwound because it was dropped (`may_sleep()`
/// false; see above), where `f` just runs.
///
/// [`Fiber::interrupt`]: spindle_fiber::Fiber::interrupt
/// [`Semaphore::acquire_interruptible`]: spindle_sync::Semaphore::acquire_interruptible
/// [`Channel::pop_interruptible`]: spindle_sync::Channel::pop_interruptible
/// [`Mutex::lock_interruptible`]: spindle_sync::Mutex::lock_interruptible
#[track_caller]
pub fn interrupt_after<R>(d: Duration, f: impl FnOnce() -> R) -> R {
    interrupt_with(|| deadline_after(d), "interrupt_after", f)
}

/// Runs `f` with a deadline at `deadline`: [`interrupt_after`] with an
/// instant instead of a duration. Useful when several waits share one
/// deadline. A deadline already past fires at sysmon's next tick, as one
/// that passes while `f` runs does.
///
/// ```
/// # std::thread::spawn(|| { // a watchdog: a hang fails the example
/// #     std::thread::sleep(std::time::Duration::from_secs(60));
/// #     eprintln!("watchdog: this example did not finish within 60 s");
/// #     std::process::exit(1)
/// # });
/// use std::time::{Duration, Instant};
/// use spindle_executor::{interrupt_at, Executor};
/// use spindle_executor::sync::{Interrupted, Semaphore};
///
/// let exec = Executor::builder().workers(1).build();
/// let got = exec
///     .block_on(|| {
///         let sem = Semaphore::new(1);
///         let deadline = Instant::now() + Duration::from_millis(5);
///         let first = interrupt_at(deadline, || sem.acquire_interruptible());
///         let second = interrupt_at(deadline, || sem.acquire_interruptible()); // nobody releases
///         (first, second)
///     })
///     .unwrap();
/// assert_eq!(got, (Ok(()), Err(Interrupted)));
/// ```
///
/// # Panics
///
/// Where [`interrupt_after`] does: outside a fiber of a `spindle-executor`
/// executor, except in a fiber whose stack is being unwound because it
/// was dropped, where `f` just runs.
#[track_caller]
pub fn interrupt_at<R>(deadline: Instant, f: impl FnOnce() -> R) -> R {
    interrupt_with(|| deadline, "interrupt_at", f)
}

/// `interrupt_after` and `interrupt_at`: `deadline` is read once the
/// caller is known to be an executor fiber; `what` names the function in
/// the panic outside one.
#[track_caller]
fn interrupt_with<R>(deadline: impl FnOnce() -> Instant, what: &str, f: impl FnOnce() -> R) -> R {
    let Some((raw, w)) = current_task() else {
        if spindle_fiber::in_fiber() && !spindle_fiber::may_sleep() {
            return f();
        }
        panic!(
            "spindle_executor::{what} called outside an executor fiber: only a fiber's \
             interruptible waits can be given a deadline (a thread has timed waits of its own: \
             acquire_timeout, lock_timeout, pop_timeout, JoinHandle::wait_timeout and their \
             _until forms)"
        );
    };
    // A cancellation point: a loop that retries a timed wait would
    // otherwise spin once cancelled (its waits are interrupted at once).
    check_cancel();
    let task = task_head(raw);
    // SAFETY: the fiber's sched word holds the reference (see task_head).
    let task_ref = unsafe { TaskRef::clone_raw(raw) };
    let slot: crate::timer::InterruptSlot = std::sync::Arc::new(parking_lot::Mutex::new(
        spindle_fiber::Waiter::current().map(|waiter| (waiter, task_ref)),
    ));
    let shared = &w.shared;
    let key = shared.timers.add_interrupt(deadline(), slot.clone());
    shared.sysmon_unparker.unpark();

    /// Disarms the deadline when `f` returns or unwinds.
    struct Disarm<'a> {
        shared: &'a crate::shared::Shared,
        task: &'a TaskHead,
        key: crate::timer::TimerKey,
        slot: crate::timer::InterruptSlot,
    }
    impl Drop for Disarm<'_> {
        fn drop(&mut self) {
            self.shared.timers.remove(self.key);
            // Waits for a timer firing right now: it interrupts under
            // this lock. Afterwards no interrupt of ours can come.
            let ours = self.slot.lock().take();
            if ours.is_none() {
                // The deadline fired. If no other fired deadline of this
                // fiber is still armed (an enclosing call's), clear a mark
                // that no wait took. If one is, its waits stay interrupted:
                // the mark, and the worker's check after every sleep.
                // (One that fires after the decrement re-marks the fiber at
                // its next sleep, so a clearing that races it loses
                // nothing.)
                if self.task.fired_deadlines.fetch_sub(1, Ordering::SeqCst) == 1 {
                    let _ = spindle_fiber::take_interrupt();
                }
            }
        }
    }
    let _disarm = Disarm { shared, task, key, slot };
    f()
}
