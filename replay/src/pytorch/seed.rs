//! Starting the PyTorch model from the state a snapshot's window opened on ([`WindowStart`]),
//! the "seeded" mode: before the first operation the model reserves the recorded segments
//! (`cudaMalloc` each, or for an expandable run its pages mapped in a reservation of the
//! run's stream and pool), places each block that was live then at its recorded offset, and
//! caches the rest as free blocks, split and linked as PyTorch's blocks are. The driver calls
//! seeding makes happened before the window, so the counters start from zero after it.
//!
//! What the recording does not say is chosen the way PyTorch would have made it:
//!
//! * a live block's size is the final state's when the same block is still there at the dump
//!   (never touched in between); otherwise its rounded request (`round_size`), grown over a
//!   gap to the next block that `should_split` would not have split off (1 MiB or less in the
//!   large pool);
//! * free space between live blocks is one free block per gap (PyTorch merges free
//!   neighbours, so no two free blocks ever touch);
//! * an expandable segment's runs keep their distances from the first run of their stream and
//!   pool (a new reservation when they do not fit one: misaligned to the page, or further
//!   apart than one reservation spans).
//!
//! A live block that fits no segment (it would overlap the one before it, or pass the end) is
//! left to the ordinary path: the first operation allocates it like any request.

use cistern_trace::snapshot::{StartSegment, WindowStart};

use super::*;
use crate::model::SeedError;

impl PytorchModel {
    /// Starts the model from `start` (see the module docs); the initial allocations of the
    /// sequence (ids `0..initially_live`) then bind to the placed blocks instead of allocating.
    /// Returns how many of them were not placed (no recorded segment holds them, or they do
    /// not fit where they were), which the first operations allocate the ordinary way. Fails
    /// with an [`Oom`] when the device cannot hold the recorded segments, and when the model
    /// has already run.
    pub fn seed(&mut self, start: &WindowStart) -> Result<usize, SeedError> {
        if !self.slots.is_empty() || self.reserved != 0 {
            return Err(SeedError::Unsupported(format!(
                "{}: a model can start from a recorded state only before its first operation",
                self.name
            )));
        }
        let placed = self.seed_all(start);
        // What seeding cost was paid before the window opened (and a failed seed's calls are
        // no part of any window either).
        self.driver.reset_counters();
        self.counters = PytorchCounters::default();
        placed.map(|placed| start.unplaced.len() + start.live.len() - placed)
    }

    /// Seeds every segment of `start`; returns how many live blocks were placed.
    fn seed_all(&mut self, start: &WindowStart) -> Result<usize, SeedError> {
        let mut by_segment: Vec<Vec<&cistern_trace::snapshot::StartBlock>> =
            vec![Vec::new(); start.segments.len()];
        for b in &start.live {
            if let Some(v) = by_segment.get_mut(b.segment) {
                v.push(b);
            }
        }
        // An expandable reservation per (stream, pool), with the address its first run had.
        let mut reservations: Vec<(u64, usize, usize, u64)> = Vec::new();
        let mut placed = 0;
        for (si, seg) in start.segments.iter().enumerate() {
            let pool = if seg.small { SMALL } else { LARGE };
            let page = if pool == SMALL {
                SMALL_BUFFER
            } else {
                LARGE_BUFFER
            };
            // A run that is no whole number of its pool's pages cannot be mapped as recorded:
            // it is seeded as a plain segment of its exact size instead.
            let (free, base) =
                if seg.expandable && self.config.expandable_segments && seg.size % page == 0 {
                    self.seed_expandable_run(seg, pool, &mut reservations)?
                } else {
                    self.seed_plain_segment(seg, pool)?
                };
            // The free block may start before the run (merged with a free neighbour): the
            // run's own address in the model is `base`.
            let offset = base.wrapping_sub(seg.address);
            placed += self.place_live_blocks(free, seg, offset, &by_segment[si]);
        }
        Ok(placed)
    }

    fn seed_oom(&self, seg: &StartSegment, what: &str) -> SeedError {
        SeedError::Oom(Oom {
            requested: seg.size,
            reserved: self.reserved,
            capacity: self.capacity,
            detail: format!(
                "{}: the device cannot hold the state recorded at the window's start ({what} \
                 of {} B at {:#x})",
                self.name, seg.size, seg.address
            ),
        })
    }

    /// One `cudaMalloc` for a plain segment: the whole of it a free block of its pool.
    /// Returns the block and the segment's address in the model.
    fn seed_plain_segment(
        &mut self,
        seg: &StartSegment,
        pool: usize,
    ) -> Result<(usize, u64), SeedError> {
        let ptr = self
            .driver
            .mem_alloc(DEV, seg.size)
            .map_err(|_| self.seed_oom(seg, "cudaMalloc"))?;
        self.reserved += seg.size;
        let b = self.new_block(Block {
            addr: ptr,
            size: seg.size,
            requested: 0,
            stream: seg.stream,
            pool,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            seg: None,
        });
        self.insert_free(b);
        Ok((b, ptr))
    }

    /// Maps an expandable run at its distance from the first run of its stream and pool
    /// (in a new reservation when it does not fit that one); the mapped run becomes one free
    /// block (possibly merged with a free neighbour). Returns that block and the run's address
    /// in the model.
    fn seed_expandable_run(
        &mut self,
        seg: &StartSegment,
        pool: usize,
        reservations: &mut Vec<(u64, usize, usize, u64)>,
    ) -> Result<(usize, u64), SeedError> {
        let page = if pool == SMALL {
            SMALL_BUFFER
        } else {
            LARGE_BUFFER
        };
        let fits = |&(stream, p, si, first): &(u64, usize, usize, u64), s: &Self| {
            let Some(Some(e)) = s.segments.get(si) else {
                return false;
            };
            let off = seg.address.wrapping_sub(first);
            stream == seg.stream
                && p == pool
                && seg.address >= first
                && off % page == 0
                && seg.size % page == 0
                && off
                    .checked_add(seg.size)
                    .is_some_and(|end| end <= e.pages.saturating_mul(e.page))
        };
        let existing = reservations.iter().find(|r| fits(r, self)).copied();
        let (si, first) = match existing {
            Some((_, _, si, first)) => (si, first),
            None => {
                // find_expandable_block makes the reservation (and its unmapped block) when
                // no segment of the stream has room: ask for more than any existing one has.
                let before = self.segments.len();
                self.find_expandable_block(pool, seg.stream, u64::MAX)
                    .ok_or_else(|| self.seed_oom(seg, "address reservation"))?;
                if self.segments.len() == before {
                    return Err(self.seed_oom(seg, "address reservation"));
                }
                let si = self.segments.len() - 1;
                reservations.push((seg.stream, pool, si, seg.address));
                (si, seg.address)
            }
        };
        let Some(Some(e)) = self.segments.get(si) else {
            return Err(self.seed_oom(seg, "address reservation"));
        };
        let target = e.base + (seg.address - first);
        // The unmapped block of this reservation that holds the run's start.
        let holder = self.pools[pool]
            .unmapped
            .iter()
            .map(|k| k.2)
            .find(|&i| {
                let b = &self.slots[i];
                b.seg == Some(si) && b.addr <= target && target < b.addr + b.size
            })
            .ok_or_else(|| self.seed_oom(seg, "mapping (overlapping runs)"))?;
        let at = self.split_unmapped(holder, target);
        if self.slots[at].size < seg.size || !self.map_block(at, seg.size) {
            return Err(self.seed_oom(seg, "page mapping"));
        }
        Ok((at, target))
    }

    /// Splits block `i` at `at` (inside it): `i` keeps `[addr, at)`, and a new block of the
    /// same kind (stream, pool, segment, mapped or not, free) takes `[at, end)`, linked after
    /// it. Pool sets are the caller's: neither block is added to one (`i`'s key is unchanged
    /// for the unmapped set, ordered by address; not for the free set, ordered by size).
    fn split_at(&mut self, i: usize, at: u64) -> usize {
        let b = self.slots[i].clone();
        let back = self.new_block(Block {
            addr: at,
            size: b.addr + b.size - at,
            requested: 0,
            allocated: false,
            prev: Some(i),
            ..b
        });
        if let Some(n) = b.next {
            self.slots[n].prev = Some(back);
        }
        self.slots[i].next = Some(back);
        self.slots[i].size = at - b.addr;
        back
    }

    /// Splits the unmapped block `i` at `at` (inside it); returns the part from `at` on.
    fn split_unmapped(&mut self, i: usize, at: u64) -> usize {
        if at == self.slots[i].addr {
            return i;
        }
        let back = self.split_at(i, at);
        let k = self.ukey(back);
        self.pools[self.slots[back].pool].unmapped.insert(k);
        back
    }

    /// Carves the live blocks of one start segment out of its free block `free` (which starts
    /// at the segment's address plus `offset`): the ones that fit become allocated blocks
    /// awaiting their initial allocation, the gaps stay free.
    fn place_live_blocks(
        &mut self,
        free: usize,
        seg: &StartSegment,
        offset: u64,
        live: &[&cistern_trace::snapshot::StartBlock],
    ) -> usize {
        let seg_end = seg.address + seg.size;
        let mut placed = 0;
        let mut tail = Some(free);
        let mut cursor = seg.address;
        for (k, b) in live.iter().enumerate() {
            if b.requested == 0 || b.address < cursor {
                continue;
            }
            let next_start = live[k + 1..]
                .iter()
                .map(|n| n.address)
                .find(|&a| a > b.address)
                .unwrap_or(seg_end)
                .min(seg_end);
            let room = next_start - b.address;
            let mut size = b.block_size.unwrap_or_else(|| round_size(b.requested));
            if b.block_size.is_none() {
                let gap = room.saturating_sub(size);
                // should_split: a large-pool remainder of 1 MiB or less (in a plain segment)
                // stays part of the block; elsewhere remainders under 512 B do.
                let keep = if seg.small || self.config.expandable_segments {
                    gap < MIN_BLOCK_SIZE
                } else {
                    gap <= SMALL_SIZE
                };
                if keep {
                    size = room;
                }
                if size > room && b.requested <= room {
                    size = room;
                }
            }
            if size > room || size == 0 {
                continue;
            }
            let Some(t) = tail else { break };
            let addr = b.address.wrapping_add(offset);
            let (slot, rest) = self.carve(t, addr, size, b.requested);
            self.seeded.insert(b.id, slot);
            placed += 1;
            tail = rest;
            cursor = b.address + size;
        }
        placed
    }

    /// Takes `[addr, addr + size)` out of the free block `i` as an allocated block of
    /// `requested` bytes; the free parts before and after stay in the pool. Returns the
    /// allocated block and the free block after it, if any.
    fn carve(&mut self, i: usize, addr: u64, size: u64, requested: u64) -> (usize, Option<usize>) {
        self.remove_free(i);
        let mut taken = i;
        if addr > self.slots[i].addr {
            // The front stays free (in the pool again, at its new size).
            taken = self.split_at(i, addr);
            self.insert_free(i);
        }
        let mut rest = None;
        if self.slots[taken].size > size {
            let back = self.split_at(taken, addr + size);
            self.insert_free(back);
            rest = Some(back);
        }
        let s = &mut self.slots[taken];
        s.allocated = true;
        s.requested = requested;
        self.allocated += size;
        (taken, rest)
    }
}
