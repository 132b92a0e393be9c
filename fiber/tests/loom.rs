//! Loom models of the sleep/wake protocol (DESIGN.md, "Sleep/wake
//! protocol"), driving the real [`StateCell`] transitions.
//!
//! Run with:
//!
//! ```text
//! LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test --release -p spindle-fiber --test loom
//! ```
//!
//! What is real and what is modelled:
//!
//! * the fiber's state word and its transitions (`transition`,
//!   `transition_to_woken`, `transition_to_sleeping`,
//!   `transition_to_yielded`, `store`) are the crate's own code, built on
//!   loom atomics through `fiber/src/loom.rs`;
//! * the runner's reaction to a yield or a sleep, `finish_wake_owned` and
//!   `Waiter::wake` are mirrored here line for line (they need a real stack
//!   switch and the type-erased header, which loom cannot run);
//! * the stack switch is modelled: the fiber's function is a resumable step
//!   function over a [`Stack`] held in a loom `UnsafeCell`, run inside
//!   `with_mut` by whoever runs the fiber, so loom reports any two runs
//!   that are not ordered by the state machine (two threads on one stack,
//!   or a stack touched before the previous run switched out);
//! * the wait list of `spindle-sync` (a semaphore: tokens, one waiter slot,
//!   the node's `value`/`done`) and the run queue (a `VecDeque` behind a
//!   mutex, a condvar for the idle scheduler) are small loom stand-ins that
//!   follow the numbered steps of `sync/src/wait.rs` for a sleep woken by
//!   its own node (no stale waiters: the stand-in asserts `done` on resume
//!   where the real `wait` would sleep again, and a void wake fails the
//!   model).
//!
//! Every execution must end with the fiber finished after all its rounds
//! (a lost wakeup leaves the scheduler parked: loom reports a deadlock),
//! scheduled exactly once per wake, never queued twice, never resumed
//! without a wake, never run on two threads at once.

#![cfg(loom)]
// The unsafe blocks here are accesses to loom's `UnsafeCell`s, which loom
// itself checks: a racing access fails the model.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering as StdOrdering};

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;
use spindle_fiber::__loom::{FiberState, SleepTransition, StateCell, WakeTransition};

/// How many times the fiber waits on the semaphore.
const ROUNDS: usize = 2;

/// Where the fiber's function resumes (its "program counter").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pc {
    /// Sleeper step 1 of round `r`.
    Acquire(usize),
    /// Just after `sleep()` returned in round `r`.
    Resumed(usize),
    /// Between round `r` and `r + 1`: yield once.
    Yield(usize),
    /// About to return.
    Done,
}

/// Why the fiber switched back to its runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Msg {
    Yield,
    Sleep,
    Return,
}

/// The fiber's stack: only whoever runs the fiber touches it.
#[derive(Debug)]
struct Stack {
    pc: Pc,
    /// Tokens acquired so far.
    acquired: usize,
    /// Times the function went to sleep.
    sleeps: usize,
}

/// The fiber's slot: touched by whoever holds the state (`Running` or
/// `Locked`), as in `fiber.rs`.
#[derive(Debug)]
struct Slot {
    /// Whether the fiber has a run queue to go back to (it always has here).
    home: bool,
    runs: usize,
}

/// A wait-list node (it lives on the fiber's stack in the real code).
struct Node {
    /// Written by the waker under the semaphore's lock.
    value: UnsafeCell<usize>,
    /// The waker's last touch of the node (Release).
    done: AtomicBool,
}

/// The semaphore's lock-guarded state.
#[derive(Debug, Default)]
struct Sem {
    tokens: usize,
    /// The linked waiter (its round), if any: at most one fiber waits here.
    waiter: Option<usize>,
}

/// The run queue's lock-guarded state.
#[derive(Debug, Default)]
struct Queue {
    fibers: VecDeque<()>,
    /// Set by the runner that saw the fiber return.
    finished: bool,
}

struct World {
    // The fiber.
    state: StateCell,
    stack: UnsafeCell<Stack>,
    slot: UnsafeCell<Slot>,
    /// Runners currently inside the fiber's function.
    on_cpu: AtomicUsize,
    // The semaphore and its wait list.
    sem: Mutex<Sem>,
    nodes: [Node; ROUNDS],
    /// Waits that found a linked waiter and woke it.
    wakes: AtomicUsize,
    // The run queue.
    queue: Mutex<Queue>,
    not_empty: Condvar,
    /// Pushes made by a wake (`finish_wake_owned`).
    wake_schedules: AtomicUsize,
    /// Pushes made by the runner after a yield.
    requeues: AtomicUsize,
    /// Options of the model.
    yield_between_rounds: bool,
    /// Makes the function wait, `Running`, for the first release before its
    /// first sleeper step 1 (the "wake before link" model).
    first_release_before_link: bool,
    released: Mutex<usize>,
    released_cv: Condvar,
    coverage: &'static Coverage,
    /// Rounds whose wake was deferred in this execution (not modelled state:
    /// bookkeeping for the coverage check).
    deferred: [StdAtomicBool; ROUNDS],
}

impl World {
    fn new(
        yield_between_rounds: bool,
        first_release_before_link: bool,
        coverage: &'static Coverage,
    ) -> World {
        World {
            state: StateCell::new(FiberState::Ready),
            stack: UnsafeCell::new(Stack {
                pc: Pc::Acquire(0),
                acquired: 0,
                sleeps: 0,
            }),
            slot: UnsafeCell::new(Slot { home: true, runs: 0 }),
            on_cpu: AtomicUsize::new(0),
            sem: Mutex::new(Sem::default()),
            nodes: std::array::from_fn(|_| Node {
                value: UnsafeCell::new(0),
                done: AtomicBool::new(false),
            }),
            wakes: AtomicUsize::new(0),
            queue: Mutex::new(Queue::default()),
            not_empty: Condvar::new(),
            wake_schedules: AtomicUsize::new(0),
            requeues: AtomicUsize::new(0),
            yield_between_rounds,
            first_release_before_link,
            released: Mutex::new(0),
            released_cv: Condvar::new(),
            coverage,
            deferred: [const { StdAtomicBool::new(false) }; ROUNDS],
        }
    }

    fn after_round(&self, r: usize) -> Pc {
        if r + 1 == ROUNDS {
            Pc::Done
        } else if self.yield_between_rounds {
            Pc::Yield(r)
        } else {
            Pc::Acquire(r + 1)
        }
    }

    /// The fiber's function, from where it last suspended to its next
    /// suspension (sleeper steps 1 to 4 and 5, `spindle-sync`'s `wait`).
    fn resume(&self, s: &mut Stack) -> Msg {
        loop {
            match s.pc {
                Pc::Acquire(r) => {
                    if r == 0 && self.first_release_before_link {
                        let mut n = self.released.lock().unwrap();
                        while *n == 0 {
                            n = self.released_cv.wait(n).unwrap();
                        }
                        drop(n);
                        // The waker found no waiter and left the state alone.
                        assert_eq!(self.state.load(), FiberState::Running);
                    }
                    // Step 1: lock; take a token if there is one.
                    let mut sem = self.sem.lock().unwrap();
                    if sem.tokens > 0 {
                        sem.tokens -= 1;
                        drop(sem);
                        s.acquired += 1;
                        s.pc = self.after_round(r);
                        continue;
                    }
                    // Step 2: link the node; step 3: unlock.
                    assert!(sem.waiter.is_none(), "a node linked twice");
                    assert!(!self.nodes[r].done.load(Ordering::Relaxed));
                    sem.waiter = Some(r);
                    drop(sem);
                    // Step 4: `sleep()` switches out to the runner.
                    s.sleeps += 1;
                    s.pc = Pc::Resumed(r);
                    return Msg::Sleep;
                }
                Pc::Resumed(r) => {
                    // Step 5: only a wake resumes a sleeper.
                    assert!(
                        self.nodes[r].done.load(Ordering::Acquire),
                        "round {r}: the fiber was resumed without being woken"
                    );
                    assert_eq!(self.nodes[r].value.with(|v| unsafe { *v }), 1);
                    s.acquired += 1;
                    s.pc = self.after_round(r);
                }
                Pc::Yield(r) => {
                    s.pc = Pc::Acquire(r + 1);
                    return Msg::Yield;
                }
                Pc::Done => return Msg::Return,
            }
        }
    }

    /// `Fiber::run`: `Ready` → `Running`, switch in, and what the runner
    /// does after the fiber switched out.
    fn run(&self) -> Msg {
        self.state
            .transition(FiberState::Ready, FiberState::Running)
            .expect("run: the fiber is not Ready");
        assert_eq!(
            self.on_cpu.fetch_add(1, Ordering::SeqCst),
            0,
            "the fiber runs on two threads"
        );
        self.slot.with_mut(|s| unsafe { (*s).runs += 1 });
        let msg = self.stack.with_mut(|s| self.resume(unsafe { &mut *s }));
        // The stack has switched out: the function no longer runs.
        self.on_cpu.fetch_sub(1, Ordering::SeqCst);
        match msg {
            Msg::Yield => self.state.transition_to_yielded(),
            Msg::Sleep => match self.state.transition_to_sleeping() {
                SleepTransition::Asleep => {}
                // Runner step 5: a waker came between the link and the
                // switch; finish the wake for it.
                SleepTransition::AlreadyWoken => {
                    self.coverage.already_woken.store(true, StdOrdering::Relaxed);
                    self.finish_wake_owned();
                }
            },
            Msg::Return => self.state.store(FiberState::Finished),
        }
        msg
    }

    /// After `run`: a yielded fiber goes back to the queue
    /// (`RunQueue::requeue`), a returned one ends the model.
    fn after_run(&self, msg: Msg) {
        match msg {
            Msg::Yield => {
                // `mark_queued`: Ready → Locked → Queued, then push.
                self.state
                    .transition(FiberState::Ready, FiberState::Locked)
                    .expect("requeue: the fiber is not Ready");
                self.state.store(FiberState::Queued);
                self.requeues.fetch_add(1, Ordering::Relaxed);
                self.push();
            }
            Msg::Sleep => {}
            Msg::Return => {
                let mut q = self.queue.lock().unwrap();
                q.finished = true;
                drop(q);
                self.not_empty.notify_all();
            }
        }
    }

    /// `Fiber::finish_wake_owned`: the caller holds the state `Locked`.
    fn finish_wake_owned(&self) {
        assert_eq!(self.state.load(), FiberState::Locked);
        let home = self.slot.with(|s| unsafe { (*s).home });
        assert!(home);
        self.state.store(FiberState::Queued);
        self.wake_schedules.fetch_add(1, Ordering::Relaxed);
        self.push();
    }

    /// `Schedule::schedule` / the run queue's insert.
    fn push(&self) {
        let mut q = self.queue.lock().unwrap();
        assert!(q.fibers.is_empty(), "the fiber is queued twice");
        assert!(!q.finished);
        assert_eq!(self.state.load(), FiberState::Queued);
        q.fibers.push_back(());
        drop(q);
        self.not_empty.notify_one();
    }

    /// Waker steps 1 to 3 (`Semaphore::release(1)` then `Waiter::wake`).
    fn release(&self) {
        let mut sem = self.sem.lock().unwrap();
        let popped = sem.waiter.take();
        match popped {
            Some(r) => {
                // Step 1: unlink, hand over the value, set `done`.
                self.nodes[r].value.with_mut(|v| unsafe { *v = 1 });
                self.nodes[r].done.store(true, Ordering::Release);
            }
            // No waiter: bank the token; the fiber's state is not touched.
            None => sem.tokens += 1,
        }
        // Step 2: unlock.
        drop(sem);
        if self.first_release_before_link {
            *self.released.lock().unwrap() += 1;
            self.released_cv.notify_all();
        }
        let Some(r) = popped else { return };
        // Step 3: `Waiter::wake`.
        self.wakes.fetch_add(1, Ordering::Relaxed);
        match self.state.transition_to_woken() {
            WakeTransition::Owned => {
                self.coverage.owned[r].store(true, StdOrdering::Relaxed);
                self.finish_wake_owned();
            }
            WakeTransition::Deferred => {
                self.coverage.deferred[r].store(true, StdOrdering::Relaxed);
                self.deferred[r].store(true, StdOrdering::Relaxed);
            }
            WakeTransition::Void => {
                panic!("the waker of a published waiter found it neither asleep nor running")
            }
        }
    }

    /// The scheduler: pops the queued fiber (`mark_dequeued`: Queued →
    /// Ready) and runs it, until the fiber has returned.
    fn schedule_loop(&self) {
        loop {
            let mut q = self.queue.lock().unwrap();
            let popped = loop {
                if q.fibers.pop_front().is_some() {
                    break true;
                }
                if q.finished {
                    break false;
                }
                q = self.not_empty.wait(q).unwrap();
            };
            drop(q);
            if !popped {
                return;
            }
            self.state
                .transition(FiberState::Queued, FiberState::Ready)
                .expect("mark_dequeued: the fiber is not Queued");
            let msg = self.run();
            self.after_run(msg);
        }
    }

    /// What must hold once every thread has finished.
    fn check_end(&self) {
        assert_eq!(self.state.load(), FiberState::Finished);
        let (acquired, sleeps) = self.stack.with(|s| unsafe { ((*s).acquired, (*s).sleeps) });
        assert_eq!(acquired, ROUNDS, "the fiber did not complete every round");
        let wakes = self.wakes.load(Ordering::Relaxed);
        let wake_schedules = self.wake_schedules.load(Ordering::Relaxed);
        assert_eq!(sleeps, wakes, "every sleep is woken exactly once");
        assert_eq!(
            wake_schedules, wakes,
            "the fiber is scheduled exactly once per wake"
        );
        let requeues = self.requeues.load(Ordering::Relaxed);
        let runs = self.slot.with(|s| unsafe { (*s).runs });
        assert_eq!(
            runs,
            1 + wake_schedules + requeues,
            "every push runs the fiber once"
        );
        let sem = self.sem.lock().unwrap();
        assert_eq!((sem.tokens, sem.waiter), (0, None));
        drop(sem);
        let q = self.queue.lock().unwrap();
        assert!(q.fibers.is_empty() && q.finished);
        if sleeps == ROUNDS {
            self.coverage.slept_every_round.store(true, StdOrdering::Relaxed);
            // Round 1's wake deferred, and round 2's wake found the fiber
            // really asleep (`Owned`, not deferred again): its sleep
            // transition came before the second release, so a stale "woken"
            // flag left by round 1 would have resumed it unwoken.
            if self.deferred[0].load(StdOrdering::Relaxed)
                && !self.deferred[ROUNDS - 1].load(StdOrdering::Relaxed)
            {
                self.coverage
                    .deferred_then_slept
                    .store(true, StdOrdering::Relaxed);
            }
        }
    }
}

/// Which interesting paths some execution took (outside the model: loom
/// does not see these). Checked after the model so that a model that
/// stops exploring them fails instead of passing vacuously.
struct Coverage {
    owned: [StdAtomicBool; ROUNDS],
    deferred: [StdAtomicBool; ROUNDS],
    already_woken: StdAtomicBool,
    slept_every_round: StdAtomicBool,
    /// Round 1's wake deferred (`RunningWoken`), and round 2 really slept
    /// (its wake was `Owned`): the interleaving that catches a stale
    /// "woken" flag.
    deferred_then_slept: StdAtomicBool,
}

impl Coverage {
    const fn new() -> Coverage {
        Coverage {
            owned: [const { StdAtomicBool::new(false) }; ROUNDS],
            deferred: [const { StdAtomicBool::new(false) }; ROUNDS],
            already_woken: StdAtomicBool::new(false),
            slept_every_round: StdAtomicBool::new(false),
            deferred_then_slept: StdAtomicBool::new(false),
        }
    }

    /// Every wake path in every round, an execution that slept in every
    /// round, and one that deferred round 1's wake and then really slept in
    /// round 2.
    fn assert_complete(&self) {
        if preemption_bound() < DEFAULT_PREEMPTIONS {
            return;
        }
        for r in 0..ROUNDS {
            assert!(
                self.owned[r].load(StdOrdering::Relaxed),
                "round {r}: no Owned wake explored"
            );
            assert!(
                self.deferred[r].load(StdOrdering::Relaxed),
                "round {r}: no Deferred wake explored"
            );
        }
        assert!(
            self.already_woken.load(StdOrdering::Relaxed),
            "no AlreadyWoken sleep explored"
        );
        assert!(
            self.slept_every_round.load(StdOrdering::Relaxed),
            "no execution slept every round"
        );
        assert!(
            self.deferred_then_slept.load(StdOrdering::Relaxed),
            "no execution deferred round 1's wake and then really slept in round 2 \
             (the stale \"woken\" flag interleaving)"
        );
    }
}

/// Spawns the sleeper (first runner), the waker (releases once per round)
/// and the scheduler (runs the fiber whenever it is queued), joins them and
/// checks the end state.
fn run_model(w: &Arc<World>) {
    let sleeper = {
        let w = w.clone();
        thread::spawn(move || {
            let msg = w.run();
            w.after_run(msg);
        })
    };
    let waker = {
        let w = w.clone();
        thread::spawn(move || {
            for _ in 0..ROUNDS {
                w.release();
            }
        })
    };
    let scheduler = {
        let w = w.clone();
        thread::spawn(move || w.schedule_loop())
    };
    sleeper.join().unwrap();
    waker.join().unwrap();
    scheduler.join().unwrap();
    w.check_end();
}

/// The preemption bound used when `LOOM_MAX_PREEMPTIONS` is not set. Three
/// is the smallest that reaches "round 1's wake deferred, round 2 really
/// sleeps" (the waker must be stopped between its two releases, the runner
/// between its link and its switch); it takes a second or two.
const DEFAULT_PREEMPTIONS: usize = 3;

fn preemption_bound() -> usize {
    std::env::var("LOOM_MAX_PREEMPTIONS").map_or(DEFAULT_PREEMPTIONS, |v| {
        v.parse().expect("invalid value for LOOM_MAX_PREEMPTIONS")
    })
}

/// `loom::model` with the preemption bound above (without a bound these
/// models do not finish in minutes).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemption_bound());
    builder.check(f);
}

/// Two rounds: a sleeper, a waker releasing twice, a scheduler. The fiber
/// runs first on the sleeper thread, then on the scheduler thread; between
/// the rounds it yields and is requeued. Each release may come before the
/// link (banked token), between the link and the switch (`RunningWoken`),
/// or after the switch (`Sleeping`).
#[test]
fn sleep_wake_two_rounds() {
    static COVERAGE: Coverage = Coverage::new();
    model(|| run_model(&Arc::new(World::new(true, false, &COVERAGE))));
    COVERAGE.assert_complete();
}

/// The same without the yield: round 2's sleeper step 1 follows round 1's
/// resume directly. A wake deferred in round 1 (`RunningWoken`) must not
/// leak into round 2: the second sleep must wait for the second release
/// (the C original's "woken before sleeping" flag, never reset, is this
/// bug).
#[test]
fn sleep_wake_two_rounds_back_to_back() {
    static COVERAGE: Coverage = Coverage::new();
    model(|| run_model(&Arc::new(World::new(false, false, &COVERAGE))));
    COVERAGE.assert_complete();
}

/// The wake comes while the fiber runs but before it links itself: the
/// waker finds the list empty, banks the token and leaves the fiber's state
/// alone (still `Running`, not `RunningWoken`); the fiber then takes the
/// token without sleeping. The second release races the second round.
#[test]
fn wake_before_link() {
    static COVERAGE: Coverage = Coverage::new();
    model(|| {
        let w = Arc::new(World::new(false, true, &COVERAGE));
        run_model(&w);
        let sleeps = w.stack.with(|s| unsafe { (*s).sleeps });
        assert!(sleeps < ROUNDS, "round 1 took the banked token");
    });
}

/// `Fiber::run_mut`'s claim (DESIGN.md, "Claiming a fiber to run it"),
/// mirrored: a handle count, the real state word and the fiber's slot.
///
/// Another thread holds a second handle; it runs the fiber once through
/// the shared path (compare-and-swap claim), writes the slot, publishes
/// `Ready` and drops its handle (Release decrement, as `Arc` does). This
/// thread holds the other handle with `&mut` and runs the fiber through
/// `run_mut`: a Relaxed load of the count, and if it is one, an Acquire
/// fence and a plain load + store of the state, otherwise the shared path.
/// loom reports a race on the slot if the unique path can see a count of
/// one without everything the other handle's owner did being visible.
fn unique_claim_model(fence: bool) {
    struct Shared {
        handles: AtomicUsize,
        state: StateCell,
        slot: UnsafeCell<usize>,
    }
    fn run_shared(s: &Shared) -> bool {
        if s.state
            .transition(FiberState::Ready, FiberState::Running)
            .is_err()
        {
            return false;
        }
        s.slot.with_mut(|v| unsafe { *v += 1 });
        s.state.store(FiberState::Ready);
        true
    }
    let s = Arc::new(Shared {
        handles: AtomicUsize::new(2),
        state: StateCell::new(FiberState::Ready),
        slot: UnsafeCell::new(0),
    });
    let other = {
        let s = s.clone();
        thread::spawn(move || {
            let ran = run_shared(&s);
            s.handles.fetch_sub(1, Ordering::Release);
            ran
        })
    };
    // run_mut, once, racing the other handle's run and drop.
    let run_mut = |s: &Shared| {
        if s.handles.load(Ordering::Relaxed) == 1 {
            if fence {
                loom::sync::atomic::fence(Ordering::Acquire);
            }
            assert_eq!(
                s.state.load(),
                FiberState::Ready,
                "a unique handle finds the fiber Ready"
            );
            s.state.store(FiberState::Running);
            s.slot.with_mut(|v| unsafe { *v += 1 });
            s.state.store(FiberState::Ready);
            true
        } else {
            run_shared(s)
        }
    };
    let first = run_mut(&s);
    let other_ran = other.join().unwrap();
    // Each successful run incremented the slot once, and no two overlapped
    // (loom checks the `UnsafeCell` accesses).
    let ran = [first, other_ran].iter().filter(|&&r| r).count();
    let total = s.slot.with(|v| unsafe { *v });
    assert_eq!(total, ran, "every successful run ran alone");
}

#[test]
fn run_mut_unique_claim() {
    model(|| unique_claim_model(true));
}

/// Without the fence the model must fail: this proves the model can see
/// the race the fence prevents.
#[test]
#[should_panic(expected = "Causality violation")]
fn run_mut_unique_claim_without_fence_is_caught() {
    model(|| unique_claim_model(false));
}

/// Interruptible waits (DESIGN.md, "Interruptible waits"), mirrored: the
/// real state word, a fiber that waits once on a semaphore through
/// `spindle-sync`'s interruptible `wait` (the interrupt check before it
/// links its node, and after every resume without a value, under the
/// semaphore's lock; a resume with neither sleeps again), an interrupter
/// (`Waiter::interrupt`: the mark, a SeqCst fence, a wake), and a
/// scheduler that runs the fiber whenever a wake queues it.
///
/// With `releaser`, a thread releases one token, racing the interrupt:
/// the token ends up either taken by the wait or left in the semaphore.
/// With `stale_waker`, another thread wakes the fiber for nothing (a
/// `Waiter` it kept from before), and no token ever comes: the wait must
/// end interrupted, or the fiber sleeps forever and loom reports the
/// scheduler deadlocked. That is where the interrupter's wake can find
/// the fiber queued by the stale wake and do nothing, so the mark alone
/// must reach the fiber (the store-buffering pattern the fences close).
mod interrupt {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Pc {
        Start,
        Resumed,
        Done,
    }

    struct Stack {
        pc: Pc,
        /// `Some(true)`: the wait returned a token; `Some(false)`: interrupted.
        outcome: Option<bool>,
    }

    struct World {
        state: StateCell,
        stack: UnsafeCell<Stack>,
        on_cpu: AtomicUsize,
        /// The header's `interrupt` mark.
        mark: AtomicBool,
        /// Tokens, and whether the fiber's node is linked.
        sem: Mutex<(usize, bool)>,
        /// The node's `done`.
        done: AtomicBool,
        /// Queued, finished.
        queue: Mutex<(bool, bool)>,
        not_empty: Condvar,
        fences: bool,
    }

    impl World {
        fn take_mark(&self) -> bool {
            if self.fences {
                loom::sync::atomic::fence(Ordering::SeqCst);
            }
            // As `take_interrupt`: a load, and the swap only if set.
            self.mark.load(Ordering::Acquire) && self.mark.swap(false, Ordering::Acquire)
        }

        /// The fiber's function: `acquire_interruptible` on an empty
        /// semaphore (or one the releaser filled).
        fn resume(&self, s: &mut Stack) -> Msg {
            loop {
                match s.pc {
                    Pc::Start => {
                        let mut sem = self.sem.lock().unwrap();
                        if sem.0 > 0 {
                            sem.0 -= 1;
                            s.outcome = Some(true);
                            s.pc = Pc::Done;
                        } else if self.take_mark() {
                            s.outcome = Some(false);
                            s.pc = Pc::Done;
                        } else {
                            sem.1 = true;
                            drop(sem);
                            s.pc = Pc::Resumed;
                            return Msg::Sleep;
                        }
                    }
                    Pc::Resumed => {
                        if self.done.load(Ordering::Acquire) {
                            s.outcome = Some(true);
                            s.pc = Pc::Done;
                            continue;
                        }
                        let mut sem = self.sem.lock().unwrap();
                        if self.done.load(Ordering::Acquire) {
                            s.outcome = Some(true);
                            s.pc = Pc::Done;
                        } else if self.take_mark() {
                            assert!(sem.1, "an undone node is linked");
                            sem.1 = false;
                            s.outcome = Some(false);
                            s.pc = Pc::Done;
                        } else {
                            // Spurious: sleep again, still linked.
                            drop(sem);
                            return Msg::Sleep;
                        }
                    }
                    Pc::Done => return Msg::Return,
                }
            }
        }

        fn run(&self) {
            self.state
                .transition(FiberState::Ready, FiberState::Running)
                .expect("run: the fiber is not Ready");
            assert_eq!(
                self.on_cpu.fetch_add(1, Ordering::SeqCst),
                0,
                "the fiber runs on two threads"
            );
            let msg = self.stack.with_mut(|s| self.resume(unsafe { &mut *s }));
            self.on_cpu.fetch_sub(1, Ordering::SeqCst);
            match msg {
                Msg::Sleep => match self.state.transition_to_sleeping() {
                    SleepTransition::Asleep => {}
                    SleepTransition::AlreadyWoken => self.finish_wake_owned(),
                },
                Msg::Return => {
                    // The real runner stores `Finished`. Here a wake can race
                    // this last run, and loom 0.7 can order a plain store
                    // before a racing compare-and-swap that read the state
                    // before it (leaving `RunningWoken` after `Finished`,
                    // which C11's read-modify-write atomicity forbids), so
                    // the model publishes it with a compare-and-swap.
                    self.state
                        .transition(FiberState::Running, FiberState::Finished)
                        .or_else(|_| {
                            self.state
                                .transition(FiberState::RunningWoken, FiberState::Finished)
                        })
                        .expect("the runner owns a running fiber's state");
                    self.queue.lock().unwrap().1 = true;
                    self.not_empty.notify_all();
                }
                Msg::Yield => unreachable!(),
            }
        }

        fn finish_wake_owned(&self) {
            assert_eq!(self.state.load(), FiberState::Locked);
            self.state.store(FiberState::Queued);
            let mut q = self.queue.lock().unwrap();
            assert!(!q.0, "the fiber is queued twice");
            q.0 = true;
            drop(q);
            self.not_empty.notify_one();
        }

        /// `Waiter::wake`: a wake that finds the fiber neither asleep nor
        /// running is void.
        fn wake(&self) {
            match self.state.transition_to_woken() {
                WakeTransition::Owned => self.finish_wake_owned(),
                WakeTransition::Deferred | WakeTransition::Void => {}
            }
        }

        fn release(&self) {
            let mut sem = self.sem.lock().unwrap();
            if sem.1 {
                sem.1 = false;
                self.done.store(true, Ordering::Release);
                drop(sem);
                self.wake();
            } else {
                sem.0 += 1;
            }
        }

        fn interrupt(&self) {
            self.mark.store(true, Ordering::Release);
            if self.fences {
                loom::sync::atomic::fence(Ordering::SeqCst);
            }
            self.wake();
        }

        fn schedule_loop(&self) {
            loop {
                let mut q = self.queue.lock().unwrap();
                let popped = loop {
                    if q.0 {
                        q.0 = false;
                        break true;
                    }
                    if q.1 {
                        break false;
                    }
                    q = self.not_empty.wait(q).unwrap();
                };
                drop(q);
                if !popped {
                    return;
                }
                self.state
                    .transition(FiberState::Queued, FiberState::Ready)
                    .expect("mark_dequeued: the fiber is not Queued");
                self.run();
            }
        }
    }

    pub(super) fn run_model(releaser: bool, stale_waker: bool, fences: bool) {
        let w = Arc::new(World {
            state: StateCell::new(FiberState::Ready),
            stack: UnsafeCell::new(Stack {
                pc: Pc::Start,
                outcome: None,
            }),
            on_cpu: AtomicUsize::new(0),
            mark: AtomicBool::new(false),
            sem: Mutex::new((0, false)),
            done: AtomicBool::new(false),
            queue: Mutex::new((false, false)),
            not_empty: Condvar::new(),
            fences,
        });
        let mut threads = Vec::new();
        {
            let w = w.clone();
            threads.push(thread::spawn(move || w.run()));
        }
        {
            let w = w.clone();
            threads.push(thread::spawn(move || w.interrupt()));
        }
        if releaser {
            let w = w.clone();
            threads.push(thread::spawn(move || w.release()));
        }
        if stale_waker {
            let w = w.clone();
            threads.push(thread::spawn(move || w.wake()));
        }
        w.schedule_loop();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(w.state.load(), FiberState::Finished);
        let outcome = w.stack.with(|s| unsafe { (*s).outcome });
        let (tokens, linked) = *w.sem.lock().unwrap();
        assert!(!linked, "the node was left linked");
        match outcome {
            Some(true) => assert_eq!(tokens, 0, "the token was taken by the wait"),
            Some(false) => assert_eq!(tokens, usize::from(releaser), "an interrupted wait took nothing"),
            None => panic!("the wait never ended"),
        }
        assert!(!w.queue.lock().unwrap().0);
    }
}

/// An interrupt racing a release: the token is taken or left, never lost,
/// and the wait always ends.
#[test]
fn an_interrupt_racing_a_release_loses_no_token() {
    model(|| interrupt::run_model(true, false, true));
}

/// An interrupt racing a stale wake, with no token ever: the wait ends
/// interrupted in every execution.
#[test]
fn an_interrupt_racing_a_stale_wake_is_never_lost() {
    model(|| interrupt::run_model(false, true, true));
}

/// The same without the two SeqCst fences must fail: the interrupter's
/// wake finds the fiber queued by the stale wake, and the fiber's check
/// misses the mark (store buffering), so it sleeps forever.
#[test]
#[should_panic(expected = "deadlock")]
fn an_interrupt_without_the_fences_can_be_lost() {
    model(|| interrupt::run_model(false, true, false));
}

/// A wake that the fiber's home refuses (DESIGN.md, "Sleep/wake protocol",
/// waker step 4), mirrored: the real state word, the node's `done` word in
/// a loom cell, and a second holder of the fiber that, whenever the state
/// word lets it, takes the fiber out of `Queued` by hand (`mark_dequeued`,
/// public and safe), runs it (it reads the node as the resumed wait does,
/// then moves on: the node's memory is the next wait's, written `NEXT`)
/// and queues it again.
///
/// The waker wakes the sleeping fiber (`Sleeping` → `Locked`), its home
/// refuses it, and the waker revokes the node and stores `Ready`. As
/// built, the fiber stays `Locked` from the wake to the revocation (the
/// scheduler gets a `Woken`). `publish_first` mirrors the first version,
/// which stored `Queued` before calling the scheduler and took `Locked`
/// back after the refusal: the `should_panic` variant shows the holder
/// slipping in between and the waker revoking a node the fiber had moved
/// past (the ABA a review found).
fn refused_wake_model(publish_first: bool) {
    const DONE: u8 = 1;
    const REVOKED: u8 = 2;
    const NEXT: u8 = 3;
    struct Shared {
        state: StateCell,
        node: UnsafeCell<u8>,
    }
    let s = Arc::new(Shared {
        state: StateCell::new(FiberState::Sleeping),
        node: UnsafeCell::new(DONE),
    });
    let holder = {
        let s = s.clone();
        thread::spawn(move || {
            // `mark_dequeued`, then `run` (the shared claim).
            let _ = s.state.transition(FiberState::Queued, FiberState::Ready);
            if s.state
                .transition(FiberState::Ready, FiberState::Running)
                .is_err()
            {
                return None;
            }
            let seen = s.node.with(|v| unsafe { *v });
            // On into its next wait, and queued again by a later wake.
            s.node.with_mut(|v| unsafe { *v = NEXT });
            s.state.store(FiberState::Queued);
            Some(seen)
        })
    };
    // The waker: `Waiter::try_wake` with a home that refuses.
    assert_eq!(s.state.transition_to_woken(), WakeTransition::Owned);
    let held = if publish_first {
        s.state.store(FiberState::Queued);
        s.state.transition(FiberState::Queued, FiberState::Locked).is_ok()
    } else {
        true
    };
    if held {
        s.node.with_mut(|v| unsafe { *v = REVOKED });
        s.state.store(FiberState::Ready);
    }
    let seen = holder.join().unwrap();
    let last = s.node.with(|v| unsafe { *v });
    match seen {
        // The holder ran: after the revocation (it sees it, and would wait
        // again), or, only in the first version, before the waker held the
        // fiber. Either way the waker must not have written the node
        // after the fiber moved past it.
        Some(v) => {
            assert!(v == REVOKED || (publish_first && v == DONE), "the holder saw {v}");
            assert_eq!(last, NEXT, "the waker revoked a node the fiber had moved past");
        }
        None => assert_eq!(last, REVOKED),
    }
}

#[test]
fn a_refused_wake_is_held_while_the_waker_takes_its_value_back() {
    model(|| refused_wake_model(false));
}

/// The first version's re-take of `Queued`: the model must find the ABA.
#[test]
#[should_panic(expected = "the waker revoked a node the fiber had moved past")]
fn a_refused_wake_published_as_queued_first_is_caught() {
    model(|| refused_wake_model(true));
}

/// Waker step 4 with the wait hook (`WaitHook`, spindle-sync's
/// `take_back_hook`), mirrored over the real state word: the fiber sleeps
/// in a wait, its home refuses every wake. A value waker hands its node a
/// value under the primitive's lock, then wakes it (`try_wake`, with the
/// claim of a fiber marked refused, `wake_refused_before`); meanwhile a
/// wake that hands nothing over (`wake`, a stale waiter's) takes and lets
/// go of the fiber, and a handle's call that fails (`set_function` on a
/// busy fiber: `Ready` → `Locked` → let go) holds it for a moment. Whoever
/// lets go of the refused fiber runs the hook: under the lock, revoke a
/// handed value, make the fiber `Ready`. Checked: nobody runs the fiber,
/// so the value must come back, exactly once, whatever the interleaving
/// (before the hook, a value waker that found the fiber held by the empty
/// wake left the value with it).
#[test]
fn a_value_handed_to_a_refused_fiber_comes_back_once() {
    model(|| refused_fiber_model(false));
}

/// The same with `Fiber::abandon` in place of the failing call: the fiber
/// starts `Queued` (woken for nothing, its home took it) and its home,
/// shutting down, abandons it (`Queued` → `Locked`, marked refused, let go
/// through the hook) while the value waker hands it a value and wakes it
/// and the empty waker's wake finds it queued.
#[test]
fn a_value_handed_to_an_abandoned_fiber_comes_back_once() {
    model(|| refused_fiber_model(true));
}

fn refused_fiber_model(abandon: bool) {
    {
        const LINKED: u8 = 0;
        const DONE: u8 = 1;
        const REVOKED: u8 = 2;
        struct Prim {
            node: u8,
            given_back: u32,
        }
        struct Shared {
            state: StateCell,
            /// `home_refused`: written while the fiber is held.
            refused: AtomicBool,
            prim: Mutex<Prim>,
        }
        // The hook, run by whoever holds the refused fiber and lets it go.
        fn let_go_refused(s: &Shared) {
            let mut p = s.prim.lock().unwrap();
            if p.node == DONE {
                p.node = REVOKED;
                p.given_back += 1;
            }
            s.state.store(FiberState::Ready);
        }
        // `Waiter::wake_as(take_back)`.
        fn wake(s: &Shared, take_back: bool) {
            loop {
                match s.state.transition_to_woken() {
                    WakeTransition::Owned => {
                        // The home refuses.
                        s.refused.store(true, Ordering::Relaxed);
                        let_go_refused(s);
                    }
                    WakeTransition::Deferred => unreachable!("nobody runs the fiber"),
                    WakeTransition::Void if take_back && s.refused.load(Ordering::Relaxed) => {
                        match s.state.transition(FiberState::Ready, FiberState::Locked) {
                            Ok(()) if s.refused.load(Ordering::Relaxed) => let_go_refused(s),
                            Ok(()) => s.state.store(FiberState::Ready),
                            Err(FiberState::Sleeping | FiberState::Running) => continue,
                            Err(_) => {}
                        }
                    }
                    WakeTransition::Void => {}
                }
                return;
            }
        }
        let s = Arc::new(Shared {
            state: StateCell::new(if abandon {
                FiberState::Queued
            } else {
                FiberState::Sleeping
            }),
            refused: AtomicBool::new(false),
            prim: Mutex::new(Prim {
                node: LINKED,
                given_back: 0,
            }),
        });
        let empty = {
            let s = s.clone();
            thread::spawn(move || wake(&s, false))
        };
        let failing_call = {
            let s = s.clone();
            thread::spawn(move || {
                // `set_function` on a started fiber (`Busy`, let go), or
                // `abandon` of the queued fiber.
                let from = if abandon {
                    FiberState::Queued
                } else {
                    FiberState::Ready
                };
                if s.state.transition(from, FiberState::Locked).is_ok() {
                    if abandon {
                        s.refused.store(true, Ordering::Relaxed);
                    }
                    if s.refused.load(Ordering::Relaxed) {
                        let_go_refused(&s);
                    } else {
                        s.state.store(FiberState::Ready);
                    }
                }
            })
        };
        s.prim.lock().unwrap().node = DONE;
        wake(&s, true);
        empty.join().unwrap();
        failing_call.join().unwrap();
        let p = s.prim.lock().unwrap();
        assert_eq!(
            (p.node, p.given_back),
            (REVOKED, 1),
            "the value handed to the refused fiber must come back once"
        );
        assert_eq!(s.state.load(), FiberState::Ready);
    }
}
