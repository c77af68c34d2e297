//! Sharing memory between processes: `cuMemExportToShareableHandle`,
//! `cuMemImportFromShareableHandle` (POSIX file descriptors), `cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`, and the `cisternFakeOrigin` hook.
//!
//! Each process has its own simulator, so the fake models a shared allocation by its
//! **identity**, not its bytes:
//!
//! * `cuMemExportToShareableHandle` gives a real file descriptor (a `memfd`) naming the memory:
//!   the exporting process's id, the handle, its size and device. The handle must have been
//!   created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` in `requestedHandleTypes` ("the
//!   handle type must have been requested at allocation time": `CUDA_ERROR_INVALID_VALUE`
//!   otherwise). The descriptor travels as the driver's does: inherited, over a socket, or
//!   taken with `pidfd_getfd`.
//! * `cuMemImportFromShareableHandle` in another process makes a handle there that stands for
//!   the same memory: the simulator backs it with memory of the importing process's device
//!   (a deviation: the real memory is counted once, on the exporter's side), and the fake
//!   remembers whose memory it is. A handle of the process's own is imported the same way (a
//!   new handle standing for the same memory, as the driver's).
//! * `cuIpcGetMemHandle` names a `cuMemAlloc` allocation (any pointer inside it) in 64 bytes;
//!   `cuIpcOpenMemHandle_v2` in another process maps a stand-in allocation of the same size
//!   (needs a current context) and returns its base; opening a handle of the process's own
//!   memory is `CUDA_ERROR_INVALID_CONTEXT` ("cannot be opened in the process that created
//!   it"), opening one twice in a process `CUDA_ERROR_INVALID_VALUE` (the fake is stricter
//!   than newer drivers, which count references: a client must cache what it opened).
//!   `cuIpcCloseMemHandle` frees the stand-in.
//! * `cisternFakeOrigin(ptr, *pid, *alloc, *offset)` says which memory an address is:
//!   (process id, handle or allocation base there, offset in it), following imports and opened
//!   handles back to the exporter. Two processes see the same byte exactly when they report
//!   the same triple, so a test checks that a receiver maps the sender's memory at the right
//!   offset.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::fs::File;
use std::io::Write;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::os::unix::fs::FileExt;

use cistern::driver::Driver;

use crate::memory::HANDLE_POSIX_FD;
use crate::CUresult::{self, *};
use crate::{code, entry, fake, put, CUdeviceptr, CUmemGenericAllocationHandle, Handle, State};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, as the type argument of export and import.
const TYPE_POSIX_FD: c_uint = HANDLE_POSIX_FD;
/// The first bytes of an exported handle's descriptor and of an IPC handle.
const HANDLE_MAGIC: &[u8; 8] = b"cstfakH1";
const IPC_MAGIC: &[u8; 8] = b"cstfakI1";

/// `CUipcMemHandle`: 64 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUipcMemHandle {
    /// The handle's bytes.
    pub reserved: [u8; 64],
}

fn pid() -> u64 {
    u64::from(std::process::id())
}

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
    let f = |i: usize| u64::from_le_bytes(bytes[8 + 8 * i..16 + 8 * i].try_into().unwrap());
    Some([f(0), f(1), f(2), f(3)])
}

/// Where the memory of handle `h` of this process comes from: (process, handle there).
fn handle_origin(st: &State, h: u64) -> (u64, u64) {
    st.handles
        .get(&h)
        .and_then(|hd| hd.origin)
        .unwrap_or((pid(), h))
}

/// `cuMemExportToShareableHandle`: a POSIX file descriptor naming handle `handle` (see the
/// module documentation). No context needed.
///
/// # Safety
///
/// `shareable` is null or valid for writing a `c_int` (the POSIX type's "OS handle").
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> CUresult {
    entry("cuMemExportToShareableHandle", || {
        let f = fake()?;
        f.vmm()?;
        if shareable.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if handle_type != TYPE_POSIX_FD {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let st = f.state();
        let hd = st
            .handles
            .get(&handle)
            .filter(|h| !h.released)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.alive(hd.dev)?;
        if hd.types & TYPE_POSIX_FD == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (from, h) = handle_origin(&st, handle);
        let bytes = encode(HANDLE_MAGIC, [from, h, hd.size, hd.dev as u64]);
        // SAFETY: a valid NUL-terminated name and documented flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"cistern-fake-handle".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(CUDA_ERROR_UNKNOWN);
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        let mut file = unsafe { File::from_raw_fd(fd) };
        file.write_all(&bytes).map_err(|_| CUDA_ERROR_UNKNOWN)?;
        // SAFETY: `shareable` is non-null and writable for a c_int (contract).
        unsafe { put(shareable.cast::<c_int>(), file.into_raw_fd()) }
    })
}

/// `cuMemImportFromShareableHandle`: a handle of this process for memory exported by another
/// (see the module documentation). No context needed.
///
/// # Safety
///
/// `handle` is null or valid for writing a handle; `os_handle` is a file descriptor's value
/// cast to a pointer (the POSIX type's convention).
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    entry("cuMemImportFromShareableHandle", || {
        let f = fake()?;
        f.vmm()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if handle_type != TYPE_POSIX_FD {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let fd = os_handle as usize as c_int;
        // SAFETY: the descriptor stays the caller's: it is only read through a duplicate.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `dup` is a new descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(dup) };
        let mut buf = [0u8; 40];
        let n = file.read_at(&mut buf, 0).unwrap_or(0);
        let [from, h, size, dev] =
            decode(HANDLE_MAGIC, &buf[..n]).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let d = f.device(dev as c_int)?;
        let mut st = f.state();
        st.alive(d)?;
        let mine = f.sim.create_physical(d, size).map_err(|e| code(&e))?;
        st.handles.insert(
            mine.0,
            Handle {
                dev: d,
                maps: 0,
                released: false,
                size,
                types: TYPE_POSIX_FD,
                origin: Some((from, h)),
            },
        );
        // SAFETY: `handle` is non-null and writable (contract).
        unsafe { put(handle, mine.0) }
    })
}

/// `cuIpcGetMemHandle`: names the `cuMemAlloc` allocation containing `dptr` (see the module
/// documentation).
///
/// # Safety
///
/// `handle` is null or valid for writing a `CUipcMemHandle`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    entry("cuIpcGetMemHandle", || {
        let f = fake()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let st = f.state();
        let (&base, &(size, d)) = st
            .linear
            .range(..=dptr)
            .next_back()
            .filter(|(&b, &(s, _))| dptr - b < s)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        st.alive(d)?;
        let (from, b) = st.opened.get(&base).copied().unwrap_or((pid(), base));
        let mut out = [0u8; 64];
        out[..40].copy_from_slice(&encode(IPC_MAGIC, [from, b, size, d as u64]));
        // SAFETY: `handle` is non-null and writable (contract).
        unsafe { put(handle, CUipcMemHandle { reserved: out }) }
    })
}

/// `cuIpcOpenMemHandle_v2`: maps another process's allocation into the current context (see
/// the module documentation). `flags` must be `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS` (1).
///
/// # Safety
///
/// `pdptr` is null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CUresult {
    entry("cuIpcOpenMemHandle_v2", || {
        let f = fake()?;
        if pdptr.is_null() || flags != 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let [from, base, size, _dev] =
            decode(IPC_MAGIC, &handle.reserved).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = f.state();
        let d = f.current(&st)?;
        st.alive(d)?;
        if from == pid() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        if st.opened.values().any(|&o| o == (from, base)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = f.sim.mem_alloc(d, size).map_err(|e| code(&e))?;
        st.linear.insert(p, (size, d));
        st.opened.insert(p, (from, base));
        // SAFETY: `pdptr` is non-null and writable (contract).
        unsafe { put(pdptr, p) }
    })
}

/// `cuIpcCloseMemHandle`: unmaps memory opened with `cuIpcOpenMemHandle_v2` (its base).
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    entry("cuIpcCloseMemHandle", || {
        let f = fake()?;
        let mut st = f.state();
        let &(_, d) = st.linear.get(&dptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !st.opened.contains_key(&dptr) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        st.alive(d)?;
        f.sim.mem_free(d, dptr).map_err(|e| code(&e))?;
        st.linear.remove(&dptr);
        st.opened.remove(&dptr);
        Ok(())
    })
}

/// `cisternFakeOrigin`: which memory `ptr` is (see the module documentation):
/// `CUDA_ERROR_INVALID_VALUE` for an address of no mapping or allocation.
///
/// # Safety
///
/// `pid`, `alloc` and `offset` are null or valid for writing an `unsigned long long`.
#[no_mangle]
pub unsafe extern "C" fn cisternFakeOrigin(
    ptr: CUdeviceptr,
    pid_out: *mut c_ulonglong,
    alloc: *mut c_ulonglong,
    offset: *mut c_ulonglong,
) -> CUresult {
    entry("cisternFakeOrigin", || {
        let f = fake()?;
        let st = f.state();
        let mapped = st
            .mappings
            .range(..=ptr)
            .next_back()
            .filter(|(&s, m)| ptr - s < m.size)
            .map(|(&s, m)| {
                let (p, h) = handle_origin(&st, m.handle);
                (p, h, ptr - s)
            });
        let linear = || {
            st.linear
                .range(..=ptr)
                .next_back()
                .filter(|(&b, &(s, _))| ptr - b < s)
                .map(|(&b, _)| {
                    let (p, base) = st.opened.get(&b).copied().unwrap_or((pid(), b));
                    (p, base, ptr - b)
                })
        };
        let (p, a, o) = mapped.or_else(linear).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: the pointers are null (refused) or writable (contract).
        unsafe {
            put(pid_out, p)?;
            put(alloc, a)?;
            put(offset, o)
        }
    })
}
