//! Timers for `sleep` and `yield_timeout`, fired by the sysmon thread.

use std::collections::BTreeMap;
use std::time::Instant;

use parking_lot::Mutex;

use crate::task::TaskRef;

struct Entry {
    generation: u64,
    task: TaskRef,
}

/// Where a timer sits: its deadline, then the order timers were added.
pub(crate) type TimerKey = (Instant, u64);

/// Deadlines, each for a task sleeping in its sleep slot. A sleep that ends
/// before its deadline (a wake, a cancel) removes its timer, so that the
/// timer neither keeps the task alive nor counts as pending.
pub(crate) struct Timers {
    map: Mutex<(BTreeMap<TimerKey, Entry>, u64)>,
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers { map: Mutex::new((BTreeMap::new(), 0)) }
    }

    pub(crate) fn add(&self, deadline: Instant, generation: u64, task: TaskRef) -> TimerKey {
        let mut m = self.map.lock();
        let key = (deadline, m.1);
        m.1 += 1;
        m.0.insert(key, Entry { generation, task });
        key
    }

    /// Removes a timer whose sleep ended before it fired (if it is still
    /// there). The task reference is dropped after the lock is released.
    pub(crate) fn remove(&self, key: TimerKey) {
        let entry = self.map.lock().0.remove(&key);
        drop(entry);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.map.lock().0.is_empty()
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.map.lock().0.first_key_value().map(|(k, _)| k.0)
    }

    /// Wakes every task whose deadline passed (taking its sleep waiter, so a
    /// concurrent explicit wake and the timer never both wake it).
    pub(crate) fn fire_due(&self, now: Instant) -> usize {
        let mut fired = 0;
        loop {
            let entry = {
                let mut m = self.map.lock();
                match m.0.first_entry() {
                    Some(e) if e.key().0 <= now => Some(e.remove()),
                    _ => None,
                }
            };
            let Some(entry) = entry else { return fired };
            let waiter = {
                let mut slot = entry.task.sleep.lock();
                if slot.generation != entry.generation {
                    continue; // that sleep already ended; this is a stale timer
                }
                let w = slot.waiter.take();
                if w.is_some() {
                    slot.timed_out = true;
                }
                w
            };
            if let Some(w) = waiter {
                w.wake();
                fired += 1;
            }
        }
    }

    /// Wakes every sleeper now (shutdown).
    pub(crate) fn fire_all(&self) {
        let entries = std::mem::take(&mut self.map.lock().0);
        for (_, e) in entries {
            let w = e.task.sleep.lock().waiter.take();
            if let Some(w) = w {
                w.wake();
            }
        }
    }
}
