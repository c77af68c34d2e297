//! Giving memory back: `empty_cache`, `trim`, the memory fraction and the release threshold.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::device::{DeviceState, Lost};
use super::pages::Budget;
use super::DevicePool;
use crate::arena::{Arena, ArenaState, Backing, HeapKind};
use crate::driver::{Driver, StreamId};
use crate::error::{Error, Result};
use crate::heap::SpanState;

impl<D: Driver> DevicePool<D> {
    /// Releases all cached memory (whole free pages, wholly free linear segments) of every
    /// arena. Returns the bytes released.
    pub(super) fn release_cached(&self, dev: &mut DeviceState) -> u64 {
        // Chunks still mapped where they moved from cannot be released before that mapping
        // goes: wait for their donors (this path may wait for every stream anyway).
        self.finish_deferred(dev, true);
        let mut released = 0;
        for arena in self.donors() {
            let mut st = arena.state.lock();
            released += self.release_arena(dev, arena.handle_here(), &mut st, u64::MAX, true);
        }
        released
    }

    /// Gives back what retired arenas (their stream is gone, see `DevicePool::retire`) hold once
    /// none of their blocks is live or pending: their cached pages, after a device
    /// synchronisation (the gone stream cannot be waited for by name), then their address
    /// ranges, and the arena leaves the pool. Without this, every stream destroyed and replaced
    /// would keep its reservations for the process's life. `except` (the arena being grown) is
    /// left alone.
    pub(super) fn reap_retired(&self, dev: &mut DeviceState, except: Option<&Arc<Arena<D>>>) {
        let c = &*self.core;
        let retired: Vec<_> = self.retired.lock().clone();
        for arena in retired {
            if except.is_some_and(|e| Arc::ptr_eq(&arena, e)) {
                continue;
            }
            let mut a = arena.state.lock();
            if !a.pending.is_empty() {
                a.process_pending(false, c);
            }
            if !a.live.is_empty() || !a.pending.is_empty() {
                continue;
            }
            self.release_arena(dev, None, &mut a, u64::MAX, true);
            if !self.free_extents(dev, &mut a) {
                continue;
            }
            dev.keep_counts(&a);
            drop(a);
            self.retired.lock().retain(|r| !Arc::ptr_eq(r, &arena));
        }
    }

    /// Drops the dormant arenas: those with no live, pending or used block and no memory (every
    /// page taken by other streams or released, no `cuMemAlloc` segment), whose stream may well
    /// be gone (a server's short-lived streams). Their address ranges go back and the arena
    /// objects leave the pool, so that host memory and address space follow the streams that
    /// hold memory, not every stream ever seen; a stream that allocates again gets a new arena.
    /// Run at a growth once the number of arenas has doubled since the last sweep (at least
    /// [`SWEEP_MIN_ARENAS`](super::device::SWEEP_MIN_ARENAS)): amortised O(1) per new arena.
    /// Arenas whose lock is busy, and `except` (the one growing), are left for the next sweep.
    pub(super) fn sweep_dormant(&self, dev: &mut DeviceState, except: &Arc<Arena<D>>) {
        let mut map = self.arenas.write();
        let mut gone = Vec::new();
        for (&id, arena) in map.iter() {
            if Arc::ptr_eq(arena, except) {
                continue;
            }
            let Some(mut a) = arena.state.try_lock() else {
                continue;
            };
            if !a.live.is_empty() || !a.pending.is_empty() || !a.uses.is_empty() {
                continue;
            }
            let holds_memory = a.kinds.iter().any(|(_, kh)| {
                kh.segments.iter().flatten().any(|seg| match &seg.backing {
                    Backing::Vmm { pages } => pages.iter().any(Option::is_some),
                    Backing::Linear => true,
                })
            });
            if holds_memory || !self.free_extents(dev, &mut a) {
                continue;
            }
            dev.keep_counts(&a);
            arena.retired.store(true, Relaxed);
            gone.push(id);
        }
        for id in &gone {
            map.remove(id);
        }
        if !gone.is_empty() {
            self.generation.fetch_add(1, Relaxed);
            // Streams without an arena now are no longer asked of (`DeviceCore::sync_device`).
            self.core
                .streams
                .lock()
                .retain(|&s| map.values().any(|a| a.stream == s));
        }
        self.sweep_at.store(
            (map.len() * 2).max(super::device::SWEEP_MIN_ARENAS),
            Relaxed,
        );
    }

    /// Frees every address range of an arena none of whose pages is mapped any more (also no
    /// old mapping of a moved chunk, nor a page whose unmap failed); returns whether the arena
    /// holds no segment now.
    fn free_extents(&self, dev: &DeviceState, a: &mut ArenaState) -> bool {
        let c = &*self.core;
        let still_mapped = dev.still_mapped(c.granularity);
        let mut all = true;
        for kind in [HeapKind::Large, HeapKind::Small] {
            let kh = &mut a.kinds[kind];
            for slot in &mut kh.segments {
                let Some(seg) = slot.as_ref() else { continue };
                let end = seg.base + seg.len;
                let unmapped = matches!(&seg.backing,
                    Backing::Vmm { pages } if pages.iter().all(Option::is_none))
                    && !still_mapped
                        .iter()
                        .any(|&(lo, hi)| lo < end && seg.base < hi);
                if !unmapped {
                    all = false;
                    continue;
                }
                if c.driver.free_va(c.dev, seg.base, seg.len).is_err() {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    all = false;
                    continue;
                }
                self.ranges.write().remove(&seg.base);
                if let Some(seg) = slot.take() {
                    kh.heap.remove_segment(seg.first);
                }
            }
            let segs = &kh.segments;
            kh.vmm_segs.retain(|&s| segs[s as usize].is_some());
        }
        all
    }

    /// Releases up to `budget` bytes of cached memory from one arena (whole chunks: the last
    /// may overshoot). With VMM its chunks must be idle: `wait` blocks on the stream's work;
    /// without, a busy stream's chunks stay. Without VMM, `cuMemFree` synchronises the device,
    /// so without `wait` nothing is released.
    pub(super) fn release_arena(
        &self,
        dev: &mut DeviceState,
        stream: Option<StreamId>,
        a: &mut ArenaState,
        budget: u64,
        wait: bool,
    ) -> u64 {
        let c = &*self.core;
        if c.capturing() {
            // Knowing that the chunks are idle needs an event query or a wait (and `cuMemFree`
            // synchronises): none of them while a graph may be capturing.
            return 0;
        }
        let g = c.granularity;
        let mut released = 0u64;
        if c.vmm {
            for kind in [HeapKind::Large, HeapKind::Small] {
                if released >= budget {
                    break;
                }
                let want = ((budget - released) / g).min(usize::MAX as u64) as usize;
                if want == 0 {
                    break;
                }
                let mut budget_pages = Budget {
                    left: want,
                    taken: Vec::new(),
                };
                // Each heap's chunks, counted as that heap's, so per-pool statistics stay true.
                self.steal_pages(
                    a,
                    stream,
                    None,
                    dev,
                    kind,
                    wait,
                    &mut budget_pages,
                    &[kind],
                    None,
                );
                for ch in budget_pages.taken {
                    self.release_handle(dev, kind, ch);
                    c.counters
                        .num_released_pages
                        .fetch_add(ch.pages as u64, Relaxed);
                    released += ch.pages as u64 * g;
                }
            }
        } else if wait {
            // cuMemFree synchronises the device (a host wait): only where waiting is allowed.
            let mut synced = false;
            for kind in [HeapKind::Large, HeapKind::Small] {
                let free_segs: Vec<(u32, u64, u64)> = a.kinds[kind]
                    .segments
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| {
                        let s = s.as_ref()?;
                        let first = a.kinds[kind].heap.span(s.first);
                        (first.state == SpanState::Free && first.len == s.len)
                            .then_some((i as u32, s.base, s.len))
                    })
                    .collect();
                for (idx, base, len) in free_segs {
                    if released >= budget {
                        break;
                    }
                    if !synced {
                        // cuMemFree synchronises on its own; no event needed.
                        synced = true;
                    }
                    // Told before the free (see `steal_pages`); a failed free keeps the segment.
                    c.observer.emit(
                        super::PoolEventKind::SegmentFree,
                        c.dev,
                        base,
                        len,
                        a.graph_pool,
                    );
                    if c.driver.mem_free(c.dev, base).is_err() {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        c.observer.emit(
                            super::PoolEventKind::SegmentAlloc,
                            c.dev,
                            base,
                            len,
                            a.graph_pool,
                        );
                        continue;
                    }
                    dev.add_private_reserved(a.graph_pool, kind, -(len as i64));
                    c.counters.num_device_free.fetch_add(1, Relaxed);
                    let before = a.free_totals(kind);
                    let Some(seg) = a.kinds[kind].segments[idx as usize].take() else {
                        continue;
                    };
                    a.kinds[kind].heap.remove_segment(seg.first);
                    a.note_free_change(kind, before, &c.shared);
                    self.ranges.write().remove(&base);
                    dev.add_reserved(kind, -(len as i64));
                    dev.add_segments(kind, -1);
                    released += len;
                }
            }
        }
        released
    }

    /// Applies `release_threshold` after growth (`wait: false`: a busy stream keeps its pages
    /// until a later growth or `trim`) and on `trim` (`wait: true`).
    pub(super) fn release_over_threshold(
        &self,
        dev: &mut DeviceState,
        held: Option<(&Arc<Arena<D>>, &mut ArenaState)>,
        wait: bool,
    ) {
        let Some(threshold) = self.core.config.release_threshold else {
            return;
        };
        let reserved = dev.reserved[0].current as u64;
        let live = self.bytes_with(
            held.as_ref().map(|(a, s)| (*a, &**s)),
            crate::stats::Gauge::ActiveBytes,
        );
        let cached = reserved.saturating_sub(live);
        if cached <= threshold {
            return;
        }
        let mut budget = cached - threshold;
        self.finish_deferred(dev, wait);
        let mut held = held;
        for arena in self.donors() {
            if budget == 0 {
                break;
            }
            let got = match held {
                Some((h, ref mut hs)) if Arc::ptr_eq(h, &arena) => {
                    self.release_arena(dev, arena.handle_here(), hs, budget, wait)
                }
                _ => {
                    let mut st = arena.state.lock();
                    self.release_arena(dev, arena.handle_here(), &mut st, budget, wait)
                }
            };
            budget = budget.saturating_sub(got);
        }
    }

    /// The device-wide current value of a byte gauge; `held` is an arena whose lock the caller
    /// holds.
    pub(super) fn bytes_with(
        &self,
        held: Option<(&Arc<Arena<D>>, &ArenaState)>,
        gauge: crate::stats::Gauge,
    ) -> u64 {
        let mut live = 0i64;
        for arena in self.all_arenas() {
            match held {
                Some((h, hs)) if Arc::ptr_eq(h, &arena) => live += hs.gauges.cur[gauge as usize][0],
                _ => live += arena.state.lock().gauges.cur[gauge as usize][0],
            }
        }
        live.max(0) as u64
    }

    /// Returns every cached page (and wholly free segment) to the driver. Live blocks and the
    /// virtual reservations stay.
    pub fn empty_cache(&self) {
        let c = &*self.core;
        let mut dev = self.state.lock();
        for arena in self.all_arenas() {
            let mut a = arena.state.lock();
            a.retry_device_sync(c);
            a.process_pending(false, c);
        }
        self.release_cached(&mut dev);
        self.reap_retired(&mut dev, None);
        for Lost { kind, chunk } in std::mem::take(&mut dev.lost) {
            self.release_handle(&mut dev, kind, chunk);
        }
        for s in std::mem::take(&mut dev.stuck) {
            let len = s.chunk.pages as u64 * c.granularity;
            if c.driver.unmap(c.dev, s.addr, len).is_ok() {
                self.release_handle(&mut dev, s.kind, s.chunk);
            } else {
                dev.stuck.push(s);
            }
        }
        if let Some(rec) = &c.recorder {
            rec.reserved(dev.reserved[0].current.max(0) as u64);
        }
    }

    /// Returns the cached pages (and wholly free segments) of graph pool `id` to the driver once
    /// the pool is released, as PyTorch's `emptyCache(mempool_id)` frees a released pool's
    /// cached blocks; returns the bytes released. A pool still in use keeps its memory (it is
    /// its graphs' until released: nothing happens), and so does every other arena. Its
    /// arenas' pending frees are polled first; with VMM their pages are released once their
    /// stream is idle, after a device synchronisation, as [`DevicePool::empty_cache`] does.
    pub fn empty_pool_cache(&self, id: super::MempoolId) -> u64 {
        let c = &*self.core;
        let mut dev = self.state.lock();
        let arenas: Vec<_> = self
            .retired
            .lock()
            .iter()
            .filter(|a| a.graph_pool == Some((id.0, id.1)))
            .cloned()
            .collect();
        if !arenas.is_empty() {
            // Their chunks still mapped where they moved from can go only after their donors.
            self.finish_deferred(&mut dev, true);
        }
        let mut released = 0;
        for arena in arenas {
            let mut a = arena.state.lock();
            a.retry_device_sync(c);
            a.process_pending(false, c);
            released += self.release_arena(&mut dev, None, &mut a, u64::MAX, true);
        }
        if released > 0 {
            if let Some(rec) = &c.recorder {
                rec.reserved(dev.reserved[0].current.max(0) as u64);
            }
        }
        released
    }

    /// Releases cached memory above `release_threshold` (nothing when no threshold is set;
    /// `empty_cache` releases all of it).
    pub fn trim(&self) {
        let mut dev = self.state.lock();
        self.release_over_threshold(&mut dev, None, true);
    }

    /// Sets the per-process limit as a fraction of device memory (`[0, 1]`).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) || fraction.is_nan() {
            return Err(Error::InvalidArgument(format!(
                "memory fraction {fraction} is outside [0, 1]"
            )));
        }
        let mut cfg = self.core.config.clone();
        cfg.memory_fraction = fraction;
        let mut dev = self.state.lock();
        dev.limit = cfg.limit_for(self.core.caps.total_memory);
        dev.fraction = fraction;
        // A limit lowered below what is reserved: give cached memory back down to the limit.
        // What live blocks keep above it stays (it can only shrink from here: growth stops at
        // the limit), and the invariant checker allows exactly that much.
        let mut over = (dev.reserved[0].current.max(0) as u64).saturating_sub(dev.limit);
        if over > 0 {
            self.finish_deferred(&mut dev, true);
            for arena in self.donors() {
                if over == 0 {
                    break;
                }
                let mut st = arena.state.lock();
                over = over.saturating_sub(self.release_arena(
                    &mut dev,
                    arena.handle_here(),
                    &mut st,
                    over,
                    true,
                ));
            }
        }
        dev.over_limit = dev.reserved[0].current.max(0) as u64;
        Ok(())
    }

    /// The fraction last set (or configured).
    pub fn memory_fraction(&self) -> f64 {
        self.state.lock().fraction
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;

    use crate::config::Config;
    use crate::driver::sim::{SimConfig, SimDriver};
    use crate::driver::StreamId;
    use crate::pool::DevicePool;

    /// The streams a device synchronisation asks of (`DeviceCore::sync_device`) are those with
    /// an arena: a stream forgotten, or whose dormant arena was swept, leaves the list; the
    /// special handles are never in it.
    #[test]
    fn the_streams_asked_before_a_device_sync_are_those_with_an_arena() {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let pool = DevicePool::new(sim, 0, Config::default()).unwrap();
        let known = |pool: &DevicePool<SimDriver>| {
            let mut v: Vec<u64> = pool.core.streams.lock().iter().map(|s| s.0).collect();
            v.sort_unstable();
            v
        };
        for s in [
            StreamId::DEFAULT,
            StreamId::LEGACY,
            StreamId(10),
            StreamId(11),
        ] {
            let p = pool.alloc_raw(4096, s).unwrap();
            pool.free_raw(p, s).unwrap();
        }
        assert_eq!(known(&pool), [10, 11]);
        pool.forget_stream(StreamId(10));
        assert_eq!(known(&pool), [11]);
        // Stream 11's arena, its memory released, is dormant: the next growth sweeps it.
        pool.empty_cache();
        pool.sweep_wanted.store(true, Relaxed);
        let p = pool.alloc_raw(64 << 20, StreamId(12)).unwrap();
        assert_eq!(known(&pool), [12]);
        pool.free_raw(p, StreamId(12)).unwrap();
    }
}
