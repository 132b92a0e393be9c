//! Reports that name the fiber: panic messages, leaked stacks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static LEAKED: AtomicU64 = AtomicU64::new(0);

/// Counts a suspended stack that was leaked instead of unwound (a pinned
/// fiber dropped on a thread other than its own).
pub(crate) fn note_leaked_stack() {
    LEAKED.fetch_add(1, Ordering::Relaxed);
}

/// Stacks leaked because a suspended, pinned fiber was dropped on another
/// thread than the one it ran on (its locals could not be safely dropped
/// there). Zero in a program that drops fibers where they ran.
pub fn leaked_stacks() -> u64 {
    LEAKED.load(Ordering::Relaxed)
}

/// Installs (once) a panic hook that says which fiber panicked, then calls
/// the hook that was installed before.
pub(crate) fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let h = crate::current::current_header();
            // SAFETY: a non-null current fiber is the one running on this thread.
            if let Some(h) = unsafe { h.as_ref() } {
                eprintln!("panic in fiber {}:", h.display_name());
            }
            previous(info);
        }));
    });
}
