//! Helpers shared by the spindle-executor behaviour tests: a watchdog that
//! turns a hang into a failure naming what the test was doing, bounded
//! condition waits (spinning or yielding, never sleeping), drop flags and
//! size selection for debug builds.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::panic::resume_unwind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a watched test is doing right now; shown when the watchdog fires.
/// Cheap to clone, so fibers of the test may update it too.
#[derive(Clone, Default)]
pub struct Stage(Arc<Mutex<String>>);

impl Stage {
    /// Records what the test is doing from now on.
    pub fn set(&self, doing: impl Into<String>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = doing.into();
    }

    /// The last recorded stage.
    pub fn get(&self) -> String {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Runs `body` on a fresh thread and returns its result. If it does not
/// finish within `secs` seconds, fails the calling test with
/// `watchdog: <name> did not finish in <secs>s: <stage>`, where the stage is
/// the last one the body recorded. The stuck thread is left behind (the test
/// binary still exits). A panic in the body is resumed in the caller.
pub fn watchdog<R, F>(name: &str, secs: u64, body: F) -> R
where
    F: FnOnce(Stage) -> R + Send + 'static,
    R: Send + 'static,
{
    let stage = Stage::default();
    stage.set("starting");
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let body_stage = stage.clone();
    let thread = std::thread::Builder::new()
        .name(format!("watched: {name}"))
        .spawn(move || {
            let r = body(body_stage);
            // The receiver is gone if the watchdog already fired.
            let _ = done_tx.send(());
            r
        })
        .expect("spawning the watched test thread");
    match done_rx.recv_timeout(Duration::from_secs(secs)) {
        // Disconnected: the body panicked and dropped the sender unwinding.
        Ok(()) | Err(RecvTimeoutError::Disconnected) => match thread.join() {
            Ok(r) => r,
            Err(payload) => resume_unwind(payload),
        },
        Err(RecvTimeoutError::Timeout) => {
            panic!("watchdog: {name} did not finish in {secs}s: {}", stage.get())
        }
    }
}

/// Waits until `cond` holds, yielding between looks: the executor's
/// `yield_now` inside a fiber, a thread yield elsewhere. Not a sleep: it
/// waits for a state, and the caller's watchdog bounds it. Records `what`
/// as the stage while it waits.
pub fn wait_for(stage: &Stage, what: &str, mut cond: impl FnMut() -> bool) {
    stage.set(format!("waiting for {what}"));
    while !cond() {
        spindle_executor::yield_now();
    }
}

/// Waits (yielding) until `cond` holds or `bound` passes; returns whether
/// it held. For conditions whose timing is what the test checks.
pub fn wait_within(bound: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + bound;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return cond();
        }
        spindle_executor::yield_now();
    }
}

/// Runs `cmd` (a child process) and returns its output, with stdout and
/// stderr captured. Kills it (SIGKILL) and fails the calling test if it
/// runs longer than `secs` seconds, so that a hung child neither hangs the
/// test nor outlives it.
pub fn output_within(cmd: &mut std::process::Command, secs: u64) -> std::process::Output {
    use std::process::Stdio;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the child process");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(output) => output.expect("waiting for the child process"),
        Err(_) => {
            // Not reaped yet: the waiting thread is still blocked on it.
            let _ = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            panic!("watchdog: the child process did not finish within {secs} s; killed it")
        }
    }
}

/// The kernel's id of the calling thread (Linux: `/proc/thread-self`).
pub fn current_tid() -> u32 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("reading /proc/thread-self/stat");
    stat.split_whitespace().next().and_then(|t| t.parse().ok()).expect("a thread id")
}

/// Whether thread `tid` of this process is blocked in the kernel (state
/// `S` or `D` in `/proc/self/task/<tid>/stat`): a way to see that a thread
/// reached a blocking wait, without sleeping.
pub fn thread_blocked(tid: u32) -> bool {
    let stat =
        std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("reading a thread's stat");
    // The state follows the command name, which is in parentheses.
    let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start().chars().next());
    matches!(state, Some(Some('S' | 'D')))
}

/// Burns CPU without yielding for `d` (a hog that never reaches a
/// suspension point).
pub fn spin_for(d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

/// A shared flag.
#[derive(Clone, Default)]
pub struct Flag(Arc<AtomicBool>);

impl Flag {
    /// A cleared flag.
    pub fn new() -> Flag {
        Flag::default()
    }

    /// Sets the flag.
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether the flag is set.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// A value that sets this flag when it is dropped: put one on a fiber's
    /// stack (or in its closure) to see whether it was destroyed.
    pub fn on_drop(&self) -> SetOnDrop {
        SetOnDrop(self.clone())
    }
}

/// Sets its [`Flag`] when dropped.
pub struct SetOnDrop(Flag);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set();
    }
}

/// `debug` in debug builds (unoptimised code on 2 cores must keep the
/// whole suite within about a minute), `release` otherwise.
pub fn size(debug: usize, release: usize) -> usize {
    if cfg!(debug_assertions) {
        debug
    } else {
        release
    }
}
