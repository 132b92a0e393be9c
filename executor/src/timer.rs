//! Timers for `sleep` and `yield_timeout`, fired by the sysmon thread.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::time::Instant;

use parking_lot::Mutex;

use crate::task::TaskRef;

struct Entry {
    deadline: Instant,
    seq: u64,
    generation: u64,
    task: TaskRef,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.deadline == other.deadline && self.seq == other.seq
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    /// Earliest deadline first (BinaryHeap is a max-heap).
    fn cmp(&self, other: &Self) -> CmpOrdering {
        other.deadline.cmp(&self.deadline).then(other.seq.cmp(&self.seq))
    }
}

/// A heap of deadlines, each for a task sleeping in its sleep slot.
pub(crate) struct Timers {
    heap: Mutex<(BinaryHeap<Entry>, u64)>,
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers { heap: Mutex::new((BinaryHeap::new(), 0)) }
    }

    pub(crate) fn add(&self, deadline: Instant, generation: u64, task: TaskRef) {
        let mut h = self.heap.lock();
        let seq = h.1;
        h.1 += 1;
        h.0.push(Entry { deadline, seq, generation, task });
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.heap.lock().0.is_empty()
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.heap.lock().0.peek().map(|e| e.deadline)
    }

    /// Wakes every task whose deadline passed (taking its sleep waiter, so a
    /// concurrent explicit wake and the timer never both wake it).
    pub(crate) fn fire_due(&self, now: Instant) -> usize {
        let mut fired = 0;
        loop {
            let entry = {
                let mut h = self.heap.lock();
                match h.0.peek() {
                    Some(e) if e.deadline <= now => h.0.pop(),
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
        let entries: Vec<Entry> = std::mem::take(&mut self.heap.lock().0).into_vec();
        for e in entries {
            let w = e.task.sleep.lock().waiter.take();
            if let Some(w) = w {
                w.wake();
            }
        }
    }
}
