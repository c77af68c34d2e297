//! Chunks in and out of an extent's page table: mapping gathered chunks into a window (one
//! `cuMemSetAccess` per run), releasing a chunk to the driver (or keeping it as lost), and
//! stealing whole free chunks out of an arena for a [`Taker`] (a window's `Placement` when
//! stitching, a [`Budget`] when releasing), once the arena's stream is idle. See Note [Chunks]
//! in `vmm.rs`.

use std::sync::atomic::Ordering::Relaxed;

use super::device::{DeviceState, Lost, Stuck};
use super::window::{free_page_runs, whole_mappings, Exclude};
use super::{DevicePool, PoolEventKind};
use crate::arena::{ArenaState, Backing, Chunk, HeapKind, Page};
use crate::driver::{Driver, StreamId};
use crate::heap::SpanState;

/// Who takes the chunks that [`DevicePool::steal_pages`] unmaps.
pub(super) trait Taker {
    /// Whether a chunk of `pages` granules is wanted now.
    fn wants(&self, pages: u32) -> bool;
    /// Takes a chunk that was wanted.
    fn take(&mut self, c: Chunk);
    /// Whether nothing more is wanted.
    fn full(&self) -> bool;
}

/// Takes chunks up to a budget of pages (for releasing cached memory).
pub(super) struct Budget {
    /// Pages still wanted.
    pub left: usize,
    /// The chunks taken.
    pub taken: Vec<Chunk>,
}

impl Taker for Budget {
    /// Any chunk while pages are still wanted: the last one may overshoot the budget (a chunk
    /// is released whole), so that a lowered limit or a release threshold is always met.
    fn wants(&self, _pages: u32) -> bool {
        self.left > 0
    }
    fn take(&mut self, c: Chunk) {
        self.left = self.left.saturating_sub(c.pages as usize);
        self.taken.push(c);
    }
    fn full(&self) -> bool {
        self.left == 0
    }
}

impl<D: Driver> DevicePool<D> {
    /// Maps each placed chunk at its address and turns those pages into free space. Access is
    /// granted once per run of consecutive chunks (one `cuMemSetAccess` per mapped range, not
    /// per chunk: it costs ~36 µs a call). On a driver failure the failing chunk is released,
    /// the run being mapped keeps the chunks mapped before the failure when access can be
    /// granted to them (else they are unmapped and released), the chunks of earlier runs are
    /// kept, and the rest are released.
    pub(super) fn map_pages(
        &self,
        dev: &mut DeviceState,
        a: &mut ArenaState,
        graph_pool: Option<(u64, u64)>,
        kind: HeapKind,
        seg_idx: u32,
        mut placed: Vec<(u64, Chunk)>,
    ) -> crate::driver::DriverResult<()> {
        let c = &*self.core;
        let g = c.granularity;
        let d = &*c.driver;
        let base = a.kinds[kind].segment(seg_idx).base;
        placed.sort_unstable_by_key(|&(addr, _)| addr);
        let mut mapped: Vec<(u64, u64)> = Vec::with_capacity(placed.len());
        let mut result = Ok(());
        let mut rest = placed.into_iter().peekable();
        // Chunks of the current run mapped so far, without access yet.
        let mut run: Vec<(u64, Chunk)> = Vec::new();
        while let Some((addr, ch)) = rest.next() {
            let len = ch.pages as u64 * g;
            let mapped_ok = match d.map(c.dev, addr, len, ch.handle) {
                Ok(()) => {
                    run.push((addr, ch));
                    true
                }
                Err(e) => {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    self.release_handle(dev, kind, ch);
                    result = Err(e);
                    false
                }
            };
            let run_ends = !mapped_ok || rest.peek().is_none_or(|&(next, _)| next != addr + len);
            if !run_ends || run.is_empty() {
                if !mapped_ok {
                    break;
                }
                continue;
            }
            let lo = run[0].0;
            let hi = run.last().map_or(lo, |&(a, ch)| a + ch.pages as u64 * g);
            match d.set_access(c.dev, lo, hi - lo, &dev.peers) {
                Ok(()) => {
                    c.observer
                        .emit(PoolEventKind::SegmentMap, c.dev, lo, hi - lo, graph_pool);
                    dev.add_private_reserved(graph_pool, kind, (hi - lo) as i64);
                    if let Some(seg) = a.kinds[kind].segments[seg_idx as usize].as_mut() {
                        if let Backing::Vmm { pages } = &mut seg.backing {
                            for &(at, ch) in &run {
                                let first = ((at - base) / g) as usize;
                                for i in 0..ch.pages {
                                    pages[first + i as usize] = Some(Page {
                                        handle: ch.handle,
                                        index: i,
                                        len: ch.pages,
                                    });
                                }
                            }
                        }
                    }
                    mapped.push((lo, hi));
                    run.clear();
                }
                Err(e) => {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    for (at, ch) in run.drain(..) {
                        if d.unmap(c.dev, at, ch.pages as u64 * g).is_ok() {
                            self.release_handle(dev, kind, ch);
                        } else {
                            // Still mapped: releasing it now would fail and lose the mapping.
                            dev.stuck.push(Stuck {
                                kind,
                                chunk: ch,
                                addr: at,
                            });
                        }
                    }
                    if result.is_ok() {
                        result = Err(e);
                    }
                    break;
                }
            }
            if !mapped_ok {
                break;
            }
        }
        // Chunks we could not map (after a failure) are released, not leaked.
        for (_, ch) in rest {
            self.release_handle(dev, kind, ch);
        }
        // Fill the holes range by range.
        for (lo, hi) in mapped {
            let first = a.kinds[kind].segment(seg_idx).first;
            let hole = a.kinds[kind]
                .heap
                .segment_spans(first)
                .find(|(_, s)| s.state == SpanState::Hole && s.start <= lo && hi <= s.end())
                .map(|(id, _)| id);
            if let Some(id) = hole {
                a.fill(kind, id, lo, hi, &c.shared);
            }
        }
        result
    }

    /// Gives chunk `ch` (counted in heap `kind`) back to the driver; a failed release keeps it,
    /// still reserved, in the lost list for growth to map again and `empty_cache` to retry.
    pub(super) fn release_handle(&self, dev: &mut DeviceState, kind: HeapKind, ch: Chunk) {
        let c = &*self.core;
        match c.share.release_chunk(c, ch.handle) {
            Ok(()) => {
                c.counters.num_device_free.fetch_add(1, Relaxed);
                dev.add_reserved(kind, -(ch.pages as i64 * c.granularity as i64));
                dev.add_segments(kind, -1);
            }
            Err(_) => {
                // The handle is lost to us; it stays counted as reserved so the numbers keep
                // matching the driver's (and the invariant checker knows why).
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                dev.lost.push(Lost { kind, chunk: ch });
            }
        }
    }

    /// Takes whole free chunks out of arena `a` (whose stream is `stream`) for `taker`, skipping
    /// `exclude`, while the taker wants them. The stream's work must be finished first: with
    /// `wait` it blocks on it, without it takes nothing when an event query says the stream is
    /// still busy. The chunks are unmapped; their address ranges become holes. Only heaps in
    /// `from` give chunks; `to_kind` is the heap the chunks are for (for per-pool reserved
    /// accounting). Returns the pages taken.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn steal_pages(
        &self,
        a: &mut ArenaState,
        stream: Option<StreamId>,
        exclude: Option<Exclude>,
        dev: &mut DeviceState,
        to_kind: HeapKind,
        wait: bool,
        taker: &mut dyn Taker,
        from: &[HeapKind],
    ) -> usize {
        let c = &*self.core;
        let g = c.granularity;
        let mut taken = 0usize;
        let mut synced = false;
        for &kind in from {
            if taker.full() {
                break;
            }
            for run in free_page_runs(a, kind, exclude, g, usize::MAX) {
                if taker.full() {
                    break;
                }
                // The free span holding the rest of the run (after each carve, the span right
                // of the new hole).
                let mut hint = Some(run.span);
                for (addr, p) in whole_mappings(a, kind, &run, g) {
                    if taker.full() {
                        break;
                    }
                    if !taker.wants(p.len) {
                        continue;
                    }
                    if !synced {
                        // Unmapping needs the stream's work on these pages finished.
                        let ready = c.stream_idle(stream) || (wait && c.sync_stream(stream));
                        if !ready {
                            return taken;
                        }
                        synced = true;
                    }
                    let len = p.len as u64 * g;
                    let Some(hole) = self.carve_free(a, kind, run.seg, hint, addr, addr + len)
                    else {
                        continue;
                    };
                    hint = match a.kinds[kind].heap.span(hole).next {
                        crate::heap::NIL => None,
                        n => Some(n),
                    };
                    // Told before the unmap (see `PoolEventKind::SegmentUnmap`): an observer
                    // still finds the range mapped.
                    c.observer
                        .emit(PoolEventKind::SegmentUnmap, c.dev, addr, len, a.graph_pool);
                    if c.driver.unmap(c.dev, addr, len).is_err() {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        // Put the carved range back as free space; it is still mapped.
                        self.refill(a, kind, run.seg, addr, addr + len);
                        c.observer
                            .emit(PoolEventKind::SegmentMap, c.dev, addr, len, a.graph_pool);
                        return taken;
                    }
                    // A released graph pool's memory counts as its own until it leaves.
                    dev.add_private_reserved(a.graph_pool, kind, -(len as i64));
                    let base = a.kinds[kind].segment(run.seg).base;
                    if let Some(crate::arena::Segment {
                        backing: Backing::Vmm { pages },
                        ..
                    }) = a.kinds[kind].segments[run.seg as usize].as_mut()
                    {
                        let first = ((addr - base) / g) as usize;
                        for e in &mut pages[first..first + p.len as usize] {
                            *e = None;
                        }
                    }
                    if kind != to_kind {
                        dev.add_reserved(kind, -(len as i64));
                        dev.add_segments(kind, -1);
                        dev.add_reserved(to_kind, len as i64);
                        dev.add_segments(to_kind, 1);
                    }
                    taker.take(p.chunk());
                    taken += p.len as usize;
                }
            }
        }
        taken
    }

    /// Turns `[lo, hi)`, inside a free span of heap `kind`'s segment `seg_idx`, into a hole:
    /// the span `hint` when it holds the range, else found by a scan of the segment. Returns
    /// the hole's span, or `None` when no free span holds the range.
    fn carve_free(
        &self,
        a: &mut ArenaState,
        kind: HeapKind,
        seg_idx: u32,
        hint: Option<crate::heap::SpanId>,
        lo: u64,
        hi: u64,
    ) -> Option<crate::heap::SpanId> {
        let holds = |s: &crate::heap::Span| {
            s.state == SpanState::Free && s.seg == seg_idx && s.start <= lo && hi <= s.end()
        };
        let heap = &a.kinds[kind].heap;
        let id = match hint.filter(|&h| holds(heap.span(h))) {
            Some(h) => h,
            None => {
                let first = a.kinds[kind].segment(seg_idx).first;
                heap.segment_spans(first).find(|(_, s)| holds(s))?.0
            }
        };
        Some(a.carve(kind, id, lo, hi, &self.core.shared))
    }

    /// Turns the (still mapped) range `[lo, hi)`, which was carved into a hole, back into free
    /// space.
    pub(super) fn refill(
        &self,
        a: &mut ArenaState,
        kind: HeapKind,
        seg_idx: u32,
        lo: u64,
        hi: u64,
    ) {
        let first = a.kinds[kind].segment(seg_idx).first;
        let hole = a.kinds[kind]
            .heap
            .segment_spans(first)
            .find(|(_, s)| s.state == SpanState::Hole && s.start <= lo && hi <= s.end())
            .map(|(id, _)| id);
        if let Some(id) = hole {
            a.fill(kind, id, lo, hi, &self.core.shared);
        }
    }
}
