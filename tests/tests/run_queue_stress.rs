//! Randomized stress test (from an adversarial review): own worker threads
//! over one or more `RunQueue`s (no executor), pinned and migratable fibers
//! (migratable ones hop between queues), plain threads and fibers sharing
//! one `Semaphore`, one `Mutex` and one `Channel`, interrupts and stale
//! wakes from a meddling thread, `set_priority`, planned panics while a
//! token, a `MutexGuard` or a `Msg` is held, fiber reuse (a new function
//! after each life), small queue capacities, and a `Channel::close` that
//! may come early (from a random participant) or after the last producer.
//!
//! Each round checks: every message is dropped exactly once and was
//! received once, handed back by a closed channel once, or left in the
//! channel; semaphore tokens are conserved and never over-held; the mutex
//! is exclusive and its count matches; every fiber life ended (returned
//! or planned panic); no worker saw an error; no interruptible wait
//! returned `Interrupted` that nobody interrupted; queue stats add up.
//!
//! A second mode ("shutdown") stops the workers with fibers still asleep,
//! drops every run queue (abandoning what is queued) and then checks that
//! plain threads waiting on the same semaphore, mutex and channel still get
//! every token, the lock and every message: nothing handed to an abandoned
//! or refused fiber is lost.
//!
//! Seeds: `STRESS_SEED_START` (default 1) and `STRESS_SEEDS` (default 60).
//! A watchdog exits the process (status 3) naming the seed and stage if a
//! round makes no progress for `STRESS_WATCHDOG_SECS` (default 60).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::XorShift;
use spindle_fiber::{set_current_priority, yield_now, Fiber, FiberAttr, Priority, RunOutcome, Waiter};
use spindle_run_queue::{PushError, RunQueue};
use spindle_sync::{Channel, Closed, Interrupted, Msg, Mutex, Semaphore};

/// What the watchdog prints about the round in progress.
static STATUS: std::sync::Mutex<Option<Box<dyn Fn() -> String + Send>>> = std::sync::Mutex::new(None);
/// Round number, for the per-round deadline.
static ROUND: AtomicU64 = AtomicU64::new(0);

/// The payload of a planned panic (raised with `resume_unwind`: no hook
/// output).
struct Planned;

/// Per-message bookkeeping.
struct Ledger {
    received: Vec<AtomicU32>,
    returned: Vec<AtomicU32>,
    dropped: Vec<AtomicU32>,
}

impl Ledger {
    fn new(n: usize) -> Ledger {
        let v = || (0..n).map(|_| AtomicU32::new(0)).collect();
        Ledger { received: v(), returned: v(), dropped: v() }
    }
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

struct Ctx {
    _seed: u64,
    sem: Semaphore,
    sem_tokens: usize,
    sem_held: AtomicUsize,
    mtx: Mutex<u64>,
    mtx_inside: AtomicBool,
    mtx_locks: AtomicU64,
    chan: Channel<Tok>,
    ledger: Arc<Ledger>,
    producers_left: AtomicUsize,
    early_close: bool,
    /// Per fiber life: an interrupt was sent to one of its waiters.
    interrupt_sent: Vec<AtomicBool>,
    /// Per fiber slot: `Fiber::interrupt` was called on it (any life).
    slot_interrupted: Vec<AtomicBool>,
    waiters: std::sync::Mutex<Vec<(usize, usize, Waiter)>>,
    errors: std::sync::Mutex<Vec<String>>,
    progress: Arc<AtomicU64>,
    stage: Arc<std::sync::Mutex<String>>,
    planned_panics: AtomicUsize,
    interrupted_waits: AtomicUsize,
    /// Fiber lives whose function started, and those whose function
    /// ended (returned, panicked, or unwound because it was dropped).
    started: AtomicUsize,
    exited: AtomicUsize,
}

/// Counts a fiber life's end, however it ends.
struct Exit<'a>(&'a Ctx);

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        self.0.exited.fetch_add(1, SeqCst);
    }
}

impl Ctx {
    fn error(&self, e: String) {
        let mut errs = self.errors.lock().unwrap();
        if errs.len() < 20 {
            errs.push(e);
        }
    }

    fn tick(&self) {
        self.progress.fetch_add(1, SeqCst);
    }
}

/// Gives its tokens back when dropped (also while unwinding), with one
/// `release(n)`.
struct Token<'a>(&'a Ctx, usize);

impl<'a> Token<'a> {
    fn new(ctx: &'a Ctx) -> Token<'a> {
        let mut t = Token(ctx, 0);
        t.add();
        t
    }

    /// Counts one more token acquired.
    fn add(&mut self) {
        let held = self.0.sem_held.fetch_add(1, SeqCst) + 1;
        if held > self.0.sem_tokens {
            self.0.error(format!("{held} tokens held at once, only {} exist", self.0.sem_tokens));
        }
        self.1 += 1;
    }
}

impl Drop for Token<'_> {
    fn drop(&mut self) {
        self.0.sem_held.fetch_sub(self.1, SeqCst);
        self.0.sem.release(self.1);
    }
}

/// Marks the mutex's critical section; checks exclusion.
struct Inside<'a>(&'a Ctx);

impl<'a> Inside<'a> {
    fn enter(ctx: &'a Ctx, guard: &mut spindle_sync::MutexGuard<'_, u64>) -> Inside<'a> {
        if ctx.mtx_inside.swap(true, SeqCst) {
            ctx.error("two holders of the mutex at once".into());
        }
        **guard += 1;
        ctx.mtx_locks.fetch_add(1, SeqCst);
        Inside(ctx)
    }
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.mtx_inside.store(false, SeqCst);
    }
}

/// The messages a producer still has to push; pushes them all and counts
/// the producer done when dropped (also while unwinding).
struct Producer<'a> {
    ctx: &'a Ctx,
    ids: std::ops::Range<usize>,
}

impl Producer<'_> {
    fn push_one(&mut self) {
        if let Some(id) = self.ids.next() {
            let tok = Tok { id, ledger: self.ctx.ledger.clone() };
            if let Err(Closed(m)) = self.ctx.chan.push(Msg::new(tok)) {
                self.ctx.ledger.returned[id].fetch_add(1, SeqCst);
                drop(m);
            }
        }
    }
}

impl Drop for Producer<'_> {
    fn drop(&mut self) {
        while !self.ids.is_empty() {
            self.push_one();
        }
        if self.ctx.producers_left.fetch_sub(1, SeqCst) == 1 {
            self.ctx.chan.close();
        }
    }
}

fn pause() {
    // In a fiber: a yield; on a thread: a thread yield.
    yield_now();
}

fn planned_panic(ctx: &Ctx) -> ! {
    ctx.planned_panics.fetch_add(1, SeqCst);
    std::panic::resume_unwind(Box::new(Planned))
}

/// What a participant (fiber life or thread) does. `life` is the fiber
/// life's index (None on a thread). `consumer`: may wait on the channel.
fn script(
    ctx: &Ctx,
    rng: &mut XorShift,
    life: Option<(usize, usize)>,
    mut producer: Option<Producer<'_>>,
    consumer: bool,
) {
    let ops = 4 + rng.below(36);
    let mut chan_done = false;
    let interrupted = |ctx: &Ctx| {
        ctx.interrupted_waits.fetch_add(1, SeqCst);
        if let Some((l, slot)) = life {
            if !ctx.interrupt_sent[l].load(SeqCst) && !ctx.slot_interrupted[slot].load(SeqCst) {
                ctx.error(format!("life {l} (slot {slot}): Interrupted with no interrupt sent to it"));
            }
        }
    };
    for _ in 0..ops {
        ctx.tick();
        match rng.below(17) {
            0 => {
                // Busy work, so that rounds overlap on the workers.
                let n = rng.below(20_000);
                let mut x = 1u64;
                for i in 0..n {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
                }
                std::hint::black_box(x);
                pause();
            }
            1 => {
                set_current_priority(Priority(rng.below(256) as u8));
                pause();
            }
            2 | 3 => {
                // A token, held across yields, maybe with the lock inside.
                match rng.below(3) {
                    0 => ctx.sem.acquire(),
                    1 => ctx.sem.acquire_with_priority(Priority(rng.below(256) as u8)),
                    _ => {
                        if ctx.sem.acquire_interruptible().is_err() {
                            interrupted(ctx);
                            continue;
                        }
                    }
                }
                let _t = Token::new(ctx);
                for _ in 0..rng.below(3) {
                    pause();
                }
                if rng.below(3) == 0 {
                    let mut g = ctx.mtx.lock();
                    let _in = Inside::enter(ctx, &mut g);
                    pause();
                }
                if rng.below(40) == 0 {
                    planned_panic(ctx);
                }
            }
            4 => {
                if ctx.sem.try_acquire() {
                    let mut t = Token::new(ctx);
                    pause();
                    if rng.below(2) == 0 && ctx.sem.try_acquire() {
                        // Two tokens given back by one release(2).
                        t.add();
                        pause();
                    }
                }
            }
            5 | 6 => {
                let mut g = if rng.below(2) == 0 {
                    ctx.mtx.lock()
                } else {
                    match ctx.mtx.lock_interruptible() {
                        Ok(g) => g,
                        Err(Interrupted) => {
                            interrupted(ctx);
                            continue;
                        }
                    }
                };
                let _in = Inside::enter(ctx, &mut g);
                for _ in 0..rng.below(3) {
                    pause();
                }
                if rng.below(40) == 0 {
                    planned_panic(ctx);
                }
            }
            7 => {
                if let Some(mut g) = ctx.mtx.try_lock() {
                    let _in = Inside::enter(ctx, &mut g);
                    pause();
                }
            }
            8..=10 if consumer && !chan_done => {
                let got = if rng.below(2) == 0 {
                    ctx.chan.pop()
                } else {
                    match ctx.chan.pop_interruptible() {
                        Ok(m) => m,
                        Err(Interrupted) => {
                            interrupted(ctx);
                            continue;
                        }
                    }
                };
                match got {
                    None => chan_done = true,
                    Some(m) => {
                        let id = m.id;
                        if ctx.ledger.received[id].fetch_add(1, SeqCst) != 0 {
                            ctx.error(format!("message {id} received twice"));
                        }
                        if rng.below(2) == 0 {
                            pause(); // holding the message
                        }
                        if rng.below(40) == 0 {
                            planned_panic(ctx); // drops the message while unwinding
                        }
                        drop(m);
                    }
                }
            }
            11 => {
                if let Some(m) = ctx.chan.try_pop() {
                    if ctx.ledger.received[m.id].fetch_add(1, SeqCst) != 0 {
                        ctx.error(format!("message {} received twice", m.id));
                    }
                }
            }
            12 | 13 => {
                if let Some(p) = producer.as_mut() {
                    p.push_one();
                }
            }
            14 | 16 => {
                if let (Some((l, slot)), Some(w)) = (life, Waiter::current()) {
                    ctx.waiters.lock().unwrap().push((l, slot, w));
                }
            }
            _ => {
                if ctx.early_close && rng.below(8) == 0 {
                    ctx.chan.close();
                }
            }
        }
    }
    drop(producer);
}

#[derive(Clone, Copy)]
struct Life {
    seed: u64,
    migratable: bool,
    priority: Priority,
    producer: Option<(usize, usize)>,
    consumer: bool,
}

struct Slot {
    lives: Vec<(usize, Life)>,
    next: AtomicUsize,
}

fn set_life(ctx: &Arc<Ctx>, fiber: &Fiber<()>, slot: usize, l: usize, life: Life) {
    let c = ctx.clone();
    let body = move || {
        c.started.fetch_add(1, SeqCst);
        let _exit = Exit(&c);
        let mut rng = XorShift::new(life.seed);
        let producer = life.producer.map(|(a, b)| Producer { ctx: &c, ids: a..b });
        script(&c, &mut rng, Some((l, slot)), producer, life.consumer);
    };
    let r = if life.migratable {
        // SAFETY: the body keeps no !Send value and no thread-local reference
        // across a suspension (Arcs, atomics, a spindle MutexGuard, a Msg, a
        // token guard), reads no thread-local after one, and does not
        // suspend while unwinding (the guards' drops only release and wake).
        unsafe { fiber.set_function_migratable(life.priority, body) }
    } else {
        fiber.set_function(life.priority, body)
    };
    r.expect("set_function on a finished fiber");
    fiber.set_sched_data(slot);
}

struct Round {
    seed: u64,
    shutdown: bool,
}

fn run_round(
    r: &Round,
    progress: &Arc<AtomicU64>,
    stage: &Arc<std::sync::Mutex<String>>,
) -> Result<String, String> {
    let mut rng = XorShift::new(r.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x1234_5678);
    let nqueues = 1 + rng.below(2) as usize;
    let workers_per_queue = 1 + rng.below(3) as usize;
    let nslots = 2 + rng.below(14) as usize;
    let nthreads = rng.below(3) as usize;
    let capacity = 1 + rng.below(nslots as u64) as usize;
    let sem_tokens = 1 + rng.below(3) as usize;
    let nmsgs = rng.below(100) as usize;
    let early_close = rng.below(3) == 0;
    let hop = rng.below(2) == 0;

    // Participants: lives of fiber slots, and threads.
    let mut slots = Vec::new();
    let mut nlives = 0;
    let mut producer_count = 0;
    // Messages: split among producers (fiber lives and threads).
    let mut msg_next = 0;
    let mut take_msgs = |rng: &mut XorShift| -> Option<(usize, usize)> {
        if rng.below(3) == 0 {
            let n = rng.below(12) as usize;
            let a = msg_next.min(nmsgs);
            let b = (msg_next + n).min(nmsgs);
            msg_next = b;
            Some((a, b))
        } else {
            None
        }
    };
    for _ in 0..nslots {
        let k = 1 + rng.below(3) as usize;
        let mut lives = Vec::new();
        for i in 0..k {
            // Only first lives produce: a later life starts only after the
            // earlier ones end, and a consumer before it may be waiting
            // for the close that the producers make.
            let producer = if i == 0 { take_msgs(&mut rng) } else { None };
            if producer.is_some() {
                producer_count += 1;
            }
            let life = Life {
                seed: rng.next_u64(),
                migratable: r.shutdown || rng.below(2) == 0,
                priority: Priority(rng.below(256) as u8),
                consumer: producer.is_none() && rng.below(2) == 0,
                producer,
            };
            lives.push((nlives, life));
            nlives += 1;
        }
        slots.push(Slot { lives, next: AtomicUsize::new(1) });
    }
    let mut threads_cfg = Vec::new();
    for _ in 0..nthreads {
        let producer = take_msgs(&mut rng);
        if producer.is_some() {
            producer_count += 1;
        }
        threads_cfg.push((rng.next_u64(), producer, producer.is_none() && rng.below(2) == 0));
    }
    // Whatever is left goes to the main thread as a producer at the end.
    let rest = (msg_next, nmsgs);
    producer_count += 1;

    let ledger = Arc::new(Ledger::new(nmsgs));
    let ctx = Arc::new(Ctx {
        _seed: r.seed,
        sem: Semaphore::new(sem_tokens),
        sem_tokens,
        sem_held: AtomicUsize::new(0),
        mtx: Mutex::new(0),
        mtx_inside: AtomicBool::new(false),
        mtx_locks: AtomicU64::new(0),
        chan: Channel::new(),
        ledger: ledger.clone(),
        producers_left: AtomicUsize::new(producer_count),
        early_close,
        interrupt_sent: (0..nlives).map(|_| AtomicBool::new(false)).collect(),
        slot_interrupted: (0..nslots).map(|_| AtomicBool::new(false)).collect(),
        waiters: std::sync::Mutex::new(Vec::new()),
        errors: std::sync::Mutex::new(Vec::new()),
        progress: progress.clone(),
        stage: stage.clone(),
        planned_panics: AtomicUsize::new(0),
        interrupted_waits: AtomicUsize::new(0),
        started: AtomicUsize::new(0),
        exited: AtomicUsize::new(0),
    });
    let set_stage = |s: String| *ctx.stage.lock().unwrap() = format!("seed {}: {s}", r.seed);
    set_stage(format!(
        "setup: {nqueues} queues x {workers_per_queue} workers, {nslots} slots / {nlives} lives, {nthreads} \
         threads, capacity {capacity}, {sem_tokens} tokens, {nmsgs} msgs, early_close {early_close}, hop {hop}, \
         shutdown {}",
        r.shutdown
    ));
    let slots = Arc::new(slots);
    let queues: Vec<RunQueue> = (0..nqueues).map(|_| RunQueue::new(capacity)).collect();
    let slots_done = Arc::new(AtomicUsize::new(0));
    let lives_ended = Arc::new(AtomicUsize::new(0));
    let stop_workers = Arc::new(AtomicBool::new(false));

    // Workers.
    let mut workers = Vec::new();
    for q in 0..nqueues {
        for w in 0..workers_per_queue {
            let queues = queues.clone();
            let (ctx, slots, slots_done, lives_ended, stop) =
                (ctx.clone(), slots.clone(), slots_done.clone(), lives_ended.clone(), stop_workers.clone());
            let mut wrng = XorShift::new(r.seed ^ (((q * 8 + w) as u64 + 1) * 0xABCD_EF01));
            workers.push(std::thread::spawn(move || {
                let me = &queues[q];
                loop {
                    let f = if stop.load(SeqCst) {
                        // Shutdown mode: stop popping at once (fibers may
                        // still sleep or be queued).
                        break;
                    } else {
                        me.pop_timeout(Duration::from_millis(20))
                    };
                    let Some(mut f) = f else {
                        if me.is_closed() {
                            break;
                        }
                        continue;
                    };
                    ctx.tick();
                    let slot = f.sched_data();
                    if wrng.below(16) == 0 {
                        me.set_priority(&f, Priority(wrng.below(256) as u8));
                    }
                    // Hop a migratable fiber that yields to another queue.
                    let outcome = if hop && nqueues > 1 && wrng.below(2) == 0 {
                        let out = f.run_mut();
                        if let Ok(RunOutcome::Yielded(_)) = &out {
                            let j = wrng.below(nqueues as u64) as usize;
                            let migratable = f.may_run_here() && {
                                // A pinned function is pinned here now; only
                                // migratable ones (no pin) may hop.
                                !f.is_pinned_here()
                            };
                            if migratable && j != q {
                                match queues[j].try_push(f.clone()) {
                                    Ok(()) => {}
                                    Err(PushError::Full(f2)) | Err(PushError::Closed(f2)) => {
                                        if let Err(e) = me.requeue(&f2) {
                                            ctx.error(format!("requeue after a refused hop: {e}"));
                                        }
                                    }
                                    Err(e) => ctx.error(format!("hop push: {e}")),
                                }
                            } else if let Err(e) = me.requeue(&f) {
                                ctx.error(format!("requeue: {e}"));
                            }
                        }
                        out
                    } else {
                        me.run_popped(f.clone()).outcome
                    };
                    match outcome {
                        Ok(RunOutcome::Yielded(_)) | Ok(RunOutcome::Slept) => {}
                        Ok(RunOutcome::Returned(())) | Ok(RunOutcome::Panicked(_)) => {
                            if let Ok(RunOutcome::Panicked(p)) = outcome {
                                if !p.payload.is::<Planned>() {
                                    ctx.error(format!("unplanned panic in slot {slot}: {:?}", p.message()));
                                }
                            }
                            lives_ended.fetch_add(1, SeqCst);
                            let s = &slots[slot];
                            let n = s.next.fetch_add(1, SeqCst);
                            if n < s.lives.len() {
                                let (l, life) = s.lives[n];
                                set_life(&ctx, &f, slot, l, life);
                                match me.try_push(f.clone()) {
                                    Ok(()) => {}
                                    Err(PushError::Full(f2)) => {
                                        if let Err(e) = me.requeue(&f2) {
                                            ctx.error(format!("requeue of a new life: {e}"));
                                        }
                                    }
                                    // Shutdown mode: closed; the new life is dropped unstarted.
                                    Err(PushError::Closed(_)) if stop.load(SeqCst) => {}
                                    Err(e) => ctx.error(format!("push of a new life: {e}")),
                                }
                            } else if slots_done.fetch_add(1, SeqCst) + 1 == slots.len() {
                                for q in &queues {
                                    q.close();
                                }
                            }
                        }
                        Err(e) => ctx.error(format!("worker {q}/{w}: run error {e}")),
                    }
                    drop(f);
                }
            }));
        }
    }

    // Plain threads.
    let mut threads = Vec::new();
    for (seed, producer, consumer) in threads_cfg {
        let ctx = ctx.clone();
        threads.push(std::thread::spawn(move || {
            let mut rng = XorShift::new(seed);
            let producer = producer.map(|(a, b)| Producer { ctx: &ctx, ids: a..b });
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                script(&ctx, &mut rng, None, producer, consumer)
            }));
            if let Err(p) = r {
                if !p.is::<Planned>() {
                    std::panic::resume_unwind(p);
                }
            }
        }));
    }

    // Fibers: first lives, pushed (retrying while full).
    let mut handles = Vec::new();
    let mut pending: Vec<(usize, Fiber<()>)> = Vec::new();
    for (slot, s) in slots.iter().enumerate() {
        let f = Fiber::new(FiberAttr::new().stack_size(64 * 1024).name(format!("slot{slot}"))).unwrap();
        let (l, life) = s.lives[0];
        set_life(&ctx, &f, slot, l, life);
        if rng.below(3) == 0 {
            handles.push(f.clone());
        }
        pending.push((rng.below(nqueues as u64) as usize, f));
    }
    {
        let all: Vec<Fiber<()>> = pending.iter().map(|(_, f)| f.clone()).collect();
        let qs: Vec<RunQueue> = queues.clone();
        let c = ctx.clone();
        let (ld, sd) = (lives_ended.clone(), slots_done.clone());
        *STATUS.lock().unwrap() = Some(Box::new(move || {
            let mut out = format!(
                "lives ended {}, slots done {}, sem avail {} waiters {} held {}, mutex locked {} waiters {}, chan len {} receivers {} closed {}, producers left {}\n",
                ld.load(SeqCst), sd.load(SeqCst), c.sem.available(), c.sem.waiters(), c.sem_held.load(SeqCst),
                c.mtx.is_locked(), c.mtx.waiters(), c.chan.len(), c.chan.receivers(), c.chan.is_closed(),
                c.producers_left.load(SeqCst)
            );
            for (i, q) in qs.iter().enumerate() {
                out += &format!("queue {i}: {q:?}\n");
            }
            for f in &all {
                out += &format!(
                    "fiber {:?} slot {} state {:?} prio {:?} stats {:?} wait {:?}\n",
                    f.name(),
                    f.sched_data(),
                    f.state(),
                    f.priority(),
                    f.stats(),
                    f.wait_site().map(|w| w.0)
                );
            }
            out
        }));
    }
    set_stage("pushing the first lives".into());
    while !pending.is_empty() {
        let mut left = Vec::new();
        for (q, f) in pending {
            match queues[q].try_push(f) {
                Ok(()) => ctx.tick(),
                Err(PushError::Full(f)) => left.push((q, f)),
                Err(e) => return Err(format!("first push: {e}")),
            }
        }
        pending = left;
        if !pending.is_empty() {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    // The meddler: interrupts, stale wakes, priorities, early closes.
    let meddle_stop = Arc::new(AtomicBool::new(false));
    let meddler = {
        let (ctx, stop, queues) = (ctx.clone(), meddle_stop.clone(), queues.clone());
        let mut mrng = XorShift::new(r.seed ^ 0x5555_AAAA);
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(SeqCst) {
                n += 1;
                match mrng.below(6) {
                    0 | 1 => {
                        let w = {
                            let mut ws = ctx.waiters.lock().unwrap();
                            if ws.is_empty() {
                                None
                            } else {
                                let i = mrng.below(ws.len() as u64) as usize;
                                Some(ws.swap_remove(i))
                            }
                        };
                        if let Some((l, _slot, w)) = w {
                            match mrng.below(3) {
                                0 => {
                                    ctx.interrupt_sent[l].store(true, SeqCst);
                                    w.interrupt();
                                }
                                1 => w.wake(),
                                _ => {
                                    // Keep it a while longer.
                                    ctx.waiters.lock().unwrap().push((l, _slot, w));
                                }
                            }
                        }
                    }
                    2 if !handles.is_empty() => {
                        let f = &handles[mrng.below(handles.len() as u64) as usize];
                        let q = &queues[mrng.below(queues.len() as u64) as usize];
                        q.set_priority(f, Priority(mrng.below(256) as u8));
                    }
                    3 if !handles.is_empty() => {
                        let f = &handles[mrng.below(handles.len() as u64) as usize];
                        ctx.slot_interrupted[f.sched_data()].store(true, SeqCst);
                        f.interrupt();
                    }
                    4 if ctx.early_close && mrng.below(50) == 0 => {
                        ctx.chan.close();
                    }
                    _ => {}
                }
                if n.is_multiple_of(64) {
                    std::thread::sleep(Duration::from_micros(20));
                } else {
                    std::thread::yield_now();
                }
            }
            drop(handles);
        })
    };

    // The main thread's own messages.
    {
        let mut p = Producer { ctx: &ctx, ids: rest.0..rest.1 };
        while !p.ids.is_empty() {
            p.push_one();
            if rng.below(4) == 0 {
                std::thread::yield_now();
            }
        }
    }

    if r.shutdown {
        // Let the round run a little, then stop the workers wherever they
        // are (every fiber is migratable in this mode: abandoned ones are
        // unwound where the queue is dropped, so what they hold is let go).
        let ms = rng.below(5);
        std::thread::sleep(Duration::from_millis(ms));
        set_stage("shutdown: stopping workers".into());
        stop_workers.store(true, SeqCst);
        for q in &queues {
            q.close();
        }
        for w in workers {
            if w.join().is_err() {
                ctx.error("a worker thread panicked".into());
            }
        }
        meddle_stop.store(true, SeqCst);
        meddler.join().unwrap();
        // Stale waiters and the watchdog's status hold references: gone first.
        ctx.waiters.lock().unwrap().clear();
        drop(STATUS.lock().unwrap().take());
        set_stage("shutdown: dropping the queues".into());
        drop(queues);
        // Receivers asleep now are woken with None (refused, unwound).
        ctx.chan.close();
        set_stage("shutdown: joining plain threads".into());
        for t in threads {
            if t.join().is_err() {
                ctx.error("a plain thread panicked".into());
            }
        }
        set_stage("shutdown: checking".into());
        let mut errs = ctx.errors.lock().unwrap().clone();
        let held = ctx.sem_held.load(SeqCst);
        let avail = ctx.sem.available();
        let sem_waiters = ctx.sem.waiters();
        if held != 0 || avail != sem_tokens || (avail > 0 && sem_waiters > 0) {
            errs.push(format!(
                "semaphore after shutdown: {held} held, {avail} available of {sem_tokens}, {sem_waiters} waiters"
            ));
        }
        if ctx.mtx_inside.load(SeqCst) || ctx.mtx.is_locked() || ctx.mtx.waiters() != 0 {
            errs.push(format!(
                "mutex after shutdown: inside {}, locked {}, {} waiters",
                ctx.mtx_inside.load(SeqCst),
                ctx.mtx.is_locked(),
                ctx.mtx.waiters()
            ));
        }
        if ctx.chan.receivers() != 0 {
            errs.push(format!("{} receivers still waiting on the closed channel", ctx.chan.receivers()));
        }
        let (st, ex) = (ctx.started.load(SeqCst), ctx.exited.load(SeqCst));
        if st - ex != sem_waiters {
            errs.push(format!(
                "fibers: {st} started, {ex} ended or unwound, {sem_waiters} asleep on the semaphore"
            ));
        }
        if errs.is_empty() {
            // Nothing may block now.
            set_stage("shutdown: a thread takes every token and the lock".into());
            for _ in 0..sem_tokens {
                ctx.sem.acquire();
            }
            drop(ctx.mtx.lock());
        }
        let mut left = vec![0u32; nmsgs];
        while let Some(m) = ctx.chan.try_pop() {
            left[m.id] += 1;
        }
        for (id, &left) in left.iter().enumerate() {
            let rcv = ledger.received[id].load(SeqCst);
            let ret = ledger.returned[id].load(SeqCst);
            let drp = ledger.dropped[id].load(SeqCst);
            // A message not yet pushed by a producer fiber that is asleep
            // for good (on the semaphore) was never created: all zero.
            let never = rcv + ret + left + drp == 0;
            if !never && (rcv + ret + left != 1 || drp != 1) {
                errs.push(format!(
                    "message {id}: received {rcv}, returned {ret}, left {left}, dropped {drp}"
                ));
            }
        }
        if !errs.is_empty() {
            return Err(errs.join("\n"));
        }
        return Ok(format!("shutdown, {} of {nlives} lives ended", lives_ended.load(SeqCst)));
    }

    set_stage("waiting for workers (every life ends)".into());
    for w in workers {
        if w.join().is_err() {
            ctx.error("a worker thread panicked".into());
        }
    }
    set_stage("joining plain threads".into());
    for t in threads {
        if t.join().is_err() {
            ctx.error("a plain thread panicked".into());
        }
    }
    meddle_stop.store(true, SeqCst);
    meddler.join().unwrap();
    ctx.waiters.lock().unwrap().clear();

    set_stage("checking".into());
    drop(STATUS.lock().unwrap().take());
    let mut errs = ctx.errors.lock().unwrap().clone();
    if lives_ended.load(SeqCst) != nlives {
        errs.push(format!("{} of {nlives} lives ended", lives_ended.load(SeqCst)));
    }
    for q in &queues {
        let s = q.stats();
        if !q.is_empty() || s.pushes != s.pops {
            errs.push(format!("queue not empty at the end: len {}, {s:?}", q.len()));
        }
    }
    if ctx.sem.available() != sem_tokens || ctx.sem.waiters() != 0 || ctx.sem_held.load(SeqCst) != 0 {
        errs.push(format!(
            "semaphore: {} available of {sem_tokens}, {} waiters, {} held",
            ctx.sem.available(),
            ctx.sem.waiters(),
            ctx.sem_held.load(SeqCst)
        ));
    }
    match ctx.mtx.try_lock() {
        Some(g) => {
            if *g != ctx.mtx_locks.load(SeqCst) {
                errs.push(format!("mutex count {} != locks {}", *g, ctx.mtx_locks.load(SeqCst)));
            }
        }
        None => errs.push(format!("mutex still locked at the end, {} waiters", ctx.mtx.waiters())),
    }
    if ctx.started.load(SeqCst) != nlives || ctx.exited.load(SeqCst) != nlives {
        errs.push(format!(
            "{} lives started, {} exited, of {nlives}",
            ctx.started.load(SeqCst),
            ctx.exited.load(SeqCst)
        ));
    }
    if !ctx.chan.is_closed() {
        errs.push("channel not closed after every producer ended".into());
    }
    if ctx.chan.receivers() != 0 {
        errs.push(format!("{} receivers still waiting", ctx.chan.receivers()));
    }
    let mut left = vec![0u32; nmsgs];
    while let Some(m) = ctx.chan.try_pop() {
        left[m.id] += 1;
    }
    drop(queues);
    for (id, &left) in left.iter().enumerate() {
        let rcv = ledger.received[id].load(SeqCst);
        let ret = ledger.returned[id].load(SeqCst);
        let drp = ledger.dropped[id].load(SeqCst);
        if rcv + ret + left != 1 || drp != 1 {
            errs.push(format!("message {id}: received {rcv}, returned {ret}, left {left}, dropped {drp}"));
        }
    }
    if !errs.is_empty() {
        return Err(errs.join("\n"));
    }
    Ok(format!(
        "{nlives} lives, {} panics, {} interrupted waits, {} locks",
        ctx.planned_panics.load(SeqCst),
        ctx.interrupted_waits.load(SeqCst),
        ctx.mtx_locks.load(SeqCst)
    ))
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn run_seeds(shutdown: bool) {
    let start = env("STRESS_SEED_START", 1);
    let count = env("STRESS_SEEDS", 60);
    let secs = env("STRESS_WATCHDOG_SECS", 60);
    let progress = Arc::new(AtomicU64::new(0));
    let stage = Arc::new(std::sync::Mutex::new(String::from("starting")));
    {
        let (progress, stage) = (progress.clone(), stage.clone());
        std::thread::spawn(move || {
            let mut seen = progress.load(SeqCst);
            let round_secs = env("STRESS_ROUND_SECS", 120);
            let mut round = (ROUND.load(SeqCst), std::time::Instant::now());
            loop {
                std::thread::sleep(Duration::from_secs(secs));
                let now = progress.load(SeqCst);
                let r = ROUND.load(SeqCst);
                if r != round.0 {
                    round = (r, std::time::Instant::now());
                }
                let too_long = round.1.elapsed() > Duration::from_secs(round_secs);
                if now == seen || too_long {
                    if let Some(st) = STATUS.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                        eprintln!("watchdog status:\n{}", st());
                    }
                    if too_long {
                        eprintln!("watchdog: the round ran longer than {round_secs}s (progress still moving: a livelock?)");
                    }
                    eprintln!(
                        "watchdog: run_queue_stress (shutdown {shutdown}) made no progress for {secs}s: {} (a hang: \
                         lost wakeup or deadlock)",
                        stage.lock().unwrap_or_else(|e| e.into_inner())
                    );
                    std::process::exit(3);
                }
                seen = now;
            }
        });
    }
    let verbose = std::env::var("STRESS_VERBOSE").is_ok();
    let mut failures = Vec::new();
    for seed in start..start + count {
        progress.fetch_add(1, SeqCst);
        ROUND.store(seed, SeqCst);
        match run_round(&Round { seed, shutdown }, &progress, &stage) {
            Ok(s) => {
                if verbose {
                    eprintln!("seed {seed}: ok: {s}");
                }
            }
            Err(e) => {
                eprintln!("seed {seed}: FAILED:\n{e}");
                failures.push(seed);
                if failures.len() >= 5 {
                    break;
                }
            }
        }
    }
    assert!(failures.is_empty(), "failed seeds: {failures:?}");
    eprintln!("run_queue_stress (shutdown {shutdown}): seeds {start}..{} passed", start + count);
}

#[test]
fn every_life_completes() {
    run_seeds(false);
}

#[test]
fn workers_stop_mid_round() {
    run_seeds(true);
}

/// The last handle of a run queue dropped inside a fiber that runs on a
/// worker: the queued fibers (migratable, each suspended holding a token,
/// the lock, or a received message) are abandoned and unwound right there,
/// nested on the running fiber's thread, and a plain thread waiting for
/// the token, the lock and the message gets all three.
#[test]
fn the_last_queue_handle_dropped_inside_a_fiber_lets_go_of_everything() {
    common::watchdog("the_last_queue_handle_dropped_inside_a_fiber_lets_go_of_everything", 60, |stage| {
        for round in 0..200u64 {
            stage.set(format!("round {round}"));
            let sem = Arc::new(Semaphore::new(1));
            let mtx = Arc::new(Mutex::new(0u32));
            let chan = Arc::new(Channel::<u32>::new());
            let queue: RunQueue = RunQueue::new(8);
            // Holders: each takes its thing and yields for ever (until dropped).
            let mk = |f: Box<dyn FnOnce() + Send>| {
                let fiber = Fiber::new(FiberAttr::new().stack_size(64 * 1024)).unwrap();
                // SAFETY: the closures keep only Arcs, a spindle guard, a
                // token and a Msg across suspensions.
                unsafe { fiber.set_function_migratable(Priority::NORMAL, f) }.unwrap();
                fiber
            };
            let (s, m, c) = (sem.clone(), mtx.clone(), chan.clone());
            let holder = mk(Box::new(move || {
                s.acquire();
                struct Give(Arc<Semaphore>);
                impl Drop for Give {
                    fn drop(&mut self) {
                        self.0.release(1);
                    }
                }
                let _t = Give(s);
                let _g = m.lock();
                let msg = c.pop();
                loop {
                    yield_now();
                    std::hint::black_box(&msg);
                }
            }));
            queue.try_push(holder).unwrap();
            // Run the holder until it waits for the message, then push one
            // (it is handed over and the holder queued again).
            let ran = queue.run_next().unwrap();
            assert!(matches!(ran.outcome, Ok(RunOutcome::Slept)), "{:?}", ran.outcome);
            drop(ran);
            // A plain thread that wants the token, the lock and a message.
            let waiter = {
                let (s, m, c) = (sem.clone(), mtx.clone(), chan.clone());
                std::thread::spawn(move || {
                    s.acquire();
                    *m.lock() += 1;
                    c.pop().map(Msg::into_inner)
                })
            };
            common::spin_until(|| sem.waiters() == 1);
            chan.push(Msg::new(7)).unwrap();
            if round % 2 == 0 {
                // Once more, so that the holder holds it on its stack.
                let ran = queue.run_next().unwrap();
                assert!(matches!(ran.outcome, Ok(RunOutcome::Yielded(_))), "{:?}", ran.outcome);
                chan.push(Msg::new(8)).unwrap();
            }
            // The dropper holds the last handle and drops it while running.
            let dropper = mk(Box::new({
                let q = queue.clone();
                move || {
                    yield_now();
                    drop(q);
                }
            }));
            assert!(matches!(dropper.run(), Ok(RunOutcome::Yielded(_))));
            drop(queue);
            stage.set(format!("round {round}: the dropper drops the last handle"));
            match dropper.run() {
                Ok(RunOutcome::Returned(())) => {}
                other => panic!("round {round}: {other:?}"),
            }
            stage.set(format!("round {round}: the thread waits"));
            let got = waiter.join().unwrap();
            assert!(got == Some(7) || got == Some(8), "round {round}: {got:?}");
            assert_eq!(*mtx.lock(), 1);
            assert_eq!(sem.available(), 0, "the thread holds the one token");
        }
    });
}
