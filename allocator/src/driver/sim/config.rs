//! How a simulator is set up: [`SimConfig`] (devices, capacity, granularity, VMM, host backing,
//! memory of simulated other processes) and [`SimLatencies`] (a busy-wait per driver call kind).

use std::time::Duration;

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

    /// Rough latencies of a real GPU driver: `cuMemCreate` ~20 µs, `cuMemMap` ~10 µs,
    /// `cuMemUnmap` ~20 µs, `cuMemSetAccess` ~10 µs, `cuMemAlloc`/`cuMemFree` ~100 µs, event
    /// record ~2 µs, event query ~1 µs, and similar guesses for the rest.
    pub fn realistic() -> Self {
        let us = Duration::from_micros;
        let mut l = Self::default();
        for (call, d) in [
            (DriverCall::DeviceCount, us(1)),
            (DriverCall::Capabilities, us(1)),
            (DriverCall::MemInfo, us(5)),
            (DriverCall::ReserveVa, us(5)),
            (DriverCall::FreeVa, us(5)),
            (DriverCall::CreatePhysical, us(20)),
            (DriverCall::ReleasePhysical, us(20)),
            (DriverCall::Map, us(10)),
            (DriverCall::Unmap, us(20)),
            (DriverCall::SetAccess, us(10)),
            (DriverCall::MemAlloc, us(100)),
            (DriverCall::MemFree, us(100)),
            (DriverCall::EventCreate, us(2)),
            (DriverCall::EventRecord, us(2)),
            (DriverCall::EventQuery, us(1)),
            (DriverCall::EventSynchronize, us(5)),
            (DriverCall::EventDestroy, us(2)),
            (DriverCall::StreamWaitEvent, us(2)),
            (DriverCall::DeviceSynchronize, us(10)),
        ] {
            l.per_call[call as usize] = Some(d);
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

/// How a [`SimDriver`](super::SimDriver) is set up. Build it with `SimConfig::default()` and
/// the setters.
#[derive(Clone, Debug, PartialEq, Eq)]
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
        }
    }
}

impl SimConfig {
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
}
