//! Address space for the VMM heaps: reserving a heap's next virtual extent (sized by
//! `window::next_extent`, Note [Virtual extents] in `window.rs`), halving it when the address
//! space is short, and registering it in the range index. Growth (`vmm.rs`) calls it when no
//! extent of the heap has a free virtual range for a request.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::device::DeviceState;
use super::DevicePool;
use crate::arena::{Arena, ArenaState, Backing, HeapKind};
use crate::driver::{Driver, DriverErrorKind};
use crate::error::{Error, Result};

impl<D: Driver> DevicePool<D> {
    /// Reserves one more virtual extent for heap `kind` of `arena`, for a request of `rounded`
    /// bytes: `extent` bytes when the address space has room, else the largest of halves of it
    /// down to the request itself (the address space is one for all devices and the host, and
    /// may be limited by `RLIMIT_AS`). When not even that fits, the request fails as an OOM
    /// with its report, naming the address space: never as a bare driver error.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reserve_for(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        extent: u64,
        rounded: u64,
        size: u64,
    ) -> Result<u32> {
        let g = self.core.granularity;
        let least = rounded.div_ceil(g) * g;
        let mut want = extent.max(least);
        // The driver says CUDA_ERROR_OUT_OF_MEMORY when no range of the size is left (some
        // versions CUDA_ERROR_INVALID_VALUE for a size it cannot place); anything else is not
        // about room and is passed on.
        let last = loop {
            match self.reserve_extent(arena, a, kind, want) {
                Ok(seg) => return Ok(seg),
                Err(Error::Driver(e))
                    if matches!(
                        e.kind,
                        DriverErrorKind::OutOfMemory | DriverErrorKind::InvalidValue
                    ) =>
                {
                    if want == least {
                        break e;
                    }
                }
                Err(e) => return Err(e),
            }
            want = ((want / 2).div_ceil(g) * g).max(least);
        };
        let why = format!(
            "no virtual address space is left for a {least}-byte range (the address space is \
             shared by every device and the host, and RLIMIT_AS may limit it; fewer streams or \
             empty_cache() free some): {last}"
        );
        Err(self.oom_locked(dev, Some(a), arena.stream, size, rounded, false, &why))
    }

    /// Reserves one more virtual extent for heap `kind` of `arena`; returns its segment index.
    fn reserve_extent(
        &self,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: HeapKind,
        extent: u64,
    ) -> Result<u32> {
        let c = &*self.core;
        let base = c
            .driver
            .reserve_va(c.dev, extent, c.granularity)
            .inspect_err(|_| {
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
            })?;
        let pages = vec![None; (extent / c.granularity) as usize];
        let s = a.kinds[kind].add_segment(base, extent, Backing::Vmm { pages });
        a.kinds[kind].vmm_segs.push(s);
        self.ranges
            .write()
            .insert(base, (base + extent, Arc::downgrade(arena)));
        Ok(s)
    }
}
