//! The simple models: `cistern` and `cistern-novmm` (the real [`cistern::Pool`] on a simulated
//! device), `cudamalloc` (no caching) and `ideal` (the lower bound).

use std::collections::BTreeMap;
use std::sync::Arc;

use cistern::driver::{Driver, StreamId};
use cistern::{Config, CostTable, Pool, SimDriver};
use rustc_hash::FxHashMap;

use crate::model::{driver_call_counts, sim_cost, sim_driver, AllocatorModel, Cost, Oom, DEV};

/// The real [`cistern::Pool`] on a [`SimDriver`].
pub struct CisternModel {
    name: String,
    pool: Pool<Arc<SimDriver>>,
    driver: Arc<SimDriver>,
    capacity: u64,
    /// id -> (pointer, stream, rounded size).
    live: FxHashMap<u64, (u64, u64, u64)>,
    allocated: u64,
    /// How many kernels each stream's GPU work runs behind the host ([`Self::with_gpu_lag`]).
    gpu_lag: u32,
    /// Blocks handed out that a kernel could not use (not mapped with access): a pool bug,
    /// reported with the simulator's hazards.
    bad_launches: u64,
}

impl CisternModel {
    /// A pool with `config` on a fresh simulated device of `capacity` bytes pricing its calls
    /// with `costs`.
    pub fn new(
        name: &str,
        config: Config,
        capacity: u64,
        costs: &CostTable,
    ) -> Result<Self, String> {
        let driver = Arc::new(sim_driver(capacity, costs));
        let pool = Pool::new(driver.clone(), config).map_err(|e| format!("{name}: {e}"))?;
        Ok(CisternModel {
            name: name.to_string(),
            pool,
            driver,
            capacity,
            live: FxHashMap::default(),
            allocated: 0,
            gpu_lag: 0,
            bad_launches: 0,
        })
    }

    /// Replays on a GPU that runs behind the host: each allocation launches a kernel over its
    /// block on its stream, and a stream's kernels finish only once `lag` later ones have been
    /// launched there (or the pool waits for them). With 0 (the default) every kernel has
    /// finished before the next call, as if the GPU kept up with the host: no page is ever busy
    /// when the pool looks. A lag makes the pool meet busy pages: it must move them with the
    /// order kept on the device, leave them or wait for them (`stream_sync`), and the
    /// simulator's hazard check sees any page unmapped or
    /// handed out under pending work. The pool judges a stream by its last kernel, so on a
    /// trace with one stream any lag of 1 or more gives the same result: the stream is always
    /// busy; larger lags differ only where streams take turns.
    pub fn with_gpu_lag(mut self, lag: u32) -> Self {
        self.gpu_lag = lag;
        self
    }

    /// The simulator's hazards so far (pages unmapped, released or handed out while work
    /// still touched them): none, unless the pool has a bug.
    pub fn hazards(&self) -> Vec<cistern::driver::sim::Hazard> {
        self.driver.hazards()
    }

    /// Kernels not finished on `stream`.
    pub fn in_flight(&self, stream: u64) -> usize {
        self.driver.unfinished_on(DEV, StreamId(stream))
    }

    /// Launches the kernel of a new block and lets the stream's oldest kernels finish until at
    /// most `gpu_lag` are in flight (the simulator's count: a host wait finishes them early).
    fn run_behind(&mut self, ptr: u64, size: u64, stream: u64) {
        if self.gpu_lag == 0 || size == 0 {
            return;
        }
        let s = StreamId(stream);
        if self.driver.launch(DEV, s, &[(ptr, size)]).is_err() {
            // The pool handed out a block a kernel cannot use.
            self.bad_launches += 1;
            return;
        }
        while self.driver.unfinished_on(DEV, s) > self.gpu_lag as usize {
            if !self.driver.complete_next(DEV, s) {
                break;
            }
        }
    }

    /// The pool, e.g. for its statistics.
    pub fn pool(&self) -> &Pool<Arc<SimDriver>> {
        &self.pool
    }
}

impl AllocatorModel for CisternModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc(&mut self, id: u64, size: u64, stream: u64) -> Result<(), Oom> {
        match self.pool.alloc_raw(DEV, size, StreamId(stream)) {
            Ok(ptr) => {
                self.run_behind(ptr, size, stream);
                let rounded = if size == 0 {
                    0
                } else {
                    cistern::pool::round_size(size).unwrap_or(size)
                };
                self.allocated += rounded;
                self.live.insert(id, (ptr, stream, rounded));
                Ok(())
            }
            Err(e) => Err(Oom {
                requested: size,
                reserved: self.reserved(),
                capacity: self.capacity,
                detail: format!("cistern: {}", first_line(&e.to_string())),
            }),
        }
    }

    fn free(&mut self, id: u64) {
        if let Some((ptr, stream, rounded)) = self.live.remove(&id) {
            self.allocated -= rounded;
            // A pointer from alloc_raw, freed once: the pool accepts it. An error would be a
            // pool bug that the pool already counts in num_invalid_frees.
            let _ = self.pool.free_raw(ptr, StreamId(stream));
        }
    }

    fn reserved(&self) -> u64 {
        // The pool's reserved bytes are exactly the physical handles and linear allocations it
        // holds from the driver.
        self.driver.committed_bytes(DEV)
    }

    fn allocated(&self) -> Option<u64> {
        Some(self.allocated)
    }

    fn driver_calls(&self) -> BTreeMap<String, u64> {
        driver_call_counts(&self.driver)
    }

    fn total_driver_calls(&self) -> u64 {
        self.driver.total_calls()
    }

    /// Pages moved are the pool's stitched pages (`num_stitched_pages`: cached pages unmapped
    /// from one place and mapped into another window, cross-stream ones included).
    fn cost(&self) -> Cost {
        let stitched = self
            .pool
            .stats(DEV)
            .map_or(0, |s| s.get("num_stitched_pages").max(0) as u64);
        let sim = sim_cost(&self.driver);
        Cost {
            pages_moved: stitched,
            hazards: sim.hazards + self.bad_launches,
            ..sim
        }
    }
}

impl Drop for CisternModel {
    fn drop(&mut self) {
        // The GPU catches up first: the pool then tears down with no work pending.
        self.driver.complete_all(DEV);
        // A trace's blocks live at its end are never freed; free them here so that the pool
        // does not warn about leaked blocks when a replay ends.
        for (_, (ptr, stream, _)) in self.live.drain() {
            let _ = self.pool.free_raw(ptr, StreamId(stream));
        }
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

/// No caching: every allocation is a `cuMemAlloc`, every free a `cuMemFree`.
pub struct CudaMallocModel {
    driver: SimDriver,
    capacity: u64,
    live: FxHashMap<u64, (u64, u64)>,
    allocated: u64,
}

/// `cuMemAlloc` hands out 512-byte aligned ranges; a request occupies its size rounded to that.
pub const CUDAMALLOC_ALIGN: u64 = 512;

impl CudaMallocModel {
    /// A model on a fresh simulated device of `capacity` bytes pricing its calls with `costs`.
    /// Every free is a `cuMemFree`, which synchronises the device: a host wait.
    pub fn new(capacity: u64, costs: &CostTable) -> Self {
        CudaMallocModel {
            driver: sim_driver(capacity, costs),
            capacity,
            live: FxHashMap::default(),
            allocated: 0,
        }
    }
}

impl AllocatorModel for CudaMallocModel {
    fn name(&self) -> &str {
        "cudamalloc"
    }

    fn alloc(&mut self, id: u64, size: u64, _stream: u64) -> Result<(), Oom> {
        if size == 0 {
            self.live.insert(id, (0, 0));
            return Ok(());
        }
        let rounded = size.div_ceil(CUDAMALLOC_ALIGN) * CUDAMALLOC_ALIGN;
        match self.driver.mem_alloc(DEV, rounded) {
            Ok(ptr) => {
                self.live.insert(id, (ptr, rounded));
                self.allocated += rounded;
                Ok(())
            }
            Err(e) => Err(Oom {
                requested: size,
                reserved: self.reserved(),
                capacity: self.capacity,
                detail: format!("cudamalloc: {e}"),
            }),
        }
    }

    fn free(&mut self, id: u64) {
        if let Some((ptr, rounded)) = self.live.remove(&id) {
            if ptr != 0 {
                // A live base pointer from mem_alloc: the simulator accepts it.
                let _ = self.driver.mem_free(DEV, ptr);
                self.allocated -= rounded;
            }
        }
    }

    fn reserved(&self) -> u64 {
        self.driver.committed_bytes(DEV)
    }

    fn allocated(&self) -> Option<u64> {
        Some(self.allocated)
    }

    fn driver_calls(&self) -> BTreeMap<String, u64> {
        driver_call_counts(&self.driver)
    }

    fn total_driver_calls(&self) -> u64 {
        self.driver.total_calls()
    }

    fn cost(&self) -> Cost {
        sim_cost(&self.driver)
    }
}

/// The lower bound: reserved bytes equal the live requested bytes; no driver.
pub struct IdealModel {
    capacity: u64,
    live: FxHashMap<u64, u64>,
    bytes: u64,
}

impl IdealModel {
    /// A model that fails only when live bytes would exceed `capacity`.
    pub fn new(capacity: u64) -> Self {
        IdealModel {
            capacity,
            live: FxHashMap::default(),
            bytes: 0,
        }
    }
}

impl AllocatorModel for IdealModel {
    fn name(&self) -> &str {
        "ideal"
    }

    fn alloc(&mut self, id: u64, size: u64, _stream: u64) -> Result<(), Oom> {
        let after = self.bytes.saturating_add(size);
        if after > self.capacity {
            return Err(Oom {
                requested: size,
                reserved: self.bytes,
                capacity: self.capacity,
                detail: "ideal: live bytes exceed the capacity".to_string(),
            });
        }
        self.bytes = after;
        self.live.insert(id, size);
        Ok(())
    }

    fn free(&mut self, id: u64) {
        if let Some(s) = self.live.remove(&id) {
            self.bytes -= s;
        }
    }

    fn reserved(&self) -> u64 {
        self.bytes
    }

    fn allocated(&self) -> Option<u64> {
        Some(self.bytes)
    }

    fn driver_calls(&self) -> BTreeMap<String, u64> {
        BTreeMap::new()
    }
}
