//! The expandable-segments side of the PyTorch model (`expandable_segments:True`): finding a
//! block in a stream's segment (`find_expandable_block`), mapping and unmapping its pages
//! (`map_block`, `unmap_block`, with the stream synchronisation PyTorch makes before an unmap),
//! and releasing a wholly unmapped segment's address space. The rest of the allocator (pools,
//! splitting, merging, the OOM protocol) is in `pytorch.rs`.

use cistern::driver::{Driver, StreamId};

use super::*;

impl PytorchModel {
    /// `find_expandable_block`: the lowest-addressed run of free and unmapped space of this
    /// stream's segments (starting at the free block just before an unmapped range) with room
    /// for `size`; else a new segment whose address space is 9/8 of the device's memory.
    pub(super) fn find_expandable_block(
        &mut self,
        pool: usize,
        stream: u64,
        size: u64,
    ) -> Option<usize> {
        let cands: Vec<usize> = self.pools[pool]
            .unmapped
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .map(|k| k.2)
            .collect();
        for mut c in cands {
            if let Some(p) = self.slots[c].prev {
                if !self.slots[p].allocated {
                    c = p;
                }
            }
            let mut bytes = 0;
            let mut cur = Some(c);
            while bytes < size {
                match cur {
                    Some(x) if !self.slots[x].allocated => {
                        bytes += self.slots[x].size;
                        cur = self.slots[x].next;
                    }
                    _ => break,
                }
            }
            if bytes >= size {
                return Some(c);
            }
        }
        // Note [Segment page size] (ExpandableSegment): 2 MiB pages for the small pool, 20 MiB
        // for the large one, to bound the number of handles to map.
        let page = if pool == SMALL {
            SMALL_BUFFER
        } else {
            LARGE_BUFFER
        };
        let space = self.capacity.saturating_add(self.capacity / 8);
        // At most what a u64 of bytes can span (a capacity near 2^64 would overflow).
        let pages = space.div_ceil(page).clamp(1, u64::MAX / page);
        let base = self.driver.reserve_va(DEV, pages * page, page).ok()?;
        let seg = self.segments.len();
        self.segments.push(Some(ExpandableSegment {
            base,
            page,
            pages,
            handles: Vec::new(),
        }));
        let b = self.new_block(Block {
            addr: base,
            size: pages * page,
            requested: 0,
            stream,
            pool,
            allocated: false,
            mapped: false,
            prev: None,
            next: None,
            seg: Some(seg),
        });
        let k = self.ukey(b);
        self.pools[pool].unmapped.insert(k);
        Some(b)
    }

    /// `map_block`: back the pages covering the first `size` bytes of the unmapped block `i`
    /// (rounded out to whole pages), merge with free neighbours, and cache the result as free.
    pub(super) fn map_block(&mut self, i: usize, size: u64) -> bool {
        let Some(seg_i) = self.slots[i].seg else {
            return false;
        };
        let (base, page) = match &self.segments[seg_i] {
            Some(s) => (s.base, s.page),
            None => return false,
        };
        let addr = self.slots[i].addr;
        let begin = (addr - base) / page;
        let end = (addr + size - base).div_ceil(page);
        if begin == end {
            return false;
        }
        let mut created = Vec::new();
        for _ in begin..end {
            match self.driver.create_physical(DEV, page) {
                Ok(h) => created.push(h),
                Err(_) => {
                    for h in created {
                        let _ = self.driver.release_physical(DEV, h);
                    }
                    return false;
                }
            }
        }
        for (k, &h) in created.iter().enumerate() {
            let a = base + (begin + k as u64) * page;
            // The pages are fresh handles of exactly one page at unmapped page-aligned
            // addresses of a live reservation, so the map cannot fail on the simulator.
            let _ = self.driver.map(DEV, a, page, h);
        }
        let mapped = (end - begin) * page;
        let _ = self
            .driver
            .set_access(DEV, base + begin * page, mapped, &[]);
        if let Some(Some(s)) = self.segments.get_mut(seg_i) {
            let need = end as usize;
            if s.handles.len() < need {
                s.handles.resize(need, None);
            }
            for (k, h) in created.into_iter().enumerate() {
                s.handles[begin as usize + k] = Some(h);
            }
        }
        let uk = self.ukey(i);
        let pool = self.slots[i].pool;
        self.pools[pool].unmapped.remove(&uk);
        self.slots[i].mapped = true;
        if mapped < self.slots[i].size {
            let b = self.slots[i].clone();
            let rem = self.new_block(Block {
                addr: b.addr + mapped,
                size: b.size - mapped,
                requested: 0,
                stream: b.stream,
                pool,
                allocated: false,
                mapped: false,
                prev: Some(i),
                next: b.next,
                seg: b.seg,
            });
            if let Some(n) = b.next {
                self.slots[n].prev = Some(rem);
            }
            self.slots[i].next = Some(rem);
            self.slots[i].size = mapped;
            let k = self.ukey(rem);
            self.pools[pool].unmapped.insert(k);
        }
        let p = self.slots[i].prev;
        self.try_merge_blocks(i, p);
        let n = self.slots[i].next;
        self.try_merge_blocks(i, n);
        self.insert_free(i);
        self.reserved += mapped;
        self.counters.num_device_alloc += 1;
        true
    }

    /// `try_allocate_expandable_block`: map pages at the candidate until it holds `size` bytes.
    pub(super) fn try_allocate_expandable_block(
        &mut self,
        pool: usize,
        stream: u64,
        size: u64,
    ) -> Option<usize> {
        let mut cand = self.find_expandable_block(pool, stream, size)?;
        if !self.slots[cand].mapped {
            let want = self.slots[cand].size.min(size);
            if !self.map_block(cand, want) {
                return None;
            }
        }
        while self.slots[cand].size < size {
            let remaining = size - self.slots[cand].size;
            let next = self.slots[cand].next?;
            if self.slots[next].mapped || self.slots[next].allocated {
                return None;
            }
            let want = remaining.min(self.slots[next].size);
            if !self.map_block(next, want) {
                return None;
            }
            // map_block merged `cand` (its free mapped predecessor) into `next`.
            cand = next;
        }
        self.remove_free(cand);
        Some(cand)
    }

    /// `unmap_block`: unmap the whole pages inside the free block `i`; the partial pages at
    /// either end stay mapped as free blocks.
    pub(super) fn unmap_block(&mut self, i: usize) {
        let Some(seg_i) = self.slots[i].seg else {
            return;
        };
        let (base, page) = match &self.segments[seg_i] {
            Some(s) => (s.base, s.page),
            None => return,
        };
        let b = self.slots[i].clone();
        let begin = (b.addr - base).div_ceil(page);
        let end = (b.addr + b.size - base) / page;
        if begin >= end {
            return;
        }
        self.remove_free(i);
        let un_ptr = base + begin * page;
        let un_size = (end - begin) * page;
        let before = un_ptr - b.addr;
        if before > 0 {
            let bf = self.new_block(Block {
                addr: b.addr,
                size: before,
                requested: 0,
                stream: b.stream,
                pool: b.pool,
                allocated: false,
                mapped: true,
                prev: b.prev,
                next: Some(i),
                seg: b.seg,
            });
            if let Some(p) = b.prev {
                self.slots[p].next = Some(bf);
            }
            self.slots[i].prev = Some(bf);
            self.insert_free(bf);
        }
        let after = b.size - before - un_size;
        if after > 0 {
            let af = self.new_block(Block {
                addr: un_ptr + un_size,
                size: after,
                requested: 0,
                stream: b.stream,
                pool: b.pool,
                allocated: false,
                mapped: true,
                prev: Some(i),
                next: b.next,
                seg: b.seg,
            });
            if let Some(n) = b.next {
                self.slots[n].prev = Some(af);
            }
            self.slots[i].next = Some(af);
            self.insert_free(af);
        }
        {
            let s = &mut self.slots[i];
            s.addr = un_ptr;
            s.size = un_size;
            s.mapped = false;
        }
        let p = self.slots[i].prev;
        self.try_merge_blocks(i, p);
        let n = self.slots[i].next;
        self.try_merge_blocks(i, n);
        let k = self.ukey(i);
        self.pools[b.pool].unmapped.insert(k);
        // `unmapHandles`: cudaStreamSynchronize(stream) first, since cuMemUnmap does not wait.
        self.stream_synchronize(b.stream);
        if let Some(Some(s)) = self.segments.get_mut(seg_i) {
            for pg in begin..end {
                if let Some(h) = s.handles.get_mut(pg as usize).and_then(Option::take) {
                    let _ = self.driver.unmap(DEV, base + pg * page, page);
                    let _ = self.driver.release_physical(DEV, h);
                }
            }
        }
        self.reserved -= un_size;
        self.counters.num_device_free += 1;
    }

    /// `cudaStreamSynchronize(stream)`: one host wait.
    pub(super) fn stream_synchronize(&mut self, stream: u64) {
        // A live device: the simulator accepts the call.
        let _ = self.driver.stream_synchronize(DEV, StreamId(stream));
    }

    /// `release_expandable_segment`: free the address space of a wholly unmapped segment.
    pub(super) fn release_expandable_segment(&mut self, i: usize) {
        let Some(seg_i) = self.slots[i].seg else {
            return;
        };
        if let Some(s) = self.segments[seg_i].take() {
            let _ = self.driver.free_va(DEV, s.base, s.pages * s.page);
        }
        let k = self.ukey(i);
        self.pools[self.slots[i].pool].unmapped.remove(&k);
        self.delete_block(i);
    }
}
