//! A fake `libcuda.so` for tests and CI: the CUDA driver API functions cistern and its tests'
//! clients call, implemented over one process-wide [`SimDriver`] (one simulator, two faces), and
//! following the real driver's rules strictly enough that a client breaking one is refused.
//!
//! With it, a machine without a GPU runs the *real* [`CudaDriver`](cistern::CudaDriver) (cudarc
//! loads this library as the driver), the C ABI and the Python package end to end.
//!
//! It exports exactly [`CUDA_SYMBOLS`] (what cistern resolves) ∪ [`CLIENT_SYMBOLS`] (driver
//! functions test clients call: streams, the context stack, stream capture, peers) ∪
//! [`HOOK_SYMBOLS`] (the `cisternFake*` test hooks, see [`hooks`]); `tests/symbols.rs` compares
//! the built library's dynamic symbol table with that union.
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
//! Environment variables, read once at the first successful `cuInit` (see [`knobs`] and the
//! README's table): capacity, device count, VMM support, granularity (minimum and recommended),
//! the driver's reserve, the address-space limit, peer access, fabric and RDMA support, and
//! injected failures (`CISTERN_FAKECUDA_FAIL`: `cuMemCreate:3` fails the simulator's third
//! `cuMemCreate`; `cuEventQuery:3=700` makes the third `cuEventQuery` return 700). A value that
//! cannot be used is reported on stderr and its default used instead.
//!
//! # Rules (the real driver's, each export's documentation says which)
//!
//! * **Results**: only codes of the real `CUresult` enum, each described by `cuGetErrorString`.
//!   Every call but `cuInit`, `cuGetErrorString` and `cuGetErrorName` is `CUDA_ERROR_NOT_INITIALIZED` before a
//!   successful `cuInit`, and `CUDA_ERROR_DEINITIALIZED` once the process has begun exiting (an
//!   `atexit` hook registered by `cuInit`). A null output pointer is `CUDA_ERROR_INVALID_VALUE`.
//!   No panic crosses the boundary (a caught one is `CUDA_ERROR_UNKNOWN`).
//! * **Contexts** ([`context`]): only primary contexts exist (`cuCtxCreate` is not exported),
//!   reference-counted; each thread has a context *stack* (`cuCtxPushCurrent_v2`,
//!   `cuCtxPopCurrent_v2`, `cuCtxSetCurrent` replacing the top, `cuCtxGetCurrent` reading it).
//!   Calls the driver documents as acting on the current context need one
//!   (`CUDA_ERROR_INVALID_CONTEXT`). A sticky error (700, 719) corrupts the context: every later
//!   call on it returns the same code.
//! * **Streams and events** ([`streams`]): real stream objects of the current context;
//!   unknown or destroyed handles are `CUDA_ERROR_INVALID_HANDLE`; `0` and `CU_STREAM_LEGACY`
//!   name the current context's legacy stream, `CU_STREAM_PER_THREAD` a stream of the calling
//!   thread. Each resolved stream is a distinct simulator stream, never reused.
//! * **Stream capture** ([`capture`]): capture modes, the "potentially unsafe" calls they
//!   prohibit (900, invalidating the capture: `cuStreamEndCapture` then returns 901), captured
//!   events (907), the legacy stream's implicit dependency on capturing blocking streams (906).
//! * **Memory** ([`memory`]): one address space for all devices under a limit, the driver's
//!   reserve, recommended granularity, peer access through `cuMemSetAccess`, deferred release of
//!   mapped handles, `cuMemCreate`'s property validation.
//! * **Hooks** ([`hooks`]): simulated work on streams, hazard and access checks.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]
// The exports keep the CUDA driver API's names.
#![allow(non_snake_case)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, Once, OnceLock};
use std::thread::ThreadId;

use cistern::driver::cuda::CUDA_SYMBOLS;
use cistern::driver::{DeviceCaps, Driver, DriverError};
use cistern::{SimConfig, SimDriver};

pub use cudarc::driver::sys::CUresult;
use CUresult::*;

pub mod capture;
pub mod context;
pub mod hooks;
pub mod knobs;
pub mod memory;
pub mod share;
pub mod streams;

use knobs::Knobs;

/// CUDA driver functions the fake exports for its clients (tests, the CUDA runtime, PyTorch)
/// beyond what cistern's backend resolves ([`CUDA_SYMBOLS`]). Overlaps with it are allowed.
pub const CLIENT_SYMBOLS: [&str; 17] = [
    "cuGetErrorName",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuDeviceCanAccessPeer",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuStreamGetId",
    "cuStreamGetCtx",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo_v2",
    "cuThreadExchangeStreamCaptureMode",
    "cuGraphDestroy",
];

/// The fake's test hooks, not CUDA functions (see [`hooks`]).
pub const HOOK_SYMBOLS: [&str; 5] = [
    "cisternFakeLaunch",
    "cisternFakeComplete",
    "cisternFakeHazards",
    "cisternFakePrintHazards",
    "cisternFakeOrigin",
];

/// Every function the library exports: [`CUDA_SYMBOLS`] ∪ [`CLIENT_SYMBOLS`] ∪
/// [`HOOK_SYMBOLS`], each once, sorted.
pub fn exported_symbols() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = CUDA_SYMBOLS
        .iter()
        .chain(CLIENT_SYMBOLS.iter())
        .chain(HOOK_SYMBOLS.iter())
        .copied()
        .collect();
    all.sort_unstable();
    all.dedup();
    all
}

/// The exported CUDA function `name` names, with or without its `_v2` suffix.
pub fn exported_function(name: &str) -> Option<&'static str> {
    CUDA_SYMBOLS
        .iter()
        .chain(CLIENT_SYMBOLS.iter())
        .copied()
        .find(|s| *s == name || s.strip_suffix("_v2") == Some(name))
}

/// Whether `code` is one the fake describes (and so may return).
pub fn described(code: u32) -> bool {
    ERROR_STRINGS.iter().any(|(r, _)| *r as u32 == code)
}

/// The `CUresult` with value `code`, when the fake describes it.
fn result_of(code: u32) -> Option<CUresult> {
    ERROR_STRINGS
        .iter()
        .map(|(r, _)| *r)
        .find(|r| *r as u32 == code)
}

/// Whether `r` is a sticky error: the context is unusable afterwards ("the CUDA context ... is
/// in an inconsistent state ... the process must be terminated and relaunched", the driver API's
/// description of `CUDA_ERROR_ILLEGAL_ADDRESS` and `CUDA_ERROR_LAUNCH_FAILED`).
pub fn is_sticky(r: CUresult) -> bool {
    matches!(r, CUDA_ERROR_ILLEGAL_ADDRESS | CUDA_ERROR_LAUNCH_FAILED)
}

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
    /// `CUmemAllocationHandleType` bits: 0 (none) or 1 (POSIX fd), 8 (fabric) where supported.
    pub requestedHandleTypes: c_uint,
    /// Where the memory lives.
    pub location: CUmemLocation,
    /// Windows only (ignored).
    pub win32HandleMetaData: *mut c_void,
    /// `compressionType` (byte 0), `gpuDirectRDMACapable` (byte 1), `usage` (bytes 2-3) and
    /// four reserved bytes, checked by `cuMemCreate`.
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
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
const ATTR_POSIX_FD: c_uint = 103;

/// The description of each code the fake can return, as the real driver words it.
const ERROR_STRINGS: [(CUresult, &CStr); 26] = [
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
    (CUDA_ERROR_NOT_PERMITTED, c"operation not permitted"),
    (CUDA_ERROR_UNKNOWN, c"unknown error"),
    (
        CUDA_ERROR_ILLEGAL_ADDRESS,
        c"an illegal memory access was encountered",
    ),
    (CUDA_ERROR_LAUNCH_FAILED, c"unspecified launch failure"),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        c"the operation cannot be performed in the present state",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        c"operation not permitted when stream is capturing",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        c"operation failed due to a previous error during capture",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_MERGE,
        c"operation would result in a merge of separate capture sequences",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
        c"capture was not ended in the same stream as it began",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
        c"capturing stream has unjoined work",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
        c"dependency created on uncaptured work in another stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        c"operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        CUDA_ERROR_CAPTURED_EVENT,
        c"operation not permitted on an event last recorded in a capturing stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
        c"attempt to terminate a thread-local capture sequence from another thread",
    ),
];

// ---------------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------------

/// A device's primary context; its address is the `CUcontext`.
#[derive(Debug)]
pub(crate) struct PrimaryCtx {
    pub(crate) dev: usize,
    pub(crate) refs: AtomicU32,
}

/// A physical handle from `cuMemCreate`.
#[derive(Debug)]
pub(crate) struct Handle {
    pub(crate) dev: usize,
    /// Live mappings of it.
    pub(crate) maps: u32,
    /// `cuMemRelease` was called while it was mapped: freed at its last `cuMemUnmap`.
    pub(crate) released: bool,
    /// Its size in bytes.
    pub(crate) size: u64,
    /// The handle types it may be exported as (`requestedHandleTypes`).
    pub(crate) types: c_uint,
    /// For a handle imported from another process: (that process's id, its handle).
    pub(crate) origin: Option<(u64, u64)>,
}

/// A mapping made by `cuMemMap`.
#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) size: u64,
    pub(crate) handle: u64,
    /// The device that owns the memory (the handle's).
    pub(crate) dev: usize,
    /// Bit `d`: device `d` was granted read-write access.
    pub(crate) access: u32,
}

/// An event from `cuEventCreate`.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) dev: usize,
    /// The simulator stream of its last record outside a capture.
    pub(crate) recorded: Option<u64>,
    /// Its last record was into a capture (the capture's id).
    pub(crate) captured: Option<u64>,
}

/// What a resolved stream is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum StreamKind {
    /// From `cuStreamCreate`.
    Created,
    /// A context's legacy default stream (`0`, `CU_STREAM_LEGACY`).
    Legacy,
    /// A thread's per-thread default stream (`CU_STREAM_PER_THREAD`).
    PerThread,
}

/// A stream, keyed in [`State::streams`] by its simulator stream id (also its `cuStreamGetId`).
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) dev: usize,
    pub(crate) kind: StreamKind,
    /// Synchronises with the legacy stream (created with flags 0, or a per-thread stream).
    pub(crate) blocking: bool,
    /// The capture it takes part in.
    pub(crate) capture: Option<u64>,
    /// Bit `d`: simulated work of this stream was queued on device `d`'s memory.
    pub(crate) work_devs: u32,
}

/// A stream capture sequence.
#[derive(Debug)]
pub(crate) struct Capture {
    pub(crate) mode: c_uint,
    pub(crate) thread: ThreadId,
    /// The stream it began on.
    pub(crate) origin: u64,
    pub(crate) invalidated: bool,
    /// The graph `cuStreamEndCapture` returns.
    pub(crate) graph: u64,
}

/// Everything the CUDA face adds to the simulator, under one lock (held across the simulator
/// calls each export makes, so that every export is atomic).
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Reservation start -> (size, device whose simulator holds it).
    pub(crate) reservations: BTreeMap<u64, (u64, usize)>,
    /// Bytes reserved, all devices together.
    pub(crate) reserved: u64,
    pub(crate) handles: HashMap<u64, Handle>,
    /// Mapping start -> mapping.
    pub(crate) mappings: BTreeMap<u64, Mapping>,
    /// Linear allocation base -> (size, device).
    pub(crate) linear: BTreeMap<u64, (u64, usize)>,
    /// Linear allocations opened with `cuIpcOpenMemHandle`: base here -> (the exporting
    /// process's id, the allocation's base there).
    pub(crate) opened: BTreeMap<u64, (u64, u64)>,
    pub(crate) events: HashMap<u64, Event>,
    /// Simulator stream id -> stream.
    pub(crate) streams: HashMap<u64, Stream>,
    /// `CUstream` of a created stream -> its simulator stream id.
    pub(crate) created: HashMap<u64, u64>,
    /// Per device: the simulator stream id of its legacy stream.
    pub(crate) legacy: Vec<u64>,
    /// (thread, device) -> the simulator stream id of that thread's per-thread stream.
    pub(crate) per_thread: HashMap<(ThreadId, usize), u64>,
    /// Capture id -> capture.
    pub(crate) captures: HashMap<u64, Capture>,
    /// Graphs from `cuStreamEndCapture`, not yet destroyed.
    pub(crate) graphs: HashSet<u64>,
    /// Per device: the sticky error that corrupted its primary context.
    pub(crate) sticky: Vec<Option<CUresult>>,
    /// Calls per export, for the coded faults.
    pub(crate) calls: HashMap<&'static str, u64>,
    /// Source of simulator stream ids, capture ids and graph handles (never 0, never reused).
    pub(crate) next: u64,
}

impl State {
    /// A fresh id (simulator stream ids start above the special handles 0, 1, 2).
    pub(crate) fn new_id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// `Err(code)` when device `dev`'s context was corrupted by a sticky error.
    pub(crate) fn alive(&self, dev: usize) -> Result<(), CUresult> {
        match self.sticky.get(dev).copied().flatten() {
            Some(r) => Err(r),
            None => Ok(()),
        }
    }

    /// Corrupts device `dev`'s context with the sticky error `r`, and returns `r`.
    pub(crate) fn corrupt(&mut self, dev: usize, r: CUresult) -> CUresult {
        if let Some(s) = self.sticky.get_mut(dev) {
            s.get_or_insert(r);
        }
        r
    }
}

/// The fake driver: the simulator and what the CUDA face adds to it.
pub(crate) struct Fake {
    pub(crate) sim: SimDriver,
    pub(crate) knobs: Knobs,
    /// Read from the simulator at `cuInit`.
    pub(crate) caps: Vec<DeviceCaps>,
    /// One per device; boxed so that the addresses never move.
    pub(crate) ctxs: Box<[PrimaryCtx]>,
    /// The address-space limit: the knob, lowered to `RLIMIT_AS` when that is set.
    pub(crate) va_limit: u64,
    /// Per device: a simulator event `cuStreamQuery` records to probe a stream.
    pub(crate) probes: Vec<u64>,
    state: Mutex<State>,
}

static FAKE: OnceLock<Fake> = OnceLock::new();

/// Set by the `atexit` hook: the process is exiting and the driver is shutting down.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Runs at process exit, before the `atexit` handlers registered before `cuInit` and the static
/// destructors of libraries loaded before this one.
extern "C" fn at_exit() {
    EXITING.store(true, Ordering::SeqCst);
}

/// The address-space limit `RLIMIT_AS` sets, when it is set.
fn rlimit_as() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a live, writable rlimit; getrlimit only writes it.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
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
                .vmm(knobs.vmm)
                // The driver's reserve: memory nothing can allocate, on every device.
                .other_process_bytes(knobs.reserve),
        );
        let caps = (0..knobs.devices)
            .map(|d| {
                sim.capabilities(d).unwrap_or_else(|_| DeviceCaps {
                    total_memory: knobs.capacity,
                    vmm: knobs.vmm,
                    granularity: knobs.granularity,
                    name: "cistern-sim".into(),
                    uuid: None,
                    posix_fd_handles: knobs.vmm,
                })
            })
            .collect();
        let probes = (0..knobs.devices)
            .map(|d| sim.event_create(d).map(|e| e.0).unwrap_or(0))
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
        let mut state = State {
            sticky: vec![None; knobs.devices],
            ..State::default()
        };
        state.next = 2;
        for dev in 0..knobs.devices {
            let sid = state.new_id();
            state.legacy.push(sid);
            state.streams.insert(
                sid,
                Stream {
                    dev,
                    kind: StreamKind::Legacy,
                    blocking: true,
                    capture: None,
                    work_devs: 0,
                },
            );
        }
        let va_limit = match rlimit_as() {
            Some(r) => knobs.va_limit.min(r),
            None => knobs.va_limit,
        };
        Fake {
            sim,
            knobs,
            caps,
            ctxs,
            va_limit,
            probes,
            state: Mutex::new(state),
        }
    }

    /// The CUDA face's state, locked.
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        // Every export checks before it changes anything, and a panic (caught at the boundary)
        // can only come from a bug; the state of a poisoned lock is used as it is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Device ordinal `d`, checked.
    pub(crate) fn device(&self, d: CUdevice) -> Result<usize, CUresult> {
        usize::try_from(d)
            .ok()
            .filter(|&d| d < self.ctxs.len())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    pub(crate) fn ctx_ptr(&self, dev: usize) -> CUcontext {
        &self.ctxs[dev] as *const PrimaryCtx as CUcontext
    }

    pub(crate) fn ctx_at(&self, addr: usize) -> Option<&PrimaryCtx> {
        self.ctxs
            .iter()
            .find(|&c| std::ptr::eq(c, addr as *const PrimaryCtx))
    }

    /// The device of the calling thread's current context, which must be retained and not
    /// corrupted by a sticky error.
    pub(crate) fn current(&self, st: &State) -> Result<usize, CUresult> {
        let addr = context::top();
        let dev = match self.ctx_at(addr) {
            Some(c) if c.refs.load(Ordering::Acquire) > 0 => c.dev,
            _ => return Err(CUDA_ERROR_INVALID_CONTEXT),
        };
        st.alive(dev)?;
        Ok(dev)
    }

    pub(crate) fn vmm(&self) -> Result<(), CUresult> {
        if self.knobs.vmm {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_SUPPORTED)
        }
    }

    /// Whether device `peer` can access memory of device `dev` (`cuDeviceCanAccessPeer`).
    pub(crate) fn can_access_peer(&self, dev: usize, peer: usize) -> bool {
        dev != peer && self.knobs.peers
    }

    /// Applies the coded faults (`cuName:N=CODE`) to a call of `name`.
    fn coded_fault(&self, name: &'static str) -> Result<(), CUresult> {
        if self.knobs.coded_faults.is_empty() {
            return Ok(());
        }
        let mut st = self.state();
        let n = {
            let c = st.calls.entry(name).or_insert(0);
            *c += 1;
            *c
        };
        let hit = self
            .knobs
            .coded_faults
            .iter()
            .find(|f| f.function == name && (n == f.nth || (f.and_after && n > f.nth)));
        let Some(r) = hit.and_then(|f| result_of(f.code)) else {
            return Ok(());
        };
        if is_sticky(r) {
            let dev = self.ctx_at(context::top()).map_or(0, |c| c.dev);
            st.corrupt(dev, r);
        }
        Err(r)
    }

    /// Says on stderr what is still live on `dev` when its primary context is released.
    pub(crate) fn report_leaks(&self, dev: usize) {
        let s = &self.sim;
        let (handles, mapped, reserved, linear, events) = (
            s.live_handles(dev),
            s.mapped_bytes(dev),
            s.reserved_va_bytes(dev),
            s.live_linear_allocations(dev),
            // Less the fake's own probe event.
            s.live_events(dev).saturating_sub(1),
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
pub(crate) fn code(e: &DriverError) -> CUresult {
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

/// Runs the export `name`'s body: `CUDA_ERROR_DEINITIALIZED` once the process is exiting, the
/// coded faults, and a panic becomes `CUDA_ERROR_UNKNOWN`, never an unwind into C.
pub(crate) fn entry(name: &'static str, body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    if EXITING.load(Ordering::SeqCst) {
        return CUDA_ERROR_DEINITIALIZED;
    }
    let run = || {
        if let Some(f) = FAKE.get() {
            f.coded_fault(name)?;
        }
        body()
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(r)) => r,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// The fake, once `cuInit` succeeded.
pub(crate) fn fake() -> Result<&'static Fake, CUresult> {
    FAKE.get().ok_or(CUDA_ERROR_NOT_INITIALIZED)
}

/// Writes `v` through an output pointer, refusing null.
///
/// # Safety
///
/// `p` is null or valid for writing a `T` (the C API's contract for output arguments).
pub(crate) unsafe fn put<T>(p: *mut T, v: T) -> Result<(), CUresult> {
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
pub(crate) unsafe fn get<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and readable by this function's contract; `T: Copy` and every field of
    // the C structs read here is an integer or a raw pointer, valid for any bit pattern.
    Ok(unsafe { p.read_unaligned() })
}

pub(crate) fn size(v: usize) -> u64 {
    v as u64
}

// ---------------------------------------------------------------------------------------------
// Initialisation and errors
// ---------------------------------------------------------------------------------------------

/// `cuInit`: starts the simulator with the knobs of the environment, and registers the `atexit`
/// hook after which every call is `CUDA_ERROR_DEINITIALIZED` (the driver API: "This indicates
/// that the CUDA driver is in the process of shutting down"). Refuses with
/// `CUDA_ERROR_STUB_LIBRARY` (and one line on stderr) unless `CISTERN_FAKECUDA=1`.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry("cuInit", || {
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
        static HOOK: Once = Once::new();
        HOOK.call_once(|| {
            // SAFETY: `at_exit` is an `extern "C" fn()` that never unwinds and lives as long as
            // the library, which is never unloaded once initialised (cudarc keeps it loaded).
            if unsafe { libc::atexit(at_exit) } != 0 {
                eprintln!("cistern-fakecuda: atexit failed; no CUDA_ERROR_DEINITIALIZED at exit");
            }
        });
        Ok(())
    })
}

/// `cuGetErrorString`: a static description of `error`; an unknown code stores NULL and returns
/// `CUDA_ERROR_INVALID_VALUE`. Works before `cuInit` and during exit.
///
/// # Safety
///
/// `pStr` is null or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: c_uint, pStr: *mut *const c_char) -> CUresult {
    // SAFETY: the caller's contract on `pStr` is this function's.
    unsafe {
        static_text(pStr, || {
            ERROR_STRINGS
                .iter()
                .find(|(r, _)| *r as c_uint == error)
                .map(|(_, s)| s.as_ptr())
        })
    }
}

/// `cuGetErrorName`: the name of `error` as the `CUresult` enum spells it
/// (`"CUDA_ERROR_OUT_OF_MEMORY"`), static for the process's life; an unknown code stores NULL
/// and returns `CUDA_ERROR_INVALID_VALUE`, as `cuGetErrorString` does. Works before `cuInit`
/// and during exit.
///
/// # Safety
///
/// `pStr` is null or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: c_uint, pStr: *mut *const c_char) -> CUresult {
    static NAMES: OnceLock<Vec<(c_uint, CString)>> = OnceLock::new();
    // SAFETY: the caller's contract on `pStr` is this function's.
    unsafe {
        static_text(pStr, || {
            NAMES
                .get_or_init(|| {
                    ERROR_STRINGS
                        .iter()
                        .map(|(r, _)| {
                            let name =
                                CString::new(format!("{r:?}")).expect("no NUL in a variant name");
                            (*r as c_uint, name)
                        })
                        .collect()
                })
                .iter()
                .find(|(r, _)| *r == error)
                .map(|(_, s)| s.as_ptr())
        })
    }
}

/// What `cuGetErrorString` and `cuGetErrorName` share: stores the static text `lookup` finds
/// (NULL when none, then `CUDA_ERROR_INVALID_VALUE`) at `pStr`; never panics across the
/// boundary (`CUDA_ERROR_UNKNOWN`).
///
/// # Safety
///
/// `pStr` is null or valid for writing a pointer.
unsafe fn static_text(
    pStr: *mut *const c_char,
    lookup: impl FnOnce() -> Option<*const c_char>,
) -> CUresult {
    let body = || {
        let text = lookup();
        // SAFETY: `pStr` is null or writable (this function's contract); `put` refuses null.
        unsafe { put(pStr, text.unwrap_or(std::ptr::null())) }?;
        text.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
    };
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(r)) => r,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
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
    entry("cuDeviceGetCount", || {
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
    entry("cuDeviceGet", || {
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
    entry("cuDeviceGetName", || {
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
    entry("cuDeviceGetUuid_v2", || {
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
    entry("cuDeviceTotalMem_v2", || {
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
    entry("cuDeviceGetAttribute", || {
        let f = fake()?;
        if pi.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.device(dev)?;
        let caps = f.sim.capabilities(d).map_err(|e| code(&e))?;
        let v = match attrib {
            ATTR_VMM => c_int::from(caps.vmm),
            ATTR_POSIX_FD => c_int::from(caps.vmm),
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
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
                as c_uint,
            ATTR_POSIX_FD
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
    fn every_code_the_sources_name_is_described() {
        // Every `CUDA_ERROR_*` the fake's sources return (or mention) is one it describes, so
        // it never returns a code `cuGetErrorString` does not know.
        let sources = [
            include_str!("lib.rs"),
            include_str!("context.rs"),
            include_str!("streams.rs"),
            include_str!("capture.rs"),
            include_str!("memory.rs"),
            include_str!("hooks.rs"),
        ];
        let described: Vec<String> = ERROR_STRINGS
            .iter()
            .map(|(r, _)| format!("{r:?}"))
            .collect();
        let mut seen = 0;
        for src in sources {
            for word in src.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("CUDA_ERROR_") && word != "CUDA_ERROR_" {
                    seen += 1;
                    assert!(
                        described.iter().any(|d| d == word),
                        "{word} is not described"
                    );
                }
            }
        }
        assert!(seen > 50, "{seen}");
    }

    #[test]
    fn symbol_lists_and_names() {
        let all = exported_symbols();
        assert_eq!(
            all.len(),
            CUDA_SYMBOLS.len() + CLIENT_SYMBOLS.len() + HOOK_SYMBOLS.len()
                - CLIENT_SYMBOLS
                    .iter()
                    .filter(|s| CUDA_SYMBOLS.contains(s))
                    .count()
        );
        assert_eq!(exported_function("cuMemAlloc"), Some("cuMemAlloc_v2"));
        assert_eq!(exported_function("cuStreamCreate"), Some("cuStreamCreate"));
        assert_eq!(
            exported_function("cisternFakeLaunch"),
            None,
            "hooks take no faults"
        );
        assert_eq!(exported_function("cuLaunchKernel"), None);
        assert!(described(700) && described(907) && !described(12345));
        assert!(is_sticky(CUDA_ERROR_ILLEGAL_ADDRESS) && is_sticky(CUDA_ERROR_LAUNCH_FAILED));
        assert!(!is_sticky(CUDA_ERROR_OUT_OF_MEMORY));
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

    #[test]
    fn error_names_are_the_enums_and_unknown_codes_are_refused() {
        let mut text: *const c_char = std::ptr::null();
        for (code, name) in [
            (2, c"CUDA_ERROR_OUT_OF_MEMORY"),
            (900, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
            (907, c"CUDA_ERROR_CAPTURED_EVENT"),
        ] {
            // SAFETY: `text` is a live, writable pointer.
            let r = unsafe { cuGetErrorName(code, &mut text) };
            assert_eq!(r, CUDA_SUCCESS);
            // SAFETY: on success the pointer is one of the static names.
            assert_eq!(unsafe { CStr::from_ptr(text) }, name);
        }
        // SAFETY: as above.
        let r = unsafe { cuGetErrorName(123_456, &mut text) };
        assert_eq!(r, CUDA_ERROR_INVALID_VALUE);
        assert!(text.is_null());
        // SAFETY: a null output pointer is refused, not written.
        let r = unsafe { cuGetErrorName(2, std::ptr::null_mut()) };
        assert_eq!(r, CUDA_ERROR_INVALID_VALUE);
    }
}
