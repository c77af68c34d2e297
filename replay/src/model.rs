//! The allocator-model seam: the [`AllocatorModel`] trait every replayed allocator implements,
//! the [`Oom`] it fails with, and the helpers models share ([`sim_driver`],
//! [`driver_call_counts`]). It names no model: the models live in their own modules
//! ([`crate::simple`], [`crate::pytorch`]) and [`crate::catalog`] lists them by name.
//!
//! Every model except `ideal` runs on its own [`SimDriver`] whose capacity is the simulated
//! device's memory, so a model runs out of memory exactly where the device would, and its
//! driver calls are counted by kind.

use std::collections::BTreeMap;

use cistern::driver::DeviceId;
use cistern::{SimConfig, SimDriver};

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
