//! Sharing memory with other processes through the driver: exporting a physical handle as a
//! POSIX file descriptor and importing one, and CUDA IPC handles of linear memory. The
//! [`Driver`](crate::driver::Driver) methods of [`CudaDriver`] call these.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys::{self, CUresult};

use super::call::cu;
use super::CudaDriver;
use crate::driver::{DeviceId, DriverCall, DriverError, DriverErrorKind, DriverResult, PhysHandle};

impl CudaDriver {
    pub(super) fn export_fd(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<OwnedFd> {
        let call = DriverCall::ExportHandle;
        let _bound = self.bind(call, dev)?;
        let mut fd: c_int = -1;
        // SAFETY: for the POSIX type the driver writes an `int` through the pointer, which is
        // a live, writable c_int; the handle is a plain value the driver validates; flags 0.
        cu(call, "cuMemExportToShareableHandle", || unsafe {
            (self.api.cuMemExportToShareableHandle)(
                (&mut fd as *mut c_int).cast(),
                handle.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(DriverError::new(
                call,
                DriverErrorKind::Other,
                CUresult::CUDA_ERROR_UNKNOWN as i32,
                format!("cuMemExportToShareableHandle gave the descriptor {fd}"),
            ));
        }
        // SAFETY: the driver made a new descriptor for the caller, which nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(super) fn import_fd(&self, dev: DeviceId, fd: BorrowedFd<'_>) -> DriverResult<PhysHandle> {
        let call = DriverCall::ImportHandle;
        let _bound = self.bind(call, dev)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for the POSIX type the "OS handle" argument is the descriptor's value cast to
        // a pointer (the driver's documented convention); the descriptor is live for the call
        // and stays the caller's. `handle` is a live, writable handle.
        cu(call, "cuMemImportFromShareableHandle", || unsafe {
            (self.api.cuMemImportFromShareableHandle)(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(PhysHandle(handle))
    }

    pub(super) fn ipc_handle_of(&self, dev: DeviceId, ptr: u64) -> DriverResult<[u8; 64]> {
        let call = DriverCall::IpcGetHandle;
        let _bound = self.bind(call, dev)?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `h` is a live, writable handle; `ptr` a plain value the driver validates.
        cu(call, "cuIpcGetMemHandle", || unsafe {
            (self.api.cuIpcGetMemHandle)(&mut h, ptr)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    pub(super) fn ipc_open_handle(&self, dev: DeviceId, handle: &[u8; 64]) -> DriverResult<u64> {
        let call = DriverCall::IpcOpen;
        let _bound = self.bind(call, dev)?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is live and writable; the handle is passed by value; the flag is the
        // documented CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
        cu(call, "cuIpcOpenMemHandle", || unsafe {
            (self.api.cuIpcOpenMemHandle_v2)(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
            )
        })?;
        Ok(ptr)
    }

    pub(super) fn ipc_close_handle(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        let call = DriverCall::IpcClose;
        let _bound = self.bind(call, dev)?;
        // SAFETY: a plain address the driver validates.
        cu(call, "cuIpcCloseMemHandle", || unsafe {
            (self.api.cuIpcCloseMemHandle)(ptr)
        })
    }
}
