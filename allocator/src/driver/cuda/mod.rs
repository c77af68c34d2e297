//! The CUDA driver backend: the only place cistern calls CUDA.
//!
//! [`CudaDriver`] implements [`Driver`] over the CUDA driver API, opened at run time from
//! `libcuda.so.1` by [`api`] (cudarc provides the types). It must never panic (every failure is a
//! [`DriverError`]), never create a context (it uses each device's *primary* context, the one
//! the CUDA runtime and PyTorch use, so its pointers are valid in their code), and never
//! synchronise on a hot path (only `event_synchronize`, `stream_synchronize`,
//! `device_synchronize` and `mem_free` may block the host, as the [contract](super) allows).
//!
//! # Loading without panics
//!
//! [`api`] resolves every function in [`CUDA_SYMBOLS`] when the library is opened, before a
//! single call; a missing library or symbol is a [`DriverErrorKind::NoDriver`] error naming the
//! fix. Which file is opened (`libcuda.so.1`, the one already in the process first) is explained
//! there. Every call also runs under `catch_unwind`, as a second line of defence.
//!
//! # Contexts
//!
//! A device's primary context is retained the first time a call needs it (so a process that uses
//! one GPU does not pay for a context on every visible GPU) and released when the driver is
//! dropped. Before each call on device `dev`, the driver compares the thread's current context
//! (`cuCtxGetCurrent`, a thread-local read inside libcuda) with `dev`'s primary context. When
//! they differ it pushes `dev`'s context for the call and pops it after (`cuCtxPushCurrent` /
//! `cuCtxPopCurrent`), so the caller's current context, or its lack of one, is exactly as it was:
//! a thread that had none is not left with cistern's (which would change the CUDA runtime's
//! notion of the current device behind the caller's back). A cache of our own in a thread-local
//! would be stale as soon as other code on the thread switches devices, so the driver keeps none.
//!
//! # Streams
//!
//! [`Driver::stream_info`] says what a handle names: `cuStreamGetCtx` and `cuCtxGetDevice` give
//! its device, `cuStreamGetId` an id that no other live stream of the process has. A stream
//! that is capturing a graph (`cuStreamIsCapturing`) is not asked for its id: the driver
//! refuses `cuStreamGetId` then and invalidates the capture, in every capture mode (measured
//! on driver 580, `scripts/gpu/capture_rules.py`); its id is
//! [`CAPTURING_ID`](crate::driver::CAPTURING_ID) with the handle's bits, and the pool finds
//! the stream's arena by its handle (`streams.rs`). The special handles
//! `0` (the legacy default stream), `CU_STREAM_LEGACY` (`0x1`, the same stream) and
//! `CU_STREAM_PER_THREAD` (`0x2`, a different stream on every thread) are resolved through the
//! device's context on the calling thread, as the driver resolves them. While a blocking stream
//! of the context captures, every use of the legacy stream, `cuStreamGetId` included, is an
//! implicit dependency on that capture, refused and invalidating it; `cuStreamIsCapturing` of
//! the legacy stream then answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` without harm (measured
//! there too), and the legacy stream is reported as capturing, named by its handle.
//!
//! # Stream capture
//!
//! Another thread (or this one) may be capturing a CUDA graph while cistern runs: PyTorch
//! allocates during `torch.cuda.graph`, whose default mode is global. In that mode the
//! calls the driver calls "potentially unsafe" (`cuMemAlloc`, `cuMemFree`, and the event, stream
//! and context queries and synchronisations) are refused and *invalidate the capture*. None of
//! cistern's such calls is part of the user's graph, so each runs with the calling thread's
//! capture mode exchanged to relaxed for the call and put back after
//! (`cuThreadExchangeStreamCaptureMode`, as PyTorch's `CUDAStreamCaptureModeGuard` does around
//! `cudaMalloc`): a capture elsewhere is left valid. Calls that conflict with a capture
//! whatever the mode (a query of an event recorded inside one) still fail, and the pool treats
//! them as "not yet". Measured on driver 580 (`scripts/gpu/capture_rules.py`, results in
//! `tests/fakecuda/capture-rules-h200.json`), some calls break a capture in every mode, relaxed
//! too: `cuCtxSynchronize` (every capture of the context, from any thread), `cuStreamGetId` and
//! `cuStreamQuery` of the capturing stream, `cuStreamWaitEvent` of the capturing stream on an
//! event recorded outside it, and a query of an event recorded inside the capture. The pool
//! never calls `cuStreamQuery`; it asks no id of a stream [`Driver::stream_info`] finds
//! capturing; on one [`Driver::stream_capturing`] finds capturing (the legacy stream among
//! them while a blocking stream captures) it orders no move and
//! records no event to query (its cached pages are not known to be idle, and a free it used
//! waits for the capture's end); and it makes no device synchronisation while a graph pool's
//! window is open. A device synchronisation (`empty_cache`, the OOM protocol, a free whose
//! block a stream used on which no event can be recorded) is refused here, as the call would
//! invalidate it, while a capture is seen under way on the device: a blocking stream's (the
//! legacy stream answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` then), or one of a stream this
//! backend has found capturing before and that still is (asked again each time; forgotten once
//! it is not, or with [`Driver::forget_stream`]). The pool treats the refusal as any failed
//! synchronisation: the blocks waiting for it stay pending until a later one succeeds. The
//! pool asks each stream it has an arena for before it synchronises (`DeviceCore::sync_device`),
//! so the backend sees their captures too. Still breaking a capture cistern was not told of: a
//! device synchronisation while a non-blocking stream never used through cistern, or another
//! thread's per-thread stream, captures.
//!
//! # Handles
//!
//! [`StreamId`], [`EventId`] and [`PhysHandle`] carry the raw `CUstream`, `CUevent` and
//! `CUmemGenericAllocationHandle` values. The driver validates most handles it is given, but
//! passing an event or stream that was never created (or already destroyed) is outside the
//! contract and the CUDA driver does not promise to detect it; the pool only passes handles it
//! got from here or from its caller, and never a stream it knows to be gone.
#![deny(clippy::undocumented_unsafe_blocks)]
// The driver API is FFI: this module and `crate::sys` are the only ones allowed `unsafe`.
#![allow(unsafe_code)]

pub mod api;
mod call;
mod caps;
mod share;
mod streams;

use std::ffi::{c_int, c_uint};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};
use parking_lot::Mutex;

use super::{
    DeviceCaps, DeviceId, Driver, DriverCall, DriverError, DriverErrorKind, DriverResult, EventId,
    MemInfo, PhysHandle, StreamId, StreamInfo,
};

use api::Api;
pub use api::CUDA_SYMBOLS;
use call::{
    cu, cuda_error, device_location, event_ptr, pinned_on, stream_ptr, to_usize, unavailable,
};

/// How to get going when no usable driver is found; every [`CudaDriver::new`] error ends with it.
const FIX: &str =
    "install the NVIDIA driver, or set CISTERN_DRIVER=sim to run on the simulated GPU";

/// The granularity reported for devices without VMM: the size of the pool's linear segments.
const LINEAR_GRANULARITY: u64 = 2 << 20;

/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_uint = 2;

/// The code reported when the driver library cannot be loaded at all (`CUDA_ERROR_NOT_INITIALIZED`).
const CODE_NOT_LOADED: i32 = CUresult::CUDA_ERROR_NOT_INITIALIZED as i32;

/// One device as the driver knows it.
#[derive(Debug)]
struct Device {
    /// The `CUdevice` handle for this ordinal.
    cu: sys::CUdevice,
    /// The retained primary context (a `CUcontext` as an address), once a call needed it.
    ctx: OnceLock<usize>,
    /// Serialises the first retain, so the context is retained exactly once.
    retain: Mutex<()>,
    /// Capabilities, after the first query.
    caps: OnceLock<DeviceCaps>,
    /// Whether `cuMemCreate` requests POSIX file-descriptor handles: the device supports them
    /// and no creation has refused them yet (containers and WSL may refuse the type a device
    /// reports; creation then goes on without it, and export says why it cannot).
    exportable: AtomicBool,
    /// Streams (`CUstream` addresses) of this device found capturing a graph, asked again
    /// before a device synchronisation (`streams.rs`, "Stream capture" above).
    captures: Mutex<Vec<usize>>,
}

/// The CUDA driver API on each device's primary context. See the [module documentation](self).
#[derive(Debug)]
pub struct CudaDriver {
    api: &'static Api,
    devices: Vec<Device>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("libcuda")
    }
}

impl CudaDriver {
    /// Loads the CUDA driver, initialises it and enumerates the devices.
    ///
    /// Fails with [`DriverErrorKind::NoDriver`] when no driver library is installed, when it
    /// lacks a function cistern needs, or when it sees no device; every error message ends with
    /// how to fix it (install the driver, or set `CISTERN_DRIVER=sim`). Never panics.
    pub fn new() -> DriverResult<CudaDriver> {
        Self::open().map_err(|mut e| {
            e.message = format!("{}: {FIX}", e.message);
            e
        })
    }

    fn open() -> DriverResult<CudaDriver> {
        let call = DriverCall::DeviceCount;
        let api = load_library()?;
        // SAFETY: cuInit takes a plain flags word (which must be 0) and may be called any number
        // of times; every symbol was resolved by `load_library`.
        cu(call, "cuInit", || unsafe { (api.cuInit)(0) }).map_err(|mut e| {
            if e.code == CUresult::CUDA_ERROR_STUB_LIBRARY as i32 {
                e.message = format!(
                    "{}: the libcuda.so.1 on the loader's path is the CUDA toolkit's stub, not \
                     the NVIDIA driver (remove the toolkit's stubs directory from \
                     LD_LIBRARY_PATH)",
                    e.message
                );
            }
            e
        })?;
        let mut count: c_int = 0;
        // SAFETY: `count` is a live, writable c_int for the whole call.
        cu(call, "cuDeviceGetCount", || unsafe {
            (api.cuDeviceGetCount)(&mut count)
        })?;
        if count <= 0 {
            return Err(DriverError::new(
                call,
                DriverErrorKind::NoDriver,
                CUresult::CUDA_ERROR_NO_DEVICE as i32,
                "the CUDA driver sees no device (check CUDA_VISIBLE_DEVICES)",
            ));
        }
        let mut devices = Vec::with_capacity(count as usize);
        for ordinal in 0..count {
            let mut handle: sys::CUdevice = 0;
            // SAFETY: `handle` is a live, writable CUdevice; `ordinal` is in
            // `0..cuDeviceGetCount()`, and the driver checks it anyway.
            cu(call, "cuDeviceGet", || unsafe {
                (api.cuDeviceGet)(&mut handle, ordinal)
            })?;
            devices.push(Device {
                cu: handle,
                ctx: OnceLock::new(),
                retain: Mutex::new(()),
                caps: OnceLock::new(),
                exportable: AtomicBool::new(false),
                captures: Mutex::new(Vec::new()),
            });
        }
        Ok(CudaDriver { api, devices })
    }

    /// Device `dev`, or an [`DriverErrorKind::InvalidDevice`] error without asking the driver.
    fn device(&self, call: DriverCall, dev: DeviceId) -> DriverResult<&Device> {
        self.devices.get(dev).ok_or_else(|| {
            DriverError::new(
                call,
                DriverErrorKind::InvalidDevice,
                CUresult::CUDA_ERROR_INVALID_DEVICE as i32,
                format!(
                    "device {dev} does not exist: the CUDA driver sees {} device(s)",
                    self.devices.len()
                ),
            )
        })
    }

    /// The primary context of `d`, retained on first use.
    fn primary(&self, call: DriverCall, d: &Device) -> DriverResult<sys::CUcontext> {
        if let Some(&ctx) = d.ctx.get() {
            return Ok(ctx as sys::CUcontext);
        }
        let _first = d.retain.lock();
        if let Some(&ctx) = d.ctx.get() {
            return Ok(ctx as sys::CUcontext);
        }
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `ctx` is a live, writable CUcontext; `d.cu` came from cuDeviceGet. Retaining
        // the primary context never creates a new context of ours: it activates the shared one.
        cu(call, "cuDevicePrimaryCtxRetain", || unsafe {
            (self.api.cuDevicePrimaryCtxRetain)(&mut ctx, d.cu)
        })?;
        if ctx.is_null() {
            return Err(DriverError::new(
                call,
                DriverErrorKind::Other,
                CUresult::CUDA_ERROR_INVALID_CONTEXT as i32,
                "cuDevicePrimaryCtxRetain returned a null context",
            ));
        }
        // We hold `retain` and saw the cell empty, and the cell is only set under `retain`, so
        // this set succeeds and the context is retained exactly once (released in `Drop`).
        let _ = d.ctx.set(ctx as usize);
        Ok(ctx)
    }

    /// Makes device `dev`'s primary context current on this thread until the guard drops.
    fn bind(&self, call: DriverCall, dev: DeviceId) -> DriverResult<Bound> {
        let d = self.device(call, dev)?;
        let ctx = self.primary(call, d)?;
        self.bind_ctx(call, ctx)
    }

    /// Makes `ctx` current on this thread until the guard drops: pushed on the thread's context
    /// stack when another context (or none) is current, and popped again by the guard.
    fn bind_ctx(&self, call: DriverCall, ctx: sys::CUcontext) -> DriverResult<Bound> {
        let api = self.api;
        let mut current: sys::CUcontext = ptr::null_mut();
        // SAFETY: `current` is a live, writable CUcontext; the call only reads the thread's
        // context stack.
        cu(call, "cuCtxGetCurrent", || unsafe {
            (api.cuCtxGetCurrent)(&mut current)
        })?;
        if current == ctx {
            return Ok(Bound { api, pushed: false });
        }
        // SAFETY: `ctx` is a primary context we retained (see `primary`) and do not release
        // before `self` drops, or the context of a live stream the caller gave us; either is
        // valid to make current.
        cu(call, "cuCtxPushCurrent_v2", || unsafe {
            (api.cuCtxPushCurrent_v2)(ctx)
        })?;
        Ok(Bound { api, pushed: true })
    }

    /// The ordinal of the device `ctx` belongs to: a retained primary context is recognised
    /// without a driver call; any other context is asked (`cuCtxGetDevice` with it pushed).
    fn device_of_ctx(&self, call: DriverCall, ctx: sys::CUcontext) -> DriverResult<DeviceId> {
        if let Some(i) = self
            .devices
            .iter()
            .position(|d| d.ctx.get() == Some(&(ctx as usize)))
        {
            return Ok(i);
        }
        let api = self.api;
        let mut cu_dev: sys::CUdevice = 0;
        {
            let _bound = self.bind_ctx(call, ctx)?;
            // SAFETY: `cu_dev` is a live, writable CUdevice; `ctx` is current (bound above).
            cu(call, "cuCtxGetDevice", || unsafe {
                (api.cuCtxGetDevice)(&mut cu_dev)
            })?;
        }
        self.devices
            .iter()
            .position(|d| d.cu == cu_dev)
            .ok_or_else(|| {
                DriverError::new(
                    call,
                    DriverErrorKind::InvalidDevice,
                    CUresult::CUDA_ERROR_INVALID_DEVICE as i32,
                    format!(
                        "the stream's context is on CUdevice {cu_dev}, which cistern does not see"
                    ),
                )
            })
    }

    /// Runs `f` with this thread's stream-capture mode relaxed (see the module documentation).
    fn relaxed<R>(&self, f: impl FnOnce() -> R) -> R {
        let api = self.api;
        let mut mode: c_uint = CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a live, writable integer holding a valid mode; the driver stores
        // the thread's previous mode in it.
        let swapped = matches!(
            catch_unwind(AssertUnwindSafe(|| unsafe {
                (api.cuThreadExchangeStreamCaptureMode)(&mut mode)
            })),
            Ok(CUresult::CUDA_SUCCESS)
        );
        let r = f();
        if swapped {
            // SAFETY: as above; `mode` now holds the mode to put back.
            let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
                (api.cuThreadExchangeStreamCaptureMode)(&mut mode)
            }));
        }
        r
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        for d in &self.devices {
            if d.ctx.get().is_some() {
                let (handle, api) = (d.cu, self.api);
                // SAFETY: this device's primary context was retained exactly once (`primary`)
                // and is released exactly once, here; nothing of ours uses it afterwards.
                let _ = catch_unwind(|| unsafe { (api.cuDevicePrimaryCtxRelease_v2)(handle) });
            }
        }
    }
}

/// Pops the context [`CudaDriver::bind_ctx`] pushed.
struct Bound {
    api: &'static Api,
    pushed: bool,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if self.pushed {
            let api = self.api;
            let mut popped: sys::CUcontext = ptr::null_mut();
            // SAFETY: `popped` is a live, writable CUcontext; the context pushed by `bind_ctx`
            // is on top of this thread's stack (the call in between does not push or pop), so
            // the pop restores exactly what the caller had current.
            let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
                (api.cuCtxPopCurrent_v2)(&mut popped)
            }));
        }
    }
}

/// Opens the driver library and resolves [`CUDA_SYMBOLS`], without panicking.
fn load_library() -> DriverResult<&'static Api> {
    let not_loaded = |message: String| {
        DriverError::new(
            DriverCall::DeviceCount,
            DriverErrorKind::NoDriver,
            CODE_NOT_LOADED,
            message,
        )
    };
    match catch_unwind(api::api) {
        Ok(Ok(api)) => Ok(api),
        Ok(Err(api::OpenError::NotFound(why))) => Err(not_loaded(format!(
            "no CUDA driver (libcuda.so.1) found ({why})"
        ))),
        Ok(Err(api::OpenError::Missing(name, missing))) => Err(not_loaded(format!(
            "the CUDA driver library ({name}) lacks {missing:?}: it is older than CUDA 12 or \
             not the NVIDIA driver"
        ))),
        Err(_) => Err(not_loaded(
            "a CUDA driver library (libcuda.so.1) was found but could not be loaded".into(),
        )),
    }
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> DriverResult<usize> {
        // Counted by cuDeviceGetCount in `new`; the set of visible devices cannot change after
        // cuInit.
        Ok(self.devices.len())
    }

    fn capabilities(&self, dev: DeviceId) -> DriverResult<DeviceCaps> {
        let d = self.device(DriverCall::Capabilities, dev)?;
        if let Some(caps) = d.caps.get() {
            return Ok(caps.clone());
        }
        let caps = self.query_caps(d)?;
        Ok(d.caps
            .get_or_init(|| {
                // Once: a later query must not turn exports back on after a refusal.
                d.exportable.store(caps.posix_fd_handles, Ordering::Relaxed);
                caps
            })
            .clone())
    }

    fn mem_info(&self, dev: DeviceId) -> DriverResult<MemInfo> {
        let call = DriverCall::MemInfo;
        let _bound = self.bind(call, dev)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are live, writable usizes; dev's context is current.
        cu(call, "cuMemGetInfo_v2", || unsafe {
            (self.api.cuMemGetInfo_v2)(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn reserve_va(&self, dev: DeviceId, size: u64, align: u64) -> DriverResult<u64> {
        let call = DriverCall::ReserveVa;
        let (size, align) = (to_usize(call, size)?, to_usize(call, align)?);
        let _bound = self.bind(call, dev)?;
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a live, writable CUdeviceptr; no fixed address (0) and no flags are
        // requested, and the driver validates size and alignment.
        cu(call, "cuMemAddressReserve", || unsafe {
            (self.api.cuMemAddressReserve)(&mut addr, size, align, 0, 0)
        })?;
        Ok(addr)
    }

    fn free_va(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        let call = DriverCall::FreeVa;
        let size = to_usize(call, size)?;
        let _bound = self.bind(call, dev)?;
        // SAFETY: plain values; the driver checks that `[addr, addr + size)` is a reservation.
        cu(call, "cuMemAddressFree", || unsafe {
            (self.api.cuMemAddressFree)(addr, size)
        })
    }

    fn create_physical(&self, dev: DeviceId, size: u64) -> DriverResult<PhysHandle> {
        let call = DriverCall::CreatePhysical;
        let size = to_usize(call, size)?;
        let _bound = self.bind(call, dev)?;
        let d = self.device(call, dev)?;
        if d.caps.get().is_none() {
            self.capabilities(dev)?;
        }
        let mut prop = pinned_on(d.cu);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let exportable = d.exportable.load(Ordering::Relaxed);
        if exportable {
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        // SAFETY: `handle` is a live, writable handle and `prop` a fully initialised property
        // that outlives the call; flags must be 0.
        let r = cu(call, "cuMemCreate", || unsafe {
            (self.api.cuMemCreate)(&mut handle, size, &prop, 0)
        });
        // Codes with which a driver refuses the handle type itself (containers, WSL).
        const REFUSALS: [CUresult; 3] = [
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
            CUresult::CUDA_ERROR_NOT_PERMITTED,
            CUresult::CUDA_ERROR_INVALID_VALUE,
        ];
        match r {
            Err(e) if exportable && REFUSALS.iter().any(|&c| c as i32 == e.code) => {
                prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
                // SAFETY: as above.
                cu(call, "cuMemCreate", || unsafe {
                    (self.api.cuMemCreate)(&mut handle, size, &prop, 0)
                })?;
                // Plain handles work where exportable ones do not: create plain ones from now
                // on; sharing then says the driver refused exportable handles.
                d.exportable.store(false, Ordering::Relaxed);
            }
            r => r?,
        }
        Ok(PhysHandle(handle))
    }

    fn export_handle(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<OwnedFd> {
        self.export_fd(dev, handle)
    }

    fn import_handle(&self, dev: DeviceId, fd: BorrowedFd<'_>) -> DriverResult<PhysHandle> {
        self.import_fd(dev, fd)
    }

    fn ipc_get_handle(&self, dev: DeviceId, ptr: u64) -> DriverResult<[u8; 64]> {
        self.ipc_handle_of(dev, ptr)
    }

    fn ipc_open(&self, dev: DeviceId, handle: &[u8; 64]) -> DriverResult<u64> {
        self.ipc_open_handle(dev, handle)
    }

    fn ipc_close(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        self.ipc_close_handle(dev, ptr)
    }

    fn release_physical(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<()> {
        let call = DriverCall::ReleasePhysical;
        let _bound = self.bind(call, dev)?;
        // SAFETY: a plain handle value, which the driver validates.
        cu(call, "cuMemRelease", || unsafe {
            (self.api.cuMemRelease)(handle.0)
        })
    }

    fn map(&self, dev: DeviceId, addr: u64, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let call = DriverCall::Map;
        let size = to_usize(call, size)?;
        let _bound = self.bind(call, dev)?;
        // SAFETY: plain values; the driver checks that the range lies in a reservation, is free,
        // and that `size` covers the handle (offset 0 and flags 0 are the only legal values).
        cu(call, "cuMemMap", || unsafe {
            (self.api.cuMemMap)(addr, size, 0, handle.0, 0)
        })
    }

    fn unmap(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        let call = DriverCall::Unmap;
        let size = to_usize(call, size)?;
        let _bound = self.bind(call, dev)?;
        // SAFETY: plain values the driver validates. That no queued work still touches the
        // range is the caller's duty, stated in the contract.
        cu(call, "cuMemUnmap", || unsafe {
            (self.api.cuMemUnmap)(addr, size)
        })
    }

    fn set_access(
        &self,
        dev: DeviceId,
        addr: u64,
        size: u64,
        peers: &[DeviceId],
    ) -> DriverResult<()> {
        let call = DriverCall::SetAccess;
        let size = to_usize(call, size)?;
        let _bound = self.bind(call, dev)?;
        let descs = std::iter::once(dev)
            .chain(peers.iter().copied().filter(|&p| p != dev))
            .map(|d| {
                Ok(sys::CUmemAccessDesc {
                    location: device_location(self.device(call, d)?.cu),
                    flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                })
            })
            .collect::<DriverResult<Vec<_>>>()?;
        // SAFETY: `descs` holds `descs.len()` fully initialised descriptors and outlives the
        // call; the driver validates the range and each location.
        cu(call, "cuMemSetAccess", || unsafe {
            (self.api.cuMemSetAccess)(addr, size, descs.as_ptr(), descs.len())
        })
    }

    fn can_access_peer(&self, dev: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        let call = DriverCall::Capabilities;
        let (d, p) = (self.device(call, dev)?.cu, self.device(call, peer)?.cu);
        if dev == peer {
            return Ok(false);
        }
        let mut can: c_int = 0;
        // SAFETY: `can` is a live, writable c_int; both devices came from cuDeviceGet. The
        // query needs no context.
        cu(call, "cuDeviceCanAccessPeer", || unsafe {
            (self.api.cuDeviceCanAccessPeer)(&mut can, p, d)
        })?;
        Ok(can != 0)
    }

    fn mem_alloc(&self, dev: DeviceId, size: u64) -> DriverResult<u64> {
        let call = DriverCall::MemAlloc;
        let size = to_usize(call, size)?;
        let _bound = self.bind(call, dev)?;
        let mut ptr: sys::CUdeviceptr = 0;
        self.relaxed(|| {
            // SAFETY: `ptr` is a live, writable CUdeviceptr; dev's context is current.
            cu(call, "cuMemAlloc_v2", || unsafe {
                (self.api.cuMemAlloc_v2)(&mut ptr, size)
            })
        })?;
        Ok(ptr)
    }

    fn mem_free(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        let call = DriverCall::MemFree;
        let _bound = self.bind(call, dev)?;
        self.relaxed(|| {
            // SAFETY: a plain address; the driver refuses one that cuMemAlloc did not return.
            cu(call, "cuMemFree_v2", || unsafe {
                (self.api.cuMemFree_v2)(ptr)
            })
        })
    }

    fn event_create(&self, dev: DeviceId) -> DriverResult<EventId> {
        let call = DriverCall::EventCreate;
        let _bound = self.bind(call, dev)?;
        let mut event: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        // SAFETY: `event` is a live, writable CUevent; dev's context is current, so the event
        // belongs to it.
        cu(call, "cuEventCreate", || unsafe {
            (self.api.cuEventCreate)(&mut event, flags)
        })?;
        Ok(EventId(event as usize as u64))
    }

    fn event_record(&self, dev: DeviceId, event: EventId, stream: StreamId) -> DriverResult<()> {
        let call = DriverCall::EventRecord;
        let (ev, st) = (event_ptr(call, event)?, stream_ptr(call, stream)?);
        let _bound = self.bind(call, dev)?;
        // SAFETY: `ev` came from event_create (contract) and `st` is a stream of dev's primary
        // context or a special stream handle; the driver checks they share a context.
        cu(call, "cuEventRecord", || unsafe {
            (self.api.cuEventRecord)(ev, st)
        })
    }

    fn event_query(&self, dev: DeviceId, event: EventId) -> DriverResult<bool> {
        let call = DriverCall::EventQuery;
        let ev = event_ptr(call, event)?;
        let _bound = self.bind(call, dev)?;
        let api = self.api;
        // SAFETY: `ev` came from event_create (contract); the query never blocks.
        let query = || catch_unwind(|| unsafe { (api.cuEventQuery)(ev) });
        match self.relaxed(query) {
            Ok(CUresult::CUDA_SUCCESS) => Ok(true),
            Ok(CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            Ok(r) => Err(cuda_error(call, "cuEventQuery", r)),
            Err(_) => Err(unavailable(call, "cuEventQuery")),
        }
    }

    fn event_synchronize(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        let call = DriverCall::EventSynchronize;
        let ev = event_ptr(call, event)?;
        let _bound = self.bind(call, dev)?;
        self.relaxed(|| {
            // SAFETY: `ev` came from event_create (contract).
            cu(call, "cuEventSynchronize", || unsafe {
                (self.api.cuEventSynchronize)(ev)
            })
        })
    }

    fn event_destroy(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        let call = DriverCall::EventDestroy;
        let ev = event_ptr(call, event)?;
        let _bound = self.bind(call, dev)?;
        // SAFETY: `ev` came from event_create and is destroyed once (contract).
        cu(call, "cuEventDestroy_v2", || unsafe {
            (self.api.cuEventDestroy_v2)(ev)
        })
    }

    fn stream_wait_event(
        &self,
        dev: DeviceId,
        stream: StreamId,
        event: EventId,
    ) -> DriverResult<()> {
        let call = DriverCall::StreamWaitEvent;
        let (ev, st) = (event_ptr(call, event)?, stream_ptr(call, stream)?);
        let _bound = self.bind(call, dev)?;
        // SAFETY: `ev` came from event_create (contract), `st` is a stream handle, flags are 0;
        // the wait is queued on the device and never blocks the host.
        cu(call, "cuStreamWaitEvent", || unsafe {
            (self.api.cuStreamWaitEvent)(st, ev, 0)
        })
    }

    fn stream_capturing(&self, dev: DeviceId, stream: StreamId) -> DriverResult<bool> {
        self.stream_is_capturing(dev, stream)
    }

    fn forget_stream(&self, stream: StreamId) {
        self.forget_capture(stream);
    }

    fn device_synchronize(&self, dev: DeviceId) -> DriverResult<()> {
        let call = DriverCall::DeviceSynchronize;
        let _bound = self.bind(call, dev)?;
        // cuCtxSynchronize invalidates every capture of the context, in any mode.
        self.refuse_during_capture(call, dev)?;
        self.relaxed(|| {
            // SAFETY: no arguments; dev's primary context is current, so this waits for its work.
            cu(call, "cuCtxSynchronize", || unsafe {
                (self.api.cuCtxSynchronize)()
            })
        })
    }

    fn stream_info(&self, dev: DeviceId, stream: StreamId) -> DriverResult<StreamInfo> {
        self.resolve_stream(dev, stream)
    }

    fn current_device(&self) -> Option<DeviceId> {
        let api = self.api;
        let mut current: sys::CUcontext = ptr::null_mut();
        // SAFETY: `current` is a live, writable CUcontext; the call only reads the thread's
        // context stack.
        cu(DriverCall::EventRecord, "cuCtxGetCurrent", || unsafe {
            (api.cuCtxGetCurrent)(&mut current)
        })
        .ok()?;
        if current.is_null() {
            return None;
        }
        self.device_of_ctx(DriverCall::EventRecord, current).ok()
    }

    fn stream_synchronize(&self, dev: DeviceId, stream: StreamId) -> DriverResult<()> {
        let call = DriverCall::StreamSynchronize;
        let st = stream_ptr(call, stream)?;
        let _bound = self.bind(call, dev)?;
        self.relaxed(|| {
            // SAFETY: `st` is a stream handle of dev's context (or the legacy default stream, 0);
            // the call blocks until the stream's queued work has finished.
            cu(call, "cuStreamSynchronize", || unsafe {
                (self.api.cuStreamSynchronize)(st)
            })
        })
    }
}
