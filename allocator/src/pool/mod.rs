//! The pool: per-device pools of per-stream arenas, growth, stitching, release and the OOM
//! protocol.
//!
//! # One allocation, end to end
//!
//! `alloc_raw(size, stream)` rounds `size` up to 512 B and picks the small heap (at most
//! `small_size`, 1 MiB by default) or the large one. It finds the stream's arena
//! (`crate::arena`) through a small thread-local cache (no shared lock), locks it, and asks the
//! heap for a free span (O(1), see `crate::heap`). On a hit it updates the arena's share of the
//! statistics, tells the driver's hazard hook, and returns: one uncontended lock, no driver
//! call.
//!
//! On a miss it takes the slow path, `DevicePool::grow` (`grow.rs`), under the device lock:
//!
//! 1. poll the events of pending (`record_stream`ed) frees;
//! 2. with VMM, choose a *window* in the arena's virtual segment for the request: the run of free
//!    space and unmapped holes that needs the fewest new pages (often the growing end);
//! 3. find physical pages for the unmapped part of the window, cheapest first: **stitch** whole
//!    free pages cached anywhere in the device pool (any arena, either heap): an idle stream's
//!    (an event query) are unmapped where they are; a busy stream's, by default
//!    (`stream_sync:device`), are mapped at their new address while the old mapping stays,
//!    the taking stream waits for the donor's work on the GPU, and the old mapping is unmapped
//!    at a later growth once that work is done (Note \[Moves ordered on the device\] in
//!    `pages.rs`); then create new chunks with the driver while the per-process limit and the
//!    device allow. With `stream_sync:pressure` a busy stream's pages are left while new
//!    memory can cover the request and waited for under memory pressure; with `always`,
//!    growth waits for busy streams first and takes their cached chunks before creating any;
//! 4. if that is not enough: wait for pending frees' events, free them, and retry once; then
//!    fail with an [`OomReport`](crate::OomReport) (pages already gathered stay mapped in the
//!    window as cache);
//! 5. map the pages into the window, grant access once per run of pages, and take the block.
//!
//! # Note [What growth costs on a real driver]
//!
//! `cuMemCreate` (~195 µs a handle), `cuMemSetAccess` (~36 µs a call) and `cuMemUnmap` (~26 µs)
//! dominate; a host wait idles the GPU. So growth grants access per run of mapped pages, not
//! per page; reads `cuMemGetInfo` (~10 µs) only when its last answer, corrected by what this
//! pool reserved since, says the device may be too full (`DeviceState::free_seen`); polls
//! pending frees per stream only up to the first unfinished event; buys memory in chunks of
//! up to 20 MiB (Note \[Chunks\] in `vmm.rs`); while memory is plentiful, leaves chunks that
//! would go straight back where they came from (Note \[No bounce\] in `pages.rs`); moves a busy
//! stream's pages with the order kept on the GPU instead of waiting for it; and blocks the
//! host only where the GPU cannot keep that order (a graph capture, a stream that cannot be
//! named: a retired arena is reaped after a device synchronisation), or on explicit
//! `empty_cache` / `set_memory_fraction` / `trim` (without VMM, the release threshold too
//! waits for those, as `cuMemFree` synchronises the device).
//!
//! Without VMM the arena grows by `cuMemAlloc` segments (2 MiB for small requests, 20 MiB for
//! requests under 10 MiB, else the request rounded to 2 MiB, as PyTorch does), and the OOM
//! protocol releases wholly free segments of every arena before retrying.
//!
//! # Note [Why pages move, not blocks]
//!
//! A block freed on stream S may still be read by queued work on S. S itself can reuse it at
//! once (stream order), but another stream cannot without an event. Rather than recording an
//! event on every free (a driver call on the hot path), arenas never lend blocks across
//! streams; whole free *pages* move instead, on the slow path, once an event recorded on the
//! donor stream has completed, or ordered after it on the GPU (the taking stream waits for it;
//! the old mapping stays until it completes). This keeps the hot path free of driver calls
//! and still lets every stream's cache serve every other stream: physical fragmentation is
//! bounded by the partially used pages at the edges of live runs.
//!
//! # Locks
//!
//! Order: device lock, then arena locks (the target arena first), then the range index and the
//! graph pools' lock (leaves: nothing is taken under them; stream filters run under the graph
//! pools' lock and must not call the pool). The hot path takes one arena lock and nothing else.
//! Any path that holds two arena locks holds the device lock, so arena locks cannot deadlock.
//! Every driver call that queries or waits is made under the device lock or an arena lock, so
//! taking each once (`graphs.rs`, opening a window) waits for all such calls under way.
//!
//! # Layout
//!
//! | module | owns |
//! |---|---|
//! | `mod.rs` | [`Pool`] over every device, this contract and the lock order |
//! | `device.rs` | [`DevicePool`], its device-lock state, the thread-local arena cache, the hot path (alloc, free, `record_stream`) and teardown |
//! | `grow.rs` | the slow path: `grow` picks the strategy (VMM in `vmm.rs`, `cuMemAlloc` segments here), the give-up rule, the OOM report |
//! | `vmm.rs` | VMM growth in named phases (plan, feasibility, gather, map) and stitching |
//! | `pages.rs` | chunks in and out of page tables: mapping, releasing, stealing |
//! | `window.rs` | the pure window arithmetic (which pages a request needs, which pages are free) |
//! | `peers.rs` | peer access: which other devices are granted every mapping |
//! | `graphs.rs` | graph pools (CUDA graphs' private memory) and capture-safe operation |
//! | `release.rs` | `empty_cache`, `trim`, the memory fraction, the release threshold |
//! | `report.rs` | statistics, invariant checks, live views, snapshots, reports |
//! | `buffer.rs` | [`Buffer`], the owning handle |
//! | `publish.rs` | the pool's side of the cross-process registry: its `RecordSource`, device records, [`Pool::start_registry`] |
//!
//! An arena's own books (heaps, page tables, live map, pending frees) are `crate::arena`'s,
//! one layer down; nothing there names the pool.
//!
//! # The contract between the hot path and growth
//!
//! The hot path ([`DevicePool::alloc_raw`], `free_raw`) only ever asks an arena's heap for a
//! free span of the request's heap kind, and gives spans back. Either growth strategy (VMM
//! extents in `vmm.rs`, `cuMemAlloc` segments in `grow.rs`) must supply, under the device lock
//! and the target arena's lock:
//!
//! 1. **Backed free space.** After growth returns `Done(ptr)`, `ptr` is a live span of the
//!    target arena taken for the request; every byte of every free or live span is backed by
//!    mapped, accessible memory; holes (unmapped VMM pages) are never handed out.
//! 2. **Ranges indexed.** Every segment added to a heap is entered in the range index (segment
//!    base → end, arena) before any of its spans is handed out, so that a free without the
//!    right stream finds its arena; a linear segment leaves the index only once it holds no
//!    live or pending block (VMM extents stay indexed until the pool is dropped).
//! 3. **Feasibility first.** A VMM request that the limit or the device's free memory rules
//!    out is rejected before anything moves: no counter changes but the OOM counters, and
//!    reserved memory stays as it was (ACCEPTANCE B8). Two exceptions, both leaving memory in
//!    a usable state: a request that passes the check but runs short while gathering (the
//!    driver ran out, e.g. another process took memory, or cached chunks packed less well into
//!    the window than the check's largest-first placement) keeps the chunks it stitched,
//!    mapped in its window as cache, and releases the chunks it created; linear growth first
//!    returns wholly free segments to the driver, then tries again.
//! 4. **Accounting.** `DeviceState::reserved` and `segments` equal what the driver holds for
//!    this pool (mapped pages, linear segments, and handles whose release or unmap failed), by
//!    heap kind and in all, and reserved never exceeds the limit except by what live blocks kept
//!    after the limit was lowered.
//! 5. **Cross-stream safety.** Memory moves between arenas only as whole free chunks (VMM),
//!    after the donor stream's work on them is known finished or with the taking stream
//!    ordered after it on the GPU (and the old mapping unmapped only once it is finished), or
//!    as wholly free segments returned to the driver (`cuMemFree` synchronises); no block is
//!    ever reused by another stream.
//! 6. **Give up once.** When memory is short and frees are waiting on events, growth asks for
//!    one retry of the OOM protocol (`Grow::Retry`); otherwise it fails with an
//!    [`OomReport`](crate::OomReport).
//!
//! [`check_invariants`](DevicePool::check_invariants), run after every operation in the tests,
//! checks 1 (every non-hole span's pages are mapped), 2, and 4 in total (reserved equals mapped
//! pages, linear segments and lost handles; all equals small plus large; the limit), not per
//! heap kind or for the segment counts.

mod buffer;
mod device;
mod extent;
mod graphs;
mod grow;
mod observe;
mod pages;
mod peers;
mod placement;
mod publish;
mod release;
mod report;
mod share;
mod sizing;
mod vmm;
mod window;

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::config::Config;
use crate::driver::{DeviceId, Driver, StreamId};
use crate::error::{Error, Result};
use crate::heap::ALIGN;
use crate::stats::Stats;

pub use buffer::Buffer;
pub use device::DevicePool;
pub use graphs::{
    CheckpointBlock, GraphPoolInfo, MempoolId, PoolCheckpoint, RestoreDelta, StreamFilter,
};
pub(crate) use observe::ObserverSlot;
pub use observe::{Observer, PoolEvent, PoolEventKind};
pub use report::{BlockInfo, BlockSnapshot, BlockState, CacheInfo, DeviceReport, SegmentSnapshot};
pub use share::Imported;
pub(crate) use share::ShareState;

/// Rounds a request up to the pool's 512 B unit; `None` on overflow.
#[inline]
pub fn round_size(size: u64) -> Option<u64> {
    size.checked_add(ALIGN - 1).map(|s| s & !(ALIGN - 1))
}

/// The pool for every device of a driver: per-device pools created on first use.
///
/// # Publishing to the cross-process registry
///
/// A Rust program that wants `cistern ps / leaks / doctor` to see its pool keeps the pool in an
/// `Arc` and calls [`Pool::start_registry`] once (`libcistern.so` does it for its global pool):
///
/// ```no_run
/// # use std::sync::Arc;
/// # use cistern::{Config, Pool, SimConfig, SimDriver};
/// let pool = Arc::new(Pool::new(SimDriver::new(SimConfig::default()), Config::default())?);
/// if let Err(e) = pool.start_registry() {
///     eprintln!("cistern: not published: {e}");
/// }
/// # Ok::<(), cistern::Error>(())
/// ```
pub struct Pool<D: Driver> {
    driver: Arc<D>,
    config: Config,
    devices: Vec<OnceLock<Arc<DevicePool<D>>>>,
    /// Held while a device pool is created; it keeps the observer devices created later get.
    create: Mutex<Option<Observer>>,
}

impl<D: Driver> Pool<D> {
    /// A pool over `driver` with `config`. Fails when the configuration is invalid or the
    /// driver cannot count its devices.
    pub fn new(driver: D, config: Config) -> Result<Self> {
        config.validate()?;
        // A fork() child of this process must never take the pool's locks (see `crate::fork`).
        crate::fork::watch();
        let driver = Arc::new(driver);
        let n = driver.device_count()?;
        Ok(Pool {
            driver,
            config,
            devices: (0..n).map(|_| OnceLock::new()).collect(),
            create: Mutex::new(None),
        })
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// How many devices there are.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The pool of device `dev`, created on first use.
    pub fn device(&self, dev: DeviceId) -> Result<&Arc<DevicePool<D>>> {
        let slot = self.devices.get(dev).ok_or_else(|| Error::InvalidDevice {
            device: dev,
            count: self.devices.len(),
            driver: self.driver.name(),
        })?;
        if let Some(p) = slot.get() {
            return Ok(p);
        }
        // Before the lock: a fork() child must never take one (see `crate::fork`).
        crate::fork::check()?;
        let g = self.create.lock();
        if let Some(p) = slot.get() {
            return Ok(p);
        }
        let p = Arc::new(DevicePool::new(
            self.driver.clone(),
            dev,
            self.config.clone(),
        )?);
        drop(p.core_observer_set(g.clone()));
        Ok(slot.get_or_init(|| p))
    }

    /// Sets (or, with `None`, removes) the observer of every device's mappings, segments and
    /// completed frees, present and created later (see [`PoolEvent`]).
    pub fn set_observer(&self, observer: Option<Observer>) {
        // The old observers are dropped after the lock is released: dropping one may release a
        // C caller's context, which may call cistern.
        let mut old = Vec::new();
        {
            let mut g = self.create.lock();
            old.push(std::mem::replace(&mut *g, observer.clone()));
            for d in self.devices() {
                old.push(d.core_observer_set(observer.clone()));
            }
        }
        drop(old);
    }

    /// The device pools created so far.
    pub fn devices(&self) -> impl Iterator<Item = &Arc<DevicePool<D>>> {
        self.devices.iter().filter_map(|d| d.get())
    }

    /// Allocates a buffer of `size` bytes on device `dev` for use on `stream`.
    pub fn try_alloc(&self, dev: DeviceId, size: u64, stream: StreamId) -> Result<Buffer<D>> {
        self.device(dev)?.try_alloc(size, stream)
    }

    /// Like [`Pool::try_alloc`], but panics on failure (with the OOM report).
    pub fn alloc(&self, dev: DeviceId, size: u64, stream: StreamId) -> Buffer<D> {
        match self.try_alloc(dev, size, stream) {
            Ok(b) => b,
            Err(e) => panic!("cistern: allocation of {size} bytes failed: {e}"),
        }
    }

    /// Allocates `size` bytes on device `dev` and returns the raw pointer (0 for size 0).
    pub fn alloc_raw(&self, dev: DeviceId, size: u64, stream: StreamId) -> Result<u64> {
        self.device(dev)?.alloc_raw(size, stream)
    }

    /// Frees a raw pointer from [`Pool::alloc_raw`], on whichever device owns it.
    pub fn free_raw(&self, ptr: u64, stream: StreamId) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        // Before `owns` takes a device's range lock: a fork() child must never take one (see
        // `crate::fork`).
        crate::fork::check()?;
        for d in self.devices() {
            if d.owns(ptr) {
                return d.free_raw(ptr, stream);
            }
        }
        match self.devices().next() {
            // Counted and logged by the device pool.
            Some(d) => d.free_raw(ptr, stream),
            None => Err(Error::InvalidArgument(format!(
                "{ptr:#x} is not a live allocation: no device pool exists yet"
            ))),
        }
    }

    /// Declares that `stream` uses the block containing `ptr` (see
    /// [`DevicePool::record_stream`]).
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<()> {
        crate::fork::check()?;
        for d in self.devices() {
            if d.owns(ptr) {
                return d.record_stream(ptr, stream);
            }
        }
        Err(Error::InvalidArgument(format!(
            "record_stream: {ptr:#x} is not memory of this pool"
        )))
    }

    /// Describes the live block containing `ptr` for another process (see
    /// [`DevicePool::share`]), with the device that owns it.
    pub fn share(&self, ptr: u64) -> Result<(DeviceId, crate::ipc::Share)> {
        crate::fork::check()?;
        for d in self.devices() {
            if d.owns(ptr) {
                return Ok((d.device(), d.share(ptr)?));
            }
        }
        Err(Error::InvalidArgument(format!(
            "share: {ptr:#x} is not memory of this pool"
        )))
    }

    /// Maps memory another process shared into this one on device `dev` (see
    /// [`DevicePool::open_shared`]); returns the range's base.
    pub fn open_shared(&self, dev: DeviceId, memory: &crate::ipc::Shared) -> Result<u64> {
        self.device(dev)?.open_shared(memory)
    }

    /// Drops one open of a range from [`Pool::open_shared`] on device `dev`.
    pub fn close_shared(&self, dev: DeviceId, base: u64) -> Result<()> {
        self.device(dev)?.close_shared(base)
    }

    /// Says that `stream` is about to be destroyed (or just was): the pool never names the
    /// handle again, and a later stream that gets the same handle from the driver starts
    /// afresh instead of being served the gone stream's cached blocks (see
    /// [`DevicePool::forget_stream`]). Blocks still live on it stay valid. The special handles
    /// (`0`, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) cannot be destroyed: refused.
    pub fn forget_stream(&self, stream: StreamId) -> Result<()> {
        if stream.is_special() {
            return Err(Error::InvalidArgument(format!(
                "forget_stream({stream}): the default streams cannot be destroyed"
            )));
        }
        for d in self.devices() {
            d.forget_stream(stream);
        }
        Ok(())
    }

    /// Statistics of device `dev`.
    pub fn stats(&self, dev: DeviceId) -> Result<Stats> {
        Ok(self.device(dev)?.stats())
    }

    /// Resets the peaks of device `dev`.
    pub fn reset_peak_stats(&self, dev: DeviceId) -> Result<()> {
        self.device(dev)?.reset_peak_stats();
        Ok(())
    }

    /// Returns every device's cached memory to the driver.
    pub fn empty_cache(&self) {
        for d in self.devices() {
            d.empty_cache();
        }
    }

    /// Grants device `peer` read/write access to every mapping of device `dev`'s pool, present
    /// and future (see [`DevicePool::enable_peer_access`]).
    pub fn enable_peer_access(&self, dev: DeviceId, peer: DeviceId) -> Result<()> {
        self.device(dev)?.enable_peer_access(peer)
    }

    /// Opens an allocation window into graph pool `id` on device `dev` (see
    /// [`DevicePool::begin_allocate_to_pool`]).
    pub fn begin_allocate_to_pool(
        &self,
        dev: DeviceId,
        id: MempoolId,
        filter: Option<StreamFilter>,
    ) -> Result<()> {
        self.device(dev)?.begin_allocate_to_pool(id, filter);
        Ok(())
    }

    /// Closes the allocation window into graph pool `id` on device `dev` (see
    /// [`DevicePool::end_allocate_to_pool`]).
    pub fn end_allocate_to_pool(&self, dev: DeviceId, id: MempoolId) -> Result<()> {
        self.device(dev)?.end_allocate_to_pool(id)
    }

    /// One more use of graph pool `id` on device `dev`, without a window (see
    /// [`DevicePool::create_or_incref_pool`]).
    pub fn create_or_incref_pool(&self, dev: DeviceId, id: MempoolId) -> Result<()> {
        self.device(dev)?.create_or_incref_pool(id);
        Ok(())
    }

    /// The uses of graph pool `id` on device `dev` not yet released (see
    /// [`DevicePool::pool_use_count`]).
    pub fn pool_use_count(&self, dev: DeviceId, id: MempoolId) -> Result<u64> {
        Ok(self.device(dev)?.pool_use_count(id))
    }

    /// Drops one use of graph pool `id` on device `dev` (see [`DevicePool::release_pool`]).
    pub fn release_pool(&self, dev: DeviceId, id: MempoolId) -> Result<()> {
        self.device(dev)?.release_pool(id)
    }

    /// The largest free block of device `dev` and its room to grow (see
    /// [`DevicePool::cache_info`]).
    pub fn cache_info(&self, dev: DeviceId) -> Result<CacheInfo> {
        Ok(self.device(dev)?.cache_info())
    }

    /// Releases the cached memory of graph pool `id` on every device once the pool is released
    /// there (see [`DevicePool::empty_pool_cache`]), as PyTorch's `emptyCache(mempool_id)`;
    /// returns the bytes released. Devices this process has not used are left untouched (no
    /// pool is made for them).
    pub fn empty_pool_cache(&self, id: MempoolId) -> u64 {
        self.devices().map(|d| d.empty_pool_cache(id)).sum()
    }

    /// The live blocks of graph pool `id` on device `dev` (see
    /// [`DevicePool::pool_live_blocks`]).
    pub fn pool_live_blocks(&self, dev: DeviceId, id: MempoolId) -> Result<Vec<u64>> {
        self.device(dev)?.pool_live_blocks(id)
    }

    /// A checkpoint of graph pool `id` on device `dev` (see [`DevicePool::checkpoint_pool`]).
    pub fn checkpoint_pool(&self, dev: DeviceId, id: MempoolId) -> Result<PoolCheckpoint> {
        self.device(dev)?.checkpoint_pool(id)
    }

    /// Puts a graph pool of device `dev` back to checkpoint `cp` (see
    /// [`DevicePool::restore_pool`]).
    pub fn restore_pool(&self, dev: DeviceId, cp: &PoolCheckpoint) -> Result<RestoreDelta> {
        self.device(dev)?.restore_pool(cp)
    }

    /// Sets device `dev`'s per-process limit as a fraction of its memory.
    pub fn set_memory_fraction(&self, dev: DeviceId, fraction: f64) -> Result<()> {
        self.device(dev)?.set_memory_fraction(fraction)
    }

    /// Checks every device pool's invariants.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for d in self.devices() {
            d.check_invariants()
                .map_err(|e| format!("device {}: {e}", d.device()))?;
        }
        Ok(())
    }

    /// A summary of every device pool created so far.
    pub fn report(&self) -> PoolReport {
        PoolReport {
            devices: self.devices().map(|d| d.report()).collect(),
        }
    }
}

/// A summary of a whole pool.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PoolReport {
    /// One entry per device pool in use.
    pub devices: Vec<DeviceReport>,
}

impl std::fmt::Display for PoolReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.devices.is_empty() {
            return f.write_str("no device pool in use");
        }
        for (i, d) in self.devices.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}
