//! An arena: one stream's share of a device pool.
//!
//! Each stream that allocates gets an arena with two heaps (small and large requests), each over
//! its own segments. A block freed on the stream is reusable at once by the next allocation on
//! the same stream, because work on one stream runs in order. Other streams never reuse an
//! arena's *blocks*; they can only take its whole free *pages* through the device pool (after
//! the stream's work has finished, see [`crate::pool`]). One lock per arena; the hot path takes
//! it once and makes no driver call.
//!
//! This module owns the arena's bookkeeping: its heaps, its segments and their page tables, its
//! map of live pointers, its pending frees and its share of the statistics. It never calls the
//! driver except to record and poll the events of `record_stream`ed blocks.

use rustc_hash::FxHashMap;

use crate::driver::{Driver, EventId, PhysHandle, StreamId};
use crate::heap::{Heap, SpanId, SpanState};
use crate::provenance::{Ledger, Origin};
use crate::stats::{Gauge, LocalGauges, SharedGauges};

/// Small or large heap.
pub(crate) const SMALL: usize = 0;
/// Large heap.
pub(crate) const LARGE: usize = 1;

/// The stats pool index (1 small, 2 large) of a heap kind.
#[inline]
pub(crate) fn pool_index(kind: usize) -> usize {
    kind + 1
}

/// How a segment's memory is backed.
#[derive(Debug)]
pub(crate) enum Backing {
    /// A virtual reservation whose pages are mapped on demand; `pages[i]` is the handle mapped
    /// at `base + i * granularity`.
    Vmm { pages: Vec<Option<PhysHandle>> },
    /// One `cuMemAlloc` allocation.
    Linear,
}

/// A contiguous address range owned by one heap.
#[derive(Debug)]
pub(crate) struct Segment {
    pub base: u64,
    pub len: u64,
    pub first: SpanId,
    pub backing: Backing,
}

/// One heap with its segments.
#[derive(Debug, Default)]
pub(crate) struct KindHeap {
    pub heap: Heap,
    /// Segments by index (`Span::seg`); `None` for removed ones.
    pub segments: Vec<Option<Segment>>,
    /// The indices of the VMM segments (virtual extents), in the order they were reserved.
    pub vmm_segs: Vec<u32>,
}

impl KindHeap {
    pub fn add_segment(&mut self, base: u64, len: u64, backing: Backing) -> u32 {
        let idx = match self.segments.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.segments.push(None);
                self.segments.len() - 1
            }
        } as u32;
        let state = match backing {
            Backing::Vmm { .. } => SpanState::Hole,
            Backing::Linear => SpanState::Free,
        };
        let first = self.heap.add_segment(idx, base, len, state);
        self.segments[idx as usize] = Some(Segment {
            base,
            len,
            first,
            backing,
        });
        idx
    }

    pub fn segment(&self, idx: u32) -> &Segment {
        // Segment indices come from spans of live segments only.
        self.segments[idx as usize]
            .as_ref()
            .expect("span refers to a removed segment")
    }
}

/// A block freed while other streams may still use it.
#[derive(Debug)]
pub(crate) struct Pending {
    pub kind: usize,
    pub span: SpanId,
    pub events: Vec<EventId>,
    /// Some stream's use could not be captured by an event and the device could not be
    /// synchronised: the block waits for a successful device synchronisation.
    pub needs_device_sync: bool,
}

/// Live pointers to their spans.
///
/// # Note [An address-ordered hash]
///
/// The map is a hash table whose bucket index is the block's address in 512 B units (the low
/// bits of the hash), with mixed bits only in the top seven bits that hashbrown uses as tags.
/// Blocks that are neighbours in memory are neighbours in the table, so a program that frees
/// in allocation order (queues of activations, KV caches) walks the table sequentially instead
/// of missing the cache on every free; random frees cost the same as with a mixing hash.
pub(crate) type LiveMap = std::collections::HashMap<u64, LiveRef, AddressHash>;

/// The hasher of [`LiveMap`] (see the note there).
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct AddressHash;

impl std::hash::BuildHasher for AddressHash {
    type Hasher = AddressHasher;
    #[inline]
    fn build_hasher(&self) -> AddressHasher {
        AddressHasher(0)
    }
}

/// Hashes one `u64` address as described in [`LiveMap`].
#[derive(Default, Debug)]
pub(crate) struct AddressHasher(u64);

impl std::hash::Hasher for AddressHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed; this path exists for completeness.
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ b as u64);
        }
    }
    #[inline]
    fn write_u64(&mut self, addr: u64) {
        let tag = addr.wrapping_mul(0x9E37_79B9_7F4A_7C15) & (0x7F << 57);
        self.0 = (addr >> 9) & !(0x7F << 57) | tag;
    }
}

/// Where a live block is: heap kind and span.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveRef {
    pub kind: u8,
    pub span: SpanId,
}

/// Everything behind an arena's lock.
#[derive(Debug, Default)]
pub(crate) struct ArenaState {
    pub kinds: [KindHeap; 2],
    pub live: LiveMap,
    /// Streams other than the arena's that used a live block (`record_stream`).
    pub uses: FxHashMap<u64, Vec<StreamId>>,
    pub pending: Vec<Pending>,
    pub gauges: LocalGauges,
    /// Live bytes per (tag, site) of this arena (see [`crate::provenance`]).
    pub ledger: Ledger,
    /// Allocations recorded with provenance so far: the last block's `BlockMeta::seq`.
    pub seq: u64,
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

impl ArenaState {
    /// Updates the inactive-split gauges after heap `kind`'s free totals changed.
    #[inline]
    pub fn note_free_change(&mut self, kind: usize, before: (u64, u64), shared: &SharedGauges) {
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
        self.gauges.apply(pool_index(kind), &d, shared);
    }

    #[inline]
    pub fn free_totals(&self, kind: usize) -> (u64, u64) {
        let h = &self.kinds[kind].heap;
        (h.free_count(), h.free_bytes())
    }

    /// The hot path: a free block of `size` bytes from heap `kind`, or `None`.
    #[inline]
    pub fn try_take(
        &mut self,
        kind: usize,
        size: u64,
        requested: u64,
        shared: &SharedGauges,
    ) -> Option<(u64, SpanId)> {
        let id = self.kinds[kind].heap.find(size)?;
        let before = self.free_totals(kind);
        let h = &mut self.kinds[kind].heap;
        let id = h.take(id, size);
        let ptr = h.span(id).start;
        h.set_requested(id, requested);
        self.live.insert(
            ptr,
            LiveRef {
                kind: kind as u8,
                span: id,
            },
        );
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
        self.gauges.apply(pool_index(kind), &d, shared);
        Some((ptr, id))
    }

    /// Records the provenance of the block just taken (span `id` of heap `kind`, `size` bytes
    /// rounded): its meta and the ledger. Only for pools with provenance on.
    #[inline]
    pub fn record(&mut self, kind: usize, id: SpanId, size: u64, o: &Origin) {
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
            let len = self.kinds[r.kind as usize].heap.span(r.span).len;
            self.record(r.kind as usize, r.span, len, o);
        }
    }

    /// Returns a live or pending span to its heap's free space. `live` also ends its life as
    /// an allocation (`requested` bytes asked for), for a span that was not pending.
    #[inline]
    fn release_span(&mut self, kind: usize, id: SpanId, live: Option<u64>, shared: &SharedGauges) {
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
        self.gauges.apply(pool_index(kind), &d, shared);
    }

    /// Frees the live block at `ptr`. Blocks used by other streams become pending: an event is
    /// recorded on each of those streams and the block returns to the heap once all complete.
    pub fn free<D: Driver + ?Sized>(
        &mut self,
        ptr: u64,
        own_stream: StreamId,
        dev: usize,
        driver: &D,
        events: &crate::pool::EventCache,
        shared: &SharedGauges,
    ) -> FreeOutcome {
        let Some(r) = self.live.remove(&ptr) else {
            return FreeOutcome::Unknown;
        };
        let kind = r.kind as usize;
        let (len, requested) = {
            let s = self.kinds[kind].heap.span(r.span);
            (s.len, s.requested)
        };
        let slot = self.kinds[kind].heap.meta(r.span).slot;
        if slot != 0 {
            self.ledger.remove(slot - 1, len);
        }
        if let Some(streams) = self.uses.remove(&ptr) {
            let mut evs = Vec::with_capacity(streams.len());
            let mut ok = true;
            for s in streams.into_iter().filter(|s| *s != own_stream) {
                match events.get(driver, dev) {
                    Ok(ev) => {
                        if driver.event_record(dev, ev, s).is_ok() {
                            evs.push(ev);
                        } else {
                            events.put(ev);
                            ok = false;
                        }
                    }
                    Err(_) => ok = false,
                }
            }
            // An event could not be recorded (a destroyed stream, a driver fault): wait for
            // the whole device instead, so the block is still never reused too early. If even
            // that fails, the block stays pending until a device synchronisation succeeds.
            let needs_device_sync = !ok && driver.device_synchronize(dev).is_err();
            if !evs.is_empty() || needs_device_sync {
                let d = [-1, -(len as i64), 0, 0, 0, 0, -(requested as i64)];
                self.gauges.apply(pool_index(kind), &d, shared);
                self.kinds[kind].heap.set_pending(r.span);
                self.pending.push(Pending {
                    kind,
                    span: r.span,
                    events: evs,
                    needs_device_sync,
                });
                return FreeOutcome::Pending;
            }
        }
        self.release_span(kind, r.span, Some(requested), shared);
        FreeOutcome::Freed
    }

    /// Frees pending blocks whose events have all completed. With `wait`, blocks on the events
    /// first (the OOM protocol). Returns how many blocks were freed.
    pub fn process_pending<D: Driver + ?Sized>(
        &mut self,
        wait: bool,
        dev: usize,
        driver: &D,
        events: &crate::pool::EventCache,
        shared: &SharedGauges,
    ) -> usize {
        let mut freed = 0;
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].needs_device_sync {
                // Only a blocking wait may synchronise the device (never the hot path).
                if !wait || driver.device_synchronize(dev).is_err() {
                    i += 1;
                    continue;
                }
                self.pending[i].needs_device_sync = false;
            }
            let done = self.pending[i].events.iter().all(|&ev| {
                if wait {
                    driver.event_synchronize(dev, ev).is_ok()
                } else {
                    // A failed query is treated as "not yet": the block stays pending rather
                    // than risk reuse while another stream writes it.
                    driver.event_query(dev, ev).unwrap_or(false)
                }
            });
            if done {
                let p = self.pending.swap_remove(i);
                for ev in p.events {
                    events.put(ev);
                }
                self.release_span(p.kind, p.span, None, shared);
                freed += 1;
            } else {
                i += 1;
            }
        }
        freed
    }

    /// Retries the device synchronisation that blocks pending frees whose uses no event could
    /// capture (slow paths only: it blocks the host). Returns whether none is left waiting.
    pub fn retry_device_sync<D: Driver + ?Sized>(&mut self, dev: usize, driver: &D) -> bool {
        if !self.pending.iter().any(|p| p.needs_device_sync) {
            return true;
        }
        if driver.device_synchronize(dev).is_err() {
            return false;
        }
        for p in &mut self.pending {
            p.needs_device_sync = false;
        }
        true
    }

    /// Turns `[lo, hi)` inside free span `id` of heap `kind` into a hole, keeping the gauges.
    pub fn carve(&mut self, kind: usize, id: SpanId, lo: u64, hi: u64, shared: &SharedGauges) {
        let before = self.free_totals(kind);
        self.kinds[kind].heap.carve_hole(id, lo, hi);
        self.note_free_change(kind, before, shared);
    }

    /// Turns `[lo, hi)` inside hole `id` of heap `kind` into free space, keeping the gauges.
    pub fn fill(&mut self, kind: usize, id: SpanId, lo: u64, hi: u64, shared: &SharedGauges) {
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
            let s = self.kinds[r.kind as usize].heap.span(r.span);
            (addr >= s.start && addr < s.end()).then_some(ptr)
        })
    }

    /// Bytes of the largest free span in either heap (for OOM reports).
    pub fn largest_free(&self) -> u64 {
        let mut best = 0;
        for kh in &self.kinds {
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

    /// Checks this arena's consistency: heaps, page tables, live map and gauges. `granularity`
    /// is the page size. Returns the number of mapped pages (for the device-wide check).
    pub fn check(&self, granularity: u64) -> Result<u64, String> {
        let mut mapped = 0u64;
        let mut live_count = [0i64; 2];
        let mut live_bytes = [0i64; 2];
        let mut requested = [0i64; 2];
        let mut pending = [0i64; 2];
        let mut pending_bytes = [0i64; 2];
        for (k, kh) in self.kinds.iter().enumerate() {
            let segs: Vec<_> = kh
                .segments
                .iter()
                .flatten()
                .map(|s| (s.first, s.base, s.len))
                .collect();
            kh.heap.check(&segs).map_err(|e| format!("heap {k}: {e}"))?;
            for seg in kh.segments.iter().flatten() {
                for (id, s) in kh.heap.segment_spans(seg.first) {
                    match s.state {
                        SpanState::Live => {
                            live_count[k] += 1;
                            live_bytes[k] += s.len as i64;
                            requested[k] += s.requested as i64;
                            match self.live.get(&s.start) {
                                Some(r) if r.span == id && r.kind as usize == k => {}
                                _ => {
                                    return Err(format!(
                                        "live span {id} at {:#x} not in the live map",
                                        s.start
                                    ))
                                }
                            }
                        }
                        SpanState::Pending => {
                            pending[k] += 1;
                            pending_bytes[k] += s.len as i64;
                            if !self.pending.iter().any(|p| p.span == id && p.kind == k) {
                                return Err(format!(
                                    "pending span {id} is not in the pending list"
                                ));
                            }
                        }
                        _ => {}
                    }
                }
                if let Backing::Vmm { pages } = &seg.backing {
                    // A page must be mapped iff some non-hole span overlaps it.
                    let mut need = vec![false; pages.len()];
                    for (_, s) in kh.heap.segment_spans(seg.first) {
                        if s.state != SpanState::Hole {
                            let lo = (s.start - seg.base) / granularity;
                            let hi = (s.end() - seg.base).div_ceil(granularity);
                            for n in &mut need[lo as usize..hi as usize] {
                                *n = true;
                            }
                        } else if s.start % granularity != 0 || s.len % granularity != 0 {
                            return Err(format!("hole at {:#x} is not page-aligned", s.start));
                        }
                    }
                    for (i, (p, n)) in pages.iter().zip(&need).enumerate() {
                        if p.is_some() != *n {
                            return Err(format!(
                                "page {i} of segment {:#x}: mapped={} but needed={}",
                                seg.base,
                                p.is_some(),
                                n
                            ));
                        }
                    }
                    mapped += pages.iter().filter(|p| p.is_some()).count() as u64;
                }
            }
        }
        if self.live.len() as i64 != live_count[0] + live_count[1] {
            return Err(format!(
                "live map has {} entries, heaps {} live spans",
                self.live.len(),
                live_count[0] + live_count[1]
            ));
        }
        let g = &self.gauges;
        for k in 0..2 {
            let p = pool_index(k);
            let h = &self.kinds[k].heap;
            let expect = [
                (Gauge::Allocation, live_count[k]),
                (Gauge::AllocatedBytes, live_bytes[k]),
                (Gauge::Active, live_count[k] + pending[k]),
                (Gauge::ActiveBytes, live_bytes[k] + pending_bytes[k]),
                (Gauge::InactiveSplit, h.free_count() as i64),
                (Gauge::InactiveSplitBytes, h.free_bytes() as i64),
                (Gauge::RequestedBytes, requested[k]),
            ];
            for (gauge, v) in expect {
                if g.cur[gauge as usize][p] != v {
                    return Err(format!(
                        "gauge {:?} of heap {k} is {}, blocks say {v}",
                        gauge, g.cur[gauge as usize][p]
                    ));
                }
            }
        }
        for gi in 0..crate::stats::GAUGES {
            if g.cur[gi][0] != g.cur[gi][1] + g.cur[gi][2] {
                return Err(format!("gauge {gi}: all != small + large"));
            }
        }
        Ok(mapped)
    }
}
