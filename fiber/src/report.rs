//! Reports that name the fiber: panic messages, leaked stacks.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Once;

use crate::header::Header;

static LEAKED: AtomicU64 = AtomicU64::new(0);

/// Counts a stack that was leaked instead of unwound or reused.
pub(crate) fn note_leaked_stack() {
    LEAKED.fetch_add(1, Ordering::Relaxed);
}

/// Says, once per process, that a suspended fiber's last handle went where
/// it could not be unwound, so its stack was leaked: silent, the mistake
/// (dropping a pinned fiber on another thread) shows only as memory that
/// grows and destructors that never run.
pub(crate) fn warn_suspended_fiber_leaked(h: &Header) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    if h.slept_panicking.load(Ordering::Relaxed) {
        warn!(
            "spindle-fiber: fiber {} was dropped while asleep in a wait it began during an unwind (a \
             destructor that waits while its fiber panics or is cancelled): unwinding it from there \
             would abort the process, so its stack is leaked and the rest of its destructors never \
             run. Let such a fiber wake and finish before dropping it. (Said once; leaked_stacks() \
             counts every leak.)",
            h.display_name()
        );
    } else if cfg!(panic = "unwind") && h.may_be_suspended_in_panic() {
        warn!(
            "spindle-fiber: fiber {} was dropped while suspended inside the unwind of its own panic \
             (a destructor that yields while its fiber panics or is cancelled), or where that cannot \
             be told apart: unwinding it from there would abort the process, so its stack is leaked \
             and the rest of its destructors never run. Run such a fiber until it finishes (its run \
             returns Panicked) before dropping it. (Said once; leaked_stacks() counts every leak.)",
            h.display_name()
        );
    } else if cfg!(panic = "unwind") {
        warn!(
            "spindle-fiber: fiber {} was dropped while suspended, on another thread than the one it is \
             pinned to: its stack is leaked and the destructors of its locals never run. Drop a \
             suspended pinned fiber on its own thread, let its function finish first, or give it \
             its function with set_function_migratable. (A fiber of a scheduler that has shut down, \
             such as an executor dropped while the fiber slept in a plain wait, is let go of by \
             whoever wakes it: wait with an interruptible wait instead, which a shutdown ends.) \
             (Said once; leaked_stacks() counts every leak.)",
            h.display_name()
        );
    } else {
        warn!(
            "spindle-fiber: fiber {} was dropped while suspended, and a build with panic = \"abort\" \
             cannot unwind its stack: it is leaked and the destructors of its locals never run. Let \
             fibers finish before dropping them. (Said once; leaked_stacks() counts every leak.)",
            h.display_name()
        );
    }
}

/// Stacks leaked instead of unwound or reused: a suspended, pinned fiber
/// dropped on another thread than the one it ran on (its locals could not
/// be safely dropped there), a fiber dropped while asleep in a wait it
/// began during an unwind, or suspended in a yield after a panic of its own
/// began where spindle cannot tell that the unwind is over (on another
/// thread, or on a thread that is panicking; unwinding it from inside the
/// unwind would abort), a forced unwind that did not finish (it
/// panicked, or suspended into a function that is over), and a closure
/// that never ran whose drop panicked. The first suspended fiber leaked
/// (any of the suspended-fiber cases, or a build with `panic = "abort"`)
/// is also reported on stderr, once per process.
pub fn leaked_stacks() -> u64 {
    LEAKED.load(Ordering::Relaxed)
}

/// Drops a caught panic's payload where a panic must not escape (a drop).
/// A payload whose own drop panics (`panic_any` of a value whose `Drop`
/// panics) would otherwise unwind out of the code that contained the
/// first panic; that second payload is leaked instead.
///
/// One unwind is handed back instead: a payload whose drop suspended the
/// running fiber, which was then dropped, comes back with that fiber's
/// forced unwind, and the caller must resume it (`resume_unwind`) once its
/// own bookkeeping is done, so that the unwind goes on through the fiber's
/// frames (its code after this drop would otherwise run inside its own
/// drop).
#[must_use = "a forced unwind handed back must be resumed"]
pub(crate) fn drop_payload(payload: Box<dyn std::any::Any + Send>) -> Option<Box<dyn std::any::Any + Send>> {
    if let Err(again) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(payload))) {
        if unwinding_current_for_drop() {
            return Some(again);
        }
        std::mem::forget(again);
    }
    None
}

/// Whether an unwind just caught in the running fiber must be passed on:
/// the fiber is being unwound because it was dropped (a suspension in the
/// code that panicked came back with the forced unwind), and the thread is
/// not unwinding from another panic (passing it on would abort).
pub(crate) fn unwinding_current_for_drop() -> bool {
    let current = crate::current::current_header();
    // SAFETY: a non-null current fiber is the one running on this thread,
    // alive while it runs.
    let dropping = unsafe { current.as_ref() }
        .is_some_and(|h| h.unwinding_for_drop.load(std::sync::atomic::Ordering::Relaxed));
    dropping && !std::thread::panicking()
}

/// Starts an unwind with `payload`, as [`std::panic::resume_unwind`]
/// does, and first notes, in a fiber, that the fiber's function is
/// unwinding, as the crate's panic hook does for a `panic!` (which
/// `std::panic::resume_unwind` does not call).
///
/// The note matters if a destructor yields during this unwind and the
/// fiber is then dropped while suspended there: it is leaked instead of
/// unwound a second time, which would abort the process (see
/// [`Fiber`](crate::Fiber): do not suspend while
/// `std::thread::panicking()`). [`Panic::resume_unwind`](crate::Panic::resume_unwind)
/// starts its unwind this way; a fiber that passes a caught payload on
/// should too.
///
/// ```
/// use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};
///
/// let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap();
/// fiber
///     .set_function(Priority::NORMAL, || spindle_fiber::resume_unwind(Box::new("stop")))
///     .unwrap();
/// match fiber.run() {
///     Ok(RunOutcome::Panicked(p)) => assert_eq!(p.message(), Some("stop")),
///     other => panic!("{other:?}"),
/// }
/// ```
pub fn resume_unwind(payload: Box<dyn std::any::Any + Send>) -> ! {
    // Under loom the current-fiber word is a loom thread-local, which code
    // outside a model must not read.
    #[cfg(not(loom))]
    {
        let h = crate::current::current_header();
        // SAFETY: a non-null current fiber is the one running on this thread.
        if let Some(h) = unsafe { h.as_ref() } {
            h.note_panicking();
        }
    }
    std::panic::resume_unwind(payload)
}

/// Installs (once) a panic hook that says which fiber panicked, then calls
/// the hook that was installed before.
pub(crate) fn install_panic_hook() {
    static ONCE: Once = Once::new();
    // take_hook/set_hook panic on a thread that is panicking (a fiber made
    // in a destructor during an unwind): leave the hook for a later call.
    if std::thread::panicking() {
        return;
    }
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            // Under loom the word is a loom thread-local, which a hook
            // running outside a model (or while loom itself panics) must
            // not touch.
            #[cfg(loom)]
            let h: *const crate::header::Header = std::ptr::null();
            #[cfg(not(loom))]
            let h = crate::current::current_header();
            // SAFETY: a non-null current fiber is the one running on this thread.
            if let Some(h) = unsafe { h.as_ref() } {
                // Remembered for `release`: if the fiber suspends inside
                // this panic's unwind (a destructor that yields) and is then
                // dropped, unwinding it again would abort the process.
                h.note_panicking();
                // Not eprintln!: a failed write (a closed stderr pipe) must
                // not panic inside the hook, which would abort the process.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "panic in fiber {}:", h.display_name());
            }
            previous(info);
        }));
    });
}
