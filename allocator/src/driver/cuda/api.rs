//! The CUDA driver library, opened by cistern itself: which file is loaded, and the table of the
//! functions [`CudaDriver`](super::CudaDriver) calls.
//!
//! # Which library
//!
//! The NVIDIA driver installs `libcuda.so.1`; `libcuda.so` is a development symlink at best, and
//! in the CUDA toolkit's `stubs/` directory a link-time stub whose `cuInit` fails with
//! `CUDA_ERROR_STUB_LIBRARY`. PyTorch, NCCL and Triton open `libcuda.so.1`. cudarc's own loader
//! tries `libcuda.so` first, so with the toolkit's stubs on `LD_LIBRARY_PATH` it would get the
//! stub while PyTorch in the same process gets the driver, and where the two names are different
//! files two drivers would live in one process. So this module:
//!
//! 1. looks for a `libcuda.so.1` already loaded in the process (`RTLD_NOLOAD`): the one PyTorch or
//!    the CUDA runtime already uses;
//! 2. else opens `libcuda.so.1` through the loader's search path;
//! 3. only if no `libcuda.so.1` exists at all, tries `libcuda.so` (a driver installed by hand).
//!
//! cudarc provides the types and constants (`cudarc::driver::sys`); every function is resolved
//! here, all at once, so that a missing symbol is an error before the first call, never a panic
//! in the middle of one.
// The whole module is FFI with the driver library, whose functions keep their C names.
#![allow(unsafe_code, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUipcMemHandle, CUmemAccessDesc,
    CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUresult, CUstream, CUuuid,
};
use libc::RTLD_NOLOAD;
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

/// The file names tried, in order (see the module documentation).
pub const LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

macro_rules! driver_api {
    ($( $name:ident ( $($arg:ty),* ) ; )*) => {
        /// Every CUDA driver symbol this backend resolves, as exported by `libcuda.so.1`.
        ///
        /// [`CudaDriver::new`](super::CudaDriver::new) refuses to start (with
        /// [`DriverErrorKind::NoDriver`](crate::driver::DriverErrorKind::NoDriver)) unless the
        /// library exports all of them; a fake `libcuda.so.1` must export at least these.
        pub const CUDA_SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        /// The driver functions, resolved from one loaded library.
        #[allow(non_snake_case)]
        pub(crate) struct Api {
            $( pub(crate) $name: unsafe extern "C" fn($($arg),*) -> CUresult, )*
            /// Keeps the library loaded for as long as the table lives (the whole process).
            _lib: Library,
        }

        impl Api {
            /// Resolves every function from `lib`, or names the ones it lacks.
            fn resolve(lib: Library) -> Result<Api, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    // SAFETY: a lookup of a function symbol; the type is the one the CUDA
                    // driver API headers (cudarc's bindings of CUDA 12.8) give it.
                    let $name = unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) -> CUresult>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                    }
                    .map(|s| *s)
                    .ok();
                    if $name.is_none() {
                        missing.push(stringify!($name));
                    }
                )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok(Api {
                    $( $name: $name.expect("checked above"), )*
                    _lib: lib,
                })
            }
        }
    };
}

driver_api! {
    cuInit(c_uint);
    cuGetErrorString(CUresult, *mut *const c_char);
    cuDeviceGetCount(*mut c_int);
    cuDeviceGet(*mut CUdevice, c_int);
    cuDeviceGetName(*mut c_char, c_int, CUdevice);
    cuDeviceGetUuid_v2(*mut CUuuid, CUdevice);
    cuDeviceTotalMem_v2(*mut usize, CUdevice);
    cuDeviceGetAttribute(*mut c_int, CUdevice_attribute, CUdevice);
    cuDeviceCanAccessPeer(*mut c_int, CUdevice, CUdevice);
    cuDevicePrimaryCtxRetain(*mut CUcontext, CUdevice);
    cuDevicePrimaryCtxRelease_v2(CUdevice);
    cuCtxGetCurrent(*mut CUcontext);
    cuCtxPushCurrent_v2(CUcontext);
    cuCtxPopCurrent_v2(*mut CUcontext);
    cuCtxGetDevice(*mut CUdevice);
    cuCtxSynchronize();
    cuMemGetInfo_v2(*mut usize, *mut usize);
    cuMemGetAllocationGranularity(
        *mut usize,
        *const CUmemAllocationProp,
        CUmemAllocationGranularity_flags
    );
    cuMemAddressReserve(*mut CUdeviceptr, usize, usize, CUdeviceptr, c_ulonglong);
    cuMemAddressFree(CUdeviceptr, usize);
    cuMemCreate(
        *mut CUmemGenericAllocationHandle,
        usize,
        *const CUmemAllocationProp,
        c_ulonglong
    );
    cuMemRelease(CUmemGenericAllocationHandle);
    cuMemMap(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, c_ulonglong);
    cuMemUnmap(CUdeviceptr, usize);
    cuMemSetAccess(CUdeviceptr, usize, *const CUmemAccessDesc, usize);
    cuMemExportToShareableHandle(
        *mut c_void,
        CUmemGenericAllocationHandle,
        CUmemAllocationHandleType,
        c_ulonglong
    );
    cuMemImportFromShareableHandle(
        *mut CUmemGenericAllocationHandle,
        *mut c_void,
        CUmemAllocationHandleType
    );
    cuIpcGetMemHandle(*mut CUipcMemHandle, CUdeviceptr);
    cuIpcOpenMemHandle_v2(*mut CUdeviceptr, CUipcMemHandle, c_uint);
    cuIpcCloseMemHandle(CUdeviceptr);
    cuMemAlloc_v2(*mut CUdeviceptr, usize);
    cuMemFree_v2(CUdeviceptr);
    cuEventCreate(*mut CUevent, c_uint);
    cuEventRecord(CUevent, CUstream);
    cuEventQuery(CUevent);
    cuEventSynchronize(CUevent);
    cuEventDestroy_v2(CUevent);
    cuStreamWaitEvent(CUstream, CUevent, c_uint);
    cuStreamSynchronize(CUstream);
    cuStreamGetId(CUstream, *mut c_ulonglong);
    cuStreamGetCtx(CUstream, *mut CUcontext);
    // The status is a `CUstreamCaptureStatus`, read as a plain integer (as the mode below).
    cuStreamIsCapturing(CUstream, *mut c_uint);
    // The mode is a `CUstreamCaptureMode`, read and written as a plain integer here so that no
    // value the driver writes back can be an invalid Rust enum.
    cuThreadExchangeStreamCaptureMode(*mut c_uint);
}

// SAFETY: the table holds plain function pointers into a library that stays loaded; the CUDA
// driver API is thread-safe, so the functions may be called from any thread.
unsafe impl Send for Api {}
// SAFETY: as above; the table is never mutated after it is built.
unsafe impl Sync for Api {}

/// Why the library could not be opened, for the error [`CudaDriver::new`](super::CudaDriver::new)
/// returns.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// No file of [`LIBRARY_NAMES`] could be loaded.
    NotFound(String),
    /// The library loaded but lacks functions.
    Missing(&'static str, Vec<&'static str>),
}

/// The process's driver table, opened on first use (see the module documentation). A failure is
/// not remembered: a later call tries again (the library may have been installed since).
pub(crate) fn api() -> Result<&'static Api, OpenError> {
    static API: OnceLock<Api> = OnceLock::new();
    if let Some(a) = API.get() {
        return Ok(a);
    }
    let (name, lib) = open()?;
    let api = Api::resolve(lib).map_err(|missing| OpenError::Missing(name, missing))?;
    Ok(API.get_or_init(|| api))
}

/// Opens the first of [`LIBRARY_NAMES`] that loads, preferring one already in the process.
fn open() -> Result<(&'static str, Library), OpenError> {
    let first = LIBRARY_NAMES[0];
    // SAFETY: with RTLD_NOLOAD, dlopen only returns a library that is already loaded (its
    // initialisers have run); nothing new is loaded.
    if let Ok(lib) = unsafe { Library::open(Some(first), RTLD_NOW | RTLD_NOLOAD) } {
        return Ok((first, lib));
    }
    let mut errors = Vec::new();
    for name in LIBRARY_NAMES {
        // SAFETY: loading the CUDA driver runs its initialisers, as every CUDA program does;
        // that is sound for the NVIDIA driver (or a faithful fake of it).
        match unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL) } {
            Ok(lib) => return Ok((name, lib)),
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    Err(OpenError::NotFound(errors.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols_are_listed_once() {
        let mut s = CUDA_SYMBOLS.to_vec();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), CUDA_SYMBOLS.len());
    }
}
