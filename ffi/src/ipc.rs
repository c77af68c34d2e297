//! Sharing memory with other processes through the C ABI: `cistern_ipc_share` writes a live
//! allocation as PyTorch's shareable-handle bytes (what `CUDAAllocator::shareIpcHandle` returns,
//! so that a process running PyTorch's own allocator can open it), `cistern_ipc_open` maps
//! such bytes from another process (what `getIpcDevPtr` does), `cistern_ipc_close` undoes an
//! open. The format and the mechanism: `cistern_alloc::ipc` and Note [Sharing] in the pool.

use std::ffi::{c_int, c_void};

use cistern_alloc::ipc::{self, TorchFormat};

use crate::global::{self, with_pool};
use crate::{addr, fail, fail_no_pool, fail_with, guard};

/// The handle format for torch `version` (`major * 100 + minor`, e.g. 205 for 2.5; 0 for the
/// newest format cistern knows).
fn format_for(version: c_int) -> TorchFormat {
    if version <= 0 {
        TorchFormat::V3
    } else {
        TorchFormat::for_torch((version / 100) as u32, (version % 100) as u32)
    }
}

/// Writes the live allocation containing `ptr` as PyTorch's shareable handle for a receiver
/// running torch `torch_version` (`major * 100 + minor`, e.g. 205; 0 for the newest format):
/// `'e'` (VMM memory on handles of one size) or `'c'` (a `cuMemAlloc` segment, with
/// `CISTERN_CONF=vmm:false`), both readable by PyTorch's own allocator, or cistern's `'v'`
/// (handles of several sizes; only cistern reads it). `*offset` receives the allocation's offset
/// from the shared range's start (PyTorch's `ShareableHandle::offset`).
///
/// `snprintf`'s rules: returns the handle's length in bytes, writing it to `buf` only when it
/// fits in `cap` (no terminator: the bytes are binary). Returns 0 on failure (not a live
/// allocation, a device that cannot export: `cistern_last_error` says which and what to do).
/// The receiver takes the memory from this process: the allocation must stay live until it has
/// done so and is done with it.
///
/// # Safety
///
/// `buf` is NULL or has `cap` writable bytes; `offset` is NULL or points to a writable
/// `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn cistern_ipc_share(
    ptr: *mut c_void,
    torch_version: c_int,
    buf: *mut u8,
    cap: usize,
    offset: *mut u64,
) -> usize {
    let shared = guard::call("cistern_ipc_share", None, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_ipc_share", why);
                return None;
            }
        };
        match with_pool!(pool, |p| p.share(addr(ptr))) {
            Ok((_, share)) => Some(share),
            Err(e) => {
                fail_with(format!("cistern_ipc_share({ptr:p})"), &e);
                None
            }
        }
    });
    let Some(share) = shared else {
        return 0;
    };
    let bytes = ipc::encode(&share.memory, format_for(torch_version));
    if !offset.is_null() {
        // SAFETY: non-null, and writable by the caller's contract.
        unsafe { offset.write(share.offset) };
    }
    if !buf.is_null() && bytes.len() <= cap {
        // SAFETY: `buf` has `cap >= bytes.len()` writable bytes (contract), and does not
        // overlap a local vector.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    }
    bytes.len()
}

/// Maps memory another process shared (the `len` bytes at `handle`: PyTorch's shareable handle
/// from `cistern_ipc_share` or from PyTorch's own allocator, or a bare 64-byte CUDA IPC handle)
/// on device `device`, and returns the shared range's base: the allocation is at the base plus
/// the sender's offset. Opening the same bytes again returns the same base and counts an open;
/// each open is undone by one `cistern_ipc_close`. NULL on failure, with the reason (for
/// example no ptrace permission over the sender, and how to grant it) in `cistern_last_error`.
///
/// # Safety
///
/// `handle` is NULL or points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn cistern_ipc_open(
    handle: *const u8,
    len: usize,
    device: c_int,
) -> *mut c_void {
    let bytes: &[u8] = if handle.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: non-null, `len` readable bytes (contract), not written while borrowed here.
        unsafe { std::slice::from_raw_parts(handle, len) }
    };
    let base = guard::call("cistern_ipc_open", 0u64, || {
        let memory = match ipc::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                fail(
                    format!("cistern_ipc_open: not a shareable handle: {e}"),
                    true,
                );
                return 0;
            }
        };
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_ipc_open", why);
                return 0;
            }
        };
        let r = with_pool!(pool, |p| global::device(p, device)
            .and_then(|d| d.open_shared(&memory)));
        match r {
            Ok(base) => base,
            Err(e) => {
                fail_with(format!("cistern_ipc_open(device {device})"), &e);
                0
            }
        }
    });
    base as usize as *mut c_void
}

/// Undoes one `cistern_ipc_open` that returned `base` on device `device`; the last one unmaps
/// the memory. Returns 1, or 0 when nothing opened starts at `base` (`cistern_last_error`).
#[no_mangle]
pub extern "C" fn cistern_ipc_close(base: *mut c_void, device: c_int) -> c_int {
    guard::call("cistern_ipc_close", 0, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_ipc_close", why);
                return 0;
            }
        };
        let r = with_pool!(pool, |p| global::device(p, device)
            .and_then(|d| d.close_shared(addr(base))));
        match r {
            Ok(()) => 1,
            Err(e) => {
                fail_with(format!("cistern_ipc_close({base:p}, device {device})"), &e);
                0
            }
        }
    })
}
