//! Resident memory per suspended fiber, spindle against its peers.
//!
//! ```text
//! cargo run --release -p spindle-benches --bin rss_per_fiber [-- N]
//! ```
//!
//! For each runtime, creates `N` (default 10,000) fibers with a 128 KiB
//! stack, runs each to its first suspension and keeps them all suspended,
//! then reports the growth of the resident set (`/proc/self/statm`) per
//! fiber. It also counts, with `mincore(2)`, how many pages of each stack
//! are resident, and lists which pages of the last stack created are
//! (numbered from the top, where a stack starts), so that the per-fiber
//! figure splits into stack pages and everything else (fiber object,
//! handles). Each runtime is measured in its own child process, so that
//! none reuses heap another one freed.
//!
//! Peers: corosensei coroutines on a `DefaultStack` of the same size, and
//! `may` coroutines (stack size set to the same 128 KiB, one worker, a
//! coroutine pool of one so that none is made in advance) parked with
//! `may::coroutine::park`.

use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult};
use spindle_fiber::{yield_value, Fiber, FiberAttr, Priority, RunOutcome, DEFAULT_STACK_SIZE};

const STACK: usize = DEFAULT_STACK_SIZE;

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Resident set size in bytes, from the second field of /proc/self/statm.
fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: usize =
        statm.split_whitespace().nth(1).and_then(|f| f.parse().ok()).expect("statm has a resident field");
    pages * page_size()
}

/// The mappings of this process, `(start, end)`, sorted by start.
fn mappings() -> Vec<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let mut v: Vec<(usize, usize)> = maps
        .lines()
        .filter_map(|l| {
            let range = l.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))
        })
        .collect();
    v.sort_unstable();
    v
}

/// For the stack that holds `addr`: the indices of its resident pages,
/// counted from the top (0 = the highest page, where a stack starts).
///
/// Every stack measured here sits directly above its own guard page, a
/// separate mapping, so it starts where the mapping holding `addr` starts
/// and spans `STACK` bytes from there (the kernel may have merged other
/// anonymous memory above it into the same mapping).
fn resident_pages_from_top(maps: &[(usize, usize)], addr: usize) -> Vec<usize> {
    let i = maps.partition_point(|&(start, _)| start <= addr);
    let (start, end) = maps[i.checked_sub(1).expect("address below every mapping")];
    assert!(addr < end, "address {addr:#x} is in no mapping");
    let end = end.min(start + STACK);
    assert!(addr < end, "address {addr:#x} is not in the lowest {STACK} bytes of its mapping");
    let page = page_size();
    let pages = (end - start) / page;
    let mut vec = vec![0u8; pages];
    // SAFETY: [start, end) lies in a mapping of this process (page aligned)
    // and `vec` has one byte per page.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    (0..pages).filter(|&p| vec[pages - 1 - p] & 1 != 0).collect()
}

struct Measure {
    name: &'static str,
    n: usize,
    rss_delta: usize,
    /// Resident stack pages of each fiber, from `mincore`.
    stack_pages: Vec<usize>,
    last_stack: Vec<usize>,
}

impl Measure {
    fn new(name: &'static str, n: usize, rss_delta: usize, marks: &[usize]) -> Measure {
        let maps = mappings();
        let mut stack_pages: Vec<usize> =
            marks.iter().map(|&a| resident_pages_from_top(&maps, a).len()).collect();
        let last_stack = resident_pages_from_top(&maps, marks[n - 1]);
        stack_pages.sort_unstable();
        Measure { name, n, rss_delta, stack_pages, last_stack }
    }

    fn print(&self) {
        let kib = |b: f64| b / 1024.0;
        let per_fiber = self.rss_delta as f64 / self.n as f64;
        let page = page_size() as f64;
        let mean_pages = self.stack_pages.iter().sum::<usize>() as f64 / self.n as f64;
        let median_pages = self.stack_pages[self.n / 2];
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {} / {} / {} | {:?} |",
            self.name,
            self.n,
            kib(per_fiber),
            mean_pages,
            kib(per_fiber - mean_pages * page),
            self.stack_pages[0],
            median_pages,
            self.stack_pages[self.n - 1],
            self.last_stack,
        );
    }
}

fn spindle(n: usize) -> Measure {
    fn body() {
        let marker = 0u8;
        yield_value(black_box(&marker) as *const u8 as usize);
    }
    // One-time setup (signal handler, thread id, pool) outside the measure.
    let warm = Fiber::<()>::new(FiberAttr::new()).unwrap();
    warm.set_function(Priority::NORMAL, body).unwrap();
    let _ = warm.run().unwrap();
    drop(warm);

    let mut fibers = Vec::with_capacity(n);
    let mut marks = Vec::with_capacity(n);
    let before = rss_bytes();
    for _ in 0..n {
        let fiber = Fiber::<()>::new(FiberAttr::new()).unwrap_or_else(|e| panic!("{e}"));
        fiber.set_function(Priority::NORMAL, body).unwrap();
        match fiber.run() {
            Ok(RunOutcome::Yielded(mark)) => marks.push(mark),
            other => panic!("expected the fiber to suspend, got {other:?}"),
        }
        fibers.push(fiber);
    }
    let after = rss_bytes();
    let m = Measure::new("spindle", n, after.saturating_sub(before), &marks);
    drop(fibers); // unwinds each suspended fiber
    m
}

fn corosensei(n: usize) -> Measure {
    type Co = Coroutine<(), usize, (), DefaultStack>;
    fn make() -> Co {
        Coroutine::with_stack(DefaultStack::new(STACK).expect("map stack"), |y, ()| {
            let marker = 0u8;
            y.suspend(black_box(&marker) as *const u8 as usize);
        })
    }
    drop(make());

    let mut coros = Vec::with_capacity(n);
    let mut marks = Vec::with_capacity(n);
    let before = rss_bytes();
    for _ in 0..n {
        let mut co = make();
        match co.resume(()) {
            CoroutineResult::Yield(mark) => marks.push(mark),
            CoroutineResult::Return(()) => unreachable!(),
        }
        coros.push(co);
    }
    let after = rss_bytes();
    let m = Measure::new("corosensei", n, after.saturating_sub(before), &marks);
    drop(coros);
    m
}

fn may(n: usize) -> Measure {
    let marks: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    let parked = Arc::new(AtomicUsize::new(0));
    let spawn = |i: usize| {
        let marks = Arc::clone(&marks);
        let parked = Arc::clone(&parked);
        may::go!(move || {
            let marker = 0u8;
            if let Some(slot) = marks.get(i) {
                slot.store(black_box(&marker) as *const u8 as usize, Ordering::Relaxed);
            }
            parked.fetch_add(1, Ordering::Release);
            may::coroutine::park();
        })
    };
    let wait_parked = |count: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while parked.load(Ordering::Acquire) < count {
            assert!(Instant::now() < deadline, "may coroutines did not all park");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Let the last ones finish switching out.
        std::thread::sleep(Duration::from_millis(50));
    };
    // Start the scheduler outside the measure (index n: no mark slot).
    let warm = spawn(n);
    wait_parked(1);
    warm.coroutine().unpark();
    warm.join().unwrap();

    let mut handles = Vec::with_capacity(n);
    let before = rss_bytes();
    for i in 0..n {
        handles.push(spawn(i));
    }
    wait_parked(n + 1);
    let after = rss_bytes();
    let addrs: Vec<usize> = marks.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    let m = Measure::new("may", n, after.saturating_sub(before), &addrs);
    for h in &handles {
        h.coroutine().unpark();
    }
    for h in handles {
        h.join().unwrap();
    }
    m
}

const RUNTIMES: [&str; 3] = ["spindle", "corosensei", "may"];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = match args.first() {
        Some(a) => a.parse().expect("usage: rss_per_fiber [N [RUNTIME]]"),
        None => 10_000,
    };
    assert!(n > 0, "N must be positive");
    // Each guarded stack is two mappings; stay well inside the kernel's
    // limit so that creation fails nowhere.
    let max_maps: usize = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65_530);
    assert!(
        2 * n + 2_000 <= max_maps,
        "N = {n} needs {} mappings, vm.max_map_count is {max_maps}: use a smaller N",
        2 * n + 2_000
    );

    if let Some(runtime) = args.get(1) {
        let m = match runtime.as_str() {
            "spindle" => spindle(n),
            "corosensei" => corosensei(n),
            "may" => {
                // Same stack size as the others (may counts machine words),
                // one worker, and no pool of coroutines made in advance
                // (they would be resident before the measure starts).
                may::config()
                    .set_stack_size(STACK / std::mem::size_of::<usize>())
                    .set_pool_capacity(1)
                    .set_workers(1);
                may(n)
            }
            other => panic!("unknown runtime {other:?}; one of {RUNTIMES:?}"),
        };
        m.print();
        return;
    }

    println!(
        "RSS per suspended fiber, {} KiB stacks, {} fibers each, page {} B",
        STACK / 1024,
        n,
        page_size()
    );
    println!();
    println!(
        "| runtime | fibers | KiB/fiber | stack pages (mean) | other KiB | stack pages min / median / max \
         | resident pages of the last stack (from top) |"
    );
    println!("|---|---:|---:|---:|---:|---|---|");
    // One process per runtime, so that none inherits another's freed heap.
    let exe = std::env::current_exe().expect("own executable");
    for runtime in RUNTIMES {
        let status = std::process::Command::new(&exe)
            .arg(n.to_string())
            .arg(runtime)
            .status()
            .expect("run a measurement");
        assert!(status.success(), "{runtime}: {status}");
    }
}
