//! The allocator-model seam: the [`AllocatorModel`] trait every replayed allocator implements,
//! the simple models (`cistern`, `cistern-novmm`, `cudamalloc`, `ideal`), and the registry
//! ([`ALLOCATORS`], [`make`]) that the CLI and the benches pick models from by name.
//!
//! Every model except `ideal` runs on its own [`SimDriver`] whose capacity is the simulated
//! device's memory, so a model runs out of memory exactly where the device would, and its
//! driver calls are counted by kind.

use std::collections::BTreeMap;
use std::sync::Arc;

use cistern::driver::{DeviceId, Driver, StreamId};
use cistern::{Config, Pool, SimConfig, SimDriver};
use rustc_hash::FxHashMap;

use crate::pytorch::{PytorchConfig, PytorchModel};

const DEV: DeviceId = 0;

/// An allocation the model could not satisfy.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Oom {
    /// Bytes requested.
    pub requested: u64,
    /// Bytes the model had reserved when it failed.
    pub reserved: u64,
    /// The simulated device's capacity.
    pub capacity: u64,
    /// The model's own explanation.
    pub detail: String,
}

impl std::fmt::Display for Oom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "out of memory allocating {} B with {} B reserved of {} B: {}",
            self.requested, self.reserved, self.capacity, self.detail
        )
    }
}

/// An allocator that a sequence of allocations and frees can be replayed against.
pub trait AllocatorModel {
    /// The registry name (`cistern`, `pytorch`, ...).
    fn name(&self) -> &str;
    /// Allocates `size` requested bytes for allocation `id` on `stream`.
    fn alloc(&mut self, id: u64, size: u64, stream: u64) -> Result<(), Oom>;
    /// Frees allocation `id` (unknown ids, including failed allocations, are ignored).
    fn free(&mut self, id: u64);
    /// Bytes reserved from the device right now (segments, mapped pages).
    fn reserved(&self) -> u64;
    /// Bytes in live blocks as the allocator sized them (after rounding and unsplit
    /// remainders), when the model knows it; `None` otherwise.
    fn allocated(&self) -> Option<u64>;
    /// Driver calls made so far, by kind (`mem_alloc`, `map`, ...).
    fn driver_calls(&self) -> BTreeMap<String, u64>;
}

/// Every allocator [`make`] knows, in the order reports list them.
pub const ALLOCATORS: &[&str] = &[
    "cistern",
    "cistern-novmm",
    "pytorch",
    "pytorch-expandable",
    "cudamalloc",
    "ideal",
];

/// Name of the row built from a snapshot's own `segment_*` events (not a model; see
/// [`crate::recorded()`]).
pub const RECORDED: &str = "pytorch-recorded";

/// Builds the model `name` on a simulated device of `capacity` bytes.
///
/// The PyTorch models accept PyTorch's `max_split_size_mb` setting as a suffix, in
/// `PYTORCH_CUDA_ALLOC_CONF` syntax: `pytorch:max_split_size_mb:256`.
pub fn make(name: &str, capacity: u64) -> Result<Box<dyn AllocatorModel>, String> {
    if let Some((base, conf)) = name.split_once(':') {
        if base == "pytorch" || base == "pytorch-expandable" {
            let mb = conf
                .strip_prefix("max_split_size_mb:")
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&mb| mb > 20)
                .ok_or_else(|| {
                    format!(
                        "`{name}`: expected `{base}:max_split_size_mb:N` with N > 20 \
                         (PyTorch's own lower bound)"
                    )
                })?;
            return Ok(Box::new(PytorchModel::new(
                name,
                PytorchConfig {
                    max_split_size: mb << 20,
                    expandable_segments: base == "pytorch-expandable",
                },
                capacity,
            )));
        }
    }
    Ok(match name {
        "cistern" => Box::new(CisternModel::new(name, Config::default(), capacity)?),
        "cistern-novmm" => Box::new(CisternModel::new(
            name,
            Config {
                vmm: false,
                ..Config::default()
            },
            capacity,
        )?),
        "pytorch" => Box::new(PytorchModel::new(name, PytorchConfig::default(), capacity)),
        "pytorch-expandable" => Box::new(PytorchModel::new(
            name,
            PytorchConfig {
                expandable_segments: true,
                ..PytorchConfig::default()
            },
            capacity,
        )),
        "cudamalloc" => Box::new(CudaMallocModel::new(capacity)),
        "ideal" => Box::new(IdealModel::new(capacity)),
        RECORDED => {
            return Err(format!(
                "`{RECORDED}` is not a model: it is read from a snapshot's segment events \
                 (cistern_replay::recorded); models: {}",
                ALLOCATORS.join(", ")
            ))
        }
        other => {
            return Err(format!(
                "unknown allocator `{other}`; valid names: {} (and \
                 pytorch:max_split_size_mb:N)",
                ALLOCATORS.join(", ")
            ))
        }
    })
}

/// A simulated device of `capacity` bytes (2 MiB granularity, VMM supported).
pub fn sim_driver(capacity: u64) -> SimDriver {
    SimDriver::new(SimConfig::default().capacity(capacity))
}

/// The nonzero call counters of a simulator, keyed by [`cistern::driver::DriverCall::key`].
pub fn driver_call_counts(driver: &SimDriver) -> BTreeMap<String, u64> {
    driver
        .call_counts()
        .into_iter()
        .map(|(c, n)| (c.key().to_string(), n))
        .collect()
}

/// The real [`cistern::Pool`] on a [`SimDriver`].
pub struct CisternModel {
    name: String,
    pool: Pool<Arc<SimDriver>>,
    driver: Arc<SimDriver>,
    capacity: u64,
    /// id -> (pointer, stream, rounded size).
    live: FxHashMap<u64, (u64, u64, u64)>,
    allocated: u64,
}

impl CisternModel {
    /// A pool with `config` on a fresh simulated device of `capacity` bytes.
    pub fn new(name: &str, config: Config, capacity: u64) -> Result<Self, String> {
        let driver = Arc::new(sim_driver(capacity));
        let pool = Pool::new(driver.clone(), config).map_err(|e| format!("{name}: {e}"))?;
        Ok(CisternModel {
            name: name.to_string(),
            pool,
            driver,
            capacity,
            live: FxHashMap::default(),
            allocated: 0,
        })
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
}

impl Drop for CisternModel {
    fn drop(&mut self) {
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
    /// A model on a fresh simulated device of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        CudaMallocModel {
            driver: sim_driver(capacity),
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
