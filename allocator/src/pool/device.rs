//! [`DevicePool`]: one device's pool of per-stream arenas, the state behind its device lock, the
//! thread-local arena cache and the hot path (alloc, free, `record_stream`), and its teardown.
//! The slow path it falls into on a miss is in `grow.rs`.

use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;

use super::buffer::Buffer;
use super::round_size;
use crate::arena::{
    Arena, Chunk, Counters, DeviceCore, EventCache, FreeOutcome, HeapKind, StreamRef,
};
use crate::config::Config;
use crate::driver::{DeviceCaps, DeviceId, Driver, EventId, StreamId, StreamInfo};
use crate::error::{Error, OomReport, Result};
use crate::fork::check as fork_check;
use crate::heap::ALIGN;
use crate::provenance::{Mode, Origin};
use crate::stats::{ExactGauge, SharedGauges};

/// A chunk whose release failed: unmapped, still reserved (in heap `kind`'s count).
#[derive(Debug, Clone, Copy)]
pub(super) struct Lost {
    pub kind: HeapKind,
    pub chunk: Chunk,
}

/// A handle mapped at `addr` whose access could not be granted and which could not be unmapped
/// either: still reserved, outside every heap's page table.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stuck {
    pub kind: HeapKind,
    pub chunk: Chunk,
    pub addr: u64,
}

/// Device-level state behind the device lock: reserved memory and the limit.
#[derive(Debug)]
pub(super) struct DeviceState {
    /// Reserved bytes by pool (0 all, 1 small, 2 large).
    pub(super) reserved: [ExactGauge; 3],
    /// The reserved bytes of each graph pool (PyTorch's `reserved_bytes_by_private_pools`):
    /// what its arenas hold (mapped pages, `cuMemAlloc` segments), by pool half as
    /// `reserved`, also after the pool is released, until that memory is released or taken by
    /// other streams, as PyTorch counts a released pool's segments until they are freed. An
    /// entry whose current value is 0 is forgotten when the peaks are reset with the pool
    /// gone.
    pub(super) private_reserved: BTreeMap<(u64, u64), [ExactGauge; 3]>,
    /// Physical handles or linear segments by pool.
    pub(super) segments: [ExactGauge; 3],
    pub(super) limit: u64,
    pub(super) fraction: f64,
    /// Physical handles (with their heap kind) whose release failed: unmapped, still reserved.
    /// Growth maps them again before creating new pages; `empty_cache` retries releasing them.
    pub(super) lost: Vec<Lost>,
    /// Handles mapped at an address (kind, handle, address) whose access could not be granted
    /// and which could not be unmapped either: still reserved, outside every heap's page
    /// table. `empty_cache` retries the unmap and the release.
    pub(super) stuck: Vec<Stuck>,
    /// Reserved bytes right after the limit was last lowered (and cached memory released):
    /// live blocks may keep reserved above a lowered limit, never above this.
    pub(super) over_limit: u64,
    /// The report of the last failed request (for the registry's record).
    pub(super) last_oom: Option<Box<OomReport>>,
    /// The device's free bytes as `cuMemGetInfo` last told (it costs ~10 µs), with this pool's
    /// reserved bytes at that moment: free now ≈ free then − (reserved now − reserved then).
    /// Growth trusts the estimate when it shows room and reads the driver again when it does
    /// not; a failed creation forgets it (another process may have taken memory).
    pub(super) free_seen: Option<(u64, u64)>,
    /// The devices granted access to every mapping (`peers.rs`).
    pub(super) peers: Vec<DeviceId>,
    /// The cumulative increases and decreases (per gauge and pool) of arenas dropped for good
    /// (reaped after retiring, swept as dormant): the statistics' "allocated" and "freed"
    /// counts keep them, so they never go down.
    pub(super) gone: [[[i64; 3]; crate::stats::GAUGES]; 2],
    /// The last chunk moves stitching made (Note [No bounce] in `pages.rs`).
    pub(super) moves: super::pages::RecentMoves,
    /// Old mappings of chunks moved from busy streams, unmapped once the donor's work is done
    /// (Note [Moves ordered on the device] in `pages.rs`), oldest first.
    pub(super) deferred: Vec<super::pages::Deferred>,
}

impl DeviceState {
    /// Whether `handle` is still mapped at an address it moved from (a deferred unmap).
    pub(super) fn aliased(&self, handle: crate::driver::PhysHandle) -> bool {
        self.deferred
            .iter()
            .any(|d| d.aliases.iter().any(|al| al.handle == handle))
    }

    /// The events of the deferred unmaps of `handle`'s old mappings: what work that reaches
    /// the handle elsewhere must be ordered after.
    pub(super) fn alias_events(&self, handle: crate::driver::PhysHandle) -> Vec<EventId> {
        self.deferred
            .iter()
            .filter(|d| d.aliases.iter().any(|al| al.handle == handle))
            .map(|d| d.event)
            .collect()
    }

    /// The address ranges (`(start, end)`, sorted) that sit in some heap's holes but are still
    /// mapped: deferred unmaps, and pages whose unmap failed. Windows never cover them.
    pub(super) fn still_mapped(&self, g: u64) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .deferred
            .iter()
            .flat_map(|d| d.aliases.iter().map(|al| (al.addr, al.addr + al.len)))
            .chain(
                self.stuck
                    .iter()
                    .map(|s| (s.addr, s.addr + s.chunk.pages as u64 * g)),
            )
            .collect();
        v.sort_unstable();
        v
    }

    /// Keeps the cumulative counts of an arena that is about to be dropped for good.
    pub(super) fn keep_counts(&mut self, a: &crate::arena::ArenaState) {
        for g in 0..crate::stats::GAUGES {
            for p in 0..3 {
                self.gone[0][g][p] += a.gauges.increases(g, p);
                self.gone[1][g][p] += a.gauges.decreases(g, p);
            }
        }
    }
}

impl DeviceState {
    pub(super) fn add_reserved(&mut self, kind: HeapKind, bytes: i64) {
        self.reserved[0].add(bytes);
        self.reserved[kind.pool_index()].add(bytes);
    }
    /// Counts `bytes` mapped into (or, negative, unmapped from) an arena of graph pool `pool`;
    /// nothing for an arena of no graph pool.
    pub(super) fn add_private_reserved(
        &mut self,
        pool: Option<(u64, u64)>,
        kind: HeapKind,
        bytes: i64,
    ) {
        if let Some(id) = pool {
            let g = self.private_reserved.entry(id).or_default();
            g[0].add(bytes);
            g[kind.pool_index()].add(bytes);
        }
    }
    pub(super) fn add_segments(&mut self, kind: HeapKind, n: i64) {
        self.segments[0].add(n);
        self.segments[kind.pool_index()].add(n);
    }
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

struct CacheEntry {
    uid: u64,
    stream: StreamId,
    /// The pool's [`DevicePool::generation`] when the entry was made: an arena retired since
    /// makes every older entry stale.
    generation: u64,
    /// An `Arc<Arena<D>>` of the pool `uid` (type-erased: the cache serves every driver type).
    arena: Box<dyn Any + Send + Sync>,
}

const TLS_ENTRIES: usize = 4;

/// The fewest arenas at which dormant ones are swept (see `DevicePool::sweep_dormant`).
pub(super) const SWEEP_MIN_ARENAS: usize = 256;

thread_local! {
    /// The arenas this thread used last: (pool uid, stream) -> arena. Saves a shared lock on
    /// every allocation.
    static ARENA_CACHE: RefCell<Vec<CacheEntry>> = const { RefCell::new(Vec::new()) };
}

/// Segment base -> (end, owning arena).
type RangeIndex<D> = BTreeMap<u64, (u64, Weak<Arena<D>>)>;

/// The pool of one device: an arena per stream, plus the state that all of them share.
pub struct DevicePool<D: Driver> {
    pub(super) core: Arc<DeviceCore<D>>,
    /// The live streams' arenas, by the driver's stream id (see [`Driver::stream_info`]): a
    /// handle is not an identity (`CU_STREAM_PER_THREAD` is another stream on every thread, and
    /// a destroyed stream's handle can come back as a new stream).
    pub(super) arenas: RwLock<FxHashMap<u64, Arc<Arena<D>>>>,
    /// Arenas whose stream is gone, kept while they hold memory: their live blocks can still be
    /// freed, and their free pages taken by other streams once the device is idle.
    pub(super) retired: Mutex<Vec<Arc<Arena<D>>>>,
    /// Bumped when an arena retires, so that threads drop their cached handle -> arena entries.
    pub(super) generation: AtomicU64,
    /// The number of arenas at which the next growth sweeps dormant ones (see
    /// `DevicePool::sweep_dormant`), and whether it should.
    pub(super) sweep_at: AtomicUsize,
    pub(super) sweep_wanted: AtomicBool,
    /// Segment base -> (end, owning arena), to find a pointer's arena without its stream.
    pub(super) ranges: RwLock<RangeIndex<D>>,
    pub(super) state: Mutex<DeviceState>,
    /// The graph pools and the allocation windows open into them (`graphs.rs`); a leaf lock.
    pub(super) graphs: Mutex<super::graphs::GraphPools<D>>,
    /// Who an OOM report last named, NVML's count for this process, and when (`grow.rs`): read
    /// at most once a second, however often OOMs are caught. A leaf lock.
    pub(super) others: Mutex<Option<(std::time::Instant, super::publish::Others)>>,
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
        let peers = super::peers::initial_peers(&*driver, dev, config.peer_access)?;
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
                capturing: AtomicUsize::new(0),
                recorder,
                observer: Default::default(),
                share: Default::default(),
                streams: Default::default(),
            }),
            arenas: RwLock::new(FxHashMap::default()),
            retired: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            sweep_at: AtomicUsize::new(SWEEP_MIN_ARENAS),
            sweep_wanted: AtomicBool::new(false),
            ranges: RwLock::new(BTreeMap::new()),
            state: Mutex::new(DeviceState {
                reserved: Default::default(),
                private_reserved: BTreeMap::new(),
                segments: Default::default(),
                limit,
                fraction: config.memory_fraction,
                over_limit: 0,
                last_oom: None,
                free_seen: None,
                lost: Vec::new(),
                stuck: Vec::new(),
                peers,
                gone: [[[0; 3]; crate::stats::GAUGES]; 2],
                moves: Default::default(),
                deferred: Vec::new(),
            }),
            graphs: Mutex::new(super::graphs::GraphPools::default()),
            others: Mutex::new(None),
        })
    }

    /// Sets (or, with `None`, removes) the observer of this device's mappings, segments and
    /// completed frees (see [`PoolEvent`](crate::PoolEvent)).
    pub fn set_observer(&self, observer: Option<crate::Observer>) {
        // The old observer is dropped here, with no lock held.
        drop(self.core.observer.set(observer));
    }

    /// Replaces the observer, returning the old one (see `ObserverSlot::set`).
    pub(super) fn core_observer_set(
        &self,
        observer: Option<crate::Observer>,
    ) -> Option<crate::Observer> {
        self.core.observer.set(observer)
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

    /// What the driver says `stream` names on this thread, refused unless it is a stream of
    /// this device.
    pub(super) fn stream_here(&self, stream: StreamId) -> Result<crate::driver::StreamInfo> {
        let c = &*self.core;
        let info = c.driver.stream_info(c.dev, stream)?;
        if info.device != c.dev {
            return Err(Error::InvalidArgument(format!(
                "stream {stream} belongs to device {}, not device {}: allocate on the stream's \
                 own device",
                info.device, c.dev
            )));
        }
        Ok(info)
    }

    /// The arena of the stream `stream` names on this thread, made on first use. The driver
    /// resolves the handle (one `stream_info` call: this is the path of a thread's first use of
    /// a handle, and of every growth). A new stream seen with the handle of an arena's stream
    /// means that stream is gone: its arena retires (see [`DevicePool::retire`]).
    ///
    /// Known limit: a thread's cache of handle -> arena is checked against retirements, not the
    /// driver, so a thread that destroys a stream and allocates at once on a new stream with the
    /// same handle is served from the old arena's cached blocks until its next growth or until
    /// another thread meets the new stream. Asking the driver (`cuStreamGetId`) on every
    /// allocation would close it, at a driver call on the hot path.
    pub(super) fn arena(&self, stream: StreamId) -> Result<Arc<Arena<D>>> {
        let info = self.stream_here(stream)?;
        let key = |map: &FxHashMap<u64, Arc<Arena<D>>>| arena_key(map, stream, &info);
        {
            let map = self.arenas.read();
            if let Some(a) = map.get(&key(&map)) {
                return Ok(a.clone());
            }
        }
        let mut map = self.arenas.write();
        let id = key(&map);
        if let Some(a) = map.get(&id) {
            return Ok(a.clone());
        }
        // A stream met while it captures has no driver id: its handle names it, and a later
        // id for that handle (once the capture is over) retires the arena as a new stream's.
        if !stream.is_special() && !info.capturing {
            self.retire_handle(&mut map, stream);
        }
        let arena = Arc::new(Arena::new(StreamRef::new(stream, info), self.core.clone()));
        map.insert(id, arena.clone());
        self.core.know_stream(stream);
        if map.len() >= self.sweep_at.load(Relaxed) {
            self.sweep_wanted.store(true, Relaxed);
        }
        Ok(arena)
    }

    /// Retires `arena`, whose stream is gone: its handle is never used again (another stream
    /// may have it now). Its live blocks stay valid and can be freed; its free pages go to other
    /// streams only after a device synchronisation (the gone stream's last work may still run:
    /// `cuStreamDestroy` does not wait for it). Every thread's cached entries are invalidated.
    pub(super) fn retire(&self, arena: Arc<Arena<D>>) {
        arena.retired.store(true, Relaxed);
        self.generation.fetch_add(1, Relaxed);
        self.retired.lock().push(arena);
    }

    /// Retires the arenas of the stream handle `stream` (see [`Pool::forget_stream`]), without
    /// a driver call: the stream may be destroyed already. Returns whether there was one.
    ///
    /// [`Pool::forget_stream`]: super::Pool::forget_stream
    pub fn forget_stream(&self, stream: StreamId) -> bool {
        self.retire_handle(&mut self.arenas.write(), stream)
    }

    /// Retires every arena of `map` whose stream has the handle `stream`; whether there was one.
    fn retire_handle(&self, map: &mut FxHashMap<u64, Arc<Arena<D>>>, stream: StreamId) -> bool {
        let gone: Vec<u64> = map
            .iter()
            .filter(|(_, a)| a.stream == stream)
            .map(|(&id, _)| id)
            .collect();
        for old in gone.iter().filter_map(|id| map.remove(id)) {
            self.retire(old);
        }
        self.core.forget_stream(stream);
        !gone.is_empty()
    }

    /// Runs `f` on the cached arena of `stream`, if this thread has it cached (and no arena
    /// retired since it was cached).
    #[inline]
    pub(super) fn with_cached<R>(
        &self,
        stream: StreamId,
        f: impl FnOnce(&Arc<Arena<D>>) -> R,
    ) -> Option<R> {
        let uid = self.core.uid;
        let generation = self.generation.load(Relaxed);
        ARENA_CACHE
            .try_with(|cell| {
                let cache = cell.try_borrow().ok()?;
                let e = cache
                    .iter()
                    .find(|e| e.uid == uid && e.stream == stream && e.generation == generation)?;
                let arena = e.arena.downcast_ref::<Arc<Arena<D>>>()?;
                Some(f(arena))
            })
            .ok()
            .flatten()
    }

    /// The arena of `stream`, caching it for this thread.
    pub(super) fn arena_cached(&self, stream: StreamId) -> Result<Arc<Arena<D>>> {
        let generation = self.generation.load(Relaxed);
        let arena = self.arena(stream)?;
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
                    generation,
                    arena: Box::new(arena.clone()),
                });
            }
        });
        Ok(arena)
    }

    #[inline]
    pub(super) fn kind_of(&self, rounded: u64) -> HeapKind {
        if rounded <= self.core.config.small_size {
            HeapKind::Small
        } else {
            HeapKind::Large
        }
    }

    /// The hot path on one arena: `Some(ptr)` on a cache hit.
    #[inline]
    pub(super) fn fast_alloc(
        &self,
        arena: &Arena<D>,
        kind: HeapKind,
        rounded: u64,
        size: u64,
        o: Option<&Origin>,
    ) -> Option<u64> {
        let c = &*self.core;
        let mut a = arena.state.lock();
        if !a.pending.is_empty() {
            a.process_pending(false, c);
        }
        let (p, id) = a.try_take(kind, rounded, size, &c.shared)?;
        if let Some(o) = o {
            a.record(kind, id, rounded, o);
        }
        Some(p)
    }

    /// This allocation's provenance (see Note [Provenance on the hot path]); `None` when off.
    #[inline]
    pub(super) fn origin(&self) -> Option<Origin> {
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
        self.alloc_inner(size, stream, false).map(|(p, _)| p)
    }

    /// Allocates and returns the pointer with the arena it came from (on a cache hit only
    /// `with_arena` asks for it: cloning the `Arc` costs two atomic operations).
    pub(super) fn alloc_inner(
        &self,
        size: u64,
        stream: StreamId,
        with_arena: bool,
    ) -> Result<(u64, Option<Arc<Arena<D>>>)> {
        if size == 0 {
            return Ok((0, None));
        }
        fork_check()?;
        let rounded = round_size(size)
            .ok_or_else(|| Error::InvalidArgument(format!("size {size} is too large to round")))?;
        let kind = self.kind_of(rounded);
        let o = self.origin();
        if self.core.capturing() {
            if let Some(arena) = self.graph_arena(stream)? {
                let ptr = self.alloc_routed(arena.clone(), stream, kind, rounded, size, &o)?;
                return Ok((ptr, Some(arena)));
            }
        }
        if let Some(Some(hit)) = self.with_cached(stream, |a| {
            self.fast_alloc(a, kind, rounded, size, o.as_ref())
                .map(|p| (p, with_arena.then(|| a.clone())))
        }) {
            self.handed_out(hit.0, rounded, size, stream);
            return Ok(hit);
        }
        let arena = self.arena_cached(stream)?;
        let ptr = self.alloc_routed(arena.clone(), stream, kind, rounded, size, &o)?;
        Ok((ptr, Some(arena)))
    }

    /// Allocates from `arena` (the stream's own, or a graph pool's): its hot path, else the
    /// slow path; an arena retired meanwhile is looked up again.
    fn alloc_routed(
        &self,
        mut arena: Arc<Arena<D>>,
        stream: StreamId,
        kind: HeapKind,
        rounded: u64,
        size: u64,
        o: &Option<Origin>,
    ) -> Result<u64> {
        let mut stale = 0;
        let ptr = loop {
            if let Some(p) = self.fast_alloc(&arena, kind, rounded, size, o.as_ref()) {
                break p;
            }
            let slow = match self.alloc_slow(&arena, kind, rounded, size) {
                Err(e) if e.is_oom() => {
                    // PyTorch's MemPool(use_on_oom=True): a free block of such a pool.
                    let from_pool = self
                        .oom_arenas(stream)
                        .iter()
                        .find_map(|a| self.fast_alloc(a, kind, rounded, size, o.as_ref()));
                    match from_pool {
                        Some(p) => break p,
                        None => return Err(self.name_other_processes(e)),
                    }
                }
                r => r?,
            };
            match slow {
                Some(p) => {
                    if let Some(o) = &o {
                        arena.state.lock().record_ptr(p, o);
                    }
                    break p;
                }
                // Retired or swept since it was looked up: the stream's arena now is another.
                None if stale < 8 => {
                    stale += 1;
                    arena = self.arena_cached(stream)?;
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "internal error: the arena of stream {stream} kept being retired"
                    )))
                }
            }
        };
        self.handed_out(ptr, rounded, size, stream);
        Ok(ptr)
    }

    /// What every successful allocation does last: the hazard hook and the recorder.
    #[inline]
    pub(super) fn handed_out(&self, ptr: u64, rounded: u64, size: u64, stream: StreamId) {
        let c = &*self.core;
        c.driver.note_handout(c.dev, ptr, rounded, stream);
        if let Some(r) = &c.recorder {
            r.alloc(ptr, size, stream);
        }
    }

    /// Allocates a [`Buffer`] that frees itself on drop.
    pub fn try_alloc(&self, size: u64, stream: StreamId) -> Result<Buffer<D>> {
        let (ptr, arena) = self.alloc_inner(size, stream, true)?;
        let arena = if ptr == 0 { None } else { arena };
        Ok(Buffer {
            ptr,
            len: size,
            stream,
            device: self.core.dev,
            arena,
        })
    }

    #[cold]
    pub(super) fn alloc_slow(
        &self,
        arena: &Arc<Arena<D>>,
        kind: HeapKind,
        rounded: u64,
        size: u64,
    ) -> Result<Option<u64>> {
        let r = self.grow_with_retry(arena, kind, rounded, size);
        if let Some(rec) = &self.core.recorder {
            rec.reserved(self.state.lock().reserved[0].current.max(0) as u64);
        }
        r
    }

    /// Frees the block at `ptr`. `stream` is a hint (the allocation's stream makes it fast).
    /// Freeing 0 is a no-op; an unknown pointer is counted, logged and reported as an error,
    /// and changes nothing.
    pub fn free_raw(&self, ptr: u64, stream: StreamId) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        fork_check()?;
        let c = &*self.core;
        // The recorder hears of a free before the block can be handed out again, so another
        // thread's reuse of the address is always recorded after it (it ignores unknown
        // pointers, so an invalid free records nothing).
        if let Some(r) = &c.recorder {
            r.free(ptr);
        }
        let hit = self.with_cached(stream, |a| a.state.lock().free(ptr, &a.sref, c));
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
    pub(super) fn arena_of(&self, addr: u64) -> Option<Arc<Arena<D>>> {
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
        fork_check()?;
        let c = &*self.core;
        let Some(arena) = self.arena_of(ptr) else {
            c.counters.num_invalid_frees.fetch_add(1, Relaxed);
            return Err(Error::InvalidArgument(format!(
                "record_stream: {ptr:#x} is not memory of this pool"
            )));
        };
        let base = arena.state.lock().block_containing(ptr);
        let Some(base) = base else {
            return Err(Error::InvalidArgument(format!(
                "record_stream: {ptr:#x} is not inside a live block"
            )));
        };
        let info = c.resolve_use(stream)?;
        c.counters.num_record_streams.fetch_add(1, Relaxed);
        arena.add_use(base, stream, info);
        Ok(())
    }

    /// Every arena: the live streams', the graph pools' and the retired ones.
    pub(super) fn all_arenas(&self) -> Vec<Arc<Arena<D>>> {
        let mut v: Vec<_> = self.arenas.read().values().cloned().collect();
        v.sort_by_key(|a| a.stream);
        self.graphs.lock().extend_arenas(&mut v);
        v.extend(self.retired.lock().iter().cloned());
        v
    }

    /// The arenas whose pages may be taken by others or released: all but the pinned arenas
    /// of live graph pools (see `graphs.rs`).
    pub(super) fn donors(&self) -> Vec<Arc<Arena<D>>> {
        let mut v = self.all_arenas();
        v.retain(|a| !a.pinned());
        v
    }
}

impl<D: Driver> Drop for DevicePool<D> {
    fn drop(&mut self) {
        let c = &*self.core;
        if let Some(r) = &c.recorder {
            r.flush();
        }
        // Ranges opened from other processes first: they are not the arenas'.
        c.share.close_all(c);
        let (lost, stuck) = {
            let mut dev = self.state.lock();
            // Old mappings of moved chunks first: their donors' work is waited for, so that
            // the chunks can be released and the address ranges freed.
            self.finish_deferred(&mut dev, true);
            // Whatever is left (an unmap that failed again, a capture underway) stays mapped,
            // as the failing call leaves it; its events go with the pool.
            for group in std::mem::take(&mut dev.deferred) {
                let _ = c.driver.event_destroy(c.dev, group.event);
            }
            (
                std::mem::take(&mut dev.lost),
                std::mem::take(&mut dev.stuck),
            )
        };
        for l in lost {
            let _ = c.share.release_chunk(c, l.chunk.handle);
        }
        // Before the arenas free their address ranges, which must hold no mapping.
        for s in stuck {
            let _ = c
                .driver
                .unmap(c.dev, s.addr, s.chunk.pages as u64 * c.granularity);
            let _ = c.share.release_chunk(c, s.chunk.handle);
        }
        // Only now may a buffer freed on another thread tear its arena down (and free its
        // address range): the stuck pages inside it are gone.
        c.closed.store(true, Relaxed);
        for arena in self.all_arenas() {
            arena.teardown();
        }
        self.arenas.write().clear();
        self.retired.lock().clear();
        for ev in c.events.drain() {
            let _ = c.driver.event_destroy(c.dev, ev);
        }
    }
}

/// The key of `stream`'s arena in `map` (a device's stream arenas, or a graph pool's): its
/// driver id; for a stream resolved while capturing ([`StreamInfo::capturing`]), whose id is
/// made from its handle, the key of the arena already made for that handle, so that a capture
/// allocates from the stream's own cache rather than a second arena of the same stream.
///
/// Limits, both of the handle standing in for the id. That arena may be a destroyed stream's
/// whose handle the capturing stream got, when cistern was not told ([`Pool::forget_stream`])
/// and has not met the new stream outside a capture: the known limit of [`DevicePool::arena`]'s
/// thread caches. And a stream first met inside a capture keeps a handle-keyed arena: outside
/// the capture its real id makes a new one, and the old one retires (a device stream's: its
/// free pages serve others after a device synchronisation) or stays beside it (a graph pool's:
/// two arenas of one stream split that pool's cached memory until it is released; and the
/// legacy stream's: later captures find it again, other streams' growth takes its pages).
/// Re-keying would be cheaper but unsafe where the handle has meanwhile been reused. Handles
/// compare as [`StreamId::canonical`]: the null handle and `CU_STREAM_LEGACY` are one stream.
///
/// [`Pool::forget_stream`]: super::Pool::forget_stream
pub(super) fn arena_key<D: Driver>(
    map: &FxHashMap<u64, Arc<Arena<D>>>,
    stream: StreamId,
    info: &StreamInfo,
) -> u64 {
    if info.capturing {
        // The stream's own arena (a driver id) before one made during an earlier capture.
        if let Some((&id, _)) = map
            .iter()
            .filter(|(_, a)| {
                a.stream.canonical() == stream.canonical() && a.sref.dev == info.device
            })
            .min_by_key(|(&id, _)| (id & crate::driver::CAPTURING_ID != 0, id))
        {
            return id;
        }
    }
    info.id
}
