//! A thread-safe priority run queue of fibers (work in progress).
