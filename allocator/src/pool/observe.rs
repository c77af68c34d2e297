//! Pool events for an observer: device memory mapped and unmapped (VMM), segments allocated and
//! freed (`cuMemAlloc` mode), and frees completed. These are what PyTorch's allocator records in
//! its trace as `segment_map` / `segment_unmap` / `segment_alloc` / `segment_free` /
//! `free_completed`; a layer above the pool (cistern_torch's history, through
//! `cistern_set_observer`) cannot see them otherwise: it sees a free requested, but not when a
//! `record_stream`ed block's other streams finish with it, and never sees pages move.
//!
//! Off by default: each event site costs one relaxed load. The observer is called on the thread
//! that caused the event, with pool locks held (an arena's, the device's): it must return
//! quickly and must not call back into the pool.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::driver::DeviceId;

/// What happened (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolEventKind {
    /// Physical memory mapped at `addr` (`bytes` of it), with access granted: the pool holds
    /// more device memory.
    SegmentMap,
    /// Memory about to be unmapped at `addr` (told while it is still mapped, as PyTorch
    /// records it): moved to another address of the pool (a `SegmentMap` follows) or about to
    /// be released to the driver. When the unmap fails, a `SegmentMap` of the same range
    /// follows: it stays mapped.
    SegmentUnmap,
    /// A `cuMemAlloc` segment (without VMM).
    SegmentAlloc,
    /// A segment about to be given back with `cuMemFree` (told before the free); when the free
    /// fails, a `SegmentAlloc` of the same segment follows.
    SegmentFree,
    /// The block at `addr` (`bytes`: the size that was asked for) is free for reuse: at its free, or, when
    /// other streams used it (`record_stream`), once their work has completed.
    FreeCompleted,
}

/// One event of device `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolEvent {
    /// What happened.
    pub kind: PoolEventKind,
    /// The device it happened on.
    pub device: DeviceId,
    /// The first address of the range (or block).
    pub addr: u64,
    /// Its length.
    pub bytes: u64,
    /// The graph pool (PyTorch's mempool id) whose arena the memory or block is in; `(0, 0)`
    /// outside graph pools.
    pub pool: (u64, u64),
}

/// A callback for pool events (see the module docs for what it may do).
pub type Observer = Arc<dyn Fn(&PoolEvent) + Send + Sync>;

/// A device's observer, if any.
#[derive(Default)]
pub(crate) struct ObserverSlot {
    on: AtomicBool,
    f: RwLock<Option<Observer>>,
}

impl ObserverSlot {
    /// Replaces the observer; returns the old one, for the caller to drop once it holds no
    /// lock (dropping it may release a C caller's context, which may call cistern). Waits for
    /// calls to the old observer under way: none is made after this returns.
    #[must_use]
    pub(crate) fn set(&self, f: Option<Observer>) -> Option<Observer> {
        let mut g = self.f.write();
        self.on.store(f.is_some(), Relaxed);
        std::mem::replace(&mut *g, f)
    }

    /// Tells the observer, if there is one.
    #[inline]
    pub(crate) fn emit(
        &self,
        kind: PoolEventKind,
        device: DeviceId,
        addr: u64,
        bytes: u64,
        pool: Option<(u64, u64)>,
    ) {
        if self.on.load(Relaxed) {
            self.emit_slow(PoolEvent {
                kind,
                device,
                addr,
                bytes,
                pool: pool.unwrap_or((0, 0)),
            });
        }
    }

    #[cold]
    fn emit_slow(&self, e: PoolEvent) {
        // Called under the read lock, so that `set` returns only when no call is under way.
        if let Some(f) = &*self.f.read() {
            f(&e);
        }
    }
}
