//! Timers for `sleep`, `sleep_until` and `yield_timeout` (which wake) and
//! for `interrupt_after` deadlines (which interrupt), fired by the sysmon
//! thread.

use std::collections::BTreeMap;
use std::time::Instant;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use spindle_fiber::Waiter;

use crate::task::TaskRef;

/// The waiter an `interrupt_after` deadline interrupts and its task, taken
/// by whichever comes first: the timer (which interrupts the fiber and
/// drops both while holding this lock) or the end of `interrupt_after`
/// (which then knows no interrupt is in flight).
///
/// The task reference lives here, not in the timer's entry: an entry that
/// sysmon took out of the map just as the call ended would otherwise hold
/// the task's last reference once the task finished, and drop what it
/// still holds (an unjoined panic's payload) on the sysmon thread. Under the lock, the fiber is still inside
/// the call, so the timer's references are never the last.
pub(crate) type InterruptSlot = Arc<Mutex<Option<(Waiter, TaskRef)>>>;

enum Entry {
    /// Ends a `sleep`/`yield_timeout` of the task.
    Sleep { generation: u64, task: TaskRef },
    /// Interrupts a fiber (`interrupt_after`) and counts the deadline as
    /// fired in its task.
    Interrupt(InterruptSlot),
}

/// Where a timer sits: its deadline, then the order timers were added.
pub(crate) type TimerKey = (Instant, u64);

/// Ends the firing of one timer when dropped: after the wake, or if it
/// unwinds. Lowers `Timers::firing` (a count left raised would hold
/// shutdown's quiescence check forever) and clears the map's record of the
/// key being fired (a `remove` of that key waits for it).
struct Firing<'a>(&'a Timers);

impl Drop for Firing<'_> {
    fn drop(&mut self) {
        self.0.map.lock().in_flight = None;
        self.0.firing.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The map's lock-guarded state.
struct Map {
    timers: BTreeMap<TimerKey, Entry>,
    /// The next timer's sequence number.
    next: u64,
    /// The key of the timer `fire_due` took out and is firing now.
    in_flight: Option<TimerKey>,
}

/// Deadlines, each for a task sleeping in its sleep slot. A sleep that ends
/// before its deadline (a wake, a cancel) removes its timer, so that the
/// timer neither keeps the task alive nor counts as pending.
pub(crate) struct Timers {
    map: Mutex<Map>,
    /// Timers taken out of the map by `fire_due` whose wake is not done
    /// yet: raised under the map's lock with the removal, lowered after
    /// the wake, so a timer is always in the map or counted here until its
    /// fiber is in an inbox (shutdown's quiescence check relies on it).
    firing: AtomicUsize,
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers {
            map: Mutex::new(Map { timers: BTreeMap::new(), next: 0, in_flight: None }),
            firing: AtomicUsize::new(0),
        }
    }

    pub(crate) fn add(&self, deadline: Instant, generation: u64, task: TaskRef) -> TimerKey {
        self.insert(deadline, Entry::Sleep { generation, task })
    }

    /// A deadline that interrupts the fiber whose waiter is in `slot`.
    pub(crate) fn add_interrupt(&self, deadline: Instant, slot: InterruptSlot) -> TimerKey {
        self.insert(deadline, Entry::Interrupt(slot))
    }

    fn insert(&self, deadline: Instant, entry: Entry) -> TimerKey {
        let mut m = self.map.lock();
        let key = (deadline, m.next);
        m.next += 1;
        m.timers.insert(key, entry);
        key
    }

    /// Removes a timer whose sleep ended before it fired (if it is still
    /// there). The task reference is dropped after the lock is released.
    ///
    /// If sysmon took the timer out to fire it just as the sleep ended some
    /// other way, waits until that firing is over: the firing's task
    /// reference is then gone while the caller's fiber still holds its
    /// own, so the firing never drops the task's last reference (and with
    /// it an unjoined panic's payload, on sysmon). The wait is the few instructions
    /// of one firing, unless sysmon is descheduled meanwhile.
    pub(crate) fn remove(&self, key: TimerKey) {
        loop {
            let mut m = self.map.lock();
            if let Some(entry) = m.timers.remove(&key) {
                drop(m);
                drop(entry);
                return;
            }
            if m.in_flight != Some(key) {
                return;
            }
            drop(m);
            #[cfg(test)]
            tests::remove_waited();
            std::thread::yield_now();
        }
    }

    /// No timer pending, and none being fired.
    pub(crate) fn is_empty(&self) -> bool {
        let m = self.map.lock();
        m.timers.is_empty() && self.firing.load(Ordering::SeqCst) == 0
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.map.lock().timers.first_key_value().map(|(k, _)| k.0)
    }

    /// Wakes every task whose deadline passed (taking its sleep waiter, so a
    /// concurrent explicit wake and the timer never both wake it).
    pub(crate) fn fire_due(&self, now: Instant) -> usize {
        let mut fired = 0;
        loop {
            let entry = {
                let mut m = self.map.lock();
                match m.timers.first_entry() {
                    Some(e) if e.key().0 <= now => {
                        self.firing.fetch_add(1, Ordering::SeqCst);
                        let (key, entry) = e.remove_entry();
                        m.in_flight = Some(key);
                        Some(entry)
                    }
                    _ => None,
                }
            };
            let Some(entry) = entry else { return fired };
            let _firing = Firing(self);
            let (generation, task) = match entry {
                Entry::Sleep { generation, task } => {
                    #[cfg(test)]
                    tests::sleep_entry_taken();
                    (generation, task)
                }
                Entry::Interrupt(slot) => {
                    #[cfg(test)]
                    tests::interrupt_entry_taken();
                    fired += usize::from(fire_interrupt(&slot));
                    continue;
                }
            };
            let waiter = {
                let mut slot = task.sleep.lock();
                // A stale timer (that sleep already ended) wakes nothing.
                let w = if slot.generation == generation { slot.waiter.take() } else { None };
                if w.is_some() {
                    slot.timed_out = true;
                }
                w
            };
            // The entry's task reference goes before the wake: while the
            // fiber sleeps, its own references keep the task alive, so this
            // one is not the last. Dropped after the wake, it often was (the
            // woken fiber finished first), and the task's value, with
            // whatever its `Drop` does, was dropped on this thread (sysmon).
            // A stale entry, whose sleep something else ended, is not the
            // last either: that fiber's `remove` of this key waits until
            // `_firing` is dropped.
            drop(task);
            if let Some(w) = waiter {
                w.wake();
                fired += 1;
            }
            // The fiber is in its inbox now (or was woken some other way);
            // `_firing` lowers the count (on an unwind too).
        }
    }

    /// Wakes every sleeper now (shutdown). Runs on the thread that drops
    /// the executor, not on sysmon, and records no key in flight: a stale
    /// entry's task reference may be a task's last here, and an unjoined
    /// panic's payload is then dropped on that thread.
    pub(crate) fn fire_all(&self) {
        let entries = std::mem::take(&mut self.map.lock().timers);
        for (_, e) in entries {
            match e {
                Entry::Sleep { task, .. } => {
                    let w = task.sleep.lock().waiter.take();
                    // As in `fire_due`: the task reference before the wake.
                    drop(task);
                    if let Some(w) = w {
                        w.wake();
                    }
                }
                // Out of its interruptible wait, to its next cancellation
                // point.
                Entry::Interrupt(slot) => {
                    fire_interrupt(&slot);
                }
            }
        }
    }
}

/// Fires an `interrupt_after` deadline that is still armed: counts it as
/// fired in the task and interrupts the fiber, under the slot's lock
/// (`interrupt_after`'s end waits for it, so no interrupt arrives after it
/// returned). Whether it was still armed.
fn fire_interrupt(slot: &InterruptSlot) -> bool {
    let mut armed = slot.lock();
    let Some((waiter, task)) = armed.take() else { return false };
    task.fired_deadlines.fetch_add(1, Ordering::SeqCst);
    // Both references go under the lock (`interrupt` consumes the waiter):
    // the fiber cannot leave `interrupt_after` meanwhile, so neither is its
    // last (see `InterruptSlot`).
    waiter.interrupt();
    drop(task);
    drop(armed);
    true
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc, Mutex};
    use std::time::Duration;

    use crate::{interrupt_after, spawn, yield_now, Executor};

    type Hook = Box<dyn FnMut() + Send>;

    /// Run by `fire_due` on the sysmon thread right after it took an
    /// `interrupt_after` entry out of the map, before it fires it.
    static INTERRUPT_ENTRY_TAKEN: Mutex<Option<Hook>> = Mutex::new(None);
    /// The same for a sleep's entry.
    static SLEEP_ENTRY_TAKEN: Mutex<Option<Hook>> = Mutex::new(None);
    /// Rounds a `remove` waited for the firing of its key.
    static REMOVE_WAITED: AtomicUsize = AtomicUsize::new(0);

    pub(super) fn interrupt_entry_taken() {
        if let Some(hook) = INTERRUPT_ENTRY_TAKEN.lock().unwrap().as_mut() {
            hook();
        }
    }

    pub(super) fn sleep_entry_taken() {
        if let Some(hook) = SLEEP_ENTRY_TAKEN.lock().unwrap().as_mut() {
            hook();
        }
    }

    pub(super) fn remove_waited() {
        REMOVE_WAITED.fetch_add(1, Ordering::SeqCst);
    }

    /// The two tests below stall sysmon and count `remove`'s waits: one
    /// at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// Stalls sysmon (inside a hook) until the fiber either went on and
    /// finished (`after`: a job queued behind its task ran) or waits in its
    /// timer's removal.
    fn stall_until_done_or_waiting(after: &mpsc::Receiver<()>) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while after.try_recv().is_err() {
            if REMOVE_WAITED.load(Ordering::SeqCst) > 0 {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the fiber neither finished nor waited");
            std::thread::yield_now();
        }
    }

    /// A panic payload that records the thread it is dropped on. (A panic
    /// payload nobody joined is dropped with the task's last reference; a
    /// value nobody joined is dropped on its own fiber once its handle is
    /// gone, so it cannot show where the last reference went.)
    struct RecordsDropThread(mpsc::Sender<String>);
    impl Drop for RecordsDropThread {
        fn drop(&mut self) {
            let name = std::thread::current().name().unwrap_or("?").to_owned();
            let _ = self.0.send(name);
        }
    }

    /// A sleep's timer that sysmon takes out of the map just as the sleep
    /// ends another way (`JoinHandle::wake`, made here while sysmon is
    /// stalled between taking the entry and firing it) does not hold the
    /// task's last reference once the fiber goes on and finishes: the
    /// fiber's removal of its timer waits for that firing, so the task's
    /// unjoined panic payload is dropped on its worker, not on sysmon.
    #[test]
    fn a_sleep_timer_taken_as_a_wake_ends_the_sleep_does_not_drop_the_payload_on_sysmon() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        REMOVE_WAITED.store(0, Ordering::SeqCst);
        spindle_test_support::watchdog(
            "a_sleep_timer_taken_as_a_wake_ends_the_sleep_does_not_drop_the_payload_on_sysmon",
            60,
            |_stage| {
                let exec = Executor::builder().workers(1).build();
                let (after_tx, after_rx) = mpsc::channel::<()>();
                let (handle_tx, handle_rx) = mpsc::channel();
                let handle_rx = Mutex::new(handle_rx);
                let after_rx = Mutex::new(after_rx);
                *SLEEP_ENTRY_TAKEN.lock().unwrap() = Some(Box::new(move || {
                    let handle = handle_rx
                        .lock()
                        .unwrap()
                        .recv_timeout(Duration::from_secs(30))
                        .expect("the test sends the task's handle");
                    // End the sleep another way, and let go of the task.
                    crate::JoinHandle::<()>::wake(&handle);
                    drop(handle);
                    stall_until_done_or_waiting(&after_rx.lock().unwrap());
                }));
                let (drop_tx, drop_rx) = mpsc::channel();
                let handle = exec.spawn(move || {
                    // Never reached: the timer is taken first, and the wake ends it.
                    crate::sleep(Duration::from_millis(1));
                    // Runs once this task has ended (one worker, no yield before).
                    drop(spawn(move || after_tx.send(()).unwrap()));
                    std::panic::panic_any(RecordsDropThread(drop_tx))
                });
                handle_tx.send(handle).unwrap();
                let thread = drop_rx
                    .recv_timeout(Duration::from_secs(30))
                    .expect("the panic payload was never dropped");
                *SLEEP_ENTRY_TAKEN.lock().unwrap() = None;
                assert_ne!(
                    thread, "spindle-sysmon",
                    "the task's unjoined panic payload was dropped on sysmon"
                );
                assert!(
                    REMOVE_WAITED.load(Ordering::SeqCst) > 0,
                    "the fiber did not meet the firing in flight"
                );
            },
        );
    }

    /// An `interrupt_after` deadline that sysmon takes out of the map just
    /// as its call ends holds no reference to the task that could be its
    /// last: the task's unjoined panic payload is dropped where the task
    /// ends, on its worker, not on sysmon after the fiber is gone. (Sysmon is
    /// stalled here between taking the entry and firing it. The call's end
    /// waits for that firing now, which then interrupts the fiber, and the
    /// call's end clears the mark; before the wait, the call took the
    /// waiter first and the task ended while sysmon held a reference.)
    #[test]
    fn a_deadline_taken_as_its_call_ends_does_not_drop_the_payload_on_sysmon() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        REMOVE_WAITED.store(0, Ordering::SeqCst);
        spindle_test_support::watchdog(
            "a_deadline_taken_as_its_call_ends_does_not_drop_the_payload_on_sysmon",
            60,
            |_stage| {
                let exec = Executor::builder().workers(1).build();
                let taken = Arc::new(AtomicBool::new(false));
                let (after_tx, after_rx) = mpsc::channel::<()>();
                let after_rx = Mutex::new(after_rx);
                {
                    let taken = Arc::clone(&taken);
                    *INTERRUPT_ENTRY_TAKEN.lock().unwrap() = Some(Box::new(move || {
                        taken.store(true, Ordering::SeqCst);
                        stall_until_done_or_waiting(&after_rx.lock().unwrap());
                    }));
                }
                let (drop_tx, drop_rx) = mpsc::channel();
                drop(exec.spawn(move || {
                    interrupt_after(Duration::from_millis(1), || {
                        while !taken.load(Ordering::SeqCst) {
                            yield_now();
                        }
                    });
                    // Runs once this task has ended (one worker, no yield before).
                    drop(spawn(move || after_tx.send(()).unwrap()));
                    std::panic::panic_any(RecordsDropThread(drop_tx))
                }));
                let thread = drop_rx
                    .recv_timeout(Duration::from_secs(30))
                    .expect("the panic payload was never dropped");
                *INTERRUPT_ENTRY_TAKEN.lock().unwrap() = None;
                assert_ne!(
                    thread, "spindle-sysmon",
                    "the task's unjoined panic payload was dropped on sysmon"
                );
                assert!(
                    REMOVE_WAITED.load(Ordering::SeqCst) > 0,
                    "the call's end did not meet the firing in flight"
                );
            },
        );
    }
}
