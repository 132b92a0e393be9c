//! Error types. Every message says what happened and what to do about it.

use std::fmt;
use std::io;

use crate::FiberId;

/// Why a stack could not be created.
///
/// `Copy`, like [`FiberError`]: an error holds no allocation, so dropping
/// a `Result` of [`Fiber::run`](crate::Fiber::run) costs nothing when it
/// is not a panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StackError {
    /// The requested usable size is below what a fiber needs.
    TooSmall {
        /// Bytes requested.
        requested: usize,
        /// Smallest accepted size.
        minimum: usize,
    },
    /// The requested usable size is beyond what this library maps.
    TooLarge {
        /// Bytes requested.
        requested: usize,
        /// Largest accepted size.
        maximum: usize,
    },
    /// The kernel is out of memory (or address space, or mappings) for
    /// the mapping.
    #[non_exhaustive]
    OutOfMemory {
        /// Bytes of the mapping, guard page included.
        bytes: usize,
        /// Fiber stacks this process had mapped when the mapping failed
        /// (pooled ones included): near 32,000, the kernel's limit on
        /// mappings is the likely cause.
        mapped: u32,
        /// The process's address-space limit in bytes (`ulimit -v`,
        /// `RLIMIT_AS`) when the mapping failed, if it has one.
        address_limit: Option<std::num::NonZeroU64>,
    },
    /// Any other `mmap`/`mprotect` failure.
    Map {
        /// Bytes of the mapping, guard page included.
        bytes: usize,
        /// The operating system's error number (`errno`; `EINVAL` if the
        /// arguments were refused before any system call); see
        /// [`os_error`](StackError::os_error).
        errno: i32,
    },
}

impl StackError {
    /// `mapped_before`: the fiber stacks mapped when the mapping was tried.
    pub(crate) fn from_map_error(bytes: usize, source: io::Error, mapped_before: usize) -> StackError {
        match source.raw_os_error() {
            Some(libc::ENOMEM) => StackError::OutOfMemory {
                bytes,
                // Saturating: 4 bytes keep the error as small as it was.
                mapped: u32::try_from(mapped_before.max(crate::stack::mapped_stacks())).unwrap_or(u32::MAX),
                address_limit: address_limit(),
            },
            // Not an OS error: the mapping library refused the arguments
            // without a system call, which is what EINVAL means for mmap.
            errno => StackError::Map {
                bytes,
                errno: errno.unwrap_or(libc::EINVAL),
            },
        }
    }

    /// The operating system's error, for [`StackError::Map`].
    pub fn os_error(&self) -> Option<io::Error> {
        match *self {
            StackError::Map { errno, .. } => Some(io::Error::from_raw_os_error(errno)),
            _ => None,
        }
    }
}

/// The soft `RLIMIT_AS` of the process, if it is not unlimited.
fn address_limit() -> Option<std::num::NonZeroU64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    std::num::NonZeroU64::new(limit.rlim_cur)
}

/// Live fibers at which the kernel's default limit on mappings
/// (`vm.max_map_count`, 65,530) is near: each guarded stack takes two.
const MAP_COUNT_NEAR: usize = 30_000;

impl fmt::Display for StackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StackError::TooSmall { requested, minimum } => write!(
                f,
                "fiber stack size {requested} bytes is too small: ask for at least {minimum} bytes \
                 (a fiber that may panic needs about 8 KiB, 32 KiB with RUST_BACKTRACE set; the \
                 default is 128 KiB)"
            ),
            StackError::TooLarge { requested, maximum } => write!(
                f,
                "fiber stack size {requested} bytes is too large: at most {maximum} bytes are mapped \
                 per fiber; check the unit of the size you passed"
            ),
            StackError::OutOfMemory {
                bytes,
                mapped,
                address_limit,
            } => {
                write!(
                    f,
                    "could not map a {bytes}-byte fiber stack: out of memory (ENOMEM), with {mapped} \
                     fiber stacks mapped by this process. "
                )?;
                let map_count = "Each guarded stack uses two kernel memory mappings, so around \
                                 32,000 live fibers (counting the idle stacks kept by stack pools) \
                                 hit the default vm.max_map_count limit of 65,530: raise it (sysctl \
                                 vm.max_map_count) or keep fewer fibers alive at once";
                match address_limit {
                    Some(limit) if (*mapped as usize) < MAP_COUNT_NEAR => write!(
                        f,
                        "The process's address space is limited to {limit} bytes (ulimit -v, \
                         RLIMIT_AS): raise that limit, or use smaller stacks or fewer fibers. \
                         (Otherwise: {map_count}.)"
                    ),
                    Some(limit) => write!(
                        f,
                        "{map_count}. (The address space is also limited, to {limit} bytes: \
                         ulimit -v, RLIMIT_AS; smaller stacks help with that limit, not with the \
                         mapping count.)"
                    ),
                    None if (*mapped as usize) < MAP_COUNT_NEAR => write!(
                        f,
                        "The system (or the container or cgroup this process runs in) may be out \
                         of memory: free some, or use smaller stacks or fewer fibers. (Otherwise: \
                         {map_count}.)"
                    ),
                    None => write!(
                        f,
                        "{map_count}. Or the system is out of memory (check the memory a \
                         container or cgroup may use): then smaller stacks help too."
                    ),
                }
            }
            StackError::Map { bytes, errno } => write!(
                f,
                "could not map a {bytes}-byte fiber stack: {}; check the process's memory limits \
                 (ulimit -v, RLIMIT_AS, a seccomp or container policy on mmap/mprotect) or ask for \
                 a smaller stack",
                io::Error::from_raw_os_error(*errno)
            ),
        }
    }
}

impl std::error::Error for StackError {}

/// Why a fiber operation was refused. The fiber is left as it was (except
/// that `run` marks a fiber whose function was unwound on drop `Finished`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FiberError {
    /// `run` on a fiber that has no function.
    NoFunction(FiberId),
    /// `run` on a fiber whose function already returned or panicked.
    Finished(FiberId),
    /// `set_function` on a fiber suspended in the middle of its function
    /// (it yielded, or it sleeps on a synchronisation primitive).
    Busy(FiberId),
    /// `run` or `set_function` on a fiber that is running right now: on
    /// another thread, or on this one (the caller is that fiber, or a
    /// fiber it runs); or on a fiber held for a moment by a wake that
    /// another thread is finishing for it (a hand-driven loop that runs a
    /// fiber woken by another thread can see this: retry, as for
    /// [`Sleeping`](FiberError::Sleeping)).
    Running(FiberId),
    /// `run` or `set_function` on a fiber that sits in a run queue.
    Queued(FiberId),
    /// `run` of a fiber that sleeps (on a synchronisation primitive, or in
    /// [`sleep`](crate::sleep) until its [`Waiter`](crate::Waiter) wakes
    /// it; `set_function` on it gives [`Busy`](FiberError::Busy): it is in
    /// the middle of its function).
    Sleeping(FiberId),
    /// `mark_dequeued` on a fiber that is not in a queue.
    NotQueued(FiberId),
    /// `run` of a pinned fiber on a thread other than the one it started on
    /// (or, before its first run, the one [`Fiber::pin_to`](crate::Fiber::pin_to)
    /// named).
    WrongThread(FiberId),
    /// [`Fiber::pin_to`](crate::Fiber::pin_to) on a fiber whose function has
    /// already run on another thread: it stays pinned there.
    AlreadyStarted(FiberId),
    /// [`Fiber::pin_to`](crate::Fiber::pin_to) on a fiber whose function was
    /// set with [`set_function_migratable`](crate::Fiber::set_function_migratable):
    /// it may run on any thread, and is not pinned.
    Migratable(FiberId),
    /// `run` or `set_function` on a fiber that has no stack any more: it
    /// was dropped while suspended, and a destructor that ran during that
    /// unwind kept a reference to it (a `Waiter`), so its stack went back
    /// to the pool (or was leaked) without it; or dropping its unstarted
    /// closure panicked (see [`Fiber::set_function`](crate::Fiber::set_function)).
    NoStack(FiberId),
    /// The fiber's stack could not be created.
    Stack(StackError),
}

impl fmt::Display for FiberError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FiberError::NoFunction(id) => {
                write!(f, "fiber {id} has no function to run: call set_function first")
            }
            FiberError::Finished(id) => write!(
                f,
                "fiber {id} has finished its function (it returned or panicked): call set_function \
                 to give it a new function before running it again"
            ),
            FiberError::Busy(id) => write!(
                f,
                "fiber {id} is suspended in the middle of its function (it yielded or sleeps): let \
                 it run to completion (wake it if it sleeps) or drop it before setting a new \
                 function"
            ),
            FiberError::Running(id) => write!(
                f,
                "fiber {id} is already running, on another thread or as the caller itself (or a \
                 fiber that runs the caller), or is held for a moment by a wake that another thread \
                 is finishing for it: wait until it has suspended (or the wake is done: retry) \
                 before running it or setting its function, and never do either from inside the \
                 fiber or a fiber it runs"
            ),
            FiberError::Queued(id) => write!(
                f,
                "fiber {id} is in a run queue: pop it from the queue before running it (or, if it \
                 has not started, before giving it a new function)"
            ),
            FiberError::Sleeping(id) => write!(
                f,
                "fiber {id} is asleep (on a synchronisation primitive, or in sleep until its \
                 Waiter wakes it): leave it until a wake makes it runnable again (it is handed to its home scheduler, or left ready to run if it \
                 has none), then run it"
            ),
            FiberError::NotQueued(id) => write!(
                f,
                "fiber {id} is not in a queue: only a scheduler that queued it may take it out"
            ),
            FiberError::WrongThread(id) => write!(
                f,
                "fiber {id} is pinned to another thread (the one it started on, or the one pin_to \
                 named): run it there, pin_to this thread before its first run, or give it its \
                 function with the unsafe set_function_migratable if that function is safe to move"
            ),
            FiberError::AlreadyStarted(id) => write!(
                f,
                "fiber {id} has already run its function on another thread, which keeps it there: \
                 call pin_to after set_function and before the first run"
            ),
            FiberError::Migratable(id) => write!(
                f,
                "fiber {id} has a function set with set_function_migratable, which may run on any \
                 thread: pin_to is for functions set with set_function"
            ),
            FiberError::NoStack(id) => write!(
                f,
                "fiber {id} has no stack: it was dropped while suspended and only lives on \
                 through a reference a destructor kept, or dropping its previous function's \
                 closure panicked; create a new fiber instead"
            ),
            FiberError::Stack(e) => write!(f, "{e}"),
        }
    }
}

/// `Stack` is transparent: its message is the stack error's, so its
/// `source()` is the stack error's source (none), not the stack error
/// itself, which a reporter walking the chain would print twice.
impl std::error::Error for FiberError {}

impl From<StackError> for FiberError {
    fn from(e: StackError) -> FiberError {
        FiberError::Stack(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapping_error_keeps_its_errno_and_enomem_names_the_limit() {
        let eperm = StackError::from_map_error(4096, io::Error::from_raw_os_error(libc::EPERM), 0);
        assert_eq!(
            eperm,
            StackError::Map {
                bytes: 4096,
                errno: libc::EPERM
            }
        );
        assert_eq!(eperm.os_error().and_then(|e| e.raw_os_error()), Some(libc::EPERM));
        assert!(
            eperm.to_string().contains("check the process's memory limits"),
            "{eperm}"
        );

        // A refusal without a system call reads as EINVAL, not "os error 0".
        let refused =
            StackError::from_map_error(4096, io::Error::new(io::ErrorKind::InvalidInput, "too big"), 0);
        assert_eq!(
            refused,
            StackError::Map {
                bytes: 4096,
                errno: libc::EINVAL
            }
        );

        // Errors come back from every `run` and `Fiber::new`: the
        // out-of-memory details must not make them larger than before.
        assert!(
            std::mem::size_of::<StackError>() <= 24,
            "{}",
            std::mem::size_of::<StackError>()
        );
        assert!(
            std::mem::size_of::<FiberError>() <= 24,
            "{}",
            std::mem::size_of::<FiberError>()
        );

        let oom = StackError::from_map_error(8192, io::Error::from_raw_os_error(libc::ENOMEM), 0);
        assert!(
            matches!(oom, StackError::OutOfMemory { bytes: 8192, .. }),
            "{oom:?}"
        );
        assert!(oom.os_error().is_none());
        assert!(oom.to_string().contains("max_map_count"), "{oom}");

        // The likely cause comes first: the address-space limit while few
        // stacks are mapped, the mappings limit near 32,000 of them.
        let limited = StackError::OutOfMemory {
            bytes: 8192,
            mapped: 63,
            address_limit: std::num::NonZeroU64::new(1 << 30),
        };
        let msg = limited.to_string();
        assert!(msg.starts_with("could not map a 8192-byte fiber stack"), "{msg}");
        assert!(msg.contains("with 63 fiber stacks mapped"), "{msg}");
        let (rlimit, map_count) = (
            msg.find("RLIMIT_AS").unwrap(),
            msg.find("vm.max_map_count").unwrap(),
        );
        assert!(rlimit < map_count, "the address-space limit first: {msg}");
        let crowded = StackError::OutOfMemory {
            bytes: 8192,
            mapped: 32_700,
            address_limit: std::num::NonZeroU64::new(1 << 40),
        };
        let msg = crowded.to_string();
        let (rlimit, map_count) = (
            msg.find("RLIMIT_AS").unwrap(),
            msg.find("vm.max_map_count").unwrap(),
        );
        assert!(map_count < rlimit, "the mappings limit first: {msg}");
        // Smaller stacks do not lower the number of mappings (from review:
        // the advice read as if they did).
        assert!(msg.contains("not with the mapping count"), "{msg}");
        let unlimited = StackError::OutOfMemory {
            bytes: 8192,
            mapped: 10,
            address_limit: None,
        };
        let msg = unlimited.to_string();
        assert!(
            msg.contains("vm.max_map_count") && !msg.contains("RLIMIT_AS"),
            "{msg}"
        );
        let (memory, map_count) = (
            msg.find("out of memory: free").unwrap(),
            msg.find("vm.max_map_count").unwrap(),
        );
        assert!(memory < map_count, "memory first with few stacks mapped: {msg}");
    }
}
