//! What the pool tells: statistics with PyTorch's names, the invariant check, live views
//! (blocks, ledger, marks), segment snapshots, and the device report.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::DevicePool;
use crate::arena::{Backing, HeapKind};
use crate::driver::{DeviceId, Driver, StreamId};
use crate::error::OomReport;
use crate::heap::SpanState;
use crate::provenance::{LedgerEntry, LiveBlock, Mark};
use crate::stats::{ExactGauge, Stats, GAUGES, GAUGE_NAMES, POOL_NAMES};

/// What a caller sizing a workspace may count on (PyTorch's `cacheInfo`, with which cuDNN
/// sizes its convolution workspaces).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheInfo {
    /// The largest free block of any arena: what an allocation of that size may reuse at once.
    pub largest_free: u64,
    /// The bytes growth may still map: the device's free memory, no more than the limit leaves.
    pub room: u64,
}

impl<D: Driver> DevicePool<D> {
    /// The largest free block and the room to grow (see [`CacheInfo`]). PyTorch's allocator
    /// answers `cacheInfo` with the larger of the device's free memory and its largest cached
    /// block, graph pools' included (a capture's workspace comes from its pool); a caller
    /// wanting the same takes the larger of the two. Costs a `cuMemGetInfo` and a scan of
    /// every arena's free spans: not for a hot path.
    pub fn cache_info(&self) -> CacheInfo {
        let c = &*self.core;
        let mut largest_free = 0;
        for arena in self.all_arenas() {
            largest_free = largest_free.max(arena.state.lock().largest_free());
        }
        let (reserved, limit) = {
            let dev = self.state.lock();
            (dev.reserved[0].current.max(0) as u64, dev.limit)
        };
        let free = c.driver.mem_info(c.dev).map_or(0, |i| i.free);
        CacheInfo {
            largest_free,
            room: free.min(limit.saturating_sub(reserved)),
        }
    }

    /// The report of this device's last failed request (out of memory or over the limit), if
    /// any request failed yet.
    pub fn last_oom(&self) -> Option<OomReport> {
        self.state.lock().last_oom.as_deref().cloned()
    }

    /// The device's statistics, with PyTorch's key names.
    pub fn stats(&self) -> Stats {
        let c = &*self.core;
        let dev = self.state.lock();
        let mut cur = [[0i64; 3]; GAUGES];
        // Arenas dropped for good count too: "allocated" and "freed" never go down.
        let mut inc = dev.gone[0];
        let mut dec = dev.gone[1];
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            for g in 0..GAUGES {
                for p in 0..3 {
                    cur[g][p] += a.gauges.cur[g][p];
                    inc[g][p] += a.gauges.increases(g, p);
                    dec[g][p] += a.gauges.decreases(g, p);
                }
            }
        }
        let mut s = Stats::default();
        for g in 0..GAUGES {
            for p in 0..3 {
                c.shared.raise_peak(g, p, cur[g][p]);
                s.set_gauge(
                    GAUGE_NAMES[g],
                    POOL_NAMES[p],
                    ExactGauge {
                        current: cur[g][p],
                        peak: c.shared.peak(g, p),
                        allocated: inc[g][p],
                        freed: dec[g][p],
                    },
                );
            }
        }
        for p in 0..3 {
            s.set_gauge("reserved_bytes", POOL_NAMES[p], dev.reserved[p]);
            s.set_gauge("segment", POOL_NAMES[p], dev.segments[p]);
            // cistern never makes oversize allocations/segments (no max_split_size); kept for
            // key compatibility with PyTorch.
            s.set_gauge("oversize_allocations", POOL_NAMES[p], ExactGauge::default());
            s.set_gauge("oversize_segments", POOL_NAMES[p], ExactGauge::default());
        }
        for (id, g) in &dev.private_reserved {
            let name = format!("reserved_bytes_by_private_pools.{}_{}", id.0, id.1);
            for p in 0..3 {
                s.set_gauge(&name, POOL_NAMES[p], g[p]);
            }
        }
        let k = &c.counters;
        for (name, v) in [
            ("num_alloc_retries", &k.num_alloc_retries),
            ("num_ooms", &k.num_ooms),
            ("num_limit_ooms", &k.num_limit_ooms),
            ("num_invalid_frees", &k.num_invalid_frees),
            ("num_stitches", &k.num_stitches),
            ("num_stitched_pages", &k.num_stitched_pages),
            ("num_cross_stream_pages", &k.num_cross_stream_pages),
            ("num_device_alloc", &k.num_device_alloc),
            ("num_device_free", &k.num_device_free),
            ("num_sync_all_streams", &k.num_sync_all_streams),
            ("num_stream_syncs", &k.num_stream_syncs),
            ("num_pending_frees", &k.num_pending_frees),
            ("num_released_pages", &k.num_released_pages),
            ("num_driver_errors", &k.num_driver_errors),
            ("num_record_streams", &k.num_record_streams),
            ("num_ordered_moves", &k.num_ordered_moves),
            ("num_deferred_unmaps", &k.num_deferred_unmaps),
        ] {
            s.set(name, v.load(Relaxed) as i64);
        }
        s.set("max_split_size", -1);
        s.set("memory_limit", dev.limit.min(i64::MAX as u64) as i64);
        s.set("num_streams", self.arenas.read().len() as i64);
        s
    }

    /// Sets every peak to its current value; a released graph pool's reserved bytes are
    /// forgotten then.
    pub fn reset_peak_stats(&self) {
        let c = &*self.core;
        let live: Vec<(u64, u64)> = self
            .graph_pools()
            .iter()
            .map(|p| (p.id.0, p.id.1))
            .collect();
        let mut dev = self.state.lock();
        dev.private_reserved
            .retain(|id, g| g[0].current != 0 || live.contains(id));
        for g in dev.private_reserved.values_mut() {
            for x in g.iter_mut() {
                x.peak = x.current;
            }
        }
        let arenas = self.all_arenas();
        let mut guards: Vec<_> = arenas.iter().map(|a| a.state.lock()).collect();
        let mut cur = [[0i64; 3]; GAUGES];
        for gd in guards.iter_mut() {
            gd.gauges.publish_all(&c.shared);
            for (g, row) in cur.iter_mut().enumerate() {
                for (p, v) in row.iter_mut().enumerate() {
                    *v += gd.gauges.cur[g][p];
                }
            }
        }
        c.shared.reset_peaks(&cur);
        for p in 0..3 {
            dev.reserved[p].peak = dev.reserved[p].current;
            dev.segments[p].peak = dev.segments[p].current;
        }
    }

    /// Checks the whole pool's consistency (see `crate::arena`); tests run it after every
    /// operation. Returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let c = &*self.core;
        let dev = self.state.lock();
        let mut mapped = 0u64;
        let mut linear = [0u64; 2];
        // The bytes each graph pool's arenas hold, live or retired.
        let mut by_pool: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            let pages = a
                .check(c.granularity)
                .map_err(|e| format!("arena of stream {}: {e}", arena.stream))?;
            mapped += pages;
            let mut held = pages * c.granularity;
            for (kind, kh) in a.kinds.iter() {
                let k = kind as usize;
                for seg in kh.segments.iter().flatten() {
                    if matches!(seg.backing, Backing::Linear) {
                        linear[k] += seg.len;
                        held += seg.len;
                    }
                    let ranges = self.ranges.read();
                    match ranges.get(&seg.base) {
                        Some((end, w))
                            if *end == seg.base + seg.len && w.as_ptr() == Arc::as_ptr(&arena) => {}
                        _ => {
                            return Err(format!(
                                "segment {:#x} missing from the range index",
                                seg.base
                            ))
                        }
                    }
                }
            }
            if let Some(id) = arena.graph_pool {
                *by_pool.entry(id).or_default() += held;
            }
        }
        for (id, g) in &dev.private_reserved {
            let held = by_pool.remove(id).unwrap_or(0);
            if g[0].current < 0 || g[0].current as u64 != held {
                return Err(format!(
                    "graph pool ({}, {}) counts {} reserved bytes, but its arenas hold {held}",
                    id.0, id.1, g[0].current
                ));
            }
            if g[0].current != g[1].current + g[2].current {
                return Err(format!(
                    "graph pool ({}, {}): reserved all != small + large",
                    id.0, id.1
                ));
            }
        }
        if let Some((id, held)) = by_pool.into_iter().find(|&(_, held)| held > 0) {
            return Err(format!(
                "graph pool ({}, {}) holds {held} bytes that no reserved count has",
                id.0, id.1
            ));
        }
        // The old mapping of a chunk moved ordered on the device sits in a hole of the heap it
        // left (so that no window maps over it), and the chunk is mapped, lost or stuck
        // elsewhere.
        for al in dev.deferred.iter().flat_map(|d| &d.aliases) {
            let (lo, hi) = (al.addr, al.addr + al.len);
            let mut in_hole = false;
            let mut elsewhere = dev.lost.iter().any(|l| l.chunk.handle == al.handle)
                || dev.stuck.iter().any(|s| s.chunk.handle == al.handle);
            for arena in self.all_arenas() {
                let a = arena.state.lock();
                for (_, kh) in a.kinds.iter() {
                    for seg in kh.segments.iter().flatten() {
                        let Backing::Vmm { pages } = &seg.backing else {
                            continue;
                        };
                        elsewhere |= pages.iter().flatten().any(|p| p.handle == al.handle);
                        if seg.base <= lo && hi <= seg.base + seg.len {
                            in_hole |= kh.heap.segment_spans(seg.first).any(|(_, s)| {
                                s.state == crate::heap::SpanState::Hole
                                    && s.start <= lo
                                    && hi <= s.end()
                            });
                        }
                    }
                }
            }
            if !in_hole || !elsewhere {
                return Err(format!(
                    "deferred unmap [{lo:#x}, {hi:#x}) of handle {}: in a hole {in_hole}, \
                     mapped or lost elsewhere {elsewhere}",
                    al.handle.0
                ));
            }
        }
        let reserved = dev.reserved[0].current as u64;
        let lost_pages: u64 = dev.lost.iter().map(|l| l.chunk.pages as u64).sum::<u64>()
            + dev.stuck.iter().map(|s| s.chunk.pages as u64).sum::<u64>();
        let lost = lost_pages * c.granularity;
        let expect = mapped * c.granularity + linear[0] + linear[1] + lost;
        if reserved != expect {
            return Err(format!(
                "reserved_bytes is {reserved}, but {mapped} pages are mapped, {} B of \
                 segments allocated and {} B of handles lost ({expect} B)",
                linear[0] + linear[1],
                lost
            ));
        }
        if dev.reserved[0].current != dev.reserved[1].current + dev.reserved[2].current {
            return Err("reserved all != small + large".into());
        }
        if reserved > dev.limit.max(dev.over_limit) {
            return Err(format!(
                "reserved {reserved} exceeds the limit {}",
                dev.limit
            ));
        }
        Ok(())
    }

    /// Live blocks sorted by address, for reports and tests (with provenance:
    /// [`DevicePool::live_blocks_detailed`]).
    pub fn live_blocks(&self) -> Vec<BlockInfo> {
        let mut out = Vec::new();
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            for (&ptr, r) in &a.live {
                let s = a.kinds[r.kind].heap.span(r.span);
                out.push(BlockInfo {
                    ptr,
                    size: s.len,
                    requested: s.requested,
                    stream: arena.stream,
                });
            }
        }
        out.sort_unstable();
        out
    }

    /// Live bytes, blocks, peaks and total allocations per (tag, site) on this device, largest
    /// live bytes first (empty with `provenance:off`). Sums the arenas' ledgers under the
    /// device lock (it holds every arena's lock at once, which only the device lock's holder
    /// may do: growth locks other arenas while holding its own).
    pub fn ledger(&self) -> Vec<LedgerEntry> {
        let _dev = self.state.lock();
        let arenas = self.all_arenas();
        let guards: Vec<_> = arenas.iter().map(|a| a.state.lock()).collect();
        crate::provenance::merge_ledgers(guards.iter().map(|g| &g.ledger))
    }

    /// A point in this device's allocation history, for [`DevicePool::live_since`]. Exact per
    /// stream (it reads each arena's sequence number); needs provenance on.
    pub fn mark(&self) -> Mark {
        let seqs = self
            .all_arenas()
            .iter()
            .map(|a| (a.sref.id, a.state.lock().seq))
            .collect();
        Mark {
            pool: self.core.uid,
            seqs,
            time_ns: crate::provenance::now_ns(),
        }
    }

    /// The blocks allocated after `mark` and still live (sorted by address): with a mark taken
    /// every step of a training loop, what each step leaked. Empty with `provenance:off`, or
    /// for a mark of another pool.
    pub fn live_since(&self, mark: &Mark) -> Vec<LiveBlock> {
        if mark.pool != self.core.uid {
            return Vec::new();
        }
        self.live_detailed(|stream| Some(mark.seq_of(stream)))
    }

    /// Every live block with its provenance, sorted by address.
    pub fn live_blocks_detailed(&self) -> Vec<LiveBlock> {
        self.live_detailed(|_| None)
    }

    /// Live blocks whose sequence number is above `after(arena's stream id)` (all for `None`).
    pub(super) fn live_detailed(&self, after: impl Fn(u64) -> Option<u64>) -> Vec<LiveBlock> {
        let now = crate::provenance::now_ns();
        let mut out = Vec::new();
        for arena in self.all_arenas() {
            let seq = after(arena.sref.id);
            let a = arena.state.lock();
            for (&ptr, r) in &a.live {
                let h = &a.kinds[r.kind].heap;
                let m = h.meta(r.span);
                if seq.is_some_and(|q| m.seq <= q) {
                    continue;
                }
                let s = h.span(r.span);
                out.push(LiveBlock {
                    ptr,
                    size: s.len,
                    requested: s.requested,
                    stream: arena.stream.0,
                    tag: crate::provenance::tag_name(m.tag),
                    site: (m.site != 0).then_some(m.site),
                    thread: m.thread,
                    time_ns: m.time_ns,
                    age: std::time::Duration::from_nanos(if m.time_ns == 0 {
                        0
                    } else {
                        now.saturating_sub(m.time_ns)
                    }),
                });
            }
        }
        out.sort_unstable_by_key(|b| b.ptr);
        out
    }

    /// Every mapped range of this device's pool with the blocks that tile it, sorted by
    /// address: the data of PyTorch's `torch.cuda.memory._snapshot()["segments"]`.
    ///
    /// A `cuMemAlloc` segment is one entry. A VMM extent is reported as one entry per run of
    /// mapped pages (unmapped address space is left out), as PyTorch reports expandable
    /// segments. The blocks of an entry cover it exactly, in address order. Takes each arena's
    /// lock in turn (never two at once): a read for reports and debugging, not for a hot path.
    pub fn segments_snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut out = Vec::new();
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            for (kind, kh) in a.kinds.iter() {
                for seg in kh.segments.iter().flatten() {
                    let expandable = matches!(seg.backing, Backing::Vmm { .. });
                    let mut run: Option<SegmentSnapshot> = None;
                    for (id, s) in kh.heap.segment_spans(seg.first) {
                        let state = match s.state {
                            SpanState::Live => BlockState::Allocated,
                            SpanState::Pending => BlockState::PendingFree,
                            SpanState::Free => BlockState::Free,
                            SpanState::Hole | SpanState::Vacant => {
                                out.extend(run.take());
                                continue;
                            }
                        };
                        let r = run.get_or_insert_with(|| SegmentSnapshot {
                            device: self.core.dev,
                            address: s.start,
                            total_size: 0,
                            stream: arena.stream.0,
                            large: kind == HeapKind::Large,
                            expandable,
                            pool_id: arena.graph_pool.unwrap_or((0, 0)),
                            blocks: Vec::new(),
                        });
                        r.total_size += s.len;
                        // Free blocks carry no provenance.
                        let meta = (state != BlockState::Free).then(|| kh.heap.meta(id));
                        r.blocks.push(BlockSnapshot {
                            address: s.start,
                            size: s.len,
                            requested_size: if state == BlockState::Free {
                                0
                            } else {
                                s.requested
                            },
                            state,
                            tag: meta
                                .filter(|m| m.tag != 0)
                                .and_then(|m| crate::provenance::tag_name(m.tag)),
                            site: meta.map(|m| m.site).filter(|&site| site != 0),
                        });
                    }
                    out.extend(run.take());
                }
            }
        }
        out.sort_unstable_by_key(|s| s.address);
        out
    }

    /// A summary of this device's pool.
    pub fn report(&self) -> DeviceReport {
        let s = self.stats();
        let largest = self
            .all_arenas()
            .iter()
            .map(|a| a.state.lock().largest_free())
            .max()
            .unwrap_or(0);
        DeviceReport {
            device: self.core.dev,
            name: self.core.caps.name.clone(),
            driver: self.core.driver.name(),
            vmm: self.core.vmm,
            granularity: self.core.granularity,
            total_memory: self.core.caps.total_memory,
            limit: self.limit(),
            reserved: s.get("reserved_bytes.all.current") as u64,
            peak_reserved: s.get("reserved_bytes.all.peak") as u64,
            live: s.get("allocated_bytes.all.current") as u64,
            peak_live: s.get("allocated_bytes.all.peak") as u64,
            requested: s.get("requested_bytes.all.current") as u64,
            pending: (s.get("active_bytes.all.current") - s.get("allocated_bytes.all.current"))
                .max(0) as u64,
            live_blocks: s.get("allocation.all.current") as u64,
            streams: s.get("num_streams") as u64,
            largest_free: largest,
            stitched_pages: s.get("num_stitched_pages") as u64,
            ooms: s.get("num_ooms") as u64,
            allocations: s.get("allocation.all.allocated") as u64,
            invalid_frees: s.get("num_invalid_frees") as u64,
        }
    }
}

/// A live block, as [`DevicePool::live_blocks`] lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockInfo {
    /// Its address.
    pub ptr: u64,
    /// Its size, rounded to the pool's 512 B unit.
    pub size: u64,
    /// The size that was asked for.
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: StreamId,
}

/// A summary of one device's pool: plain data with `Display` and serde.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceReport {
    /// Device ordinal.
    pub device: DeviceId,
    /// Device name.
    pub name: String,
    /// Driver backend name.
    pub driver: &'static str,
    /// Whether the pool maps pages itself.
    pub vmm: bool,
    /// Page size.
    pub granularity: u64,
    /// Device memory.
    pub total_memory: u64,
    /// Per-process limit.
    pub limit: u64,
    /// Bytes held from the driver.
    pub reserved: u64,
    /// Highest reserved bytes.
    pub peak_reserved: u64,
    /// Bytes in live blocks (rounded).
    pub live: u64,
    /// Highest live bytes.
    pub peak_live: u64,
    /// Bytes requested by users for live blocks.
    pub requested: u64,
    /// Bytes freed but waiting on other streams.
    pub pending: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Streams that allocated.
    pub streams: u64,
    /// Largest free range.
    pub largest_free: u64,
    /// Pages moved by stitching.
    pub stitched_pages: u64,
    /// Failed requests.
    pub ooms: u64,
    /// Allocations made since the pool started.
    pub allocations: u64,
    /// Frees of unknown pointers.
    pub invalid_frees: u64,
}

impl std::fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::format_bytes as b;
        writeln!(
            f,
            "device {} ({}, driver {}, {}, page {})",
            self.device,
            self.name,
            self.driver,
            if self.vmm {
                "VMM"
            } else {
                "cuMemAlloc segments"
            },
            b(self.granularity)
        )?;
        writeln!(
            f,
            "  reserved {} (peak {}) of {} (limit {})",
            b(self.reserved),
            b(self.peak_reserved),
            b(self.total_memory),
            b(self.limit)
        )?;
        writeln!(
            f,
            "  live     {} in {} blocks (peak {}; requested {}), pending {}",
            b(self.live),
            self.live_blocks,
            b(self.peak_live),
            b(self.requested),
            b(self.pending)
        )?;
        write!(
            f,
            "  {} stream(s), largest free range {}, {} pages stitched, {} OOMs, {} invalid frees",
            self.streams,
            b(self.largest_free),
            self.stitched_pages,
            self.ooms,
            self.invalid_frees
        )
    }
}

/// One mapped range of a device pool, as [`DevicePool::segments_snapshot`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SegmentSnapshot {
    /// Device ordinal.
    pub device: DeviceId,
    /// First address.
    pub address: u64,
    /// Length in bytes (the sum of the blocks' sizes).
    pub total_size: u64,
    /// The raw handle of the stream whose arena owns the range.
    pub stream: u64,
    /// Whether it belongs to the large heap (else the small one).
    pub large: bool,
    /// Whether it is a run of mapped pages of a VMM extent (else one `cuMemAlloc` segment).
    pub expandable: bool,
    /// The graph pool (PyTorch's mempool id) it belongs to; `(0, 0)` outside graph pools, as
    /// PyTorch's `segment_pool_id` says.
    pub pool_id: (u64, u64),
    /// The blocks that tile the range, in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// One block of a [`SegmentSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockSnapshot {
    /// First address.
    pub address: u64,
    /// Length in bytes (rounded).
    pub size: u64,
    /// The size the user asked for (0 for a free block).
    pub requested_size: u64,
    /// What the block is.
    pub state: BlockState,
    /// The tag the block was allocated under, for live and pending blocks that have one.
    pub tag: Option<String>,
    /// The sampled call site of a live or pending block (`provenance:stacks`;
    /// [`crate::provenance::site_frames`] reads it).
    pub site: Option<u32>,
}

/// The state of a block in a snapshot, named as in PyTorch's snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum BlockState {
    /// Handed to a user (`active_allocated`).
    #[serde(rename = "active_allocated")]
    Allocated,
    /// Freed, but waiting for other streams' work (`active_pending_free`).
    #[serde(rename = "active_pending_free")]
    PendingFree,
    /// Free and reusable (`inactive`).
    #[serde(rename = "inactive")]
    Free,
}

impl BlockState {
    /// PyTorch's name for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::Allocated => "active_allocated",
            BlockState::PendingFree => "active_pending_free",
            BlockState::Free => "inactive",
        }
    }
}

#[cfg(test)]
mod snapshot_tests {
    use super::*;
    use crate::config::Config;
    use crate::driver::sim::{SimConfig, SimDriver};

    #[test]
    fn segments_snapshot_tiles_mapped_ranges() {
        for vmm in [true, false] {
            let sim = Arc::new(SimDriver::new(SimConfig::default()));
            let cfg = Config {
                vmm,
                ..Config::default()
            };
            let pool = DevicePool::new(sim, 0, cfg).unwrap();
            let s1 = StreamId(1);
            let a = pool.alloc_raw(1000, StreamId::DEFAULT).unwrap();
            let b = pool.alloc_raw(3 << 20, s1).unwrap();
            let c = pool.alloc_raw(4096, StreamId::DEFAULT).unwrap();
            pool.free_raw(c, StreamId::DEFAULT).unwrap();
            let segs = pool.segments_snapshot();
            assert!(segs.windows(2).all(|w| w[0].address < w[1].address));
            for seg in &segs {
                assert_eq!(seg.expandable, vmm);
                let mut at = seg.address;
                for blk in &seg.blocks {
                    assert_eq!(blk.address, at, "blocks tile the segment");
                    at += blk.size;
                }
                assert_eq!(at, seg.address + seg.total_size);
            }
            let find = |p: u64| {
                segs.iter()
                    .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
                    .find(|(_, b)| b.address == p)
                    .unwrap()
            };
            let (sa, ba) = find(a);
            assert_eq!(
                (ba.size, ba.requested_size, ba.state),
                (1024, 1000, BlockState::Allocated)
            );
            assert!(!sa.large);
            let (sb, bb) = find(b);
            assert_eq!(
                (bb.requested_size, bb.state, sb.stream),
                (3 << 20, BlockState::Allocated, 1)
            );
            assert!(sb.large);
            let live: u64 = segs
                .iter()
                .flat_map(|s| &s.blocks)
                .filter(|b| b.state == BlockState::Allocated)
                .map(|b| b.size)
                .sum();
            assert_eq!(live, pool.stats().get("allocated_bytes.all.current") as u64);
            pool.free_raw(a, StreamId::DEFAULT).unwrap();
            pool.free_raw(b, s1).unwrap();
        }
    }
}
