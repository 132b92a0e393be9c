//! `spindle-fiber` against its peers, measured side by side in one run.
//!
//! ```text
//! cargo bench -p spindle-benches --bench fiber
//! ```
//!
//! Groups (each holds spindle and its peers):
//!
//! * `run_yield_round_trip`: one `run` that comes back through `yield_now`,
//!   against a raw corosensei `resume` that comes back through `suspend`
//!   (both inlined into the loop), the same switch with a current-fiber
//!   pointer behind out-of-line `thread_local!` calls, and the same switch
//!   made two non-inlined calls deep on each side.
//! * `create_run_return`: a new fiber (pooled 128 KiB stack), a function,
//!   a `run` to its return and the drop, against corosensei on a fresh
//!   `DefaultStack`, `std::thread::spawn`+`join`, `may::go!`+`join` (from
//!   inside a may coroutine, and from a thread) and a tokio current-thread
//!   `spawn`+`await`.
//! * `reuse_run_return`: `set_function`+`run` to return on one reused fiber,
//!   against a corosensei coroutine built on one reused stack.
//!
//! Timings are per iteration (one round trip, or one fiber/thread/task).

use std::hint::black_box;
use std::time::{Duration, Instant};

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult};
use criterion::{criterion_group, criterion_main, Criterion};
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority, RunOutcome, DEFAULT_STACK_SIZE};

/// The default fiber stack size, used for every peer that takes a size.
const STACK: usize = DEFAULT_STACK_SIZE;

/// A fiber whose function yields forever.
fn yielding_fiber() -> Fiber<()> {
    let fiber = Fiber::new(FiberAttr::new()).unwrap();
    fiber
        .set_function(Priority::NORMAL, || loop {
            yield_now();
        })
        .unwrap();
    fiber
}

fn run_yield_round_trip(c: &mut Criterion) {
    let mut g = c.benchmark_group("run_yield_round_trip");

    g.bench_function("spindle", |b| {
        let fiber = yielding_fiber();
        b.iter(|| match fiber.run() {
            Ok(RunOutcome::Yielded(v)) => black_box(v),
            other => panic!("expected a yield, got {other:?}"),
        });
    });

    // A uniquely owned fiber driven through `run_mut` (no atomic claim).
    g.bench_function("spindle_run_mut", |b| {
        let mut fiber = yielding_fiber();
        b.iter(|| match fiber.run_mut() {
            Ok(RunOutcome::Yielded(v)) => black_box(v),
            other => panic!("expected a yield, got {other:?}"),
        });
    });

    g.bench_function("corosensei", |b| {
        let mut co: Coroutine<(), usize, (), DefaultStack> =
            Coroutine::with_stack(DefaultStack::new(STACK).unwrap(), |y, ()| loop {
                y.suspend(0);
            });
        b.iter(|| match co.resume(()) {
            CoroutineResult::Yield(v) => black_box(v),
            CoroutineResult::Return(()) => unreachable!(),
        });
    });

    // The raw switch plus a current-fiber pointer kept the portable way: a
    // `thread_local!` behind one non-inlined call on each side (set it
    // before resuming; read it, and put back the previous one, before
    // suspending), out of line because a fiber may resume on another
    // thread (llvm/llvm-project#98479). This was Spindle's design before
    // its accesses became inline asm (tls.rs).
    g.bench_function("corosensei_current_tls", |b| {
        thread_local! {
            static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
        }
        #[inline(never)]
        fn enter(v: usize) {
            CURRENT.with(|c| c.set(v));
        }
        #[inline(never)]
        fn leave() -> usize {
            CURRENT.with(|c| c.replace(0))
        }
        let mut co: Coroutine<(), usize, (), DefaultStack> =
            Coroutine::with_stack(DefaultStack::new(STACK).unwrap(), |y, ()| loop {
                let v = leave();
                y.suspend(v);
            });
        b.iter(|| {
            enter(1);
            match co.resume(()) {
                CoroutineResult::Yield(v) => black_box(v),
                CoroutineResult::Return(()) => unreachable!(),
            }
        });
    });

    // The same switch with two non-inlined calls live on each side of it,
    // as in any library that wraps corosensei: the return-address predictor
    // mispredicts the returns through them after every switch.
    g.bench_function("corosensei_nested", |b| {
        type Co = Coroutine<(), usize, (), DefaultStack>;
        type Y = corosensei::Yielder<(), usize>;
        #[inline(never)]
        fn suspend_inner(y: &Y) {
            y.suspend(0);
        }
        #[inline(never)]
        fn suspend_outer(y: &Y) {
            suspend_inner(y);
        }
        #[inline(never)]
        fn resume_inner(co: &mut Co) -> usize {
            match co.resume(()) {
                CoroutineResult::Yield(v) => v,
                CoroutineResult::Return(()) => unreachable!(),
            }
        }
        #[inline(never)]
        fn resume_outer(co: &mut Co) -> usize {
            resume_inner(co)
        }
        let mut co: Co = Coroutine::with_stack(DefaultStack::new(STACK).unwrap(), |y, ()| loop {
            suspend_outer(y);
        });
        b.iter(|| black_box(resume_outer(&mut co)));
    });

    g.finish();
}

fn create_run_return(c: &mut Criterion) {
    let mut g = c.benchmark_group("create_run_return");

    g.bench_function("spindle", |b| {
        b.iter(|| {
            let fiber = Fiber::<usize>::new(FiberAttr::new()).unwrap();
            fiber.set_function(Priority::NORMAL, || black_box(1)).unwrap();
            let v = fiber.run().unwrap().unwrap_returned();
            drop(fiber);
            v
        });
    });

    g.bench_function("corosensei_fresh_stack", |b| {
        b.iter(|| {
            let mut co: Coroutine<(), (), usize, DefaultStack> =
                Coroutine::with_stack(DefaultStack::new(STACK).unwrap(), |_, ()| black_box(1));
            match co.resume(()) {
                CoroutineResult::Return(v) => v,
                CoroutineResult::Yield(()) => unreachable!(),
            }
        });
    });

    g.bench_function("std_thread", |b| {
        b.iter(|| std::thread::spawn(|| black_box(1usize)).join().unwrap());
    });

    // may, one worker: spawn+join from inside a may coroutine (the join
    // parks a coroutine), and from an ordinary thread (the join parks the
    // thread, and the worker wakes it).
    g.bench_function("may_in_coroutine", |b| {
        may::config().set_workers(1);
        b.iter_custom(|iters| {
            // SAFETY (may's contract for spawning): the coroutines keep no
            // thread-local references across their suspensions.
            may::go!(move || {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(may::go!(|| black_box(1usize)).join().unwrap());
                }
                start.elapsed()
            })
            .join()
            .unwrap()
        });
    });

    g.bench_function("may_from_thread", |b| {
        may::config().set_workers(1);
        b.iter(|| may::go!(|| black_box(1usize)).join().unwrap());
    });

    g.bench_function("tokio_current_thread", |b| {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        b.iter_custom(|iters| {
            rt.block_on(async move {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(tokio::spawn(async { black_box(1usize) }).await.unwrap());
                }
                start.elapsed()
            })
        });
    });

    g.finish();
}

fn reuse_run_return(c: &mut Criterion) {
    let mut g = c.benchmark_group("reuse_run_return");

    g.bench_function("spindle", |b| {
        let fiber = Fiber::<usize>::new(FiberAttr::new()).unwrap();
        b.iter(|| {
            fiber.set_function(Priority::NORMAL, || black_box(1)).unwrap();
            fiber.run().unwrap().unwrap_returned()
        });
    });

    g.bench_function("corosensei_reused_stack", |b| {
        let mut stack = Some(DefaultStack::new(STACK).unwrap());
        b.iter(|| {
            let mut co: Coroutine<(), (), usize, DefaultStack> =
                Coroutine::with_stack(stack.take().unwrap(), |_, ()| black_box(1));
            let v = match co.resume(()) {
                CoroutineResult::Return(v) => v,
                CoroutineResult::Yield(()) => unreachable!(),
            };
            stack = Some(co.into_stack());
            v
        });
    });

    g.finish();
}

fn config() -> Criterion {
    // Two noisy cores: many samples, long measurements; medians are quoted.
    Criterion::default()
        .sample_size(100)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(6))
        .noise_threshold(0.05)
}

criterion_group! {
    name = benches;
    config = config();
    targets = run_yield_round_trip, create_run_return, reuse_run_return
}
criterion_main!(benches);
