//! The pool: per-device pools of per-stream arenas, growth, stitching, release and the OOM
//! protocol.
//!
//! # One allocation, end to end
//!
//! `alloc_raw(size, stream)` rounds `size` up to 512 B and picks the small heap (at most
//! `small_size`, 1 MiB by default) or the large one. It finds the stream's [`Arena`] through a
//! small thread-local cache (no shared lock), locks it, and asks the heap for a free span
//! (O(1), see [`crate::heap`]). On a hit it updates the arena's share of the statistics, tells
//! the driver's hazard hook, and returns: one uncontended lock, no driver call.
//!
//! On a miss it takes the slow path, [`DevicePool::grow`], under the device lock:
//!
//! 1. poll the events of pending (`record_stream`ed) frees;
//! 2. with VMM, choose a *window* in the arena's virtual segment for the request: the run of free
//!    space and unmapped holes that needs the fewest new pages (often the growing end);
//! 3. find physical pages for the unmapped part of the window, cheapest first: **stitch** whole
//!    free pages cached anywhere in the device pool (any arena, either heap), unmapping them
//!    where they are (after the owning stream's work has finished), then create new pages with
//!    the driver while the per-process limit allows;
//! 4. if that is not enough: wait for pending frees' events, free them, and retry once; then
//!    fail with an [`OomReport`] (pages already gathered stay mapped in the window as cache);
//! 5. map the pages into the window, grant access, and take the block.
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
//! streams; whole free *pages* move instead, on the slow path, after an event recorded on the
//! donor stream has completed. This keeps the hot path free of driver calls and still lets
//! every stream's cache serve every other stream: physical fragmentation is bounded by the
//! partially used pages at the edges of live runs.
//!
//! # Locks
//!
//! Order: device lock, then arena locks (the target arena first), then the range index (a
//! leaf). The hot path takes one arena lock and nothing else. Any path that holds two arena
//! locks holds the device lock, so arena locks cannot deadlock.

use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;

use crate::arena::{pool_index, ArenaState, Backing, FreeOutcome, LARGE, SMALL};
use crate::config::Config;
use crate::driver::{DeviceCaps, DeviceId, Driver, EventId, PhysHandle, StreamId};
use crate::error::{Error, OomReport, Result};
use crate::heap::{SpanState, ALIGN};
use crate::provenance::{LedgerEntry, LiveBlock, Mark, Mode, Origin};
use crate::stats::{ExactGauge, SharedGauges, Stats, GAUGES, GAUGE_NAMES, POOL_NAMES};

/// A cache of driver events, so that pending frees do not create and destroy one each time.
#[derive(Debug, Default)]
pub struct EventCache {
    free: Mutex<Vec<EventId>>,
}

impl EventCache {
    /// An event, from the cache or freshly created.
    pub(crate) fn get<D: Driver + ?Sized>(
        &self,
        driver: &D,
        dev: DeviceId,
    ) -> crate::driver::DriverResult<EventId> {
        if let Some(ev) = self.free.lock().pop() {
            return Ok(ev);
        }
        driver.event_create(dev)
    }

    /// Returns an event to the cache.
    pub(crate) fn put(&self, ev: EventId) {
        self.free.lock().push(ev);
    }

    fn drain(&self) -> Vec<EventId> {
        std::mem::take(&mut *self.free.lock())
    }
}

/// Event counters of a device pool (slow-path events; read into [`Stats`]).
#[derive(Debug, Default)]
struct Counters {
    num_alloc_retries: AtomicU64,
    num_ooms: AtomicU64,
    num_limit_ooms: AtomicU64,
    num_invalid_frees: AtomicU64,
    num_stitches: AtomicU64,
    num_stitched_pages: AtomicU64,
    num_cross_stream_pages: AtomicU64,
    num_device_alloc: AtomicU64,
    num_device_free: AtomicU64,
    num_sync_all_streams: AtomicU64,
    num_stream_syncs: AtomicU64,
    num_pending_frees: AtomicU64,
    num_released_pages: AtomicU64,
    num_driver_errors: AtomicU64,
    num_record_streams: AtomicU64,
}

/// What every arena of a device shares: the driver, the settings, the published statistics.
pub(crate) struct DeviceCore<D: Driver> {
    uid: u64,
    dev: DeviceId,
    driver: Arc<D>,
    caps: DeviceCaps,
    config: Config,
    granularity: u64,
    vmm: bool,
    shared: SharedGauges,
    events: EventCache,
    counters: Counters,
    closed: AtomicBool,
    recorder: Option<crate::trace_writer::Recorder>,
}

impl<D: Driver> DeviceCore<D> {
    fn invalid_free(&self, ptr: u64, why: &str) -> Error {
        self.counters.num_invalid_frees.fetch_add(1, Relaxed);
        let msg = format!(
            "cistern: ignoring free of {ptr:#x} on device {}: {why} (counted in num_invalid_frees)",
            self.dev
        );
        if self.config.strict {
            eprintln!("{msg}; aborting because strict:true is set");
            std::process::abort();
        }
        crate::log_rate_limited(&msg);
        Error::InvalidArgument(format!("{ptr:#x} is not a live allocation: {why}"))
    }

    /// Records an event on `stream` and waits for it: all work queued there so far is done.
    fn sync_stream(&self, stream: StreamId) -> bool {
        self.counters.num_stream_syncs.fetch_add(1, Relaxed);
        let d = &*self.driver;
        if let Ok(ev) = self.events.get(d, self.dev) {
            let ok = d.event_record(self.dev, ev, stream).is_ok()
                && d.event_synchronize(self.dev, ev).is_ok();
            self.events.put(ev);
            if ok {
                return true;
            }
        }
        self.counters.num_sync_all_streams.fetch_add(1, Relaxed);
        d.device_synchronize(self.dev).is_ok()
    }
}

/// One stream's share of a device pool.
pub struct Arena<D: Driver> {
    stream: StreamId,
    core: Arc<DeviceCore<D>>,
    state: Mutex<ArenaState>,
}

impl<D: Driver> Arena<D> {
    fn free_ptr(&self, ptr: u64) -> Result<()> {
        let c = &*self.core;
        // Before the block can be reused (see `DevicePool::free_raw`).
        if let Some(r) = &c.recorder {
            r.free(ptr);
        }
        let outcome =
            self.state
                .lock()
                .free(ptr, self.stream, c.dev, &*c.driver, &c.events, &c.shared);
        match outcome {
            FreeOutcome::Unknown => return Err(c.invalid_free(ptr, "unknown or already freed")),
            FreeOutcome::Pending => {
                c.counters.num_pending_frees.fetch_add(1, Relaxed);
            }
            FreeOutcome::Freed => {}
        }
        if c.closed.load(Relaxed) {
            self.teardown();
        }
        Ok(())
    }

    /// Releases everything the arena holds when no block is live or pending (after the device
    /// pool was dropped). Returns whether it did.
    fn teardown(&self) -> bool {
        let c = &*self.core;
        let mut a = self.state.lock();
        if !a.pending.is_empty() {
            a.process_pending(true, c.dev, &*c.driver, &c.events, &c.shared);
        }
        // A block still pending (its events could not be waited for) may still be used by
        // another stream: its pages stay mapped, like a live block's.
        if !a.live.is_empty() || !a.pending.is_empty() {
            return false;
        }
        let d = &*c.driver;
        let mut synced = false;
        for kh in &mut a.kinds {
            for slot in &mut kh.segments {
                let Some(seg) = slot.take() else { continue };
                if !synced {
                    c.sync_stream(self.stream);
                    synced = true;
                }
                match seg.backing {
                    Backing::Vmm { pages } => {
                        for (i, p) in pages.iter().enumerate() {
                            if let Some(h) = p {
                                let addr = seg.base + i as u64 * c.granularity;
                                let _ = d.unmap(c.dev, addr, c.granularity);
                                let _ = d.release_physical(c.dev, *h);
                            }
                        }
                        let _ = d.free_va(c.dev, seg.base, seg.len);
                    }
                    Backing::Linear => {
                        let _ = d.mem_free(c.dev, seg.base);
                    }
                }
                kh.heap.remove_segment(seg.first);
            }
            kh.vmm_segs.clear();
        }
        true
    }
}

impl<D: Driver> Drop for Arena<D> {
    fn drop(&mut self) {
        if !self.teardown() {
            let (n, p) = {
                let a = self.state.lock();
                (a.live.len(), a.pending.len())
            };
            crate::log_rate_limited(&format!(
                "cistern: {n} block(s) on device {} stream {} were never freed and {p} freed \
                 block(s) could not be waited for; their memory is left mapped so that their \
                 pointers stay valid",
                self.core.dev, self.stream
            ));
        }
    }
}

/// Device-level state behind the device lock: reserved memory and the limit.
#[derive(Debug)]
struct DeviceState {
    /// Reserved bytes by pool (0 all, 1 small, 2 large).
    reserved: [ExactGauge; 3],
    /// Physical handles or linear segments by pool.
    segments: [ExactGauge; 3],
    limit: u64,
    fraction: f64,
    /// Physical handles (with their heap kind) whose release failed: unmapped, still reserved.
    /// Growth maps them again before creating new pages; `empty_cache` retries releasing them.
    lost: Vec<(usize, PhysHandle)>,
    /// Handles mapped at an address (kind, handle, address) whose access could not be granted
    /// and which could not be unmapped either: still reserved, outside every heap's page
    /// table. `empty_cache` retries the unmap and the release.
    stuck: Vec<(usize, PhysHandle, u64)>,
    /// Reserved bytes right after the limit was last lowered (and cached memory released):
    /// live blocks may keep reserved above a lowered limit, never above this.
    over_limit: u64,
    /// The report of the last failed request (for the registry's record).
    last_oom: Option<Box<OomReport>>,
}

impl DeviceState {
    fn add_reserved(&mut self, kind: usize, bytes: i64) {
        self.reserved[0].add(bytes);
        self.reserved[pool_index(kind)].add(bytes);
    }
    fn add_segments(&mut self, kind: usize, n: i64) {
        self.segments[0].add(n);
        self.segments[pool_index(kind)].add(n);
    }
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

struct CacheEntry {
    uid: u64,
    stream: StreamId,
    arena: Arc<dyn Any + Send + Sync>,
}

const TLS_ENTRIES: usize = 4;

thread_local! {
    /// The arenas this thread used last: (pool uid, stream) -> arena. Saves a shared lock on
    /// every allocation.
    static ARENA_CACHE: RefCell<Vec<CacheEntry>> = const { RefCell::new(Vec::new()) };
}

/// Segment base -> (end, owning arena).
type RangeIndex<D> = BTreeMap<u64, (u64, Weak<Arena<D>>)>;

/// The pool of one device: an arena per stream, plus the state that all of them share.
pub struct DevicePool<D: Driver> {
    core: Arc<DeviceCore<D>>,
    arenas: RwLock<FxHashMap<StreamId, Arc<Arena<D>>>>,
    /// Segment base -> (end, owning arena), to find a pointer's arena without its stream.
    ranges: RwLock<RangeIndex<D>>,
    state: Mutex<DeviceState>,
}

/// The outcome of one attempt to grow.
enum Grow {
    Done(u64),
    Retry,
}

/// Rounds a request up to the pool's 512 B unit; `None` on overflow.
#[inline]
pub fn round_size(size: u64) -> Option<u64> {
    size.checked_add(ALIGN - 1).map(|s| s & !(ALIGN - 1))
}

impl<D: Driver> DevicePool<D> {
    /// A pool for device `dev`, using `driver` and `config`.
    pub fn new(driver: Arc<D>, dev: DeviceId, config: Config) -> Result<Self> {
        config.validate()?;
        let caps = driver.capabilities(dev)?;
        if caps.granularity == 0 || !caps.granularity.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "device {dev} reports granularity {} (not a power of two)",
                caps.granularity
            )));
        }
        let vmm = config.vmm && caps.vmm;
        // Starts the provenance clock no later than the first pool.
        crate::provenance::now_ns();
        let limit = config.limit_for(caps.total_memory);
        let recorder = match &config.record {
            Some(path) => Some(
                crate::trace_writer::Recorder::create(path, dev).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "{}: record: cannot create {}: {e}",
                        crate::config::ENV_VAR,
                        crate::trace_writer::Recorder::path_for(path, dev).display()
                    ))
                })?,
            ),
            None => None,
        };
        Ok(DevicePool {
            core: Arc::new(DeviceCore {
                uid: NEXT_UID.fetch_add(1, Relaxed),
                dev,
                granularity: caps.granularity.max(ALIGN),
                caps,
                vmm,
                config: config.clone(),
                driver,
                shared: SharedGauges::default(),
                events: EventCache::default(),
                counters: Counters::default(),
                closed: AtomicBool::new(false),
                recorder,
            }),
            arenas: RwLock::new(FxHashMap::default()),
            ranges: RwLock::new(BTreeMap::new()),
            state: Mutex::new(DeviceState {
                reserved: Default::default(),
                segments: Default::default(),
                limit,
                fraction: config.memory_fraction,
                over_limit: 0,
                last_oom: None,
                lost: Vec::new(),
                stuck: Vec::new(),
            }),
        })
    }

    /// The device ordinal.
    pub fn device(&self) -> DeviceId {
        self.core.dev
    }

    /// What the device can do.
    pub fn caps(&self) -> &DeviceCaps {
        &self.core.caps
    }

    /// Whether this pool maps pages itself (VMM) rather than using `cuMemAlloc` segments.
    pub fn uses_vmm(&self) -> bool {
        self.core.vmm
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.core.driver
    }

    /// The per-process limit on reserved bytes.
    pub fn limit(&self) -> u64 {
        self.state.lock().limit
    }

    fn arena(&self, stream: StreamId) -> Arc<Arena<D>> {
        if let Some(a) = self.arenas.read().get(&stream) {
            return a.clone();
        }
        let mut map = self.arenas.write();
        map.entry(stream)
            .or_insert_with(|| {
                Arc::new(Arena {
                    stream,
                    core: self.core.clone(),
                    state: Mutex::new(ArenaState::default()),
                })
            })
            .clone()
    }

    /// Runs `f` on the cached arena of `stream`, if this thread has it cached.
    #[inline]
    fn with_cached<R>(&self, stream: StreamId, f: impl FnOnce(&Arena<D>) -> R) -> Option<R> {
        let uid = self.core.uid;
        ARENA_CACHE
            .try_with(|cell| {
                let cache = cell.try_borrow().ok()?;
                let e = cache.iter().find(|e| e.uid == uid && e.stream == stream)?;
                let arena = e.arena.downcast_ref::<Arena<D>>()?;
                Some(f(arena))
            })
            .ok()
            .flatten()
    }

    /// The arena of `stream`, caching it for this thread.
    fn arena_cached(&self, stream: StreamId) -> Arc<Arena<D>> {
        let arena = self.arena(stream);
        let uid = self.core.uid;
        let _ = ARENA_CACHE.try_with(|cell| {
            if let Ok(mut cache) = cell.try_borrow_mut() {
                cache.retain(|e| !(e.uid == uid && e.stream == stream));
                if cache.len() >= TLS_ENTRIES {
                    cache.remove(0);
                }
                cache.push(CacheEntry {
                    uid,
                    stream,
                    arena: arena.clone(),
                });
            }
        });
        arena
    }

    #[inline]
    fn kind_of(&self, rounded: u64) -> usize {
        if rounded <= self.core.config.small_size {
            SMALL
        } else {
            LARGE
        }
    }

    /// The hot path on one arena: `Some(ptr)` on a cache hit.
    #[inline]
    fn fast_alloc(
        &self,
        arena: &Arena<D>,
        kind: usize,
        rounded: u64,
        size: u64,
        o: Option<&Origin>,
    ) -> Option<u64> {
        let c = &*self.core;
        let mut a = arena.state.lock();
        if !a.pending.is_empty() {
            a.process_pending(false, c.dev, &*c.driver, &c.events, &c.shared);
        }
        let (p, id) = a.try_take(kind, rounded, size, &c.shared)?;
        if let Some(o) = o {
            a.record(kind, id, rounded, o);
        }
        Some(p)
    }

    /// This allocation's provenance (see Note [Provenance on the hot path]); `None` when off.
    #[inline]
    fn origin(&self) -> Option<Origin> {
        let c = &self.core.config;
        match c.provenance {
            Mode::Off => None,
            m => Some(crate::provenance::origin(
                m == Mode::Stacks,
                c.stack_sample_rate,
            )),
        }
    }

    /// Allocates `size` bytes for use on `stream`; returns the device pointer (0 for size 0).
    pub fn alloc_raw(&self, size: u64, stream: StreamId) -> Result<u64> {
        self.alloc_inner(size, stream).map(|(p, _)| p)
    }

    /// Allocates and returns the pointer with the arena it came from (when needed).
    fn alloc_inner(&self, size: u64, stream: StreamId) -> Result<(u64, Option<Arc<Arena<D>>>)> {
        if size == 0 {
            return Ok((0, None));
        }
        let rounded = round_size(size)
            .ok_or_else(|| Error::InvalidArgument(format!("size {size} is too large to round")))?;
        let kind = self.kind_of(rounded);
        let o = self.origin();
        if let Some(Some(ptr)) = self.with_cached(stream, |a| {
            self.fast_alloc(a, kind, rounded, size, o.as_ref())
        }) {
            self.handed_out(ptr, rounded, size, stream);
            return Ok((ptr, None));
        }
        let arena = self.arena_cached(stream);
        let ptr = match self.fast_alloc(&arena, kind, rounded, size, o.as_ref()) {
            Some(p) => p,
            None => {
                let p = self.alloc_slow(&arena, kind, rounded, size)?;
                if let Some(o) = &o {
                    arena.state.lock().record_ptr(p, o);
                }
                p
            }
        };
        self.handed_out(ptr, rounded, size, stream);
        Ok((ptr, Some(arena)))
    }

    /// What every successful allocation does last: the hazard hook and the recorder.
    #[inline]
    fn handed_out(&self, ptr: u64, rounded: u64, size: u64, stream: StreamId) {
        let c = &*self.core;
        c.driver.note_handout(c.dev, ptr, rounded, stream);
        if let Some(r) = &c.recorder {
            r.alloc(ptr, size, stream);
        }
    }

    /// Allocates a [`Buffer`] that frees itself on drop.
    pub fn try_alloc(&self, size: u64, stream: StreamId) -> Result<Buffer<D>> {
        let (ptr, arena) = self.alloc_inner(size, stream)?;
        let arena = match (ptr, arena) {
            (0, _) => None,
            (_, Some(a)) => Some(a),
            (_, None) => Some(self.arena_cached(stream)),
        };
        Ok(Buffer {
            ptr,
            len: size,
            stream,
            device: self.core.dev,
            arena,
        })
    }

    #[cold]
    fn alloc_slow(
        &self,
        arena: &Arc<Arena<D>>,
        kind: usize,
        rounded: u64,
        size: u64,
    ) -> Result<u64> {
        let r = self.grow_with_retry(arena, kind, rounded, size);
        if let Some(rec) = &self.core.recorder {
            rec.reserved(self.state.lock().reserved[0].current.max(0) as u64);
        }
        r
    }

    fn grow_with_retry(
        &self,
        arena: &Arc<Arena<D>>,
        kind: usize,
        rounded: u64,
        size: u64,
    ) -> Result<u64> {
        let mut retried = false;
        loop {
            match self.grow(arena, kind, rounded, size, retried)? {
                Grow::Done(p) => return Ok(p),
                Grow::Retry => {
                    if retried {
                        // grow() only asks for one retry; a second request means a bug. Fail
                        // rather than loop.
                        return Err(self.oom(arena.stream, size, rounded, false, "retry loop"));
                    }
                    retried = true;
                    self.core.counters.num_alloc_retries.fetch_add(1, Relaxed);
                }
            }
        }
    }

    /// Frees the block at `ptr`. `stream` is a hint (the allocation's stream makes it fast).
    /// Freeing 0 is a no-op; an unknown pointer is counted, logged and reported as an error,
    /// and changes nothing.
    pub fn free_raw(&self, ptr: u64, stream: StreamId) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        let c = &*self.core;
        // The recorder hears of a free before the block can be handed out again, so another
        // thread's reuse of the address is always recorded after it (it ignores unknown
        // pointers, so an invalid free records nothing).
        if let Some(r) = &c.recorder {
            r.free(ptr);
        }
        let hit = self.with_cached(stream, |a| {
            a.state
                .lock()
                .free(ptr, a.stream, c.dev, &*c.driver, &c.events, &c.shared)
        });
        match hit {
            Some(FreeOutcome::Freed) => return Ok(()),
            Some(FreeOutcome::Pending) => {
                c.counters.num_pending_frees.fetch_add(1, Relaxed);
                return Ok(());
            }
            _ => {}
        }
        match self.arena_of(ptr) {
            Some(a) => a.free_ptr(ptr),
            None => Err(c.invalid_free(ptr, "not an address of this pool")),
        }
    }

    /// The arena whose segments contain `addr`.
    fn arena_of(&self, addr: u64) -> Option<Arc<Arena<D>>> {
        let ranges = self.ranges.read();
        let (_, (end, arena)) = ranges.range(..=addr).next_back()?;
        if addr < *end {
            arena.upgrade()
        } else {
            None
        }
    }

    /// Whether `addr` lies in memory this pool manages.
    pub fn owns(&self, addr: u64) -> bool {
        self.arena_of(addr).is_some()
    }

    /// Marks the block containing `ptr` (its base or any address inside it) as used by
    /// `stream`: when it is freed, it is not reused until the work queued on `stream` by then
    /// has completed.
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<()> {
        let c = &*self.core;
        let Some(arena) = self.arena_of(ptr) else {
            c.counters.num_invalid_frees.fetch_add(1, Relaxed);
            return Err(Error::InvalidArgument(format!(
                "record_stream: {ptr:#x} is not memory of this pool"
            )));
        };
        c.counters.num_record_streams.fetch_add(1, Relaxed);
        let mut a = arena.state.lock();
        let Some(base) = a.block_containing(ptr) else {
            return Err(Error::InvalidArgument(format!(
                "record_stream: {ptr:#x} is not inside a live block"
            )));
        };
        if stream != arena.stream {
            let uses = a.uses.entry(base).or_default();
            if !uses.contains(&stream) {
                uses.push(stream);
            }
        }
        Ok(())
    }

    fn all_arenas(&self) -> Vec<Arc<Arena<D>>> {
        let mut v: Vec<_> = self.arenas.read().values().cloned().collect();
        v.sort_by_key(|a| a.stream);
        v
    }

    /// The slow path (see the module docs). Holds the device lock throughout.
    fn grow(
        &self,
        arena: &Arc<Arena<D>>,
        kind: usize,
        rounded: u64,
        size: u64,
        retried: bool,
    ) -> Result<Grow> {
        let c = &*self.core;
        let mut dev = self.state.lock();
        if retried {
            // OOM protocol: wait for every pending free's events, then look again.
            for other in self.all_arenas() {
                other
                    .state
                    .lock()
                    .process_pending(true, c.dev, &*c.driver, &c.events, &c.shared);
            }
        }
        let mut a = arena.state.lock();
        a.process_pending(false, c.dev, &*c.driver, &c.events, &c.shared);
        if let Some((p, _)) = a.try_take(kind, rounded, size, &c.shared) {
            return Ok(Grow::Done(p));
        }
        if c.vmm {
            self.grow_vmm(&mut dev, arena, &mut a, kind, rounded, size, retried)
        } else {
            drop(a);
            self.grow_linear(&mut dev, arena, kind, rounded, size, retried)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn grow_vmm(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: usize,
        rounded: u64,
        size: u64,
        retried: bool,
    ) -> Result<Grow> {
        let c = &*self.core;
        let g = c.granularity;
        let extent = vmm_extent(c.caps.total_memory, g, kind);
        if rounded > c.caps.total_memory {
            return Err(self.oom_locked(
                dev,
                Some(a),
                arena.stream,
                size,
                rounded,
                false,
                "the request is larger than the device",
            ));
        }
        if a.kinds[kind].vmm_segs.is_empty() {
            self.reserve_extent(arena, a, kind, extent)?;
        }
        // A page left mapped by a failed unmap sits in some arena's hole: unmap it before a
        // window there tries to map over it; its handle is then reused like any lost one.
        for (k, h, addr) in std::mem::take(&mut dev.stuck) {
            if c.driver.unmap(c.dev, addr, g).is_ok() {
                dev.lost.push((k, h));
            } else {
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                dev.stuck.push((k, h, addr));
            }
        }
        // The window needing the fewest new pages over this heap's extents; a new extent when
        // none has a free virtual range large enough (live blocks scattered through the
        // address space, e.g. KV caches that grow by reallocation).
        let mut choice: Option<(u32, u64, Vec<u64>)> = None;
        for &seg in &a.kinds[kind].vmm_segs {
            if let Some((lo, missing)) = choose_window(a, kind, seg, rounded, g) {
                if choice.as_ref().is_none_or(|c| missing.len() < c.2.len()) {
                    choice = Some((seg, lo, missing));
                }
            }
        }
        let (seg_idx, lo, missing) = match choice {
            Some(c) => c,
            None => {
                let seg = self.reserve_extent(arena, a, kind, extent)?;
                match choose_window(a, kind, seg, rounded, g) {
                    Some((lo, missing)) => (seg, lo, missing),
                    None => {
                        return Err(self.oom_locked(
                            dev,
                            Some(a),
                            arena.stream,
                            size,
                            rounded,
                            false,
                            "no virtual range is large enough",
                        ))
                    }
                }
            }
        };
        let hi = lo + rounded;
        let need = missing.len();

        // Can it succeed at all? Count the cached pages (whole free pages anywhere but in the
        // window, and handles whose release failed earlier) and the room under the limit and
        // on the device before moving anything: gathering pages first would leave a failed
        // request's pages mapped as cache, so a request above the limit would grab the whole
        // limit and change the counters (ACCEPTANCE B8).
        let cached = if need > 0 {
            let mut n = count_free_pages(a, Some((kind, lo, hi)), g) + dev.lost.len();
            for other in self.all_arenas() {
                if !Arc::ptr_eq(&other, arena) {
                    n += count_free_pages(&other.state.lock(), None, g);
                }
            }
            n
        } else {
            0
        };
        let by_limit = (dev
            .limit
            .saturating_sub(dev.reserved[0].current.max(0) as u64)
            / g) as usize;
        let by_device = if need > cached {
            c.driver
                .mem_info(c.dev)
                .map_or(usize::MAX, |i| (i.free / g) as usize)
        } else {
            usize::MAX
        };
        if cached + by_limit.min(by_device) < need {
            // Blame the limit only when a limit below the device's size is what stops the
            // request; when the device could not hold it either, it is out of memory.
            let limit_hit = cached + by_limit < need
                && dev.limit < c.caps.total_memory
                && cached.saturating_add(by_device) >= need;
            return self.give_up(dev, arena, a, size, rounded, limit_hit, retried);
        }

        // Gather physical pages: stitch cached ones first, then create new ones.
        let mut handles: Vec<PhysHandle> = Vec::with_capacity(need);
        let mut moved = 0u64;
        if need > 0 && cached > 0 {
            let stream = arena.stream;
            let got = self.steal_pages(a, stream, Some((kind, lo, hi)), need, dev, kind);
            moved += got.len() as u64;
            handles.extend(got);
            if handles.len() < need {
                for other in self.all_arenas() {
                    if Arc::ptr_eq(&other, arena) {
                        continue;
                    }
                    let mut o = other.state.lock();
                    let got = self.steal_pages(
                        &mut o,
                        other.stream,
                        None,
                        need - handles.len(),
                        dev,
                        kind,
                    );
                    c.counters
                        .num_cross_stream_pages
                        .fetch_add(got.len() as u64, Relaxed);
                    moved += got.len() as u64;
                    handles.extend(got);
                    if handles.len() == need {
                        break;
                    }
                }
            }
            if moved > 0 {
                c.counters.num_stitches.fetch_add(1, Relaxed);
                c.counters.num_stitched_pages.fetch_add(moved, Relaxed);
            }
        }
        // Handles whose release failed earlier are good memory: use them before new ones.
        while handles.len() < need {
            let Some((k, h)) = dev.lost.pop() else { break };
            if k != kind {
                dev.add_reserved(k, -(g as i64));
                dev.add_segments(k, -1);
                dev.add_reserved(kind, g as i64);
                dev.add_segments(kind, 1);
            }
            handles.push(h);
        }
        let mut limit_hit = false;
        let mut driver_err = None;
        let mut created = Vec::new();
        while handles.len() + created.len() < need {
            if dev.reserved[0].current as u64 + g > dev.limit {
                limit_hit = true;
                break;
            }
            match c.driver.create_physical(c.dev, g) {
                Ok(h) => {
                    c.counters.num_device_alloc.fetch_add(1, Relaxed);
                    dev.add_reserved(kind, g as i64);
                    dev.add_segments(kind, 1);
                    created.push(h);
                }
                Err(e) => {
                    if !e.is_oom() {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        driver_err = Some(e);
                    }
                    break;
                }
            }
        }
        if handles.len() + created.len() < need {
            // Short after all (the driver ran out, e.g. another process took memory): give
            // back what this request created, so a failed request leaves reserved memory as
            // it was; stolen pages are kept, mapped in the window, as cache.
            for h in created.drain(..) {
                self.release_handle(dev, kind, h);
            }
        }
        handles.extend(created);

        // Map what we have into the window's holes (even when short: it stays as cache).
        let short = handles.len() < need;
        if let Err(e) = self.map_pages(dev, a, kind, seg_idx, &missing, handles) {
            return Err(e.into());
        }
        if let Some(e) = driver_err {
            return Err(e.into());
        }
        if short {
            return self.give_up(dev, arena, a, size, rounded, limit_hit, retried);
        }
        match a.try_take(kind, rounded, size, &c.shared) {
            Some((p, _)) => {
                self.release_over_threshold(dev, Some((arena, a)));
                Ok(Grow::Done(p))
            }
            None => Err(Error::InvalidArgument(format!(
                "internal error: window {lo:#x}+{rounded} mapped but not allocatable"
            ))),
        }
    }

    /// Reserves one more virtual extent for heap `kind` of `arena`; returns its segment index.
    fn reserve_extent(
        &self,
        arena: &Arc<Arena<D>>,
        a: &mut ArenaState,
        kind: usize,
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

    /// A request that cannot be met now: ask for one retry of the OOM protocol when frees are
    /// waiting on events (their memory may be all that is missing), else fail with a report.
    #[allow(clippy::too_many_arguments)]
    fn give_up(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        a: &ArenaState,
        size: u64,
        rounded: u64,
        limit_hit: bool,
        retried: bool,
    ) -> Result<Grow> {
        if !retried && self.any_pending(arena, a) {
            return Ok(Grow::Retry);
        }
        let why = if limit_hit {
            "the per-process limit would be exceeded"
        } else {
            "the device has too little free memory for it"
        };
        Err(self.oom_locked(dev, Some(a), arena.stream, size, rounded, limit_hit, why))
    }

    /// Whether any arena has frees waiting on events (`a` is `arena`'s locked state).
    fn any_pending(&self, arena: &Arc<Arena<D>>, a: &ArenaState) -> bool {
        !a.pending.is_empty()
            || self
                .all_arenas()
                .iter()
                .any(|o| !Arc::ptr_eq(o, arena) && !o.state.lock().pending.is_empty())
    }

    /// Maps `handles` at the first `handles.len()` pages of `missing` and turns those pages
    /// into free space. On a driver failure the failing handle is released and the pages
    /// mapped so far are kept.
    fn map_pages(
        &self,
        dev: &mut DeviceState,
        a: &mut ArenaState,
        kind: usize,
        seg_idx: u32,
        missing: &[u64],
        handles: Vec<PhysHandle>,
    ) -> crate::driver::DriverResult<()> {
        let c = &*self.core;
        let g = c.granularity;
        let d = &*c.driver;
        let base = a.kinds[kind].segment(seg_idx).base;
        let mut mapped: Vec<u64> = Vec::with_capacity(handles.len());
        let mut result = Ok(());
        let mut rest = handles.into_iter();
        for (&page, h) in missing.iter().zip(rest.by_ref()) {
            let mut stuck = false;
            let r = d.map(c.dev, page, g, h).and_then(|()| {
                d.set_access(c.dev, page, g).inspect_err(|_| {
                    stuck = d.unmap(c.dev, page, g).is_err();
                })
            });
            match r {
                Ok(()) => {
                    if let Some(seg) = a.kinds[kind].segments[seg_idx as usize].as_mut() {
                        if let Backing::Vmm { pages } = &mut seg.backing {
                            pages[((page - base) / g) as usize] = Some(h);
                        }
                    }
                    mapped.push(page);
                }
                Err(e) => {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    if stuck {
                        // Still mapped: releasing it now would fail and lose the mapping.
                        dev.stuck.push((kind, h, page));
                    } else {
                        self.release_handle(dev, kind, h);
                    }
                    result = Err(e);
                    break;
                }
            }
        }
        // Handles we could not map (after a failure) are released, not leaked.
        for h in rest {
            self.release_handle(dev, kind, h);
        }
        // Fill the holes page run by page run.
        let mut i = 0;
        while i < mapped.len() {
            let lo = mapped[i];
            let mut hi = lo + g;
            i += 1;
            while i < mapped.len() && mapped[i] == hi {
                hi += g;
                i += 1;
            }
            let first = a.kinds[kind].segment(seg_idx).first;
            let hole = a.kinds[kind]
                .heap
                .segment_spans(first)
                .find(|(_, s)| s.state == SpanState::Hole && s.start <= lo && hi <= s.end())
                .map(|(id, _)| id);
            if let Some(id) = hole {
                a.fill(kind, id, lo, hi, &c.shared);
            }
        }
        result
    }

    fn release_handle(&self, dev: &mut DeviceState, kind: usize, h: PhysHandle) {
        let c = &*self.core;
        match c.driver.release_physical(c.dev, h) {
            Ok(()) => {
                c.counters.num_device_free.fetch_add(1, Relaxed);
                dev.add_reserved(kind, -(c.granularity as i64));
                dev.add_segments(kind, -1);
            }
            Err(_) => {
                // The handle is lost to us; it stays counted as reserved so the numbers keep
                // matching the driver's (and the invariant checker knows why).
                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                dev.lost.push((kind, h));
            }
        }
    }

    /// Takes up to `want` whole free pages out of arena `a` (whose stream is `stream`),
    /// skipping `exclude` (kind, lo, hi). Waits for the stream's work first. The pages'
    /// handles are unmapped and returned; their address ranges become holes. `to_kind` is the
    /// heap the pages are for (for per-pool reserved accounting).
    fn steal_pages(
        &self,
        a: &mut ArenaState,
        stream: StreamId,
        exclude: Option<(usize, u64, u64)>,
        want: usize,
        dev: &mut DeviceState,
        to_kind: usize,
    ) -> Vec<PhysHandle> {
        let c = &*self.core;
        let g = c.granularity;
        let mut out = Vec::new();
        let mut synced = false;
        for kind in 0..2 {
            let runs = free_page_runs(a, kind, exclude, g, want - out.len());
            for (seg_idx, id, lo, hi) in runs {
                if out.len() >= want {
                    break;
                }
                let n = (((hi - lo) / g) as usize).min(want - out.len());
                let hi = lo + n as u64 * g;
                if !synced {
                    if !c.sync_stream(stream) {
                        return out;
                    }
                    synced = true;
                }
                a.carve(kind, id, lo, hi, &c.shared);
                let base = a.kinds[kind].segment(seg_idx).base;
                let mut page = lo;
                while page < hi {
                    let idx = ((page - base) / g) as usize;
                    let handle = match a.kinds[kind].segments[seg_idx as usize].as_mut() {
                        Some(crate::arena::Segment {
                            backing: Backing::Vmm { pages },
                            ..
                        }) => pages[idx],
                        _ => None,
                    };
                    let Some(h) = handle else { break };
                    if c.driver.unmap(c.dev, page, g).is_err() {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        // Put the rest of the carved range back as free space.
                        self.refill(a, kind, seg_idx, page, hi);
                        break;
                    }
                    if let Some(crate::arena::Segment {
                        backing: Backing::Vmm { pages },
                        ..
                    }) = a.kinds[kind].segments[seg_idx as usize].as_mut()
                    {
                        pages[idx] = None;
                    }
                    if kind != to_kind {
                        dev.add_reserved(kind, -(g as i64));
                        dev.add_segments(kind, -1);
                        dev.add_reserved(to_kind, g as i64);
                        dev.add_segments(to_kind, 1);
                    }
                    out.push(h);
                    page += g;
                }
            }
            if out.len() >= want {
                break;
            }
        }
        out
    }

    /// Turns the (still mapped) range `[lo, hi)`, which was carved into a hole, back into free
    /// space.
    fn refill(&self, a: &mut ArenaState, kind: usize, seg_idx: u32, lo: u64, hi: u64) {
        let first = a.kinds[kind].segment(seg_idx).first;
        let hole = a.kinds[kind]
            .heap
            .segment_spans(first)
            .find(|(_, s)| s.state == SpanState::Hole && s.start <= lo && hi <= s.end())
            .map(|(id, _)| id);
        if let Some(id) = hole {
            a.fill(kind, id, lo, hi, &self.core.shared);
        }
    }

    fn grow_linear(
        &self,
        dev: &mut DeviceState,
        arena: &Arc<Arena<D>>,
        kind: usize,
        rounded: u64,
        size: u64,
        retried: bool,
    ) -> Result<Grow> {
        let c = &*self.core;
        const MIB: u64 = 1 << 20;
        if rounded > c.caps.total_memory {
            // Also keeps the segment arithmetic below far from overflow.
            return Err(self.oom_locked(
                dev,
                None,
                arena.stream,
                size,
                rounded,
                false,
                "the request is larger than the device",
            ));
        }
        let seg_size = if kind == SMALL {
            rounded.div_ceil(2 * MIB) * 2 * MIB
        } else if rounded < 10 * MIB {
            20 * MIB
        } else {
            rounded.div_ceil(2 * MIB) * 2 * MIB
        };
        let mut limit_hit = dev.reserved[0].current as u64 + seg_size > dev.limit;
        if limit_hit {
            self.release_cached(dev);
            limit_hit = dev.reserved[0].current as u64 + seg_size > dev.limit;
        }
        let mut result = None;
        if !limit_hit {
            result = match c.driver.mem_alloc(c.dev, seg_size) {
                Ok(p) => Some(p),
                Err(e) if e.is_oom() => {
                    // Give every wholly free segment back, then try once more.
                    self.release_cached(dev);
                    match c.driver.mem_alloc(c.dev, seg_size) {
                        Ok(p) => Some(p),
                        Err(e) if e.is_oom() => None,
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => {
                    c.counters.num_driver_errors.fetch_add(1, Relaxed);
                    return Err(e.into());
                }
            };
        }
        let mut a = arena.state.lock();
        let Some(base) = result else {
            return self.give_up(dev, arena, &a, size, rounded, limit_hit, retried);
        };
        c.counters.num_device_alloc.fetch_add(1, Relaxed);
        dev.add_reserved(kind, seg_size as i64);
        dev.add_segments(kind, 1);
        let before = a.free_totals(kind);
        a.kinds[kind].add_segment(base, seg_size, Backing::Linear);
        a.note_free_change(kind, before, &c.shared);
        self.ranges
            .write()
            .insert(base, (base + seg_size, Arc::downgrade(arena)));
        match a.try_take(kind, rounded, size, &c.shared) {
            Some((ptr, _)) => {
                let mut a = a;
                self.release_over_threshold(dev, Some((arena, &mut a)));
                Ok(Grow::Done(ptr))
            }
            None => Err(Error::InvalidArgument(
                "internal error: fresh segment not allocatable".into(),
            )),
        }
    }

    /// Releases all cached memory (whole free pages, wholly free linear segments) of every
    /// arena. Returns the bytes released.
    fn release_cached(&self, dev: &mut DeviceState) -> u64 {
        let mut released = 0;
        for arena in self.all_arenas() {
            let mut st = arena.state.lock();
            released += self.release_arena(dev, arena.stream, &mut st, u64::MAX);
        }
        released
    }

    /// Releases up to `budget` bytes of cached memory from one arena.
    fn release_arena(
        &self,
        dev: &mut DeviceState,
        stream: StreamId,
        a: &mut ArenaState,
        budget: u64,
    ) -> u64 {
        let c = &*self.core;
        let g = c.granularity;
        let mut released = 0u64;
        if c.vmm {
            for kind in [LARGE, SMALL] {
                if released >= budget {
                    break;
                }
                let want = ((budget - released) / g).min(usize::MAX as u64) as usize;
                if want == 0 {
                    break;
                }
                let handles = self.steal_pages(a, stream, None, want, dev, kind);
                for h in handles {
                    self.release_handle(dev, kind, h);
                    c.counters.num_released_pages.fetch_add(1, Relaxed);
                    released += g;
                }
            }
        } else {
            let mut synced = false;
            for kind in [LARGE, SMALL] {
                let free_segs: Vec<(u32, u64, u64)> = a.kinds[kind]
                    .segments
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| {
                        let s = s.as_ref()?;
                        let first = a.kinds[kind].heap.span(s.first);
                        (first.state == SpanState::Free && first.len == s.len)
                            .then_some((i as u32, s.base, s.len))
                    })
                    .collect();
                for (idx, base, len) in free_segs {
                    if released >= budget {
                        break;
                    }
                    if !synced {
                        // cuMemFree synchronises on its own; no event needed.
                        synced = true;
                    }
                    if c.driver.mem_free(c.dev, base).is_err() {
                        c.counters.num_driver_errors.fetch_add(1, Relaxed);
                        continue;
                    }
                    c.counters.num_device_free.fetch_add(1, Relaxed);
                    let before = a.free_totals(kind);
                    let Some(seg) = a.kinds[kind].segments[idx as usize].take() else {
                        continue;
                    };
                    a.kinds[kind].heap.remove_segment(seg.first);
                    a.note_free_change(kind, before, &c.shared);
                    self.ranges.write().remove(&base);
                    dev.add_reserved(kind, -(len as i64));
                    dev.add_segments(kind, -1);
                    released += len;
                }
            }
        }
        released
    }

    /// Applies `release_threshold` after growth.
    fn release_over_threshold(
        &self,
        dev: &mut DeviceState,
        held: Option<(&Arc<Arena<D>>, &mut ArenaState)>,
    ) {
        let Some(threshold) = self.core.config.release_threshold else {
            return;
        };
        let reserved = dev.reserved[0].current as u64;
        let live = self.bytes_with(
            held.as_ref().map(|(a, s)| (*a, &**s)),
            crate::stats::Gauge::ActiveBytes,
        );
        let cached = reserved.saturating_sub(live);
        if cached <= threshold {
            return;
        }
        let mut budget = cached - threshold;
        let mut held = held;
        for arena in self.all_arenas() {
            if budget == 0 {
                break;
            }
            let got = match held {
                Some((h, ref mut hs)) if Arc::ptr_eq(h, &arena) => {
                    self.release_arena(dev, arena.stream, hs, budget)
                }
                _ => {
                    let mut st = arena.state.lock();
                    self.release_arena(dev, arena.stream, &mut st, budget)
                }
            };
            budget = budget.saturating_sub(got);
        }
    }

    /// The device-wide current value of a byte gauge; `held` is an arena whose lock the caller
    /// holds.
    fn bytes_with(
        &self,
        held: Option<(&Arc<Arena<D>>, &ArenaState)>,
        gauge: crate::stats::Gauge,
    ) -> u64 {
        let mut live = 0i64;
        for arena in self.all_arenas() {
            match held {
                Some((h, hs)) if Arc::ptr_eq(h, &arena) => live += hs.gauges.cur[gauge as usize][0],
                _ => live += arena.state.lock().gauges.cur[gauge as usize][0],
            }
        }
        live.max(0) as u64
    }

    /// Returns every cached page (and wholly free segment) to the driver. Live blocks and the
    /// virtual reservations stay.
    pub fn empty_cache(&self) {
        let c = &*self.core;
        let mut dev = self.state.lock();
        for arena in self.all_arenas() {
            let mut a = arena.state.lock();
            a.retry_device_sync(c.dev, &*c.driver);
            a.process_pending(false, c.dev, &*c.driver, &c.events, &c.shared);
        }
        self.release_cached(&mut dev);
        for (kind, h) in std::mem::take(&mut dev.lost) {
            self.release_handle(&mut dev, kind, h);
        }
        for (kind, h, addr) in std::mem::take(&mut dev.stuck) {
            if c.driver.unmap(c.dev, addr, c.granularity).is_ok() {
                self.release_handle(&mut dev, kind, h);
            } else {
                dev.stuck.push((kind, h, addr));
            }
        }
        if let Some(rec) = &c.recorder {
            rec.reserved(dev.reserved[0].current.max(0) as u64);
        }
    }

    /// Releases cached memory above `release_threshold` (nothing when no threshold is set;
    /// `empty_cache` releases all of it).
    pub fn trim(&self) {
        let mut dev = self.state.lock();
        self.release_over_threshold(&mut dev, None);
    }

    /// Sets the per-process limit as a fraction of device memory (`[0, 1]`).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) || fraction.is_nan() {
            return Err(Error::InvalidArgument(format!(
                "memory fraction {fraction} is outside [0, 1]"
            )));
        }
        let mut cfg = self.core.config.clone();
        cfg.memory_fraction = fraction;
        let mut dev = self.state.lock();
        dev.limit = cfg.limit_for(self.core.caps.total_memory);
        dev.fraction = fraction;
        // A limit lowered below what is reserved: give cached memory back down to the limit.
        // What live blocks keep above it stays (it can only shrink from here: growth stops at
        // the limit), and the invariant checker allows exactly that much.
        let mut over = (dev.reserved[0].current.max(0) as u64).saturating_sub(dev.limit);
        if over > 0 {
            for arena in self.all_arenas() {
                if over == 0 {
                    break;
                }
                let mut st = arena.state.lock();
                over =
                    over.saturating_sub(self.release_arena(&mut dev, arena.stream, &mut st, over));
            }
        }
        dev.over_limit = dev.reserved[0].current.max(0) as u64;
        Ok(())
    }

    /// The fraction last set (or configured).
    pub fn memory_fraction(&self) -> f64 {
        self.state.lock().fraction
    }

    fn oom(&self, stream: StreamId, size: u64, rounded: u64, limit: bool, why: &str) -> Error {
        let mut dev = self.state.lock();
        self.oom_locked(&mut dev, None, stream, size, rounded, limit, why)
    }

    #[allow(clippy::too_many_arguments)]
    fn oom_locked(
        &self,
        dev: &mut DeviceState,
        held: Option<&ArenaState>,
        stream: StreamId,
        size: u64,
        rounded: u64,
        limit: bool,
        why: &str,
    ) -> Error {
        let c = &*self.core;
        c.counters.num_ooms.fetch_add(1, Relaxed);
        if limit {
            c.counters.num_limit_ooms.fetch_add(1, Relaxed);
        }
        let info = c.driver.mem_info(c.dev).ok();
        let (mut live, mut active, mut largest) = (0i64, 0i64, 0u64);
        let mut by_tag: FxHashMap<u32, (i64, i64)> = FxHashMap::default();
        let mut by_site: FxHashMap<u32, (i64, i64)> = FxHashMap::default();
        let held_ptr = held.map(|h| h as *const ArenaState);
        let mut add = |s: &ArenaState| {
            live += s.gauges.cur[crate::stats::Gauge::AllocatedBytes as usize][0];
            active += s.gauges.cur[crate::stats::Gauge::ActiveBytes as usize][0];
            largest = largest.max(s.largest_free());
            for slot in &s.ledger.slots {
                let t = by_tag.entry(slot.tag).or_default();
                t.0 += slot.live_bytes;
                t.1 += slot.live_blocks;
                if slot.site != 0 {
                    let t = by_site.entry(slot.site).or_default();
                    t.0 += slot.live_bytes;
                    t.1 += slot.live_blocks;
                }
            }
        };
        if let Some(h) = held {
            add(h);
        }
        for arena in self.all_arenas() {
            // The arena whose state the caller holds was counted above; every other one is
            // locked (the device lock is held, so holding two arena locks is allowed).
            if held_ptr.is_some_and(|p| std::ptr::eq(arena.state.data_ptr(), p)) {
                continue;
            }
            add(&arena.state.lock());
        }
        let reserved = dev.reserved[0].current.max(0) as u64;
        let report = OomReport {
            device: c.dev,
            stream: stream.0,
            requested: size,
            rounded,
            limit: dev.limit,
            device_free: info.map_or(0, |i| i.free),
            device_total: info.map_or(c.caps.total_memory, |i| i.total),
            reserved,
            live: live.max(0) as u64,
            pending: (active - live).max(0) as u64,
            cached: reserved.saturating_sub(active.max(0) as u64),
            largest_free: largest,
            top_tags: top_attributions(by_tag, |t| {
                crate::provenance::tag_name(t).unwrap_or_else(|| "(no tag)".into())
            }),
            top_sites: top_attributions(by_site, crate::provenance::site_label),
            other_processes: Vec::new(),
            reason: why.to_string(),
        };
        dev.last_oom = Some(Box::new(report.clone()));
        if limit {
            Error::LimitExceeded(Box::new(report))
        } else {
            Error::OutOfMemory(Box::new(report))
        }
    }

    /// The report of this device's last failed request (out of memory or over the limit), if
    /// any request failed yet.
    pub fn last_oom(&self) -> Option<OomReport> {
        self.state.lock().last_oom.as_deref().cloned()
    }

    /// The device's statistics, with PyTorch's key names.
    pub fn stats(&self) -> Stats {
        let c = &*self.core;
        let dev = self.state.lock();
        let mut cur = [[0i64; 3]; GAUGES];
        let mut inc = [[0i64; 3]; GAUGES];
        let mut dec = [[0i64; 3]; GAUGES];
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            for g in 0..GAUGES {
                for p in 0..3 {
                    cur[g][p] += a.gauges.cur[g][p];
                    inc[g][p] += a.gauges.increases(g, p);
                    dec[g][p] += a.gauges.decreases(g, p);
                }
            }
        }
        let mut s = Stats::default();
        for g in 0..GAUGES {
            for p in 0..3 {
                c.shared.raise_peak(g, p, cur[g][p]);
                s.set_gauge(
                    GAUGE_NAMES[g],
                    POOL_NAMES[p],
                    ExactGauge {
                        current: cur[g][p],
                        peak: c.shared.peak(g, p),
                        allocated: inc[g][p],
                        freed: dec[g][p],
                    },
                );
            }
        }
        for p in 0..3 {
            s.set_gauge("reserved_bytes", POOL_NAMES[p], dev.reserved[p]);
            s.set_gauge("segment", POOL_NAMES[p], dev.segments[p]);
            // cistern never makes oversize allocations/segments (no max_split_size); kept for
            // key compatibility with PyTorch.
            s.set_gauge("oversize_allocations", POOL_NAMES[p], ExactGauge::default());
            s.set_gauge("oversize_segments", POOL_NAMES[p], ExactGauge::default());
        }
        let k = &c.counters;
        for (name, v) in [
            ("num_alloc_retries", &k.num_alloc_retries),
            ("num_ooms", &k.num_ooms),
            ("num_limit_ooms", &k.num_limit_ooms),
            ("num_invalid_frees", &k.num_invalid_frees),
            ("num_stitches", &k.num_stitches),
            ("num_stitched_pages", &k.num_stitched_pages),
            ("num_cross_stream_pages", &k.num_cross_stream_pages),
            ("num_device_alloc", &k.num_device_alloc),
            ("num_device_free", &k.num_device_free),
            ("num_sync_all_streams", &k.num_sync_all_streams),
            ("num_stream_syncs", &k.num_stream_syncs),
            ("num_pending_frees", &k.num_pending_frees),
            ("num_released_pages", &k.num_released_pages),
            ("num_driver_errors", &k.num_driver_errors),
            ("num_record_streams", &k.num_record_streams),
        ] {
            s.set(name, v.load(Relaxed) as i64);
        }
        s.set("max_split_size", -1);
        s.set("memory_limit", dev.limit.min(i64::MAX as u64) as i64);
        s.set("num_streams", self.arenas.read().len() as i64);
        s
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let c = &*self.core;
        let mut dev = self.state.lock();
        let arenas = self.all_arenas();
        let mut guards: Vec<_> = arenas.iter().map(|a| a.state.lock()).collect();
        let mut cur = [[0i64; 3]; GAUGES];
        for gd in guards.iter_mut() {
            gd.gauges.publish_all(&c.shared);
            for (g, row) in cur.iter_mut().enumerate() {
                for (p, v) in row.iter_mut().enumerate() {
                    *v += gd.gauges.cur[g][p];
                }
            }
        }
        c.shared.reset_peaks(&cur);
        for p in 0..3 {
            dev.reserved[p].peak = dev.reserved[p].current;
            dev.segments[p].peak = dev.segments[p].current;
        }
    }

    /// Checks the whole pool's consistency (see [`crate::arena`]); tests run it after every
    /// operation. Returns a description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let c = &*self.core;
        let dev = self.state.lock();
        let mut mapped = 0u64;
        let mut linear = [0u64; 2];
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            mapped += a
                .check(c.granularity)
                .map_err(|e| format!("arena of stream {}: {e}", arena.stream))?;
            for (k, kh) in a.kinds.iter().enumerate() {
                for seg in kh.segments.iter().flatten() {
                    if matches!(seg.backing, Backing::Linear) {
                        linear[k] += seg.len;
                    }
                    let ranges = self.ranges.read();
                    match ranges.get(&seg.base) {
                        Some((end, w))
                            if *end == seg.base + seg.len && w.as_ptr() == Arc::as_ptr(&arena) => {}
                        _ => {
                            return Err(format!(
                                "segment {:#x} missing from the range index",
                                seg.base
                            ))
                        }
                    }
                }
            }
        }
        let reserved = dev.reserved[0].current as u64;
        let lost = (dev.lost.len() + dev.stuck.len()) as u64 * c.granularity;
        let expect = mapped * c.granularity + linear[0] + linear[1] + lost;
        if reserved != expect {
            return Err(format!(
                "reserved_bytes is {reserved}, but {mapped} pages are mapped, {} B of \
                 segments allocated and {} B of handles lost ({expect} B)",
                linear[0] + linear[1],
                lost
            ));
        }
        if dev.reserved[0].current != dev.reserved[1].current + dev.reserved[2].current {
            return Err("reserved all != small + large".into());
        }
        if reserved > dev.limit.max(dev.over_limit) {
            return Err(format!(
                "reserved {reserved} exceeds the limit {}",
                dev.limit
            ));
        }
        Ok(())
    }

    /// Live blocks as `(ptr, rounded size, requested size, stream)`, for reports and tests.
    pub fn live_blocks(&self) -> Vec<(u64, u64, u64, StreamId)> {
        let mut out = Vec::new();
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            for (&ptr, r) in &a.live {
                let s = a.kinds[r.kind as usize].heap.span(r.span);
                out.push((ptr, s.len, s.requested, arena.stream));
            }
        }
        out.sort_unstable();
        out
    }

    /// Live bytes, blocks, peaks and total allocations per (tag, site) on this device, largest
    /// live bytes first (empty with `provenance:off`). Sums the arenas' ledgers under the
    /// device lock (it holds every arena's lock at once, which only the device lock's holder
    /// may do: growth locks other arenas while holding its own).
    pub fn ledger(&self) -> Vec<LedgerEntry> {
        let _dev = self.state.lock();
        let arenas = self.all_arenas();
        let guards: Vec<_> = arenas.iter().map(|a| a.state.lock()).collect();
        crate::provenance::merge_ledgers(guards.iter().map(|g| &g.ledger))
    }

    /// A point in this device's allocation history, for [`DevicePool::live_since`]. Exact per
    /// stream (it reads each arena's sequence number); needs provenance on.
    pub fn mark(&self) -> Mark {
        let seqs = self
            .all_arenas()
            .iter()
            .map(|a| (a.stream, a.state.lock().seq))
            .collect();
        Mark {
            pool: self.core.uid,
            seqs,
            time_ns: crate::provenance::now_ns(),
        }
    }

    /// The blocks allocated after `mark` and still live (sorted by address): with a mark taken
    /// every step of a training loop, what each step leaked. Empty with `provenance:off`, or
    /// for a mark of another pool.
    pub fn live_since(&self, mark: &Mark) -> Vec<LiveBlock> {
        if mark.pool != self.core.uid {
            return Vec::new();
        }
        self.live_detailed(|stream| Some(mark.seq_of(stream)))
    }

    /// Every live block with its provenance, sorted by address.
    pub fn live_blocks_detailed(&self) -> Vec<LiveBlock> {
        self.live_detailed(|_| None)
    }

    /// Live blocks whose sequence number is above `after(stream)` (all for `None`).
    fn live_detailed(&self, after: impl Fn(StreamId) -> Option<u64>) -> Vec<LiveBlock> {
        let now = crate::provenance::now_ns();
        let mut out = Vec::new();
        for arena in self.all_arenas() {
            let seq = after(arena.stream);
            let a = arena.state.lock();
            for (&ptr, r) in &a.live {
                let h = &a.kinds[r.kind as usize].heap;
                let m = h.meta(r.span);
                if seq.is_some_and(|q| m.seq <= q) {
                    continue;
                }
                let s = h.span(r.span);
                out.push(LiveBlock {
                    ptr,
                    size: s.len,
                    requested: s.requested,
                    stream: arena.stream.0,
                    tag: crate::provenance::tag_name(m.tag),
                    site: (m.site != 0).then_some(m.site),
                    thread: m.thread,
                    time_ns: m.time_ns,
                    age: std::time::Duration::from_nanos(if m.time_ns == 0 {
                        0
                    } else {
                        now.saturating_sub(m.time_ns)
                    }),
                });
            }
        }
        out.sort_unstable_by_key(|b| b.ptr);
        out
    }

    /// Every mapped range of this device's pool with the blocks that tile it, sorted by
    /// address: the data of PyTorch's `torch.cuda.memory._snapshot()["segments"]`.
    ///
    /// A `cuMemAlloc` segment is one entry. A VMM extent is reported as one entry per run of
    /// mapped pages (unmapped address space is left out), as PyTorch reports expandable
    /// segments. The blocks of an entry cover it exactly, in address order. Takes each arena's
    /// lock in turn (never two at once): a read for reports and debugging, not for a hot path.
    pub fn segments_snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut out = Vec::new();
        for arena in self.all_arenas() {
            let a = arena.state.lock();
            for (kind, kh) in a.kinds.iter().enumerate() {
                for seg in kh.segments.iter().flatten() {
                    let expandable = matches!(seg.backing, Backing::Vmm { .. });
                    let mut run: Option<SegmentSnapshot> = None;
                    for (id, s) in kh.heap.segment_spans(seg.first) {
                        let state = match s.state {
                            SpanState::Live => BlockState::Allocated,
                            SpanState::Pending => BlockState::PendingFree,
                            SpanState::Free => BlockState::Free,
                            SpanState::Hole | SpanState::Vacant => {
                                out.extend(run.take());
                                continue;
                            }
                        };
                        let r = run.get_or_insert_with(|| SegmentSnapshot {
                            device: self.core.dev,
                            address: s.start,
                            total_size: 0,
                            stream: arena.stream.0,
                            large: kind == LARGE,
                            expandable,
                            blocks: Vec::new(),
                        });
                        r.total_size += s.len;
                        r.blocks.push(BlockSnapshot {
                            address: s.start,
                            size: s.len,
                            requested_size: if state == BlockState::Free {
                                0
                            } else {
                                s.requested
                            },
                            state,
                            tag: match state {
                                BlockState::Free => None,
                                _ => match kh.heap.meta(id).tag {
                                    0 => None,
                                    t => crate::provenance::tag_name(t),
                                },
                            },
                        });
                    }
                    out.extend(run.take());
                }
            }
        }
        out.sort_unstable_by_key(|s| s.address);
        out
    }

    /// A summary of this device's pool.
    pub fn report(&self) -> DeviceReport {
        let s = self.stats();
        let largest = self
            .all_arenas()
            .iter()
            .map(|a| a.state.lock().largest_free())
            .max()
            .unwrap_or(0);
        DeviceReport {
            device: self.core.dev,
            name: self.core.caps.name.clone(),
            driver: self.core.driver.name(),
            vmm: self.core.vmm,
            granularity: self.core.granularity,
            total_memory: self.core.caps.total_memory,
            limit: self.limit(),
            reserved: s.get("reserved_bytes.all.current") as u64,
            peak_reserved: s.get("reserved_bytes.all.peak") as u64,
            live: s.get("allocated_bytes.all.current") as u64,
            peak_live: s.get("allocated_bytes.all.peak") as u64,
            requested: s.get("requested_bytes.all.current") as u64,
            pending: (s.get("active_bytes.all.current") - s.get("allocated_bytes.all.current"))
                .max(0) as u64,
            live_blocks: s.get("allocation.all.current") as u64,
            streams: s.get("num_streams") as u64,
            largest_free: largest,
            stitched_pages: s.get("num_stitched_pages") as u64,
            ooms: s.get("num_ooms") as u64,
            invalid_frees: s.get("num_invalid_frees") as u64,
        }
    }
}

impl<D: Driver> Drop for DevicePool<D> {
    fn drop(&mut self) {
        let c = &*self.core;
        if let Some(r) = &c.recorder {
            r.flush();
        }
        let (lost, stuck) = {
            let mut dev = self.state.lock();
            (
                std::mem::take(&mut dev.lost),
                std::mem::take(&mut dev.stuck),
            )
        };
        for (_, h) in lost {
            let _ = c.driver.release_physical(c.dev, h);
        }
        // Before the arenas free their address ranges, which must hold no mapping.
        for (_, h, addr) in stuck {
            let _ = c.driver.unmap(c.dev, addr, c.granularity);
            let _ = c.driver.release_physical(c.dev, h);
        }
        // Only now may a buffer freed on another thread tear its arena down (and free its
        // address range): the stuck pages inside it are gone.
        c.closed.store(true, Relaxed);
        for arena in self.all_arenas() {
            arena.teardown();
        }
        self.arenas.write().clear();
        for ev in c.events.drain() {
            let _ = c.driver.event_destroy(c.dev, ev);
        }
    }
}

/// Chooses where in segment `seg_idx` of heap `kind` a block of `size` bytes should go: the
/// run of free space and holes that needs the fewest newly mapped pages (ties: the smallest
/// run). Returns the window's start and its unmapped pages.
/// How many tags and sites an OOM report lists.
const TOP_N: usize = 8;

/// The largest `TOP_N` of `m` (id -> (live bytes, live blocks)), named by `name`.
fn top_attributions(
    m: FxHashMap<u32, (i64, i64)>,
    name: impl Fn(u32) -> String,
) -> Vec<crate::error::Attribution> {
    let mut v: Vec<_> = m
        .into_iter()
        .filter(|(_, (b, n))| *b > 0 || *n > 0)
        .collect();
    v.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
    v.truncate(TOP_N);
    v.into_iter()
        .map(|(id, (b, n))| crate::error::Attribution {
            name: name(id),
            bytes: b.max(0) as u64,
            blocks: n.max(0) as u64,
        })
        .collect()
}

fn choose_window(
    a: &ArenaState,
    kind: usize,
    seg_idx: u32,
    size: u64,
    g: u64,
) -> Option<(u64, Vec<u64>)> {
    let kh = &a.kinds[kind];
    let seg = kh.segment(seg_idx);
    let Backing::Vmm { pages } = &seg.backing else {
        return None;
    };
    let missing_in = |lo: u64| -> Vec<u64> {
        let first = (lo - seg.base) / g;
        let last = (lo + size - seg.base).div_ceil(g);
        (first..last)
            .filter(|&i| pages[i as usize].is_none())
            .map(|i| seg.base + i * g)
            .collect()
    };
    let mut best: Option<(usize, u64, u64)> = None; // (missing, run len, lo)
    let consider = |start: u64, end: u64, best: &mut Option<(usize, u64, u64)>| {
        let len = end - start;
        if len < size {
            return;
        }
        let missing = missing_in(start).len();
        let better = match best {
            None => true,
            Some((m, l, _)) => missing < *m || (missing == *m && len < *l),
        };
        if better {
            *best = Some((missing, len, start));
        }
    };
    // Free spans coalesce, and none alone is large enough (the fast path looked), so a window
    // that fits always contains a hole: build the run of free space and holes around each hole.
    let heap = &kh.heap;
    let open = |st: SpanState| matches!(st, SpanState::Free | SpanState::Hole);
    let mut covered_until = 0u64;
    for hole in heap.holes() {
        let h = heap.span(hole);
        if h.seg != seg_idx || h.start < covered_until {
            continue;
        }
        let (mut start, mut end) = (h.start, h.end());
        let mut p = h.prev;
        while p != crate::heap::NIL && open(heap.span(p).state) {
            start = heap.span(p).start;
            p = heap.span(p).prev;
        }
        let mut n = h.next;
        while n != crate::heap::NIL && open(heap.span(n).state) {
            end = heap.span(n).end();
            n = heap.span(n).next;
        }
        covered_until = end;
        consider(start, end, &mut best);
    }
    best.map(|(_, _, lo)| (lo, missing_in(lo)))
}

/// Runs of whole free pages in heap `kind`'s VMM segment, as `(span, lo, hi)`, leaving out the
/// pages that overlap `exclude` (`(kind, lo, hi)`), until `want` pages are found.
fn free_page_runs(
    a: &ArenaState,
    kind: usize,
    exclude: Option<(usize, u64, u64)>,
    g: u64,
    want: usize,
) -> Vec<(u32, crate::heap::SpanId, u64, u64)> {
    let mut runs = Vec::new();
    let kh = &a.kinds[kind];
    if kh.vmm_segs.is_empty() {
        return runs;
    }
    let mut avail = 0usize;
    // Only free spans of at least a page can hold a whole page.
    for id in kh.heap.free_spans_at_least(g) {
        let s = kh.heap.span(id);
        if avail >= want {
            break;
        }
        if !matches!(kh.segment(s.seg).backing, Backing::Vmm { .. }) {
            continue;
        }
        let mut lo = s.start.div_ceil(g) * g;
        let mut hi = s.end() / g * g;
        if let Some((k, xlo, xhi)) = exclude {
            if k == kind && lo < xhi && xlo < hi {
                // Keep the pages that overlap the window; take the larger side outside it.
                let xlo_p = xlo / g * g;
                let xhi_p = xhi.div_ceil(g) * g;
                if xlo_p.saturating_sub(lo) >= hi.saturating_sub(xhi_p) {
                    hi = hi.min(xlo_p);
                } else {
                    lo = lo.max(xhi_p);
                }
            }
        }
        if hi > lo {
            avail += ((hi - lo) / g) as usize;
            runs.push((s.seg, id, lo, hi));
        }
    }
    runs
}

/// Whole free pages an arena could give up (both heaps), leaving out `exclude`.
fn count_free_pages(a: &ArenaState, exclude: Option<(usize, u64, u64)>, g: u64) -> usize {
    (0..2)
        .flat_map(|k| free_page_runs(a, k, exclude, g, usize::MAX))
        .map(|(_, _, lo, hi)| ((hi - lo) / g) as usize)
        .sum()
}

/// The virtual extent reserved for one heap of one stream.
///
/// # Note [Virtual extents]
///
/// Address space is cheap but not free (a reservation costs page-table setup, and 47 bits go
/// only so far when many streams allocate), so each stream's large heap reserves twice the
/// device's memory, which leaves room to place any request that fits in physical memory next to
/// live blocks scattered through the range; the small heap (blocks of at most 64 MiB) reserves
/// the device's memory.
fn vmm_extent(total: u64, g: u64, kind: usize) -> u64 {
    let t = total.div_ceil(g) * g;
    if kind == LARGE {
        t.saturating_mul(2)
    } else {
        t
    }
}

/// A summary of one device's pool: plain data with `Display` and serde.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceReport {
    /// Device ordinal.
    pub device: DeviceId,
    /// Device name.
    pub name: String,
    /// Driver backend name.
    pub driver: &'static str,
    /// Whether the pool maps pages itself.
    pub vmm: bool,
    /// Page size.
    pub granularity: u64,
    /// Device memory.
    pub total_memory: u64,
    /// Per-process limit.
    pub limit: u64,
    /// Bytes held from the driver.
    pub reserved: u64,
    /// Highest reserved bytes.
    pub peak_reserved: u64,
    /// Bytes in live blocks (rounded).
    pub live: u64,
    /// Highest live bytes.
    pub peak_live: u64,
    /// Bytes requested by users for live blocks.
    pub requested: u64,
    /// Bytes freed but waiting on other streams.
    pub pending: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Streams that allocated.
    pub streams: u64,
    /// Largest free range.
    pub largest_free: u64,
    /// Pages moved by stitching.
    pub stitched_pages: u64,
    /// Failed requests.
    pub ooms: u64,
    /// Frees of unknown pointers.
    pub invalid_frees: u64,
}

impl std::fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::format_bytes as b;
        writeln!(
            f,
            "device {} ({}, driver {}, {}, page {})",
            self.device,
            self.name,
            self.driver,
            if self.vmm {
                "VMM"
            } else {
                "cuMemAlloc segments"
            },
            b(self.granularity)
        )?;
        writeln!(
            f,
            "  reserved {} (peak {}) of {} (limit {})",
            b(self.reserved),
            b(self.peak_reserved),
            b(self.total_memory),
            b(self.limit)
        )?;
        writeln!(
            f,
            "  live     {} in {} blocks (peak {}; requested {}), pending {}",
            b(self.live),
            self.live_blocks,
            b(self.peak_live),
            b(self.requested),
            b(self.pending)
        )?;
        write!(
            f,
            "  {} stream(s), largest free range {}, {} pages stitched, {} OOMs, {} invalid frees",
            self.streams,
            b(self.largest_free),
            self.stitched_pages,
            self.ooms,
            self.invalid_frees
        )
    }
}

/// One mapped range of a device pool, as [`DevicePool::segments_snapshot`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SegmentSnapshot {
    /// Device ordinal.
    pub device: DeviceId,
    /// First address.
    pub address: u64,
    /// Length in bytes (the sum of the blocks' sizes).
    pub total_size: u64,
    /// The raw handle of the stream whose arena owns the range.
    pub stream: u64,
    /// Whether it belongs to the large heap (else the small one).
    pub large: bool,
    /// Whether it is a run of mapped pages of a VMM extent (else one `cuMemAlloc` segment).
    pub expandable: bool,
    /// The blocks that tile the range, in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// One block of a [`SegmentSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockSnapshot {
    /// First address.
    pub address: u64,
    /// Length in bytes (rounded).
    pub size: u64,
    /// The size the user asked for (0 for a free block).
    pub requested_size: u64,
    /// What the block is.
    pub state: BlockState,
    /// The tag the block was allocated under, for live and pending blocks that have one.
    pub tag: Option<String>,
}

/// The state of a block in a snapshot, named as in PyTorch's snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum BlockState {
    /// Handed to a user (`active_allocated`).
    #[serde(rename = "active_allocated")]
    Allocated,
    /// Freed, but waiting for other streams' work (`active_pending_free`).
    #[serde(rename = "active_pending_free")]
    PendingFree,
    /// Free and reusable (`inactive`).
    #[serde(rename = "inactive")]
    Free,
}

impl BlockState {
    /// PyTorch's name for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::Allocated => "active_allocated",
            BlockState::PendingFree => "active_pending_free",
            BlockState::Free => "inactive",
        }
    }
}

/// A pooled device buffer: returns itself to its pool when dropped.
///
/// The memory is valid for work on the buffer's stream; to use it on another stream as well,
/// call [`Buffer::record_stream`] so that the pool waits for that stream before reusing it.
pub struct Buffer<D: Driver> {
    ptr: u64,
    len: u64,
    stream: StreamId,
    device: DeviceId,
    arena: Option<Arc<Arena<D>>>,
}

impl<D: Driver> Buffer<D> {
    /// The device address (0 for an empty buffer).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// The size that was asked for.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the buffer has size 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
    /// The device it lives on.
    pub fn device(&self) -> DeviceId {
        self.device
    }
    /// Declares that `stream` also uses this buffer (see [`DevicePool::record_stream`]).
    pub fn record_stream(&self, stream: StreamId) {
        if let Some(a) = &self.arena {
            if stream != a.stream {
                let mut st = a.state.lock();
                let uses = st.uses.entry(self.ptr).or_default();
                if !uses.contains(&stream) {
                    uses.push(stream);
                }
                a.core.counters.num_record_streams.fetch_add(1, Relaxed);
            }
        }
    }
}

impl<D: Driver> std::fmt::Debug for Buffer<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream)
            .field("device", &self.device)
            .finish()
    }
}

impl<D: Driver> Drop for Buffer<D> {
    fn drop(&mut self) {
        if let Some(a) = self.arena.take() {
            // A buffer's pointer is live by construction; an error here would be a pool bug,
            // already counted and logged by free_ptr.
            let _ = a.free_ptr(self.ptr);
        }
    }
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
    create: Mutex<()>,
}

impl<D: Driver> Pool<D> {
    /// A pool over `driver` with `config`. Fails when the configuration is invalid or the
    /// driver cannot count its devices.
    pub fn new(driver: D, config: Config) -> Result<Self> {
        config.validate()?;
        let driver = Arc::new(driver);
        let n = driver.device_count()?;
        Ok(Pool {
            driver,
            config,
            devices: (0..n).map(|_| OnceLock::new()).collect(),
            create: Mutex::new(()),
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
        let slot = self.devices.get(dev).ok_or(Error::InvalidDevice {
            device: dev,
            count: self.devices.len(),
        })?;
        if let Some(p) = slot.get() {
            return Ok(p);
        }
        let _g = self.create.lock();
        if let Some(p) = slot.get() {
            return Ok(p);
        }
        let p = Arc::new(DevicePool::new(
            self.driver.clone(),
            dev,
            self.config.clone(),
        )?);
        Ok(slot.get_or_init(|| p))
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
        for d in self.devices() {
            if d.owns(ptr) {
                return d.record_stream(ptr, stream);
            }
        }
        Err(Error::InvalidArgument(format!(
            "record_stream: {ptr:#x} is not memory of this pool"
        )))
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

    /// Publishes this pool in the cross-process registry ([`crate::registry`]), when the
    /// configuration's `registry` setting is on (the default): opens the directory
    /// ([`crate::registry::dir_for`]: `registry_dir`, else the per-user default), writes a first
    /// record, starts the background thread that republishes it at most once a second when it
    /// changed, and installs the `atexit` hook that writes the final record (state `exited`,
    /// with the blocks still live) when the process exits normally
    /// ([`crate::registry::install_exit_hook`]).
    ///
    /// Returns `Ok(None)` with `registry:off`, and the error when the directory is unsafe or
    /// cannot be written: the pool works the same either way, and the caller decides whether
    /// to log it. Nothing is added to the allocation path. The registry's thread and the exit
    /// hook hold a clone of the `Arc`, so the pool lives until the process exits. Call it once
    /// per process: every call publishes this process's one record.
    pub fn start_registry(
        self: &Arc<Self>,
    ) -> std::result::Result<Option<crate::registry::RegistryHandle>, crate::registry::RegistryError>
    {
        let Some(dir) = crate::registry::dir_for(&self.config) else {
            return Ok(None);
        };
        let source: Arc<dyn crate::registry::RecordSource + Send + Sync> = self.clone();
        let handle =
            crate::registry::Registry::start(dir, source, crate::registry::DEFAULT_INTERVAL)?;
        crate::registry::install_exit_hook(handle.clone());
        Ok(Some(handle))
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

#[cfg(test)]
mod snapshot_tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    #[test]
    fn segments_snapshot_tiles_mapped_ranges() {
        for vmm in [true, false] {
            let sim = Arc::new(SimDriver::new(SimConfig::default()));
            let cfg = Config {
                vmm,
                ..Config::default()
            };
            let pool = DevicePool::new(sim, 0, cfg).unwrap();
            let s1 = StreamId(1);
            let a = pool.alloc_raw(1000, StreamId::DEFAULT).unwrap();
            let b = pool.alloc_raw(3 << 20, s1).unwrap();
            let c = pool.alloc_raw(4096, StreamId::DEFAULT).unwrap();
            pool.free_raw(c, StreamId::DEFAULT).unwrap();
            let segs = pool.segments_snapshot();
            assert!(segs.windows(2).all(|w| w[0].address < w[1].address));
            for seg in &segs {
                assert_eq!(seg.expandable, vmm);
                let mut at = seg.address;
                for blk in &seg.blocks {
                    assert_eq!(blk.address, at, "blocks tile the segment");
                    at += blk.size;
                }
                assert_eq!(at, seg.address + seg.total_size);
            }
            let find = |p: u64| {
                segs.iter()
                    .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
                    .find(|(_, b)| b.address == p)
                    .unwrap()
            };
            let (sa, ba) = find(a);
            assert_eq!(
                (ba.size, ba.requested_size, ba.state),
                (1024, 1000, BlockState::Allocated)
            );
            assert!(!sa.large);
            let (sb, bb) = find(b);
            assert_eq!(
                (bb.requested_size, bb.state, sb.stream),
                (3 << 20, BlockState::Allocated, 1)
            );
            assert!(sb.large);
            let live: u64 = segs
                .iter()
                .flat_map(|s| &s.blocks)
                .filter(|b| b.state == BlockState::Allocated)
                .map(|b| b.size)
                .sum();
            assert_eq!(live, pool.stats().get("allocated_bytes.all.current") as u64);
            pool.free_raw(a, StreamId::DEFAULT).unwrap();
            pool.free_raw(b, s1).unwrap();
        }
    }
}
