//! The simulated memory: each device's address space (VMM reservations and linear allocations
//! from disjoint regions, an [`IntervalSet`] of free ranges each), physical handles, mappings and
//! access rights, linear allocations, their translation into physical [`Piece`]s, the capacity and
//! byte-budget checks on commits, and the lazily allocated host backing behind
//! [`SimDriver::read`] and [`SimDriver::write`].

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use rustc_hash::FxHashMap;

use super::codes::CUDA_ERROR_NOT_SUPPORTED;
use super::{err, invalid, oom, DevState, Device, SimDriver};
use crate::driver::{DeviceId, DriverCall, DriverError, DriverErrorKind, DriverResult};

/// Base of device 0's VMM region.
pub(super) const REGION_BASE: u64 = 0x7000_0000_0000;
/// Distance between two devices' regions.
pub(super) const DEVICE_STRIDE: u64 = 1 << 45;
/// Size of each of a device's two regions (VMM, then linear).
pub(super) const REGION_SPAN: u64 = 1 << 44;
/// Alignment of linear allocations (`cuMemAlloc` aligns to at least 256 B).
pub(super) const LINEAR_ALIGN: u64 = 512;
/// Host backing is allocated in chunks of this many bytes.
const CHUNK: u64 = 64 * 1024;
/// The call kind named by errors of [`SimDriver::read`] and [`SimDriver::write`].
const ACCESS_CALL: DriverCall = DriverCall::SetAccess;

/// Disjoint, non-adjacent half-open intervals `start -> end`.
#[derive(Debug, Default)]
pub(super) struct IntervalSet {
    /// Start -> end; `pub(super)` only for the unit tests, which check the merging directly.
    pub(super) map: BTreeMap<u64, u64>,
}

impl IntervalSet {
    pub(super) fn with(start: u64, end: u64) -> Self {
        let mut s = Self::default();
        s.insert(start, end);
        s
    }

    pub(super) fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        if let Some((&s, &e)) = self.map.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
                self.map.remove(&s);
            }
        }
        while let Some((&s, &e)) = self.map.range(start..=end).next() {
            end = end.max(e);
            self.map.remove(&s);
        }
        self.map.insert(start, end);
    }

    pub(super) fn remove(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let mut hits: Vec<(u64, u64)> = Vec::new();
        if let Some((&s, &e)) = self.map.range(..start).next_back() {
            if e > start {
                hits.push((s, e));
            }
        }
        hits.extend(self.map.range(start..end).map(|(&s, &e)| (s, e)));
        for (s, e) in hits {
            self.map.remove(&s);
            if s < start {
                self.map.insert(s, start);
            }
            if e > end {
                self.map.insert(end, e);
            }
        }
    }

    pub(super) fn contains(&self, start: u64, end: u64) -> bool {
        if start >= end {
            return true;
        }
        match self.map.range(..=start).next_back() {
            Some((_, &e)) => e >= end,
            None => false,
        }
    }

    /// Carves the first (lowest) `size` bytes aligned to `align` out of the set.
    pub(super) fn alloc(&mut self, size: u64, align: u64) -> Option<u64> {
        let found = self.map.iter().find_map(|(&s, &e)| {
            let a = round_up(s, align)?;
            let stop = a.checked_add(size)?;
            (stop <= e).then_some(a)
        })?;
        self.remove(found, found + size);
        Some(found)
    }
}

/// `x` rounded up to a multiple of `align`, or `None` on overflow. Callers pass `align > 0`
/// (the granularity, or `LINEAR_ALIGN`).
pub(super) fn round_up(x: u64, align: u64) -> Option<u64> {
    Some(x.checked_add(align - 1)? / align * align)
}

/// Lazily allocated host storage of one physical handle or linear allocation.
#[derive(Debug, Default)]
pub(super) struct Store {
    chunks: FxHashMap<u64, Box<[u8]>>,
}

impl Store {
    fn read(&self, off: u64, out: &mut [u8]) {
        let mut done = 0usize;
        while done < out.len() {
            let pos = off + done as u64;
            let within = (pos % CHUNK) as usize;
            let n = (CHUNK as usize - within).min(out.len() - done);
            match self.chunks.get(&(pos / CHUNK)) {
                Some(c) => out[done..done + n].copy_from_slice(&c[within..within + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
        }
    }

    fn write(&mut self, off: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let pos = off + done as u64;
            let within = (pos % CHUNK) as usize;
            let n = (CHUNK as usize - within).min(data.len() - done);
            let c = self
                .chunks
                .entry(pos / CHUNK)
                .or_insert_with(|| vec![0u8; CHUNK as usize].into_boxed_slice());
            c[within..within + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
    }
}

#[derive(Debug)]
pub(super) struct PhysAlloc {
    pub(super) size: u64,
    pub(super) map_count: u32,
    /// Handles of this memory not yet released: 1, plus one per import (`share.rs`).
    pub(super) refs: u32,
    pub(super) data: Store,
}

#[derive(Debug)]
pub(super) struct Mapping {
    pub(super) size: u64,
    pub(super) handle: u64,
}

#[derive(Debug)]
pub(super) struct LinearAlloc {
    pub(super) id: u64,
    pub(super) size: u64,
    pub(super) data: Store,
}

/// Which physical memory a piece lies in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum MemKey {
    Phys(u64),
    Linear(u64),
}

/// A contiguous piece of physical memory.
#[derive(Copy, Clone, Debug)]
pub(super) struct Piece {
    pub(super) key: MemKey,
    pub(super) off: u64,
    pub(super) len: u64,
}

impl Piece {
    pub(super) fn overlaps(&self, o: &Piece) -> bool {
        self.key == o.key && self.off < o.off + o.len && o.off < self.off + self.len
    }
}

impl DevState {
    pub(super) fn commit(&mut self, bytes: u64) {
        self.committed += bytes;
        self.peak = self.peak.max(self.committed);
    }

    /// Translates `[ptr, ptr + len)` into physical pieces; every byte must be allocated (and,
    /// with `need_access`, access-granted).
    pub(super) fn translate(
        &self,
        ptr: u64,
        len: u64,
        need_access: bool,
    ) -> Result<Vec<Piece>, String> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let end = ptr
            .checked_add(len)
            .ok_or_else(|| format!("range [{ptr:#x}, +{len:#x}) overflows"))?;
        if let Some((&base, la)) = self.linear.range(..=ptr).next_back() {
            let stop = base + la.size;
            if ptr < stop {
                if end > stop {
                    return Err(format!(
                        "[{ptr:#x}, {end:#x}) runs past the end of linear allocation \
                         [{base:#x}, {stop:#x})"
                    ));
                }
                return Ok(vec![Piece {
                    key: MemKey::Linear(la.id),
                    off: ptr - base,
                    len,
                }]);
            }
        }
        let mut pieces = Vec::new();
        let mut cur = ptr;
        while cur < end {
            let Some((&s, m)) = self
                .mappings
                .range(..=cur)
                .next_back()
                .filter(|(&s, m)| cur < s + m.size)
            else {
                return Err(format!("address {cur:#x} is neither mapped nor allocated"));
            };
            let stop = end.min(s + m.size);
            pieces.push(Piece {
                key: MemKey::Phys(m.handle),
                off: cur - s,
                len: stop - cur,
            });
            cur = stop;
        }
        if need_access && !self.access.contains(ptr, end) {
            return Err(format!(
                "[{ptr:#x}, {end:#x}) is mapped but access was not granted (set_access)"
            ));
        }
        Ok(pieces)
    }

    /// The physical pieces of whatever is allocated in `[ptr, ptr + len)`, ignoring gaps.
    pub(super) fn translate_lenient(&self, ptr: u64, len: u64) -> Vec<Piece> {
        let end = ptr.saturating_add(len);
        let mut pieces = Vec::new();
        let mut clip = |s: u64, size: u64, key: MemKey| {
            let lo = s.max(ptr);
            let hi = (s + size).min(end);
            if lo < hi {
                pieces.push(Piece {
                    key,
                    off: lo - s,
                    len: hi - lo,
                });
            }
        };
        if let Some((&s, l)) = self.linear.range(..ptr).next_back() {
            clip(s, l.size, MemKey::Linear(l.id));
        }
        for (&s, l) in self.linear.range(ptr..end) {
            clip(s, l.size, MemKey::Linear(l.id));
        }
        if let Some((&s, m)) = self.mappings.range(..ptr).next_back() {
            clip(s, m.size, MemKey::Phys(m.handle));
        }
        for (&s, m) in self.mappings.range(ptr..end) {
            clip(s, m.size, MemKey::Phys(m.handle));
        }
        pieces
    }

    fn store_mut(&mut self, key: MemKey) -> Option<&mut Store> {
        match key {
            MemKey::Phys(h) => self.handles.get_mut(&h).map(|p| &mut p.data),
            MemKey::Linear(id) => {
                let base = self.linear_ids.get(&id)?;
                self.linear.get_mut(base).map(|l| &mut l.data)
            }
        }
    }

    fn store(&self, key: MemKey) -> Option<&Store> {
        match key {
            MemKey::Phys(h) => self.handles.get(&h).map(|p| &p.data),
            MemKey::Linear(id) => {
                let base = self.linear_ids.get(&id)?;
                self.linear.get(base).map(|l| &l.data)
            }
        }
    }
}

impl SimDriver {
    pub(super) fn check_commit(
        &self,
        call: DriverCall,
        st: &DevState,
        size: u64,
    ) -> DriverResult<()> {
        let usable = self
            .config
            .capacity
            .saturating_sub(self.other_process_bytes.load(Ordering::Relaxed));
        let after = st.committed.saturating_add(size);
        if after > usable {
            return Err(oom(
                call,
                format!(
                    "out of memory: {size} bytes requested, {} committed, {usable} usable",
                    st.committed
                ),
            ));
        }
        let budget = self.byte_budget.load(Ordering::Relaxed);
        if after > budget {
            return Err(oom(
                call,
                format!("injected fault: byte budget of {budget} bytes exceeded"),
            ));
        }
        Ok(())
    }

    pub(super) fn granularity_check(
        &self,
        call: DriverCall,
        what: &str,
        v: u64,
    ) -> DriverResult<()> {
        // The granularity is a power of two (normalised in `new`).
        if v & (self.config.granularity - 1) != 0 {
            return Err(invalid(
                call,
                format!(
                    "{what} {v:#x} is not a multiple of the granularity {:#x}",
                    self.config.granularity
                ),
            ));
        }
        Ok(())
    }

    // --- host backing -------------------------------------------------------------------------

    fn backing_device(&self, dev: DeviceId) -> DriverResult<&Device> {
        let d = self.device(ACCESS_CALL, dev)?;
        if !self.config.backing {
            return Err(err(
                ACCESS_CALL,
                DriverErrorKind::NotSupported,
                CUDA_ERROR_NOT_SUPPORTED,
                "host backing is disabled (SimConfig::backing)",
            ));
        }
        Ok(d)
    }

    /// Writes `data` at device address `ptr` through the current mappings (needs
    /// [`SimConfig::backing`](super::SimConfig::backing); every byte must be mapped with access
    /// granted, or linear).
    pub fn write(&self, dev: DeviceId, ptr: u64, data: &[u8]) -> Result<(), DriverError> {
        let d = self.backing_device(dev)?;
        let mut st = d.state.lock();
        let pieces = st
            .translate(ptr, data.len() as u64, true)
            .map_err(|m| invalid(ACCESS_CALL, format!("write: {m}")))?;
        // The pieces tile `[ptr, ptr + data.len())` in order, so the slices below stay in bounds.
        let mut done = 0usize;
        for p in pieces {
            let n = p.len as usize;
            if let Some(s) = st.store_mut(p.key) {
                s.write(p.off, &data[done..done + n]);
            }
            done += n;
        }
        Ok(())
    }

    /// Reads `len` bytes at device address `ptr` through the current mappings (needs
    /// [`SimConfig::backing`](super::SimConfig::backing)); bytes never written read as zero.
    pub fn read(&self, dev: DeviceId, ptr: u64, len: usize) -> Result<Vec<u8>, DriverError> {
        let d = self.backing_device(dev)?;
        let st = d.state.lock();
        let pieces = st
            .translate(ptr, len as u64, true)
            .map_err(|m| invalid(ACCESS_CALL, format!("read: {m}")))?;
        let mut out = vec![0u8; len];
        // The pieces tile `[ptr, ptr + len)` in order, so the slices below stay in bounds.
        let mut done = 0usize;
        for p in pieces {
            let n = p.len as usize;
            if let Some(s) = st.store(p.key) {
                s.read(p.off, &mut out[done..done + n]);
            }
            done += n;
        }
        Ok(out)
    }

    /// Whether device `by` may touch `[ptr, ptr + len)` of device `dev`'s memory: for `by ==
    /// dev`, mapped with access granted (or inside a live linear allocation); for a peer, mapped
    /// with access granted to that peer by `set_access` (VMM mappings need it per peer; linear
    /// memory is a context's peer access, which the simulator does not model: `false`).
    pub fn accessible(&self, dev: DeviceId, ptr: u64, len: u64, by: DeviceId) -> bool {
        let Some(d) = self.devices.get(dev) else {
            return false;
        };
        let st = d.state.lock();
        if by == dev {
            return st.translate(ptr, len, true).is_ok();
        }
        let end = ptr.saturating_add(len);
        st.translate(ptr, len, true).is_ok()
            && st
                .peer_access
                .get(&by)
                .is_some_and(|s| s.contains(ptr, end))
    }
}
