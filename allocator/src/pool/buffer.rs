//! [`Buffer`]: an owning handle to a pooled block, which frees itself on drop.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use crate::arena::Arena;
use crate::driver::{DeviceId, Driver, StreamId};

/// A pooled device buffer: returns itself to its pool when dropped.
///
/// The memory is valid for work on the buffer's stream; to use it on another stream as well,
/// call [`Buffer::record_stream`] so that the pool waits for that stream before reusing it.
pub struct Buffer<D: Driver> {
    pub(super) ptr: u64,
    pub(super) len: u64,
    pub(super) stream: StreamId,
    pub(super) device: DeviceId,
    pub(super) arena: Option<Arc<Arena<D>>>,
}

impl<D: Driver> Buffer<D> {
    /// The device address (0 for an empty buffer).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// The size that was asked for.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the buffer has size 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
    /// The device it lives on.
    pub fn device(&self) -> DeviceId {
        self.device
    }
    /// Declares that `stream` also uses this buffer (see
    /// [`DevicePool::record_stream`](super::DevicePool::record_stream)).
    ///
    /// Fails, recording nothing, when the driver cannot resolve `stream` (no event could be
    /// recorded on it either).
    pub fn record_stream(&self, stream: StreamId) -> crate::error::Result<()> {
        let Some(a) = &self.arena else { return Ok(()) };
        let c = &*a.core;
        let info = c.resolve_use(stream)?;
        if a.add_use(self.ptr, stream, info) {
            c.counters.num_record_streams.fetch_add(1, Relaxed);
        }
        Ok(())
    }
}

impl<D: Driver> std::fmt::Debug for Buffer<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream)
            .field("device", &self.device)
            .finish()
    }
}

impl<D: Driver> Drop for Buffer<D> {
    fn drop(&mut self) {
        if let Some(a) = self.arena.take() {
            if crate::fork::is_fork_child() {
                // The parent's pool: its locks may be held forever here (see `crate::fork`).
                std::mem::forget(a);
                return;
            }
            // A buffer's pointer is live by construction; an error here would be a pool bug,
            // already counted and logged by free_ptr.
            let _ = a.free_ptr(self.ptr);
        }
    }
}
