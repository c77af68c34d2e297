//! The simulated GPU: [`SimDriver`], a [`Driver`] with no hardware behind it.
//!
//! This module owns the simulator's whole state: per device, the virtual address space
//! (reservations and their free list), physical handles, mappings and access rights, linear
//! allocations, events, and the **work model** (synthetic kernels queued on streams); and, for the
//! whole simulator, call counters, modelled host time and host waits, fault injection, optional
//! latencies and the hazard log. It is
//! used by tests, benches and `cistern replay`, and a later fake `libcuda.so` wraps it, so its
//! semantics and error codes follow the real CUDA driver closely.
//!
//! Its `mod.rs` holds the model's state ([`SimDriver`] and each device's state) and the checks
//! every call starts with; around it: `config` (how a simulator is set up), `cost` (the price of
//! each call in modelled host time), `memory` (address
//! space, physical handles, mappings, linear allocations, host backing), `work` (streams, work,
//! completion, events' ordering, hazards), `faults` (call entry, fault injection, counters and
//! gauges), `capture` (stream capture: the calls it forbids, graphs that replay), `driver` (the
//! [`Driver`] calls themselves) and `tests`.
//!
//! # Model
//!
//! * Each device has its own disjoint address regions: VMM reservations come from
//!   `0x7000_0000_0000 + dev * 2^45` (16 TiB, room for dozens of streams' reservations of an
//!   80 GiB device), linear allocations from the next 16 TiB. Freed ranges
//!   are reused (first fit). `0` is never handed out.
//! * Physical handles and linear allocations count against the device's capacity (minus the
//!   memory of simulated other processes). Nothing is backed by host memory unless
//!   [`SimConfig::backing`] is set; then host storage is allocated lazily, 64 KiB at a time, and
//!   belongs to the physical handle (or linear allocation), so data follows a page that is
//!   unmapped and mapped elsewhere.
//! * **Work**: [`SimDriver::launch`] queues one unit of work on a stream, touching address ranges.
//!   Each range is translated at launch time into *physical pieces* (handle + offset, or linear
//!   allocation + offset). Work stays unfinished until a test completes it
//!   ([`SimDriver::complete_next`], [`SimDriver::complete_stream`], [`SimDriver::complete_all`])
//!   or a synchronising call (`event_synchronize`, `mem_free`, `device_synchronize`) does.
//!   Streams are FIFO. `stream_wait_event` makes later work on a stream depend on the event's
//!   captured work: completing that later work completes the dependency first.
//! * **Hazards**: [`Driver::note_handout`] records a [`Hazard`] when unfinished work on another
//!   stream touches the same physical memory and the handout stream has not waited for it (an
//!   ordering established through `stream_wait_event`, transitively through pending work). An
//!   `unmap` of an address range that unfinished work was launched over (and whose memory it
//!   touches) is a hazard, and so is a `release_physical` of memory that unfinished work
//!   touches. One handle may be mapped at several addresses (a real driver allows it): work
//!   launched over one of them is not disturbed by unmapping another.
//!   When a device has no unfinished work, `note_handout` costs one relaxed atomic load.
//! * Stream `0` is treated as an ordinary stream: the legacy default stream's implicit
//!   synchronisation with other streams is not simulated.
//!
//! * **Modelled host time**: every call adds its price from [`SimConfig::costs`] (a
//!   [`CostTable`]) to a per-kind total ([`SimDriver::modelled_time_us`]); nothing is spent.
//!   Calls that block the host on GPU work (`event_synchronize`, `device_synchronize`,
//!   `mem_free`) are also counted as *host waits* ([`SimDriver::host_waits`]), whose duration
//!   (GPU idle time) the simulator cannot know.
//!
//! Operations that exist only in the simulator (`launch`, `read`, `write`) are not driver calls:
//! they are not counted, delayed or subject to fault injection. Their errors name the closest
//! call kind: [`DriverCall::StreamWaitEvent`] for `launch`, [`DriverCall::SetAccess`] for `read`
//! and `write`.
//!
//! [`Driver`]: super::Driver
//! [`Driver::note_handout`]: super::Driver::note_handout

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{DeviceId, DriverCall, DriverError, DriverErrorKind, DriverResult, StreamId};

mod capture;
mod config;
pub mod cost;
mod driver;
mod faults;
mod memory;
mod share;
mod work;

pub use capture::{CaptureViolation, SimGraph, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED};
pub use config::{SimConfig, SimLatencies, MAX_CAPACITY, MAX_DEVICES, MAX_PAGES, MIN_GRANULARITY};
pub use cost::{CallCost, CostTable};
pub use work::{Hazard, HazardKind, WorkId};

use faults::Faults;
use memory::{
    IntervalSet, LinearAlloc, Mapping, PhysAlloc, DEVICE_STRIDE, REGION_BASE, REGION_SPAN,
};
use work::{Pos, StreamState};

/// The `CUresult` codes the simulator reports.
pub mod codes {
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
    /// `CUDA_ERROR_INVALID_DEVICE`.
    pub const CUDA_ERROR_INVALID_DEVICE: i32 = 101;
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const CUDA_ERROR_INVALID_HANDLE: i32 = 400;
    /// `CUDA_ERROR_NOT_READY` (an event query that is not complete; the trait reports it as
    /// `Ok(false)`).
    pub const CUDA_ERROR_NOT_READY: i32 = 600;
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;
    /// `CUDA_ERROR_UNKNOWN`, used for injected faults on calls that cannot run out of memory.
    pub const CUDA_ERROR_UNKNOWN: i32 = 999;
}

use codes::*;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// How many [`DriverCall`] kinds exist.
const NCALLS: usize = DriverCall::ALL.len();

// ---------------------------------------------------------------------------------------------
// Internal state
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct DevState {
    va_free: IntervalSet,
    /// Reservation start -> size.
    reservations: BTreeMap<u64, u64>,
    reserved_bytes: u64,
    handles: FxHashMap<u64, PhysAlloc>,
    /// Mapping start -> mapping.
    mappings: BTreeMap<u64, Mapping>,
    mapped_bytes: u64,
    /// Address ranges with access granted.
    access: IntervalSet,
    /// Peer device -> address ranges of this device's memory it was granted access to.
    peer_access: FxHashMap<DeviceId, IntervalSet>,
    linear_free: IntervalSet,
    /// Linear allocation base -> allocation.
    linear: BTreeMap<u64, LinearAlloc>,
    /// Linear allocation id -> base.
    linear_ids: FxHashMap<u64, u64>,
    committed: u64,
    peak: u64,
    /// Event id -> captured positions (empty: complete).
    events: FxHashMap<u64, Vec<Pos>>,
    streams: FxHashMap<u64, StreamState>,
    next_work: u64,
}

impl DevState {
    fn new(dev: DeviceId) -> Self {
        let base = REGION_BASE.saturating_add((dev as u64).saturating_mul(DEVICE_STRIDE));
        let linear = base.saturating_add(REGION_SPAN);
        DevState {
            va_free: IntervalSet::with(base, linear),
            reservations: BTreeMap::new(),
            reserved_bytes: 0,
            handles: FxHashMap::default(),
            mappings: BTreeMap::new(),
            mapped_bytes: 0,
            access: IntervalSet::default(),
            peer_access: FxHashMap::default(),
            linear_free: IntervalSet::with(linear, linear.saturating_add(REGION_SPAN)),
            linear: BTreeMap::new(),
            linear_ids: FxHashMap::default(),
            committed: 0,
            peak: 0,
            events: FxHashMap::default(),
            streams: FxHashMap::default(),
            next_work: 1,
        }
    }
}

struct Device {
    /// Unfinished work items on this device; read with one relaxed load by `note_handout`.
    unfinished: AtomicUsize,
    state: Mutex<DevState>,
}

// ---------------------------------------------------------------------------------------------
// The simulator
// ---------------------------------------------------------------------------------------------

/// A simulated GPU implementing [`Driver`](super::Driver): see the [module documentation](self).
///
/// `SimDriver` is `Send + Sync`; share it with `Arc` (the trait is implemented for `Arc<D>`).
pub struct SimDriver {
    config: SimConfig,
    devices: Vec<Device>,
    counters: [AtomicU64; NCALLS],
    /// Modelled host time per call kind, in picoseconds.
    time_ps: [AtomicU64; NCALLS],
    /// Calls that blocked the host on GPU work.
    host_waits: AtomicU64,
    other_process_bytes: AtomicU64,
    /// Injected per-device budget of committed bytes (`u64::MAX`: none).
    byte_budget: AtomicU64,
    faults_armed: AtomicBool,
    /// How many injected faults have fired ([`SimDriver::faults_fired`]).
    faults_fired: AtomicU64,
    faults: Mutex<Faults>,
    hazards: Mutex<Vec<Hazard>>,
    /// Source of handle, event and linear allocation ids (never 0).
    next_id: AtomicU64,
    /// This simulator among the process's (`share.rs`: descriptors name the simulator that
    /// exported them).
    uid: u64,
    /// Handles whose stream was destroyed and given to a new stream ([`SimDriver::recreate_stream`]):
    /// how many times.
    stream_generations: Mutex<FxHashMap<u64, u64>>,
    /// Stream captures underway and the calls they refused (`capture.rs`).
    captures: Mutex<capture::Captures>,
    /// How many captures are underway: one relaxed load decides that none is.
    captures_active: AtomicUsize,
}

impl fmt::Debug for SimDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDriver")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Default for SimDriver {
    fn default() -> Self {
        SimDriver::new(SimConfig::default())
    }
}

fn err(call: DriverCall, kind: DriverErrorKind, code: i32, msg: impl Into<String>) -> DriverError {
    DriverError::new(call, kind, code, msg)
}

fn invalid(call: DriverCall, msg: impl Into<String>) -> DriverError {
    err(
        call,
        DriverErrorKind::InvalidValue,
        CUDA_ERROR_INVALID_VALUE,
        msg,
    )
}

fn invalid_handle(call: DriverCall, msg: impl Into<String>) -> DriverError {
    err(
        call,
        DriverErrorKind::InvalidValue,
        CUDA_ERROR_INVALID_HANDLE,
        msg,
    )
}

fn oom(call: DriverCall, msg: impl Into<String>) -> DriverError {
    err(
        call,
        DriverErrorKind::OutOfMemory,
        CUDA_ERROR_OUT_OF_MEMORY,
        msg,
    )
}

impl SimDriver {
    /// A simulator with the given configuration. A granularity of 0 means the default's, and one
    /// that is not a power of two is rounded up to the next one.
    ///
    /// # Panics
    ///
    /// When the configuration would make the simulator, or a pool on it, allocate without
    /// bound: no device or more than [`MAX_DEVICES`], or a granularity under
    /// [`MIN_GRANULARITY`] (a pool's page tables would take gigabytes). [`SimDriver::try_new`]
    /// returns that as an error instead and checks the capacity too ([`SimConfig::check`]):
    /// configurations from people (files, flags, environment) should go through it, as
    /// `CISTERN_SIM` does.
    pub fn new(config: SimConfig) -> SimDriver {
        let config = Self::normalised(config);
        if let Err(e) = Self::bounded(&config) {
            panic!("SimDriver::new: {e} (SimDriver::try_new returns this as an error)");
        }
        Self::build(config)
    }

    /// [`SimDriver::new`], with every bound of [`SimConfig::check`] an error naming the fix.
    pub fn try_new(config: SimConfig) -> Result<SimDriver, String> {
        let config = Self::normalised(config);
        config.check()?;
        Ok(Self::build(config))
    }

    fn normalised(mut config: SimConfig) -> SimConfig {
        if config.granularity == 0 {
            config.granularity = SimConfig::default().granularity;
        }
        config.granularity = config.granularity.checked_next_power_of_two().unwrap_or(0);
        config
    }

    /// The bounds [`SimDriver::new`] enforces: those that keep memory bounded whatever the
    /// capacity (replays size devices from traces, up to [`MAX_CAPACITY`] and beyond).
    fn bounded(config: &SimConfig) -> Result<(), String> {
        if config.devices == 0 || config.devices > MAX_DEVICES {
            return Err(format!(
                "devices:{} is out of range: use 1 to {MAX_DEVICES}",
                config.devices
            ));
        }
        if config.granularity < MIN_GRANULARITY {
            return Err(format!(
                "granularity:{} must be a power of two of at least {MIN_GRANULARITY} bytes",
                config.granularity
            ));
        }
        Ok(())
    }

    fn build(config: SimConfig) -> SimDriver {
        let devices = (0..config.devices)
            .map(|d| Device {
                unfinished: AtomicUsize::new(0),
                state: Mutex::new(DevState::new(d)),
            })
            .collect();
        SimDriver {
            other_process_bytes: AtomicU64::new(config.other_process_bytes),
            config,
            devices,
            counters: std::array::from_fn(|_| AtomicU64::new(0)),
            time_ps: std::array::from_fn(|_| AtomicU64::new(0)),
            host_waits: AtomicU64::new(0),
            byte_budget: AtomicU64::new(u64::MAX),
            faults_armed: AtomicBool::new(false),
            faults_fired: AtomicU64::new(0),
            faults: Mutex::new(Faults::default()),
            hazards: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            uid: share::next_uid(),
            stream_generations: Mutex::new(FxHashMap::default()),
            captures: Mutex::new(capture::Captures::default()),
            captures_active: AtomicUsize::new(0),
        }
    }

    /// Says that `stream`'s stream was destroyed and its handle now names a new stream, as the
    /// real driver may hand a freed `CUstream` to the next `cuStreamCreate`: from now on
    /// [`Driver::stream_info`](super::Driver::stream_info) gives the handle another id. (Work already queued on the handle
    /// stays on it: the simulator's streams are its handles.)
    pub fn recreate_stream(&self, stream: StreamId) {
        *self.stream_generations.lock().entry(stream.0).or_default() += 1;
    }

    /// The configuration in effect (granularity normalised).
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Changes the bytes used on each device by simulated other processes.
    pub fn set_other_process_bytes(&self, bytes: u64) {
        self.other_process_bytes.store(bytes, Ordering::Relaxed);
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn device(&self, call: DriverCall, dev: DeviceId) -> DriverResult<&Device> {
        self.devices.get(dev).ok_or_else(|| {
            err(
                call,
                DriverErrorKind::InvalidDevice,
                CUDA_ERROR_INVALID_DEVICE,
                format!(
                    "device {dev} does not exist ({} devices)",
                    self.devices.len()
                ),
            )
        })
    }

    /// `enter` + `device` + the VMM check.
    fn vmm_device(&self, call: DriverCall, dev: DeviceId) -> DriverResult<&Device> {
        self.vmm_device_sized(call, dev, 0)
    }

    /// [`SimDriver::vmm_device`] for a call naming `bytes` bytes (priced per MiB).
    fn vmm_device_sized(
        &self,
        call: DriverCall,
        dev: DeviceId,
        bytes: u64,
    ) -> DriverResult<&Device> {
        self.enter_sized(call, bytes)?;
        let d = self.device(call, dev)?;
        if !self.config.vmm {
            return Err(err(
                call,
                DriverErrorKind::NotSupported,
                CUDA_ERROR_NOT_SUPPORTED,
                "virtual memory management is disabled on this simulated device",
            ));
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests;
