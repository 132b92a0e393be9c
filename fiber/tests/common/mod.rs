//! Helpers shared by the spindle-fiber integration tests: a watchdog for
//! tests that could hang, and child processes for tests that must crash.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::process::{Command, Output};

/// Runs `f` under `spindle-test-support`'s watchdog: if it does not finish
/// within `secs` seconds, the calling test fails with a message that names
/// it (the stuck thread is left behind; the test binary still exits). A
/// panic in `f` is resumed in the caller.
pub fn with_watchdog<R, F>(secs: u64, name: &str, f: F) -> R
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    spindle_test_support::watchdog(name, secs, |_stage| f())
}

/// Environment variable that tells a re-run test binary which test should
/// act as the child.
pub const CHILD_ENV: &str = "SPINDLE_FIBER_TEST_CHILD";

/// Environment variable carrying [`run_child_with`]'s argument.
pub const CHILD_ARG_ENV: &str = "SPINDLE_FIBER_TEST_CHILD_ARG";

/// The argument given to this child by [`run_child_with`].
pub fn child_arg() -> String {
    std::env::var(CHILD_ARG_ENV).unwrap_or_default()
}

/// Whether this process is the child started by [`run_child`] for `test`.
pub fn is_child(test: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == test)
}

/// Re-runs the current test binary with only `test` selected (exact name,
/// no output capture) and [`CHILD_ENV`] set to `test`, and returns its
/// output. Kills the child and fails if it runs longer than `secs` seconds.
pub fn run_child(test: &str, secs: u64) -> Output {
    run_child_with(test, secs, "")
}

/// [`run_child`], passing `arg` to the child in [`CHILD_ARG_ENV`].
pub fn run_child_with(test: &str, secs: u64, arg: &str) -> Output {
    let exe = std::env::current_exe().expect("locating the test binary");
    spindle_test_support::run_child_watched(
        test,
        secs,
        Command::new(exe)
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, test)
            .env(CHILD_ARG_ENV, arg)
            .env("RUST_BACKTRACE", "0"),
    )
}

/// Whether a child started by [`run_child`] ran its one test and passed.
pub fn child_passed(out: &Output) -> bool {
    out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed")
}

/// Turns off core dumps for this process (a child that is meant to abort
/// should not leave a core file behind).
pub fn no_core_dumps() {
    let limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit with a valid, initialised struct.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &limit) };
}

/// A value that counts its drops: put one on a fiber's stack to see
/// whether the fiber's locals were destroyed.
pub struct DropCounter(pub std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for DropCounter {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[allow(unused_imports)] // each test binary uses a subset
pub use spindle_test_support::describe;

/// A fiber left without a stack: its function slept, the fiber was dropped
/// (so unwound) while a destructor on its stack kept a `Waiter`, and that
/// waiter then woke it back to a home of its own. Returned `Ready` (taken
/// out of that home), with no function and no stack.
pub fn stackless_fiber(name: &str) -> spindle_fiber::Fiber<()> {
    use spindle_fiber::{sleep, Fiber, FiberAttr, Priority, RunOutcome, Schedule, Waiter, Woken};
    use std::sync::{Arc, Mutex};

    struct Home(Mutex<Vec<Fiber<()>>>);
    impl Schedule<()> for Home {
        fn schedule<'w>(&self, fiber: Woken<'w, ()>) -> Result<(), Woken<'w, ()>> {
            self.0.lock().unwrap().push(fiber.into_queued());
            Ok(())
        }
    }
    struct Keep(Arc<Mutex<Option<Waiter>>>);
    impl Drop for Keep {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Waiter::current();
        }
    }
    let stash = Arc::new(Mutex::new(None));
    let home = Arc::new(Home(Mutex::new(Vec::new())));
    let home_dyn: Arc<dyn Schedule<()>> = home.clone();
    let fiber = Fiber::<()>::new(FiberAttr::new().name(name)).unwrap();
    let kept = stash.clone();
    fiber
        .set_function(Priority::NORMAL, move || {
            let _keep = Keep(kept);
            sleep();
        })
        .unwrap();
    fiber.mark_queued(Some(&home_dyn)).unwrap();
    fiber.mark_dequeued().unwrap();
    assert!(matches!(fiber.run().unwrap(), RunOutcome::Slept));
    drop(fiber); // unwound here; the destructor keeps a waiter
    let waiter = stash
        .lock()
        .unwrap()
        .take()
        .expect("the destructor kept a waiter");
    waiter.wake();
    let fiber = home.0.lock().unwrap().pop().expect("the wake scheduled it");
    fiber.mark_dequeued().unwrap();
    fiber
}
