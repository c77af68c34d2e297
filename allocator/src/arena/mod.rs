//! An arena: one stream's share of a device pool.
//!
//! Each stream that allocates gets an [`Arena`] with two heaps (small and large requests), each
//! over its own segments. A block freed on the stream is reusable at once by the next
//! allocation on the same stream, because work on one stream runs in order. Other streams never
//! reuse an arena's *blocks*; they can only take its whole free *pages* through the device pool
//! (after the stream's work has finished, see [`crate::pool`]). One lock per arena; the hot
//! path takes it once and makes no driver call, except event queries while frees are pending.
//!
//! This module owns the arena whole: the [`Arena`] (its stream, the [`DeviceCore`] every arena
//! of a device shares, its lock, its teardown) and, behind the lock, [`ArenaState`]: its heaps,
//! its segments and their page tables ([`segment`]), its map of live pointers ([`live`]), its
//! pending frees ([`pending`]) and its share of the statistics, with the invariant check
//! ([`check`]). It calls the driver only for `record_stream`ed blocks (recording, polling and, on slow paths,
//! waiting for their events, or synchronising the device when no event could be recorded), in
//! `DeviceCore::sync_stream` (which the pool calls before it takes an arena's pages), and at
//! teardown, to give its memory back.
//!
//! It names nothing of [`crate::pool`]: the device pool above it decides *when* arenas grow,
//! shrink and trade pages; the arena only keeps its own books straight.

mod check;
mod live;
mod pending;
mod segment;
mod shared;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::driver::{Driver, StreamId, StreamInfo};
use crate::error::Result;
use crate::heap::{SpanId, SpanState};
use crate::pool::PoolEventKind;
use crate::provenance::{Ledger, Origin};
use crate::stats::{LocalGauges, SharedGauges};

pub(crate) use live::{LiveMap, LiveRef};
pub(crate) use pending::{Pending, StreamRef};
pub(crate) use segment::{Backing, Chunk, HeapKind, Heaps, Page, Segment};
pub(crate) use shared::{Counters, DeviceCore, EventCache, StreamMark};

/// Everything behind an arena's lock.
#[derive(Debug, Default)]
pub(crate) struct ArenaState {
    pub kinds: Heaps,
    pub live: LiveMap,
    /// Streams other than the arena's that used a live block (`record_stream`).
    pub uses: FxHashMap<u64, Vec<StreamRef>>,
    pub pending: Vec<Pending>,
    pub gauges: LocalGauges,
    /// Live bytes per (tag, site) of this arena (see [`crate::provenance`]).
    pub ledger: Ledger,
    /// Allocations recorded with provenance so far: the last block's `BlockMeta::seq`.
    pub seq: u64,
    /// The graph pool this arena serves ([`Arena::graph_pool`]), for what is counted and told
    /// under the arena's lock alone.
    pub graph_pool: Option<(u64, u64)>,
}

/// What became of a free request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FreeOutcome {
    /// The block is free again.
    Freed,
    /// The block waits on other streams' events.
    Pending,
    /// The pointer is not a live block of this arena.
    Unknown,
}

/// One stream's share of a device pool.
pub(crate) struct Arena<D: Driver> {
    /// The stream whose allocations this arena serves (the handle it was first seen with).
    pub(crate) stream: StreamId,
    /// What identifies that stream.
    pub(crate) sref: StreamRef,
    /// Set when the stream is known to be gone (its handle now names another stream): the
    /// handle is never used again, and the arena only serves frees of its live blocks.
    pub(crate) retired: AtomicBool,
    /// The graph pool (PyTorch's mempool id) whose allocations this arena serves, if any.
    pub(crate) graph_pool: Option<(u64, u64)>,
    /// What every arena of the device shares.
    pub(crate) core: Arc<DeviceCore<D>>,
    /// The arena's books; see the lock order in [`crate::pool`].
    pub(crate) state: Mutex<ArenaState>,
}

impl<D: Driver> Arena<D> {
    /// A new, empty arena for the stream `sref`.
    pub(crate) fn new(sref: StreamRef, core: Arc<DeviceCore<D>>) -> Self {
        Self::for_pool(sref, core, None)
    }

    /// A graph pool's arena is *pinned* until its pool is released (which retires it): a
    /// replay may write any of its memory at any time, so its pages are never taken by another
    /// arena, moved, nor released (see `crate::pool::graphs`).
    #[inline]
    pub(crate) fn pinned(&self) -> bool {
        self.graph_pool.is_some() && !self.retired.load(Relaxed)
    }

    /// A new, empty arena for the stream `sref`, serving graph pool `graph_pool` when given.
    pub(crate) fn for_pool(
        sref: StreamRef,
        core: Arc<DeviceCore<D>>,
        graph_pool: Option<(u64, u64)>,
    ) -> Self {
        Arena {
            stream: sref.handle,
            sref,
            retired: AtomicBool::new(false),
            graph_pool,
            core,
            state: Mutex::new(ArenaState {
                graph_pool,
                ..ArenaState::default()
            }),
        }
    }

    /// The handle that names this arena's stream on the calling thread: `None` when the stream
    /// is gone, or is another thread's per-thread stream. Every driver call on the arena's
    /// stream goes through this.
    pub(crate) fn handle_here(&self) -> Option<StreamId> {
        if self.retired.load(Relaxed) {
            return None;
        }
        self.sref.handle_here()
    }

    /// Notes that `stream` (resolved as `info`) uses the live block at `base`, unless it is the
    /// arena's own stream. Returns whether a use was added.
    pub(crate) fn add_use(&self, base: u64, stream: StreamId, info: StreamInfo) -> bool {
        let u = StreamRef::new(stream, info);
        if u.same(&self.sref) {
            return false;
        }
        let mut a = self.state.lock();
        let uses = a.uses.entry(base).or_default();
        if !uses.iter().any(|x| x.same(&u)) {
            uses.push(u);
        }
        true
    }

    /// Frees `ptr`, a block of this arena (found by address, or a [`crate::Buffer`]'s own).
    pub(crate) fn free_ptr(&self, ptr: u64) -> Result<()> {
        let c = &*self.core;
        // Before the block can be reused (see `DevicePool::free_raw`).
        if let Some(r) = &c.recorder {
            r.free(ptr);
        }
        let outcome = self.state.lock().free(ptr, &self.sref, c);
        match outcome {
            FreeOutcome::Unknown => return Err(c.invalid_free(ptr, "unknown or already freed")),
            FreeOutcome::Pending => {
                c.counters.num_pending_frees.fetch_add(1, Relaxed);
            }
            FreeOutcome::Freed => {}
        }
        if c.closed.load(Relaxed) {
            self.teardown();
        }
        Ok(())
    }

    /// Releases everything the arena holds when no block is live or pending (after the device
    /// pool was dropped). Returns whether it did.
    pub(crate) fn teardown(&self) -> bool {
        let c = &*self.core;
        let mut a = self.state.lock();
        if !a.pending.is_empty() {
            a.process_pending(true, c);
        }
        // A block still pending (its events could not be waited for) may still be used by
        // another stream: its pages stay mapped, like a live block's.
        if !a.live.is_empty() || !a.pending.is_empty() {
            return false;
        }
        let d = &*c.driver;
        let pool = a.graph_pool;
        let mut synced = false;
        for kh in a.kinds.iter_mut() {
            for slot in &mut kh.segments {
                if slot.is_none() {
                    continue;
                }
                if !synced {
                    // Unmapping needs the stream's work on these pages finished. If that cannot
                    // be known, the memory stays mapped (lost to this process, never corrupted).
                    if !c.sync_stream(self.handle_here()) {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        crate::log_rate_limited(&format!(
                            "cistern: device {} stream {}: the stream's work could not be waited \
                             for at teardown; its memory is left mapped",
                            c.dev, self.stream
                        ));
                        return false;
                    }
                    synced = true;
                }
                let Some(seg) = slot.take() else { continue };
                match seg.backing {
                    Backing::Vmm { pages } => {
                        // Each chunk once, at its mapping's first granule.
                        for (i, p) in pages.iter().enumerate() {
                            if let Some(p) = p.filter(|p| p.index == 0) {
                                let addr = seg.base + i as u64 * c.granularity;
                                let len = p.len as u64 * c.granularity;
                                // Told first, as everywhere (see `PoolEventKind`).
                                c.observer.emit(
                                    PoolEventKind::SegmentUnmap,
                                    c.dev,
                                    addr,
                                    len,
                                    pool,
                                );
                                if d.unmap(c.dev, addr, len).is_err() {
                                    c.observer.emit(
                                        PoolEventKind::SegmentMap,
                                        c.dev,
                                        addr,
                                        len,
                                        pool,
                                    );
                                }
                                let _ = c.share.release_chunk(c, p.handle);
                            }
                        }
                        let _ = d.free_va(c.dev, seg.base, seg.len);
                    }
                    Backing::Linear => {
                        c.observer
                            .emit(PoolEventKind::SegmentFree, c.dev, seg.base, seg.len, pool);
                        if d.mem_free(c.dev, seg.base).is_err() {
                            c.observer.emit(
                                PoolEventKind::SegmentAlloc,
                                c.dev,
                                seg.base,
                                seg.len,
                                pool,
                            );
                        }
                    }
                }
                kh.heap.remove_segment(seg.first);
            }
            kh.vmm_segs.clear();
        }
        true
    }
}

impl<D: Driver> Drop for Arena<D> {
    fn drop(&mut self) {
        if !self.teardown() {
            let (n, p) = {
                let a = self.state.lock();
                (a.live.len(), a.pending.len())
            };
            crate::log_rate_limited(&format!(
                "cistern: {n} block(s) on device {} stream {} were never freed and {p} freed \
                 block(s) could not be waited for; their memory is left mapped so that their \
                 pointers stay valid",
                self.core.dev, self.stream
            ));
        }
    }
}

impl ArenaState {
    /// Updates the inactive-split gauges after heap `kind`'s free totals changed.
    #[inline]
    pub fn note_free_change(&mut self, kind: HeapKind, before: (u64, u64), shared: &SharedGauges) {
        let (c, b) = self.free_totals(kind);
        let d = [
            0,
            0,
            0,
            0,
            c as i64 - before.0 as i64,
            b as i64 - before.1 as i64,
            0,
        ];
        self.gauges.apply(kind.pool_index(), &d, shared);
    }

    #[inline]
    pub fn free_totals(&self, kind: HeapKind) -> (u64, u64) {
        let h = &self.kinds[kind].heap;
        (h.free_count(), h.free_bytes())
    }

    /// The hot path: a free block of `size` bytes from heap `kind`, or `None`.
    #[inline]
    pub fn try_take(
        &mut self,
        kind: HeapKind,
        size: u64,
        requested: u64,
        shared: &SharedGauges,
    ) -> Option<(u64, SpanId)> {
        let id = self.kinds[kind].heap.find(size)?;
        let before = self.free_totals(kind);
        let id = self.kinds[kind].heap.take(id, size);
        let ptr = self.kinds[kind].heap.span(id).start;
        self.note_taken(kind, ptr, id, size, requested, before, shared);
        Some((ptr, id))
    }

    /// The books of a span just taken from heap `kind` (free totals `before` the take): its
    /// requested size, the live map and the gauges.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn note_taken(
        &mut self,
        kind: HeapKind,
        ptr: u64,
        id: SpanId,
        size: u64,
        requested: u64,
        before: (u64, u64),
        shared: &SharedGauges,
    ) {
        self.kinds[kind].heap.set_requested(id, requested);
        self.live.insert(ptr, LiveRef { kind, span: id });
        let (fc, fb) = self.free_totals(kind);
        let d = [
            1,
            size as i64,
            1,
            size as i64,
            fc as i64 - before.0 as i64,
            fb as i64 - before.1 as i64,
            requested as i64,
        ];
        self.gauges.apply(kind.pool_index(), &d, shared);
    }

    /// The segment of heap `kind` that contains `ptr`.
    fn segment_at(&self, kind: HeapKind, ptr: u64) -> Option<&Segment> {
        self.kinds[kind]
            .segments
            .iter()
            .flatten()
            .find(|s| s.base <= ptr && ptr < s.base + s.len)
    }

    /// Whether `[ptr, ptr + size)` lies in one segment of heap `kind`, in mapped memory (no
    /// hole), whatever its blocks' states.
    pub fn mapped_range(&self, kind: HeapKind, ptr: u64, size: u64) -> bool {
        let Some(seg) = self.segment_at(kind, ptr) else {
            return false;
        };
        let end = ptr.saturating_add(size);
        end <= seg.base + seg.len
            && self.kinds[kind]
                .heap
                .segment_spans(seg.first)
                .filter(|(_, s)| s.start < end && ptr < s.end())
                .all(|(_, s)| s.state != SpanState::Hole)
    }

    /// A live block of `size` bytes (`requested` asked for) at exactly `ptr` in heap `kind`,
    /// when that range lies inside one free span; `None` otherwise (nothing changes). Not for
    /// the hot path: it walks the segment's spans.
    pub fn take_at(
        &mut self,
        kind: HeapKind,
        ptr: u64,
        size: u64,
        requested: u64,
        shared: &SharedGauges,
    ) -> Option<SpanId> {
        let first = self.segment_at(kind, ptr)?.first;
        let (id, _) = self.kinds[kind]
            .heap
            .segment_spans(first)
            .find(|(_, s)| s.state == SpanState::Free && s.start <= ptr && ptr + size <= s.end())?;
        let before = self.free_totals(kind);
        let id = self.kinds[kind].heap.take_range(id, ptr, size);
        self.note_taken(kind, ptr, id, size, requested, before, shared);
        Some(id)
    }

    /// Records the provenance of the block just taken (span `id` of heap `kind`, `size` bytes
    /// rounded): its meta and the ledger. Only for pools with provenance on.
    #[inline]
    pub fn record(&mut self, kind: HeapKind, id: SpanId, size: u64, o: &Origin) {
        self.seq += 1;
        let slot = self.ledger.add(o.tag, o.site, size);
        *self.kinds[kind].heap.meta_mut(id) = crate::heap::BlockMeta {
            tag: o.tag,
            site: o.site,
            thread: o.thread,
            time_ns: o.time_ns,
            seq: self.seq,
            slot: slot + 1,
        };
    }

    /// [`ArenaState::record`] for the live block at `ptr` (after the slow path).
    pub fn record_ptr(&mut self, ptr: u64, o: &Origin) {
        if let Some(r) = self.live.get(&ptr).copied() {
            let len = self.kinds[r.kind].heap.span(r.span).len;
            self.record(r.kind, r.span, len, o);
        }
    }

    /// Returns a live or pending span to its heap's free space. `live` also ends its life as
    /// an allocation (`requested` bytes asked for), for a span that was not pending.
    #[inline]
    fn release_span(
        &mut self,
        kind: HeapKind,
        id: SpanId,
        live: Option<u64>,
        shared: &SharedGauges,
    ) {
        let before = self.free_totals(kind);
        let len = self.kinds[kind].heap.span(id).len as i64;
        self.kinds[kind].heap.free(id);
        let (fc, fb) = self.free_totals(kind);
        let (n, bytes, req) = match live {
            Some(r) => (1, len, r as i64),
            None => (0, 0, 0),
        };
        let d = [
            -n,
            -bytes,
            -1,
            -len,
            fc as i64 - before.0 as i64,
            fb as i64 - before.1 as i64,
            -req,
        ];
        self.gauges.apply(kind.pool_index(), &d, shared);
    }

    /// Frees the live block at `ptr`. Blocks used by other streams become pending: an event is
    /// recorded on each of those streams and the block returns to the heap once all complete.
    pub fn free<D: Driver>(
        &mut self,
        ptr: u64,
        own: &StreamRef,
        core: &DeviceCore<D>,
    ) -> FreeOutcome {
        let (dev, shared) = (core.dev, &core.shared);
        let Some(r) = self.live.remove(&ptr) else {
            return FreeOutcome::Unknown;
        };
        let kind = r.kind;
        let (len, requested) = {
            let s = self.kinds[kind].heap.span(r.span);
            (s.len, s.requested)
        };
        let slot = self.kinds[kind].heap.meta(r.span).slot;
        if slot != 0 {
            self.ledger.remove(slot - 1, len);
        }
        if let Some(streams) = self.uses.remove(&ptr) {
            let streams: Vec<StreamRef> = streams.into_iter().filter(|u| !u.same(own)).collect();
            let mut p = Pending {
                kind,
                span: r.span,
                events: Vec::new(),
                needs_device_sync: false,
                sync_dev: dev,
                deferred: Vec::new(),
            };
            if core.capturing() {
                p.deferred = streams;
            } else {
                p.record(streams, core, false);
            }
            if !p.events.is_empty() || p.needs_device_sync || !p.deferred.is_empty() {
                let d = [-1, -(len as i64), 0, 0, 0, 0, -(requested as i64)];
                self.gauges.apply(kind.pool_index(), &d, shared);
                self.kinds[kind].heap.set_pending(r.span);
                self.pending.push(p);
                return FreeOutcome::Pending;
            }
        }
        core.observer.emit(
            PoolEventKind::FreeCompleted,
            dev,
            ptr,
            requested,
            self.graph_pool,
        );
        self.release_span(kind, r.span, Some(requested), shared);
        FreeOutcome::Freed
    }

    /// Turns `[lo, hi)` inside free span `id` of heap `kind` into a hole, keeping the gauges.
    /// Returns the hole's span.
    pub fn carve(
        &mut self,
        kind: HeapKind,
        id: SpanId,
        lo: u64,
        hi: u64,
        shared: &SharedGauges,
    ) -> SpanId {
        let before = self.free_totals(kind);
        let hole = self.kinds[kind].heap.carve_hole(id, lo, hi);
        self.note_free_change(kind, before, shared);
        hole
    }

    /// Turns `[lo, hi)` inside hole `id` of heap `kind` into free space, keeping the gauges.
    pub fn fill(&mut self, kind: HeapKind, id: SpanId, lo: u64, hi: u64, shared: &SharedGauges) {
        let before = self.free_totals(kind);
        self.kinds[kind].heap.fill_hole(id, lo, hi);
        self.note_free_change(kind, before, shared);
    }

    /// The live block containing `addr` (its base pointer), also for interior pointers.
    pub fn block_containing(&self, addr: u64) -> Option<u64> {
        if self.live.contains_key(&addr) {
            return Some(addr);
        }
        // Interior pointers are rare (record_stream on a view): a scan is acceptable here.
        self.live.iter().find_map(|(&ptr, r)| {
            let s = self.kinds[r.kind].heap.span(r.span);
            (addr >= s.start && addr < s.end()).then_some(ptr)
        })
    }

    /// Bytes of the largest free span in either heap (for OOM reports).
    pub fn largest_free(&self) -> u64 {
        let mut best = 0;
        for (_, kh) in self.kinds.iter() {
            for seg in kh.segments.iter().flatten() {
                for (_, s) in kh.heap.segment_spans(seg.first) {
                    if s.state == SpanState::Free {
                        best = best.max(s.len);
                    }
                }
            }
        }
        best
    }
}
