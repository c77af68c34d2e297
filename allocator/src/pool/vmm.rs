//! VMM growth: choose a window, check that the request can succeed, gather physical pages
//! (stitch cached pages from any arena, reuse lost handles, create new ones), map them. Mapping,
//! releasing and stealing chunks are in `pages.rs`, reserving extents in `extent.rs`, the window
//! arithmetic in `window.rs` and handle sizes in `sizing.rs`.
//!
//! # Note [Chunks]
//!
//! Memory is bought in *chunks*: physical handles of one or more granules, each created,
//! mapped, unmapped and released whole (`cuMemCreate` costs ~195 µs a handle whatever its size,
//! and `cuMemUnmap` must unmap a whole mapping). Growth backs each run of a window's missing
//! pages with chunks of up to `chunk_size` (20 MiB by default, as PyTorch's expandable segments
//! use) and of at most a `chunk_split`-th of the request (a quarter by default; `none` lifts
//! it), the last one of a run smaller; the small heap uses single granules, where flexibility
//! pays most. With `grow_whole_chunks`, a window whose last run ends in unmapped space grows
//! that run past the request to whole chunks while the limit and the device have room (the
//! pages beyond the request are optional: given up, never failing the request, when room or
//! the device runs short); they join the heap as a free span like any mapped page.
//!
//! `grow_whole_chunks:auto`, the default, sizes both to what the process holds and to how
//! much room it has: see Note [Auto growth] in `sizing.rs`.
//!
//! The page table keeps, per granule, the chunk mapped there and the granule's index in it,
//! so a chunk's mapping can be found from any of its pages.
//!
//! Stitching moves chunks, not granules: a free run gives up only the chunks lying wholly
//! inside it (`window::whole_mappings`), and a chunk goes where a run of the window's missing pages
//! has room for it (first fit, [`Placement`]). So a chunk of 10 granules can fill a 10-page gap
//! of another stream, but not a 3-page one: that gap is filled with smaller chunks or new
//! granules. Releasing (`empty_cache`, the release threshold, a lowered limit) gives back whole
//! chunks, the last of which may overshoot its budget. While memory is plentiful, a chunk does
//! not go straight back to the arena and heap a recent move took it from (Note [No bounce] in
//! `pages.rs`). A chunk whose stream may still have work queued on it moves with the order
//! kept on the GPU, its old mapping unmapped later (Note [Moves ordered on the device] in
//! `pages.rs`). The feasibility check plans which cached chunks fill which run, largest first
//! or as fully as they go, and stitching takes those (Note [Stitching to a plan] in
//! `placement.rs`). A request that still runs short (a donor that could not be waited for, a
//! failed unmap, creation falling short of what the device seemed to have) keeps what it
//! stitched as cache.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::device::{DeviceState, Lost};
use super::grow::Grow;
use super::pages::{Dest, Home, Taker};
use super::placement::Placement;
use super::sizing::{
    creating_is_cheaper, plentiful, request_chunk_pages, small_pages_stay, whole_chunk_pages,
    Plenty, AUTO_SHARE, INSTEAD_SHARE,
};
use super::window::{choose_window, next_extent, vmm_extent, Exclude, EDGE_CHUNKS};
use super::DevicePool;
use crate::arena::{Arena, ArenaState, Chunk, HeapKind};
use crate::config::{StreamSync, WholeChunks};
use crate::driver::Driver;
use crate::error::{Error, Result};

/// Where a request goes in a VMM extent (the plan phase's answer).
#[derive(Debug)]
pub(super) struct Window {
    /// The heap's segment (virtual extent) index.
    pub seg: u32,
    /// The window's first address.
    pub lo: u64,
    /// One past its last address (`lo` + the rounded request).
    pub hi: u64,
    /// The window's pages that are not mapped yet, in address order.
    pub missing: Vec<u64>,
}

impl Window {
    /// The window as a range page searches leave out.
    pub(super) fn exclude(&self, kind: HeapKind) -> Exclude {
        Exclude {
            kind,
            lo: self.lo,
            hi: self.hi,
        }
    }
}

/// What the gather phase found for a window.
struct Gathered {
    /// The chunks gathered, each with the address it goes to.
    placed: Vec<(u64, Chunk)>,
    /// The window's missing pages left without a chunk (0 when the request can be met).
    short: usize,
    /// Creation stopped at the per-process limit.
    limit_hit: bool,
    /// Creation failed for a reason other than memory.
    driver_err: Option<crate::driver::DriverError>,
}

/// What the feasibility check found: the request can be met.
#[derive(Debug, Clone)]
struct Feasible {
    /// Cached pages that could serve it.
    cached: usize,
    /// The chunks (mappings) those pages are.
    cached_chunks: usize,
    /// New memory alone (the room under the limit and on the device) cannot cover it.
    pressure: bool,
    /// Pages of new memory the limit and the device leave room for beyond the request (0
    /// when cached pages alone may cover it: the device's free memory was not read).
    headroom: usize,
    /// The room beyond the request even when cached pages could cover it (then read afresh
    /// from `cuMemGetInfo`, only when several cached chunks would move): what decides whether
    /// new handles may replace stitching (Note [Cheaper than moving]).
    spare: usize,
    /// A large window leaves the small heaps' free pages out of `cached` and stitching, and
    /// buys new pages for them (Note [Small pages stay small]); taken only if creation falls
    /// short.
    small_kept: bool,
    /// The chunk sizes stitching takes per run of the window (Note [Stitching to a plan] in
    /// `placement.rs`); `None` when no cached chunk could serve it.
    plan: Option<Vec<Vec<(u32, u32)>>>,
}

impl<D: Driver> DevicePool<D> {
    /// VMM growth, in four phases: **plan** (where the request goes: [`Self::plan_window`]),
    /// **feasibility** (can it succeed at all, before anything moves:
    /// [`Self::check_feasible`]), **gather** (physical pages: stitched, lost, new:
    /// [`Self::gather_pages`]) and **map** (into the window, then take the block:
    /// [`Self::map_window`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grow_vmm(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        rounded: u64,
        size: u64,
        retried: bool,
    ) -> Result<Grow> {
        let window = self.plan_window(dev, arena, a, kind, rounded, size)?;
        let feasible = match self.check_feasible(dev, arena, a, kind, &window) {
            Ok(f) => f,
            Err(limit_hit) => {
                return self.give_up(dev, arena, a, size, rounded, limit_hit, retried);
            }
        };
        let gathered = self.gather_pages(dev, arena, a, kind, &window, feasible);
        self.map_window(dev, arena, a, kind, size, retried, window, gathered)
    }

    /// Plan: reserves the heap's first extent when it has none, unmaps pages left stuck by a
    /// failed unmap, and chooses the window that needs the fewest new pages over this heap's
    /// extents (a new extent when none has a free virtual range large enough: live blocks
    /// scattered through the address space, e.g. KV caches that grow by reallocation).
    fn plan_window(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        rounded: u64,
        size: u64,
    ) -> Result<Window> {
        let c = &*self.core;
        let g = c.granularity;
        let cap = vmm_extent(c.caps.total_memory, g, kind);
        if rounded > c.caps.total_memory {
            return Err(self.oom_locked(
                dev,
                Some(a),
                arena.stream,
                size,
                rounded,
                false,
                "the request is larger than the device",
            ));
        }
        if a.kinds[kind].vmm_segs.is_empty() {
            let extent = next_extent(cap, g, 0, rounded);
            self.reserve_for(dev, arena, a, kind, extent, rounded, size)?;
        }
        // A page left mapped by a failed unmap sits in some arena's hole: unmap it before a
        // window there tries to map over it; its handle is then reused like any lost one.
        for s in std::mem::take(&mut dev.stuck) {
            if c.driver
                .unmap(c.dev, s.addr, s.chunk.pages as u64 * g)
                .is_ok()
            {
                dev.lost.push(Lost {
                    kind: s.kind,
                    chunk: s.chunk,
                });
            } else {
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                dev.stuck.push(s);
            }
        }
        // Old mappings of moved chunks whose donors are done: their ranges become usable.
        self.finish_deferred(dev, false);
        let blocked = dev.still_mapped(g);
        // Large blocks try the free spans' edges too (Note [Windows over free spans]).
        let edges = c.config.chunk_size.saturating_mul(EDGE_CHUNKS);
        let mut choice: Option<Window> = None;
        for &seg in &a.kinds[kind].vmm_segs {
            if let Some((lo, missing)) = choose_window(a, kind, seg, rounded, g, &blocked, edges) {
                if choice
                    .as_ref()
                    .is_none_or(|c| missing.len() < c.missing.len())
                {
                    choice = Some(Window {
                        seg,
                        lo,
                        hi: lo + rounded,
                        missing,
                    });
                }
            }
        }
        if let Some(w) = choice {
            return Ok(w);
        }
        let largest = a.kinds[kind]
            .vmm_segs
            .iter()
            .map(|&s| a.kinds[kind].segment(s).len)
            .max()
            .unwrap_or(0);
        let extent = next_extent(cap, g, largest, rounded);
        let seg = self.reserve_for(dev, arena, a, kind, extent, rounded, size)?;
        match choose_window(a, kind, seg, rounded, g, &blocked, edges) {
            Some((lo, missing)) => Ok(Window {
                seg,
                lo,
                hi: lo + rounded,
                missing,
            }),
            None => Err(self.oom_locked(
                dev,
                Some(a),
                arena.stream,
                size,
                rounded,
                false,
                "no virtual range is large enough",
            )),
        }
    }

    /// The device's free memory read afresh (`cuMemGetInfo`) and kept as the estimate
    /// (`free_seen`); `None`, and no estimate, when the read fails.
    fn read_free(&self, dev: &mut DeviceState) -> Option<u64> {
        let c = &*self.core;
        let reserved = dev.reserved[0].current.max(0) as u64;
        match c.driver.mem_info(c.dev) {
            Ok(i) => {
                dev.free_seen = Some((i.free, reserved));
                Some(i.free)
            }
            Err(_) => {
                dev.free_seen = None;
                None
            }
        }
    }

    /// Feasibility: can the window be backed at all? Counts the cached pages (whole free
    /// chunks anywhere but in the window that could be placed in it, and chunks whose release
    /// failed earlier) and the room under the limit and on the device, before moving anything:
    /// gathering pages first would leave a failed request's pages mapped as cache, so a request
    /// above the limit would grab the whole limit and change the counters (ACCEPTANCE B8).
    /// `Ok(cached pages)`, or `Err(limit_hit)`: whether the limit (rather than the device) is
    /// what stops it.
    ///
    /// The cached chunks are placed in the window's runs largest first, or as fully as they
    /// go where that places more, in a plan that gathering follows (Note [Stitching to a plan]
    /// in `placement.rs`).
    fn check_feasible(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &ArenaState,
        kind: HeapKind,
        w: &Window,
    ) -> std::result::Result<Feasible, bool> {
        let c = &*self.core;
        let g = c.granularity;
        let need = w.missing.len();
        let fit = Placement::new(&w.missing, g);
        // The small heaps' pages are counted apart only where they may stay (Note [Small
        // pages stay small]): a large window, once small heaps have had to buy pages back.
        let split = kind == HeapKind::Large && dev.moves.small_churn();
        let (mut lens, small) = if need > 0 {
            self.cached_chunk_lens(dev, arena, a, kind, w, fit.largest_open(), split)
        } else {
            Default::default()
        };
        let mut greedy = fit.largest_first(&lens);
        let (mut cached, mut cached_chunks) = (greedy.pages, greedy.chunks);
        let by_limit = (dev
            .limit
            .saturating_sub(dev.reserved[0].current.max(0) as u64)
            / g) as usize;
        let mut fresh = false;
        let mut by_device = if need > cached {
            let reserved = dev.reserved[0].current.max(0) as u64;
            let estimate = dev.free_seen.map(|(free, then)| {
                (free.saturating_add(then).saturating_sub(reserved) / g) as usize
            });
            // Trusted only when it says new memory alone covers the request: a stale low
            // estimate (another process freed memory since) must not make growth think it is
            // under pressure, which would wait for busy streams.
            match estimate {
                Some(pages) if pages >= need => pages,
                _ => {
                    fresh = true;
                    self.read_free(dev).map_or(usize::MAX, |f| (f / g) as usize)
                }
            }
        } else {
            usize::MAX
        };
        let mut small_kept = false;
        if !small.is_empty() {
            let held = dev.reserved[0].current.max(0) as u64 / g;
            let stay = |room: usize| small_pages_stay(&c.config, held, room, need - cached);
            // Only with the device's room known (a failed read keeps nothing back).
            small_kept = by_device != usize::MAX && stay(by_limit.min(by_device));
            if small_kept && !fresh {
                // Read afresh (~10 µs, against a move now and a new small page later), as
                // below: a stale estimate showing room another process has taken since would
                // make growth fill the device.
                by_device = self.read_free(dev).map_or(usize::MAX, |f| (f / g) as usize);
                small_kept = by_device != usize::MAX && stay(by_limit.min(by_device));
            }
            if !small_kept {
                lens.extend(small);
                greedy = fit.largest_first(&lens);
                (cached, cached_chunks) = (greedy.pages, greedy.chunks);
                if need <= cached {
                    // Cached pages cover it: as if the device had not been read.
                    by_device = usize::MAX;
                }
            }
        }
        // Which cached chunks stitching takes: the largest first, or the fullest packing where
        // that places more (Note [Stitching to a plan] in `placement.rs`).
        let mut plan = None;
        if need > 0 && !lens.is_empty() {
            let p = fit.plan(greedy, &lens);
            (cached, cached_chunks) = (p.pages, p.chunks);
            plan = Some(p.quota);
        }
        let spare = if need > cached {
            by_limit.min(by_device).saturating_sub(need)
        } else if c.config.grow_whole_chunks == WholeChunks::Auto
            && kind == HeapKind::Large
            && cached_chunks >= super::sizing::MIN_MOVES
        {
            // Read afresh (~10 µs, against at least two moves of ~64 µs): a stale estimate
            // showing room another process has taken since would make growth fill the device.
            let free = self.read_free(dev).unwrap_or(0);
            by_limit.min((free / g) as usize).saturating_sub(need)
        } else {
            0
        };
        if cached + by_limit.min(by_device) < need {
            // Blame the limit only when a limit below the device's size is what stops the
            // request; when the device could not hold it either, it is out of memory.
            return Err(cached + by_limit < need
                && dev.limit < c.caps.total_memory
                && cached.saturating_add(by_device) >= need);
        }
        Ok(Feasible {
            cached,
            cached_chunks,
            pressure: by_limit.min(by_device) < need,
            headroom: if need > cached { spare } else { 0 },
            spare,
            small_kept,
            plan,
        })
    }

    /// Gather: chunks for the window's missing pages, cheapest first: stitch cached chunks
    /// (this arena's outside the window, then other arenas'; with `stream_sync:pressure` only
    /// those whose stream is idle), reuse chunks whose release failed, create new ones while
    /// the limit allows (large heaps in chunks of up to `chunk_size` per run of missing pages,
    /// the small heap in single granules), and only then, under memory pressure, wait for busy
    /// streams' cached chunks. When still short, the chunks this request created are released
    /// again (stolen ones are kept, as cache).
    fn gather_pages(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        w: &Window,
        mut feasible: Feasible,
    ) -> Gathered {
        let c = &*self.core;
        let g = c.granularity;
        let need = w.missing.len();
        let cached = feasible.cached;
        let mut place = Placement::new(&w.missing, g);
        // With `stream_sync:pressure` and room for the request in new memory, this first pass
        // takes only pages whose stream's work has finished (no host wait); a second pass below
        // waits only if creation then falls short after all. Under memory pressure (new memory
        // cannot cover the request) cached chunks are what the request needs: wait for them
        // first, before creation uses up the room that the rest will need.
        let wait_first = c.config.stream_sync == StreamSync::Always || feasible.pressure;
        let held = dev.reserved[0].current.max(0) as u64 / g;
        let mode = c.config.grow_whole_chunks;
        let auto = (mode == WholeChunks::Auto).then_some(held);
        // How plentiful memory is for `auto` growth (`sizing.rs`), given the room beyond the
        // request.
        let plenty = |room: usize| match auto {
            Some(held) if !feasible.pressure => {
                let p = |share| plentiful(share, held, need as u64, need as u64, room as u64);
                if p(AUTO_SHARE) {
                    Plenty::Quarter(held)
                } else if p(INSTEAD_SHARE) {
                    Plenty::Third(held)
                } else {
                    Plenty::Tight
                }
            }
            _ => Plenty::Tight,
        };
        let chunk_pages = match kind {
            HeapKind::Large => {
                // Handles beyond what a quarter allows are for replacing moves (below) only.
                let now = match plenty(feasible.headroom) {
                    Plenty::Third(_) => Plenty::Tight,
                    p => p,
                };
                request_chunk_pages(&c.config, g, (w.hi - w.lo) / g, now)
            }
            HeapKind::Small => 1,
        };
        // While memory is plentiful, new handles instead of many moved ones when they cost less
        // (Note [Cheaper than moving] in `sizing.rs`); the cached chunks stay where they are.
        // Those handles are sized as plentiful memory allows, and replace stitching while the
        // process holds up to a third of what it may ([`INSTEAD_SHARE`]).
        let instead = plenty(feasible.spare);
        let instead_pages = request_chunk_pages(&c.config, g, (w.hi - w.lo) / g, instead);
        let create_instead = instead != Plenty::Tight
            && kind == HeapKind::Large
            && c.config.stream_sync != StreamSync::Always
            && creating_is_cheaper(&place, instead_pages, cached, feasible.cached_chunks);
        let chunk_pages = if create_instead {
            instead_pages
        } else {
            chunk_pages
        };
        // While memory is plentiful, chunks do not go straight back where a recent move took
        // them from (Note [No bounce] in `pages.rs`): growth creates for the rest instead.
        let settle = !wait_first && instead != Plenty::Tight;
        let mut moved = 0u64;
        let from: &[HeapKind] = if feasible.small_kept {
            &[HeapKind::Large]
        } else {
            &HeapKind::ALL
        };
        if need > 0 && cached > 0 && !create_instead {
            // Only the chunks the check's plan wants (lost ones too, below).
            place.quota = feasible.plan.take();
            moved += self.stitch(dev, arena, a, kind, w, wait_first, settle, from, &mut place);
        }
        // Chunks whose release failed earlier are good memory: use them before new ones.
        let mut i = 0;
        let order = self.order_stream(arena);
        while i < dev.lost.len() && !place.full() {
            let l = dev.lost[i];
            if !place.wants(l.chunk.pages) {
                i += 1;
                continue;
            }
            if dev.aliased(l.chunk.handle) {
                // Parked while still mapped where it moved from (a failed mapping): its donor's
                // work may still be queued, so this stream must wait for it on the device, as
                // the stream it moved to did (Note [Moves ordered on the device]).
                let events = dev.alias_events(l.chunk.handle);
                let ordered =
                    order.is_some_and(|s| events.iter().all(|&ev| self.order_after(s, ev)));
                if !ordered {
                    i += 1;
                    continue;
                }
            }
            dev.lost.swap_remove(i);
            if l.kind != kind {
                let bytes = l.chunk.pages as i64 * g as i64;
                dev.add_reserved(l.kind, -bytes);
                dev.add_segments(l.kind, -1);
                dev.add_reserved(kind, bytes);
                dev.add_segments(kind, 1);
            }
            place.take(l.chunk);
        }
        if place.quota.take().is_some() && !place.full() {
            // A chunk the plan counted could not be taken (a failed carve, a busy donor, a
            // chunk left as a bounce): any others that fit, as stitching would take them.
            moved += self.stitch(dev, arena, a, kind, w, wait_first, settle, from, &mut place);
        }
        let mut limit_hit = false;
        let mut driver_err = None;
        let mut created: Vec<(usize, Chunk)> = Vec::new();
        // The handles' sizes (`sizing.rs`): a request's (above), and whole chunks'.
        let big = chunk_pages;
        // `grow_whole_chunks`: the last run, when it ends the window in unmapped space, is
        // backed with whole chunks, and grows past the request to whole chunks while the limit
        // and the device leave room for it and one chunk more; those `optional` pages are
        // cached free memory for the next requests, and are given up (never failing the
        // request, never waited for) as soon as room runs short.
        // What the process may hold (understated when cached pages may cover the request and
        // `headroom` is 0; whole chunks are then never grown past it).
        let may = |h: u64| (h, h.saturating_add((need + feasible.headroom) as u64));
        let full = whole_chunk_pages(&c.config, g, auto.map(may));
        let mut whole: Option<u32> = None;
        if mode != WholeChunks::Off && kind == HeapKind::Large && !feasible.pressure {
            let blocked = dev.still_mapped(g);
            whole = self.whole_chunk_extension(
                a,
                kind,
                w,
                &place,
                full,
                feasible.headroom,
                &blocked,
                auto,
            );
            if let (Some(extra), Some(last)) = (whole, place.runs.last_mut()) {
                last.1 += extra;
            }
        }
        let mut optional = whole.unwrap_or(0);
        let last_run = place.runs.len().saturating_sub(1);
        // After a failed whole chunk: the rest in single granules.
        let mut single = false;
        'runs: for r in 0..place.runs.len() {
            loop {
                let (_, n, f) = place.runs[r];
                let open = n - f;
                if open == 0 {
                    break;
                }
                // Up to a chunk, and no more than the limit leaves room for.
                let room = dev
                    .limit
                    .saturating_sub(dev.reserved[0].current.max(0) as u64)
                    / g;
                let room = room.min(u32::MAX as u64) as u32;
                let extending = r == last_run && whole.is_some();
                let chunk = if single {
                    1
                } else if extending {
                    full.max(big)
                } else {
                    big
                };
                let pages = open.min(chunk).min(room);
                if pages == 0 {
                    limit_hit = true;
                    break 'runs;
                }
                let bytes = pages as u64 * g;
                match c.driver.create_physical(c.dev, bytes) {
                    Ok(h) => {
                        c.counters.num_device_alloc.fetch_add(1, Relaxed);
                        dev.add_reserved(kind, bytes as i64);
                        dev.add_segments(kind, 1);
                        let chunk = Chunk { handle: h, pages };
                        created.push((place.placed.len(), chunk));
                        place.place_in(r, chunk);
                    }
                    Err(e) if e.is_oom() && extending && optional > 0 => {
                        // The device has less room than it seemed: the request's own pages
                        // first, without the ones beyond it.
                        dev.free_seen = None;
                        place.runs[r].1 -= optional.min(open);
                        optional = 0;
                    }
                    Err(e) if e.is_oom() && create_instead => {
                        // Less room than it seemed: stop creating, stitch the cached chunks
                        // (below) as growth would have without the choice.
                        dev.free_seen = None;
                        break 'runs;
                    }
                    Err(e) if e.is_oom() && pages > 1 => {
                        // No room for a whole chunk: the rest in single granules.
                        dev.free_seen = None;
                        single = true;
                    }
                    Err(e) => {
                        if e.is_oom() {
                            // The estimate of free memory was wrong: read it again next time.
                            dev.free_seen = None;
                        } else {
                            c.counters.num_driver_errors.fetch_add(1, Relaxed);
                            driver_err = Some(e);
                        }
                        break 'runs;
                    }
                }
            }
        }
        // The pages beyond the request are never what a request waits for or fails on: those
        // still open after a stop (the limit, a driver error) are not wanted.
        if optional > 0 {
            if let Some(&(_, n, f)) = place.runs.get(last_run) {
                place.runs[last_run].1 -= optional.min(n - f);
            }
        }
        if kind == HeapKind::Small && !created.is_empty() {
            dev.moves.small_grew();
        }
        let any_cached = cached > 0 || feasible.small_kept;
        if !place.full() && any_cached && (create_instead || settle || feasible.small_kept) {
            // Creation fell short (the limit, the device): the cached chunks after all, those
            // left as bounces and the small heaps' too, still without waiting for a busy stream.
            let all = &HeapKind::ALL;
            moved += self.stitch(dev, arena, a, kind, w, wait_first, false, all, &mut place);
        }
        if !place.full() && any_cached && !wait_first && driver_err.is_none() {
            // Memory pressure: the limit or the device stops creation, so waiting for busy
            // streams' cached chunks is now the only way to meet the request.
            let all = &HeapKind::ALL;
            moved += self.stitch(dev, arena, a, kind, w, true, false, all, &mut place);
        }
        if moved > 0 {
            c.counters.num_stitches.fetch_add(1, Relaxed);
            c.counters.num_stitched_pages.fetch_add(moved, Relaxed);
        }
        for chunk in std::mem::take(&mut place.spare) {
            self.release_handle(dev, kind, chunk);
        }
        let short = place.open();
        if short > 0 && !created.is_empty() {
            // Short after all (the driver ran out, e.g. another process took memory): give
            // back what this request created, so a failed request leaves reserved memory as
            // it was; stolen chunks are kept, mapped in the window, as cache.
            let mut drop_at: Vec<usize> = created.iter().map(|&(i, _)| i).collect();
            drop_at.sort_unstable();
            for &(_, chunk) in &created {
                self.release_handle(dev, kind, chunk);
            }
            let mut k = 0;
            let mut idx = 0;
            place.placed.retain(|_| {
                let keep = drop_at.get(k) != Some(&idx);
                if !keep {
                    k += 1;
                }
                idx += 1;
                keep
            });
        }
        Gathered {
            placed: place.placed,
            short,
            limit_hit,
            driver_err,
        }
    }

    /// Stitching: takes whole free chunks for window `w` into `place` until it is full, from
    /// this arena (outside the window, unless it is a pinned graph pool's) first, then from the
    /// other arenas (but the pinned ones). A busy stream's chunks move ordered on the device
    /// with `stream_sync:device`; else with `wait` the host blocks on the stream's work, and
    /// without it they are left. With `settle`, leaves
    /// the chunks that would go straight back where a recent move took them from (Note [No
    /// bounce] in `pages.rs`). Returns the pages moved.
    #[allow(clippy::too_many_arguments)]
    fn stitch(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        w: &Window,
        wait: bool,
        settle: bool,
        from: &[HeapKind],
        place: &mut Placement,
    ) -> u64 {
        let c = &*self.core;
        let mut moved = 0u64;
        // With `stream_sync:device`, a busy donor's chunks move with the order kept on the
        // device: this arena's stream waits for the donor's work (Note [Moves ordered on the
        // device] in `pages.rs`).
        let order = self.order_stream(arena);
        let dest = Some(Dest {
            home: Home::of(a, kind),
            settle,
            order,
        });
        // A graph pool's pages never move: a replay reads and writes them where they are.
        if !place.full() && !arena.pinned() {
            moved += self.steal_pages(
                a,
                arena.handle_here(),
                Some(w.exclude(kind)),
                dev,
                kind,
                wait,
                place,
                from,
                dest,
            ) as u64;
        }
        if !place.full() {
            for other in self.donors() {
                if Arc::ptr_eq(&other, arena) {
                    continue;
                }
                let mut o = other.state.lock();
                let got = self.steal_pages(
                    &mut o,
                    other.handle_here(),
                    None,
                    dev,
                    kind,
                    wait,
                    place,
                    from,
                    dest,
                );
                c.counters
                    .num_cross_stream_pages
                    .fetch_add(got as u64, Relaxed);
                moved += got as u64;
                if place.full() {
                    break;
                }
            }
        }
        moved
    }

    /// The stream that work moved to `arena` may be ordered on (Note [Moves ordered on the
    /// device] in `pages.rs`): its own, with `stream_sync:device`, when it can be named here and
    /// no graph capture may be underway (a capturing stream may not wait for an event recorded
    /// outside the capture); `None` otherwise.
    pub(super) fn order_stream(&self, arena: &Arena<D>) -> Option<crate::driver::StreamId> {
        let c = &*self.core;
        if c.config.stream_sync != StreamSync::Device || c.capturing() {
            return None;
        }
        arena.handle_here()
    }

    /// Map: maps what was gathered into the window's holes (even when short: it stays as
    /// cache), then takes the block, or gives up when short.
    #[allow(clippy::too_many_arguments)]
    fn map_window(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        size: u64,
        retried: bool,
        w: Window,
        gathered: Gathered,
    ) -> Result<Grow> {
        let c = &*self.core;
        let rounded = w.hi - w.lo;
        let short = gathered.short > 0;
        if let Err(e) = self.map_pages(dev, a, arena.graph_pool, kind, w.seg, gathered.placed) {
            return Err(e.into());
        }
        if short {
            // A driver failure is reported only when it left the request short: a window
            // that stitching completed anyway serves the request.
            if let Some(e) = gathered.driver_err {
                return Err(e.into());
            }
            return self.give_up(dev, arena, a, size, rounded, gathered.limit_hit, retried);
        }
        match a.try_take(kind, rounded, size, &c.shared) {
            Some((p, _)) => {
                // After growth, on the allocation path: never a host wait.
                self.release_over_threshold(dev, Some((arena, a)), false);
                Ok(Grow::Done(p))
            }
            None => Err(Error::InvalidArgument(format!(
                "internal error: window {:#x}+{rounded} mapped but not allocatable",
                w.lo
            ))),
        }
    }
}
