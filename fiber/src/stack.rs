//! Guarded, mmap'd fiber stacks and the pool that recycles them.
//!
//! A [`FiberStack`] is one anonymous mapping: a `PROT_NONE` guard page at the
//! low end and the usable region above it (stacks grow down). The
//! [`StackPool`] keeps returned stacks so that creating a fiber in a steady
//! state costs no system call.

use std::fmt;
use std::sync::{Mutex, OnceLock};

use corosensei::stack::{Stack, StackPointer};
use memmap2::{MmapMut, MmapOptions};

use crate::error::StackError;

/// Default usable stack size: 128 KiB, as in the design reference.
pub const DEFAULT_STACK_SIZE: usize = 128 * 1024;

/// Smallest usable stack size accepted (what the context switch itself
/// needs, not what a function needs); see [`FiberAttr::stack_size`](crate::FiberAttr::stack_size) for
/// what real code needs.
pub const MIN_STACK_SIZE: usize = corosensei::stack::MIN_STACK_SIZE;

/// Largest usable stack size accepted (1 GiB): larger requests are almost
/// certainly a unit mistake.
pub const MAX_STACK_SIZE: usize = 1 << 30;

/// Default number of stacks a [`StackPool`] keeps for reuse.
pub const DEFAULT_POOL_CAPACITY: usize = 1024;

pub(crate) fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE.get_or_init(|| unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize })
}

/// Fiber stacks mapped now, or being mapped (pooled ones included), for the out-of-memory
/// report.
static MAPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Fiber stacks this process has mapped now.
pub(crate) fn mapped_stacks() -> usize {
    MAPPED.load(std::sync::atomic::Ordering::Relaxed)
}

/// A fiber stack: an anonymous mapping with a guard page below the usable
/// region.
///
/// Implements corosensei's [`Stack`] trait. Obtain one through
/// [`StackPool::take`]; give it back with [`StackPool::give`] (fibers do both
/// for you).
///
/// A stack is `Send` and `Sync`, derived from its owned mapping: it is
/// plain memory with no thread affinity (pools hand stacks between
/// threads), and `&FiberStack` only reads its bounds.
///
/// ```
/// fn assert_send_sync<T: Send + Sync>() {}
/// assert_send_sync::<spindle_fiber::FiberStack>();
/// ```
pub struct FiberStack {
    /// Unmapped by `drop`, before the count of mapped stacks goes down.
    map: std::mem::ManuallyDrop<MmapMut>,
    usable: usize,
    /// Top of the usable region (read on every switch into the fiber).
    base: usize,
}

impl FiberStack {
    /// Maps a new stack with `usable` bytes (rounded up to whole pages) plus
    /// one guard page.
    ///
    /// # Errors
    ///
    /// [`StackError::TooSmall`] or [`StackError::TooLarge`] for a size out
    /// of range (nothing is mapped); [`StackError::OutOfMemory`] when the
    /// kernel has no memory, address space or mappings left for it (the
    /// message says which limit is likely); [`StackError::Map`] for any
    /// other failure of `mmap` or `mprotect`.
    pub fn new(usable: usize) -> Result<FiberStack, StackError> {
        let usable = checked_size(usable)?;
        let page = page_size();
        let total = usable + page;
        // Counted from before the mapping until after its unmap, so that an
        // out-of-memory report counts every stack that was mapped, or being
        // mapped, while this one was tried (`mapped_before`: the others).
        let mapped_before = MAPPED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let failed = |e: std::io::Error| {
            MAPPED.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            StackError::from_map_error(total, e, mapped_before)
        };
        let map = MmapOptions::new().len(total).stack().map_anon().map_err(failed)?;
        // SAFETY: the first page lies inside the mapping we own; making it
        // PROT_NONE only removes access to memory nobody references yet.
        let rc = unsafe { libc::mprotect(map.as_ptr() as *mut libc::c_void, page, libc::PROT_NONE) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            drop(map);
            return Err(failed(e));
        }
        let base = map.as_ptr() as usize + page + usable;
        let guard = map.as_ptr() as usize;
        crate::overflow::note_guard(guard, guard + page);
        Ok(FiberStack {
            map: std::mem::ManuallyDrop::new(map),
            usable,
            base,
        })
    }

    /// Usable bytes (excluding the guard page).
    pub fn usable_size(&self) -> usize {
        self.usable
    }

    /// The guard page's address range `[start, end)`.
    pub fn guard_range(&self) -> (usize, usize) {
        let start = self.map.as_ptr() as usize;
        (start, start + page_size())
    }

    /// The usable region's address range `[low, high)`.
    pub fn usable_range(&self) -> (usize, usize) {
        let low = self.map.as_ptr() as usize + page_size();
        (low, low + self.usable)
    }
}

/// Validates and rounds a requested usable size.
pub(crate) fn checked_size(requested: usize) -> Result<usize, StackError> {
    if requested < MIN_STACK_SIZE {
        return Err(StackError::TooSmall {
            requested,
            minimum: MIN_STACK_SIZE,
        });
    }
    if requested > MAX_STACK_SIZE {
        return Err(StackError::TooLarge {
            requested,
            maximum: MAX_STACK_SIZE,
        });
    }
    let page = page_size();
    Ok(requested.div_ceil(page) * page)
}

// SAFETY: base and limit are page aligned (hence STACK_ALIGNMENT aligned),
// the region [limit, base) is mapped read-write for the stack's lifetime
// and the limit sits directly above a PROT_NONE guard page.
unsafe impl Stack for FiberStack {
    #[inline]
    fn base(&self) -> StackPointer {
        // SAFETY: the top of a mapping is never address zero.
        unsafe { StackPointer::new_unchecked(self.base) }
    }

    /// The lowest address, guard page included (as the trait asks).
    #[inline]
    fn limit(&self) -> StackPointer {
        StackPointer::new(self.map.as_ptr() as usize).expect("mapping is never at address zero")
    }
}

impl Drop for FiberStack {
    fn drop(&mut self) {
        // SAFETY: dropped once, here; `map` is not used afterwards.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.map) };
        // Only now: a count of zero means no stack is mapped any more.
        MAPPED.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl fmt::Debug for FiberStack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (low, high) = self.usable_range();
        f.debug_struct("FiberStack")
            .field("usable", &self.usable)
            .field("range", &format_args!("{low:#x}..{high:#x}"))
            .finish()
    }
}

/// A bounded cache of fiber stacks, keyed by usable size.
///
/// Fibers take their stack from a pool on creation and give it back when
/// dropped, so that a steady state of creating and dropping fibers makes no
/// `mmap`/`munmap` calls. At most [`capacity`](StackPool::capacity) stacks
/// are kept; extra stacks are unmapped.
///
/// A cached stack keeps the pages its fibers touched (giving them back
/// would cost a system call per fiber): after a burst of fibers that ran
/// deep, up to `capacity` times their depth stays resident. Giving such
/// fibers a pool of their own with a small capacity
/// ([`FiberAttr::pool`](crate::FiberAttr::pool)) bounds that.
///
/// ```
/// use spindle_fiber::StackPool;
///
/// let pool = StackPool::new(8);
/// let stack = pool.take(64 * 1024).unwrap();
/// pool.give(stack);
/// assert_eq!(pool.cached(), 1);
/// let again = pool.take(64 * 1024).unwrap(); // no system call
/// assert_eq!(pool.cached(), 0);
/// # drop(again);
/// ```
pub struct StackPool {
    capacity: usize,
    /// Guarded by the mutex; touched only in `take`/`give`.
    cache: Mutex<Cache>,
}

/// The cached stacks, by usable size.
struct Cache {
    /// Stacks cached, over every size.
    count: usize,
    /// (usable size, stacks of that size). An entry that runs empty stays
    /// (a steady take-give cycle would otherwise allocate its `Vec` every
    /// time) unless there are more than [`MAX_SIZES`] entries, so that
    /// many sizes used once do not pile up. (With more sizes than that in
    /// steady use, their entries come and go, an allocation each time.)
    by_size: Vec<(usize, Vec<FiberStack>)>,
}

/// Size entries beyond which one that runs empty is dropped.
const MAX_SIZES: usize = 16;

impl StackPool {
    /// A pool that keeps at most `capacity` stacks.
    pub const fn new(capacity: usize) -> StackPool {
        StackPool {
            capacity,
            cache: Mutex::new(Cache {
                count: 0,
                by_size: Vec::new(),
            }),
        }
    }

    /// The process-wide pool used by fibers unless told otherwise.
    /// Its capacity is [`DEFAULT_POOL_CAPACITY`], or `SPINDLE_STACK_POOL`
    /// if that environment variable holds a number.
    pub fn global() -> &'static StackPool {
        static GLOBAL: OnceLock<StackPool> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let cap = match std::env::var("SPINDLE_STACK_POOL") {
                Ok(v) => v.trim().parse().unwrap_or_else(|_| {
                    warn!(
                        "spindle-fiber: SPINDLE_STACK_POOL={v:?} is not a number of stacks; \
                         using the default, {DEFAULT_POOL_CAPACITY}"
                    );
                    DEFAULT_POOL_CAPACITY
                }),
                Err(_) => DEFAULT_POOL_CAPACITY,
            };
            StackPool::new(cap)
        })
    }

    /// Most stacks this pool keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stacks currently cached.
    pub fn cached(&self) -> usize {
        self.lock().count
    }

    /// A stack with `usable` bytes: a cached one if there is one, else a
    /// fresh mapping. If the mapping fails for lack of memory, address
    /// space or mappings while the pool keeps idle stacks (of other
    /// sizes), those are unmapped and the mapping is tried once more.
    ///
    /// # Errors
    ///
    /// As [`FiberStack::new`]: a size out of range, or a mapping that
    /// failed again after the idle stacks were unmapped.
    pub fn take(&self, usable: usize) -> Result<FiberStack, StackError> {
        let usable = checked_size(usable)?;
        {
            let mut cache = self.lock();
            if let Some(i) = cache.by_size.iter().position(|(s, _)| *s == usable) {
                if let Some(stack) = cache.by_size[i].1.pop() {
                    cache.count -= 1;
                    if cache.by_size[i].1.is_empty() && cache.by_size.len() > MAX_SIZES {
                        cache.by_size.swap_remove(i);
                    }
                    return Ok(stack);
                }
            }
        }
        match FiberStack::new(usable) {
            Err(e @ StackError::OutOfMemory { .. }) => self.map_after_releasing_idle(usable, e),
            mapped => mapped,
        }
    }

    /// A mapping failed for lack of memory: if this pool keeps idle stacks
    /// (of other sizes, or put back meanwhile), unmaps them and maps again.
    /// Out of line: the common path of `take` stays as small as it was.
    #[cold]
    #[inline(never)]
    fn map_after_releasing_idle(&self, usable: usize, failed: StackError) -> Result<FiberStack, StackError> {
        let idle = {
            let mut cache = self.lock();
            // Emptied sizes stay listed: the count says whether a stack is.
            if cache.count == 0 {
                return Err(failed);
            }
            cache.count = 0;
            std::mem::take(&mut cache.by_size)
        };
        drop(idle); // munmap outside the lock
        FiberStack::new(usable)
    }

    /// Returns a stack to the pool (or unmaps it if the pool is full).
    pub fn give(&self, stack: FiberStack) {
        let mut cache = self.lock();
        if cache.count >= self.capacity {
            drop(cache);
            drop(stack); // munmap outside the lock
            return;
        }
        cache.count += 1;
        match cache.by_size.iter_mut().find(|(s, _)| *s == stack.usable) {
            Some((_, v)) => v.push(stack),
            None => cache.by_size.push((stack.usable, vec![stack])),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        // A panic while holding the lock cannot leave the cache inconsistent.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl fmt::Debug for StackPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StackPool")
            .field("capacity", &self.capacity)
            .field("cached", &self.cached())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_counts_its_stacks_and_forgets_sizes_it_no_longer_holds() {
        let page = page_size();
        let pool = StackPool::new(64);
        // One stack of each of 40 sizes, given back, then taken again.
        let sizes: Vec<usize> = (1..=40).map(|i| i * page).collect();
        for &s in &sizes {
            pool.give(pool.take(s).unwrap());
        }
        assert_eq!(pool.cached(), 40);
        for &s in &sizes {
            let st = pool.take(s).unwrap();
            assert_eq!(st.usable_size(), s, "a cached stack of the asked size");
        }
        assert_eq!(pool.cached(), 0);
        // Emptied sizes are dropped down to the bound, so lookups stay short.
        assert!(
            pool.lock().by_size.len() <= MAX_SIZES,
            "{}",
            pool.lock().by_size.len()
        );
        // The capacity holds across sizes: the 65th stack is unmapped.
        let stacks: Vec<_> = (0..65).map(|i| pool.take((1 + i % 3) * page).unwrap()).collect();
        for st in stacks {
            pool.give(st);
        }
        assert_eq!(pool.cached(), 64);
    }
}
