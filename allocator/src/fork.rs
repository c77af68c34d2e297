//! `fork()` and the pool: a child of a process that uses cistern must never touch the pool.
//!
//! `fork()` copies only the calling thread. Every lock another thread of the parent held at that
//! moment (an arena's, the device's, the registry's) stays locked in the child forever, so a
//! child that allocates can hang; and a child cannot use its parent's CUDA state anyway (the
//! driver does not support it: CUDA contexts do not survive `fork`). [`watch`] (called by
//! `Pool::new` and the C ABI) registers a `pthread_atfork` child handler that marks the child;
//! every pool call there (`alloc`, `free`, `record_stream`, and the C ABI's exports) then fails
//! with [`CHILD_ERROR`] before taking a lock, and the registry's exit hook does nothing.
//! A child that wants the GPU starts fresh: `multiprocessing`'s `spawn` or `forkserver`, or an
//! `exec`.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Once;

static CHILD: AtomicBool = AtomicBool::new(false);
static WATCH: Once = Once::new();

/// What a forked child is told when it calls into the pool.
pub const CHILD_ERROR: &str = "this process is a fork() child of a process that uses cistern: \
    the parent's pool (its locks, its CUDA state) cannot be used after fork; start GPU work in \
    a fresh process instead (multiprocessing's \"spawn\" or \"forkserver\" start method, or exec)";

extern "C" fn mark_child() {
    CHILD.store(true, Relaxed);
}

/// Marks every future `fork()` child of this process (idempotent; call before the pool exists).
/// Returns whether the handler is registered.
pub fn watch() -> bool {
    let mut ok = true;
    WATCH.call_once(|| ok = crate::sys::at_fork_child(mark_child));
    ok
}

/// Whether this process is a `fork()` child of one that called [`watch`].
#[inline]
pub fn is_fork_child() -> bool {
    CHILD.load(Relaxed)
}

/// Refuses pool work in a `fork()` child: before any lock, one relaxed load.
#[inline]
pub(crate) fn check() -> crate::error::Result<()> {
    if is_fork_child() {
        return Err(crate::error::Error::InvalidArgument(CHILD_ERROR.to_owned()));
    }
    Ok(())
}
