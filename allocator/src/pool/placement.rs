//! Where growth puts the chunks it gathers: a window's missing pages as runs, each filled
//! first fit, and the cached chunks that could fill them (`vmm.rs` gathers and maps;
//! `sizing.rs` sizes handles for the runs).

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

    /// How many of `lens` (chunk sizes in pages) fit the open runs, placed largest first (the
    /// best packing; gathering, which goes arena by arena, may place fewer): `(pages, chunks)`.
    /// Places nothing.
    pub(super) fn fit(&self, lens: &[u32]) -> (usize, usize) {
        let mut fit = Placement {
            g: self.g,
            runs: self.runs.clone(),
            placed: Vec::new(),
            spare: Vec::new(),
        };
        let mut lens = lens.to_vec();
        lens.sort_unstable_by(|x, y| y.cmp(x));
        let mut placed = (0usize, 0usize);
        for n in lens {
            if fit.full() {
                break;
            }
            if fit.wants(n) {
                fit.take(Chunk {
                    handle: crate::driver::PhysHandle(0),
                    pages: n,
                });
                placed.0 += n as usize;
                placed.1 += 1;
            }
        }
        placed
    }
}

impl Taker for Placement {
    fn wants(&self, pages: u32) -> bool {
        self.runs.iter().any(|&(_, n, f)| n - f >= pages)
    }
    fn take(&mut self, c: Chunk) {
        match self.runs.iter().position(|&(_, n, f)| n - f >= c.pages) {
            Some(r) => self.place_in(r, c),
            None => self.spare.push(c),
        }
    }
    fn full(&self) -> bool {
        self.runs.iter().all(|&(_, n, f)| n == f)
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
