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

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::DevicePool;
use crate::arena::{Arena, StreamRef};
use crate::driver::{Driver, StreamId};
use crate::error::{Error, Result};

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
            .filter_map(|id| g.pools[id].arenas.get(&info.id).cloned())
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
        let (arenas, closed) = {
            let mut g = self.graphs.lock();
            let Some(p) = g.pools.get_mut(&id) else {
                return Err(Error::InvalidArgument(format!(
                    "release_pool: device {} has no graph pool {id} (already released, or \
                     never opened with begin_allocate_to_pool)",
                    self.core.dev
                )));
            };
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
        // Their filters are released outside the lock.
        drop(closed);
        // The device lock orders this against a growth that holds one of these arenas.
        let _dev = self.state.lock();
        for (_, arena) in arenas {
            self.retire(arena);
        }
        Ok(())
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
        let arena = p.arenas.entry(info.id).or_insert_with(|| {
            Arc::new(Arena::for_pool(
                StreamRef::new(stream, info),
                self.core.clone(),
                Some((pool.0, pool.1)),
            ))
        });
        Ok(Some(arena.clone()))
    }
}
