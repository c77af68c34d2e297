//! Segments: the address ranges a heap owns and how they are backed (a VMM extent with its page
//! table, or one `cuMemAlloc` allocation).

use std::ops::{Index, IndexMut};

use crate::driver::PhysHandle;
use crate::heap::{Heap, SpanId, SpanState};

/// Which of an arena's two heaps: requests of at most `small_size` bytes, or larger ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub(crate) enum HeapKind {
    /// Requests of at most `small_size` (1 MiB by default).
    Small = 0,
    /// Larger requests.
    Large = 1,
}

impl HeapKind {
    /// Both kinds, small first.
    pub const ALL: [HeapKind; 2] = [HeapKind::Small, HeapKind::Large];

    /// The statistics' pool index of the kind (0 is "all", 1 small, 2 large).
    #[inline]
    pub fn pool_index(self) -> usize {
        self as usize + 1
    }
}

/// An arena's two heaps, indexed by [`HeapKind`].
#[derive(Debug, Default)]
pub(crate) struct Heaps([KindHeap; 2]);

impl Heaps {
    /// Each heap with its kind, small first.
    pub fn iter(&self) -> impl Iterator<Item = (HeapKind, &KindHeap)> {
        HeapKind::ALL.into_iter().zip(self.0.iter())
    }

    /// Each heap, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut KindHeap> {
        self.0.iter_mut()
    }
}

impl Index<HeapKind> for Heaps {
    type Output = KindHeap;
    #[inline]
    fn index(&self, k: HeapKind) -> &KindHeap {
        &self.0[k as usize]
    }
}

impl IndexMut<HeapKind> for Heaps {
    #[inline]
    fn index_mut(&mut self, k: HeapKind) -> &mut KindHeap {
        &mut self.0[k as usize]
    }
}

/// A physical handle of one or more granules: the unit that is created, mapped, unmapped and
/// released whole (see Note [Chunks] in `pool/vmm.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The driver's handle.
    pub handle: PhysHandle,
    /// Its size in granules.
    pub pages: u32,
}

/// A mapped granule of a VMM extent: which chunk is mapped there, and where in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Page {
    /// The chunk's handle.
    pub handle: PhysHandle,
    /// This granule's index in the chunk's mapping (0 at the mapping's first granule).
    pub index: u32,
    /// The chunk's size in granules.
    pub len: u32,
}

impl Page {
    /// The chunk mapped here.
    pub fn chunk(self) -> Chunk {
        Chunk {
            handle: self.handle,
            pages: self.len,
        }
    }
}

/// How a segment's memory is backed.
#[derive(Debug)]
pub(crate) enum Backing {
    /// A virtual reservation whose pages are mapped on demand; `pages[i]` tells which chunk is
    /// mapped at `base + i * granularity`. A chunk's mapping covers `len` consecutive entries.
    Vmm { pages: Vec<Option<Page>> },
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
