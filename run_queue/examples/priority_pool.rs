//! A priority pool built from the core pieces: one worker thread per core
//! over one [`RunQueue`], four times as many fibers, and a channel of tasks
//! submitted at different priorities.
//!
//! ```text
//! cargo run --release -p spindle-run-queue --example priority_pool
//! ```
//!
//! Tasks go into one channel per priority class, and a semaphore counts
//! them. Each fiber waits on the semaphore, takes the task from the most
//! urgent non-empty channel, sets its own priority to the task's, yields (so
//! the run queue orders it among the others), works for a few slices, and
//! records its completion. Under saturation, higher-priority tasks complete
//! earlier. The program prints
//! per-worker task counts and the mean completion rank per priority, and
//! checks that every worker ran at least one task.
//!
//! The fibers here move between worker threads, which takes one `unsafe`
//! call (`set_function_migratable`, whose contract the comment at the call
//! argues): a fiber that migrates must not keep thread-bound values across
//! a suspension. The `workers` example shows the safe default instead:
//! fibers pinned to the thread that first ran them.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use spindle_fiber::{set_current_priority, yield_now, Fiber, FiberAttr, Priority, RunOutcome};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Msg, Semaphore, WaitGroup};

const PRIORITIES: [(&str, Priority); 4] = [
    ("highest", Priority::HIGHEST),
    ("high", Priority::HIGH),
    ("normal", Priority::NORMAL),
    ("lowest", Priority::LOWEST),
];
const TASKS_PER_PRIORITY: usize = 200;
const WORK_SLICES: usize = 4;

enum Task {
    Work { id: usize },
    Stop,
}

thread_local! {
    static WORKER: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The worker this code runs on. Not inlined, so a fiber that moved between
/// workers reads the slot of the thread it runs on now.
#[inline(never)]
fn worker_index() -> usize {
    WORKER.with(|w| w.get())
}

/// A slice of work: some arithmetic the optimiser cannot remove.
fn work(id: usize, slice: usize) {
    let mut x = (id * 31 + slice) as u64 | 1;
    for _ in 0..2_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x);
}

fn main() {
    if std::env::args().len() > 1 {
        eprintln!("usage: priority_pool (takes no arguments)");
        std::process::exit(2);
    }
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let fibers = 4 * workers;
    let queue: RunQueue = RunQueue::new(fibers);
    let tasks: Arc<Vec<Channel<Task>>> = Arc::new(PRIORITIES.iter().map(|_| Channel::new()).collect());
    let pending = Arc::new(Semaphore::new(0));
    // Each fiber holds a member of the group until its function ends.
    let running = WaitGroup::new();
    let rank = Arc::new(AtomicUsize::new(0));
    // (class, completion rank, worker) for every task.
    let log = Arc::new(Mutex::new(Vec::new()));

    for i in 0..fibers {
        let fiber = Fiber::new(FiberAttr::new().stack_size(64 * 1024).name(format!("pool-{i}"))).unwrap();
        let (tasks, pending, member, rank, log) =
            (tasks.clone(), pending.clone(), running.clone(), rank.clone(), log.clone());
        let body = move || {
            // Dropped when the function ends, by a return or a panic's
            // unwind: the group then counts this fiber as done.
            let _member = member;
            loop {
                pending.acquire();
                let (class, msg) = tasks
                    .iter()
                    .enumerate()
                    .find_map(|(class, chan)| chan.try_pop().map(|m| (class, m)))
                    .expect("the semaphore counts queued tasks");
                let id = match *msg {
                    Task::Work { id } => id,
                    Task::Stop => break,
                };
                set_current_priority(PRIORITIES[class].1);
                yield_now(); // back into the queue at the task's priority
                for slice in 0..WORK_SLICES {
                    work(id, slice);
                    yield_now();
                }
                let r = rank.fetch_add(1, Ordering::Relaxed);
                log.lock().unwrap().push((class, r, worker_index()));
            }
            set_current_priority(Priority::LOWEST);
        };
        // SAFETY: the fiber holds no !Send value and no thread-local
        // reference across a suspension point: the Msg, the Arcs and plain
        // integers are Send, and the worker index is read through a
        // non-inlined function after each resume.
        unsafe { fiber.set_function_migratable(Priority::NORMAL, body) }.unwrap();
        queue.try_push(fiber).unwrap();
    }

    // Submit every task up front, priorities interleaved, so the pool is
    // saturated and has to choose; stop messages go last, at the lowest
    // priority.
    let total = TASKS_PER_PRIORITY * PRIORITIES.len();
    for id in 0..total {
        tasks[(id * 7 + id / 3) % PRIORITIES.len()].push(Msg::new(Task::Work { id })).unwrap();
        pending.release(1);
    }
    for _ in 0..fibers {
        tasks[PRIORITIES.len() - 1].push(Msg::new(Task::Stop)).unwrap();
    }

    let start = Arc::new(Barrier::new(workers + 1));
    let counts: Vec<_> = (0..workers)
        .map(|w| {
            let (queue, start) = (queue.clone(), start.clone());
            std::thread::spawn(move || {
                WORKER.with(|c| c.set(w));
                start.wait();
                let mut ran = 0usize;
                // Parks while there is nothing to run; `None` once the main
                // thread has closed the queue.
                while let Some(fiber) = queue.pop() {
                    match queue.run_popped(fiber).outcome {
                        Err(e) => panic!("worker {w}: {e}"),
                        // The panic comes back here; the worker goes on.
                        // The unwind gave up the fiber's group member (its
                        // task is missing from the log, which the check
                        // below then says).
                        Ok(RunOutcome::Panicked(p)) => eprintln!("worker {w}: {p}"),
                        Ok(_) => {}
                    }
                    ran += 1;
                }
                ran
            })
        })
        .collect();

    start.wait();
    // Stop messages are released only now, so that no fiber stops early.
    pending.release(fibers);

    // The main thread waits for a group whose members are the fibers:
    // threads and fibers share the primitives.
    running.wait();
    // Every fiber's function has ended: none can come back to the queue
    // now, so closing it ends every worker's loop.
    queue.close();
    let runs: Vec<usize> = counts.into_iter().map(|h| h.join().unwrap()).collect();

    let log = log.lock().unwrap();
    assert_eq!(log.len(), total, "every task completed once");
    let mut tasks_per_worker = vec![0usize; workers];
    for &(_, _, w) in log.iter() {
        tasks_per_worker[w] += 1;
    }
    println!("{workers} workers, {fibers} fibers, {total} tasks");
    for w in 0..workers {
        println!("worker {w}: {:>5} tasks completed, {:>6} fiber runs", tasks_per_worker[w], runs[w]);
    }
    println!("mean completion rank by priority (lower = earlier):");
    let mut means = Vec::new();
    for (class, (name, prio)) in PRIORITIES.iter().enumerate() {
        let ranks: Vec<usize> = log.iter().filter(|e| e.0 == class).map(|e| e.1).collect();
        let mean = ranks.iter().sum::<usize>() as f64 / ranks.len() as f64;
        println!("  {name:>8} (priority {:>3}): {mean:>7.1}", prio.0);
        means.push(mean);
    }
    assert!(
        tasks_per_worker.iter().all(|&n| n > 0),
        "every worker ran at least one task: {tasks_per_worker:?}"
    );
    assert!(means[0] < means[3], "highest-priority tasks complete before lowest-priority ones on average");
    println!("ok: every worker ran tasks; higher priorities completed earlier");
}
