//! VMM growth: choose a window, check that the request can succeed, gather physical pages
//! (stitch cached pages from any arena, reuse lost handles, create new ones), map them; plus
//! mapping, releasing and stealing pages.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::device::{DeviceState, Lost, Stuck};
use super::grow::Grow;
use super::window::{choose_window, count_free_pages, free_page_runs, vmm_extent, Exclude};
use super::DevicePool;
use crate::arena::{Arena, ArenaState, Backing, HeapKind};
use crate::config::StreamSync;
use crate::driver::{Driver, PhysHandle, StreamId};
use crate::error::{Error, Result};
use crate::heap::SpanState;

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
    fn exclude(&self, kind: HeapKind) -> Exclude {
        Exclude {
            kind,
            lo: self.lo,
            hi: self.hi,
        }
    }
}

/// What the gather phase found for a window.
struct Gathered {
    /// Physical pages for the first `handles.len()` missing pages.
    handles: Vec<PhysHandle>,
    /// Creation stopped at the per-process limit.
    limit_hit: bool,
    /// Creation failed for a reason other than memory.
    driver_err: Option<crate::driver::DriverError>,
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
        let cached = match self.check_feasible(dev, arena, a, kind, &window) {
            Ok(cached) => cached,
            Err(limit_hit) => {
                return self.give_up(dev, arena, a, size, rounded, limit_hit, retried);
            }
        };
        let gathered = self.gather_pages(dev, arena, a, kind, &window, cached);
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
        let extent = vmm_extent(c.caps.total_memory, g, kind);
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
            self.reserve_extent(arena, a, kind, extent)?;
        }
        // A page left mapped by a failed unmap sits in some arena's hole: unmap it before a
        // window there tries to map over it; its handle is then reused like any lost one.
        for s in std::mem::take(&mut dev.stuck) {
            if c.driver.unmap(c.dev, s.addr, g).is_ok() {
                dev.lost.push(Lost {
                    kind: s.kind,
                    handle: s.handle,
                });
            } else {
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                dev.stuck.push(s);
            }
        }
        let mut choice: Option<Window> = None;
        for &seg in &a.kinds[kind].vmm_segs {
            if let Some((lo, missing)) = choose_window(a, kind, seg, rounded, g) {
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
        let seg = self.reserve_extent(arena, a, kind, extent)?;
        match choose_window(a, kind, seg, rounded, g) {
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

    /// Feasibility: can the window be backed at all? Counts the cached pages (whole free pages
    /// anywhere but in the window, and handles whose release failed earlier) and the room
    /// under the limit and on the device, before moving anything: gathering pages first would
    /// leave a failed request's pages mapped as cache, so a request above the limit would grab
    /// the whole limit and change the counters (ACCEPTANCE B8). `Ok(cached pages)`, or
    /// `Err(limit_hit)`: whether the limit (rather than the device) is what stops it.
    fn check_feasible(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &ArenaState,
        kind: HeapKind,
        w: &Window,
    ) -> std::result::Result<usize, bool> {
        let c = &*self.core;
        let g = c.granularity;
        let need = w.missing.len();
        let cached = if need > 0 {
            let mut n = count_free_pages(a, Some(w.exclude(kind)), g) + dev.lost.len();
            for other in self.all_arenas() {
                if !Arc::ptr_eq(&other, arena) {
                    n += count_free_pages(&other.state.lock(), None, g);
                }
            }
            n
        } else {
            0
        };
        let by_limit = (dev
            .limit
            .saturating_sub(dev.reserved[0].current.max(0) as u64)
            / g) as usize;
        let by_device = if need > cached {
            let reserved = dev.reserved[0].current.max(0) as u64;
            let estimate = dev.free_seen.map(|(free, then)| {
                (free.saturating_add(then).saturating_sub(reserved) / g) as usize
            });
            match estimate {
                Some(pages) if cached.saturating_add(pages) >= need => pages,
                _ => match c.driver.mem_info(c.dev) {
                    Ok(i) => {
                        dev.free_seen = Some((i.free, reserved));
                        (i.free / g) as usize
                    }
                    Err(_) => {
                        dev.free_seen = None;
                        usize::MAX
                    }
                },
            }
        } else {
            usize::MAX
        };
        if cached + by_limit.min(by_device) < need {
            // Blame the limit only when a limit below the device's size is what stops the
            // request; when the device could not hold it either, it is out of memory.
            return Err(cached + by_limit < need
                && dev.limit < c.caps.total_memory
                && cached.saturating_add(by_device) >= need);
        }
        Ok(cached)
    }

    /// Gather: physical pages for the window's missing pages, cheapest first: stitch cached
    /// pages (this arena's outside the window, then other arenas'), reuse handles whose
    /// release failed, then create new ones while the limit allows. When still short, the
    /// pages this request created are released again (stolen ones are kept, as cache).
    fn gather_pages(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        w: &Window,
        cached: usize,
    ) -> Gathered {
        let c = &*self.core;
        let g = c.granularity;
        let need = w.missing.len();
        let mut handles: Vec<PhysHandle> = Vec::with_capacity(need);
        // With `stream_sync:pressure`, this first pass takes only pages whose stream's work has
        // finished; a second pass below waits, only if the request would fail otherwise.
        let wait_first = c.config.stream_sync == StreamSync::Always;
        let mut moved = 0u64;
        if need > 0 && cached > 0 {
            moved += self.stitch(dev, arena, a, kind, w, need, wait_first, &mut handles);
        }
        // Handles whose release failed earlier are good memory: use them before new ones.
        while handles.len() < need {
            let Some(Lost { kind: k, handle: h }) = dev.lost.pop() else {
                break;
            };
            if k != kind {
                dev.add_reserved(k, -(g as i64));
                dev.add_segments(k, -1);
                dev.add_reserved(kind, g as i64);
                dev.add_segments(kind, 1);
            }
            handles.push(h);
        }
        let mut limit_hit = false;
        let mut driver_err = None;
        let mut created = Vec::new();
        while handles.len() + created.len() < need {
            if dev.reserved[0].current as u64 + g > dev.limit {
                limit_hit = true;
                break;
            }
            match c.driver.create_physical(c.dev, g) {
                Ok(h) => {
                    c.counters.num_device_alloc.fetch_add(1, Relaxed);
                    dev.add_reserved(kind, g as i64);
                    dev.add_segments(kind, 1);
                    created.push(h);
                }
                Err(e) => {
                    if e.is_oom() {
                        // The estimate of free memory was wrong: read it again next time.
                        dev.free_seen = None;
                    } else {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        driver_err = Some(e);
                    }
                    break;
                }
            }
        }
        if handles.len() + created.len() < need && cached > 0 && !wait_first {
            // Memory pressure: the limit or the device stops creation, so waiting for busy
            // streams' cached pages is now the only way to meet the request.
            let want = need - created.len();
            moved += self.stitch(dev, arena, a, kind, w, want, true, &mut handles);
        }
        if moved > 0 {
            c.counters.num_stitches.fetch_add(1, Relaxed);
            c.counters.num_stitched_pages.fetch_add(moved, Relaxed);
        }
        if handles.len() + created.len() < need {
            // Short after all (the driver ran out, e.g. another process took memory): give
            // back what this request created, so a failed request leaves reserved memory as
            // it was; stolen pages are kept, mapped in the window, as cache.
            for h in created.drain(..) {
                self.release_handle(dev, kind, h);
            }
        }
        handles.extend(created);
        Gathered {
            handles,
            limit_hit,
            driver_err,
        }
    }

    /// Stitching: takes whole free pages for window `w` into `handles` until it holds `want`,
    /// from this arena (outside the window) first, then from the other arenas. With `wait`,
    /// blocks on a busy stream's work; without, leaves busy streams' pages. Returns the pages
    /// moved.
    #[allow(clippy::too_many_arguments)]
    fn stitch(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        w: &Window,
        want: usize,
        wait: bool,
        handles: &mut Vec<PhysHandle>,
    ) -> u64 {
        let c = &*self.core;
        let mut moved = 0u64;
        if handles.len() < want {
            let got = self.steal_pages(
                a,
                arena.stream,
                Some(w.exclude(kind)),
                want - handles.len(),
                dev,
                kind,
                wait,
            );
            moved += got.len() as u64;
            handles.extend(got);
        }
        if handles.len() < want {
            for other in self.all_arenas() {
                if Arc::ptr_eq(&other, arena) {
                    continue;
                }
                let mut o = other.state.lock();
                let got = self.steal_pages(
                    &mut o,
                    other.stream,
                    None,
                    want - handles.len(),
                    dev,
                    kind,
                    wait,
                );
                c.counters
                    .num_cross_stream_pages
                    .fetch_add(got.len() as u64, Relaxed);
                moved += got.len() as u64;
                handles.extend(got);
                if handles.len() >= want {
                    break;
                }
            }
        }
        moved
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
        let short = gathered.handles.len() < w.missing.len();
        if let Err(e) = self.map_pages(dev, a, kind, w.seg, &w.missing, gathered.handles) {
            return Err(e.into());
        }
        if let Some(e) = gathered.driver_err {
            return Err(e.into());
        }
        if short {
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

    /// Reserves one more virtual extent for heap `kind` of `arena`; returns its segment index.
    pub(super) fn reserve_extent(
        &self,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        extent: u64,
    ) -> Result<u32> {
        let c = &*self.core;
        let base = c
            .driver
            .reserve_va(c.dev, extent, c.granularity)
            .inspect_err(|_| {
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
            })?;
        let pages = vec![None; (extent / c.granularity) as usize];
        let s = a.kinds[kind].add_segment(base, extent, Backing::Vmm { pages });
        a.kinds[kind].vmm_segs.push(s);
        self.ranges
            .write()
            .insert(base, (base + extent, Arc::downgrade(arena)));
        Ok(s)
    }

    /// Maps `handles` at the first `handles.len()` pages of `missing` and turns those pages
    /// into free space. Access is granted once per run of consecutive pages (one
    /// `cuMemSetAccess` per mapped range, not per page: it costs ~36 µs a call). On a driver
    /// failure the failing handle is released, the run being mapped keeps the pages mapped
    /// before the failure when access can be granted to them (else they are unmapped and
    /// released), the pages of earlier runs are kept, and the rest are released.
    pub(super) fn map_pages(
        &self,
        dev: &mut DeviceState,
        a: &mut ArenaState,
        kind: HeapKind,
        seg_idx: u32,
        missing: &[u64],
        handles: Vec<PhysHandle>,
    ) -> crate::driver::DriverResult<()> {
        let c = &*self.core;
        let g = c.granularity;
        let d = &*c.driver;
        let base = a.kinds[kind].segment(seg_idx).base;
        let mut mapped: Vec<u64> = Vec::with_capacity(handles.len());
        let mut result = Ok(());
        let mut rest = handles.into_iter();
        let mut pairs = missing.iter().copied().zip(rest.by_ref()).peekable();
        // Pages of the current run mapped so far, without access yet.
        let mut run: Vec<(u64, PhysHandle)> = Vec::new();
        while let Some((page, h)) = pairs.next() {
            let mapped_ok = match d.map(c.dev, page, g, h) {
                Ok(()) => {
                    run.push((page, h));
                    true
                }
                Err(e) => {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    self.release_handle(dev, kind, h);
                    result = Err(e);
                    false
                }
            };
            let run_ends = !mapped_ok || pairs.peek().is_none_or(|&(next, _)| next != page + g);
            if !run_ends || run.is_empty() {
                if !mapped_ok {
                    break;
                }
                continue;
            }
            let lo = run[0].0;
            let len = run.len() as u64 * g;
            match d.set_access(c.dev, lo, len) {
                Ok(()) => {
                    if let Some(seg) = a.kinds[kind].segments[seg_idx as usize].as_mut() {
                        if let Backing::Vmm { pages } = &mut seg.backing {
                            for &(p, h) in &run {
                                pages[((p - base) / g) as usize] = Some(h);
                            }
                        }
                    }
                    mapped.extend(run.drain(..).map(|(p, _)| p));
                }
                Err(e) => {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    for (p, h) in run.drain(..) {
                        if d.unmap(c.dev, p, g).is_ok() {
                            self.release_handle(dev, kind, h);
                        } else {
                            // Still mapped: releasing it now would fail and lose the mapping.
                            dev.stuck.push(Stuck {
                                kind,
                                handle: h,
                                addr: p,
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
        // Handles we could not map (after a failure) are released, not leaked: the one a peek
        // may have taken out, then the rest.
        for (_, h) in pairs {
            self.release_handle(dev, kind, h);
        }
        for h in rest {
            self.release_handle(dev, kind, h);
        }
        // Fill the holes page run by page run.
        let mut i = 0;
        while i < mapped.len() {
            let lo = mapped[i];
            let mut hi = lo + g;
            i += 1;
            while i < mapped.len() && mapped[i] == hi {
                hi += g;
                i += 1;
            }
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

    pub(super) fn release_handle(&self, dev: &mut DeviceState, kind: HeapKind, h: PhysHandle) {
        let c = &*self.core;
        match c.driver.release_physical(c.dev, h) {
            Ok(()) => {
                c.counters.num_device_free.fetch_add(1, Relaxed);
                dev.add_reserved(kind, -(c.granularity as i64));
                dev.add_segments(kind, -1);
            }
            Err(_) => {
                // The handle is lost to us; it stays counted as reserved so the numbers keep
                // matching the driver's (and the invariant checker knows why).
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                dev.lost.push(Lost { kind, handle: h });
            }
        }
    }

    /// Takes up to `want` whole free pages out of arena `a` (whose stream is `stream`),
    /// skipping `exclude`. The stream's work must be finished first: with `wait` it blocks on
    /// it, without it takes nothing when an event query says the stream is still busy. The
    /// pages' handles are unmapped and returned; their address ranges become holes. `to_kind` is the
    /// heap the pages are for (for per-pool reserved accounting).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn steal_pages(
        &self,
        a: &mut ArenaState,
        stream: StreamId,
        exclude: Option<Exclude>,
        want: usize,
        dev: &mut DeviceState,
        to_kind: HeapKind,
        wait: bool,
    ) -> Vec<PhysHandle> {
        let c = &*self.core;
        let g = c.granularity;
        let mut out = Vec::new();
        let mut synced = false;
        for kind in HeapKind::ALL {
            let runs = free_page_runs(a, kind, exclude, g, want - out.len());
            for run in runs {
                let (seg_idx, id, lo, hi) = (run.seg, run.span, run.lo, run.hi);
                if out.len() >= want {
                    break;
                }
                let n = (((hi - lo) / g) as usize).min(want - out.len());
                let hi = lo + n as u64 * g;
                if !synced {
                    // Unmapping needs the stream's work on these pages finished.
                    let ready = if wait {
                        c.sync_stream(stream)
                    } else {
                        c.stream_idle(stream)
                    };
                    if !ready {
                        return out;
                    }
                    synced = true;
                }
                a.carve(kind, id, lo, hi, &c.shared);
                let base = a.kinds[kind].segment(seg_idx).base;
                let mut page = lo;
                while page < hi {
                    let idx = ((page - base) / g) as usize;
                    let handle = match a.kinds[kind].segments[seg_idx as usize].as_mut() {
                        Some(crate::arena::Segment {
                            backing: Backing::Vmm { pages },
                            ..
                        }) => pages[idx],
                        _ => None,
                    };
                    let Some(h) = handle else { break };
                    if c.driver.unmap(c.dev, page, g).is_err() {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        // Put the rest of the carved range back as free space.
                        self.refill(a, kind, seg_idx, page, hi);
                        break;
                    }
                    if let Some(crate::arena::Segment {
                        backing: Backing::Vmm { pages },
                        ..
                    }) = a.kinds[kind].segments[seg_idx as usize].as_mut()
                    {
                        pages[idx] = None;
                    }
                    if kind != to_kind {
                        dev.add_reserved(kind, -(g as i64));
                        dev.add_segments(kind, -1);
                        dev.add_reserved(to_kind, g as i64);
                        dev.add_segments(to_kind, 1);
                    }
                    out.push(h);
                    page += g;
                }
            }
            if out.len() >= want {
                break;
            }
        }
        out
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
