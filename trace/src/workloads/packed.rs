//! Static-lifetime instances with a known optimum, made in the way of google/minimalloc's
//! "challenging" benchmarks, so that the main command has them on a fresh clone.
//!
//! A rectangle of `TIME` time units by `CAPACITY` bytes is cut, one guillotine cut at a time,
//! into `n` pieces: each piece is a buffer that lives for its time extent at its address extent.
//! The pieces partition the rectangle, so at *every* instant the live buffers tile the whole
//! address range: the instance packs exactly into `CAPACITY`, and no packing does better
//! (`CAPACITY` is live at once). Lifetimes of pieces that are not live at one chosen instant are
//! then shortened at random until the area filled (Σ size × lifetime over `TIME × CAPACITY`)
//! drops to a target; the instant keeps its full tiling, so the optimum stays exactly
//! `CAPACITY`, while the free space between buffers is what makes an online allocator strand
//! memory.
//!
//! The ten instances ([`INSTANCES`]) take their buffer counts and fill ratios from minimalloc's
//! eleven challenging instances A–K (154–454 buffers, fill 0.57–0.98), so the set spans the same
//! range. As with the `minimalloc-*` workloads, sizes are multiplied by 64: the optimum is
//! 64 MiB.

use crate::minimalloc;
use crate::sequence::AllocSequence;

use super::Rng;

/// Time units of the rectangle.
const TIME: u64 = 1 << 20;
/// Bytes of the rectangle: the optimum before scaling.
pub const CAPACITY: u64 = 1 << 20;
/// Address cuts fall on multiples of this (minimalloc's sizes are multiples of 1 KiB).
const ALIGN: u64 = 1024;
/// The size multiplier, as for the `minimalloc-*` workloads.
pub const SCALE: u64 = 64;

/// `(name suffix, buffers, fill ratio)`: buffer counts and fills of minimalloc's challenging
/// instances A, B, C, D, E, F, H, I, J and K.
pub const INSTANCES: [(&str, usize, f64); 10] = [
    ("A", 154, 0.95),
    ("B", 170, 0.98),
    ("C", 203, 0.97),
    ("D", 213, 0.89),
    ("E", 215, 0.89),
    ("F", 296, 0.61),
    ("H", 316, 0.57),
    ("I", 374, 0.90),
    ("J", 409, 0.81),
    ("K", 454, 0.94),
];

/// One piece: `[t0, t1)` × `[a0, a1)`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    t0: u64,
    t1: u64,
    a0: u64,
    a1: u64,
}

impl Piece {
    fn area(&self) -> u128 {
        (self.t1 - self.t0) as u128 * (self.a1 - self.a0) as u128
    }
}

/// The instance with `n` buffers and about `fill` of the rectangle used, as minimalloc CSV
/// text (`id,lower,upper,size`, unscaled).
pub(crate) fn csv(rng: &mut Rng, n: usize, fill: f64) -> String {
    let mut pieces = vec![Piece {
        t0: 0,
        t1: TIME,
        a0: 0,
        a1: CAPACITY,
    }];
    // Cut a piece chosen with probability proportional to its area, along an axis with room,
    // at a point uniform in the middle 80% of that extent.
    let mut guard = 0;
    while pieces.len() < n && guard < 100 * n {
        guard += 1;
        let total: u128 = pieces.iter().map(Piece::area).sum();
        let mut pick = (rng.unit() * total as f64) as u128;
        let mut k = 0;
        while k + 1 < pieces.len() && pick >= pieces[k].area() {
            pick -= pieces[k].area();
            k += 1;
        }
        let p = pieces[k];
        let can_time = p.t1 - p.t0 >= 2;
        let can_addr = p.a1 - p.a0 >= 2 * ALIGN;
        let by_time = match (can_time, can_addr) {
            (false, false) => continue,
            (true, false) => true,
            (false, true) => false,
            (true, true) => rng.below(2) == 0,
        };
        let at = |lo: u64, hi: u64, align: u64, rng: &mut Rng| {
            let span = (hi - lo) / align;
            let cut = (span as f64 * (0.1 + 0.8 * rng.unit())).round() as u64;
            lo + cut.clamp(1, span - 1) * align
        };
        if by_time {
            let t = at(p.t0, p.t1, 1, rng);
            pieces[k].t1 = t;
            pieces.push(Piece { t0: t, ..p });
        } else {
            let a = at(p.a0, p.a1, ALIGN, rng);
            pieces[k].a1 = a;
            pieces.push(Piece { a0: a, ..p });
        }
    }
    // Shorten the lifetimes of pieces not live at `instant` until the fill is reached.
    let instant = TIME / 4 + rng.below(TIME / 2);
    let target = (fill.clamp(0.05, 1.0) * (TIME as f64) * (CAPACITY as f64)) as u128;
    let mut area: u128 = pieces.iter().map(Piece::area).sum();
    let movable: Vec<usize> = (0..pieces.len())
        .filter(|&k| !(pieces[k].t0 <= instant && instant < pieces[k].t1))
        .collect();
    let mut rounds = 0;
    while area > target && !movable.is_empty() && rounds < 100 * n {
        rounds += 1;
        let k = movable[rng.below(movable.len() as u64) as usize];
        let p = &mut pieces[k];
        let life = p.t1 - p.t0;
        if life < 2 {
            continue;
        }
        let keep = ((life as f64) * (0.3 + 0.6 * rng.unit())).round() as u64;
        let keep = keep.clamp(1, life - 1);
        let start = p.t0 + rng.below(life - keep + 1);
        let before = p.area();
        p.t0 = start;
        p.t1 = start + keep;
        area -= before - p.area();
    }
    let mut out = String::from("id,lower,upper,size\n");
    for (id, p) in pieces.iter().enumerate() {
        out.push_str(&format!("{id},{},{},{}\n", p.t0, p.t1, p.a1 - p.a0));
    }
    out
}

/// The workload `packed-<suffix>` as a sequence (sizes × [`SCALE`]).
pub(crate) fn sequence(rng: &mut Rng, n: usize, fill: f64) -> Result<AllocSequence, String> {
    minimalloc::parse_csv(&csv(rng, n, fill), SCALE)
        .map_err(|e| format!("generated an invalid instance: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses the CSV back into pieces: `(lower, upper, size)`.
    fn rows(text: &str) -> Vec<(u64, u64, u64)> {
        text.lines()
            .skip(1)
            .map(|l| {
                let f: Vec<u64> = l.split(',').map(|x| x.parse().unwrap()).collect();
                (f[1], f[2], f[3])
            })
            .collect()
    }

    #[test]
    fn every_instance_packs_exactly_into_its_capacity_at_its_fill() {
        for (k, &(name, n, fill)) in INSTANCES.iter().enumerate() {
            let mut rng = Rng::new(k as u64);
            let r = rows(&csv(&mut rng, n, fill));
            assert_eq!(r.len(), n, "{name}: buffer count");
            // The most bytes live at once is exactly the capacity: the lower bound every
            // packing must meet, and the generator's own packing meets it.
            let mut events: Vec<(u64, i64)> = Vec::new();
            for &(lo, hi, size) in &r {
                assert!(
                    lo < hi && size > 0 && size % ALIGN == 0,
                    "{name}: {lo} {hi} {size}"
                );
                events.push((lo, size as i64));
                events.push((hi, -(size as i64)));
            }
            events.sort_by_key(|&(t, d)| (t, d));
            let (mut live, mut peak) = (0i64, 0i64);
            for (_, d) in events {
                live += d;
                peak = peak.max(live);
            }
            assert_eq!(peak as u64, CAPACITY, "{name}: peak live");
            let area: f64 = r.iter().map(|&(l, h, s)| ((h - l) * s) as f64).sum();
            let got = area / (TIME as f64 * CAPACITY as f64);
            assert!(
                (got - fill).abs() < 0.03,
                "{name}: fill {got:.3} for {fill}"
            );
        }
    }

    #[test]
    fn the_seed_changes_the_instance() {
        let a = csv(&mut Rng::new(1), 200, 0.9);
        let b = csv(&mut Rng::new(2), 200, 0.9);
        assert_ne!(a, b);
        assert_eq!(a, csv(&mut Rng::new(1), 200, 0.9));
    }
}
