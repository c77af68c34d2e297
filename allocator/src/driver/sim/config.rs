//! How a simulator is set up: [`SimConfig`] (devices, capacity, granularity, VMM, host backing,
//! memory of simulated other processes, the [`CostTable`] of modelled host time), the bounds a
//! configuration from text must keep ([`SimConfig::check`]) and [`SimLatencies`] (a busy-wait
//! per driver call kind).

use std::time::Duration;

use super::cost::CostTable;
use super::{GIB, MIB, NCALLS};
use crate::driver::DriverCall;

/// Simulated latencies: an optional duration per [`DriverCall`] kind, spent busy-waiting inside
/// the call (after it is counted, before it does anything).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimLatencies {
    /// The latency of each call kind, indexed by `DriverCall as usize`.
    pub per_call: [Option<Duration>; NCALLS],
}

impl SimLatencies {
    /// No latency for any call.
    pub fn none() -> Self {
        Self::default()
    }

    /// The latencies of a real GPU driver: the figures of the default [`CostTable`] (published
    /// A100 figures: `cuMemCreate` 195 µs, `cuMemSetAccess` 36 µs, `cuMemUnmap` 26 µs, ...; and
    /// its documented estimates), spent as real busy-waits, one per call (`set_access` waits
    /// its per-mapping figure once per call). For tests and benches that want latencies.
    pub fn realistic() -> Self {
        Self::from_costs(&CostTable::default())
    }

    /// One busy-wait per call of each kind, of its `per_call_us` figure in `costs`.
    pub fn from_costs(costs: &CostTable) -> Self {
        let mut l = Self::default();
        for call in DriverCall::ALL {
            let ns = (costs.get(call).per_call_us * 1000.0).round() as u64;
            l.per_call[call as usize] = Some(Duration::from_nanos(ns));
        }
        l
    }

    /// Sets the latency of one call kind (builder style).
    pub fn with(mut self, call: DriverCall, latency: Duration) -> Self {
        self.per_call[call as usize] = Some(latency);
        self
    }

    /// The latency of one call kind, if any.
    pub fn get(&self, call: DriverCall) -> Option<Duration> {
        self.per_call[call as usize]
    }
}

/// The most devices a checked configuration may have ([`SimConfig::check`]).
pub const MAX_DEVICES: usize = 64;
/// The smallest granularity a checked configuration may have: 64 KiB.
pub const MIN_GRANULARITY: u64 = 64 * 1024;
/// The largest capacity per device a checked configuration may have: 16 TiB, the span of a
/// device's VMM address region.
pub const MAX_CAPACITY: u64 = super::memory::REGION_SPAN;
/// The most granules (capacity / granularity) per device a checked configuration may have:
/// 2^23, e.g. 16 TiB of 2 MiB pages. A pool keeps a page table entry per granule it reserves.
pub const MAX_PAGES: u64 = 1 << 23;

/// How a [`SimDriver`](super::SimDriver) is set up. Build it with `SimConfig::default()` and
/// the setters.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Number of devices (default 1).
    pub devices: usize,
    /// Memory per device in bytes (default 80 GiB).
    pub capacity: u64,
    /// Allocation granularity in bytes (default 2 MiB). A power of two;
    /// [`SimDriver::new`](super::SimDriver::new) rounds other values up to one (and uses the
    /// default for 0).
    pub granularity: u64,
    /// Whether the VMM calls are supported (default true).
    pub vmm: bool,
    /// Whether memory is backed by host storage, so [`SimDriver::read`](super::SimDriver::read)
    /// and [`SimDriver::write`](super::SimDriver::write) work (default false).
    pub backing: bool,
    /// Simulated call latencies (default none).
    pub latencies: Option<SimLatencies>,
    /// Bytes used on each device by simulated other processes (default 0): subtracted from
    /// `mem_info`'s free memory and from what can be committed.
    pub other_process_bytes: u64,
    /// Whether every pair of devices can access each other's memory (default true, as on an
    /// NVLink machine): what [`Driver::can_access_peer`](crate::driver::Driver::can_access_peer)
    /// answers, and whether `set_access` accepts peers.
    pub peers: bool,
    /// The price of each call kind in modelled host time (default: the published figures,
    /// [`CostTable::default`]). Modelled time is accounted, never spent; see
    /// [`SimDriver::modelled_time_us`](super::SimDriver::modelled_time_us).
    pub costs: CostTable,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity: 80 * GIB,
            granularity: 2 * MIB,
            vmm: true,
            backing: false,
            latencies: None,
            other_process_bytes: 0,
            peers: true,
            costs: CostTable::default(),
        }
    }
}

impl SimConfig {
    /// Checks the bounds a configuration from text (`CISTERN_SIM`) must keep, so that a typo
    /// cannot make [`SimDriver::new`](super::SimDriver::new) allocate without bound (a vector of
    /// 4 billion devices aborts the process; a 512 B granularity makes a pool's page tables
    /// gigabytes): 1 to [`MAX_DEVICES`] devices; a granularity that is a power of two of at
    /// least [`MIN_GRANULARITY`]; a capacity of at least one granule and at most
    /// [`MAX_CAPACITY`], of at most [`MAX_PAGES`] granules. The error says which and how to fix it.
    pub fn check(&self) -> Result<(), String> {
        if self.devices == 0 || self.devices > MAX_DEVICES {
            return Err(format!(
                "devices:{} is out of range: use 1 to {MAX_DEVICES}",
                self.devices
            ));
        }
        let g = self.granularity;
        if !g.is_power_of_two() || g < MIN_GRANULARITY {
            return Err(format!(
                "granularity:{g} must be a power of two of at least {MIN_GRANULARITY} bytes \
                 (64KiB), e.g. 2MiB"
            ));
        }
        let c = self.capacity;
        if c < g || c > MAX_CAPACITY {
            return Err(format!(
                "capacity:{c} is out of range: use at least the granularity ({g} bytes) and at \
                 most {MAX_CAPACITY} bytes (16TiB)"
            ));
        }
        if c / g > MAX_PAGES {
            return Err(format!(
                "capacity:{c} is {} pages of granularity:{g}, more than {MAX_PAGES}: use a \
                 larger granularity (at least {} bytes) or a smaller capacity",
                c / g,
                c.div_ceil(MAX_PAGES).next_power_of_two()
            ));
        }
        Ok(())
    }

    /// Sets the number of devices.
    pub fn devices(mut self, devices: usize) -> Self {
        self.devices = devices;
        self
    }
    /// Sets the memory per device in bytes.
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = bytes;
        self
    }
    /// Sets the allocation granularity in bytes.
    pub fn granularity(mut self, bytes: u64) -> Self {
        self.granularity = bytes;
        self
    }
    /// Enables or disables the VMM calls.
    pub fn vmm(mut self, vmm: bool) -> Self {
        self.vmm = vmm;
        self
    }
    /// Enables or disables host backing.
    pub fn backing(mut self, backing: bool) -> Self {
        self.backing = backing;
        self
    }
    /// Sets simulated call latencies.
    pub fn latencies(mut self, latencies: SimLatencies) -> Self {
        self.latencies = Some(latencies);
        self
    }
    /// Sets the bytes used on each device by simulated other processes.
    pub fn other_process_bytes(mut self, bytes: u64) -> Self {
        self.other_process_bytes = bytes;
        self
    }
    /// Sets whether devices can access each other's memory.
    pub fn peers(mut self, peers: bool) -> Self {
        self.peers = peers;
        self
    }
    /// Sets the cost table of modelled host time.
    pub fn costs(mut self, costs: CostTable) -> Self {
        self.costs = costs;
        self
    }
}
