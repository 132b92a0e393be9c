//! Deferred releases (`spindle_fiber::defer_releases`): fibers whose last
//! reference goes inside a scope are unwound when the scope ends, one after
//! another, each with the scopes of its own destructors closed before the
//! next one starts.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::{describe, run_child_watched, watchdog};
use spindle_fiber::{defer_releases, yield_now, Fiber, FiberAttr, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::Semaphore;

/// Runs a closure when dropped.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// A fiber run once by hand on this thread and suspended in a yield, with
/// `guard` on its stack.
fn yielded_holding<G: Send + 'static>(guard: G) -> Fiber<()> {
    let f = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
    f.set_function(Priority::NORMAL, move || {
        let _g = guard;
        yield_now();
    })
    .unwrap();
    assert!(matches!(f.run(), Ok(RunOutcome::Yielded(_))));
    f
}

/// A scope defers X, then W. X's destructor opens a scope of its own (a
/// release of two tokens) and then releases `gate`, which W's destructor
/// acquires: W is released only after X's destructor has finished. (Found
/// in review: the inner scope's end released the rest of the outer list,
/// so W was unwound inside X's destructor, before the gate was released,
/// and waited for ever.)
#[test]
fn a_scope_opened_by_a_deferred_release_releases_only_its_own() {
    watchdog("a_scope_opened_by_a_deferred_release_releases_only_its_own", 30, |stage| {
        let (gate, other) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let (g, o) = (gate.clone(), other.clone());
        let x = yielded_holding(OnDrop(move || {
            o.release(2);
            g.release(1);
        }));
        let g = gate.clone();
        let w = yielded_holding(OnDrop(move || g.acquire()));
        stage.set("the scope ends: X is released, then W");
        defer_releases(|| {
            drop(x);
            drop(w);
        });
        assert_eq!((gate.available(), other.available()), (0, 2));
    });
}

/// The same through the run queue's drop (a scope of its own) with two
/// yielded fibers in it.
#[test]
fn a_dropped_queue_releases_its_fibers_one_after_another() {
    watchdog("a_dropped_queue_releases_its_fibers_one_after_another", 30, |stage| {
        let (gate, other) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
        let q = RunQueue::new(4);
        let (g, o) = (gate.clone(), other.clone());
        let x = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
        x.set_function(Priority::NORMAL, move || {
            let _g = OnDrop(move || {
                o.release(2);
                g.release(1);
            });
            loop {
                yield_now();
            }
        })
        .unwrap();
        let g = gate.clone();
        let w = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
        w.set_function(Priority::NORMAL, move || {
            let _g = OnDrop(move || g.acquire());
            loop {
                yield_now();
            }
        })
        .unwrap();
        q.try_push(x).unwrap();
        q.try_push(w).unwrap();
        for _ in 0..2 {
            assert!(matches!(q.run_next().unwrap().outcome, Ok(RunOutcome::Yielded(_))));
        }
        stage.set("dropping the queue: X's destructor, then W's");
        drop(q);
        assert_eq!((gate.available(), other.available()), (0, 2));
    });
}

const MANY_CHILD: &str = "many_deferred_releases_that_open_scopes_do_not_nest";

/// Many unstarted fibers in a dropped queue, whose captures open a scope
/// when dropped (a release of two tokens): their releases run one after
/// another, not nested in each other. (Found in review: each inner scope's
/// end released the rest of the outer list from inside the previous
/// release, and about 700 of them overflowed a 2 MiB thread stack in a
/// debug build.) In a child process, on a thread with a 256 KiB stack: a
/// regression dies there of a stack overflow, not the test binary.
#[test]
fn many_deferred_releases_that_open_scopes_do_not_nest() {
    const N: usize = 5000;
    if std::env::var("SPINDLE_TEST_CHILD").is_ok_and(|v| v == MANY_CHILD) {
        let available = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(|| {
                let sem = Arc::new(Semaphore::new(0));
                let q = RunQueue::new(N);
                for _ in 0..N {
                    let f = Fiber::<()>::new(FiberAttr::new().stack_size(16 * 1024)).unwrap();
                    let s = sem.clone();
                    let g = OnDrop(move || s.release(2));
                    f.set_function(Priority::NORMAL, move || drop(g)).unwrap();
                    q.try_push(f).unwrap();
                }
                drop(q);
                sem.available()
            })
            .unwrap()
            .join()
            .unwrap();
        eprintln!("child released: {available}");
        return;
    }
    let exe = std::env::current_exe().expect("locating the test binary");
    let out = run_child_watched(
        MANY_CHILD,
        120,
        Command::new(exe)
            .args([MANY_CHILD, "--exact", "--nocapture", "--test-threads=1"])
            .env("SPINDLE_TEST_CHILD", MANY_CHILD),
    );
    assert!(out.status.success(), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("child released: {}", 2 * N)), "{}", describe(&out));
}

/// Releases two tokens when dropped.
struct ReleasesTwo(Arc<Semaphore>);

impl Drop for ReleasesTwo {
    fn drop(&mut self) {
        self.0.release(2);
    }
}

std::thread_local! {
    static RELEASES_AT_EXIT: std::cell::RefCell<Option<ReleasesTwo>> = const { std::cell::RefCell::new(None) };
}

/// A `release(2)` made by a thread-local destructor at a thread's exit,
/// after spindle's own thread-local was first used (so, were it destroyed
/// in turn, before this one): its scope still works. A homeless fiber
/// waits first, its destructor acquiring a token; a thread waits second.
/// (Found in review: the scopes' thread-local had a destructor, so scopes
/// opened during the thread's exit were silently off, and this hung.)
#[test]
fn a_scope_opened_by_a_thread_local_destructor_still_defers() {
    watchdog("a_scope_opened_by_a_thread_local_destructor_still_defers", 30, |stage| {
        let sem = Arc::new(Semaphore::new(0));
        let f = Fiber::<()>::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
        let s = sem.clone();
        let acquires = OnDrop({
            let s = sem.clone();
            move || s.acquire()
        });
        // SAFETY: only `Arc`s live across the suspension.
        unsafe {
            f.set_function_migratable(Priority::NORMAL, move || {
                let _d = acquires;
                s.acquire();
            })
        }
        .unwrap();
        assert!(matches!(f.run(), Ok(RunOutcome::Slept)));
        drop(f);
        let s = sem.clone();
        let waiting = std::thread::spawn(move || s.acquire());
        common::spin_until(|| sem.waiters() == 2);
        stage.set("a thread's exit: release(2) in a thread-local destructor");
        let s = sem.clone();
        std::thread::spawn(move || {
            RELEASES_AT_EXIT.with(|r| *r.borrow_mut() = Some(ReleasesTwo(s)));
            // Spindle's thread-local, used after this thread's own.
            defer_releases(|| ());
        })
        .join()
        .unwrap();
        waiting.join().unwrap();
        // The fiber's token came back when it unwound; its destructor took it.
        assert_eq!((sem.available(), sem.waiters()), (0, 0));
    });
}
