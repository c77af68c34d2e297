//! The pure window arithmetic of VMM growth: where in an extent a request should go (the window
//! needing the fewest new pages), which whole pages of an arena are free, and how large an
//! extent is. No driver, no lock: it reads an [`ArenaState`] and is tested on its own.

use crate::arena::{ArenaState, Backing, HeapKind, Page};
use crate::heap::{SpanId, SpanState};

/// Chooses where in segment `seg_idx` of heap `kind` a block of `size` bytes should go: the
/// window over a run of free space and holes that needs the fewest newly mapped pages (ties:
/// the smallest run, then the lowest address). In each run it tries the run's start and, for a
/// block of at least `edges_from` bytes, each free span's start and end (the window beginning
/// where the span begins, or ending where it ends), so that a large freed block next to a hole
/// is grown in place (Note [Windows over free spans]). Ranges in `blocked` (sorted `(start,
/// end)`: holes whose pages are still mapped, by a deferred or a failed unmap) are in no
/// window. Returns the window's start and its unmapped pages.
///
/// # Note [Windows over free spans]
///
/// A program that grows a buffer by allocating a larger one and then freeing the old one (a KV
/// cache that gains a block of tokens, a vector that doubles) leaves, at each step, the
/// previous buffer's pages free and mapped where they were. Placed at the start of the run of
/// space around them, the next, larger window often began in a hole before them and covered
/// none of them, and stitching then moved every one of their chunks into it: the whole buffer
/// moved at every step (the serving workloads moved hundreds of chunks per step). Trying the
/// free spans' edges as well finds the window that covers the freed buffer and reaches into
/// the hole beside it, so the step maps only the pages it grew by.
///
/// Only for large blocks (at least [`EDGE_CHUNKS`] whole chunks, 80 MiB by default):
/// for smaller ones the run's start, which packs best, stays the only place tried. Measured
/// with `cistern replay` over 24 draws of each generated workload (`--seed`), modelled driver
/// time against expandable's, H200 prices: Mooncake a mean 1.19x -> 0.97x (the worst draw
/// 3.65x -> 2.07x), `llm-serving` 1.49x -> 1.29x (2.63x -> 2.47x); A100 prices 0.32x -> 0.29x
/// and 0.67x -> 0.63x. The smallest device: `llm-serving` a mean 1.0304x -> 1.0289x its peak
/// live bytes, Mooncake 1.0107x -> 1.0120x; the other workloads and the dev snapshots
/// unchanged. Tried for every block, the packed and minimalloc instances needed up to 5% larger
/// devices (the window placed by the freed block leaves the run's start as a smaller hole);
/// from 40 MiB, up to 5% too; from 80 MiB, none.
pub(super) fn choose_window(
    a: &ArenaState,
    kind: HeapKind,
    seg_idx: u32,
    size: u64,
    g: u64,
    blocked: &[(u64, u64)],
    edges_from: u64,
) -> Option<(u64, Vec<u64>)> {
    let kh = &a.kinds[kind];
    let seg = kh.segment(seg_idx);
    let Backing::Vmm { pages } = &seg.backing else {
        return None;
    };
    let edges_tried = size >= edges_from;
    // With the edges tried, many windows are counted: unmapped[i], how many of the first i
    // pages are not mapped, makes each count O(1). Else one per run, counted directly.
    let unmapped: Vec<usize> = if edges_tried {
        std::iter::once(0)
            .chain(pages.iter().scan(0, |n, p| {
                *n += usize::from(p.is_none());
                Some(*n)
            }))
            .collect()
    } else {
        Vec::new()
    };
    let page_range = |lo: u64| {
        let first = ((lo - seg.base) / g) as usize;
        let last = (lo + size - seg.base).div_ceil(g) as usize;
        (first, last)
    };
    let missing_at = |lo: u64| {
        let (first, last) = page_range(lo);
        if edges_tried {
            unmapped[last] - unmapped[first]
        } else {
            pages[first..last].iter().filter(|p| p.is_none()).count()
        }
    };
    // (missing, run len, lo)
    let mut best: Option<(usize, u64, u64)> = None;
    // A window in `[start, end)` (a run of open space between blocked ranges) at each of `at`
    // (clamped into the run).
    let consider = |start: u64,
                    end: u64,
                    at: &mut dyn Iterator<Item = u64>,
                    best: &mut Option<(usize, u64, u64)>| {
        let len = end - start;
        if len < size {
            return;
        }
        for want in at {
            let lo = want.clamp(start, end - size);
            let missing = missing_at(lo);
            let better = match best {
                None => true,
                Some((m, l, b)) => {
                    missing < *m || (missing == *m && (len < *l || (len == *l && lo < *b)))
                }
            };
            if better {
                *best = Some((missing, len, lo));
            }
        }
    };
    // Free spans coalesce, and none alone is large enough (the fast path looked), so a window
    // that fits always contains a hole: build the run of free space and holes around each hole.
    let heap = &kh.heap;
    let open = |st: SpanState| matches!(st, SpanState::Free | SpanState::Hole);
    let mut covered_until = 0u64;
    let mut edges: Vec<u64> = Vec::new();
    for hole in heap.holes() {
        let h = heap.span(hole);
        if h.seg != seg_idx || h.start < covered_until {
            continue;
        }
        let (mut start, mut end) = (h.start, h.end());
        let mut first = hole;
        let mut p = h.prev;
        while p != crate::heap::NIL && open(heap.span(p).state) {
            start = heap.span(p).start;
            first = p;
            p = heap.span(p).prev;
        }
        // The free spans' edges, in address order: the window may begin at a span's start or
        // end at its end.
        edges.clear();
        let mut n = first;
        while n != crate::heap::NIL && open(heap.span(n).state) {
            let sp = heap.span(n);
            if sp.state == SpanState::Free && edges_tried {
                edges.push(sp.start);
                edges.push(sp.end().saturating_sub(size));
            }
            end = sp.end();
            n = sp.next;
        }
        covered_until = end;
        // The parts of the run between the blocked ranges.
        let mut from = start;
        let part = |lo: u64, hi: u64, best: &mut Option<(usize, u64, u64)>| {
            let mut at =
                std::iter::once(lo).chain(edges.iter().copied().filter(|&e| e >= lo && e < hi));
            consider(lo, hi, &mut at, best);
        };
        for &(blo, bhi) in blocked {
            if bhi <= from || blo >= end {
                continue;
            }
            if blo > from {
                part(from, blo, &mut best);
            }
            from = bhi;
        }
        if from < end {
            part(from, end, &mut best);
        }
    }
    best.map(|(_, _, lo)| {
        let (first, last) = page_range(lo);
        let missing = (first..last)
            .filter(|&i| pages[i].is_none())
            .map(|i| seg.base + i as u64 * g)
            .collect();
        (lo, missing)
    })
}

/// Blocks of at least this many whole chunks (`chunk_size`) try the free spans' edges as
/// windows (Note [Windows over free spans]).
pub(super) const EDGE_CHUNKS: u64 = 4;

/// An address range of one heap that page searches leave out: the window being filled.
#[derive(Debug, Clone, Copy)]
pub(super) struct Exclude {
    pub kind: HeapKind,
    pub lo: u64,
    pub hi: u64,
}

/// A run of whole free pages: `[lo, hi)`, page-aligned, inside free span `span` of segment
/// `seg`.
#[derive(Debug, Clone, Copy)]
pub(super) struct PageRun {
    pub seg: u32,
    pub span: SpanId,
    pub lo: u64,
    pub hi: u64,
}

impl PageRun {
    /// Its pages.
    #[cfg(test)]
    pub fn pages(&self, g: u64) -> usize {
        ((self.hi - self.lo) / g) as usize
    }
}

/// Runs of whole free pages in heap `kind`'s VMM segments, until `want` pages are found. A free
/// span that overlaps `exclude` gives only its larger side outside the excluded pages.
pub(super) fn free_page_runs(
    a: &ArenaState,
    kind: HeapKind,
    exclude: Option<Exclude>,
    g: u64,
    want: usize,
) -> Vec<PageRun> {
    let mut runs = Vec::new();
    let kh = &a.kinds[kind];
    if kh.vmm_segs.is_empty() {
        return runs;
    }
    let mut avail = 0usize;
    // Only free spans of at least a page can hold a whole page.
    for id in kh.heap.free_spans_at_least(g) {
        let s = kh.heap.span(id);
        if avail >= want {
            break;
        }
        if !matches!(kh.segment(s.seg).backing, Backing::Vmm { .. }) {
            continue;
        }
        let mut lo = s.start.div_ceil(g) * g;
        let mut hi = s.end() / g * g;
        if let Some(Exclude {
            kind: k,
            lo: xlo,
            hi: xhi,
        }) = exclude
        {
            if k == kind && lo < xhi && xlo < hi {
                // Keep the pages that overlap the window; take the larger side outside it.
                let xlo_p = xlo / g * g;
                let xhi_p = xhi.div_ceil(g) * g;
                if xlo_p.saturating_sub(lo) >= hi.saturating_sub(xhi_p) {
                    hi = hi.min(xlo_p);
                } else {
                    lo = lo.max(xhi_p);
                }
            }
        }
        if hi > lo {
            avail += ((hi - lo) / g) as usize;
            runs.push(PageRun {
                seg: s.seg,
                span: id,
                lo,
                hi,
            });
        }
    }
    runs
}

/// The chunk mappings lying wholly inside page run `r` of heap `kind`, as (first address,
/// page), in address order: what can be taken out of the run (a chunk moves whole).
pub(super) fn whole_mappings(
    a: &ArenaState,
    kind: HeapKind,
    r: &PageRun,
    g: u64,
) -> Vec<(u64, Page)> {
    let seg = a.kinds[kind].segment(r.seg);
    let Backing::Vmm { pages } = &seg.backing else {
        return Vec::new();
    };
    let (lo, hi) = ((r.lo - seg.base) / g, (r.hi - seg.base) / g);
    let mut out = Vec::new();
    let mut i = lo;
    while i < hi {
        let Some(p) = pages[i as usize] else {
            // Free pages are mapped; a run holds no unmapped page. Skip defensively.
            i += 1;
            continue;
        };
        let start = i - p.index as u64;
        let end = start + p.len as u64;
        if start >= lo && end <= hi {
            out.push((seg.base + start * g, p));
        }
        i = end;
    }
    out
}

/// The sizes (in pages) of the whole free chunks an arena could give up from the heaps
/// `kinds`, leaving out `exclude`, and only chunks of at most `max_len` pages (larger ones
/// could not be placed).
pub(super) fn free_chunk_lens(
    a: &ArenaState,
    kinds: &[HeapKind],
    exclude: Option<Exclude>,
    g: u64,
    max_len: u32,
) -> Vec<u32> {
    kinds
        .iter()
        .copied()
        .flat_map(|k| {
            free_page_runs(a, k, exclude, g, usize::MAX)
                .into_iter()
                .map(move |r| (k, r))
        })
        .flat_map(|(k, r)| whole_mappings(a, k, &r, g))
        .filter(|(_, p)| p.len <= max_len)
        .map(|(_, p)| p.len)
        .collect()
}

/// Whole free pages an arena could give up (see [`free_chunk_lens`]).
#[cfg(test)]
pub(super) fn count_free_pages(
    a: &ArenaState,
    exclude: Option<Exclude>,
    g: u64,
    max_len: u32,
) -> usize {
    free_chunk_lens(a, &HeapKind::ALL, exclude, g, max_len)
        .into_iter()
        .map(|n| n as usize)
        .sum()
}

/// The largest virtual extent reserved for one heap of one stream.
///
/// # Note [Virtual extents]
///
/// Address space is cheap but not free: a reservation costs page-table setup in the driver and
/// a page table here (one entry per granule), 47 bits go only so far when many streams
/// allocate, and the space is one for all devices and the host. So a heap's first extent is
/// sized to what it is asked for ([`FIRST_EXTENT`], or a few times the request), and each later
/// one (made when no extent has a free virtual range for a request) doubles the heap's largest,
/// up to this cap: twice the device's memory for the large heap, which leaves room to place any
/// request that fits in physical memory next to live blocks scattered through the range, and
/// the device's memory for the small heap (blocks of at most 64 MiB). A stream that allocates a
/// little reserves a little (a server's thousands of short-lived streams fit), and one that
/// uses the whole device ends with about twice the cap in a handful of extents. Physical pages
/// move between extents as whole chunks, so the size of an extent limits where a block can be
/// placed, not how much memory can back it.
pub(super) fn vmm_extent(total: u64, g: u64, kind: HeapKind) -> u64 {
    let t = total.div_ceil(g) * g;
    if kind == HeapKind::Large {
        t.saturating_mul(2)
    } else {
        t
    }
}

/// A heap's first extent, at least (64 MiB: 32 pages of 2 MiB).
pub(super) const FIRST_EXTENT: u64 = 64 << 20;

/// The size of the next extent of a heap whose largest extent so far is `largest` (0 for
/// none), for a request of `rounded` bytes, capped at `cap` ([`vmm_extent`]); see Note
/// [Virtual extents]. Granularity-aligned, and never smaller than the request.
pub(super) fn next_extent(cap: u64, g: u64, largest: u64, rounded: u64) -> u64 {
    let need = rounded.div_ceil(g).saturating_mul(g);
    let grown = if largest == 0 {
        FIRST_EXTENT.max(need.saturating_mul(4))
    } else {
        largest.saturating_mul(2).max(need.saturating_mul(2))
    };
    (grown.min(cap) / g * g).max(need)
}

#[cfg(test)]
mod tests {
    //! The window arithmetic on hand-built arenas: no driver, no pool.

    use super::*;
    use crate::driver::PhysHandle;
    use crate::stats::SharedGauges;

    const G: u64 = 2 << 20;
    const BASE: u64 = 1 << 40;

    /// An arena whose large heap has one VMM extent of `pages` pages, with the pages listed in
    /// `mapped` mapped and free.
    fn arena(pages: usize, mapped: &[usize]) -> ArenaState {
        let mut a = ArenaState::default();
        let kh = &mut a.kinds[HeapKind::Large];
        let seg = kh.add_segment(
            BASE,
            pages as u64 * G,
            Backing::Vmm {
                pages: vec![None; pages],
            },
        );
        kh.vmm_segs.push(seg);
        for &p in mapped {
            map_free(&mut a, p);
        }
        a
    }

    /// Maps page `p` of the extent and makes it free space.
    fn map_free(a: &mut ArenaState, p: usize) {
        let kh = &mut a.kinds[HeapKind::Large];
        if let Some(s) = kh.segments[0].as_mut() {
            if let Backing::Vmm { pages } = &mut s.backing {
                pages[p] = Some(Page {
                    handle: PhysHandle(p as u64 + 1),
                    index: 0,
                    len: 1,
                });
            }
        }
        let (lo, hi) = (BASE + p as u64 * G, BASE + (p as u64 + 1) * G);
        let first = kh.segment(0).first;
        let hole = kh
            .heap
            .segment_spans(first)
            .find(|(_, s)| s.state == SpanState::Hole && s.start <= lo && hi <= s.end())
            .map(|(id, _)| id)
            .unwrap();
        a.fill(HeapKind::Large, hole, lo, hi, &SharedGauges::default());
    }

    /// A large block grows over a freed one in place: pages 6..9 are a freed block's, mapped
    /// and free, in one run with the holes around them. The run's start needs five new pages;
    /// the window ending where the freed block ends needs two. Below `edges_from` the run's
    /// start stays the only place tried.
    #[test]
    fn a_large_window_covers_a_freed_block_beside_a_hole() {
        let a = arena(12, &[6, 7, 8]);
        let (lo, missing) = choose_window(&a, HeapKind::Large, 0, 5 * G, G, &[], 5 * G).unwrap();
        assert_eq!(lo, BASE + 4 * G);
        assert_eq!(missing, vec![BASE + 4 * G, BASE + 5 * G]);
        let (lo, missing) = choose_window(&a, HeapKind::Large, 0, 5 * G, G, &[], 6 * G).unwrap();
        assert_eq!(lo, BASE);
        assert_eq!(missing.len(), 5);
    }

    #[test]
    fn an_empty_extent_places_the_request_at_its_start() {
        let a = arena(8, &[]);
        let (lo, missing) = choose_window(&a, HeapKind::Large, 0, 3 * G, G, &[], u64::MAX).unwrap();
        assert_eq!(lo, BASE);
        assert_eq!(missing, vec![BASE, BASE + G, BASE + 2 * G]);
    }

    #[test]
    fn the_run_needing_fewest_new_pages_wins() {
        // Page 3 holds a live block, so the extent has two runs of free space and holes:
        // pages 0..3 (all unmapped) and 4..8 (pages 5 and 6 mapped and free). A 3-page request
        // goes to the start of the second run, which needs one new page instead of three.
        let mut a = arena(8, &[3]);
        let (ptr, _) = a
            .try_take(HeapKind::Large, G, G, &SharedGauges::default())
            .unwrap();
        assert_eq!(ptr, BASE + 3 * G);
        map_free(&mut a, 5);
        map_free(&mut a, 6);
        let (lo, missing) = choose_window(&a, HeapKind::Large, 0, 3 * G, G, &[], u64::MAX).unwrap();
        assert_eq!((lo, missing), (BASE + 4 * G, vec![BASE + 4 * G]));
        // A request that ends inside a page needs that page too.
        let (lo, missing) =
            choose_window(&a, HeapKind::Large, 0, 3 * G + 512, G, &[], u64::MAX).unwrap();
        assert_eq!(
            (lo, missing),
            (BASE + 4 * G, vec![BASE + 4 * G, BASE + 7 * G])
        );
        // Neither run holds five pages.
        assert!(choose_window(&a, HeapKind::Large, 0, 5 * G, G, &[], u64::MAX).is_none());
    }

    #[test]
    fn a_window_never_covers_a_range_still_mapped() {
        // Pages 2 and 6 sit in the hole but are still mapped (a deferred unmap): a 3-page
        // request fits only between them (pages 3..6), and a 4-page one nowhere.
        let a = arena(8, &[]);
        let blocked = [(BASE + 2 * G, BASE + 3 * G), (BASE + 6 * G, BASE + 7 * G)];
        let (lo, missing) =
            choose_window(&a, HeapKind::Large, 0, 3 * G, G, &blocked, u64::MAX).unwrap();
        assert_eq!((lo, missing.len()), (BASE + 3 * G, 3));
        assert!(choose_window(&a, HeapKind::Large, 0, 4 * G, G, &blocked, u64::MAX).is_none());
        // Ranges elsewhere change nothing.
        let far = [(BASE + 100 * G, BASE + 101 * G)];
        let (lo, _) = choose_window(&a, HeapKind::Large, 0, 4 * G, G, &far, u64::MAX).unwrap();
        assert_eq!(lo, BASE);
    }

    #[test]
    fn no_window_when_the_extent_is_too_small() {
        let a = arena(2, &[]);
        assert!(choose_window(&a, HeapKind::Large, 0, 3 * G, G, &[], u64::MAX).is_none());
        // A linear heap has no window at all.
        let mut b = ArenaState::default();
        let seg = b.kinds[HeapKind::Small].add_segment(BASE, 4 * G, Backing::Linear);
        assert!(choose_window(&b, HeapKind::Small, seg, G, G, &[], u64::MAX).is_none());
    }

    #[test]
    fn free_page_runs_leave_out_the_window_and_stop_at_want() {
        let a = arena(8, &[0, 1, 2, 3, 6]);
        assert_eq!(count_free_pages(&a, None, G, u32::MAX), 5);
        let runs = free_page_runs(&a, HeapKind::Large, None, G, 1);
        assert_eq!(runs.len(), 1, "stops once `want` pages are found");
        // Excluding pages 1..2 of the run 0..4 keeps the larger side (pages 2 and 3).
        let x = Some(Exclude {
            kind: HeapKind::Large,
            lo: BASE + G,
            hi: BASE + 2 * G,
        });
        let pages: usize = free_page_runs(&a, HeapKind::Large, x, G, usize::MAX)
            .iter()
            .map(|r| r.pages(G))
            .sum();
        assert_eq!(pages, 3);
        // An exclusion of the other heap changes nothing.
        assert_eq!(
            count_free_pages(
                &a,
                Some(Exclude {
                    kind: HeapKind::Small,
                    lo: BASE,
                    hi: BASE + 8 * G
                }),
                G,
                u32::MAX
            ),
            5
        );
        // The small heap has no extent: nothing.
        assert!(free_page_runs(&a, HeapKind::Small, None, G, usize::MAX).is_empty());
    }

    #[test]
    fn exclusion_keeps_the_larger_side_on_either_end() {
        // Free pages 0..4; excluding page 2 leaves 0..2 (the larger side) and drops page 3.
        let a = arena(8, &[0, 1, 2, 3]);
        let x = |lo, hi| {
            Some(Exclude {
                kind: HeapKind::Large,
                lo,
                hi,
            })
        };
        let runs = free_page_runs(&a, HeapKind::Large, x(BASE + 2 * G, BASE + 3 * G), G, 9);
        assert_eq!(
            (runs.len(), runs[0].lo, runs[0].hi),
            (1, BASE, BASE + 2 * G)
        );
        // A window over the whole span leaves nothing of it.
        assert_eq!(count_free_pages(&a, x(BASE, BASE + 4 * G), G, u32::MAX), 0);
    }

    #[test]
    fn free_pages_of_both_heaps_count() {
        let mut a = arena(8, &[0, 1]);
        let kh = &mut a.kinds[HeapKind::Small];
        let seg = kh.add_segment(
            BASE + 8 * G,
            4 * G,
            Backing::Vmm {
                pages: vec![None; 4],
            },
        );
        kh.vmm_segs.push(seg);
        if let Some(s) = kh.segments[seg as usize].as_mut() {
            if let Backing::Vmm { pages } = &mut s.backing {
                pages[3] = Some(Page {
                    handle: PhysHandle(99),
                    index: 0,
                    len: 1,
                });
            }
        }
        let hole = kh.heap.holes().next().unwrap();
        a.fill(
            HeapKind::Small,
            hole,
            BASE + 11 * G,
            BASE + 12 * G,
            &SharedGauges::default(),
        );
        assert_eq!(free_page_runs(&a, HeapKind::Small, None, G, 9).len(), 1);
        assert_eq!(count_free_pages(&a, None, G, u32::MAX), 3);
    }

    #[test]
    fn only_chunks_wholly_inside_a_run_can_be_taken() {
        // Pages 0..8 mapped and free: one 4-page chunk (0..4) and four single pages.
        let mut a = arena(8, &[]);
        let shared = SharedGauges::default();
        {
            let kh = &mut a.kinds[HeapKind::Large];
            if let Some(s) = kh.segments[0].as_mut() {
                if let Backing::Vmm { pages } = &mut s.backing {
                    for i in 0..4 {
                        pages[i as usize] = Some(Page {
                            handle: PhysHandle(1),
                            index: i,
                            len: 4,
                        });
                    }
                    for i in 4..8 {
                        pages[i] = Some(Page {
                            handle: PhysHandle(10 + i as u64),
                            index: 0,
                            len: 1,
                        });
                    }
                }
            }
            let hole = kh.heap.holes().next().unwrap();
            a.fill(HeapKind::Large, hole, BASE, BASE + 8 * G, &shared);
        }
        let runs = free_page_runs(&a, HeapKind::Large, None, G, usize::MAX);
        let all: Vec<_> = runs
            .iter()
            .flat_map(|r| whole_mappings(&a, HeapKind::Large, r, G))
            .map(|(addr, p)| ((addr - BASE) / G, p.len))
            .collect();
        assert_eq!(all, vec![(0, 4), (4, 1), (5, 1), (6, 1), (7, 1)]);
        // Excluding page 1 cuts the run to pages 2..8: the chunk at 0..4 is no longer whole.
        let x = Some(Exclude {
            kind: HeapKind::Large,
            lo: BASE + G,
            hi: BASE + 2 * G,
        });
        assert_eq!(count_free_pages(&a, x, G, u32::MAX), 4);
        // Chunks longer than the window's longest run are not counted either.
        assert_eq!(count_free_pages(&a, None, G, 3), 4);
    }

    #[test]
    fn among_equal_windows_the_smallest_run_wins() {
        // Live blocks at pages 5 and 12 leave runs 0..5, 6..12 and 13..16, all unmapped: a
        // 3-page request needs three new pages in each, so the tightest run (13..16) wins.
        let mut a = arena(16, &[5, 12]);
        let shared = SharedGauges::default();
        let (p, _) = a.try_take(HeapKind::Large, G, G, &shared).unwrap();
        let (q, _) = a.try_take(HeapKind::Large, G, G, &shared).unwrap();
        let mut live = [p, q];
        live.sort_unstable();
        assert_eq!(live, [BASE + 5 * G, BASE + 12 * G]);
        let (lo, missing) = choose_window(&a, HeapKind::Large, 0, 3 * G, G, &[], u64::MAX).unwrap();
        assert_eq!(lo, BASE + 13 * G);
        assert_eq!(missing.len(), 3);
        // Four pages fit only in the first two runs; the smaller of those (0..5) wins.
        let (lo, _) = choose_window(&a, HeapKind::Large, 0, 4 * G, G, &[], u64::MAX).unwrap();
        assert_eq!(lo, BASE);
    }

    #[test]
    fn a_window_stays_in_its_extent() {
        // Two extents of the large heap: 4 pages at BASE, 8 pages further up. A 6-page
        // request fits only the second; the first extent's holes never borrow the second's.
        let mut a = arena(4, &[]);
        let far = BASE + (1 << 30);
        let kh = &mut a.kinds[HeapKind::Large];
        let seg = kh.add_segment(
            far,
            8 * G,
            Backing::Vmm {
                pages: vec![None; 8],
            },
        );
        kh.vmm_segs.push(seg);
        assert!(choose_window(&a, HeapKind::Large, 0, 6 * G, G, &[], u64::MAX).is_none());
        let (lo, missing) =
            choose_window(&a, HeapKind::Large, seg, 6 * G, G, &[], u64::MAX).unwrap();
        assert_eq!((lo, missing.len()), (far, 6));
    }

    #[test]
    fn extents_are_twice_the_device_for_large_heaps() {
        assert_eq!(vmm_extent(10 * G + 1, G, HeapKind::Large), 22 * G);
        assert_eq!(vmm_extent(10 * G + 1, G, HeapKind::Small), 11 * G);
        assert_eq!(vmm_extent(u64::MAX / 2 + G, G, HeapKind::Large), u64::MAX);
    }

    #[test]
    fn extents_start_small_and_double_up_to_the_cap() {
        const MIB: u64 = 1 << 20;
        let cap = 4096 * MIB;
        // The first: 64 MiB, or four times a larger request.
        assert_eq!(next_extent(cap, G, 0, MIB), FIRST_EXTENT);
        assert_eq!(next_extent(cap, G, 0, 100 * MIB), 400 * MIB);
        // Later ones double the largest (or twice the request), up to the cap.
        assert_eq!(next_extent(cap, G, 64 * MIB, MIB), 128 * MIB);
        assert_eq!(next_extent(cap, G, 64 * MIB, 100 * MIB), 200 * MIB);
        assert_eq!(next_extent(cap, G, 3000 * MIB, MIB), cap);
        assert_eq!(next_extent(cap, G, cap, MIB), cap);
        // Never smaller than the request, even above the cap.
        assert_eq!(next_extent(cap, G, cap, 5000 * MIB), 5000 * MIB);
        // Aligned to the granularity, without overflow.
        assert_eq!(next_extent(cap, G, 0, 100 * MIB + 1) % G, 0);
        assert_eq!(next_extent(u64::MAX, G, u64::MAX / 2, G), u64::MAX / G * G);
    }
}
