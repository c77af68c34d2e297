//! Sharing memory, as the simulator models it: `cuMemExportToShareableHandle` /
//! `cuMemImportFromShareableHandle` for physical handles, `cuIpcGetMemHandle` /
//! `cuIpcOpenMemHandle` for linear allocations.
//!
//! An exported handle is a real POSIX file descriptor, as the driver's: a `memfd` holding
//! a descriptor of the memory (this simulator's id, the device, the handle, its size). So it
//! travels as the driver's does (inherited, passed over a socket, or taken with `pidfd_getfd`).
//!
//! * **Import** of a descriptor of this simulator gives a handle of the *same* memory (the
//!   same bytes, seen through every mapping of either handle), counted as one more reference:
//!   the memory is freed when every handle of it is released (a release that is not the last
//!   one succeeds whether or not the memory is mapped elsewhere, as each process's handles are
//!   its own). The simulator returns the exporter's handle value again; the driver returns a
//!   new value. Either way the caller releases each handle it imported.
//! * **Another simulator's descriptor** (another process, or another `SimDriver` in this one)
//!   is `CUDA_ERROR_NOT_SUPPORTED`: a simulator's memory lives in its own process. Tests of
//!   sharing between processes use the fake `libcuda` (`tests/fakecuda`), which models it.
//! * **Linear memory**: `ipc_get_handle` checks that the pointer is an allocation's base and
//!   names it in 64 bytes; `ipc_open` refuses handles of its own simulator, as the driver
//!   refuses handles of its own process, so nothing opens one in the simulator.
//!
//! Every call is counted and priced like the others, and takes injected faults.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::codes::CUDA_ERROR_NOT_SUPPORTED;
use super::{err, invalid, invalid_handle, SimDriver};
use crate::driver::{DeviceId, DriverCall, DriverErrorKind, DriverResult, PhysHandle};

/// The first bytes of an exported handle's descriptor.
const HANDLE_MAGIC: &[u8; 8] = b"cstsimH1";
/// The first bytes of an IPC handle of linear memory.
const IPC_MAGIC: &[u8; 8] = b"cstsimI1";

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// A process-unique id for a new simulator (mixed with the pid, so that a descriptor of
/// another process's simulator never matches).
pub(super) fn next_uid() -> u64 {
    (u64::from(std::process::id()) << 32) | NEXT_UID.fetch_add(1, Ordering::Relaxed)
}

/// The fields of a descriptor: simulator, device, handle or allocation, size.
fn encode(magic: &[u8; 8], fields: [u64; 4]) -> [u8; 40] {
    let mut out = [0u8; 40];
    out[..8].copy_from_slice(magic);
    for (i, f) in fields.iter().enumerate() {
        out[8 + 8 * i..16 + 8 * i].copy_from_slice(&f.to_le_bytes());
    }
    out
}

fn decode(magic: &[u8; 8], bytes: &[u8]) -> Option<[u64; 4]> {
    if bytes.len() < 40 || &bytes[..8] != magic {
        return None;
    }
    let f = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[8 + 8 * i..16 + 8 * i]);
        u64::from_le_bytes(b)
    };
    Some([f(0), f(1), f(2), f(3)])
}

/// A new memfd holding `bytes`.
fn memfd_with(call: DriverCall, bytes: &[u8]) -> DriverResult<OwnedFd> {
    let os = |what: &str, e: std::io::Error| {
        err(call, DriverErrorKind::Other, 999, format!("{what}: {e}"))
    };
    let owned = crate::sys::memfd(c"cistern-sim-handle").map_err(|e| os("memfd_create", e))?;
    let mut f = File::from(owned);
    f.write_all(bytes)
        .map_err(|e| os("writing the descriptor", e))?;
    Ok(OwnedFd::from(f))
}

impl SimDriver {
    pub(super) fn export(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<OwnedFd> {
        let call = DriverCall::ExportHandle;
        let d = self.vmm_device(call, dev)?;
        let size = match d.state.lock().handles.get(&handle.0) {
            Some(p) => p.size,
            None => {
                return Err(invalid_handle(
                    call,
                    format!("unknown physical handle {}", handle.0),
                ))
            }
        };
        memfd_with(
            call,
            &encode(HANDLE_MAGIC, [self.uid, dev as u64, handle.0, size]),
        )
    }

    pub(super) fn import(&self, dev: DeviceId, fd: BorrowedFd<'_>) -> DriverResult<PhysHandle> {
        let call = DriverCall::ImportHandle;
        let d = self.vmm_device(call, dev)?;
        let f = fd
            .try_clone_to_owned()
            .map(File::from)
            .map_err(|e| invalid(call, format!("fd {}: {e}", fd.as_raw_fd())))?;
        let mut buf = [0u8; 40];
        let n = f.read_at(&mut buf, 0).unwrap_or(0);
        let Some([uid, from_dev, h, _size]) = decode(HANDLE_MAGIC, &buf[..n]) else {
            return Err(invalid(
                call,
                format!(
                    "fd {} is not a handle exported by cuMemExportToShareableHandle",
                    fd.as_raw_fd()
                ),
            ));
        };
        if uid != self.uid {
            return Err(err(
                call,
                DriverErrorKind::NotSupported,
                CUDA_ERROR_NOT_SUPPORTED,
                "the handle was exported by another simulated GPU (another process?): the \
                 simulator shares memory only within itself; the fake libcuda shares it \
                 between processes",
            ));
        }
        if from_dev != dev as u64 {
            return Err(invalid(
                call,
                format!("the handle is memory of device {from_dev}, not of device {dev}"),
            ));
        }
        let mut st = d.state.lock();
        let Some(p) = st.handles.get_mut(&h) else {
            return Err(invalid_handle(
                call,
                format!("the exported handle {h} has been released"),
            ));
        };
        p.refs += 1;
        Ok(PhysHandle(h))
    }

    pub(super) fn ipc_handle(&self, dev: DeviceId, ptr: u64) -> DriverResult<[u8; 64]> {
        let call = DriverCall::IpcGetHandle;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let st = d.state.lock();
        let Some(l) = st.linear.get(&ptr) else {
            return Err(invalid(
                call,
                format!("{ptr:#x} is not the base of a cuMemAlloc allocation"),
            ));
        };
        let mut out = [0u8; 64];
        out[..40].copy_from_slice(&encode(IPC_MAGIC, [self.uid, dev as u64, l.id, l.size]));
        Ok(out)
    }

    pub(super) fn ipc_open_handle(&self, dev: DeviceId, handle: &[u8; 64]) -> DriverResult<u64> {
        let call = DriverCall::IpcOpen;
        self.enter(call)?;
        self.device(call, dev)?;
        match decode(IPC_MAGIC, handle) {
            Some([uid, ..]) if uid == self.uid => Err(invalid(
                call,
                "the handle is of this process's own memory: cuIpcOpenMemHandle opens \
                 another process's",
            )),
            Some(_) => Err(err(
                call,
                DriverErrorKind::NotSupported,
                CUDA_ERROR_NOT_SUPPORTED,
                "the handle is of another simulated GPU's memory: the simulator shares memory \
                 only within itself",
            )),
            None => Err(invalid(call, "not a cuIpcGetMemHandle handle")),
        }
    }
}
