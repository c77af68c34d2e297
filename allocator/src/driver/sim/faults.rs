//! What every driver call passes through on entry ([`SimDriver::enter`]: its counter, its
//! modelled host time and host wait, its simulated latency, an injected failure), and what tests
//! set and read around it: fault injection ([`SimDriver::fail_nth`], [`SimDriver::fail_from`],
//! [`SimDriver::fail_after_bytes`]), call counters, modelled time, host waits, and gauges of
//! each device's state.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::codes::CUDA_ERROR_UNKNOWN;
use super::{err, oom, DevState, SimDriver, NCALLS};
use crate::driver::{DeviceId, DriverCall, DriverErrorKind, DriverResult};

#[derive(Debug, Default)]
pub(super) struct Faults {
    /// Per call kind: countdowns of one-shot failures (fail when one reaches 0).
    nth: [Vec<u64>; NCALLS],
    /// Per call kind: countdown to the first of a run of failures (fail while it is 1).
    from: [Option<u64>; NCALLS],
}

impl SimDriver {
    /// Counts the call, adds its modelled time (one unit, no bytes), counts a host wait, spends
    /// its latency, and fails it if a fault is injected.
    pub(super) fn enter(&self, call: DriverCall) -> DriverResult<()> {
        self.enter_sized(call, 0)
    }

    /// [`SimDriver::enter`] for a call that names `bytes` bytes (priced per MiB). Failed calls
    /// are counted and priced too, as the counters count them.
    pub(super) fn enter_sized(&self, call: DriverCall, bytes: u64) -> DriverResult<()> {
        self.counters[call as usize].fetch_add(1, Ordering::Relaxed);
        self.charge(call, 1, bytes);
        if call.blocks_host() {
            self.host_waits.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(d) = self.config.latencies.as_ref().and_then(|l| l.get(call)) {
            let start = Instant::now();
            while start.elapsed() < d {
                std::hint::spin_loop();
            }
        }
        if self.injected(call) {
            return Err(match call {
                DriverCall::CreatePhysical | DriverCall::MemAlloc => {
                    oom(call, "injected fault (out of memory)")
                }
                _ => err(
                    call,
                    DriverErrorKind::Other,
                    CUDA_ERROR_UNKNOWN,
                    "injected fault",
                ),
            });
        }
        Ok(())
    }

    /// Adds the price of `units` units and `bytes` bytes of `call` to its modelled time
    /// (`set_access` calls it again for each mapping past the first).
    pub(super) fn charge(&self, call: DriverCall, units: u64, bytes: u64) {
        let us = self.config.costs.price(call, units, bytes);
        let ps = (us * 1e6).round();
        if ps > 0.0 {
            self.time_ps[call as usize].fetch_add(ps as u64, Ordering::Relaxed);
        }
    }

    fn injected(&self, call: DriverCall) -> bool {
        if !self.faults_armed.load(Ordering::Relaxed) {
            return false;
        }
        let mut f = self.faults.lock();
        let i = call as usize;
        let mut fail = false;
        f.nth[i].retain_mut(|r| {
            *r -= 1;
            if *r == 0 {
                fail = true;
                false
            } else {
                true
            }
        });
        if let Some(r) = f.from[i].as_mut() {
            if *r <= 1 {
                fail = true;
            } else {
                *r -= 1;
            }
        }
        if fail {
            self.faults_fired.fetch_add(1, Ordering::Relaxed);
        }
        fail
    }

    /// Applies `f` to a device's state, or returns `default` for an unknown device.
    fn with_state<T>(&self, dev: DeviceId, default: T, f: impl FnOnce(&DevState) -> T) -> T {
        match self.devices.get(dev) {
            Some(d) => f(&d.state.lock()),
            None => default,
        }
    }

    // --- fault injection ----------------------------------------------------------------------

    /// Makes the `n`-th next call of kind `call` fail once (`n = 1`: the very next; 0 counts as
    /// 1). Injected failures have no side effect: `create_physical` and `mem_alloc` fail with
    /// `OutOfMemory` (code 2), other calls with `Other` (code 999), message "injected fault".
    pub fn fail_nth(&self, call: DriverCall, n: u64) {
        self.faults.lock().nth[call as usize].push(n.max(1));
        self.faults_armed.store(true, Ordering::Relaxed);
    }

    /// Makes every call of kind `call` fail, from the `n`-th next one on (0 counts as 1), until
    /// [`SimDriver::clear_faults`].
    pub fn fail_from(&self, call: DriverCall, n: u64) {
        self.faults.lock().from[call as usize] = Some(n.max(1));
        self.faults_armed.store(true, Ordering::Relaxed);
    }

    /// Makes any `create_physical` or `mem_alloc` that would bring a device's committed bytes
    /// above `budget` fail with `OutOfMemory`.
    pub fn fail_after_bytes(&self, budget: u64) {
        self.byte_budget.store(budget, Ordering::Relaxed);
    }

    /// How many injected faults ([`SimDriver::fail_nth`], [`SimDriver::fail_from`]) have fired
    /// so far: a test can tell a driver error the pool passed on from one it made up.
    pub fn faults_fired(&self) -> u64 {
        self.faults_fired.load(Ordering::Relaxed)
    }

    /// Removes every injected fault and the byte budget.
    pub fn clear_faults(&self) {
        *self.faults.lock() = Faults::default();
        self.faults_armed.store(false, Ordering::Relaxed);
        self.byte_budget.store(u64::MAX, Ordering::Relaxed);
    }

    // --- counters and gauges ------------------------------------------------------------------

    /// How many calls of kind `call` were made (failed ones included).
    pub fn calls(&self, call: DriverCall) -> u64 {
        self.counters[call as usize].load(Ordering::Relaxed)
    }

    /// The nonzero call counters.
    pub fn call_counts(&self) -> BTreeMap<DriverCall, u64> {
        DriverCall::ALL
            .iter()
            .map(|&c| (c, self.calls(c)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Sets every call counter, the modelled time and the host waits to zero.
    pub fn reset_counters(&self) {
        for c in self.counters.iter().chain(&self.time_ps) {
            c.store(0, Ordering::Relaxed);
        }
        self.host_waits.store(0, Ordering::Relaxed);
    }

    /// The total of every call counter.
    pub fn total_calls(&self) -> u64 {
        self.counters
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// Modelled host time of the calls of kind `call` so far, in microseconds (from
    /// [`SimConfig::costs`](super::SimConfig::costs)).
    pub fn modelled_time_us_of(&self, call: DriverCall) -> f64 {
        self.time_ps[call as usize].load(Ordering::Relaxed) as f64 / 1e6
    }

    /// Modelled host time of every call so far, in microseconds: each call's price in the
    /// [`CostTable`](super::CostTable), never spent.
    pub fn modelled_time_us(&self) -> f64 {
        self.time_ps
            .iter()
            .map(|t| t.load(Ordering::Relaxed))
            .sum::<u64>() as f64
            / 1e6
    }

    /// The nonzero modelled times by call kind, in microseconds.
    pub fn modelled_time_by_kind(&self) -> BTreeMap<DriverCall, f64> {
        DriverCall::ALL
            .iter()
            .map(|&c| (c, self.modelled_time_us_of(c)))
            .filter(|&(_, t)| t > 0.0)
            .collect()
    }

    /// Calls so far that blocked the host on GPU work ([`DriverCall::blocks_host`]:
    /// `event_synchronize`, `device_synchronize`, `mem_free`), failed ones included.
    pub fn host_waits(&self) -> u64 {
        self.host_waits.load(Ordering::Relaxed)
    }

    /// Bytes committed on `dev`: live physical handles plus live linear allocations.
    pub fn committed_bytes(&self, dev: DeviceId) -> u64 {
        self.with_state(dev, 0, |s| s.committed)
    }

    /// The highest [`SimDriver::committed_bytes`] since creation or [`SimDriver::reset_peak`].
    pub fn peak_committed_bytes(&self, dev: DeviceId) -> u64 {
        self.with_state(dev, 0, |s| s.peak)
    }

    /// Resets the peak of committed bytes on `dev` to the current value.
    pub fn reset_peak(&self, dev: DeviceId) {
        if let Some(d) = self.devices.get(dev) {
            let mut st = d.state.lock();
            st.peak = st.committed;
        }
    }

    /// Live physical handles on `dev`.
    pub fn live_handles(&self, dev: DeviceId) -> usize {
        self.with_state(dev, 0, |s| s.handles.len())
    }

    /// Bytes mapped on `dev`.
    pub fn mapped_bytes(&self, dev: DeviceId) -> u64 {
        self.with_state(dev, 0, |s| s.mapped_bytes)
    }

    /// Bytes of virtual address space reserved on `dev`.
    pub fn reserved_va_bytes(&self, dev: DeviceId) -> u64 {
        self.with_state(dev, 0, |s| s.reserved_bytes)
    }

    /// Live linear allocations on `dev`.
    pub fn live_linear_allocations(&self, dev: DeviceId) -> usize {
        self.with_state(dev, 0, |s| s.linear.len())
    }

    /// Live (created, not destroyed) events on `dev`.
    pub fn live_events(&self, dev: DeviceId) -> usize {
        self.with_state(dev, 0, |s| s.events.len())
    }
}
