//! The state of a device's caching allocator when a snapshot's trace window opened: which
//! segments existed, walked back from the final segments through the window's `segment_*`
//! events, and which of their blocks were live (the reconstruction's initial allocations, at
//! their addresses).
//!
//! A recording that began after the program had already run (a ring buffer that wrapped, or
//! `_record_memory_history` turned on late) reserves memory the window never explains: cached
//! segments from before, which a model starting from an empty device never reserves. A model
//! seeded with the [`WindowStart`] starts where the recorded run started, so the two are
//! compared like with like.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::{Action, Reconstruction, Snapshot};

/// PyTorch's small-pool segment size (`kSmallBuffer`): a plain segment of exactly this size
/// belongs to the small pool when the snapshot does not say.
const SMALL_BUFFER: u64 = 2 << 20;
/// Page size of a large pool's expandable segment (`kLargeBuffer`).
const LARGE_PAGE: u64 = 20 << 20;
/// The largest request the small pool serves (`kSmallSize`).
const SMALL_SIZE: u64 = 1 << 20;

/// A segment (or, for expandable segments, a mapped run of one) that existed when the window
/// opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartSegment {
    /// Base address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// The stream it belongs to.
    pub stream: u64,
    /// In the small pool (blocks of at most 1 MiB): from `segment_type` when the final state
    /// records it; else from an expandable neighbour of its stream; else from the blocks seen
    /// in it (a request of at most 1 MiB is the small pool's); else from the size (small
    /// segments are 2 MiB; an expandable run whose size is no multiple of the large pool's
    /// 20 MiB page is small).
    pub small: bool,
    /// Part of an expandable segment (`is_expandable`, or mapped and unmapped by
    /// `segment_map` / `segment_unmap` events).
    pub expandable: bool,
}

/// A block that was live when the window opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartBlock {
    /// Its id in the reconstruction's sequence (the initial allocations' ids are their op
    /// indices).
    pub id: u64,
    /// Address.
    pub address: u64,
    /// Bytes requested.
    pub requested: u64,
    /// The block's size as the allocator made it, when the final state shows the same block
    /// (live from before the window to the dump, never touched by an event in between).
    pub block_size: Option<u64>,
    /// Index in [`WindowStart::segments`] of the segment it lies in.
    pub segment: usize,
}

/// The allocator's state when a snapshot's window opened (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WindowStart {
    /// The segments, in address order.
    pub segments: Vec<StartSegment>,
    /// The live blocks that lie in them, in address order.
    pub live: Vec<StartBlock>,
    /// Ids of initial allocations in no start segment (or with no known address): a seeded
    /// model allocates them the ordinary way.
    pub unplaced: Vec<u64>,
    /// Segments and segment events that do not fit the final state walked back (freeing a
    /// range that is reserved at that point, allocating one that is not, an empty range, or
    /// one past the end of the address space); each was skipped.
    pub inconsistent: usize,
}

impl WindowStart {
    /// Bytes of the segments that existed when the window opened.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size).sum()
    }

    /// Requested bytes of the live blocks in them.
    pub fn live_bytes(&self) -> u64 {
        self.live.iter().map(|b| b.requested).sum()
    }

    /// Whether nothing was reserved when the window opened.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
}

/// One reserved range during the walk back.
#[derive(Debug, Clone, Copy)]
struct Range {
    end: u64,
    stream: u64,
    small: Option<bool>,
    expandable: bool,
}

/// Reserved ranges by start address; never overlapping.
#[derive(Default)]
struct Ranges(BTreeMap<u64, Range>);

impl Ranges {
    /// Whether any range overlaps `[a, b)`.
    fn overlaps(&self, a: u64, b: u64) -> bool {
        self.0
            .range(..b)
            .next_back()
            .is_some_and(|(_, r)| r.end > a)
    }

    /// Removes `[a, b)`, splitting ranges it cuts; whether all of it was reserved.
    fn remove(&mut self, a: u64, b: u64) -> bool {
        let mut covered = 0u64;
        let hits: Vec<(u64, Range)> = self
            .0
            .range(..b)
            .rev()
            .take_while(|(_, r)| r.end > a)
            .map(|(&s, &r)| (s, r))
            .collect();
        for (s, r) in hits {
            self.0.remove(&s);
            covered += r.end.min(b) - s.max(a);
            if s < a {
                self.0.insert(s, Range { end: a, ..r });
            }
            if r.end > b {
                self.0.insert(b, r);
            }
        }
        covered == b - a
    }

    /// The small-pool flag of an expandable range of `stream` that touches `[a, b)`.
    fn neighbour_pool(&self, a: u64, b: u64, stream: u64) -> Option<bool> {
        let before = self.0.range(..a).next_back().filter(|(_, r)| r.end == a);
        let after = self.0.get_key_value(&b);
        [before, after]
            .into_iter()
            .flatten()
            .find(|(_, r)| r.expandable && r.stream == stream)
            .and_then(|(_, r)| r.small)
    }
}

impl Snapshot {
    /// The state of `device`'s allocator when its window opened (see [`WindowStart`]);
    /// `recon` must be `self.reconstruct(device)`.
    ///
    /// The segments are the final ones, walked back through the window's events:
    /// `segment_alloc` and `segment_map` remove their range (it did not exist before),
    /// `segment_free` and `segment_unmap` add theirs. Adjacent expandable runs of one stream
    /// and pool are joined. The live blocks are the reconstruction's initial allocations,
    /// each in the start segment around its address.
    pub fn window_start(&self, device: usize, recon: &Reconstruction) -> WindowStart {
        let mut ranges = Ranges::default();
        let mut inconsistent = 0;
        for s in self.device_segments(device) {
            // A range past the end of the address space, or empty, is no segment.
            let end = s
                .address
                .checked_add(s.total_size)
                .filter(|_| s.total_size > 0);
            let Some(end) = end.filter(|&end| !ranges.overlaps(s.address, end)) else {
                inconsistent += 1;
                continue;
            };
            ranges.0.insert(
                s.address,
                Range {
                    end,
                    stream: s.stream,
                    small: s.segment_type.as_deref().map(|t| t == "small"),
                    expandable: s.is_expandable.unwrap_or(false),
                },
            );
        }
        let events = self.events(device);
        for e in events.iter().rev() {
            let segment_event = matches!(
                e.action,
                Action::SegmentAlloc
                    | Action::SegmentMap
                    | Action::SegmentFree
                    | Action::SegmentUnmap
            );
            if !segment_event {
                continue;
            }
            let Some(b) = e.addr.checked_add(e.size).filter(|_| e.size > 0) else {
                inconsistent += 1;
                continue;
            };
            let a = e.addr;
            match e.action {
                Action::SegmentAlloc | Action::SegmentMap => {
                    // Not reserved at that point: the event contradicts the final state.
                    inconsistent += usize::from(!ranges.remove(a, b));
                }
                _ => {
                    if ranges.overlaps(a, b) {
                        inconsistent += 1;
                        continue;
                    }
                    let expandable = e.action == Action::SegmentUnmap;
                    // An unmapped run next to a mapped one of its stream is in its pool;
                    // otherwise the blocks seen in it decide, below.
                    let small = if expandable {
                        ranges.neighbour_pool(a, b, e.stream)
                    } else {
                        None
                    };
                    ranges.0.insert(
                        a,
                        Range {
                            end: b,
                            stream: e.stream,
                            small,
                            expandable,
                        },
                    );
                }
            }
        }
        // Where the final state does not name a range's pool, the blocks seen in it do: a
        // request of at most 1 MiB (kSmallSize) is served by the small pool only.
        let initial = recon.sequence.initially_live.min(recon.sequence.ops.len());
        let initial_blocks = recon.sequence.ops[..initial]
            .iter()
            .zip(&recon.initial_addrs)
            .filter_map(|(op, a)| match (*op, *a) {
                (crate::Op::Alloc { size, .. }, Some(a)) => Some((a, size)),
                _ => None,
            });
        let window_blocks = events
            .iter()
            .filter(|e| e.action == Action::Alloc)
            .map(|e| (e.addr, e.size));
        for (addr, size) in initial_blocks.chain(window_blocks) {
            if size == 0 {
                continue;
            }
            if let Some((_, r)) = ranges.0.range_mut(..=addr).next_back() {
                if r.end > addr && r.small.is_none() {
                    r.small = Some(size <= SMALL_SIZE);
                }
            }
        }
        let mut segments: Vec<StartSegment> = Vec::new();
        for (&address, r) in &ranges.0 {
            // Nothing seen in it: small segments are 2 MiB (kSmallBuffer), and an expandable
            // run of the large pool is whole 20 MiB pages.
            let small = r.small.unwrap_or(if r.expandable {
                (r.end - address) % LARGE_PAGE != 0
            } else {
                r.end - address == SMALL_BUFFER
            });
            if let Some(last) = segments.last_mut() {
                if r.expandable
                    && last.expandable
                    && last.stream == r.stream
                    && last.small == small
                    && last.address + last.size == address
                {
                    last.size += r.end - address;
                    continue;
                }
            }
            segments.push(StartSegment {
                address,
                size: r.end - address,
                stream: r.stream,
                small,
                expandable: r.expandable,
            });
        }

        // A final block is the same block as an initial one only if no event touched its
        // address in the window.
        let touched: HashSet<u64> = events
            .iter()
            .filter(|e| {
                matches!(
                    e.action,
                    Action::Alloc | Action::FreeRequested | Action::FreeCompleted
                )
            })
            .map(|e| e.addr)
            .collect();
        let final_sizes: HashMap<u64, u64> = self
            .active_blocks(device)
            .filter(|(_, b)| !touched.contains(&b.address))
            .map(|(_, b)| (b.address, b.size))
            .collect();
        let mut live = Vec::new();
        let mut unplaced = Vec::new();
        let initial = recon.sequence.initially_live.min(recon.sequence.ops.len());
        for (i, op) in recon.sequence.ops[..initial].iter().enumerate() {
            let crate::Op::Alloc { id, size, .. } = *op else {
                continue;
            };
            let addr = recon.initial_addrs.get(i).copied().flatten();
            let seg = addr.and_then(|a| {
                let k = segments.partition_point(|s| s.address <= a);
                let s = k.checked_sub(1)?;
                let seg = &segments[s];
                (a.saturating_add(size.max(1)) <= seg.address + seg.size).then_some(s)
            });
            match (addr, seg) {
                (Some(address), Some(segment)) => live.push(StartBlock {
                    id,
                    address,
                    requested: size,
                    block_size: final_sizes.get(&address).copied(),
                    segment,
                }),
                _ => unplaced.push(id),
            }
        }
        live.sort_by_key(|b| (b.address, b.id));
        WindowStart {
            segments,
            live,
            unplaced,
            inconsistent,
        }
    }
}
