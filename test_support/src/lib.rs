//! Helpers for Spindle's own test suites (not published): a watchdog that
//! turns a hang into a failure naming what the test was doing, and a way
//! to run a child process that is killed, not left behind, if it hangs.
//!
//! ```
//! use spindle_test_support::watchdog;
//!
//! let answer = watchdog("doc_example", 10, |stage| {
//!     stage.set("adding");
//!     40 + 2
//! });
//! assert_eq!(answer, 42);
//! ```

use std::io::Read;
use std::panic::resume_unwind;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a watched test is doing right now; shown when the watchdog fires.
///
/// Cheap to clone; worker threads of the test may update it too.
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

/// Runs `f` on a fresh thread and returns its result. If `f` does not
/// finish within `secs` seconds, fails the calling test with
/// `watchdog: <name> did not finish in <secs>s: <stage>`, where the stage
/// is the last one `f` recorded. The stuck thread is left behind; the test
/// binary still exits. A panic in `f` is resumed in the caller.
pub fn watchdog<R, F>(name: &str, secs: u64, f: F) -> R
where
    F: FnOnce(Stage) -> R + Send + 'static,
    R: Send + 'static,
{
    watchdog_with_status(name, secs, String::new, f)
}

/// Like [`watchdog`], and when it fires also prints `status()` (counters
/// the test keeps in shared atomics, say).
pub fn watchdog_with_status<R, F, S>(name: &str, secs: u64, status: S, f: F) -> R
where
    F: FnOnce(Stage) -> R + Send + 'static,
    R: Send + 'static,
    S: Fn() -> String,
{
    watch(name, secs, status, None, f)
}

/// Like [`watchdog_with_status`], for a test of many rounds whose length
/// on a busy machine has no useful bound (each round waits for two threads
/// to be scheduled, say): fails only if `progress()` (a count the test
/// bumps every round) has not moved for `secs` seconds, which is a hang,
/// not a slow machine. A test that makes progress, however slowly, is not
/// failed.
pub fn watchdog_with_progress<R, F, S, P>(name: &str, secs: u64, status: S, progress: P, f: F) -> R
where
    F: FnOnce(Stage) -> R + Send + 'static,
    R: Send + 'static,
    S: Fn() -> String,
    P: Fn() -> u64,
{
    watch(name, secs, status, Some(&progress), f)
}

fn watch<R, F, S>(name: &str, secs: u64, status: S, progress: Option<&dyn Fn() -> u64>, f: F) -> R
where
    F: FnOnce(Stage) -> R + Send + 'static,
    R: Send + 'static,
    S: Fn() -> String,
{
    let stage = Stage::default();
    stage.set("starting");
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let body_stage = stage.clone();
    let worker = std::thread::Builder::new()
        .name(format!("watched: {name}"))
        .spawn(move || {
            let r = f(body_stage);
            // The receiver is gone if the watchdog already fired.
            let _ = done_tx.send(());
            r
        })
        .expect("spawning the watched test thread");
    let mut seen = progress.map(|p| p());
    loop {
        match done_rx.recv_timeout(Duration::from_secs(secs)) {
            // Disconnected: `f` panicked and dropped the sender while unwinding.
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                return match worker.join() {
                    Ok(r) => r,
                    Err(payload) => resume_unwind(payload),
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                // Still moving: slow, not hung; wait another period.
                let now = progress.map(|p| p());
                if now != seen {
                    seen = now;
                    continue;
                }
                let extra = status();
                let extra = if extra.is_empty() { extra } else { format!(" [{extra}]") };
                let what = if progress.is_some() { "made no progress for" } else { "did not finish in" };
                panic!(
                    "watchdog: {name} {what} {secs}s: {}{extra} (probably hung: a lost wakeup, \
                     a fiber that never returns, or a deadlock)",
                    stage.get()
                )
            }
        }
    }
}

/// Runs `cmd` as a child process with its stdout and stderr captured (stdin
/// closed) and returns its output: the watchdog for a test that runs a
/// child. If the child has not exited within `secs` seconds, kills it (a
/// hung child is not left running) and fails the calling test with
/// `watchdog: child process of <name> did not finish in <secs>s; killed
/// it`, followed by what the child wrote.
pub fn run_child_watched(name: &str, secs: u64, cmd: &mut Command) -> Output {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{name}: starting the child process: {e}"));
    // Each pipe is drained on its own thread (a child blocked on a full
    // pipe would never exit), which sends what it read once the pipe
    // closes.
    let (tx, rx) = mpsc::channel::<(usize, Vec<u8>)>();
    let stdout: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("stdout is piped"));
    let stderr: Box<dyn Read + Send> = Box::new(child.stderr.take().expect("stderr is piped"));
    for (i, mut pipe) in [stdout, stderr].into_iter().enumerate() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            // A read error ends the capture; what was read is kept.
            let _ = pipe.read_to_end(&mut buf);
            let _ = tx.send((i, buf));
        });
    }
    drop(tx);
    let mut captured = [Vec::new(), Vec::new()];
    for _ in 0..2 {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((i, buf)) => captured[i] = buf,
            Err(RecvTimeoutError::Timeout) => kill_hung_child(name, secs, &mut child, &rx, captured),
            Err(RecvTimeoutError::Disconnected) => panic!("{name}: a pipe reader thread died"),
        }
    }
    // Both pipes are closed: the child has exited or is exiting.
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::yield_now(),
            Ok(None) => kill_hung_child(name, secs, &mut child, &rx, captured),
            Err(e) => panic!("{name}: waiting for the child process: {e}"),
        }
    };
    let [stdout, stderr] = captured;
    Output { status, stdout, stderr }
}

/// [`run_child_watched`]'s timeout: kills and reaps the child, then fails
/// with what it wrote (the pipes close when it dies; collecting them is
/// bounded too, in case something else still holds them open).
fn kill_hung_child(
    name: &str,
    secs: u64,
    child: &mut Child,
    rx: &Receiver<(usize, Vec<u8>)>,
    mut captured: [Vec<u8>; 2],
) -> ! {
    let killed = match child.kill() {
        Ok(()) => "killed it".to_owned(),
        Err(e) => format!("killing it failed: {e}"),
    };
    let _ = child.wait();
    let until = Instant::now() + Duration::from_secs(5);
    while let Ok((i, buf)) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
        captured[i] = buf;
    }
    panic!(
        "watchdog: child process of {name} did not finish in {secs}s; {killed}. It is probably \
         hung.\n--- stdout ---\n{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&captured[0]),
        String::from_utf8_lossy(&captured[1])
    )
}

/// Describes a child process's output, for assertion messages.
pub fn describe(output: &Output) -> String {
    format!(
        "status: {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Caps the calling process's address space (`RLIMIT_AS`) `extra` bytes
/// above what it uses now, so that larger mappings fail with `ENOMEM`.
/// For child processes ([`run_child_watched`]): the cap cannot be raised
/// again by an unprivileged process.
///
/// # Panics
///
/// If `/proc/self/status` has no `VmSize`, or `setrlimit` fails.
pub fn cap_address_space(extra: u64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("reading /proc/self/status");
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize in /proc/self/status");
    let limit =
        libc::rlimit { rlim_cur: (vm_kib * 1024 + extra) as libc::rlim_t, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit with a valid struct; it affects this process only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0, "setrlimit(RLIMIT_AS)");
}

/// Points the calling process's stderr at a pipe whose reading end is
/// closed, so that every later write to stderr fails with `EPIPE` (Rust
/// ignores `SIGPIPE`), as under `program 2>&1 | head -1` once `head` has
/// exited. For child processes ([`run_child_watched`]): nothing written to
/// stderr afterwards reaches the parent.
///
/// # Panics
///
/// If `pipe` or `dup2` fails.
pub fn break_stderr() {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe() writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe()");
    // SAFETY: closing and duplicating descriptors this function owns; fd 2
    // is replaced atomically by dup2.
    unsafe {
        libc::close(fds[0]);
        assert_eq!(libc::dup2(fds[1], 2), 2, "dup2(pipe, stderr)");
        libc::close(fds[1]);
    }
}
