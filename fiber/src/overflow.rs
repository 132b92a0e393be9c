//! Stack overflow reports for fibers.
//!
//! A fiber that runs past its stack touches the `PROT_NONE` guard page and
//! the kernel raises `SIGSEGV` (or `SIGBUS`). The handler installed here
//! runs on the thread's alternate signal stack; if the faulting address lies
//! in the guard page of the fiber running on this thread, it prints
//!
//! ```text
//! fiber 'name' (#7) has overflowed its stack (131072 bytes); give it a larger stack (FiberAttr::stack_size, or the stack size setting of the scheduler that created it)
//! fatal runtime error: stack overflow in a fiber, aborting
//! ```
//!
//! and aborts, like Rust's own report for threads. Any other fault goes to
//! the handler that was installed before (Rust's own, which reports thread
//! stack overflows), called as the kernel would call it, or to the default
//! action; a SIGSEGV or SIGBUS another process sends while it was ignored
//! before stays ignored.
//!
//! Everything the handler does is async-signal-safe: a thread-local read,
//! reads of immutable header fields, `write(2)` and `abort`.

use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

use crate::header::Header;

static mut PREVIOUS: [MaybeUninit<libc::sigaction>; 2] = [MaybeUninit::uninit(), MaybeUninit::uninit()];
static INSTALL: Once = Once::new();

const SIGNALS: [libc::c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

/// Installs the handler once per process.
pub(crate) fn install() {
    INSTALL.call_once(|| {
        for (i, &sig) in SIGNALS.iter().enumerate() {
            // SAFETY: plain sigaction calls. PREVIOUS is filled before the
            // handler that reads it is installed: the current action is
            // read first and stored, and only then replaced (reading it
            // through the installing call would let a fault on another
            // thread run the handler before the slot is filled). Should
            // someone else install a handler between the two calls, the
            // action the second call replaced is the one to chain to: it is
            // stored then (a fault racing that store is the one case left).
            unsafe {
                let prev = ptr::addr_of_mut!(PREVIOUS[i]) as *mut libc::sigaction;
                libc::sigaction(sig, ptr::null(), prev);
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = handler as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let mut replaced: libc::sigaction = std::mem::zeroed();
                libc::sigaction(sig, &action, &mut replaced);
                if replaced.sa_sigaction != (*prev).sa_sigaction || replaced.sa_flags != (*prev).sa_flags {
                    prev.write(replaced);
                }
            }
        }
    });
}

/// An alternate signal stack this crate mapped for its thread: disabled
/// and unmapped when the thread exits (a thread-local destructor), if it is
/// still the thread's alternate stack then.
struct OwnAltStack {
    /// The whole mapping: a guard page, then the stack.
    mem: *mut libc::c_void,
    size: usize,
}

/// The page size, for the alternate stack's guard page.
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(4096)
}

impl Drop for OwnAltStack {
    fn drop(&mut self) {
        // SAFETY: querying and disabling this thread's alternate stack,
        // then unmapping our own mapping once nothing uses it. Destructors
        // do not run on the alternate stack.
        unsafe {
            let mut cur: libc::stack_t = std::mem::zeroed();
            let stack = self.mem.cast::<u8>().add(page_size()).cast::<libc::c_void>();
            if libc::sigaltstack(ptr::null(), &mut cur) != 0 || cur.ss_sp != stack {
                // Replaced by someone else: it may still be in use; keep it.
                return;
            }
            let off = libc::stack_t {
                ss_sp: ptr::null_mut(),
                ss_flags: libc::SS_DISABLE,
                ss_size: 0,
            };
            if libc::sigaltstack(&off, ptr::null_mut()) == 0 {
                libc::munmap(self.mem, self.size);
            }
        }
    }
}

thread_local! {
    static OWN_ALTSTACK: std::cell::Cell<Option<OwnAltStack>> = const { std::cell::Cell::new(None) };
}

/// Makes sure the calling thread has an alternate signal stack, so the
/// handler can run after a stack overflow. Threads started by Rust's std
/// already have one; threads started elsewhere get one here, unmapped when
/// the thread exits (so threads that come and go do not pile mappings up;
/// a fiber overflow in a later thread-local destructor of that thread goes
/// unreported, as on a thread without one).
pub(crate) fn ensure_altstack() {
    // SAFETY: querying and setting the alternate stack of this thread.
    unsafe {
        let mut old: libc::stack_t = std::mem::zeroed();
        if libc::sigaltstack(ptr::null(), &mut old) != 0 || old.ss_flags & libc::SS_DISABLE == 0 {
            return;
        }
        // A guard page below it, as std puts under its own: a handler that
        // runs past the stack faults instead of writing over whatever was
        // mapped next (often a fiber's stack; found in review).
        let page = page_size();
        let size = libc::SIGSTKSZ.max(64 * 1024);
        let mem = libc::mmap(
            ptr::null_mut(),
            size + page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if mem == libc::MAP_FAILED {
            return;
        }
        if libc::mprotect(mem, page, libc::PROT_NONE) != 0 {
            libc::munmap(mem, size + page);
            return;
        }
        let st = libc::stack_t {
            ss_sp: mem.cast::<u8>().add(page).cast::<libc::c_void>(),
            ss_flags: 0,
            ss_size: size,
        };
        if libc::sigaltstack(&st, ptr::null_mut()) != 0 {
            libc::munmap(mem, size + page);
            return;
        }
        // Registered for unmapping at thread exit; a thread already tearing
        // down its thread-locals keeps it (leaked with the thread).
        let _ = OWN_ALTSTACK.try_with(|slot| {
            slot.set(Some(OwnAltStack {
                mem,
                size: size + page,
            }))
        });
    }
}

/// Prints the overflow report of fiber `h` and aborts.
fn report(h: &Header) -> ! {
    let mut buf = Buf::new();
    buf.push(b"\nfiber ");
    if let Some(name) = &h.name {
        buf.push(b"'");
        // At most 256 bytes of the name, so that the rest of the report
        // always fits (a cut may split a UTF-8 sequence: it is only read).
        let name = name.as_bytes();
        buf.push(&name[..name.len().min(256)]);
        if name.len() > 256 {
            buf.push(b"...");
        }
        buf.push(b"' ");
    }
    buf.push(b"(#");
    buf.push_num(h.id.as_u64());
    buf.push(b") has overflowed its stack (");
    buf.push_num(h.stack_size as u64);
    buf.push(b" bytes); give it a larger stack (FiberAttr::stack_size, or the stack size setting of the scheduler that created it)\n");
    buf.push(b"fatal runtime error: stack overflow in a fiber, aborting\n");
    // SAFETY: write(2) and abort(3) are async-signal-safe.
    unsafe {
        libc::write(2, buf.bytes.as_ptr() as *const libc::c_void, buf.len);
        libc::abort()
    }
}

/// The lowest guard page start and the highest guard page end of every
/// fiber stack ever mapped (never narrowed). A fault outside goes straight
/// on to the previous handler without the handler reading a thread-local
/// (on the dynamic TLS path, a thread's first access may allocate, which a
/// signal handler must not do).
static GUARDS_LO: AtomicUsize = AtomicUsize::new(usize::MAX);
static GUARDS_HI: AtomicUsize = AtomicUsize::new(0);

/// Widens the range of guard pages the handler checks (called for each new
/// stack).
pub(crate) fn note_guard(lo: usize, hi: usize) {
    GUARDS_LO.fetch_min(lo, Ordering::Relaxed);
    GUARDS_HI.fetch_max(hi, Ordering::Relaxed);
}

extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    // A fault in a fiber's guard page happens on the thread running that
    // fiber, after its stack was noted here (the thread that mapped it, or
    // one that got it after a synchronising hand-over).
    if addr < GUARDS_LO.load(Ordering::Relaxed) || addr >= GUARDS_HI.load(Ordering::Relaxed) {
        chain(sig, info, ctx);
        return;
    }
    // Under loom the word is a loom thread-local, which a signal handler
    // must not touch (nor does loom model signals).
    #[cfg(loom)]
    let h: *const Header = ptr::null();
    #[cfg(not(loom))]
    let h = crate::current::current_header();
    // SAFETY: a non-null current fiber is the header of the fiber running on this
    // thread, kept alive by its runner; its fields read here are immutable.
    if let Some(h) = unsafe { h.as_ref() } {
        let (lo, hi) = h.guard;
        if addr >= lo && addr < hi {
            report(h);
        }
    }
    chain(sig, info, ctx);
}

/// Passes a fault that is not ours to the previous handler.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let i = if sig == libc::SIGSEGV { 0 } else { 1 };
    // SAFETY: PREVIOUS[i] was filled before this handler was installed.
    unsafe {
        let prev = &*(ptr::addr_of!(PREVIOUS[i]) as *const libc::sigaction);
        let action = prev.sa_sigaction;
        let sent = (*info).si_code <= 0;
        if action == libc::SIG_IGN && sent {
            // Ignored, as asked. This handler stays: putting the previous
            // action back would leave every later overflow unreported.
        } else if action == libc::SIG_DFL || action == libc::SIG_IGN {
            // Put the previous action back and return: the faulting
            // instruction runs again and that action takes place (the
            // kernel kills the process for a real fault even if it was
            // ignored). A signal sent by a process (`kill`, `raise`: no
            // faulting instruction to run again) is raised once more, or it
            // would be lost.
            libc::sigaction(sig, prev, ptr::null_mut());
            if sent {
                libc::raise(sig);
            }
        } else {
            // Call it as the kernel would have: a one-shot handler
            // (`SA_RESETHAND`, what `sysv_signal` gives) is reset
            // first, or a handler that returns to let the default action
            // take place would be called again for ever (found in review);
            // and with the signals it asked to block.
            if prev.sa_flags & libc::SA_RESETHAND != 0 {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, ptr::null_mut());
            }
            let mut mask = prev.sa_mask;
            if prev.sa_flags & libc::SA_NODEFER == 0 {
                libc::sigaddset(&mut mask, sig);
            }
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &mask, &mut old);
            if prev.sa_flags & libc::SA_NODEFER != 0 {
                let mut only: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut only);
                libc::sigaddset(&mut only, sig);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &only, ptr::null_mut());
            }
            if prev.sa_flags & libc::SA_SIGINFO != 0 {
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(action);
                f(sig, info, ctx);
            } else {
                let f: extern "C" fn(libc::c_int) = std::mem::transmute(action);
                f(sig);
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, ptr::null_mut());
        }
    }
}

/// A fixed buffer for the report: no allocation in a signal handler.
struct Buf {
    bytes: [u8; 768],
    len: usize,
}

impl Buf {
    fn new() -> Buf {
        Buf {
            bytes: [0; 768],
            len: 0,
        }
    }

    fn push(&mut self, s: &[u8]) {
        let n = s.len().min(self.bytes.len() - self.len);
        self.bytes[self.len..self.len + n].copy_from_slice(&s[..n]);
        self.len += n;
    }

    fn push_num(&mut self, mut v: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}
