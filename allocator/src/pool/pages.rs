//! Chunks in and out of an extent's page table: mapping gathered chunks into a window (one
//! `cuMemSetAccess` per run), releasing a chunk to the driver (or keeping it as lost), and
//! stealing whole free chunks out of an arena for a [`Taker`] (a window's `Placement` when
//! stitching, a [`Budget`] when releasing), once the arena's stream is idle or with the order
//! kept on the device, and the old mappings such moves leave until their donor is done. See
//! Note [Chunks] in `vmm.rs`.
//!
//! # Note [Moves ordered on the device]
//!
//! A cached chunk may be unmapped only once the work queued before its block was freed has
//! finished; that work is on the arena's own stream (uses on other streams were waited for
//! before the block became free). Asking costs an event record and a query. When the stream is
//! still busy, `stream_sync:pressure` leaves the chunk (growth creates instead, and waits on
//! the host only under memory pressure) and `always` waits. `stream_sync:device` (the default)
//! does neither:
//!
//! 1. the event recorded on the donor's stream is kept, and the taking stream is made to wait
//!    for it on the GPU (`cuStreamWaitEvent`; on the donor's own stream FIFO order does it);
//! 2. the chunk is carved out of the donor's heap (its range becomes a hole and leaves the
//!    page table) but *not unmapped*: it is mapped at its new address too (CUDA allows one
//!    handle at several addresses), so the donor's queued work still reaches it where it was;
//! 3. the old range, with the event, goes to the device's deferred list ([`Deferred`]); no
//!    window is chosen over it (`DeviceState::still_mapped`, `window::choose_window`), and
//!    each growth first unmaps the old ranges whose event a query finds complete
//!    ([`DevicePool::finish_deferred`]; a query per outstanding steal, never a wait).
//!
//! So a move costs a map and an access grant now and an unmap later, as before, plus an event
//! record and a stream wait (~1 µs), and never blocks the host. A chunk still mapped at an old
//! address is not released (CUDA would free it only at that unmap, uncounted meanwhile):
//! releasing leaves it (`Taker` without `Dest`), a failed mapping parks it with the lost chunks
//! for growth to map again (after a stream wait on its donor's event, like the move itself),
//! and `empty_cache`, a lowered limit and the pool's end wait for the donors and unmap
//! first. An arena's address range is freed only once no old mapping is left in it. Where the
//! GPU cannot keep the order (a graph capture may be underway, or the stream cannot be named
//! from this thread) the move falls back to `pressure`'s rule.
//!
//! Two departures from DESIGN.md ("pages of another stream are taken only when their free
//! events already test complete, or under pressure"; old mappings unmapped "off the allocation
//! path"): a busy stream's chunks are taken this way also while memory lasts, because leaving
//! them cost memory wherever the GPU runs behind (below) and a move ordered on the device
//! costs what an idle one does plus ~1 µs; and the old mappings are unmapped at the start of a
//! later growth, the slow path, after a query that never blocks, not on a thread of the pool's
//! own (it has none: one would need the device's context and a place in the lock order).
//!
//! The simulator checks it: work launched before the move is hazard-free when the chunk is
//! handed out on the other stream only because of the stream wait, and its unmap hazard is per
//! address (`driver/sim/work.rs`), so unmapping the old range while the new one is in use is
//! not one.
//!
//! Measured (`python3 scripts/cost-table.py --gpu-lag 2`: the replay's GPU two kernels behind
//! the host on each stream, over the dev snapshots and every built-in workload; `pressure`
//! against `device`): peak reserved at most 1.39x `pytorch-expandable`'s -> 1.014x (`packed-A`
//! 150 -> 84 MiB, Mooncake 57.1 -> 49.0 GiB), the median modelled driver time 1.26x -> 1.17x
//! expandable's, 0 host waits either way; with `--pressure 1.25` as well, host waits 4 -> 0.
//! With no lag nothing is ever busy and both modes give the same numbers.
//!
//! # Note [No bounce]
//!
//! Stitching takes whole free chunks wherever they are cached, from either heap of any arena.
//! A program whose small and large requests take turns over the same few pages then moves
//! them back and forth for ever: a small block's granules are freed and stitched into a large
//! window, the large block is freed, the next small request finds its heap without pages and
//! takes the same granules back, and so on. Each move costs an unmap, a map and an access
//! grant (≈64 µs at the published A100 prices) on every turn, where one new handle (≈233 µs)
//! would have ended it. So while memory is plentiful (growth under `grow_whole_chunks:auto`,
//! not under pressure: `sizing.rs`), stitching leaves a chunk that one of the device's last
//! [`BOUNCE_WINDOW`] moves took out of the very arena and heap it would now go back to; growth
//! then creates for the rest, once, and both sides keep their pages. Under pressure nothing is
//! left: memory first; and when creation then falls short (the device had less room than it
//! seemed), the left chunks are taken after all, still without a host wait.
//!
//! The rule acts where growth knows whether memory is plentiful: a large-heap window that its
//! cached chunks do not cover, or cover only with several (`check_feasible` reads the room
//! then). The small heap's one-granule growth, and a window one cached chunk covers, move
//! without reading it (a `cuMemGetInfo` costs ~10 µs; judging by the last reading instead
//! left one-off moves and made the `forward_bf16` snapshot 1.70x -> 1.82x), so there a single
//! chunk may still go back and forth; the turn is broken on the large heap's side, as in the
//! small and large programs above.
//!
//! Measured (`python3 scripts/cost-table.py`, and `cistern replay` with the smallest device
//! over the dev snapshots, every built-in workload and the minimalloc instances): the
//! `gpt-medium_infer_ctx128` snapshot 1.42x -> 1.14x `pytorch-expandable`'s modelled driver
//! time and its steady-state calls 414 -> 0, `llm-serving` 0.92x -> 0.89x (steady 161 -> 0),
//! Mooncake 0.27x -> 0.17x (steady 15 -> 0), the `forward_bf16` snapshot 1.73x -> 1.70x, the
//! median over all traces 1.31x -> 1.17x; slower only on four static-lifetime instances
//! (`packed-K` 2.37x -> 2.41x, minimalloc C, E and K by up to 0.1x); peak reserved at most
//! 1.014x expandable's, as before; the smallest device unchanged on every trace but
//! Mooncake's (1.012x -> 1.015x its peak live bytes). A window of 16 moves instead of 4 gave
//! `llm-serving` 0.85x but Mooncake 0.24x; of 64, Mooncake 0.40x; leaving every recently moved
//! chunk (not only those going straight back) gave Mooncake 0.41x and `packed-J` 2.45x ->
//! 2.67x; leaving cross-heap moves altogether needed a 2% larger device on `llm-serving`; and
//! leaving bounces at any capacity not under pressure, 0.6% more there.

use std::sync::atomic::Ordering::Relaxed;

use super::device::{DeviceState, Lost, Stuck};
use super::window::{free_page_runs, whole_mappings, Exclude};
use super::{DevicePool, PoolEventKind};
use crate::arena::{ArenaState, Backing, Chunk, HeapKind, Page, StreamMark};
use crate::driver::{Driver, EventId, PhysHandle, StreamId};
use crate::heap::SpanState;

/// How many of the device's last chunk moves [`RecentMoves`] remembers (Note [No bounce]).
pub(super) const BOUNCE_WINDOW: usize = 4;

/// Where a chunk is cached or goes: an arena (its state's address, which stays put while the
/// arena lives) and one of its heaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Home {
    arena: usize,
    kind: HeapKind,
}

impl Home {
    pub(super) fn of(a: &ArenaState, kind: HeapKind) -> Self {
        Home {
            arena: std::ptr::from_ref(a) as usize,
            kind,
        }
    }
}

/// One chunk move: the handle, where it was cached, and where it went.
#[derive(Clone, Copy, Debug)]
struct Move {
    handle: PhysHandle,
    from: Home,
    to: Home,
}

/// The device's last [`BOUNCE_WINDOW`] chunk moves (stitching), oldest overwritten first, and
/// whether a small heap has had to buy pages again after a large window took some of its own
/// (Note [Small pages stay small] in `sizing.rs`).
#[derive(Debug, Default)]
pub(super) struct RecentMoves {
    ring: [Option<Move>; BOUNCE_WINDOW],
    next: usize,
    /// A large window has taken a small heap's page.
    small_taken: bool,
    /// ... and a small heap created a page since.
    small_churn: bool,
}

impl RecentMoves {
    pub(super) fn record(&mut self, handle: PhysHandle, from: Home, to: Home) {
        self.ring[self.next] = Some(Move { handle, from, to });
        self.next = (self.next + 1) % BOUNCE_WINDOW;
        self.small_taken |= from.kind == HeapKind::Small && to.kind == HeapKind::Large;
    }

    /// A small heap created pages: churn, if a large window took a small heap's before.
    pub(super) fn small_grew(&mut self) {
        self.small_churn |= self.small_taken;
    }

    /// Whether small heaps have bought pages again after large windows took theirs: from then
    /// on, while memory is plentiful, large windows leave the small heaps' pages alone.
    pub(super) fn small_churn(&self) -> bool {
        self.small_churn
    }

    /// Forgets `handle`'s moves: it was released (the driver may issue its value again).
    pub(super) fn forget(&mut self, handle: PhysHandle) {
        for m in &mut self.ring {
            if m.is_some_and(|m| m.handle == handle) {
                *m = None;
            }
        }
    }

    /// Whether moving `handle` from `from` to another arena or heap `to` takes it straight
    /// back: one of the last moves took it from `to` to `from`. (Moves within one heap, which
    /// gather its free chunks into a window, are never bounces.)
    pub(super) fn bounce(&self, handle: PhysHandle, from: Home, to: Home) -> bool {
        from != to
            && self
                .ring
                .iter()
                .flatten()
                .any(|m| m.handle == handle && m.from == to && m.to == from)
    }
}

/// A chunk's old mapping, left in place by a move ordered on the device (Note [Moves ordered
/// on the device]): the chunk is mapped at its new address too, and this range is unmapped
/// once the donor's work is done. The range is a hole of the donor's heap that growth never
/// chooses for a window until then.
#[derive(Debug, Clone, Copy)]
pub(super) struct Alias {
    pub addr: u64,
    pub len: u64,
    pub handle: PhysHandle,
}

/// The old mappings of one steal from a busy stream, with the event recorded there after the
/// work that may still use them.
#[derive(Debug)]
pub(super) struct Deferred {
    pub event: EventId,
    pub aliases: Vec<Alias>,
}

/// Where [`DevicePool::steal_pages`] moves chunks when stitching.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dest {
    /// The arena and heap of the window.
    pub home: Home,
    /// Leave the chunks that would go straight back where they came from (Note [No bounce]).
    pub settle: bool,
    /// The window's stream, when a busy donor's chunks may move with the order kept on the
    /// device (`stream_sync:device`, Note [Moves ordered on the device]); `None`: only an
    /// idle donor's chunks move (or, with `wait`, after a host wait).
    pub order: Option<StreamId>,
}

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
        if dev.aliased(ch.handle) {
            // Still mapped at the address it moved from (Note [Moves ordered on the device]):
            // CUDA would free the memory only at that mapping's unmap, so it would stay
            // committed without being counted anywhere (the simulator refuses the release
            // outright). Good memory: growth maps it again (ordered after its donor), and
            // `empty_cache` releases it once the old mapping is gone.
            dev.lost.push(Lost { kind, chunk: ch });
            return;
        }
        dev.moves.forget(ch.handle);
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
    /// `exclude`, while the taker wants them. The stream's work on the chunks must be finished
    /// before they are unmapped: an event query says whether it is; when it is not, with
    /// `dest.order` the chunks move anyway, ordered on the device (Note [Moves ordered on the
    /// device]), else with `wait` the host blocks on the stream, else nothing is taken. The
    /// chunks' address ranges become holes. Only heaps in `from` give chunks; `to_kind` is the
    /// heap the chunks are for (for per-pool reserved accounting). With `dest` (stitching), the
    /// moves are recorded in the device's [`RecentMoves`], and with `dest.settle` a chunk that
    /// would go straight back is left. Without `dest` (releasing), a chunk still mapped at an
    /// old address is left: it cannot be released yet. Returns the pages taken.
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
        dest: Option<Dest>,
    ) -> usize {
        let c = &*self.core;
        let g = c.granularity;
        let mut taken = 0usize;
        let mut synced = false;
        // The old mappings left in place by moves ordered on the device.
        let mut deferred: Option<Deferred> = None;
        'kinds: for &kind in from {
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
                    let here = Home::of(a, kind);
                    match dest {
                        Some(d) if d.settle && dev.moves.bounce(p.handle, here, d.home) => continue,
                        None if dev.aliased(p.handle) => continue,
                        _ => {}
                    }
                    if !synced {
                        // Unmapping needs the stream's work on these pages finished, or (moves
                        // ordered on the device) the unmap deferred until it is.
                        let ready = match dest.and_then(|d| d.order) {
                            Some(to) => match c.stream_mark(stream) {
                                StreamMark::Idle => true,
                                StreamMark::Busy(ev) => {
                                    // The taking stream's later work waits for the donor's on
                                    // the GPU; on the donor's own stream FIFO order does it.
                                    if stream == Some(to) || self.order_after(to, ev) {
                                        deferred = Some(Deferred {
                                            event: ev,
                                            aliases: Vec::new(),
                                        });
                                        true
                                    } else {
                                        c.events.put(ev);
                                        wait && c.sync_stream(stream)
                                    }
                                }
                                StreamMark::Unknown => wait && c.sync_stream(stream),
                            },
                            None => c.stream_idle(stream) || (wait && c.sync_stream(stream)),
                        };
                        if !ready {
                            break 'kinds;
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
                    // still finds the range mapped. (A deferred unmap is told now too: the
                    // range leaves the pool's memory here.)
                    c.observer
                        .emit(PoolEventKind::SegmentUnmap, c.dev, addr, len, a.graph_pool);
                    if let Some(d) = deferred.as_mut() {
                        d.aliases.push(Alias {
                            addr,
                            len,
                            handle: p.handle,
                        });
                    } else if c.driver.unmap(c.dev, addr, len).is_err() {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        // Put the carved range back as free space; it is still mapped.
                        self.refill(a, kind, run.seg, addr, addr + len);
                        c.observer
                            .emit(PoolEventKind::SegmentMap, c.dev, addr, len, a.graph_pool);
                        break 'kinds;
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
                    if let Some(d) = dest {
                        dev.moves.record(p.handle, here, d.home);
                    }
                    taker.take(p.chunk());
                    taken += p.len as usize;
                }
            }
        }
        if let Some(d) = deferred {
            if d.aliases.is_empty() {
                c.events.put(d.event);
            } else {
                c.counters
                    .num_ordered_moves
                    .fetch_add(d.aliases.len() as u64, Relaxed);
                dev.deferred.push(d);
            }
        }
        taken
    }

    /// Makes `stream`'s later work wait, on the device, for event `ev` (`cuStreamWaitEvent`).
    /// Returns whether it does.
    pub(super) fn order_after(&self, stream: StreamId, ev: EventId) -> bool {
        let c = &*self.core;
        // A stream capturing a graph cistern was not told of (no window open): waiting there on
        // an event recorded outside the capture would fail and invalidate it.
        // (An error counts as capturing: the move falls back, which is always safe.)
        if c.driver.stream_capturing(c.dev, stream) != Ok(false) {
            return false;
        }
        let ok = c.driver.stream_wait_event(c.dev, stream, ev).is_ok();
        if !ok {
            c.counters.num_driver_errors.fetch_add(1, Relaxed);
        }
        ok
    }

    /// Unmaps the old mappings of moves ordered on the device whose donor work is done (an
    /// event query each; with `wait`, blocking on the events: for `empty_cache` and the pool's
    /// end, never the allocation path). An unmap that fails is tried again next time.
    pub(super) fn finish_deferred(&self, dev: &mut DeviceState, wait: bool) {
        let c = &*self.core;
        if dev.deferred.is_empty() || c.capturing() {
            // No query, wait or unmap while a graph may be capturing.
            return;
        }
        let d = &*c.driver;
        let mut keep = Vec::new();
        for mut group in std::mem::take(&mut dev.deferred) {
            let done = if wait {
                d.event_synchronize(c.dev, group.event).is_ok() || c.sync_device(c.dev)
            } else {
                d.event_query(c.dev, group.event) == Ok(true)
            };
            if !done {
                keep.push(group);
                continue;
            }
            group.aliases.retain(|al| {
                if d.unmap(c.dev, al.addr, al.len).is_ok() {
                    c.counters.num_deferred_unmaps.fetch_add(1, Relaxed);
                    false
                } else {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    true
                }
            });
            if group.aliases.is_empty() {
                c.events.put(group.event);
            } else {
                keep.push(group);
            }
        }
        dev.deferred = keep;
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

#[cfg(test)]
mod tests {
    use super::*;

    const fn home(arena: usize, kind: HeapKind) -> Home {
        Home { arena, kind }
    }

    /// A move back to where one of the last [`BOUNCE_WINDOW`] moves took a chunk from is a
    /// bounce; another handle, another destination, a move within one heap, or a move older
    /// than the window is not.
    #[test]
    fn bounces_are_straight_back_within_the_window() {
        let (small, large) = (home(1, HeapKind::Small), home(1, HeapKind::Large));
        let other = home(2, HeapKind::Small);
        let (h, k) = (PhysHandle(7), PhysHandle(8));
        let mut m = RecentMoves::default();
        assert!(!m.bounce(h, large, small));
        m.record(h, small, large);
        assert!(m.bounce(h, large, small));
        assert!(!m.bounce(k, large, small), "another handle");
        assert!(!m.bounce(h, large, other), "another arena");
        assert!(!m.bounce(h, large, large), "within one heap");
        // A move within the large heap: still the same way back.
        m.record(h, large, large);
        assert!(!m.bounce(h, large, large));
        assert!(m.bounce(h, large, small));
        // A released handle is forgotten (the driver may issue its value again).
        m.forget(h);
        assert!(!m.bounce(h, large, small));
        m.record(h, small, large);
        // Older than the window: forgotten.
        for i in 0..BOUNCE_WINDOW as u64 {
            m.record(PhysHandle(100 + i), other, large);
        }
        assert!(!m.bounce(h, large, small));
    }
}
