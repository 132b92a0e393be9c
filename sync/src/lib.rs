//! Fiber-aware semaphores and channels (work in progress).
