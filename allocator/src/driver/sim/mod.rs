//! The simulated GPU: [`SimDriver`], a [`Driver`] with no hardware behind it.
//!
//! This module owns the simulator's whole state: per device, the virtual address space
//! (reservations and their free list), physical handles, mappings and access rights, linear
//! allocations, events, and the **work model** (synthetic kernels queued on streams); and, for the
//! whole simulator, call counters, fault injection, optional latencies and the hazard log. It is
//! used by tests, benches and `cistern replay`, and a later fake `libcuda.so` wraps it, so its
//! semantics and error codes follow the real CUDA driver closely.
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
//!   ordering established through `stream_wait_event`, transitively through pending work). `unmap`
//!   and `release_physical` of physical memory that unfinished work touches are hazards too.
//!   When a device has no unfinished work, `note_handout` costs one relaxed atomic load.
//! * Stream `0` is treated as an ordinary stream: the legacy default stream's implicit
//!   synchronisation with other streams is not simulated.
//!
//! Operations that exist only in the simulator (`launch`, `read`, `write`) are not driver calls:
//! they are not counted, delayed or subject to fault injection. Their errors name the closest
//! call kind: [`DriverCall::StreamWaitEvent`] for `launch`, [`DriverCall::SetAccess`] for `read`
//! and `write`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{
    DeviceCaps, DeviceId, Driver, DriverCall, DriverError, DriverErrorKind, DriverResult, EventId,
    MemInfo, PhysHandle, StreamId,
};

mod config;
mod faults;
mod memory;
mod work;

pub use config::{SimConfig, SimLatencies};
pub use work::{Hazard, HazardKind, WorkId};

use faults::Faults;
use memory::{
    round_up, IntervalSet, LinearAlloc, Mapping, MemKey, PhysAlloc, Piece, Store, DEVICE_STRIDE,
    LINEAR_ALIGN, REGION_BASE, REGION_SPAN,
};
use work::{merge_pos, Pos, StreamState};

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

/// A simulated GPU implementing [`Driver`]: see the [module documentation](self).
///
/// `SimDriver` is `Send + Sync`; share it with `Arc` (the trait is implemented for `Arc<D>`).
pub struct SimDriver {
    config: SimConfig,
    devices: Vec<Device>,
    counters: [AtomicU64; NCALLS],
    other_process_bytes: AtomicU64,
    /// Injected per-device budget of committed bytes (`u64::MAX`: none).
    byte_budget: AtomicU64,
    faults_armed: AtomicBool,
    faults: Mutex<Faults>,
    hazards: Mutex<Vec<Hazard>>,
    /// Source of handle, event and linear allocation ids (never 0).
    next_id: AtomicU64,
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
    /// A simulator with the given configuration.
    pub fn new(mut config: SimConfig) -> SimDriver {
        if config.granularity == 0 {
            config.granularity = SimConfig::default().granularity;
        }
        config.granularity = config.granularity.next_power_of_two();
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
            byte_budget: AtomicU64::new(u64::MAX),
            faults_armed: AtomicBool::new(false),
            faults: Mutex::new(Faults::default()),
            hazards: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
        }
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
        self.enter(call)?;
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

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> DriverResult<usize> {
        self.enter(DriverCall::DeviceCount)?;
        Ok(self.devices.len())
    }

    fn capabilities(&self, dev: DeviceId) -> DriverResult<DeviceCaps> {
        let call = DriverCall::Capabilities;
        self.enter(call)?;
        self.device(call, dev)?;
        Ok(DeviceCaps {
            total_memory: self.config.capacity,
            vmm: self.config.vmm,
            granularity: self.config.granularity,
            name: "cistern-sim".to_string(),
            uuid: Some(format!("GPU-5157a1d0-0000-4000-8000-{dev:012x}")),
        })
    }

    fn mem_info(&self, dev: DeviceId) -> DriverResult<MemInfo> {
        let call = DriverCall::MemInfo;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let committed = d.state.lock().committed;
        let total = self.config.capacity;
        let free = total
            .saturating_sub(self.other_process_bytes.load(Ordering::Relaxed))
            .saturating_sub(committed);
        Ok(MemInfo { free, total })
    }

    fn reserve_va(&self, dev: DeviceId, size: u64, align: u64) -> DriverResult<u64> {
        let call = DriverCall::ReserveVa;
        let d = self.vmm_device(call, dev)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        self.granularity_check(call, "size", size)?;
        self.granularity_check(call, "alignment", align)?;
        let align = align.max(self.config.granularity);
        let mut st = d.state.lock();
        let addr = st.va_free.alloc(size, align).ok_or_else(|| {
            oom(
                call,
                format!("no free virtual range of {size:#x} bytes aligned to {align:#x}"),
            )
        })?;
        st.reservations.insert(addr, size);
        st.reserved_bytes += size;
        Ok(addr)
    }

    fn free_va(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        let call = DriverCall::FreeVa;
        let d = self.vmm_device(call, dev)?;
        let mut st = d.state.lock();
        match st.reservations.get(&addr) {
            Some(&s) if s == size => {}
            Some(&s) => {
                return Err(invalid(
                    call,
                    format!("reservation at {addr:#x} has size {s:#x}, not {size:#x}"),
                ))
            }
            None => return Err(invalid(call, format!("no reservation starts at {addr:#x}"))),
        }
        if let Some((&m, _)) = st.mappings.range(addr..addr + size).next() {
            return Err(invalid(
                call,
                format!("reservation at {addr:#x} still has a mapping at {m:#x}"),
            ));
        }
        st.reservations.remove(&addr);
        st.reserved_bytes -= size;
        st.va_free.insert(addr, addr + size);
        Ok(())
    }

    fn create_physical(&self, dev: DeviceId, size: u64) -> DriverResult<PhysHandle> {
        let call = DriverCall::CreatePhysical;
        let d = self.vmm_device(call, dev)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        self.granularity_check(call, "size", size)?;
        let mut st = d.state.lock();
        self.check_commit(call, &st, size)?;
        let id = self.new_id();
        st.handles.insert(
            id,
            PhysAlloc {
                size,
                map_count: 0,
                data: Store::default(),
            },
        );
        st.commit(size);
        Ok(PhysHandle(id))
    }

    fn release_physical(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<()> {
        let call = DriverCall::ReleasePhysical;
        let d = self.vmm_device(call, dev)?;
        let mut st = d.state.lock();
        let Some(p) = st.handles.get(&handle.0) else {
            return Err(invalid_handle(
                call,
                format!("unknown physical handle {}", handle.0),
            ));
        };
        if p.map_count > 0 {
            return Err(invalid(
                call,
                format!(
                    "physical handle {} is still mapped {} time(s)",
                    handle.0, p.map_count
                ),
            ));
        }
        let size = p.size;
        let touching = st.work_touching(&[Piece {
            key: MemKey::Phys(handle.0),
            off: 0,
            len: size,
        }]);
        st.handles.remove(&handle.0);
        st.committed -= size;
        drop(st);
        self.record_hazards(
            touching
                .into_iter()
                .map(|(sid, w)| Hazard {
                    dev,
                    kind: HazardKind::ReleaseWhileInUse,
                    ptr: 0,
                    size,
                    stream: None,
                    handle: Some(handle),
                    other_stream: StreamId(sid),
                    work: WorkId(w),
                })
                .collect(),
        );
        Ok(())
    }

    fn map(&self, dev: DeviceId, addr: u64, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let call = DriverCall::Map;
        let d = self.vmm_device(call, dev)?;
        self.granularity_check(call, "address", addr)?;
        let mut st = d.state.lock();
        let Some(p) = st.handles.get(&handle.0) else {
            return Err(invalid_handle(
                call,
                format!("unknown physical handle {}", handle.0),
            ));
        };
        if p.size != size {
            return Err(invalid(
                call,
                format!(
                    "size {size:#x} differs from the size {:#x} of handle {}",
                    p.size, handle.0
                ),
            ));
        }
        let end = addr
            .checked_add(size)
            .ok_or_else(|| invalid(call, "range overflows"))?;
        let inside = st
            .reservations
            .range(..=addr)
            .next_back()
            .is_some_and(|(&s, &len)| end <= s + len);
        if !inside {
            return Err(invalid(
                call,
                format!("[{addr:#x}, {end:#x}) is not inside one reservation"),
            ));
        }
        let before = st
            .mappings
            .range(..addr)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size > addr);
        if before || st.mappings.range(addr..end).next().is_some() {
            return Err(invalid(
                call,
                format!("[{addr:#x}, {end:#x}) overlaps an existing mapping"),
            ));
        }
        if let Some(p) = st.handles.get_mut(&handle.0) {
            p.map_count += 1;
        }
        st.mappings.insert(
            addr,
            Mapping {
                size,
                handle: handle.0,
            },
        );
        st.mapped_bytes += size;
        Ok(())
    }

    fn unmap(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        let call = DriverCall::Unmap;
        let d = self.vmm_device(call, dev)?;
        let mut st = d.state.lock();
        let handle = match st.mappings.get(&addr) {
            Some(m) if m.size == size => m.handle,
            Some(m) => {
                return Err(invalid(
                    call,
                    format!("mapping at {addr:#x} has size {:#x}, not {size:#x}", m.size),
                ))
            }
            None => return Err(invalid(call, format!("no mapping starts at {addr:#x}"))),
        };
        let touching = st.work_touching(&[Piece {
            key: MemKey::Phys(handle),
            off: 0,
            len: size,
        }]);
        st.mappings.remove(&addr);
        st.mapped_bytes -= size;
        st.access.remove(addr, addr + size);
        if let Some(p) = st.handles.get_mut(&handle) {
            p.map_count -= 1;
        }
        drop(st);
        self.record_hazards(
            touching
                .into_iter()
                .map(|(sid, w)| Hazard {
                    dev,
                    kind: HazardKind::UnmapWhileInUse,
                    ptr: addr,
                    size,
                    stream: None,
                    handle: None,
                    other_stream: StreamId(sid),
                    work: WorkId(w),
                })
                .collect(),
        );
        Ok(())
    }

    fn set_access(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        let call = DriverCall::SetAccess;
        let d = self.vmm_device(call, dev)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        let mut st = d.state.lock();
        st.translate(addr, size, false)
            .map_err(|m| invalid(call, m))?;
        st.access.insert(addr, addr + size);
        Ok(())
    }

    fn mem_alloc(&self, dev: DeviceId, size: u64) -> DriverResult<u64> {
        let call = DriverCall::MemAlloc;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        let mut st = d.state.lock();
        self.check_commit(call, &st, size)?;
        let span = round_up(size, LINEAR_ALIGN).ok_or_else(|| oom(call, "size overflows"))?;
        let base = st
            .linear_free
            .alloc(span, LINEAR_ALIGN)
            .ok_or_else(|| oom(call, "linear address space exhausted"))?;
        let id = self.new_id();
        st.linear.insert(
            base,
            LinearAlloc {
                id,
                size,
                data: Store::default(),
            },
        );
        st.linear_ids.insert(id, base);
        st.commit(size);
        Ok(base)
    }

    fn mem_free(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        let call = DriverCall::MemFree;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let mut st = d.state.lock();
        if !st.linear.contains_key(&ptr) {
            return Err(invalid(
                call,
                format!("{ptr:#x} is not the base of a live mem_alloc allocation"),
            ));
        }
        // Like cuMemFree, synchronise the device first.
        let n = st.complete_all();
        if n > 0 {
            d.unfinished.fetch_sub(n, Ordering::Relaxed);
        }
        if let Some(l) = st.linear.remove(&ptr) {
            st.linear_ids.remove(&l.id);
            st.committed -= l.size;
            let span = round_up(l.size, LINEAR_ALIGN).unwrap_or(l.size);
            st.linear_free.insert(ptr, ptr + span);
        }
        Ok(())
    }

    fn event_create(&self, dev: DeviceId) -> DriverResult<EventId> {
        let call = DriverCall::EventCreate;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let id = self.new_id();
        d.state.lock().events.insert(id, Vec::new());
        Ok(EventId(id))
    }

    fn event_record(&self, dev: DeviceId, event: EventId, stream: StreamId) -> DriverResult<()> {
        let call = DriverCall::EventRecord;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let mut st = d.state.lock();
        if !st.events.contains_key(&event.0) {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        }
        let mut positions = Vec::new();
        if let Some(ss) = st.streams.get(&stream.0) {
            if let Some(work) = ss.last {
                positions.push(Pos {
                    stream: stream.0,
                    work,
                });
            }
            for &p in &ss.pending_waits {
                merge_pos(&mut positions, p);
            }
        }
        positions.retain(|&p| !st.is_complete(p));
        st.events.insert(event.0, positions);
        Ok(())
    }

    fn event_query(&self, dev: DeviceId, event: EventId) -> DriverResult<bool> {
        let call = DriverCall::EventQuery;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let st = d.state.lock();
        let Some(positions) = st.events.get(&event.0) else {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        };
        Ok(positions.iter().all(|&p| st.is_complete(p)))
    }

    fn event_synchronize(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        let call = DriverCall::EventSynchronize;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let mut st = d.state.lock();
        let Some(positions) = st.events.get(&event.0).cloned() else {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        };
        let n: usize = positions.into_iter().map(|p| st.complete_through(p)).sum();
        if n > 0 {
            d.unfinished.fetch_sub(n, Ordering::Relaxed);
        }
        Ok(())
    }

    fn event_destroy(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        let call = DriverCall::EventDestroy;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        match d.state.lock().events.remove(&event.0) {
            Some(_) => Ok(()),
            None => Err(invalid_handle(call, format!("unknown event {}", event.0))),
        }
    }

    fn stream_wait_event(
        &self,
        dev: DeviceId,
        stream: StreamId,
        event: EventId,
    ) -> DriverResult<()> {
        let call = DriverCall::StreamWaitEvent;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let mut st = d.state.lock();
        let Some(positions) = st.events.get(&event.0).cloned() else {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        };
        // Everything ordered before the captured positions becomes ordered before this stream's
        // later work: each position covers its stream up to it, and what its work item was
        // ordered after when launched (a completed item needs nothing: its dependencies are
        // complete too).
        let mut covered: Vec<Pos> = Vec::new();
        for &p in &positions {
            merge_pos(&mut covered, p);
            if let Some(w) = st.work_item(p) {
                for (&stream, &work) in w.ordered_after.iter() {
                    merge_pos(&mut covered, Pos { stream, work });
                }
            }
        }
        let pending: Vec<Pos> = positions
            .into_iter()
            .filter(|&p| p.stream != stream.0 && !st.is_complete(p))
            .collect();
        let ss = st.streams.entry(stream.0).or_default();
        let news: Vec<Pos> = covered
            .into_iter()
            .filter(|p| p.stream != stream.0 && ss.waited.get(&p.stream) < Some(&p.work))
            .collect();
        if !news.is_empty() {
            let waited = Arc::make_mut(&mut ss.waited);
            for p in news {
                waited.insert(p.stream, p.work);
            }
        }
        for p in pending {
            merge_pos(&mut ss.pending_waits, p);
        }
        Ok(())
    }

    fn device_synchronize(&self, dev: DeviceId) -> DriverResult<()> {
        let call = DriverCall::DeviceSynchronize;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.complete_with(d, DevState::complete_all);
        Ok(())
    }

    #[inline]
    fn note_handout(&self, dev: DeviceId, ptr: u64, size: u64, stream: StreamId) {
        let Some(d) = self.devices.get(dev) else {
            return;
        };
        if d.unfinished.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.check_handout(dev, d, ptr, size, stream);
    }
}

#[cfg(test)]
mod tests;
