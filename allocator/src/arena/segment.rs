//! Segments: the address ranges a heap owns and how they are backed (a VMM extent with its page
//! table, or one `cuMemAlloc` allocation).

use crate::driver::PhysHandle;
use crate::heap::{Heap, SpanId, SpanState};

/// How a segment's memory is backed.
#[derive(Debug)]
pub(crate) enum Backing {
    /// A virtual reservation whose pages are mapped on demand; `pages[i]` is the handle mapped
    /// at `base + i * granularity`.
    Vmm { pages: Vec<Option<PhysHandle>> },
    /// One `cuMemAlloc` allocation.
    Linear,
}

/// A contiguous address range owned by one heap.
#[derive(Debug)]
pub(crate) struct Segment {
    pub base: u64,
    pub len: u64,
    pub first: SpanId,
    pub backing: Backing,
}

/// One heap with its segments.
#[derive(Debug, Default)]
pub(crate) struct KindHeap {
    pub heap: Heap,
    /// Segments by index (`Span::seg`); `None` for removed ones.
    pub segments: Vec<Option<Segment>>,
    /// The indices of the VMM segments (virtual extents), in the order they were reserved.
    pub vmm_segs: Vec<u32>,
}

impl KindHeap {
    pub fn add_segment(&mut self, base: u64, len: u64, backing: Backing) -> u32 {
        let idx = match self.segments.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.segments.push(None);
                self.segments.len() - 1
            }
        } as u32;
        let state = match backing {
            Backing::Vmm { .. } => SpanState::Hole,
            Backing::Linear => SpanState::Free,
        };
        let first = self.heap.add_segment(idx, base, len, state);
        self.segments[idx as usize] = Some(Segment {
            base,
            len,
            first,
            backing,
        });
        idx
    }

    pub fn segment(&self, idx: u32) -> &Segment {
        // Segment indices come from spans of live segments only.
        self.segments[idx as usize]
            .as_ref()
            .expect("span refers to a removed segment")
    }
}
