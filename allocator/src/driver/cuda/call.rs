//! How one driver call is made: the arguments converted for the C API (sizes, stream and event
//! handles, allocation properties) and the `CUresult` mapped to a [`DriverError`] with the
//! driver's own description, without panicking.
// The driver API is FFI: allowed `unsafe` as its parent module.
#![allow(unsafe_code)]

use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use cudarc::driver::sys::{self, CUresult};

use super::{api, CODE_NOT_LOADED};
use crate::driver::{DriverCall, DriverError, DriverErrorKind, DriverResult, EventId, StreamId};

/// Runs one driver function and maps its result; a panic inside cudarc becomes an error.
#[inline]
pub(super) fn cu(
    call: DriverCall,
    func: &'static str,
    f: impl FnOnce() -> CUresult,
) -> DriverResult<()> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(r) => Err(cuda_error(call, func, r)),
        Err(_) => Err(unavailable(call, func)),
    }
}

/// The error for a function cudarc could not resolve (it panicked; `new` makes this unreachable).
#[cold]
pub(super) fn unavailable(call: DriverCall, func: &'static str) -> DriverError {
    DriverError::new(
        call,
        DriverErrorKind::NoDriver,
        CODE_NOT_LOADED,
        format!("{func}: the CUDA driver library could not provide this function"),
    )
}

/// A [`DriverError`] for a failed `CUresult`: the function, the code's name and the driver's text.
#[cold]
pub(super) fn cuda_error(call: DriverCall, func: &'static str, r: CUresult) -> DriverError {
    let mut text: *const c_char = ptr::null();
    let described = match api::api() {
        // SAFETY: `text` is a live, writable pointer; on success the driver stores a pointer to
        // a static NUL-terminated string in it.
        Ok(api) => catch_unwind(AssertUnwindSafe(|| unsafe {
            (api.cuGetErrorString)(r, &mut text)
        })),
        Err(_) => Ok(CUresult::CUDA_ERROR_NOT_INITIALIZED),
    };
    let text = match described {
        Ok(CUresult::CUDA_SUCCESS) if !text.is_null() => {
            // SAFETY: the driver returned success and a non-null pointer to a static C string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        }
        _ => "no description".to_owned(),
    };
    DriverError::new(
        call,
        error_kind(r),
        r as i32,
        format!("{func}: {r:?} ({text})"),
    )
}

/// The broad class of a failed `CUresult`.
pub(super) fn error_kind(r: CUresult) -> DriverErrorKind {
    use CUresult::*;
    match r {
        CUDA_ERROR_OUT_OF_MEMORY => DriverErrorKind::OutOfMemory,
        CUDA_ERROR_NOT_SUPPORTED => DriverErrorKind::NotSupported,
        CUDA_ERROR_INVALID_VALUE => DriverErrorKind::InvalidValue,
        CUDA_ERROR_INVALID_DEVICE => DriverErrorKind::InvalidDevice,
        CUDA_ERROR_NO_DEVICE | CUDA_ERROR_NOT_INITIALIZED | CUDA_ERROR_STUB_LIBRARY => {
            DriverErrorKind::NoDriver
        }
        _ => DriverErrorKind::Other,
    }
}

/// Formats a device UUID as nvidia-smi does: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub(super) fn format_uuid(bytes: [u8; 16]) -> String {
    let mut s = String::with_capacity(40);
    s.push_str("GPU");
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 0 | 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The allocation property of pinned device memory on device `dev`.
pub(super) fn pinned_on(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: device_location(dev),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The memory location "device `dev`".
pub(super) fn device_location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    }
}

/// A `u64` from the pool as a `usize` size or address for the driver.
#[inline]
pub(super) fn to_usize(call: DriverCall, v: u64) -> DriverResult<usize> {
    usize::try_from(v).map_err(|_| {
        DriverError::new(
            call,
            DriverErrorKind::InvalidValue,
            CUresult::CUDA_ERROR_INVALID_VALUE as i32,
            format!("{v:#x} does not fit in this platform's address space"),
        )
    })
}

/// The raw `CUstream` behind a [`StreamId`] (`0` is the legacy default stream).
#[inline]
pub(super) fn stream_ptr(call: DriverCall, s: StreamId) -> DriverResult<sys::CUstream> {
    Ok(to_usize(call, s.0)? as sys::CUstream)
}

/// The raw `CUevent` behind an [`EventId`]; a null event is refused without asking the driver.
#[inline]
pub(super) fn event_ptr(call: DriverCall, e: EventId) -> DriverResult<sys::CUevent> {
    if e.0 == 0 {
        return Err(DriverError::new(
            call,
            DriverErrorKind::InvalidValue,
            CUresult::CUDA_ERROR_INVALID_HANDLE as i32,
            "null event",
        ));
    }
    Ok(to_usize(call, e.0)? as sys::CUevent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_formatted_like_nvidia_smi() {
        let bytes = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(
            format_uuid(bytes),
            "GPU-12345678-9abc-def0-0123-456789abcdef"
        );
    }

    #[test]
    fn results_map_to_kinds() {
        use CUresult::*;
        let cases = [
            (CUDA_ERROR_OUT_OF_MEMORY, DriverErrorKind::OutOfMemory),
            (CUDA_ERROR_NOT_SUPPORTED, DriverErrorKind::NotSupported),
            (CUDA_ERROR_INVALID_VALUE, DriverErrorKind::InvalidValue),
            (CUDA_ERROR_INVALID_DEVICE, DriverErrorKind::InvalidDevice),
            (CUDA_ERROR_NO_DEVICE, DriverErrorKind::NoDriver),
            (CUDA_ERROR_NOT_INITIALIZED, DriverErrorKind::NoDriver),
            (CUDA_ERROR_STUB_LIBRARY, DriverErrorKind::NoDriver),
            (CUDA_ERROR_INVALID_HANDLE, DriverErrorKind::Other),
            (CUDA_ERROR_NOT_READY, DriverErrorKind::Other),
        ];
        for (r, kind) in cases {
            assert_eq!(error_kind(r), kind, "{r:?}");
        }
    }

    #[test]
    fn codes_are_the_numeric_cuda_results() {
        assert_eq!(CUresult::CUDA_ERROR_OUT_OF_MEMORY as i32, 2);
        assert_eq!(CUresult::CUDA_ERROR_NOT_READY as i32, 600);
        assert_eq!(CODE_NOT_LOADED, 3);
    }
}
