//! With stderr closed (a broken pipe, as under `program 2>&1 | head -1`),
//! the executor's warnings fail silently and do not panic the thread that
//! writes them (`eprintln!` panics on a failed write). Sysmon's deadlock
//! report and the shutdown's statistics are tested here; the other
//! warnings (the shutdown's slow-fiber notice, the no-stack warning, a
//! failed worker spawn) use the same macro. Each case runs in a child
//! process whose stderr is a pipe with no reader.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::describe;
use spindle_executor::{sleep, Executor};
use spindle_sync::Semaphore;
use spindle_test_support::break_stderr;

/// Set in a child process started by `run_child` to the test it runs.
const CHILD_ENV: &str = "SPINDLE_EXECUTOR_CLOSED_STDERR_CHILD";

/// Whether this is the child process `run_child` started for `test`.
fn is_child(_test: &str) -> bool {
    common::is_child(CHILD_ENV)
}

/// Runs `test` alone in a child process and checks that it printed
/// `child checked` to stdout and exited cleanly.
fn run_child(test: &str) {
    run_child_with(test, &[]);
}

/// [`run_child`] with extra environment variables.
fn run_child_with(test: &str, env: &[(&str, &str)]) {
    let out = common::run_in_a_child_with(test, CHILD_ENV, env, &[]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("child checked"),
        "the child failed (its stderr was closed: a panic shows only in its stdout, if at all):\n{}",
        describe(&out)
    );
}

/// A panic hook that reports on stdout, which stays open: the parent sees
/// which thread panicked.
fn report_panics_on_stdout() {
    std::panic::set_hook(Box::new(|info| {
        println!("PANIC on {:?}: {info}", std::thread::current().name());
    }));
}

#[test]
fn a_deadlock_is_reported_and_timers_still_fire_with_stderr_closed() {
    const NAME: &str = "a_deadlock_is_reported_and_timers_still_fire_with_stderr_closed";
    if !is_child(NAME) {
        return run_child(NAME);
    }
    report_panics_on_stdout();
    break_stderr();
    let exec = Executor::builder().workers(1).deadlock_grace(Duration::from_millis(50)).build();
    // Sysmon writes the deadlock report to stderr, then fails the join.
    let never = Arc::new(Semaphore::new(0));
    let waiter = Arc::clone(&never);
    let err = exec.spawn(move || waiter.acquire()).join().expect_err("the fiber can never finish");
    assert!(err.is_deadlock(), "the join fails as a deadlock: {err}");
    // Sysmon is alive: it still fires timers.
    let slept = exec.spawn(|| {
        sleep(Duration::from_millis(5));
        "woke"
    });
    assert_eq!(slept.join().expect("sysmon fired the timer"), "woke");
    never.release(1);
    drop(exec);
    println!("child checked");
}

#[test]
fn shutdown_statistics_are_skipped_with_stderr_closed() {
    const NAME: &str = "shutdown_statistics_are_skipped_with_stderr_closed";
    if !is_child(NAME) {
        return run_child_with(NAME, &[("SPINDLE_STATS", "1")]);
    }
    report_panics_on_stdout();
    break_stderr();
    // The shutdown prints its statistics to stderr (SPINDLE_STATS=1, set
    // by the parent).
    let exec = Executor::builder().workers(1).build();
    assert_eq!(exec.spawn(|| 7).join().unwrap(), 7);
    drop(exec);
    println!("child checked");
}
