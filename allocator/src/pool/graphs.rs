//! Graph pools: private memory for CUDA graphs, as PyTorch's `beginAllocateToPool` /
//! `endAllocateToPool` / `releasePool` give it.
//!
//! A CUDA graph replays the kernels it captured on the addresses they used when captured. So
//! every block allocated while the graph was captured must stay the graph's for as long as the
//! graph can be replayed: a block freed during the capture may be reused *inside* the capture
//! (the graph orders it), but never handed to an allocation outside the graph, and the graph's
//! pages must never be taken by another stream nor unmapped.
//!
//! * [`DevicePool::begin_allocate_to_pool`] opens an *allocation window* into the graph pool
//!   named by a [`MempoolId`] (made on first use, counted once per `begin`): until
//!   [`DevicePool::end_allocate_to_pool`], every allocation on a stream the window's filter
//!   accepts (PyTorch passes one that accepts the streams of its capture) is served from that
//!   pool, by an arena of its own per stream. Such arenas are *pinned*: growth takes no page of
//!   theirs, `empty_cache` / `trim` / the memory fraction release none, and a dormant sweep
//!   never drops them. Frees of their blocks return to them, so the memory is reused only by
//!   later allocations routed into the same pool (PyTorch's pool sharing between graphs).
//! * [`DevicePool::release_pool`] drops one use; at the last, the pool's arenas retire: their
//!   live blocks (the graph's outputs) stay valid and can be freed, and their pages go back to
//!   the rest of the pool only after a device synchronisation, as a gone stream's do (a replay
//!   may still run).
//!
//! # Note [Capture-safe]
//!
//! While any window is open, a stream of the device may be capturing in the default global
//! mode, where a query or synchronisation invalidates the capture, and an event recorded on a
//! capturing stream becomes a node of the graph that never completes. So while
//! `DeviceCore::capturing` is set the whole device pool makes no such call: pending frees are
//! not polled, a free used by other streams records its events only after the capture (the
//! block stays unavailable meanwhile, as PyTorch's `needs_events_deferred_until_no_capture`),
//! pages of other arenas are not taken (that needs their stream idle: a query), cached memory
//! is not released, and the OOM protocol does not wait. Growth creates and maps new memory
//! only: `cuMemCreate` / `cuMemMap` / `cuMemSetAccess` are legal during a capture, and
//! `cuMemAlloc` (without VMM) runs in relaxed capture mode in the CUDA driver backend, as
//! PyTorch's `cudaMallocMaybeCapturing` does. A capture that needs memory cached elsewhere
//! should call `empty_cache` before it begins.
//!
//! Opening a window *quiesces* the device pool: each check of `capturing` is made under the
//! device lock or an arena lock, with the driver calls it guards, so taking each of those
//! locks once after setting the flag waits for every operation that saw it clear. Filters run
//! under the graph pools' lock, so none runs once its window has closed (PyTorch's filter
//! refers to its `CUDAGraph`, which may be gone then). A window is one use of its pool, as in
//! PyTorch: each graph that captured into a pool releases it once.
//!
//! # Note [Checkpoints]
//!
//! CUDA graph trees (`torch.compile(mode="reduce-overhead")`) record many graphs into one
//! pool and, to record a new branch after replaying others, put the pool's books back to
//! where they stood after an earlier recording: replays write memory but leave no trace in
//! the allocator. [`DevicePool::checkpoint_pool`] records the pool's live blocks (address,
//! size, stream); [`DevicePool::restore_pool`] frees every block live in the pool now and
//! makes the checkpoint's blocks live again at their addresses, returning both lists so the
//! caller can move its tensors' ownership (PyTorch's `setCheckpointPoolState`). The pool's
//! pages never move while it lives (its arenas are pinned), so a block's range is free again
//! once the pool's blocks are freed; blocks freed with other streams' uses are waited for
//! there (a host wait, off the allocation path; PyTorch's own restore refuses such blocks).
//! A restore checks the whole checkpoint against the pool before it frees anything, and
//! restores each arena under one hold of its lock, so no other allocation takes a range in
//! between. Restored blocks keep their provenance (tag, call site, thread, time) in the
//! ledger. [`DevicePool::pool_live_blocks`] answers PyTorch's
//! `checkPoolLiveAllocations`.

use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::DevicePool;
use crate::arena::{Arena, HeapKind, StreamRef};
use crate::driver::{Driver, StreamId};
use crate::error::{Error, Result};
use crate::fork::check as fork_check;

/// A graph pool's id: PyTorch's `MempoolId_t`, a pair of integers (`(0, n)` for pools made by
/// `torch.cuda.graph_pool_handle()` or `MemPool`, `(n, 0)` for a graph's own).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MempoolId(pub u64, pub u64);

impl std::fmt::Display for MempoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}

/// Which streams an allocation window routes into its pool: called with the allocation's
/// stream handle, on the allocating thread, under the device's graph-pool lock (so that no call
/// is made once `end_allocate_to_pool` has returned); it must not call the pool. `Err` (the
/// filter could not tell, e.g. its own CUDA query failed) fails the allocation with that
/// message: serving it from the stream's ordinary memory would let the graph's replays write
/// memory that is reused outside the graph.
pub type StreamFilter = Arc<dyn Fn(StreamId) -> std::result::Result<bool, String> + Send + Sync>;

/// One graph pool.
struct GraphPool<D: Driver> {
    /// `begin_allocate_to_pool` calls not yet matched by `release_pool`.
    uses: u64,
    /// The pool's arenas, by the driver's stream id.
    arenas: FxHashMap<u64, Arc<Arena<D>>>,
    /// Its free blocks serve an allocation outside it that runs out of memory (PyTorch's
    /// `MemPool(use_on_oom=True)`, `setUseOnOOM`).
    use_on_oom: bool,
}

/// An open allocation window.
struct Window {
    pool: MempoolId,
    /// `None`: every stream.
    filter: Option<StreamFilter>,
}

/// Every graph pool of a device and the windows open into them (behind `DevicePool::graphs`).
pub(crate) struct GraphPools<D: Driver> {
    pools: FxHashMap<MempoolId, GraphPool<D>>,
    /// In the order they were opened: an allocation goes to the first whose filter accepts
    /// its stream.
    windows: Vec<Window>,
}

impl<D: Driver> Default for GraphPools<D> {
    fn default() -> Self {
        GraphPools {
            pools: FxHashMap::default(),
            windows: Vec::new(),
        }
    }
}

impl<D: Driver> GraphPools<D> {
    /// Appends every live graph pool's arenas to `v`, by pool then stream.
    pub(super) fn extend_arenas(&self, v: &mut Vec<Arc<Arena<D>>>) {
        let mut ids: Vec<_> = self.pools.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let mut a: Vec<_> = self.pools[&id].arenas.values().cloned().collect();
            a.sort_by_key(|a| a.stream);
            v.extend(a);
        }
    }
}

/// A graph pool as [`DevicePool::graph_pools`] describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphPoolInfo {
    /// The pool's id.
    pub id: MempoolId,
    /// Uses not yet released.
    pub uses: u64,
    /// Whether an allocation window into it is open.
    pub open: bool,
    /// Streams with an arena in it.
    pub streams: usize,
}

/// One live block of a graph pool, as [`DevicePool::checkpoint_pool`] records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointBlock {
    /// Its address.
    pub ptr: u64,
    /// The bytes it holds (rounded).
    pub size: u64,
    /// The bytes that were asked for.
    pub requested: u64,
    /// The stream it was allocated on (the handle its arena was first seen with).
    pub stream: StreamId,
    heap: HeapKind,
    /// The driver's id of that stream: the key of its arena in the pool.
    arena: u64,
    /// Its provenance (tag, call site, thread, time), restored with it.
    meta: crate::heap::BlockMeta,
}

/// A graph pool's live blocks at one moment (see Note [Checkpoints]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolCheckpoint {
    /// The pool.
    pub id: MempoolId,
    /// Its live blocks then, by address.
    pub blocks: Vec<CheckpointBlock>,
}

/// What [`DevicePool::restore_pool`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreDelta {
    /// The blocks that were live and are now free, by address.
    pub freed: Vec<u64>,
    /// The checkpoint's blocks, live again.
    pub allocated: Vec<CheckpointBlock>,
}

impl<D: Driver> DevicePool<D> {
    /// Opens an allocation window into graph pool `id` (made if new; one more use of it if
    /// not): until [`DevicePool::end_allocate_to_pool`], allocations on streams that `filter`
    /// accepts (every stream when `None`) come from the pool, and the device pool makes no
    /// call that a stream capture forbids (see the module documentation). Call it before the
    /// capture begins.
    pub fn begin_allocate_to_pool(&self, id: MempoolId, filter: Option<StreamFilter>) {
        // The last moment before the capture: the pool's frees that wait on events are polled
        // (their arenas allocate only inside windows, where nothing is polled).
        self.poll_graph_pools(Some(id));
        {
            let mut g = self.graphs.lock();
            g.pools
                .entry(id)
                .or_insert_with(|| GraphPool {
                    uses: 0,
                    arenas: FxHashMap::default(),
                    use_on_oom: false,
                })
                .uses += 1;
            g.windows.push(Window { pool: id, filter });
            self.core.capturing.fetch_add(1, SeqCst);
        }
        self.quiesce();
    }

    /// Waits until no operation that checked `capturing` before it was set is still making
    /// driver calls: every such call is made under the device lock or an arena's lock, and each
    /// of them is taken and released once here. Operations that take one later see the flag
    /// (the lock orders the store before their load). Without this, a growth or a free already
    /// underway on another thread could query or synchronise after the capture began, as
    /// PyTorch's allocator mutex prevents in `beginAllocateToPool`.
    fn quiesce(&self) {
        drop(self.state.lock());
        for arena in self.all_arenas() {
            drop(arena.state.lock());
        }
    }

    /// One more use of graph pool `id`, made if new, without opening a window (PyTorch's
    /// `createOrIncrefPool`, when a `MemPool` is made). Released by [`DevicePool::release_pool`].
    pub fn create_or_incref_pool(&self, id: MempoolId) {
        self.graphs
            .lock()
            .pools
            .entry(id)
            .or_insert_with(|| GraphPool {
                uses: 0,
                arenas: FxHashMap::default(),
                use_on_oom: false,
            })
            .uses += 1;
    }

    /// Whether graph pool `id`'s free blocks serve allocations outside it that run out of
    /// memory (PyTorch's `MemPool(use_on_oom=True)`): such an allocation, having failed with
    /// every other remedy, takes a free block of the pool on its stream, without growing the
    /// pool; the block is the pool's (its free returns it there). It is still counted in
    /// `num_ooms` (PyTorch does not count it), since the pool's own memory ran out.
    /// [`Error::InvalidArgument`] when there is no such pool.
    pub fn set_use_on_oom(&self, id: MempoolId, on: bool) -> Result<()> {
        match self.graphs.lock().pools.get_mut(&id) {
            Some(p) => {
                p.use_on_oom = on;
                Ok(())
            }
            None => Err(Error::InvalidArgument(format!(
                "set_use_on_oom: device {} has no graph pool {id}: make it first \
                 (create_or_incref_pool, as torch.cuda.MemPool does)",
                self.core.dev
            ))),
        }
    }

    /// The arenas on `stream` of the pools whose free blocks serve an out-of-memory
    /// allocation (see [`DevicePool::set_use_on_oom`]), by pool id; none while a window is
    /// open (a capture may be underway, and its pools' blocks are its own).
    pub(super) fn oom_arenas(&self, stream: StreamId) -> Vec<Arc<Arena<D>>> {
        if self.core.capturing() {
            return Vec::new();
        }
        let Ok(info) = self.stream_here(stream) else {
            return Vec::new();
        };
        let g = self.graphs.lock();
        let mut ids: Vec<_> = g
            .pools
            .iter()
            .filter(|(_, p)| p.use_on_oom)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids.iter()
            .filter_map(|id| {
                let arenas = &g.pools[id].arenas;
                arenas
                    .get(&super::device::arena_key(arenas, stream, &info))
                    .cloned()
            })
            .collect()
    }

    /// The uses of graph pool `id` not yet released (0 when there is no such pool: PyTorch's
    /// `getPoolUseCount`).
    pub fn pool_use_count(&self, id: MempoolId) -> u64 {
        self.graphs.lock().pools.get(&id).map_or(0, |p| p.uses)
    }

    /// Closes the allocation window into graph pool `id` (its latest, when several are open).
    /// The pool's memory stays the graph's until [`DevicePool::release_pool`].
    pub fn end_allocate_to_pool(&self, id: MempoolId) -> Result<()> {
        let mut g = self.graphs.lock();
        let Some(i) = g.windows.iter().rposition(|w| w.pool == id) else {
            return Err(Error::InvalidArgument(format!(
                "end_allocate_to_pool: no allocation window into graph pool {id} is open on \
                 device {}: call begin_allocate_to_pool first",
                self.core.dev
            )));
        };
        let closed = g.windows.remove(i);
        self.core.capturing.fetch_sub(1, SeqCst);
        drop(g);
        // Its filter (and the context a C caller gave with it) is released outside the lock.
        drop(closed);
        // The capture has ended (PyTorch ends the window after `cudaStreamEndCapture`): the
        // events of frees made during it are recorded now, so their wait starts.
        self.poll_graph_pools(None);
        Ok(())
    }

    /// Polls the pending frees of graph pool `id` (when `None`: every graph pool, and every
    /// other arena with events deferred during a capture, so that they are recorded now rather
    /// than at the arena's next allocation, when the streams may be gone); nothing while a
    /// window is open.
    fn poll_graph_pools(&self, id: Option<MempoolId>) {
        if self.core.capturing() {
            return;
        }
        let arenas: Vec<Arc<Arena<D>>> = match id {
            Some(id) => self
                .graphs
                .lock()
                .pools
                .get(&id)
                .map(|p| p.arenas.values().cloned().collect())
                .unwrap_or_default(),
            None => self.all_arenas(),
        };
        for arena in arenas {
            let mut a = arena.state.lock();
            let graph = arena.graph_pool.is_some();
            if (graph && !a.pending.is_empty()) || a.pending.iter().any(|p| !p.deferred.is_empty())
            {
                a.process_pending(false, &self.core);
            }
        }
    }

    /// Drops one use of graph pool `id` (PyTorch calls it when a graph or `MemPool` that used
    /// the pool is destroyed). At the last, the pool's arenas retire: their live blocks stay
    /// valid, and their memory returns to the device pool after a device synchronisation.
    /// Windows still open into it are closed.
    pub fn release_pool(&self, id: MempoolId) -> Result<()> {
        let missing = || {
            Error::InvalidArgument(format!(
                "release_pool: device {} has no graph pool {id} (already released, or never \
                 opened with begin_allocate_to_pool)",
                self.core.dev
            ))
        };
        // A use that is not the last needs the graph pools' lock alone (a growth may hold the
        // device lock through a host wait).
        {
            let mut g = self.graphs.lock();
            let p = g.pools.get_mut(&id).ok_or_else(missing)?;
            if p.uses > 1 {
                p.uses -= 1;
                return Ok(());
            }
        }
        // The last: the device lock first (the order `all_arenas` takes them in), so that no
        // check of the arenas sees the pool's arenas gone from it and not yet retired. The
        // pool is looked up again: another thread may have used or released it in between.
        let dev = self.state.lock();
        let (arenas, closed) = {
            let mut g = self.graphs.lock();
            let p = g.pools.get_mut(&id).ok_or_else(missing)?;
            p.uses -= 1;
            if p.uses > 0 {
                return Ok(());
            }
            let Some(p) = g.pools.remove(&id) else {
                return Ok(());
            };
            let (closed, open): (Vec<Window>, Vec<Window>) = std::mem::take(&mut g.windows)
                .into_iter()
                .partition(|w| w.pool == id);
            g.windows = open;
            self.core.capturing.fetch_sub(closed.len(), SeqCst);
            (p.arenas, closed)
        };
        // Under the device lock, which orders this against a growth that holds one of these
        // arenas. Their memory still counts as the pool's (`reserved_bytes_by_private_pools`)
        // until it is released or taken by other streams, as PyTorch counts a released pool's
        // segments until they are freed.
        for (_, arena) in arenas {
            self.retire(arena);
        }
        drop(dev);
        // Their filters are released outside the locks.
        drop(closed);
        Ok(())
    }

    /// The arenas of graph pool `id`, by the driver's stream id; an error naming `what` when
    /// there is no such pool.
    fn pool_arenas(&self, id: MempoolId, what: &str) -> Result<FxHashMap<u64, Arc<Arena<D>>>> {
        match self.graphs.lock().pools.get(&id) {
            Some(p) => Ok(p.arenas.clone()),
            None => Err(Error::InvalidArgument(format!(
                "{what}: device {} has no graph pool {id} (released, or never opened with \
                 begin_allocate_to_pool)",
                self.core.dev
            ))),
        }
    }

    /// The live blocks of graph pool `id` (their addresses, in order): PyTorch's
    /// `checkPoolLiveAllocations` compares them with the tensors it knows to be alive.
    pub fn pool_live_blocks(&self, id: MempoolId) -> Result<Vec<u64>> {
        fork_check()?;
        let mut v: Vec<u64> = Vec::new();
        for arena in self.pool_arenas(id, "pool_live_blocks")?.values() {
            v.extend(arena.state.lock().live.keys().copied());
        }
        v.sort_unstable();
        Ok(v)
    }

    /// The live blocks of graph pool `id` now (see Note [Checkpoints]).
    pub fn checkpoint_pool(&self, id: MempoolId) -> Result<PoolCheckpoint> {
        fork_check()?;
        let mut blocks = Vec::new();
        for (&key, arena) in &self.pool_arenas(id, "checkpoint_pool")? {
            let a = arena.state.lock();
            for (&ptr, r) in a.live.iter() {
                let span = a.kinds[r.kind].heap.span(r.span);
                blocks.push(CheckpointBlock {
                    ptr,
                    size: span.len,
                    requested: span.requested,
                    stream: arena.stream,
                    heap: r.kind,
                    arena: key,
                    meta: a.kinds[r.kind].heap.meta(r.span),
                });
            }
        }
        blocks.sort_unstable_by_key(|b| b.ptr);
        Ok(PoolCheckpoint { id, blocks })
    }

    /// Puts graph pool `cp.id` back to checkpoint `cp` (see Note [Checkpoints]): frees every
    /// block live in it now, then makes each of the checkpoint's blocks live again at its
    /// address. Refused, changing nothing, while an allocation window is open on the device (a
    /// capture may be underway: waiting for a block's other streams, or freeing under the
    /// capture, is not safe then), for a pool released since, and for a checkpoint that is
    /// not the pool's (a stream the pool has no memory of, a range that is not the pool's
    /// mapped memory). Each arena is restored under one hold of its lock, so no allocation
    /// (`use_on_oom`) takes a range between its free and its restore. Only a failed wait for
    /// a block's other streams (a driver fault) fails after the frees: then that arena's
    /// blocks are left free and the error says so.
    pub fn restore_pool(&self, cp: &PoolCheckpoint) -> Result<RestoreDelta> {
        fork_check()?;
        let id = cp.id;
        if self.core.capturing() {
            return Err(Error::InvalidArgument(format!(
                "restore_pool: an allocation window is open on device {} (a CUDA graph may be \
                 capturing): restore graph pool {id} after end_allocate_to_pool",
                self.core.dev
            )));
        }
        let arenas = self.pool_arenas(id, "restore_pool")?;
        let mut by_arena: FxHashMap<u64, Vec<&CheckpointBlock>> = FxHashMap::default();
        for b in &cp.blocks {
            if !arenas.contains_key(&b.arena) {
                return Err(Error::InvalidArgument(format!(
                    "restore_pool: the checkpoint's block at {:#x} was allocated on stream {} \
                     of graph pool {id}, which has no memory of that stream now: the \
                     checkpoint is not this pool's",
                    b.ptr, b.stream
                )));
            }
            by_arena.entry(b.arena).or_default().push(b);
        }
        // Before anything changes: every block's range must be mapped memory of its arena's
        // heap, which is free once the arena's blocks are (the pool's pages never move).
        for (key, blocks) in &by_arena {
            let a = arenas[key].state.lock();
            if let Some(b) = blocks
                .iter()
                .find(|b| !a.mapped_range(b.heap, b.ptr, b.size))
            {
                return Err(Error::InvalidArgument(format!(
                    "restore_pool: graph pool {id} has no memory of {} bytes at {:#x} for the \
                     checkpoint's block there: the checkpoint is not this pool's, or predates \
                     a release of its memory",
                    b.size, b.ptr
                )));
            }
        }
        let c = &*self.core;
        let mut delta = RestoreDelta::default();
        let mut keys: Vec<u64> = arenas.keys().copied().collect();
        keys.sort_unstable();
        for key in &keys {
            let arena = &arenas[key];
            let mut a = arena.state.lock();
            let mut live: Vec<u64> = a.live.keys().copied().collect();
            live.sort_unstable();
            for ptr in live {
                if let Some(r) = &c.recorder {
                    r.free(ptr);
                }
                if a.free(ptr, &arena.sref, c) == crate::arena::FreeOutcome::Pending {
                    c.counters.num_pending_frees.fetch_add(1, Relaxed);
                }
                delta.freed.push(ptr);
            }
            if !a.pending.is_empty() {
                a.process_pending(true, c);
            }
            let mut taken: Vec<CheckpointBlock> = Vec::new();
            for b in by_arena.get(key).into_iter().flatten() {
                let Some(span) = a.take_at(b.heap, b.ptr, b.size, b.requested, &c.shared) else {
                    for t in &taken {
                        a.free(t.ptr, &arena.sref, c);
                    }
                    return Err(Error::InvalidArgument(format!(
                        "restore_pool: the block at {:#x} of graph pool {id} still waits for \
                         other streams' work (the wait failed: see the log); the pool's blocks \
                         on stream {} are left free",
                        b.ptr, b.stream
                    )));
                };
                if b.meta.slot != 0 {
                    // It was in the ledger: back in it, with its provenance.
                    let o = crate::provenance::Origin {
                        tag: b.meta.tag,
                        site: b.meta.site,
                        thread: b.meta.thread,
                        time_ns: b.meta.time_ns,
                    };
                    a.record(b.heap, span, b.size, &o);
                }
                taken.push((*b).clone());
            }
            drop(a);
            for b in taken {
                self.handed_out(b.ptr, b.size, b.requested, b.stream);
                delta.allocated.push(b);
            }
        }
        delta.freed.sort_unstable();
        delta.allocated.sort_unstable_by_key(|b| b.ptr);
        Ok(delta)
    }

    /// The graph pools now alive, by id.
    pub fn graph_pools(&self) -> Vec<GraphPoolInfo> {
        let g = self.graphs.lock();
        let mut v: Vec<_> = g
            .pools
            .iter()
            .map(|(&id, p)| GraphPoolInfo {
                id,
                uses: p.uses,
                open: g.windows.iter().any(|w| w.pool == id),
                streams: p.arenas.len(),
            })
            .collect();
        v.sort_by_key(|p| p.id);
        v
    }

    /// The arena of graph pool that an open window routes an allocation on `stream` to, made
    /// on first use; `None` when no window accepts the stream. Only called while a window is
    /// open (one relaxed load on the hot path decides).
    #[cold]
    pub(super) fn graph_arena(&self, stream: StreamId) -> Result<Option<Arc<Arena<D>>>> {
        let pool = {
            // The filters run under the lock: none is called after its window has closed.
            let g = self.graphs.lock();
            let mut found = None;
            for w in &g.windows {
                let accepted = match &w.filter {
                    None => true,
                    Some(f) => f(stream).map_err(|why| {
                        Error::InvalidArgument(format!(
                            "the stream filter of the allocation window into graph pool {} \
                             failed for stream {stream}: {why}",
                            w.pool
                        ))
                    })?,
                };
                if accepted {
                    found = Some(w.pool);
                    break;
                }
            }
            found
        };
        let Some(pool) = pool else {
            return Ok(None);
        };
        let info = self.stream_here(stream)?;
        let mut g = self.graphs.lock();
        let Some(p) = g.pools.get_mut(&pool) else {
            // Released since the windows were read.
            return Ok(None);
        };
        let key = super::device::arena_key(&p.arenas, stream, &info);
        let arena = p.arenas.entry(key).or_insert_with(|| {
            Arc::new(Arena::for_pool(
                StreamRef::new(stream, info),
                self.core.clone(),
                Some((pool.0, pool.1)),
            ))
        });
        Ok(Some(arena.clone()))
    }
}
