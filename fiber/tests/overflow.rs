//! Stack overflow reports, each checked in a child process (the report
//! aborts the process): a fiber that overflows its stack is named, with its
//! id and stack size; faults elsewhere still reach Rust's own handler.

mod common;

use common::{describe, is_child, no_core_dumps, run_child};
use std::hint::black_box;
use std::os::unix::process::ExitStatusExt;
use std::process::Output;

use spindle_fiber::{Fiber, FiberAttr, Priority, RunOutcome};

/// Recurses until the stack runs out. The buffer and the use of the
/// result after the call keep it a real recursion with real frames.
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let mut buf = [0u8; 1024];
    buf[0] = depth as u8;
    let buf = black_box(&mut buf);
    if black_box(depth) == u64::MAX {
        return 0;
    }
    recurse(depth + 1) + u64::from(buf[0]) + u64::from(buf[1023])
}

/// Creates a fiber named `name` with a 64 KiB stack whose function
/// overflows it; prints its identity for the parent to check.
fn overflowing_fiber(name: &str) -> Fiber<u64> {
    let fiber = Fiber::new(FiberAttr::new().name(name).stack_size(64 * 1024)).unwrap();
    eprintln!("child fiber: {} {}", fiber.id(), fiber.stack_size());
    fiber.set_function(Priority::NORMAL, || recurse(0)).unwrap();
    fiber
}

/// Runs `start(arg)` on a thread the C library starts (not Rust's std: it
/// has no alternate signal stack of its own), joins it, and returns what
/// `start` returned.
fn on_c_thread(
    start: extern "C" fn(*mut libc::c_void) -> *mut libc::c_void,
    arg: *mut libc::c_void,
) -> *mut libc::c_void {
    // SAFETY: plain pthread calls with valid arguments; the thread is joined
    // before returning.
    unsafe {
        let mut thread: libc::pthread_t = std::mem::zeroed();
        assert_eq!(libc::pthread_create(&mut thread, std::ptr::null(), start, arg), 0);
        let mut ret: *mut libc::c_void = std::ptr::null_mut();
        assert_eq!(libc::pthread_join(thread, &mut ret), 0);
        ret
    }
}

/// The `(id, stack size)` the child printed.
fn child_fiber(out: &Output) -> (String, String) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find_map(|l| l.strip_prefix("child fiber: "))
        .unwrap_or_else(|| panic!("the child did not print its fiber:\n{}", describe(out)));
    let (id, size) = line.split_once(' ').expect("id and size");
    (id.to_owned(), size.to_owned())
}

/// Checks that the child aborted with the fiber overflow report for `name`.
fn assert_fiber_report(out: &Output, name: &str) {
    let all = describe(out);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGABRT),
        "the child must abort:\n{all}"
    );
    let (id, size) = child_fiber(out);
    assert!(id.starts_with('#'), "{id}");
    assert_eq!(size, (64 * 1024).to_string());
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in [
        name,
        id.as_str(),
        size.as_str(),
        "has overflowed its stack",
        "give it a larger stack (FiberAttr::stack_size, or the stack size setting of the scheduler that created it)",
        "fatal runtime error: stack overflow in a fiber, aborting",
    ] {
        assert!(
            stderr.contains(needle),
            "{needle:?} missing from the report:\n{all}"
        );
    }
    let report = format!("fiber '{name}' ({id}) has overflowed its stack ({size} bytes)");
    assert!(stderr.contains(&report), "expected {report:?}:\n{all}");
    assert!(!stderr.contains("unexpectedly returned"), "{all}");
}

const FIBER_CHILD: &str = "a_fiber_stack_overflow_is_reported_with_name_id_and_size";

#[test]
fn a_fiber_stack_overflow_is_reported_with_name_id_and_size() {
    if is_child(FIBER_CHILD) {
        no_core_dumps();
        let fiber = overflowing_fiber("deep-diver");
        let outcome = fiber.run();
        eprintln!("unexpectedly returned: {outcome:?}");
        return;
    }
    let out = run_child(FIBER_CHILD, 60);
    assert_fiber_report(&out, "deep-diver");
}

const NESTED_CHILD: &str = "an_overflow_in_a_nested_fiber_names_the_inner_fiber";

#[test]
fn an_overflow_in_a_nested_fiber_names_the_inner_fiber() {
    if is_child(NESTED_CHILD) {
        no_core_dumps();
        let outer = Fiber::new(FiberAttr::new().name("outer-fiber")).unwrap();
        outer
            .set_function(Priority::NORMAL, || {
                overflowing_fiber("inner-diver").run().is_ok()
            })
            .unwrap();
        let outcome = outer.run();
        eprintln!("unexpectedly returned: {outcome:?}");
        return;
    }
    let out = run_child(NESTED_CHILD, 60);
    assert_fiber_report(&out, "inner-diver");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("outer-fiber"), "{}", describe(&out));
}

const FOREIGN_THREAD_CHILD: &str = "an_overflow_on_a_thread_without_an_alternate_signal_stack_is_reported";

#[test]
fn an_overflow_on_a_thread_without_an_alternate_signal_stack_is_reported() {
    if is_child(FOREIGN_THREAD_CHILD) {
        no_core_dumps();
        // A thread started by the C library, not by Rust's std: it has no
        // alternate signal stack until the fiber library gives it one.
        extern "C" fn start(_: *mut libc::c_void) -> *mut libc::c_void {
            let fiber = overflowing_fiber("foreign-diver");
            let outcome = fiber.run();
            eprintln!("unexpectedly returned: {outcome:?}");
            std::ptr::null_mut()
        }
        on_c_thread(start, std::ptr::null_mut());
        return;
    }
    let out = run_child(FOREIGN_THREAD_CHILD, 60);
    assert_fiber_report(&out, "foreign-diver");
}

const ALTSTACK_CHILD: &str = "the_alternate_stack_given_to_a_foreign_thread_is_unmapped_when_it_exits";

/// The alternate signal stack the library maps for a thread that had none
/// is unmapped when that thread exits, so threads that come and go do not
/// pile mappings up. In a child process, so that no other test maps
/// something at the freed address in between.
#[test]
fn the_alternate_stack_given_to_a_foreign_thread_is_unmapped_when_it_exits() {
    if is_child(ALTSTACK_CHILD) {
        extern "C" fn start(_: *mut libc::c_void) -> *mut libc::c_void {
            let fiber = Fiber::new(FiberAttr::new()).unwrap();
            fiber.set_function(Priority::NORMAL, || 5).unwrap();
            assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(5)));
            // SAFETY: querying this thread's alternate signal stack.
            let mut st: libc::stack_t = unsafe { std::mem::zeroed() };
            // SAFETY: `st` is a valid `stack_t` for the kernel to fill.
            // SAFETY: `st` is a valid `stack_t` for the kernel to fill.
            assert_eq!(unsafe { libc::sigaltstack(std::ptr::null(), &mut st) }, 0);
            assert_eq!(
                st.ss_flags & libc::SS_DISABLE,
                0,
                "the fiber library gave the thread one"
            );
            st.ss_sp
        }
        let mapped = |addr: usize| {
            std::fs::read_to_string("/proc/self/maps")
                .unwrap()
                .lines()
                .any(|l| {
                    let range = l.split_whitespace().next().unwrap();
                    let (lo, hi) = range.split_once('-').unwrap();
                    let (lo, hi) = (
                        usize::from_str_radix(lo, 16).unwrap(),
                        usize::from_str_radix(hi, 16).unwrap(),
                    );
                    (lo..hi).contains(&addr)
                })
        };
        let altstack = on_c_thread(start, std::ptr::null_mut()) as usize;
        assert_ne!(altstack, 0);
        assert!(
            !mapped(altstack),
            "the thread's alternate stack is still mapped after it exited"
        );
        return;
    }
    let out = run_child(ALTSTACK_CHILD, 60);
    assert!(common::child_passed(&out), "{}", describe(&out));
}

const SENT_CHILD: &str = "a_sigsegv_sent_by_a_process_is_not_swallowed";

/// A SIGSEGV sent with `kill`/`raise` (no faulting instruction to run
/// again) still gets the previous action, here the default: the process
/// dies of it instead of the signal being lost in the fiber library's
/// handler.
#[test]
fn a_sigsegv_sent_by_a_process_is_not_swallowed() {
    if is_child(SENT_CHILD) {
        no_core_dumps();
        // The default action before the fiber library installs its handler
        // (Rust's runtime installed its own).
        // SAFETY: resetting a signal's action to the default.
        unsafe { libc::signal(libc::SIGSEGV, libc::SIG_DFL) };
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber.set_function(Priority::NORMAL, || 1).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(1)));
        // SAFETY: sending this process a signal.
        unsafe { libc::raise(libc::SIGSEGV) };
        eprintln!("the signal was swallowed");
        return;
    }
    let out = run_child(SENT_CHILD, 60);
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{}", describe(&out));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("swallowed"),
        "{}",
        describe(&out)
    );
}

const THREAD_CHILD: &str = "a_thread_stack_overflow_still_gets_rusts_own_report";

#[test]
fn a_thread_stack_overflow_still_gets_rusts_own_report() {
    if is_child(THREAD_CHILD) {
        no_core_dumps();
        // Install the fiber library's handler first.
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber.set_function(Priority::NORMAL, || 1).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(1)));
        let t = std::thread::Builder::new()
            .name("deep-thread".into())
            .stack_size(256 * 1024)
            .spawn(|| recurse(0))
            .unwrap();
        let r = t.join();
        eprintln!("unexpectedly returned: {r:?}");
        return;
    }
    let out = run_child(THREAD_CHILD, 60);
    let all = describe(&out);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGABRT),
        "the child must abort:\n{all}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Rust prints `thread 'name' has overflowed its stack`, recent versions
    // with the thread's id after the name.
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("thread 'deep-thread'") && l.ends_with("has overflowed its stack")),
        "Rust's report for threads is kept:\n{all}"
    );
    assert!(!stderr.contains("in a fiber"), "not mistaken for a fiber:\n{all}");
}

/// Runs `yield_now` with the stack pointer `off` bytes above the lowest
/// usable address: the fiber has used all but `off` bytes of its stack, so
/// the library's own suspension code is what overflows, at every depth of
/// it, up to the switch (the fiber stays current until its runner is back
/// on its own stack).
#[cfg(target_arch = "x86_64")]
fn yield_near_the_guard(low: usize, off: usize) {
    extern "C" fn do_yield() {
        spindle_fiber::yield_now();
    }
    let new_sp = (low + off) & !15;
    // SAFETY: the new stack pointer lies inside this fiber's own mapped
    // stack (or its guard page, which is the point); the callee follows the
    // C ABI and r12 (callee-saved, declared clobbered) restores our rsp.
    unsafe {
        std::arch::asm!(
            "mov r12, rsp",
            "mov rsp, {sp}",
            "call {f}",
            "mov rsp, r12",
            sp = in(reg) new_sp,
            f = sym do_yield,
            out("r12") _,
            clobber_abi("C"),
        );
    }
}

#[cfg(target_arch = "x86_64")]
const EDGE_CHILD: &str = "an_overflow_in_the_last_frames_before_a_switch_is_reported";

#[cfg(target_arch = "x86_64")]
#[test]
fn an_overflow_in_the_last_frames_before_a_switch_is_reported() {
    const SIZE: usize = 64 * 1024;
    if is_child(EDGE_CHILD) {
        no_core_dumps();
        let off: usize = common::child_arg().parse().expect("an offset");
        static POOL: spindle_fiber::StackPool = spindle_fiber::StackPool::new(1);
        let stack = POOL.take(SIZE).unwrap();
        let (low, _) = stack.usable_range();
        POOL.give(stack);
        let fiber = Fiber::<()>::new(FiberAttr::new().name("edge").pool(&POOL).stack_size(SIZE)).unwrap();
        eprintln!("child fiber: {} {}", fiber.id(), fiber.stack_size());
        fiber
            .set_function(Priority::NORMAL, move || yield_near_the_guard(low, off))
            .unwrap();
        // Either the suspension overflows (the report aborts the process),
        // or it fits: the fiber yields, then returns, and the child passes.
        let first = fiber.run();
        assert!(
            matches!(first, Ok(RunOutcome::Yielded(0))),
            "first run: {first:?}"
        );
        let second = fiber.run();
        assert!(
            matches!(second, Ok(RunOutcome::Returned(()))),
            "second run: {second:?}"
        );
        return;
    }
    let mut unreported = Vec::new();
    let mut failed = Vec::new();
    let mut overflowed = 0;
    let mut completed = 0;
    for off in (0..1024).step_by(8) {
        let out = common::run_child_with(EDGE_CHILD, 60, &off.to_string());
        match out.status.signal() {
            // No signal: the yield fitted, and the child must have passed
            // (a panic in it exits with 101).
            None => {
                if common::child_passed(&out) {
                    completed += 1;
                } else {
                    failed.push((off, describe(&out)));
                }
            }
            Some(libc::SIGABRT) => {
                overflowed += 1;
                let (id, size) = child_fiber(&out);
                let stderr = String::from_utf8_lossy(&out.stderr);
                let report = format!("fiber 'edge' ({id}) has overflowed its stack ({size} bytes)");
                if !stderr.contains(&report) {
                    unreported.push((off, describe(&out)));
                }
            }
            Some(_) => unreported.push((off, describe(&out))),
        }
    }
    assert!(
        failed.is_empty(),
        "children that did not overflow failed instead of yielding and returning: {failed:#?}"
    );
    assert!(
        unreported.is_empty(),
        "overflows not reported as a fiber overflow: {unreported:#?}"
    );
    // The small offsets leave the suspension code too little stack: some
    // children must have overflowed, or the test checked nothing.
    assert!(overflowed > 0, "no offset made the suspension overflow");
    // And the large ones leave it enough: the edge lies inside the range.
    assert!(completed > 0, "no offset let the suspension complete");
}

static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A one-shot handler (`SA_RESETHAND`) that logs and returns, to let the
/// default action kill the process when the fault happens again: it gives
/// up (exit 77) if it is called over and over instead.
extern "C" fn log_and_return(_sig: libc::c_int) {
    if CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 100 {
        // SAFETY: ending the process from a signal handler.
        unsafe { libc::_exit(77) };
    }
}

const RESETHAND_CHILD: &str = "a_one_shot_handler_installed_before_the_library_is_called_once";

/// A one-shot SIGSEGV handler installed before the library is called the
/// way the kernel calls it: reset first, so that the fault's repetition
/// takes the default action. (From a review: the library's handler called
/// it again and again, and the process looped for good.)
#[test]
fn a_one_shot_handler_installed_before_the_library_is_called_once() {
    if is_child(RESETHAND_CHILD) {
        no_core_dumps();
        // SAFETY: installing a plain handler with valid arguments.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = log_and_return as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESETHAND | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGSEGV, &action, std::ptr::null_mut());
        }
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber.set_function(Priority::NORMAL, || 1).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(1)));
        // SAFETY: a deliberate fault (an unmapped address).
        let v = unsafe { std::ptr::read_volatile(black_box(16usize) as *const u64) };
        eprintln!("unexpectedly read {v}");
        return;
    }
    let out = run_child(RESETHAND_CHILD, 60);
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{}", describe(&out));
}

const IGNORED_CHILD: &str = "an_ignored_sigsegv_sent_by_a_process_leaves_overflow_reports_on";

/// With SIGSEGV ignored before the library came, a SIGSEGV another process
/// sends is ignored, as asked, and a later fiber overflow is still
/// reported. (From a review: the library put the ignoring action back for
/// good, and the overflow died with a bare SIGSEGV.)
#[test]
fn an_ignored_sigsegv_sent_by_a_process_leaves_overflow_reports_on() {
    if is_child(IGNORED_CHILD) {
        no_core_dumps();
        // SAFETY: setting a signal's action to "ignore".
        unsafe { libc::signal(libc::SIGSEGV, libc::SIG_IGN) };
        let fiber = overflowing_fiber("after-the-kill");
        // SAFETY: sending this process a signal.
        unsafe { libc::raise(libc::SIGSEGV) };
        let outcome = fiber.run();
        eprintln!("unexpectedly returned: {outcome:?}");
        return;
    }
    let out = run_child(IGNORED_CHILD, 60);
    assert_fiber_report(&out, "after-the-kill");
}

const DROPPED_CHILD: &str = "an_overflow_while_a_dropped_fiber_unwinds_on_a_foreign_thread_is_reported";

/// A migratable fiber dropped on a thread that never ran a fiber (one the C
/// library started: no alternate signal stack) is unwound there, on its
/// own stack; an overflow in a destructor then is reported too. (From a
/// review: only running a fiber gave a thread its alternate stack.)
#[test]
fn an_overflow_while_a_dropped_fiber_unwinds_on_a_foreign_thread_is_reported() {
    struct DeepDrop;
    impl Drop for DeepDrop {
        fn drop(&mut self) {
            black_box(recurse(0));
        }
    }
    if is_child(DROPPED_CHILD) {
        no_core_dumps();
        let fiber = Fiber::<()>::new(FiberAttr::new().name("dropped-diver").stack_size(64 * 1024)).unwrap();
        eprintln!("child fiber: {} {}", fiber.id(), fiber.stack_size());
        // SAFETY: the function holds nothing thread-affine across its yield.
        unsafe {
            fiber
                .set_function_migratable(Priority::NORMAL, || {
                    let _d = DeepDrop;
                    spindle_fiber::yield_now();
                })
                .unwrap()
        };
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Yielded(_)));
        extern "C" fn start(p: *mut libc::c_void) -> *mut libc::c_void {
            // SAFETY: the box made below, handed over to this thread.
            drop(unsafe { Box::from_raw(p.cast::<Fiber<()>>()) });
            eprintln!("unexpectedly returned: the drop did not overflow");
            std::ptr::null_mut()
        }
        on_c_thread(start, Box::into_raw(Box::new(fiber)).cast());
        return;
    }
    let out = run_child(DROPPED_CHILD, 60);
    assert_fiber_report(&out, "dropped-diver");
}

/// The alternate signal stack the library maps for a thread that had none
/// has a guard page below it, as std's have: a handler that runs past it
/// faults instead of writing over what was mapped next (often a fiber's
/// stack; found in review).
#[test]
fn the_alternate_stack_given_to_a_foreign_thread_has_a_guard_page() {
    extern "C" fn start(_: *mut libc::c_void) -> *mut libc::c_void {
        let fiber = Fiber::new(FiberAttr::new()).unwrap();
        fiber.set_function(Priority::NORMAL, || 1).unwrap();
        assert!(matches!(fiber.run().unwrap(), RunOutcome::Returned(1)));
        // SAFETY: querying this thread's alternate stack.
        let mut st: libc::stack_t = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid `stack_t` for the kernel to fill.
        assert_eq!(unsafe { libc::sigaltstack(std::ptr::null(), &mut st) }, 0);
        assert_eq!(
            st.ss_flags & libc::SS_DISABLE,
            0,
            "the library gave this thread one"
        );
        let below = st.ss_sp as usize - 1;
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let perms = maps
            .lines()
            .find_map(|l| {
                let (range, rest) = l.split_once(' ')?;
                let (lo, hi) = range.split_once('-')?;
                let (lo, hi) = (
                    usize::from_str_radix(lo, 16).ok()?,
                    usize::from_str_radix(hi, 16).ok()?,
                );
                (lo..hi)
                    .contains(&below)
                    .then(|| rest.split_whitespace().next().unwrap().to_owned())
            })
            .expect("the page below the alternate stack is mapped");
        assert_eq!(perms, "---p", "a guard page below the alternate stack");
        std::ptr::null_mut()
    }
    on_c_thread(start, std::ptr::null_mut());
}
