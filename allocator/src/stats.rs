//! Statistics: PyTorch's counter names, kept per arena without shared writes on the hot path.
//!
//! # Note [Sharded gauges]
//!
//! A gauge (`allocated_bytes`, `active`, ...) has a current value, a peak, and the cumulative
//! amounts added and removed. Each arena (one per stream) keeps its own exact share of every
//! gauge under its own lock, so two threads on two streams never write the same cache line on
//! the hot path. The device-wide current value is the sum of the shares, computed when stats are
//! read. The device-wide *peak* needs a shared value: each arena publishes its share into a
//! device-wide atomic sum only when its unpublished change could make a new peak (it exceeds the
//! headroom the arena saw at its last publish) or exceeds a slack of [`SLACK_BYTES`] /
//! [`SLACK_COUNT`]. With one active arena, peaks are therefore exact. With several arenas
//! allocating at once, a peak can read low by at most the slack per other arena: a deliberate
//! trade, measured by the two-thread bench, against a contended atomic per allocation.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

/// A per-arena gauge. The numeric values index arrays.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Gauge {
    /// Live blocks (`allocation`).
    Allocation = 0,
    /// Bytes in live blocks, rounded (`allocated_bytes`).
    AllocatedBytes = 1,
    /// Live or pending blocks (`active`).
    Active = 2,
    /// Bytes in live or pending blocks (`active_bytes`).
    ActiveBytes = 3,
    /// Free blocks inside mapped memory (`inactive_split`).
    InactiveSplit = 4,
    /// Bytes of free blocks inside mapped memory (`inactive_split_bytes`).
    InactiveSplitBytes = 5,
    /// Bytes the users asked for, before rounding (`requested_bytes`).
    RequestedBytes = 6,
}

/// Number of per-arena gauges.
pub const GAUGES: usize = 7;

/// PyTorch's names of the per-arena gauges, by index.
pub const GAUGE_NAMES: [&str; GAUGES] = [
    "allocation",
    "allocated_bytes",
    "active",
    "active_bytes",
    "inactive_split",
    "inactive_split_bytes",
    "requested_bytes",
];

/// The pool halves, as PyTorch names them.
pub const POOL_NAMES: [&str; 3] = ["all", "small_pool", "large_pool"];

/// Unpublished bytes an arena may hold back from the device-wide sum (see the note).
pub const SLACK_BYTES: i64 = 8 << 20;
/// Unpublished counts an arena may hold back from the device-wide sum.
pub const SLACK_COUNT: i64 = 256;

const fn slack(g: usize) -> i64 {
    match g {
        0 | 2 | 4 => SLACK_COUNT,
        _ => SLACK_BYTES,
    }
}

/// Device-wide published sums and peaks of the per-arena gauges.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct SharedGauges {
    sum: [[AtomicI64; 3]; GAUGES],
    peak: [[AtomicI64; 3]; GAUGES],
}

impl SharedGauges {
    /// The published peak of gauge `g` in pool `p` (0 all, 1 small, 2 large).
    pub fn peak(&self, g: usize, p: usize) -> i64 {
        self.peak[g][p].load(Relaxed)
    }

    /// Sets every peak to `current[g][p]` (after every arena has published).
    pub fn reset_peaks(&self, current: &[[i64; 3]; GAUGES]) {
        for g in 0..GAUGES {
            for p in 0..3 {
                self.peak[g][p].store(current[g][p], Relaxed);
            }
        }
    }

    /// Raises the peak to at least `v` (used when a read finds the sum above a stale peak).
    pub fn raise_peak(&self, g: usize, p: usize, v: i64) {
        self.peak[g][p].fetch_max(v, Relaxed);
    }
}

/// One arena's share of the gauges. Only touched under the arena's lock.
///
/// Hot-path cost matters here (two updates per allocate/free pair), so the publish test is
/// precomputed as a band `[lo, hi]` around the last published value: the current value leaving
/// the band (a possible new peak, or a drift beyond the slack) triggers a publish.
#[derive(Debug, Clone, Default)]
pub struct LocalGauges {
    /// This arena's current share, `[gauge][pool]` with pool 0 = all, 1 small, 2 large.
    pub cur: [[i64; 3]; GAUGES],
    inc: [[i64; 3]; GAUGES],
    published: [[i64; 3]; GAUGES],
    hi: [[i64; 3]; GAUGES],
    lo: [[i64; 3]; GAUGES],
}

impl LocalGauges {
    /// Adds `delta` to gauge `g` in pool `p` (1 small, 2 large) and in `all`.
    #[inline]
    pub fn add(&mut self, g: Gauge, p: usize, delta: i64, shared: &SharedGauges) {
        let mut d = [0i64; GAUGES];
        d[g as usize] = delta;
        self.apply(p, &d, shared);
    }

    /// Adds `deltas[g]` to every gauge `g` in pool `p` (1 small, 2 large) and in `all`: the one
    /// call an allocation or a free makes.
    #[inline(always)]
    pub fn apply(&mut self, p: usize, deltas: &[i64; GAUGES], shared: &SharedGauges) {
        let mut out = false;
        for g in 0..GAUGES {
            let d = deltas[g];
            let c = self.cur[g][p] + d;
            let a = self.cur[g][0] + d;
            self.cur[g][p] = c;
            self.cur[g][0] = a;
            self.inc[g][p] += d.max(0);
            self.inc[g][0] += d.max(0);
            out |= (c > self.hi[g][p])
                | (c < self.lo[g][p])
                | (a > self.hi[g][0])
                | (a < self.lo[g][0]);
        }
        if out {
            self.publish_out_of_band(shared);
        }
    }

    #[cold]
    #[inline(never)]
    fn publish_out_of_band(&mut self, shared: &SharedGauges) {
        for g in 0..GAUGES {
            for q in 0..3 {
                let c = self.cur[g][q];
                if c > self.hi[g][q] || c < self.lo[g][q] {
                    self.publish(g, q, shared);
                }
            }
        }
    }

    /// Cumulative increases of gauge `g` in pool `p` (0: all).
    pub fn increases(&self, g: usize, p: usize) -> i64 {
        self.inc[g][p]
    }

    /// Cumulative decreases of gauge `g` in pool `p` (0: all).
    pub fn decreases(&self, g: usize, p: usize) -> i64 {
        self.inc[g][p] - self.cur[g][p]
    }

    fn publish(&mut self, g: usize, q: usize, shared: &SharedGauges) {
        let delta = self.cur[g][q] - self.published[g][q];
        let sum = shared.sum[g][q].fetch_add(delta, Relaxed) + delta;
        let pubd = self.cur[g][q];
        self.published[g][q] = pubd;
        let peak = shared.peak[g][q].fetch_max(sum, Relaxed).max(sum);
        let s = slack(g);
        self.hi[g][q] = pubd + (peak - sum).min(s - 1);
        self.lo[g][q] = pubd - (s - 1);
    }

    /// Publishes every unpublished change (before a peak reset); afterwards any increase
    /// publishes again, so the next peak is seen.
    pub fn publish_all(&mut self, shared: &SharedGauges) {
        for g in 0..GAUGES {
            for q in 0..3 {
                if self.cur[g][q] != self.published[g][q] {
                    self.publish(g, q, shared);
                }
                self.hi[g][q] = self.published[g][q];
            }
        }
    }
}

/// A device-level gauge kept under the device lock (reserved bytes, segments): exact.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ExactGauge {
    /// Current value.
    pub current: i64,
    /// Highest value since the last reset.
    pub peak: i64,
    /// Cumulative increases.
    pub allocated: i64,
    /// Cumulative decreases.
    pub freed: i64,
}

impl ExactGauge {
    /// Adds `delta`.
    pub fn add(&mut self, delta: i64) {
        self.current += delta;
        if delta > 0 {
            self.allocated += delta;
        } else {
            self.freed -= delta;
        }
        self.peak = self.peak.max(self.current);
    }
}

/// A snapshot of a device's statistics, keyed by PyTorch's `memory_stats()` names
/// (`allocated_bytes.all.current`, `reserved_bytes.large_pool.peak`, `num_ooms`, ...) plus
/// cistern's own (`num_stitches`, `num_invalid_frees`, `num_driver_calls.<call>`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(transparent)]
pub struct Stats {
    /// Every counter by name.
    pub values: BTreeMap<String, i64>,
}

impl Stats {
    /// The value of a counter; 0 when absent.
    pub fn get(&self, key: &str) -> i64 {
        self.values.get(key).copied().unwrap_or(0)
    }

    /// Sets a counter.
    pub fn set(&mut self, key: impl Into<String>, v: i64) {
        self.values.insert(key.into(), v);
    }

    /// Writes the four metrics of a gauge under `name.pool.*`.
    pub fn set_gauge(&mut self, name: &str, pool: &str, g: ExactGauge) {
        self.set(format!("{name}.{pool}.current"), g.current);
        self.set(format!("{name}.{pool}.peak"), g.peak);
        self.set(format!("{name}.{pool}.allocated"), g.allocated);
        self.set(format!("{name}.{pool}.freed"), g.freed);
    }

    /// The stats as a JSON object.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.values).unwrap_or_else(|_| "{}".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_arena_peaks_are_exact() {
        let shared = SharedGauges::default();
        let mut a = LocalGauges::default();
        let mut max = 0;
        let mut cur = 0;
        for i in 0..1000i64 {
            let d = if i % 3 == 0 {
                -(i % 7) * 512
            } else {
                (i % 11) * 512
            };
            if cur + d < 0 {
                continue;
            }
            cur += d;
            max = max.max(cur);
            a.add(Gauge::AllocatedBytes, 2, d, &shared);
            assert_eq!(shared.peak(1, 0), max, "step {i}");
            assert_eq!(shared.peak(1, 2), max);
        }
        assert_eq!(a.cur[1][0], cur);
    }

    #[test]
    fn two_arenas_peak_within_slack() {
        let shared = SharedGauges::default();
        let mut a = LocalGauges::default();
        let mut b = LocalGauges::default();
        let mut max = 0;
        for i in 0..10_000i64 {
            let d = ((i * 7919) % 13 - 6) * 4096;
            let (x, y) = if i % 2 == 0 {
                (&mut a, &b)
            } else {
                (&mut b, &a)
            };
            if x.cur[1][0] + d < 0 {
                continue;
            }
            x.add(Gauge::AllocatedBytes, 1, d, &shared);
            max = max.max(x.cur[1][0] + y.cur[1][0]);
            let p = shared.peak(1, 0);
            assert!(
                p <= max + SLACK_BYTES && p >= max - SLACK_BYTES,
                "{p} vs {max}"
            );
        }
        a.publish_all(&shared);
        b.publish_all(&shared);
        assert!(shared.peak(1, 0) >= max - SLACK_BYTES);
    }
}
