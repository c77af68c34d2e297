//! The allocators a benchmark can drive: cistern on the simulated GPU, and host `mimalloc` as
//! the reference.
//!
//! This module owns the one seam the measured loop calls through ([`Backend`]) and the only
//! `unsafe` code of the benchmarks (the `GlobalAlloc` calls into mimalloc). It never decides
//! sizes or order; see [`crate::workload`].

use std::alloc::{GlobalAlloc, Layout};
use std::collections::BTreeMap;
use std::sync::Arc;

use cistern::driver::DriverCall;
use cistern::{Config, DevicePool, Pool, SimConfig, SimDriver, StreamId};
use mimalloc::MiMalloc;

/// The simulated device's capacity: 160 GiB (see [`crate::workload::MAX_LIVE_BYTES_PER_THREAD`]
/// for why not more).
pub const DEVICE_CAPACITY: u64 = 160 << 30;

/// The alignment of host blocks: what `malloc` guarantees on x86-64 and aarch64.
pub const HOST_ALIGN: usize = 16;

/// An allocator the measured loop can drive. `lane` is the thread's index (0 or 1).
pub trait Backend: Send + Sync + 'static {
    /// A live block.
    type Ptr: Copy;
    /// The name used in reports and benchmark ids.
    const NAME: &'static str;
    /// Allocates `size` bytes for thread `lane`; panics on failure (a failed allocation makes
    /// the measurement meaningless).
    fn alloc(&self, size: u64, lane: usize) -> Self::Ptr;
    /// Frees a block of `size` bytes.
    ///
    /// # Safety
    ///
    /// `ptr` was returned by `self.alloc(size, lane)` with this same `size` and `lane`, and is
    /// not used or freed again afterwards.
    unsafe fn free(&self, ptr: Self::Ptr, size: u64, lane: usize);
    /// The driver calls made so far, by kind, where the backend has a driver.
    fn driver_calls(&self) -> Option<BTreeMap<DriverCall, u64>> {
        None
    }
}

/// The stream of thread `lane`: `StreamId(lane + 1)`, so each thread has its own arena.
#[inline]
pub fn stream_of(lane: usize) -> StreamId {
    StreamId(lane as u64 + 1)
}

/// cistern's device pool 0 on a [`SimDriver`] of [`DEVICE_CAPACITY`] bytes, default settings.
pub struct Cistern {
    sim: Arc<SimDriver>,
    dev: Arc<DevicePool<Arc<SimDriver>>>,
    // Keeps the pool (and so the device pool's owner) alive; declared last so it drops last.
    _pool: Pool<Arc<SimDriver>>,
}

impl Cistern {
    /// A fresh simulator and pool.
    pub fn new() -> Cistern {
        let sim = Arc::new(SimDriver::new(
            SimConfig::default().capacity(DEVICE_CAPACITY),
        ));
        let pool = match Pool::new(sim.clone(), Config::default()) {
            Ok(p) => p,
            Err(e) => panic!("cannot create a pool on the simulated GPU: {e}"),
        };
        let dev = match pool.device(0) {
            Ok(d) => d.clone(),
            Err(e) => panic!("the simulated GPU has no device 0: {e}"),
        };
        Cistern {
            sim,
            dev,
            _pool: pool,
        }
    }

    /// The simulator (for its call counters).
    pub fn sim(&self) -> &SimDriver {
        &self.sim
    }
}

impl Default for Cistern {
    fn default() -> Self {
        Cistern::new()
    }
}

impl Backend for Cistern {
    type Ptr = u64;
    const NAME: &'static str = "cistern";

    #[inline]
    fn alloc(&self, size: u64, lane: usize) -> u64 {
        match self.dev.alloc_raw(size, stream_of(lane)) {
            Ok(p) => p,
            Err(e) => panic!("cistern failed to allocate {size} B on lane {lane}: {e}"),
        }
    }

    #[inline]
    unsafe fn free(&self, ptr: u64, _size: u64, lane: usize) {
        if let Err(e) = self.dev.free_raw(ptr, stream_of(lane)) {
            panic!("cistern failed to free {ptr:#x} on lane {lane}: {e}");
        }
    }

    fn driver_calls(&self) -> Option<BTreeMap<DriverCall, u64>> {
        Some(self.sim.call_counts())
    }
}

/// Host `malloc`/`free` through mimalloc, called as a [`GlobalAlloc`] directly (not installed as
/// the global allocator, so the harness's own allocations do not go through it).
#[derive(Clone, Copy, Debug, Default)]
pub struct HostMimalloc;

impl HostMimalloc {
    #[inline]
    fn layout(size: u64) -> Layout {
        match Layout::from_size_align(size as usize, HOST_ALIGN) {
            Ok(l) => l,
            Err(e) => panic!("no host layout for {size} B: {e}"),
        }
    }
}

impl Backend for HostMimalloc {
    type Ptr = *mut u8;
    const NAME: &'static str = "mimalloc";

    #[inline]
    fn alloc(&self, size: u64, _lane: usize) -> *mut u8 {
        assert!(size > 0, "host blocks must not be empty");
        // SAFETY: the layout has a nonzero size (checked above) and a power-of-two alignment
        // (`Layout::from_size_align` checked it), which is all `GlobalAlloc::alloc` requires.
        let p = unsafe { MiMalloc.alloc(Self::layout(size)) };
        if p.is_null() {
            panic!("mimalloc failed to allocate {size} B");
        }
        p
    }

    #[inline]
    unsafe fn free(&self, ptr: *mut u8, size: u64, _lane: usize) {
        // SAFETY: our caller guarantees (see `Backend::free`) that `ptr` came from
        // `self.alloc(size, _)`, i.e. from `MiMalloc.alloc` with the layout `layout(size)`
        // rebuilds here, and that it is freed only once.
        unsafe { MiMalloc.dealloc(ptr, Self::layout(size)) }
    }
}
