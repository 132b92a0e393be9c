//! The monitor thread: fires timers, watches worker heartbeats, scales the
//! pool up when a worker is stuck while work is pending, flags fibers that
//! overran their time slice, and detects deadlocks.
//!
//! It naps between rounds (`next_nap`): `sysmon_interval` (250 µs by
//! default) while jobs are queued and the pool can still grow; while
//! workers run but nothing waits, at most 5 ms, or half a time slice (at
//! most 10 ms) once the pool is at its maximum (each of these at least
//! `sysmon_interval`); when every worker is parked, 10 ms; unless
//! woken sooner by a timer registration, a thread blocking in a join or a
//! scope, or shutdown.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::sync::Parker;

use crate::config::OnDeadlock;
use crate::shared::Shared;
use crate::task::JoinError;

/// Sysmon's nap while every worker is parked, and the longest one while
/// workers run with the pool at its maximum or a deadlock is being
/// confirmed.
const IDLE_NAP: Duration = Duration::from_millis(10);

/// Longest sysmon sleep while a worker is busy and the pool may still grow
/// (half the default time slice).
const BUSY_NAP: Duration = Duration::from_millis(5);

struct Watch {
    beat: u64,
    since: Instant,
}

std::thread_local! {
    /// The executor whose sysmon this thread is (null elsewhere).
    static SYSMON_OF: std::cell::Cell<*const Shared> = const { std::cell::Cell::new(std::ptr::null()) };
}

/// Whether the calling thread is the sysmon thread of an executor: a
/// panic payload dropped there (the last reference of a stale timer) may
/// drop an `Executor`, this one or another, whose shutdown must then not
/// wait on this thread.
pub(crate) fn is_any_sysmon() -> bool {
    SYSMON_OF.with(|s| !s.get().is_null())
}

pub(crate) fn run(shared: Arc<Shared>, parker: Parker) {
    SYSMON_OF.with(|s| s.set(Arc::as_ptr(&shared)));
    let mut watch: Vec<Watch> =
        shared.workers.iter().map(|_| Watch { beat: 0, since: Instant::now() }).collect();
    let mut last_scale = Instant::now();
    // The workers the last scale-up activated, with their heartbeats just
    // before: the next scale-up waits until each has looked for work
    // (finished a round, or parked after its first), is running a fiber or
    // user code, or retired again, so that jobs a new thread has not had a
    // chance to take do not count as stranded twice.
    let mut added: Vec<(usize, u64)> = Vec::new();
    // Since when (and at which heartbeat sum and blocked-thread
    // generation) the pool has looked deadlocked, and whether this episode
    // was reported.
    let mut deadlock_suspect: Option<(u64, u64, Instant)> = None;
    let mut deadlock_reported = false;
    while !shared.exit.load(Ordering::Acquire) {
        let now = Instant::now();
        shared.timers.fire_due(now);

        let mut stuck = false;
        // Stuck workers that are active: each keeps one of the pool's base
        // workers from taking work, and one more worker makes up for it.
        let mut stuck_active = 0usize;
        let mut all_parked = true;
        let mut beats = 0u64;
        for (w, seen) in shared.started_workers().iter().zip(watch.iter_mut()) {
            if !w.started.load(Ordering::Acquire) {
                continue;
            }
            let beat = w.hot.heartbeat.load(Ordering::Relaxed);
            beats = beats.wrapping_add(beat);
            let parked = w.inbox.parked.load(Ordering::SeqCst);
            all_parked &= parked;
            if beat != seen.beat || parked {
                seen.beat = beat;
                seen.since = now;
                continue;
            }
            let stalled = now - seen.since;
            if stalled >= shared.config.time_slice && !w.hot.preempt.swap(true, Ordering::Relaxed) {
                crate::trace_event!(worker = w.index, "time slice overrun");
            }
            // Only a worker inside a fiber, or running user code outside
            // one (`BUSY_OUTSIDE_FIBER`: an unjoined panic's payload or a
            // cancelled job's closure dropped in its loop), is stuck; one that is searching or was descheduled by
            // the OS between fibers is not.
            if stalled >= shared.config.stuck_threshold && w.hot.running_fiber.load(Ordering::Relaxed) != 0 {
                stuck = true;
                if w.active.load(Ordering::Relaxed) {
                    stuck_active += 1;
                }
            }
        }

        // Only work another worker could take counts: woken fibers in the
        // stuck worker's own inbox are pinned to it, and a worker added
        // for them would find nothing, retire, and be added again.
        // Looked: it finished a round since it was added (two beats: the
        // first comes before its first look), or it is parked after one,
        // or it is running a fiber or user code (it took work, or it was
        // busy already: a retired worker running a fiber pinned to it,
        // which cannot look until that returns and counts as stuck), or
        // it retired again.
        let added_looked = added.iter().all(|&(i, beat)| {
            let w = &shared.workers[i];
            let beats = w.hot.heartbeat.load(Ordering::Relaxed).wrapping_sub(beat);
            beats >= 2
                || (beats == 1 && w.inbox.parked.load(Ordering::Relaxed))
                || w.hot.running_fiber.load(Ordering::Relaxed) != 0
                || !w.active.load(Ordering::Relaxed)
        });
        if stuck
            && added_looked
            && now - last_scale >= shared.config.stuck_threshold
            && shared.stealable_work()
        {
            added = scale_up(&shared, stuck_active);
            last_scale = now;
        }

        // Deadlock: a thread is blocked in join or waits in a scope, every
        // worker is parked, nothing is queued, no timer is pending, and
        // tasks remain, with no heartbeat and no thread newly blocked in
        // between, for the grace period. Reported once per episode (an
        // episode ends when any of that changes; the joins failed by the
        // report leave, and a thread that blocks after them, in a join or
        // a scope, starts a new one).
        let blocked_since = shared.blocked_generation.load(Ordering::Acquire);
        let candidate = all_parked
            && shared.config.on_deadlock != OnDeadlock::Ignore
            && (!shared.blocked_joiners.lock().is_empty()
                || shared.blocked_scopes.load(Ordering::Acquire) > 0)
            && !shared.pending_work()
            && shared.timers.is_empty()
            && shared.live() > 0;
        match deadlock_suspect {
            Some((b, g, since)) if candidate && b == beats && g == blocked_since => {
                if !deadlock_reported && now - since >= shared.config.deadlock_grace {
                    report_deadlock(&shared);
                    deadlock_reported = true;
                }
            }
            _ if candidate => {
                deadlock_suspect = Some((beats, blocked_since, now));
                deadlock_reported = false;
            }
            _ => {
                deadlock_suspect = None;
                deadlock_reported = false;
            }
        }

        let nap = next_nap(&shared, all_parked, deadlock_suspect.is_some() && !deadlock_reported);
        let nap = match shared.timers.next_deadline() {
            Some(d) => nap.min(d.saturating_duration_since(Instant::now())),
            None => nap,
        };
        parker.park_timeout(nap);
    }
}

/// How long to sleep before the next look. Every tick preempts a busy
/// worker on a small machine, so sysmon only ticks at the full rate when a
/// tick can change something:
/// * everything parked (and no deadlock to confirm): a long nap;
/// * work pending and room to scale: the sysmon interval (stuck detection);
/// * room to scale but nothing waits: half a slice, at most `BUSY_NAP`, so
///   that work spawned from outside behind a stuck worker (spawns do not
///   wake sysmon) waits that long at most, whatever the time slice;
/// * otherwise (the pool is at its maximum): only the time slices need
///   watching, at half a slice, at most `IDLE_NAP`: a worker that parks
///   does not wake sysmon, so a deadlock that forms meanwhile is seen
///   only at the next look (a nap of half an hour-long slice hid one for
///   half an hour).
///
/// Timers cap the nap (the caller), and timer registrations and blocked
/// joins wake sysmon early. While a deadlock is suspected it looks every
/// eighth of the grace period (between the sysmon interval and 10 ms).
fn next_nap(shared: &Shared, all_parked: bool, confirming_deadlock: bool) -> Duration {
    let c = &shared.config;
    if confirming_deadlock {
        (c.deadlock_grace / 8).min(IDLE_NAP).max(c.sysmon_interval)
    } else if all_parked {
        IDLE_NAP
    } else if shared.active.load(Ordering::Relaxed) < c.max_workers {
        if shared.pending_work() {
            c.sysmon_interval
        } else {
            (c.time_slice / 2).min(BUSY_NAP).max(c.sysmon_interval)
        }
    } else {
        (c.time_slice / 2).min(IDLE_NAP).max(c.sysmon_interval)
    }
}

/// Adds workers until the base count of them are not stuck (one per
/// stuck active worker), up to the maximum; returns the workers it
/// activated, each with its heartbeat just before.
pub(crate) fn scale_up(shared: &Arc<Shared>, stuck_active: usize) -> Vec<(usize, u64)> {
    let max = shared.config.max_workers;
    // Retirements change `active` too (worker.rs, `try_retire`): both hold
    // this lock, so the count and the workers' flags agree.
    let scaling = shared.scaling.lock();
    let cur = shared.active.load(Ordering::Acquire);
    // As many workers free to take work as the base count: one more for
    // each stuck active worker (a stuck worker that retired counts for
    // none: other workers take its queued jobs). Growing by half each time
    // instead compounded: one blocked thread took a pool of 2 to 16 while a
    // deep queue lasted (found in review), since each added worker took a
    // job and the same stuck one asked again.
    let want = (shared.config.base_workers + stuck_active).min(max);
    if cur >= want {
        return Vec::new();
    }
    let mut added = Vec::with_capacity(want - cur);
    for i in cur..want {
        let beat = shared.workers[i].hot.heartbeat.load(Ordering::Relaxed);
        if let Err(e) = activate(shared, i) {
            // Out of threads: grow as far as we got, and try again later.
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| warn!("spindle-executor: cannot add a worker thread for now ({e})"));
            break;
        }
        added.push((i, beat));
    }
    let target = cur + added.len();
    if target == cur {
        return added;
    }
    shared.active.store(target, Ordering::Release);
    // An added worker that parked before the count was stored (a new
    // thread that found nothing, or one reactivated just before it parked)
    // may have judged itself not the highest and parked with no timeout,
    // never to retire: the count store, a fence, then a wake of each, the
    // store-buffer pattern with its `parked` store, fence and look at the
    // count (`Worker::idle`). Either it saw the new count or it is woken
    // and looks again.
    std::sync::atomic::fence(Ordering::SeqCst);
    for &(i, _) in &added {
        shared.workers[i].notify();
    }
    shared.note_workers();
    shared.stats.scale_ups.fetch_add(1, Ordering::Relaxed);
    // Not under the lock: a subscriber may read `stats()`, which takes it.
    drop(scaling);
    crate::trace_event!(from = cur, to = target, "scale up");
    added
}

/// Makes worker `i` active, starting its thread the first time. If the
/// thread cannot be started, the worker stays as it was.
pub(crate) fn activate(shared: &Arc<Shared>, i: usize) -> std::io::Result<()> {
    let w = &shared.workers[i];
    if !w.started.load(Ordering::Acquire) {
        let s = Arc::clone(shared);
        // Marked before the thread runs: the thread reads both.
        w.active.store(true, Ordering::Release);
        w.started.store(true, Ordering::Release);
        // Slots are started in index order: scans now include this one
        // (a thread that fails to start leaves an empty slot in the scans).
        shared.slots.fetch_max(i + 1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name(format!("spindle-worker-{i}"))
            .spawn(move || crate::worker::run(s, i));
        match spawned {
            Ok(handle) => shared.threads.lock().push(handle),
            Err(e) => {
                w.started.store(false, Ordering::Release);
                w.active.store(false, Ordering::Release);
                return Err(e);
            }
        }
    } else {
        w.active.store(true, Ordering::Release);
        // Pairs with the fence a parking worker makes between storing
        // `parked` and loading `active` (the store-buffer pattern): either
        // it sees `active`, or this sees it parked and wakes it.
        std::sync::atomic::fence(Ordering::SeqCst);
        w.notify();
    }
    Ok(())
}

/// Sleeping fibers a deadlock report lists by name (the rest are counted).
const REPORTED_FIBERS: usize = 64;

/// Reports a deadlock and acts on it (fails the blocked joins, aborts, or
/// only reports).
fn report_deadlock(shared: &Shared) {
    let mut report = String::new();
    let mut sleeping = 0usize;
    for w in shared.started_workers() {
        for fiber in w.sleeping.lock().values() {
            sleeping += 1;
            if sleeping > REPORTED_FIBERS {
                continue;
            }
            let who = match fiber.name() {
                Some(n) => format!("fiber '{n}' ({})", fiber.id()),
                None => format!("fiber {}", fiber.id()),
            };
            match fiber.wait_site() {
                Some((what, loc)) => {
                    let _ = writeln!(report, "  {who} waits on {what} at {loc}");
                }
                None => {
                    let _ = writeln!(report, "  {who} sleeps");
                }
            }
        }
    }
    if sleeping > REPORTED_FIBERS {
        // Bounded: every failed join gets a copy of the report.
        let _ = writeln!(report, "  ... and {} more sleeping fibers", sleeping - REPORTED_FIBERS);
    }
    if report.is_empty() {
        report.push_str("  (no sleeping fiber found: they wait on primitives outside this executor)\n");
    }
    let scopes = shared.blocked_scopes.load(Ordering::Acquire);
    if scopes > 0 {
        let _ = writeln!(
            report,
            "  and {scopes} thread(s) wait in Executor::scope for its fibers (a scope cannot be failed: it \
             keeps waiting)"
        );
    }
    // The joins this report fails are taken before it is counted: a join
    // that blocks once the count is up is in an episode of its own, which
    // a caller that waited for the count can rely on.
    let joiners = match shared.config.on_deadlock {
        OnDeadlock::FailJoin => std::mem::take(&mut *shared.blocked_joiners.lock()),
        _ => Vec::new(),
    };
    shared.stats.deadlocks.fetch_add(1, Ordering::Relaxed);
    warn!("spindle-executor: deadlock detected; sleeping fibers:\n{report}");
    match shared.config.on_deadlock {
        OnDeadlock::Abort => std::process::abort(),
        OnDeadlock::Report | OnDeadlock::Ignore => return,
        OnDeadlock::FailJoin => {}
    }
    for task in joiners {
        // A task that completed meanwhile (its joiner not yet off the list)
        // keeps its own outcome: checked under the error's lock, which its
        // completion writes a failure under before it sets `finished` (a
        // value is read before any error, so it wins anyway).
        {
            let mut error = task.error.lock();
            if task.finished.load(Ordering::Acquire) || error.is_some() {
                continue;
            }
            *error = Some(Box::new(JoinError::Deadlock { report: report.clone() }));
        }
        task.done.release(1);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use crate::Executor;

    /// An `Executor` dropped on its sysmon thread (where a stale timer's
    /// task reference may hold its last reference) hands its shutdown to a
    /// thread of its own: the shutdown joins sysmon, and waits for fibers
    /// that sysmon's timers may have to wake. Here the calling thread is
    /// marked as the sysmon thread, and a fiber that keeps the executor
    /// from going quiet ends only after the drop returns.
    #[test]
    fn an_executor_dropped_on_its_sysmon_thread_shuts_down_elsewhere() {
        spindle_test_support::watchdog(
            "an_executor_dropped_on_its_sysmon_thread_shuts_down_elsewhere",
            60,
            |stage| dropped_on_sysmon(&stage),
        );
    }

    fn dropped_on_sysmon(stage: &spindle_test_support::Stage) {
        let exec = Executor::builder().workers(1).build();
        let (started, release) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let busy = {
            let (started, release) = (Arc::clone(&started), Arc::clone(&release));
            exec.spawn(move || {
                started.store(true, Ordering::SeqCst);
                while !release.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
            })
        };
        while !started.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let handle = exec.handle();
        stage.set("dropping the executor on a thread marked as its sysmon");
        let dropper = std::thread::spawn(move || {
            super::SYSMON_OF.with(|s| s.set(Arc::as_ptr(&handle.shared)));
            drop(exec);
            super::SYSMON_OF.with(|s| s.set(std::ptr::null()));
            handle
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while !dropper.is_finished() {
            assert!(Instant::now() < deadline, "the drop on the sysmon thread waited for the shutdown");
            std::thread::yield_now();
        }
        let handle = dropper.join().unwrap();
        release.store(true, Ordering::SeqCst);
        stage.set("joining the busy fiber after the drop returned");
        busy.join().expect("the busy fiber finished normally");
        stage.set("waiting for the shutdown, on its own thread, to refuse spawns");
        // The shutdown goes on on its own thread: spawns fail once it began.
        while !handle.spawn(|| ()).join().is_err_and(|e| e.is_cancelled()) {
            assert!(Instant::now() < deadline, "the executor never shut down");
            std::thread::yield_now();
        }
    }
}
