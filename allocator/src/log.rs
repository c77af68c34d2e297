//! The library's rate-limited stderr line: at most one line a second per limiter, the next one
//! saying how many were suppressed in between.
//!
//! One copy of the rule for the allocator (`crate::log_rate_limited`) and the C ABI crate
//! (`cistern-ffi`), which keeps a [`RateLimiter`] of its own: each layer prints at most one line
//! a second, as before the two shared this code.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

/// Prints lines to stderr at most once per second (wall-clock seconds), counting the rest.
#[derive(Debug)]
pub struct RateLimiter {
    /// The second of the last printed line.
    last: AtomicU64,
    /// Lines dropped since then.
    suppressed: AtomicU64,
}

impl RateLimiter {
    /// A limiter that has printed nothing yet.
    pub const fn new() -> Self {
        RateLimiter {
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Prints `msg` to stderr unless this limiter printed a line in the current second; a
    /// printed line says how many were suppressed since the last one. Never panics (a closed
    /// stderr is ignored).
    pub fn log(&self, msg: &str) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let last = self.last.load(Relaxed);
        if now > last
            && self
                .last
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            match self.suppressed.swap(0, Relaxed) {
                0 => stderr_line!("{msg}"),
                n => stderr_line!("{msg} ({n} similar messages suppressed)"),
            }
        } else {
            self.suppressed.fetch_add(1, Relaxed);
        }
    }
}

impl Default for RateLimiter {
    fn default() -> Self {
        Self::new()
    }
}

/// The allocator's own limiter (the pool, the registry, the trace writer).
static LIBRARY: RateLimiter = RateLimiter::new();

/// Prints `msg` to stderr at most once per second (and says how many were suppressed).
pub(crate) fn log_rate_limited(msg: &str) {
    LIBRARY.log(msg);
}
