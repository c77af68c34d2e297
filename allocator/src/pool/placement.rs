//! Where growth puts the chunks it gathers: a window's missing pages as runs, each filled
//! first fit (`vmm.rs` gathers and maps; `sizing.rs` sizes handles for the runs).

use super::pages::Taker;
use crate::arena::Chunk;

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
