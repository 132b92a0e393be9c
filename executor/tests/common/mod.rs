//! Helpers shared by the spindle-executor behaviour tests: the watchdog
//! and child process runner of `spindle-test-support`, bounded condition
//! waits (spinning or yielding, never sleeping), drop flags and size
//! selection for debug builds.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test binary uses a subset
pub use spindle_test_support::{describe, run_child_watched, watchdog, Stage};

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

/// The kernel's id of the calling thread (Linux: `/proc/thread-self`).
pub fn current_tid() -> u32 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("reading /proc/thread-self/stat");
    stat.split_whitespace().next().and_then(|t| t.parse().ok()).expect("a thread id")
}

/// Whether thread `tid` of this process sleeps in the kernel (state `S` in
/// `/proc/self/task/<tid>/stat`): a way to see that a thread reached a
/// blocking wait, without sleeping.
pub fn thread_blocked(tid: u32) -> bool {
    let stat =
        std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("reading a thread's stat");
    // The state follows the command name, which is in parentheses.
    let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start().chars().next());
    matches!(state, Some(Some('S')))
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

/// Runs the test `name` of this test binary again in a child process, with
/// `child_env` set (the test's own switch to its child part), core dumps
/// off (through the shell: a child that aborts leaves no core file) and a
/// 60 s limit after which the child is killed.
pub fn run_in_a_child(name: &str, child_env: &str) -> std::process::Output {
    run_in_a_child_with(name, child_env, &[], &[])
}

/// [`run_in_a_child`] with environment variables set (`set`) and removed
/// (`unset`) for the child.
pub fn run_in_a_child_with(
    name: &str,
    child_env: &str,
    set: &[(&str, &str)],
    unset: &[&str],
) -> std::process::Output {
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "ulimit -c 0; exec \"$0\" \"$@\""])
        .arg(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(child_env, "1")
        .env("RUST_BACKTRACE", "0")
        .envs(set.iter().copied());
    for var in unset {
        cmd.env_remove(var);
    }
    run_child_watched(name, 60, &mut cmd)
}

/// Whether this process is the child [`run_in_a_child`] started with
/// `child_env` (it runs only the one test it was started for).
pub fn is_child(child_env: &str) -> bool {
    std::env::var(child_env).is_ok_and(|v| v == "1")
}

/// A xorshift generator for the randomized stress tests (a seed gives the
/// same run every time).
#[derive(Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// A generator from any seed (mixed, never zero).
    pub fn new(seed: u64) -> Rng {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        for _ in 0..4 {
            r.next();
        }
        r
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
