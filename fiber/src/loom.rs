//! The one place that chooses between std and loom primitives, so that the
//! same state machine code runs under the loom model checker.

#[cfg(not(loom))]
pub(crate) mod sync {
    pub(crate) mod atomic {
        pub(crate) use std::sync::atomic::{AtomicU8, Ordering};
    }
}

#[cfg(loom)]
pub(crate) mod sync {
    pub(crate) mod atomic {
        pub(crate) use loom::sync::atomic::{AtomicU8, Ordering};
    }
}
