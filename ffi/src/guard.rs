//! What every export does around its work: catch panics, remember the last error of the
//! thread, count failures, and log them at most once a second.
//!
//! This module owns the thread-local last-error string and the ABI's own counters
//! (`num_abi_errors`, `num_abi_panics`, added to every device's stats). It knows nothing of
//! the pool.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use cistern_alloc::log::RateLimiter;

/// Failed calls of any export (bad arguments, no driver, out of memory, panics).
pub(crate) static ABI_ERRORS: AtomicU64 = AtomicU64::new(0);
/// Panics caught at the boundary (each one is a bug in cistern).
pub(crate) static ABI_PANICS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The message of the latest failed call on this thread (empty when none failed).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// Whether failures on this thread are logged on stderr as well (`cistern_log_errors`).
    static LOG_ERRORS: Cell<bool> = const { Cell::new(true) };
}

/// Sets whether failures on this thread are logged on stderr; returns the previous setting.
pub(crate) fn set_log_errors(on: bool) -> bool {
    LOG_ERRORS.try_with(|l| l.replace(on)).unwrap_or(true)
}

/// Runs `f`, the body of export `name`; a panic inside it becomes `fallback`, a last error, a
/// counter and a log line instead of unwinding into C.
#[inline(always)]
pub(crate) fn call<R>(name: &'static str, fallback: R, f: impl FnOnce() -> R) -> R {
    let body = || {
        #[cfg(test)]
        test_hooks::maybe_panic(name);
        f()
    };
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(payload) => {
            panicked(name, payload);
            fallback
        }
    }
}

#[cold]
#[inline(never)]
fn panicked(name: &str, payload: Box<dyn Any + Send>) {
    ABI_PANICS.fetch_add(1, Relaxed);
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    fail(
        format!("{name}: internal error (a panic, caught; please report it): {what}"),
        true,
    );
}

/// Records a failed call: the thread's last error, the error counter and, when `log` is set
/// and the thread has not turned logging off (`cistern_log_errors(0)`), a rate-limited line
/// on stderr (callers pass `false` when the pool has logged the failure already, or for
/// out-of-memory, which callers report themselves).
#[cold]
#[inline(never)]
pub(crate) fn fail(msg: String, log: bool) {
    ABI_ERRORS.fetch_add(1, Relaxed);
    let msg = format!("cistern: {msg}");
    if log && LOG_ERRORS.try_with(Cell::get).unwrap_or(true) {
        log_rate_limited(&msg);
    }
    set_last_error(msg);
}

/// Replaces the thread's last error.
fn set_last_error(msg: String) {
    // A C string cannot hold NUL; none is expected in our messages, but a user's tag could
    // carry one into a message some day.
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; the message is then dropped.
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            *e = c;
        }
    });
}

/// The thread's last error as a C string; valid until the next failed call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map(|c| c.as_ptr()).ok())
        .ok()
        .flatten()
        .unwrap_or(c"".as_ptr())
}

/// The ABI's own limiter (separate from the pool's, so each layer prints at most a line a
/// second, as it always did).
static ABI_LOG: RateLimiter = RateLimiter::new();

/// Prints `msg` to stderr at most once per second, saying how many were suppressed.
fn log_rate_limited(msg: &str) {
    ABI_LOG.log(msg);
}

/// Test-only: make the next call of an export panic inside its guard.
#[cfg(test)]
pub(crate) mod test_hooks {
    use std::cell::Cell;

    thread_local! {
        static PANIC_IN: Cell<Option<&'static str>> = const { Cell::new(None) };
    }

    /// The next call of export `name` on this thread panics.
    pub(crate) fn panic_next(name: &'static str) {
        PANIC_IN.with(|p| p.set(Some(name)));
    }

    pub(super) fn maybe_panic(name: &'static str) {
        if PANIC_IN.with(|p| p.get()) == Some(name) {
            PANIC_IN.with(|p| p.set(None));
            panic!("test hook: {name} panics on purpose");
        }
    }
}
