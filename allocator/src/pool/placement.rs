//! Where growth puts the chunks it gathers: a window's missing pages as runs, the cached
//! chunks that could fill them, and the plan of which chunk sizes fill which run, which
//! stitching follows (`vmm.rs` gathers and maps; `sizing.rs` sizes handles for the runs).
//!
//! # Note [Stitching to a plan]
//!
//! The feasibility check counted the cached chunks that fit the window's runs placed largest
//! first; stitching went arena by arena and took chunks in address order, first fit. Two
//! costs followed. Under memory pressure, requests the check had let through failed: with
//! free chunks of 2, 10 and 10 pages in that order and a run of 20 missing pages, first fit
//! takes the 2 and one 10, and the 8 pages left have nowhere to come from (Mooncake's 12 GiB
//! requests at the smallest devices failed so, short by 7 pages of 6,150 with 12.6 GiB of
//! whole free chunks cached). And everywhere, first fit moved more chunks than needed: small
//! ones first, where they lay, each costing an unmap, a map and an access grant.
//!
//! So the check makes a [`Plan`]: per run, how many chunks of each size fill it. Largest first
//! (fewest moves), unless the fullest packing places more pages (largest first is not always
//! the fullest: chunks of 10, 8 and 5 pages and dozens of 2 leave a page of a 150-page run
//! open, where leaving out the 5 fills it): each run, largest first, takes the fullest packing
//! of the chunks left, a bounded subset sum over the chunk sizes as a bitset of reachable page
//! counts. Stitching and the reuse of lost chunks then take only chunks the plan still wants,
//! in their usual order (this arena's first), so they place what the check counted. Should a
//! planned chunk not come (a failed unmap, a busy donor, a chunk left as a bounce), a plain
//! first-fit stitch follows before new memory.
//!
//! Measured with `cistern replay --gpu-lag 2` over the dev snapshots and every built-in
//! workload, 17 draws of each generated one (`--seed`), mean (worst), against first fit:
//! - under pressure only (the first version), the smallest device against the peak live
//!   bytes: `llm-serving` 1.0288x (1.0485x) -> 1.0206x (1.0291x), larger than
//!   `pytorch-expandable`'s on 8 draws -> 1; Mooncake 1.0072x (1.0141x) -> 1.0041x (1.0112x);
//!   the `packed-*` instances up to 2.7% less on seven of ten and up to 0.9% more on three
//!   (which chunks move changes the layout that follows);
//! - then everywhere, modelled driver time against expandable's: `llm-serving` 0.66x (1.00x)
//!   -> 0.51x (0.69x) at the published A100 prices and 1.39x (2.38x) -> 1.00x (1.51x) at the
//!   H200's; Mooncake 0.35x (0.70x) -> 0.19x (0.28x) and 1.27x (3.32x) -> 0.75x (1.31x); the
//!   `packed-*` instances 1-7% less on all ten; `training`, `rmm-random(-normal)` and the dev
//!   snapshots within 1%. Peak reserved on a roomy device: `llm-serving` 0.960x (1.028x) ->
//!   0.957x (1.042x) expandable's, Mooncake 0.881x (0.968x) -> 0.892x (0.967x), over
//!   expandable's on 6 of 170 `packed-*` draws instead of 4 (the worst 1.236x -> 1.111x). The
//!   smallest device within 0.1% in the mean on the generated workloads (the worst draws:
//!   Mooncake 1.0112x -> 1.0149x, `training` 1.0365x -> 1.0397x) and unchanged on the dev
//!   snapshots. The first-fit stitch after the plan leaves the small heaps' pages where Note
//!   [Small pages stay small] keeps them; taking them there too measured the same over the
//!   draws (`llm-serving` 0.51x, worst 0.61x, peak worst 1.017x) but would undo that rule.

use std::sync::Arc;

use super::device::DeviceState;
use super::pages::Taker;
use super::vmm::Window;
use super::window::free_chunk_lens;
use super::DevicePool;
use crate::arena::{Arena, ArenaState, Chunk, HeapKind};
use crate::driver::Driver;

/// Where gathered chunks go in a window: the window's missing pages as runs of consecutive
/// pages, each filled from its start, first fit (see Note [Chunks]).
pub(super) struct Placement {
    g: u64,
    /// (first address, pages, pages filled) of each run of missing pages, in address order.
    pub(super) runs: Vec<(u64, u32, u32)>,
    /// The chunks placed, with their addresses.
    pub(super) placed: Vec<(u64, Chunk)>,
    /// Chunks taken that no run had room for (none, as `take` follows `wants`; released).
    pub(super) spare: Vec<Chunk>,
    /// With a plan (Note [Stitching to a plan]), only the chunks it still wants, per run.
    pub(super) quota: Option<Vec<Vec<(u32, u32)>>>,
}

/// Which cached chunks fill which run of a window (Note [Stitching to a plan]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// Per run of the window's missing pages, `(chunk pages, how many)`.
    pub(super) quota: Vec<Vec<(u32, u32)>>,
    /// The pages placed.
    pub(super) pages: usize,
    /// The chunks placed.
    pub(super) chunks: usize,
}

/// The most words of bitsets [`fullest`] keeps (one per item, for the reconstruction): 8 MiB.
const FULLEST_WORDS: usize = 1 << 20;

/// The largest total of at most `open` pages that chunks of `avail` (`(pages, how many)`)
/// reach, and how many of each it takes: a bounded subset sum over a bitset of reachable
/// totals, each count split in powers of two. Of the fullest packings it takes the one that
/// leaves out the items last in `avail` where it can. `None` when the bitsets would take more
/// than [`FULLEST_WORDS`] (e.g. a run of 2^16 pages, 128 GiB of 2 MiB granules, with 16 items).
fn fullest(avail: &[(u32, u32)], open: u32) -> Option<(u32, Vec<(u32, u32)>)> {
    let words = (open as usize + 1).div_ceil(64);
    // Items of `(pages, count)` each: the powers of two that sum to a size's count.
    let mut items: Vec<(u32, u32)> = Vec::new();
    for &(pages, n) in avail {
        if pages == 0 || pages > open {
            continue;
        }
        let mut left = n.min(open / pages);
        let mut k = 1;
        while left > 0 {
            let take = k.min(left);
            items.push((pages, take));
            left -= take;
            k = k.saturating_mul(2);
        }
    }
    if items.is_empty() {
        return Some((0, Vec::new()));
    }
    if (items.len() + 1).saturating_mul(words) > FULLEST_WORDS {
        return None;
    }
    let mut reach = vec![0u64; words];
    reach[0] = 1;
    let mut before: Vec<Vec<u64>> = Vec::with_capacity(items.len());
    for &(pages, count) in &items {
        before.push(reach.clone());
        let shift = (pages * count) as usize;
        let (w, b) = (shift / 64, shift % 64);
        for i in (w..words).rev() {
            let mut v = reach[i - w] << b;
            if b > 0 && i > w {
                v |= reach[i - w - 1] >> (64 - b);
            }
            reach[i] |= v;
        }
    }
    let bit = |set: &[u64], t: usize| set[t / 64] >> (t % 64) & 1 == 1;
    // The highest total reached, at most `open` (bits above it in the last word are ignored).
    let top = open as usize;
    let best = (0..=top / 64).rev().find_map(|i| {
        let mut v = reach[i];
        if i == top / 64 && top % 64 < 63 {
            v &= (1u64 << (top % 64 + 1)) - 1;
        }
        (v != 0).then(|| i * 64 + 63 - v.leading_zeros() as usize)
    })?;
    let mut t = best;
    let mut taken: Vec<(u32, u32)> = Vec::new();
    for (i, &(pages, count)) in items.iter().enumerate().rev() {
        if !bit(&before[i], t) {
            t -= (pages * count) as usize;
            add(&mut taken, pages, count);
        }
    }
    Some((best as u32, taken))
}

impl Placement {
    pub(super) fn new(missing: &[u64], g: u64) -> Self {
        let mut runs: Vec<(u64, u32, u32)> = Vec::new();
        for &m in missing {
            match runs.last_mut() {
                Some((lo, n, _)) if *lo + *n as u64 * g == m => *n += 1,
                _ => runs.push((m, 1, 0)),
            }
        }
        Placement {
            g,
            runs,
            placed: Vec::new(),
            spare: Vec::new(),
            quota: None,
        }
    }

    /// Missing pages without a chunk yet.
    pub(super) fn open(&self) -> usize {
        self.runs.iter().map(|&(_, n, f)| (n - f) as usize).sum()
    }

    /// The longest stretch still open in one run.
    pub(super) fn largest_open(&self) -> u32 {
        self.runs.iter().map(|&(_, n, f)| n - f).max().unwrap_or(0)
    }

    /// Places `c` in run `r` (which has room for it).
    pub(super) fn place_in(&mut self, r: usize, c: Chunk) {
        let (lo, _, f) = &mut self.runs[r];
        self.placed.push((*lo + *f as u64 * self.g, c));
        *f += c.pages;
    }

    /// How `lens` (chunk sizes in pages) fit the open runs placed largest first, each in the
    /// first run with room: a good packing, not always the fullest (see [`Self::plan`]).
    /// Places nothing.
    pub(super) fn largest_first(&self, lens: &[u32]) -> Plan {
        let mut open: Vec<u32> = self.runs.iter().map(|&(_, n, f)| n - f).collect();
        let mut plan = Plan {
            quota: vec![Vec::new(); open.len()],
            ..Plan::default()
        };
        let mut lens = lens.to_vec();
        lens.sort_unstable_by(|x, y| y.cmp(x));
        for n in lens {
            if let Some(r) = open.iter().position(|&o| o >= n) {
                open[r] -= n;
                add(&mut plan.quota[r], n, 1);
                plan.pages += n as usize;
                plan.chunks += 1;
            }
        }
        plan
    }

    /// Which of `lens` fill which run (Note [Stitching to a plan]): each run, largest
    /// first, takes the fullest packing of the chunks left, or the whole plan is largest
    /// first's (`greedy`, [`Self::largest_first`] of the same `lens`) where that places at
    /// least as many pages.
    pub(super) fn plan(&self, greedy: Plan, lens: &[u32]) -> Plan {
        if greedy.pages == self.open() || greedy.chunks == lens.len() {
            // Every page filled or every chunk placed: no packing places more.
            return greedy;
        }
        let mut avail: Vec<(u32, u32)> = Vec::new();
        for &n in lens {
            add(&mut avail, n, 1);
        }
        // Largest first, so that of the fullest packings the one with the largest chunks is
        // chosen (`fullest` leaves out the last items it can).
        avail.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        let mut order: Vec<usize> = (0..self.runs.len()).collect();
        order.sort_by_key(|&r| std::cmp::Reverse(self.runs[r].1 - self.runs[r].2));
        let mut plan = Plan {
            quota: vec![Vec::new(); self.runs.len()],
            ..Plan::default()
        };
        for r in order {
            let (_, n, f) = self.runs[r];
            let Some((pages, taken)) = fullest(&avail, n - f) else {
                return greedy;
            };
            for &(size, count) in &taken {
                if let Some(e) = avail.iter_mut().find(|e| e.0 == size) {
                    e.1 -= count;
                }
                add(&mut plan.quota[r], size, count);
                plan.chunks += count as usize;
            }
            plan.pages += pages as usize;
        }
        // Largest first where it does as well: it takes the largest chunks.
        if greedy.pages >= plan.pages {
            greedy
        } else {
            plan
        }
    }
}

/// Adds `count` chunks of `pages` to a `(pages, how many)` list.
fn add(list: &mut Vec<(u32, u32)>, pages: u32, count: u32) {
    match list.iter_mut().find(|e| e.0 == pages) {
        Some(e) => e.1 += count,
        None => list.push((pages, count)),
    }
}

impl Placement {
    /// The run chunk `pages` goes to: the first with room (and, with a plan, with a chunk of
    /// that size still wanted).
    fn run_for(&self, pages: u32) -> Option<usize> {
        self.runs.iter().enumerate().position(|(r, &(_, n, f))| {
            n - f >= pages
                && self
                    .quota
                    .as_ref()
                    .is_none_or(|q| q[r].iter().any(|&(size, left)| size == pages && left > 0))
        })
    }
}

impl Taker for Placement {
    fn wants(&self, pages: u32) -> bool {
        self.run_for(pages).is_some()
    }
    fn take(&mut self, c: Chunk) {
        match self.run_for(c.pages) {
            Some(r) => {
                if let Some(q) = self.quota.as_mut() {
                    if let Some(e) = q[r].iter_mut().find(|e| e.0 == c.pages) {
                        e.1 -= 1;
                    }
                }
                self.place_in(r, c)
            }
            None => self.spare.push(c),
        }
    }
    fn full(&self) -> bool {
        self.runs.iter().all(|&(_, n, f)| n == f)
            || self
                .quota
                .as_ref()
                .is_some_and(|q| q.iter().flatten().all(|&(_, left)| left == 0))
    }
}

impl<D: Driver> DevicePool<D> {
    /// The sizes (in pages) of the cached chunks that could serve window `w` of a `kind` heap
    /// of `arena` (of at most `longest` pages): lost ones (one still mapped where it moved
    /// from serves only a stream that can wait for its donor on the device, as gathering
    /// does), this arena's outside the window (none of a pinned graph pool's), the other
    /// arenas'. With `split_small`, the small heaps' come apart, second (Note [Small pages
    /// stay small] in `sizing.rs`); else all are first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cached_chunk_lens(
        &self,
        dev: &DeviceState,
        arena: &Arc<Arena<D>>,
        a: &ArenaState,
        kind: HeapKind,
        w: &Window,
        longest: u32,
        split_small: bool,
    ) -> (Vec<u32>, Vec<u32>) {
        let g = self.core.granularity;
        let ordered = self.order_stream(arena).is_some();
        let mut lens: Vec<u32> = dev
            .lost
            .iter()
            .filter(|l| ordered || !dev.aliased(l.chunk.handle))
            .map(|l| l.chunk.pages)
            .filter(|&n| n <= longest)
            .collect();
        let mut small = Vec::new();
        let mut add = |st: &ArenaState, exclude| {
            if split_small {
                lens.extend(free_chunk_lens(st, &[HeapKind::Large], exclude, g, longest));
                small.extend(free_chunk_lens(st, &[HeapKind::Small], exclude, g, longest));
            } else {
                lens.extend(free_chunk_lens(st, &HeapKind::ALL, exclude, g, longest));
            }
        };
        if !arena.pinned() {
            add(a, Some(w.exclude(kind)));
        }
        for other in self.donors() {
            if !Arc::ptr_eq(&other, arena) {
                add(&other.state.lock(), None);
            }
        }
        (lens, small)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::PhysHandle;

    const G: u64 = 2 << 20;

    /// A placement over runs of `lens` missing pages, a page apart.
    fn runs(lens: &[u32]) -> Placement {
        let mut missing = Vec::new();
        let mut at = 0;
        for &n in lens {
            missing.extend((0..n as u64).map(|i| (at + i) * G));
            at += n as u64 + 1;
        }
        Placement::new(&missing, G)
    }

    fn chunk(pages: u32) -> Chunk {
        Chunk {
            handle: PhysHandle(0),
            pages,
        }
    }

    /// The fullest packing of chunks up to a run's size, with the largest chunks it can.
    #[test]
    fn fullest_fills_a_run_where_largest_first_cannot() {
        let avail = [(10, 1), (8, 1), (5, 1), (2, 66)];
        let (pages, taken) = fullest(&avail, 150).unwrap();
        assert_eq!(pages, 150);
        let mut taken = taken;
        taken.sort_unstable();
        assert_eq!(taken, vec![(2, 66), (8, 1), (10, 1)], "the 5 is left out");
        // Never more than a run holds, nor more chunks than there are.
        assert_eq!(fullest(&[(4, 3)], 10).unwrap().0, 8);
        assert_eq!(fullest(&[(4, 3)], 100).unwrap().0, 12);
        assert_eq!(fullest(&[(11, 3)], 10).unwrap().0, 0);
        // Too large a bitset for the items: `None` (the plan is then largest first's).
        assert!(fullest(&[(1, 1), (2, 1)], 1 << 26).is_none());
        assert!(fullest(&[], 1 << 26).is_some());
    }

    /// The plan is largest first's where that does as well, and the fullest packing where it
    /// places more; a placement following it takes only the chunks it wants.
    #[test]
    fn a_plan_packs_at_least_as_much_as_largest_first() {
        let p = runs(&[20]);
        let plan = p.plan(p.largest_first(&[2, 10, 10]), &[2, 10, 10]);
        assert_eq!((plan.pages, plan.chunks), (20, 2));
        assert_eq!(plan.quota, vec![vec![(10, 2)]]);

        let mut lens = vec![10, 8, 5];
        lens.extend([2; 66]);
        let p = runs(&[150]);
        let greedy = p.largest_first(&lens);
        assert_eq!(
            (greedy.pages, greedy.chunks),
            (149, 66),
            "largest first leaves a page"
        );
        let plan = p.plan(greedy, &lens);
        assert_eq!(plan.pages, 150);
        let mut p = p;
        p.quota = Some(plan.quota);
        assert!(!p.wants(5), "the plan leaves the 5 out");
        assert!(p.wants(10) && p.wants(8) && p.wants(2));
        p.take(chunk(10));
        assert!(!p.wants(10), "one 10 was planned");
        p.take(chunk(8));
        for _ in 0..66 {
            assert!(p.wants(2));
            p.take(chunk(2));
        }
        assert!(p.full());
        assert!(p.spare.is_empty());

        // Two runs: largest first fills both (3 + 3 in the first, 3 + 3 + 3 in the second).
        let p = runs(&[6, 9]);
        let plan = p.plan(p.largest_first(&[3; 5]), &[3; 5]);
        assert_eq!(plan.pages, 15);
        assert_eq!(plan.quota, vec![vec![(3, 2)], vec![(3, 3)]]);
    }
}
