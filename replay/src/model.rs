//! The allocator-model seam: the [`AllocatorModel`] trait every replayed allocator implements,
//! the [`Oom`] it fails with, the [`Cost`] of its driver calls, and the helpers models share
//! ([`sim_driver`], [`driver_call_counts`], [`sim_cost`]). It names no model: the models live in their own modules
//! ([`crate::simple`], [`crate::pytorch`]) and [`crate::catalog`] lists them by name.
//!
//! Every model except `ideal` runs on its own [`SimDriver`] whose capacity is the simulated
//! device's memory, so a model runs out of memory exactly where the device would, and its
//! driver calls are counted by kind and priced by the [`CostTable`] it was made with.

use std::collections::BTreeMap;

use cistern::driver::DeviceId;
use cistern::{CostTable, SimConfig, SimDriver};

/// The device index every model's simulated device uses.
pub(crate) const DEV: DeviceId = 0;

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

/// Why a model could not start from a recorded state ([`AllocatorModel::seed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeedError {
    /// The model cannot start from a recorded state (the message says which can).
    Unsupported(String),
    /// The simulated device cannot hold the recorded state.
    Oom(Oom),
}

/// What a model's driver calls cost so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    /// Modelled host time of the driver calls, in microseconds (the [`CostTable`]'s prices;
    /// host waits add nothing unless the table gives them a figure).
    pub driver_time_us: f64,
    /// Calls that blocked the host on GPU work (event/stream/device synchronisation, and
    /// `cudaFree`'s implicit device synchronisation).
    pub host_waits: u64,
    /// Physical pages unmapped from one place and mapped again at another (cistern: its
    /// stitched pages, `num_stitched_pages`; the PyTorch models never move a page: 0).
    pub pages_moved: u64,
    /// Memory unmapped, released or handed out while simulated GPU work still used it (the
    /// simulator's hazard check; only with GPU work, `cistern@lag=N`): 0 unless the model has
    /// a bug.
    pub hazards: u64,
}

/// An allocator that a sequence of allocations and frees can be replayed against.
pub trait AllocatorModel {
    /// The catalog name (`cistern`, `pytorch`, ...).
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
    /// The sum of [`AllocatorModel::driver_calls`]; models override it with a cheaper count
    /// (the engine reads it at every new peak of reserved bytes).
    fn total_driver_calls(&self) -> u64 {
        self.driver_calls().values().sum()
    }
    /// What the driver calls so far cost (none by default: a model without a driver).
    fn cost(&self) -> Cost {
        Cost::default()
    }
    /// Starts the model, before its first operation, from the allocator state a snapshot's
    /// window opened on: its segments reserved, the blocks live then in place, for the
    /// sequence's initial allocations to bind to; returns how many of those could not be
    /// placed (they are then allocated the ordinary way). Only the PyTorch models can (the
    /// state is PyTorch's); the default refuses.
    fn seed(&mut self, _start: &cistern_trace::WindowStart) -> Result<usize, SeedError> {
        Err(SeedError::Unsupported(format!(
            "`{}` cannot start from a recorded allocator state: only the PyTorch models \
             (pytorch, pytorch-expandable, pytorch-as-recorded) can",
            self.name()
        )))
    }
}

/// A simulated device of `capacity` bytes (2 MiB granularity, VMM supported) pricing its calls
/// with `costs`.
pub fn sim_driver(capacity: u64, costs: &CostTable) -> SimDriver {
    SimDriver::new(SimConfig::default().capacity(capacity).costs(*costs))
}

/// A simulator's modelled driver time and host waits (no pages moved: the simulator cannot
/// know which calls move pages; a model adds its own count).
pub fn sim_cost(driver: &SimDriver) -> Cost {
    Cost {
        driver_time_us: driver.modelled_time_us(),
        host_waits: driver.host_waits(),
        pages_moved: 0,
        hazards: driver.hazards().len() as u64,
    }
}

/// The nonzero call counters of a simulator, keyed by [`cistern::driver::DriverCall::key`].
pub fn driver_call_counts(driver: &SimDriver) -> BTreeMap<String, u64> {
    driver
        .call_counts()
        .into_iter()
        .map(|(c, n)| (c.key().to_string(), n))
        .collect()
}
