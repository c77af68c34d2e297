//! The arena's invariant check: heaps, page tables, the live map and the gauges agree. Tests run
//! it (through `DevicePool::check_invariants`) after every operation.

use super::{ArenaState, Backing, HeapKind};
use crate::heap::SpanState;
use crate::stats::Gauge;

impl ArenaState {
    /// Checks this arena's consistency: heaps, page tables, live map and gauges. `granularity`
    /// is the page size. Returns the number of mapped pages (for the device-wide check).
    pub fn check(&self, granularity: u64) -> Result<u64, String> {
        let mut mapped = 0u64;
        let mut live_count = [0i64; 2];
        let mut live_bytes = [0i64; 2];
        let mut requested = [0i64; 2];
        let mut pending = [0i64; 2];
        let mut pending_bytes = [0i64; 2];
        for (kind, kh) in self.kinds.iter() {
            let k = kind as usize;
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
                                Some(r) if r.span == id && r.kind == kind => {}
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
                            if !self.pending.iter().any(|p| p.span == id && p.kind == kind) {
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
                    // Each chunk's mapping is whole: `len` consecutive entries of one handle,
                    // indexed 0..len.
                    for (i, p) in pages.iter().enumerate() {
                        let Some(p) = p else { continue };
                        let ok = p.len > 0
                            && p.index < p.len
                            && if p.index == 0 {
                                i + p.len as usize <= pages.len()
                            } else {
                                i > 0
                                    && pages[i - 1].is_some_and(|q| {
                                        q.handle == p.handle
                                            && q.len == p.len
                                            && q.index + 1 == p.index
                                    })
                            };
                        if !ok {
                            return Err(format!(
                                "page {i} of segment {:#x}: chunk mapping broken ({p:?})",
                                seg.base
                            ));
                        }
                        let last = p.index + 1 == p.len;
                        let next_same = pages
                            .get(i + 1)
                            .copied()
                            .flatten()
                            .is_some_and(|q| q.handle == p.handle);
                        if last == next_same {
                            return Err(format!(
                                "page {i} of segment {:#x}: chunk mapping ends wrongly ({p:?})",
                                seg.base
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
        for kind in HeapKind::ALL {
            let (k, p) = (kind as usize, kind.pool_index());
            let h = &self.kinds[kind].heap;
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
