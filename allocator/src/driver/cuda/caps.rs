//! What a device can do, read once per device from the driver: memory, VMM support and its
//! granularity, POSIX file-descriptor handles, name and UUID.

use std::ffi::{c_char, c_int, CStr};

use cudarc::driver::sys::{self, CUresult};

use super::call::{cu, format_uuid, pinned_on};
use super::{CudaDriver, Device, LINEAR_GRANULARITY};
use crate::driver::{DeviceCaps, DriverCall, DriverError, DriverErrorKind, DriverResult};

impl CudaDriver {
    /// Reads what device `d` can do (no context needed).
    pub(super) fn query_caps(&self, d: &Device) -> DriverResult<DeviceCaps> {
        let call = DriverCall::Capabilities;
        let mut total: usize = 0;
        // SAFETY: `total` is a live, writable usize; `d.cu` came from cuDeviceGet.
        cu(call, "cuDeviceTotalMem_v2", || unsafe {
            (self.api.cuDeviceTotalMem_v2)(&mut total, d.cu)
        })?;
        let mut vmm: c_int = 0;
        // SAFETY: `vmm` is a live, writable c_int; the attribute is a valid enum value.
        cu(call, "cuDeviceGetAttribute", || unsafe {
            (self.api.cuDeviceGetAttribute)(
                &mut vmm,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                d.cu,
            )
        })?;
        let vmm = vmm != 0;
        let granularity = if vmm {
            let prop = pinned_on(d.cu);
            let mut g: usize = 0;
            // SAFETY: `g` is a live, writable usize and `prop` a fully initialised allocation
            // property that outlives the call.
            cu(call, "cuMemGetAllocationGranularity", || unsafe {
                (self.api.cuMemGetAllocationGranularity)(
                    &mut g,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            })?;
            let g = g as u64;
            if !g.is_power_of_two() {
                return Err(DriverError::new(
                    call,
                    DriverErrorKind::Other,
                    CUresult::CUDA_ERROR_INVALID_VALUE as i32,
                    format!("cuMemGetAllocationGranularity: {g} is not a power of two"),
                ));
            }
            g
        } else {
            LINEAR_GRANULARITY
        };
        let mut name: [c_char; 256] = [0; 256];
        // SAFETY: `name` is a live, writable buffer of exactly the length passed.
        cu(call, "cuDeviceGetName", || unsafe {
            (self.api.cuDeviceGetName)(name.as_mut_ptr(), name.len() as c_int, d.cu)
        })?;
        let name: Vec<u8> = name.iter().map(|&c| c as u8).collect();
        let name = match CStr::from_bytes_until_nul(&name) {
            Ok(s) => s.to_string_lossy().into_owned(),
            Err(_) => String::from_utf8_lossy(&name).into_owned(),
        };
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: `uuid` is a live, writable CUuuid.
        let uuid = cu(call, "cuDeviceGetUuid_v2", || unsafe {
            (self.api.cuDeviceGetUuid_v2)(&mut uuid, d.cu)
        })
        .ok()
        .map(|()| format_uuid(uuid.bytes.map(|c| c as u8)));
        let mut fd_handles: c_int = 0;
        // SAFETY: `fd_handles` is a live, writable c_int; the attribute is a valid enum value.
        // A driver that does not know the attribute has no such handles.
        let posix_fd_handles = vmm
            && cu(call, "cuDeviceGetAttribute", || unsafe {
                (self.api.cuDeviceGetAttribute)(
                    &mut fd_handles,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                    d.cu,
                )
            })
            .is_ok()
            && fd_handles != 0;
        Ok(DeviceCaps {
            total_memory: total as u64,
            vmm,
            granularity,
            name,
            uuid,
            posix_fd_handles,
        })
    }
}
