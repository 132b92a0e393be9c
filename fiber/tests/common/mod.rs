//! Helpers shared by the spindle-fiber integration tests: a watchdog for
//! tests that could hang, and child processes for tests that must crash.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::panic::resume_unwind;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

/// Runs `f` on a fresh thread and returns its result. If `f` does not
/// finish within `secs` seconds, fails the calling test with a message that
/// names it (the stuck thread is left behind; the test binary still exits).
/// A panic in `f` is resumed in the caller.
pub fn with_watchdog<R, F>(secs: u64, name: &str, f: F) -> R
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let worker = std::thread::Builder::new()
        .name(format!("watchdog: {name}"))
        .spawn(move || {
            let r = f();
            // The receiver may be gone if the watchdog already fired.
            let _ = done_tx.send(());
            r
        })
        .expect("spawning the watched test thread");
    match done_rx.recv_timeout(Duration::from_secs(secs)) {
        // Disconnected: `f` panicked and dropped the sender while unwinding.
        Ok(()) | Err(RecvTimeoutError::Disconnected) => match worker.join() {
            Ok(r) => r,
            Err(payload) => resume_unwind(payload),
        },
        Err(RecvTimeoutError::Timeout) => panic!(
            "watchdog: test '{name}' did not finish within {secs} s. It is probably hung: a fiber \
             that never returns, a wake that was lost, or a deadlock between the threads it uses"
        ),
    }
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
    let child = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, test)
        .env(CHILD_ARG_ENV, arg)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the child test process");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(output) => output.expect("waiting for the child test process"),
        Err(_) => {
            // SAFETY: `pid` is the child we started and have not reaped yet
            // (the waiting thread is still blocked in waitpid for it).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("watchdog: child process for test '{test}' did not finish within {secs} s; killed it")
        }
    }
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

/// Describes a child process's output for assertion messages.
pub fn describe(output: &Output) -> String {
    format!(
        "status: {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}
