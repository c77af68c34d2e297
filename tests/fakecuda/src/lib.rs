//! A fake `libcuda.so` for tests and CI: the CUDA driver API functions cistern calls, implemented
//! over one process-wide [`SimDriver`] (one simulator, two faces).
//!
//! With it, a machine without a GPU runs the *real* [`CudaDriver`](cistern::CudaDriver) (cudarc
//! loads this library as the driver), the C ABI and the Python package end to end.
//!
//! It exports exactly the functions of [`CUDA_SYMBOLS`](cistern::driver::cuda::CUDA_SYMBOLS), no
//! more: `tests/symbols.rs` compares the built library's dynamic symbol table with that list.
//!
//! # Only for tests
//!
//! * The build produces `libcistern_fakecuda.so`, **not** `libcuda.so`: cargo puts
//!   `target/<profile>` and `target/<profile>/deps` on the library path of every test and binary
//!   it runs, so a `libcuda.so` there would shadow the real driver in `cargo test` on a GPU
//!   machine. Tests copy it to `target/fakecuda/<profile>/libcuda.so` and `libcuda.so.1` (the
//!   helper in `tests/fakecuda/tests/common/mod.rs`), a directory that only tests and `.ci/run`
//!   put on `LD_LIBRARY_PATH`, and only for the processes they start.
//! * `cuInit` refuses to start (`CUDA_ERROR_STUB_LIBRARY`, with one line on stderr) unless
//!   `CISTERN_FAKECUDA=1` is set, so a deployment that picks the file up by accident fails like a
//!   machine without a driver instead of running on a simulator.
//!
//! # Knobs
//!
//! Environment variables, read once at the first successful `cuInit` (see [`knobs`]):
//! `CISTERN_FAKECUDA_CAPACITY` (memory per device, e.g. `8GiB`; default 16 GiB),
//! `CISTERN_FAKECUDA_DEVICES` (default 1), `CISTERN_FAKECUDA_VMM` (`0`: attribute 102 reads 0 and
//! the VMM calls return `CUDA_ERROR_NOT_SUPPORTED`), `CISTERN_FAKECUDA_GRANULARITY` (default
//! 2 MiB) and `CISTERN_FAKECUDA_FAIL` (`cuMemCreate:3,cuMemMap:5+`: the 3rd `cuMemCreate` fails,
//! and the 5th `cuMemMap` and every later one; injected failures of `cuMemCreate` and
//! `cuMemAlloc` are `CUDA_ERROR_OUT_OF_MEMORY`, others `CUDA_ERROR_UNKNOWN`). A value that cannot
//! be used is reported on stderr and its default used instead.
//!
//! # Semantics
//!
//! As the real driver's, for the calls exported here:
//!
//! * Every call but `cuInit` and `cuGetErrorString` returns `CUDA_ERROR_NOT_INITIALIZED` before a
//!   successful `cuInit`. A null output pointer is `CUDA_ERROR_INVALID_VALUE`, never a crash. No
//!   panic crosses the boundary (a caught one is `CUDA_ERROR_UNKNOWN`). Only codes of the real
//!   `CUresult` enum are returned.
//! * Devices are ordinals (`CUdevice` = ordinal). Each device has one primary context: a stable
//!   non-null `CUcontext`, reference-counted by `cuDevicePrimaryCtxRetain` /
//!   `cuDevicePrimaryCtxRelease_v2`. The current context is per thread (`cuCtxGetCurrent` /
//!   `cuCtxSetCurrent`). `cuMemAlloc_v2`, `cuMemFree_v2`, `cuMemGetInfo_v2`, `cuEventCreate` and
//!   `cuCtxSynchronize` need a current, retained context (`CUDA_ERROR_INVALID_CONTEXT` otherwise)
//!   and act on its device; `cuCtxSynchronize` completes the simulator's work on it.
//! * Memory, handles and events belong to the device they were created on; calls that name them
//!   act on that device. `cuMemAddressReserve` reserves on the current context's device (device 0
//!   without one). Limits of the simulation: a handle can only be mapped into a reservation of
//!   its own device; `cuMemSetAccess` grants read-write access to the owning device only (other
//!   devices or protections are `CUDA_ERROR_NOT_SUPPORTED`); `cuDeviceGetAttribute` knows a few
//!   attributes (VMM support, compute capability 9.0, 132 multiprocessors, unified addressing)
//!   and refuses the others with `CUDA_ERROR_INVALID_VALUE`.
//! * Streams are opaque values passed to the simulator; events are the simulator's ids.
//! * When a primary context's count drops to zero while memory or events of its device are
//!   still live, one line on stderr says what leaked (the real driver would free it; the fake
//!   keeps it).
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]
// The exports keep the CUDA driver API's names.
#![allow(non_snake_case)]

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use cistern::driver::{DeviceCaps, Driver, DriverError, EventId, PhysHandle, StreamId};
use cistern::{SimConfig, SimDriver};

pub use cudarc::driver::sys::CUresult;
use CUresult::*;

pub mod knobs;

use knobs::Knobs;

// ---------------------------------------------------------------------------------------------
// C types, laid out exactly as cudarc 0.19 (CUDA 12.8 headers) passes them; enum-typed fields and
// arguments are read as plain integers, so an unexpected value from a caller is an error code,
// never undefined behaviour.
// ---------------------------------------------------------------------------------------------

/// `CUdevice`: a device ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CUdeviceptr = c_ulonglong;
/// `CUcontext`: an opaque context handle.
pub type CUcontext = *mut c_void;
/// `CUstream`: an opaque stream handle (null: the legacy default stream).
pub type CUstream = *mut c_void;
/// `CUevent`: an opaque event handle.
pub type CUevent = *mut c_void;
/// `CUmemGenericAllocationHandle`: a physical allocation.
pub type CUmemGenericAllocationHandle = c_ulonglong;

/// `CUmemLocation` (CUDA 12.8).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct CUmemLocation {
    /// `CUmemLocationType`: 1 is `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub type_: c_uint,
    /// The device ordinal for a device location.
    pub id: c_int,
}

/// `CUmemAllocationProp` (CUDA 12.8).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct CUmemAllocationProp {
    /// `CUmemAllocationType`: 1 is `CU_MEM_ALLOCATION_TYPE_PINNED`.
    pub type_: c_uint,
    /// `CUmemAllocationHandleType` (ignored).
    pub requestedHandleTypes: c_uint,
    /// Where the memory lives.
    pub location: CUmemLocation,
    /// Windows only (ignored).
    pub win32HandleMetaData: *mut c_void,
    /// `compressionType`, `gpuDirectRDMACapable`, `usage` and reserved bytes (ignored).
    pub allocFlags: [u8; 8],
}

/// `CUmemAccessDesc` (CUDA 12.8).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct CUmemAccessDesc {
    /// The device granted access.
    pub location: CUmemLocation,
    /// `CUmemAccess_flags`: 3 is `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
    pub flags: c_uint,
}

/// `CUuuid`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct CUuuid {
    /// The 16 bytes of the UUID.
    pub bytes: [c_char; 16],
}

const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;
const CU_MEM_ALLOCATION_TYPE_PINNED: c_uint = 1;
const CU_MEM_ACCESS_FLAGS_PROT_NONE: c_uint = 0;
const CU_MEM_ACCESS_FLAGS_PROT_READ: c_uint = 1;
const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_uint = 3;
/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS`.
const CU_EVENT_FLAGS: c_uint = 0x7;
const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
const CU_EVENT_INTERPROCESS: c_uint = 0x4;

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
const ATTR_MULTIPROCESSOR_COUNT: c_uint = 16;
/// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
const ATTR_UNIFIED_ADDRESSING: c_uint = 41;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
const ATTR_CC_MAJOR: c_uint = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
const ATTR_CC_MINOR: c_uint = 76;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`.
const ATTR_VMM: c_uint = 102;

/// The description of each code the fake can return, as the real driver words it.
const ERROR_STRINGS: [(CUresult, &CStr); 13] = [
    (CUDA_SUCCESS, c"no error"),
    (CUDA_ERROR_INVALID_VALUE, c"invalid argument"),
    (CUDA_ERROR_OUT_OF_MEMORY, c"out of memory"),
    (CUDA_ERROR_NOT_INITIALIZED, c"initialization error"),
    (CUDA_ERROR_DEINITIALIZED, c"driver shutting down"),
    (CUDA_ERROR_STUB_LIBRARY, c"CUDA driver is a stub library"),
    (CUDA_ERROR_NO_DEVICE, c"no CUDA-capable device is detected"),
    (CUDA_ERROR_INVALID_DEVICE, c"invalid device ordinal"),
    (CUDA_ERROR_INVALID_CONTEXT, c"invalid device context"),
    (CUDA_ERROR_INVALID_HANDLE, c"invalid resource handle"),
    (CUDA_ERROR_NOT_READY, c"device not ready"),
    (CUDA_ERROR_NOT_SUPPORTED, c"operation not supported"),
    (CUDA_ERROR_UNKNOWN, c"unknown error"),
];

// ---------------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------------

/// A device's primary context; its address is the `CUcontext`.
#[derive(Debug)]
struct PrimaryCtx {
    dev: usize,
    refs: AtomicU32,
}

/// Which device owns each address range, handle and event handed out.
#[derive(Debug, Default)]
struct Owners {
    /// Reservation start -> (size, device).
    reservations: BTreeMap<u64, (u64, usize)>,
    handles: HashMap<u64, usize>,
    linear: HashMap<u64, usize>,
    events: HashMap<u64, usize>,
}

/// The fake driver: the simulator and what the CUDA face adds to it.
struct Fake {
    sim: SimDriver,
    knobs: Knobs,
    /// Read from the simulator at `cuInit`.
    caps: Vec<DeviceCaps>,
    /// One per device; boxed so that the addresses never move.
    ctxs: Box<[PrimaryCtx]>,
    owners: Mutex<Owners>,
}

static FAKE: OnceLock<Fake> = OnceLock::new();

thread_local! {
    /// The thread's current context (a `PrimaryCtx` address), 0 for none.
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

impl Fake {
    fn from_env() -> Fake {
        let (knobs, warnings) = Knobs::read(|k| std::env::var(k).ok());
        for w in warnings {
            eprintln!("{w}");
        }
        let sim = SimDriver::new(
            SimConfig::default()
                .devices(knobs.devices)
                .capacity(knobs.capacity)
                .granularity(knobs.granularity)
                .vmm(knobs.vmm),
        );
        let caps = (0..knobs.devices)
            .map(|d| {
                sim.capabilities(d).unwrap_or_else(|_| DeviceCaps {
                    total_memory: knobs.capacity,
                    vmm: knobs.vmm,
                    granularity: knobs.granularity,
                    name: "cistern-sim".into(),
                    uuid: None,
                })
            })
            .collect();
        // Count only the client's calls, and arm faults for them.
        sim.reset_counters();
        for f in &knobs.faults {
            if f.and_after {
                sim.fail_from(f.call, f.nth);
            } else {
                sim.fail_nth(f.call, f.nth);
            }
        }
        let ctxs = (0..knobs.devices)
            .map(|dev| PrimaryCtx {
                dev,
                refs: AtomicU32::new(0),
            })
            .collect();
        Fake {
            sim,
            knobs,
            caps,
            ctxs,
            owners: Mutex::new(Owners::default()),
        }
    }

    fn owners(&self) -> MutexGuard<'_, Owners> {
        // A panic while holding the lock cannot leave the maps half-updated (each update is a
        // single insert or remove), so a poisoned lock is still consistent.
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Device ordinal `d`, checked.
    fn device(&self, d: CUdevice) -> Result<usize, CUresult> {
        usize::try_from(d)
            .ok()
            .filter(|&d| d < self.ctxs.len())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    fn ctx_ptr(&self, dev: usize) -> CUcontext {
        &self.ctxs[dev] as *const PrimaryCtx as CUcontext
    }

    fn ctx_at(&self, addr: usize) -> Option<&PrimaryCtx> {
        self.ctxs
            .iter()
            .find(|&c| std::ptr::eq(c, addr as *const PrimaryCtx))
    }

    /// The device of the thread's current context, which must be retained.
    fn current_device(&self) -> Result<usize, CUresult> {
        let addr = CURRENT.with(Cell::get);
        match self.ctx_at(addr) {
            Some(c) if c.refs.load(Ordering::Acquire) > 0 => Ok(c.dev),
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    fn vmm(&self) -> Result<(), CUresult> {
        if self.knobs.vmm {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_SUPPORTED)
        }
    }

    /// The device of the reservation containing `addr`.
    fn reservation_device(&self, addr: u64) -> Option<usize> {
        let o = self.owners();
        o.reservations
            .range(..=addr)
            .next_back()
            .filter(|(&start, &(size, _))| addr - start < size)
            .map(|(_, &(_, dev))| dev)
    }

    fn event_device(&self, ev: CUevent) -> Result<usize, CUresult> {
        if ev.is_null() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        self.owners()
            .events
            .get(&(ev as usize as u64))
            .copied()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// Checks an allocation property and returns the device it names.
    fn prop_device(&self, prop: &CUmemAllocationProp) -> Result<usize, CUresult> {
        if prop.type_ != CU_MEM_ALLOCATION_TYPE_PINNED
            || prop.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.device(prop.location.id)
    }

    /// Says on stderr what is still live on `dev` when its primary context is released.
    fn report_leaks(&self, dev: usize) {
        let s = &self.sim;
        let (handles, mapped, reserved, linear, events) = (
            s.live_handles(dev),
            s.mapped_bytes(dev),
            s.reserved_va_bytes(dev),
            s.live_linear_allocations(dev),
            s.live_events(dev),
        );
        if handles + linear + events > 0 || mapped + reserved > 0 {
            eprintln!(
                "cistern-fakecuda: the primary context of device {dev} was released with \
                 {handles} physical handle(s), {mapped} mapped byte(s), {reserved} reserved \
                 byte(s), {linear} linear allocation(s) and {events} event(s) still live (the \
                 real driver would free them now)"
            );
        }
    }
}

/// The `CUresult` for a simulator error (the simulator uses the real driver's codes).
fn code(e: &DriverError) -> CUresult {
    match e.code {
        1 => CUDA_ERROR_INVALID_VALUE,
        2 => CUDA_ERROR_OUT_OF_MEMORY,
        101 => CUDA_ERROR_INVALID_DEVICE,
        400 => CUDA_ERROR_INVALID_HANDLE,
        600 => CUDA_ERROR_NOT_READY,
        801 => CUDA_ERROR_NOT_SUPPORTED,
        _ => CUDA_ERROR_UNKNOWN,
    }
}

/// Runs an export's body: a panic becomes `CUDA_ERROR_UNKNOWN`, never an unwind into C.
fn entry(body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(r)) => r,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// The fake, once `cuInit` succeeded.
fn fake() -> Result<&'static Fake, CUresult> {
    FAKE.get().ok_or(CUDA_ERROR_NOT_INITIALIZED)
}

/// Writes `v` through an output pointer, refusing null.
///
/// # Safety
///
/// `p` is null or valid for writing a `T` (the C API's contract for output arguments).
unsafe fn put<T>(p: *mut T, v: T) -> Result<(), CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for a write of `T` by this function's contract; `write` does
    // not read or drop the old value, which may be uninitialised.
    unsafe { p.write(v) };
    Ok(())
}

/// Reads an input pointer, refusing null.
///
/// # Safety
///
/// `p` is null or points to a readable, initialised `T`.
unsafe fn get<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and readable by this function's contract; `T: Copy` and every field of
    // the C structs read here is an integer or a raw pointer, valid for any bit pattern.
    Ok(unsafe { p.read_unaligned() })
}

fn size(v: usize) -> u64 {
    v as u64
}

// ---------------------------------------------------------------------------------------------
// Initialisation and errors
// ---------------------------------------------------------------------------------------------

/// `cuInit`: starts the simulator with the knobs of the environment. Refuses with
/// `CUDA_ERROR_STUB_LIBRARY` (and one line on stderr) unless `CISTERN_FAKECUDA=1`.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if FAKE.get().is_some() {
            return Ok(());
        }
        if std::env::var(knobs::ENABLE).as_deref() != Ok("1") {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "cistern-fakecuda: this libcuda.so is cistern's fake CUDA driver for tests, \
                     not the NVIDIA driver; it refuses to start unless {}=1 (remove it from \
                     LD_LIBRARY_PATH to use the real driver)",
                    knobs::ENABLE
                );
            }
            return Err(CUDA_ERROR_STUB_LIBRARY);
        }
        FAKE.get_or_init(Fake::from_env);
        Ok(())
    })
}

/// `cuGetErrorString`: a static description of `error`; an unknown code stores NULL and returns
/// `CUDA_ERROR_INVALID_VALUE`. Works before `cuInit`.
///
/// # Safety
///
/// `pStr` is null or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: c_uint, pStr: *mut *const c_char) -> CUresult {
    entry(|| {
        let text = ERROR_STRINGS
            .iter()
            .find(|(r, _)| *r as c_uint == error)
            .map(|(_, s)| s.as_ptr());
        // SAFETY: `pStr` is null or writable (this function's contract); `put` refuses null.
        unsafe { put(pStr, text.unwrap_or(std::ptr::null())) }?;
        text.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

// ---------------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------------

/// `cuDeviceGetCount`: the number of simulated devices.
///
/// # Safety
///
/// `count` is null or valid for writing a `c_int`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    entry(|| {
        let f = fake()?;
        let n = f.sim.device_count().map_err(|e| code(&e))?;
        // SAFETY: `count` is null or writable (contract); `put` refuses null.
        unsafe { put(count, n as c_int) }
    })
}

/// `cuDeviceGet`: the device handle of an ordinal (the ordinal itself).
///
/// # Safety
///
/// `device` is null or valid for writing a `CUdevice`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    entry(|| {
        let f = fake()?;
        if device.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        f.device(ordinal)?;
        // SAFETY: `device` is non-null and writable (contract).
        unsafe { put(device, ordinal) }
    })
}

/// `cuDeviceGetName`: the simulator's device name, truncated to `len - 1` bytes and
/// NUL-terminated.
///
/// # Safety
///
/// `name` is null or valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    entry(|| {
        let f = fake()?;
        let len = usize::try_from(len).unwrap_or(0);
        if name.is_null() || len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.device(dev)?;
        let text = f.caps[d].name.as_bytes();
        let n = text.len().min(len - 1);
        // SAFETY: `name` is non-null and valid for `len` bytes (contract); `n + 1 <= len`, and
        // the source is a Rust string that cannot overlap the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

/// `cuDeviceGetUuid_v2`: the simulator's device UUID.
///
/// # Safety
///
/// `uuid` is null or valid for writing a `CUuuid`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    entry(|| {
        let f = fake()?;
        if uuid.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.device(dev)?;
        let bytes = f.caps[d]
            .uuid
            .as_deref()
            .and_then(parse_uuid)
            .ok_or(CUDA_ERROR_NOT_SUPPORTED)?;
        // SAFETY: `uuid` is non-null and writable (contract).
        unsafe {
            put(
                uuid,
                CUuuid {
                    bytes: bytes.map(|b| b as c_char),
                },
            )
        }
    })
}

/// The 16 bytes of a `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` UUID.
fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = s
        .strip_prefix("GPU-")?
        .bytes()
        .filter(|&b| b != b'-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// `cuDeviceTotalMem_v2`: the simulated capacity.
///
/// # Safety
///
/// `bytes` is null or valid for writing a `usize`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    entry(|| {
        let f = fake()?;
        if bytes.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.device(dev)?;
        // SAFETY: `bytes` is non-null and writable (contract).
        unsafe { put(bytes, f.caps[d].total_memory as usize) }
    })
}

/// `cuDeviceGetAttribute`: VMM support (102) from the simulator, compute capability 9.0
/// (75, 76), 132 multiprocessors (16), unified addressing (41); other attributes are
/// `CUDA_ERROR_INVALID_VALUE`. Counts as the simulator's `capabilities` call (fault injection:
/// `cuDeviceGetAttribute:N`).
///
/// # Safety
///
/// `pi` is null or valid for writing a `c_int`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: c_uint,
    dev: CUdevice,
) -> CUresult {
    entry(|| {
        let f = fake()?;
        if pi.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.device(dev)?;
        let caps = f.sim.capabilities(d).map_err(|e| code(&e))?;
        let v = match attrib {
            ATTR_VMM => c_int::from(caps.vmm),
            ATTR_CC_MAJOR => 9,
            ATTR_CC_MINOR => 0,
            ATTR_MULTIPROCESSOR_COUNT => 132,
            ATTR_UNIFIED_ADDRESSING => 1,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: `pi` is non-null and writable (contract).
        unsafe { put(pi, v) }
    })
}

// ---------------------------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------------------------

/// `cuDevicePrimaryCtxRetain`: the device's primary context (stable, non-null), its count
/// raised by one.
///
/// # Safety
///
/// `pctx` is null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    entry(|| {
        let f = fake()?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.device(dev)?;
        f.ctxs[d].refs.fetch_add(1, Ordering::AcqRel);
        // SAFETY: `pctx` is non-null and writable (contract).
        unsafe { put(pctx, f.ctx_ptr(d)) }
    })
}

/// `cuDevicePrimaryCtxRelease_v2`: lowers the primary context's count;
/// `CUDA_ERROR_INVALID_CONTEXT` when it was not retained.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    entry(|| {
        let f = fake()?;
        let d = f.device(dev)?;
        let before = f.ctxs[d]
            .refs
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| r.checked_sub(1))
            .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        if before == 1 {
            f.report_leaks(d);
        }
        Ok(())
    })
}

/// `cuCtxGetCurrent`: the thread's current context, or NULL.
///
/// # Safety
///
/// `pctx` is null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    entry(|| {
        fake()?;
        let cur = CURRENT.with(Cell::get);
        // SAFETY: `pctx` is null or writable (contract); `put` refuses null.
        unsafe { put(pctx, cur as CUcontext) }
    })
}

/// `cuCtxSetCurrent`: makes `ctx` (a primary context, or NULL for none) current on this thread.
///
/// # Safety
///
/// None: `ctx` is only compared with the fake's own contexts, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    entry(|| {
        let f = fake()?;
        let addr = ctx as usize;
        if addr != 0 && f.ctx_at(addr).is_none() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(addr));
        Ok(())
    })
}

/// `cuCtxSynchronize`: completes all simulated work on the current context's device.
///
/// # Safety
///
/// None beyond the C API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    entry(|| {
        let f = fake()?;
        let d = f.current_device()?;
        f.sim.device_synchronize(d).map_err(|e| code(&e))
    })
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

/// `cuMemGetInfo_v2`: free and total memory of the current context's device.
///
/// # Safety
///
/// `free` and `total` are null or valid for writing a `usize`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry(|| {
        let f = fake()?;
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.current_device()?;
        let info = f.sim.mem_info(d).map_err(|e| code(&e))?;
        // SAFETY: both pointers are non-null and writable (contract).
        unsafe {
            put(free, info.free as usize)?;
            put(total, info.total as usize)
        }
    })
}

/// `cuMemGetAllocationGranularity`: the simulated granularity (minimum and recommended alike)
/// for pinned device memory.
///
/// # Safety
///
/// `granularity` is null or valid for writing a `usize`; `prop` is null or points to a
/// `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_uint,
) -> CUresult {
    entry(|| {
        let f = fake()?;
        // SAFETY: `prop` is null or readable (contract); `get` refuses null.
        let prop = unsafe { get(prop) }?;
        if granularity.is_null() || option > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.prop_device(&prop)?;
        f.vmm()?;
        // SAFETY: `granularity` is non-null and writable (contract).
        unsafe { put(granularity, f.caps[d].granularity as usize) }
    })
}

/// `cuMemAddressReserve`: reserves virtual address space on the current context's device
/// (device 0 without one). `alignment` 0 means the granularity; the `addr` hint is ignored, as
/// the real driver may.
///
/// # Safety
///
/// `ptr` is null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    let _ = addr;
    entry(|| {
        let f = fake()?;
        if ptr.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        f.vmm()?;
        let d = f.current_device().unwrap_or(0);
        let align = if alignment == 0 {
            f.knobs.granularity
        } else {
            self::size(alignment)
        };
        let va = f
            .sim
            .reserve_va(d, self::size(size), align)
            .map_err(|e| code(&e))?;
        f.owners().reservations.insert(va, (self::size(size), d));
        // SAFETY: `ptr` is non-null and writable (contract).
        unsafe { put(ptr, va) }
    })
}

/// `cuMemAddressFree`: releases a whole reservation (nothing may be mapped in it).
///
/// # Safety
///
/// None beyond the C API's: the arguments are plain values.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry(|| {
        let f = fake()?;
        f.vmm()?;
        // Held across the free, as in cuMemFree_v2: a freed range's address can be reserved
        // again at once by another thread, whose entry this free must not remove.
        let mut owners = f.owners();
        let d = owners
            .reservations
            .get(&ptr)
            .map(|&(_, d)| d)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        f.sim
            .free_va(d, ptr, self::size(size))
            .map_err(|e| code(&e))?;
        owners.reservations.remove(&ptr);
        Ok(())
    })
}

/// `cuMemCreate`: commits physical memory on the device `prop` names.
///
/// # Safety
///
/// `handle` is null or valid for writing a handle; `prop` is null or points to a
/// `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    entry(|| {
        let f = fake()?;
        // SAFETY: `prop` is null or readable (contract); `get` refuses null.
        let prop = unsafe { get(prop) }?;
        if handle.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.prop_device(&prop)?;
        f.vmm()?;
        let h = f
            .sim
            .create_physical(d, self::size(size))
            .map_err(|e| code(&e))?;
        f.owners().handles.insert(h.0, d);
        // SAFETY: `handle` is non-null and writable (contract).
        unsafe { put(handle, h.0) }
    })
}

/// `cuMemRelease`: frees a physical handle that is no longer mapped.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    entry(|| {
        let f = fake()?;
        f.vmm()?;
        let d = f
            .owners()
            .handles
            .get(&handle)
            .copied()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        f.sim
            .release_physical(d, PhysHandle(handle))
            .map_err(|e| code(&e))?;
        f.owners().handles.remove(&handle);
        Ok(())
    })
}

/// `cuMemMap`: maps a whole handle at `ptr` (offset and flags must be 0).
///
/// # Safety
///
/// None beyond the C API's: the arguments are plain values.
#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    entry(|| {
        let f = fake()?;
        f.vmm()?;
        if offset != 0 || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f
            .owners()
            .handles
            .get(&handle)
            .copied()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        f.sim
            .map(d, ptr, self::size(size), PhysHandle(handle))
            .map_err(|e| code(&e))
    })
}

/// `cuMemUnmap`: undoes exactly one earlier mapping.
///
/// # Safety
///
/// None beyond the C API's: the arguments are plain values.
#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry(|| {
        let f = fake()?;
        f.vmm()?;
        let d = f.reservation_device(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        f.sim.unmap(d, ptr, self::size(size)).map_err(|e| code(&e))
    })
}

/// `cuMemSetAccess`: grants read-write access to mapped memory, to the device that owns it.
///
/// # Safety
///
/// `desc` is null or points to `count` access descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    entry(|| {
        let f = fake()?;
        f.vmm()?;
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let owner = f.reservation_device(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for i in 0..count {
            // SAFETY: `desc` points to `count` descriptors (contract) and `i < count`.
            let d = unsafe { get(desc.add(i)) }?;
            if d.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let dev = f.device(d.location.id)?;
            match d.flags {
                CU_MEM_ACCESS_FLAGS_PROT_READWRITE if dev == owner => {}
                CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                | CU_MEM_ACCESS_FLAGS_PROT_READ
                | CU_MEM_ACCESS_FLAGS_PROT_NONE => return Err(CUDA_ERROR_NOT_SUPPORTED),
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        f.sim
            .set_access(owner, ptr, self::size(size))
            .map_err(|e| code(&e))
    })
}

/// `cuMemAlloc_v2`: linear memory on the current context's device.
///
/// # Safety
///
/// `dptr` is null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    entry(|| {
        let f = fake()?;
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.current_device()?;
        let p = f.sim.mem_alloc(d, size(bytesize)).map_err(|e| code(&e))?;
        f.owners().linear.insert(p, d);
        // SAFETY: `dptr` is non-null and writable (contract).
        unsafe { put(dptr, p) }
    })
}

/// `cuMemFree_v2`: frees memory from `cuMemAlloc_v2` (completing the device's work first, as
/// the real call synchronises). Needs a current context.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    entry(|| {
        let f = fake()?;
        f.current_device()?;
        // The owners lock is held across the free: once the simulator has freed the range,
        // another thread's cuMemAlloc may get the same address, and its owner entry must not
        // be removed by this free.
        let mut owners = f.owners();
        let d = owners
            .linear
            .get(&dptr)
            .copied()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        f.sim.mem_free(d, dptr).map_err(|e| code(&e))?;
        owners.linear.remove(&dptr);
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Events and streams
// ---------------------------------------------------------------------------------------------

/// `cuEventCreate`: an event on the current context's device.
///
/// # Safety
///
/// `phEvent` is null or valid for writing a `CUevent`.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) -> CUresult {
    entry(|| {
        let f = fake()?;
        let interprocess_needs = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
        if phEvent.is_null()
            || Flags & !CU_EVENT_FLAGS != 0
            || (Flags & CU_EVENT_INTERPROCESS != 0
                && Flags & interprocess_needs != interprocess_needs)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.current_device()?;
        let ev = f.sim.event_create(d).map_err(|e| code(&e))?;
        f.owners().events.insert(ev.0, d);
        // SAFETY: `phEvent` is non-null and writable (contract).
        unsafe { put(phEvent, ev.0 as usize as CUevent) }
    })
}

/// `cuEventRecord`: records `hEvent` on `hStream`.
///
/// # Safety
///
/// None: both handles are only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(hEvent: CUevent, hStream: CUstream) -> CUresult {
    entry(|| {
        let f = fake()?;
        let d = f.event_device(hEvent)?;
        f.sim
            .event_record(
                d,
                EventId(hEvent as usize as u64),
                StreamId(hStream as usize as u64),
            )
            .map_err(|e| code(&e))
    })
}

/// `cuEventQuery`: `CUDA_SUCCESS` when the recorded work has completed, else
/// `CUDA_ERROR_NOT_READY`.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(hEvent: CUevent) -> CUresult {
    entry(|| {
        let f = fake()?;
        let d = f.event_device(hEvent)?;
        match f.sim.event_query(d, EventId(hEvent as usize as u64)) {
            Ok(true) => Ok(()),
            Ok(false) => Err(CUDA_ERROR_NOT_READY),
            Err(e) => Err(code(&e)),
        }
    })
}

/// `cuEventSynchronize`: completes the work the event captured.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    entry(|| {
        let f = fake()?;
        let d = f.event_device(hEvent)?;
        f.sim
            .event_synchronize(d, EventId(hEvent as usize as u64))
            .map_err(|e| code(&e))
    })
}

/// `cuEventDestroy_v2`: destroys an event.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(hEvent: CUevent) -> CUresult {
    entry(|| {
        let f = fake()?;
        let d = f.event_device(hEvent)?;
        let id = hEvent as usize as u64;
        f.sim.event_destroy(d, EventId(id)).map_err(|e| code(&e))?;
        f.owners().events.remove(&id);
        Ok(())
    })
}

/// `cuStreamWaitEvent`: later work on `hStream` waits for the event's work (flags 0 or
/// `CU_EVENT_WAIT_EXTERNAL`).
///
/// # Safety
///
/// None: both handles are only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    hStream: CUstream,
    hEvent: CUevent,
    Flags: c_uint,
) -> CUresult {
    entry(|| {
        let f = fake()?;
        if Flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.event_device(hEvent)?;
        f.sim
            .stream_wait_event(
                d,
                StreamId(hStream as usize as u64),
                EventId(hEvent as usize as u64),
            )
            .map_err(|e| code(&e))
    })
}

/// `cuStreamSynchronize`: waits for the work queued on `hStream` of the current context's
/// device (the simulator completes it). Needs a current context.
///
/// # Safety
///
/// None: the stream handle is only passed on as a value.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    entry(|| {
        let f = fake()?;
        let d = f.current_device()?;
        f.sim
            .stream_synchronize(d, StreamId(hStream as usize as u64))
            .map_err(|e| code(&e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn structs_are_laid_out_like_cudarcs() {
        assert_eq!(size_of::<CUmemLocation>(), size_of::<sys::CUmemLocation>());
        assert_eq!(
            align_of::<CUmemLocation>(),
            align_of::<sys::CUmemLocation>()
        );
        assert_eq!(
            offset_of!(CUmemLocation, id),
            offset_of!(sys::CUmemLocation, id)
        );
        assert_eq!(
            size_of::<CUmemAllocationProp>(),
            size_of::<sys::CUmemAllocationProp>()
        );
        assert_eq!(
            align_of::<CUmemAllocationProp>(),
            align_of::<sys::CUmemAllocationProp>()
        );
        assert_eq!(
            offset_of!(CUmemAllocationProp, requestedHandleTypes),
            offset_of!(sys::CUmemAllocationProp, requestedHandleTypes)
        );
        assert_eq!(
            offset_of!(CUmemAllocationProp, location),
            offset_of!(sys::CUmemAllocationProp, location)
        );
        assert_eq!(
            offset_of!(CUmemAllocationProp, win32HandleMetaData),
            offset_of!(sys::CUmemAllocationProp, win32HandleMetaData)
        );
        assert_eq!(
            offset_of!(CUmemAllocationProp, allocFlags),
            offset_of!(sys::CUmemAllocationProp, allocFlags)
        );
        assert_eq!(
            size_of::<CUmemAccessDesc>(),
            size_of::<sys::CUmemAccessDesc>()
        );
        assert_eq!(
            offset_of!(CUmemAccessDesc, flags),
            offset_of!(sys::CUmemAccessDesc, flags)
        );
        assert_eq!(size_of::<CUuuid>(), size_of::<sys::CUuuid>());
        // Enum-typed arguments are read as c_uint: the same size as cudarc's enums.
        assert_eq!(size_of::<sys::CUdevice_attribute>(), size_of::<c_uint>());
        assert_eq!(size_of::<sys::CUresult>(), size_of::<c_uint>());
        assert_eq!(
            size_of::<sys::CUmemAllocationGranularity_flags>(),
            size_of::<c_uint>()
        );
    }

    #[test]
    fn constants_match_cudarcs_enums() {
        use sys::*;
        assert_eq!(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED as c_uint,
            ATTR_VMM
        );
        assert_eq!(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as c_uint,
            ATTR_CC_MAJOR
        );
        assert_eq!(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as c_uint,
            ATTR_CC_MINOR
        );
        assert_eq!(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as c_uint,
            ATTR_MULTIPROCESSOR_COUNT
        );
        assert_eq!(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING as c_uint,
            ATTR_UNIFIED_ADDRESSING
        );
        assert_eq!(
            CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as c_uint,
            CU_MEM_LOCATION_TYPE_DEVICE
        );
        assert_eq!(
            CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED as c_uint,
            CU_MEM_ALLOCATION_TYPE_PINNED
        );
        assert_eq!(
            CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as c_uint,
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        );
        assert_eq!(
            CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
            CU_EVENT_DISABLE_TIMING
        );
        assert_eq!(
            CUevent_flags::CU_EVENT_INTERPROCESS as c_uint,
            CU_EVENT_INTERPROCESS
        );
    }

    #[test]
    fn every_simulator_code_has_a_result_and_a_description() {
        use cistern::driver::sim::codes;
        use cistern::driver::{DriverCall, DriverErrorKind};
        for c in [
            codes::CUDA_ERROR_INVALID_VALUE,
            codes::CUDA_ERROR_OUT_OF_MEMORY,
            codes::CUDA_ERROR_INVALID_DEVICE,
            codes::CUDA_ERROR_INVALID_HANDLE,
            codes::CUDA_ERROR_NOT_READY,
            codes::CUDA_ERROR_NOT_SUPPORTED,
            codes::CUDA_ERROR_UNKNOWN,
        ] {
            let e = DriverError::new(DriverCall::Map, DriverErrorKind::Other, c, "x");
            let r = code(&e);
            assert_eq!(r as i32, c);
            assert!(ERROR_STRINGS.iter().any(|(s, _)| *s == r), "{r:?}");
        }
        // An unexpected code is never passed through as a value outside the enum.
        let e = DriverError::new(DriverCall::Map, DriverErrorKind::Other, 12345, "x");
        assert_eq!(code(&e), CUDA_ERROR_UNKNOWN);
    }

    #[test]
    fn uuids_parse_back() {
        assert_eq!(
            parse_uuid("GPU-12345678-9abc-def0-0123-456789abcdef"),
            Some([
                0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
                0xcd, 0xef
            ])
        );
        assert_eq!(parse_uuid("GPU-1234"), None);
        assert_eq!(parse_uuid("12345678-9abc-def0-0123-456789abcdef"), None);
    }

    #[test]
    fn error_strings_are_static_and_unknown_codes_are_refused() {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: `text` is a live, writable pointer.
        let r = unsafe { cuGetErrorString(2, &mut text) };
        assert_eq!(r, CUDA_SUCCESS);
        // SAFETY: on success the pointer is one of the static C strings above.
        assert_eq!(unsafe { CStr::from_ptr(text) }, c"out of memory");
        // SAFETY: as above.
        let r = unsafe { cuGetErrorString(123_456, &mut text) };
        assert_eq!(r, CUDA_ERROR_INVALID_VALUE);
        assert!(text.is_null());
        // SAFETY: a null output pointer is refused, not written.
        let r = unsafe { cuGetErrorString(2, std::ptr::null_mut()) };
        assert_eq!(r, CUDA_ERROR_INVALID_VALUE);
    }
}
