//! The slow path: growth on a cache miss, under the device lock. [`DevicePool::grow`] picks the
//! strategy (VMM extents, in `vmm.rs`, or `cuMemAlloc` segments, here), the give-up rule asks
//! for one retry of the OOM protocol when frees wait on events, and the OOM report is built
//! here.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::device::DeviceState;
use super::DevicePool;
use crate::arena::{Arena, ArenaState, Backing, HeapKind};
use crate::driver::{Driver, StreamId};
use crate::error::{Error, OomReport, Result};

/// The outcome of one attempt to grow.
pub(super) enum Grow {
    Done(u64),
    Retry,
    /// The arena was retired or swept after the caller looked it up: look it up again.
    Stale,
}

impl<D: Driver> DevicePool<D> {
    pub(super) fn grow_with_retry(
        &self,
        arena: &Arc<Arena<D>>,
        kind: HeapKind,
        rounded: u64,
        size: u64,
    ) -> Result<Option<u64>> {
        let mut retried = false;
        loop {
            match self.grow(arena, kind, rounded, size, retried)? {
                Grow::Done(p) => return Ok(Some(p)),
                Grow::Stale => return Ok(None),
                Grow::Retry => {
                    if retried {
                        // grow() only asks for one retry; a second request means a bug. Fail
                        // rather than loop.
                        return Err(self.oom(arena.stream, size, rounded, false, "retry loop"));
                    }
                    retried = true;
                    self.core.counters.num_alloc_retries.fetch_add(1, Relaxed);
                }
            }
        }
    }

    /// The slow path (see the module docs). Holds the device lock throughout.
    pub(super) fn grow(
        &self,
        arena: &Arc<Arena<D>>,
        kind: HeapKind,
        rounded: u64,
        size: u64,
        retried: bool,
    ) -> Result<Grow> {
        let c = &*self.core;
        let mut dev = self.state.lock();
        if arena.retired.load(Relaxed) {
            // Its stream is gone, or it was swept as dormant: never grow it (memory added here
            // would belong to an arena that nothing looks up any more).
            return Ok(Grow::Stale);
        }
        if !self.retired.lock().is_empty() {
            self.reap_retired(&mut dev, Some(arena));
        }
        if self.sweep_wanted.swap(false, Relaxed) {
            self.sweep_dormant(&mut dev, arena);
        }
        if retried {
            // OOM protocol: wait for every pending free's events, then look again.
            for other in self.all_arenas() {
                other.state.lock().process_pending(true, c);
            }
        }
        let mut a = arena.state.lock();
        a.process_pending(false, c);
        if let Some((p, _)) = a.try_take(kind, rounded, size, &c.shared) {
            return Ok(Grow::Done(p));
        }
        if c.vmm {
            self.grow_vmm(&mut dev, arena, &mut a, kind, rounded, size, retried)
        } else {
            drop(a);
            self.grow_linear(&mut dev, arena, kind, rounded, size, retried)
        }
    }

    /// A request that cannot be met now: ask for one retry of the OOM protocol when frees are
    /// waiting on events (their memory may be all that is missing), else fail with a report.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn give_up(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &ArenaState,
        size: u64,
        rounded: u64,
        limit_hit: bool,
        retried: bool,
    ) -> Result<Grow> {
        if !retried && self.any_pending(arena, a) {
            return Ok(Grow::Retry);
        }
        let why = if limit_hit {
            "the per-process limit would be exceeded"
        } else {
            "the device has too little free memory for it"
        };
        Err(self.oom_locked(dev, Some(a), arena.stream, size, rounded, limit_hit, why))
    }

    /// Whether any arena has frees waiting on events (`a` is `arena`'s locked state).
    pub(super) fn any_pending(&self, arena: &Arc<Arena<D>>, a: &ArenaState) -> bool {
        !a.pending.is_empty()
            || self
                .all_arenas()
                .iter()
                .any(|o| !Arc::ptr_eq(o, arena) && !o.state.lock().pending.is_empty())
    }

    pub(super) fn grow_linear(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        kind: HeapKind,
        rounded: u64,
        size: u64,
        retried: bool,
    ) -> Result<Grow> {
        let c = &*self.core;
        const MIB: u64 = 1 << 20;
        if rounded > c.caps.total_memory {
            // Also keeps the segment arithmetic below far from overflow.
            return Err(self.oom_locked(
                dev,
                None,
                arena.stream,
                size,
                rounded,
                false,
                "the request is larger than the device",
            ));
        }
        let seg_size = if kind == HeapKind::Small {
            rounded.div_ceil(2 * MIB) * 2 * MIB
        } else if rounded < 10 * MIB {
            20 * MIB
        } else {
            rounded.div_ceil(2 * MIB) * 2 * MIB
        };
        let mut limit_hit = dev.reserved[0].current as u64 + seg_size > dev.limit;
        if limit_hit {
            self.release_cached(dev);
            limit_hit = dev.reserved[0].current as u64 + seg_size > dev.limit;
        }
        let mut result = None;
        if !limit_hit {
            result = match c.driver.mem_alloc(c.dev, seg_size) {
                Ok(p) => Some(p),
                Err(e) if e.is_oom() => {
                    // Give every wholly free segment back, then try once more.
                    self.release_cached(dev);
                    match c.driver.mem_alloc(c.dev, seg_size) {
                        Ok(p) => Some(p),
                        Err(e) if e.is_oom() => None,
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    return Err(e.into());
                }
            };
        }
        let mut a = arena.state.lock();
        let Some(base) = result else {
            return self.give_up(dev, arena, &a, size, rounded, limit_hit, retried);
        };
        c.counters.num_device_alloc.fetch_add(1, Relaxed);
        c.observer.emit(
            super::PoolEventKind::SegmentAlloc,
            c.dev,
            base,
            seg_size,
            arena.graph_pool,
        );
        dev.add_reserved(kind, seg_size as i64);
        dev.add_private_reserved(arena.graph_pool, kind, seg_size as i64);
        dev.add_segments(kind, 1);
        let before = a.free_totals(kind);
        a.kinds[kind].add_segment(base, seg_size, Backing::Linear);
        a.note_free_change(kind, before, &c.shared);
        self.ranges
            .write()
            .insert(base, (base + seg_size, Arc::downgrade(arena)));
        match a.try_take(kind, rounded, size, &c.shared) {
            Some((ptr, _)) => {
                let mut a = a;
                self.release_over_threshold(dev, Some((arena, &mut a)), false);
                Ok(Grow::Done(ptr))
            }
            None => Err(Error::InvalidArgument(
                "internal error: fresh segment not allocatable".into(),
            )),
        }
    }

    pub(super) fn oom(
        &self,
        stream: StreamId,
        size: u64,
        rounded: u64,
        limit: bool,
        why: &str,
    ) -> Error {
        let mut dev = self.state.lock();
        self.oom_locked(&mut dev, None, stream, size, rounded, limit, why)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn oom_locked(
        &self,
        dev: &mut DeviceState,
        held: Option<&ArenaState>,
        stream: StreamId,
        size: u64,
        rounded: u64,
        limit: bool,
        why: &str,
    ) -> Error {
        let c = &*self.core;
        c.counters.num_ooms.fetch_add(1, Relaxed);
        if limit {
            c.counters.num_limit_ooms.fetch_add(1, Relaxed);
        }
        let info = c.driver.mem_info(c.dev).ok();
        let (mut live, mut active, mut largest) = (0i64, 0i64, 0u64);
        let mut by_tag: FxHashMap<u32, (i64, i64)> = FxHashMap::default();
        let mut by_site: FxHashMap<u32, (i64, i64)> = FxHashMap::default();
        let held_ptr = held.map(|h| h as *const ArenaState);
        let mut add = |s: &ArenaState| {
            live += s.gauges.cur[crate::stats::Gauge::AllocatedBytes as usize][0];
            active += s.gauges.cur[crate::stats::Gauge::ActiveBytes as usize][0];
            largest = largest.max(s.largest_free());
            for slot in &s.ledger.slots {
                let t = by_tag.entry(slot.tag).or_default();
                t.0 += slot.live_bytes;
                t.1 += slot.live_blocks;
                if slot.site != 0 {
                    let t = by_site.entry(slot.site).or_default();
                    t.0 += slot.live_bytes;
                    t.1 += slot.live_blocks;
                }
            }
        };
        if let Some(h) = held {
            add(h);
        }
        for arena in self.all_arenas() {
            // The arena whose state the caller holds was counted above; every other one is
            // locked (the device lock is held, so holding two arena locks is allowed).
            if held_ptr.is_some_and(|p| std::ptr::eq(arena.state.data_ptr(), p)) {
                continue;
            }
            add(&arena.state.lock());
        }
        let reserved = dev.reserved[0].current.max(0) as u64;
        let report = OomReport {
            device: c.dev,
            stream: stream.0,
            requested: size,
            rounded,
            limit: dev.limit,
            device_free: info.map_or(0, |i| i.free),
            device_total: info.map_or(c.caps.total_memory, |i| i.total),
            reserved,
            live: live.max(0) as u64,
            pending: (active - live).max(0) as u64,
            cached: reserved.saturating_sub(active.max(0) as u64),
            largest_free: largest,
            top_tags: top_attributions(by_tag, |t| {
                crate::provenance::tag_name(t).unwrap_or_else(|| "(no tag)".into())
            }),
            top_sites: top_attributions(by_site, crate::provenance::site_label),
            other_processes: Vec::new(),
            process_nvml_bytes: None,
            reason: why.to_string(),
        };
        dev.last_oom = Some(Box::new(report.clone()));
        if limit {
            Error::LimitExceeded(Box::new(report))
        } else {
            Error::OutOfMemory(Box::new(report))
        }
    }
}

impl<D: Driver> DevicePool<D> {
    /// Names, in an out-of-memory error of the device (not of a limit), the other processes
    /// that hold memory on it, as their registry records and NVML say, and what NVML counts
    /// for this process (`publish::others_on`): in the error and in the device's last OOM
    /// report, when that is still this error's. Called once the device lock is released: it
    /// reads the registry's files and asks NVML, at most once a second (the answer is kept
    /// that long: `DevicePool::others`).
    #[cold]
    pub(super) fn name_other_processes(&self, e: Error) -> Error {
        let Error::OutOfMemory(mut r) = e else {
            return e;
        };
        let c = &*self.core;
        let (others, mine) = {
            let mut cached = self.others.lock();
            match &*cached {
                Some((at, v)) if at.elapsed() < OTHERS_FRESH => v.clone(),
                _ => {
                    let v = super::publish::others_on(
                        &c.config,
                        c.driver.name(),
                        c.caps.uuid.as_deref(),
                        r.reserved,
                    );
                    *cached = Some((std::time::Instant::now(), v.clone()));
                    v
                }
            }
        };
        if others.is_empty() && mine.is_none() {
            return Error::OutOfMemory(r);
        }
        if let Some(last) = self.state.lock().last_oom.as_deref_mut() {
            // The same report (every field: none named yet on either), unless another
            // thread's has replaced it meanwhile.
            if *last == *r {
                last.other_processes = others.clone();
                last.process_nvml_bytes = mine;
            }
        }
        r.other_processes = others;
        r.process_nvml_bytes = mine;
        Error::OutOfMemory(r)
    }
}

/// How long the other processes read for an OOM report are reused for the next.
const OTHERS_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// How many tags and sites an OOM report lists.
const TOP_N: usize = 8;

/// The largest `TOP_N` of `m` (id -> (live bytes, live blocks)), named by `name`.
pub(super) fn top_attributions(
    m: FxHashMap<u32, (i64, i64)>,
    name: impl Fn(u32) -> String,
) -> Vec<crate::error::Attribution> {
    let mut v: Vec<_> = m
        .into_iter()
        .filter(|(_, (b, n))| *b > 0 || *n > 0)
        .collect();
    v.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
    v.truncate(TOP_N);
    v.into_iter()
        .map(|(id, (b, n))| crate::error::Attribution {
            name: name(id),
            bytes: b.max(0) as u64,
            blocks: n.max(0) as u64,
        })
        .collect()
}
