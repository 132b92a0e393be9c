//! A `Mutex` and a `Channel` shared by migratable fibers on run queues
//! with workers, threads in timed waits (`lock_timeout`, `lock_until`,
//! `pop_timeout`, `pop_until`) and plain waits, an interrupter that also
//! makes stale wakes, spurious unparks, planned panics while a guard or a
//! message is held, and in "shutdown" rounds run queues whose last handle
//! is dropped while fibers sleep on the primitives (the fibers left `Ready`
//! are then run by hand).
//!
//! What must hold: the mutex is exclusive and counts every lock, nothing
//! is left locked or waiting, every fiber's life ends, and every message
//! is received, handed back by `Closed` or left in the channel exactly
//! once, and dropped once. It found nothing when it was written (300
//! rounds of each in release, 60 in debug); it stays as cover for thread
//! timed waits beside refused and abandoned fibers, which the other
//! stress tests do not mix.
mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{watchdog, XorShift};
use spindle_fiber::{yield_now, Fiber, FiberAttr, Priority};
use spindle_run_queue::RunQueue;
use spindle_sync::{Channel, Closed, Msg, Mutex};

struct Planned;

fn tiny(rng: &mut XorShift) -> Duration {
    match rng.below(4) {
        0 => Duration::ZERO,
        1 => Duration::from_nanos(rng.below(2000)),
        _ => Duration::from_micros(rng.below(300)),
    }
}

fn mig(f: impl FnOnce() + Send + 'static) -> Fiber<()> {
    let fiber = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
    // SAFETY: the closures keep only Arcs, spindle guards and messages
    // across suspensions, no thread-locals.
    unsafe { fiber.set_function_migratable(Priority::NORMAL, f) }.unwrap();
    fiber
}

fn worker(q: RunQueue<()>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        while let Some(f) = q.pop() {
            let _ = q.run_popped(f);
        }
    })
}

/// Interrupts and stale wakes of random fibers, spurious unparks of threads.
fn meddler(
    fibers: Vec<Fiber<()>>,
    threads: Vec<std::thread::Thread>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut rng = XorShift::new(seed);
        while !stop.load(SeqCst) {
            if !fibers.is_empty() {
                let f = &fibers[rng.below(fibers.len() as u64) as usize];
                match rng.below(3) {
                    0 => f.interrupt(),
                    1 => f.waiter().wake(),
                    _ => f.waiter().interrupt(),
                }
            }
            for t in &threads {
                t.unpark();
            }
            std::thread::yield_now();
        }
    })
}

/// Runs, by hand, fibers left `Ready` (refused or abandoned by their
/// dropped queue): a handle of their own runs them anyway.
/// The middle of a shutdown round: the queues are closed, their workers
/// joined and the queues dropped while fibers sleep on the primitive; in one
/// round of four a rescuer thread then runs the fibers left `Ready` by hand.
fn drop_queues(
    queues: Vec<RunQueue<()>>,
    workers: Vec<JoinHandle<()>>,
    fibers: &[Fiber<()>],
    round: u64,
    what: &str,
    stage: &common::Stage,
) -> Rescue {
    for q in &queues {
        q.close();
    }
    for w in workers {
        w.join().unwrap();
    }
    drop(queues);
    stage.set(format!("{what} round {round}: queues dropped"));
    let stop = Arc::new(AtomicBool::new(false));
    let thread = (round % 4 == 1).then(|| rescuer(fibers.to_vec(), stop.clone()));
    Rescue { stop, thread }
}

/// The rescuer of a shutdown round, if it has one.
struct Rescue {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Rescue {
    /// With a rescuer, waits until every fiber's life has ended, then stops it.
    fn finish(self, lives: &Lives, fibers: usize, round: u64, what: &str, stage: &common::Stage) {
        if let Some(r) = self.thread {
            stage.set(format!("{what} round {round}: rescued fibers finishing"));
            while lives.exited.load(SeqCst) < fibers {
                std::thread::yield_now();
            }
            self.stop.store(true, SeqCst);
            r.join().unwrap();
        }
    }
}

fn rescuer(fibers: Vec<Fiber<()>>, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(SeqCst) {
            for f in &fibers {
                if f.state() == spindle_fiber::FiberState::Ready {
                    let _ = f.run();
                }
            }
            std::thread::yield_now();
        }
    })
}

struct Lives {
    started: AtomicUsize,
    exited: AtomicUsize,
}

struct Exit<'a>(&'a Lives);
impl Drop for Exit<'_> {
    fn drop(&mut self) {
        self.0.exited.fetch_add(1, SeqCst);
    }
}

struct MCtx {
    m: Mutex<u64>,
    inside: AtomicBool,
    locks: AtomicU64,
    errors: AtomicUsize,
    lives: Lives,
}

fn critical(ctx: &MCtx, g: &mut spindle_sync::MutexGuard<'_, u64>, rng: &mut XorShift, fiber: bool) {
    if ctx.inside.swap(true, SeqCst) {
        ctx.errors.fetch_add(1, SeqCst);
        eprintln!("two holders at once");
    }
    **g += 1;
    ctx.locks.fetch_add(1, SeqCst);
    if rng.below(3) == 0 {
        yield_now();
    }
    ctx.inside.store(false, SeqCst);
    if fiber && rng.below(30) == 0 {
        std::panic::resume_unwind(Box::new(Planned));
    }
}

fn mutex_round(round: u64, shutdown: bool, stage: &common::Stage) {
    let ctx = Arc::new(MCtx {
        m: Mutex::new(0),
        inside: AtomicBool::new(false),
        locks: AtomicU64::new(0),
        errors: AtomicUsize::new(0),
        lives: Lives { started: AtomicUsize::new(0), exited: AtomicUsize::new(0) },
    });
    let stop_fibers = Arc::new(AtomicBool::new(false));
    let stop_threads = Arc::new(AtomicBool::new(false));
    let stop_meddler = Arc::new(AtomicBool::new(false));
    let queues: Vec<RunQueue<()>> = (0..2).map(|_| RunQueue::new(64)).collect();
    let workers: Vec<_> = queues.iter().map(|q| worker(q.clone())).collect();
    let mut fibers = Vec::new();
    for (qi, q) in queues.iter().enumerate() {
        for k in 0..3u64 {
            let (ctx, stop) = (ctx.clone(), stop_fibers.clone());
            let seed = round * 1000 + qi as u64 * 10 + k + 1;
            let f = mig(move || {
                ctx.lives.started.fetch_add(1, SeqCst);
                let _exit = Exit(&ctx.lives);
                let mut rng = XorShift::new(seed);
                while !stop.load(SeqCst) {
                    // A planned panic unwinds through the guard; the life
                    // goes on.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let g = if rng.below(2) == 0 {
                            Some(ctx.m.lock())
                        } else {
                            ctx.m.lock_interruptible().ok()
                        };
                        if let Some(mut g) = g {
                            critical(&ctx, &mut g, &mut rng, true);
                        }
                    }));
                    if rng.below(2) == 0 {
                        yield_now();
                    }
                }
            });
            q.try_push(f.clone()).unwrap();
            fibers.push(f);
        }
    }
    let threads: Vec<_> = (0..3u64)
        .map(|i| {
            let (ctx, stop) = (ctx.clone(), stop_threads.clone());
            std::thread::spawn(move || {
                let mut rng = XorShift::new(round * 7919 + i + 3);
                while !stop.load(SeqCst) {
                    let g = match rng.below(4) {
                        0 => Some(ctx.m.lock()),
                        1 => ctx.m.lock_until(Instant::now() + tiny(&mut rng)),
                        _ => ctx.m.lock_timeout(tiny(&mut rng)),
                    };
                    if let Some(mut g) = g {
                        critical(&ctx, &mut g, &mut rng, false);
                    }
                }
            })
        })
        .collect();
    let med = meddler(
        fibers.clone(),
        threads.iter().map(|t| t.thread().clone()).collect(),
        stop_meddler.clone(),
        round + 99,
    );
    let target = 2000;
    stage.set(format!("mutex round {round} shutdown={shutdown}: running"));
    while ctx.locks.load(SeqCst) < target {
        std::thread::yield_now();
    }
    if shutdown {
        // Workers stop with fibers asleep; then the queues go.
        let rescue = drop_queues(queues, workers, &fibers, round, "mutex", stage);
        let now = ctx.locks.load(SeqCst);
        // Threads must still get the lock past the orphaned fibers.
        while ctx.locks.load(SeqCst) < now + 500 {
            std::thread::yield_now();
        }
        stop_threads.store(true, SeqCst);
        for t in threads {
            t.join().unwrap();
        }
        stop_meddler.store(true, SeqCst);
        med.join().unwrap();
        stop_fibers.store(true, SeqCst);
        rescue.finish(&ctx.lives, fibers.len(), round, "mutex", stage);
        drop(fibers);
    } else {
        stop_threads.store(true, SeqCst);
        for t in threads {
            t.join().unwrap();
        }
        stop_fibers.store(true, SeqCst);
        stage.set(format!("mutex round {round}: fibers finishing"));
        while ctx.lives.exited.load(SeqCst) < fibers.len() {
            std::thread::yield_now();
        }
        stop_meddler.store(true, SeqCst);
        med.join().unwrap();
        for q in &queues {
            q.close();
        }
        for w in workers {
            w.join().unwrap();
        }
        drop(fibers);
        drop(queues);
    }
    stage.set(format!("mutex round {round}: final lock"));
    {
        let g = ctx.m.lock();
        assert_eq!(*g, ctx.locks.load(SeqCst), "round {round}: count");
    }
    assert_eq!(ctx.errors.load(SeqCst), 0, "round {round}: exclusion");
    assert!(!ctx.m.is_locked(), "round {round}: left locked");
    assert_eq!(ctx.m.waiters(), 0, "round {round}: waiters left");
    assert_eq!(
        ctx.lives.started.load(SeqCst),
        ctx.lives.exited.load(SeqCst),
        "round {round}: fiber lives that did not end"
    );
}

fn rounds() -> u64 {
    std::env::var("MIXED_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(30)
}

#[test]
fn mutex_with_fibers_timed_threads_meddling_and_dropped_queues() {
    for round in 0..rounds() {
        watchdog("mutex_with_fibers_timed_threads_meddling_and_dropped_queues", 60, move |stage| {
            mutex_round(round, round % 2 == 1, &stage);
        });
    }
}

struct Ledger {
    created: Vec<AtomicU32>,
    received: Vec<AtomicU32>,
    returned: Vec<AtomicU32>,
    dropped: Vec<AtomicU32>,
}

struct Tok {
    id: usize,
    ledger: Arc<Ledger>,
}

impl Drop for Tok {
    fn drop(&mut self) {
        self.ledger.dropped[self.id].fetch_add(1, SeqCst);
    }
}

struct CCtx {
    chan: Channel<Tok>,
    ledger: Arc<Ledger>,
    producers_left: AtomicUsize,
    lives: Lives,
    got: AtomicUsize,
}

fn produce(ctx: &CCtx, ids: std::ops::Range<usize>, rng: &mut XorShift, early_close: bool) {
    for id in ids {
        ctx.ledger.created[id].fetch_add(1, SeqCst);
        let tok = Tok { id, ledger: ctx.ledger.clone() };
        if let Err(Closed(m)) = ctx.chan.push(Msg::new(tok)) {
            ctx.ledger.returned[id].fetch_add(1, SeqCst);
            drop(m);
        }
        if rng.below(4) == 0 {
            yield_now();
        }
        if early_close && rng.below(400) == 0 {
            ctx.chan.close();
        }
    }
    if ctx.producers_left.fetch_sub(1, SeqCst) == 1 {
        ctx.chan.close();
    }
}

fn note(ctx: &CCtx, m: &Msg<Tok>) {
    if ctx.ledger.received[m.id].fetch_add(1, SeqCst) != 0 {
        eprintln!("message {} received twice", m.id);
    }
    ctx.got.fetch_add(1, SeqCst);
}

fn channel_round(round: u64, shutdown: bool, stage: &common::Stage) {
    const N: usize = 3000;
    let v = || (0..N).map(|_| AtomicU32::new(0)).collect();
    let ledger = Arc::new(Ledger { created: v(), received: v(), returned: v(), dropped: v() });
    let early_close = round % 3 == 2;
    let ctx = Arc::new(CCtx {
        chan: Channel::new(),
        ledger: ledger.clone(),
        producers_left: AtomicUsize::new(4),
        lives: Lives { started: AtomicUsize::new(0), exited: AtomicUsize::new(0) },
        got: AtomicUsize::new(0),
    });
    let stop_meddler = Arc::new(AtomicBool::new(false));
    let queues: Vec<RunQueue<()>> = (0..2).map(|_| RunQueue::new(64)).collect();
    let workers: Vec<_> = queues.iter().map(|q| worker(q.clone())).collect();
    let mut fibers = Vec::new();
    let per = N / 4;
    for (qi, q) in queues.iter().enumerate() {
        // One producer fiber per queue.
        let c = ctx.clone();
        let ids = qi * per..(qi + 1) * per;
        let seed = round * 31 + qi as u64 + 1;
        let f = mig(move || {
            c.lives.started.fetch_add(1, SeqCst);
            let _exit = Exit(&c.lives);
            produce(&c, ids, &mut XorShift::new(seed), early_close);
        });
        q.try_push(f.clone()).unwrap();
        fibers.push(f);
        for k in 0..3u64 {
            let c = ctx.clone();
            let seed = round * 1000 + qi as u64 * 10 + k + 5;
            let f = mig(move || {
                c.lives.started.fetch_add(1, SeqCst);
                let _exit = Exit(&c.lives);
                let mut rng = XorShift::new(seed);
                loop {
                    let got = if rng.below(2) == 0 {
                        c.chan.pop()
                    } else {
                        match c.chan.pop_interruptible() {
                            Ok(m) => m,
                            Err(_) => continue,
                        }
                    };
                    let Some(m) = got else { break };
                    // A planned panic drops the message it holds; the life
                    // goes on.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let m = m;
                        note(&c, &m);
                        if rng.below(3) == 0 {
                            yield_now();
                        }
                        if rng.below(50) == 0 {
                            std::panic::resume_unwind(Box::new(Planned));
                        }
                    }));
                }
            });
            q.try_push(f.clone()).unwrap();
            fibers.push(f);
        }
    }
    let producers: Vec<_> = (2..4usize)
        .map(|p| {
            let c = ctx.clone();
            std::thread::spawn(move || {
                produce(&c, p * per..(p + 1) * per, &mut XorShift::new(round * 77 + p as u64), early_close)
            })
        })
        .collect();
    let receivers: Vec<_> = (0..3u64)
        .map(|i| {
            let c = ctx.clone();
            std::thread::spawn(move || {
                let mut rng = XorShift::new(round * 7919 + i + 3);
                loop {
                    let got = match rng.below(4) {
                        0 => c.chan.pop(),
                        1 => match c.chan.pop_until(Instant::now() + tiny(&mut rng)) {
                            Ok(m) => m,
                            Err(_) => continue,
                        },
                        _ => match c.chan.pop_timeout(tiny(&mut rng)) {
                            Ok(m) => m,
                            Err(_) => continue,
                        },
                    };
                    let Some(m) = got else { break };
                    note(&c, &m);
                }
            })
        })
        .collect();
    let med = meddler(
        fibers.clone(),
        receivers.iter().map(|t| t.thread().clone()).collect(),
        stop_meddler.clone(),
        round + 99,
    );
    stage.set(format!("channel round {round} shutdown={shutdown}: running"));
    if shutdown {
        while ctx.got.load(SeqCst) < N / 3 && !ctx.chan.is_closed() {
            std::thread::yield_now();
        }
        let rescue = drop_queues(queues, workers, &fibers, round, "channel", stage);
        // Producer fibers may be stranded: close for them.
        for p in producers {
            p.join().unwrap();
        }
        rescue.finish(&ctx.lives, fibers.len(), round, "channel", stage);
        ctx.chan.close();
    } else {
        for p in producers {
            p.join().unwrap();
        }
        stage.set(format!("channel round {round}: waiting for fibers"));
        while ctx.lives.exited.load(SeqCst) < fibers.len() {
            std::thread::yield_now();
        }
        for q in &queues {
            q.close();
        }
        for w in workers {
            w.join().unwrap();
        }
        drop(queues);
    }
    stage.set(format!("channel round {round}: joining receivers"));
    for r in receivers {
        r.join().unwrap();
    }
    stop_meddler.store(true, SeqCst);
    med.join().unwrap();
    drop(fibers);
    stage.set(format!("channel round {round}: checking"));
    let mut left = vec![0u32; N];
    while let Some(m) = ctx.chan.try_pop() {
        left[m.id] += 1;
    }
    let lives = (ctx.lives.started.load(SeqCst), ctx.lives.exited.load(SeqCst));
    drop(ctx);
    let mut bad = Vec::new();
    for (id, &l) in left.iter().enumerate() {
        let r = ledger.received[id].load(SeqCst);
        let b = ledger.returned[id].load(SeqCst);
        let d = ledger.dropped[id].load(SeqCst);
        let c = ledger.created[id].load(SeqCst);
        if r + b + l != c || d != c || c > 1 {
            bad.push((id, c, r, b, l, d));
        }
    }
    assert!(
        bad.is_empty(),
        "round {round}: (id, created, received, returned, left, dropped): {:?}",
        &bad[..bad.len().min(10)]
    );
    assert_eq!(lives.0, lives.1, "round {round}: fiber lives that did not end");
}

#[test]
fn channel_with_fibers_timed_threads_meddling_close_and_dropped_queues() {
    for round in 0..rounds() {
        watchdog("channel_with_fibers_timed_threads_meddling_close_and_dropped_queues", 60, move |stage| {
            channel_round(round, round % 2 == 1, &stage);
        });
    }
}
