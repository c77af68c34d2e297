//! cistern's C ABI: `libcistern.so` and `include/cistern.h`.
//!
//! The exports are PyTorch's pluggable-allocator hooks (`cistern_malloc`, `cistern_free`,
//! `cistern_init`, `cistern_empty_cache`, `cistern_set_memory_fraction`,
//! `cistern_record_stream`, `cistern_base_alloc`, loaded with
//! `torch.cuda.memory.CUDAPluggableAllocator`) plus what PyTorch cannot ask a pluggable
//! allocator for (statistics and snapshots as JSON, peak reset), errors, the version, and
//! provenance tags. `include/cistern.h` is generated from this file by cbindgen
//! (`cargo run -p cistern-ffi --example gen-header`); a test fails when it is stale.
//!
//! # Contract
//!
//! * Thread-safe: every export may be called from any thread at any time.
//! * Nothing unwinds into C: every export runs under `catch_unwind`. A panic (a bug in cistern)
//!   becomes the export's failure value, a last error, `num_abi_panics` and a log line. (This
//!   relies on the default `panic = "unwind"`; a build with `panic = "abort"` would abort.)
//! * A missing driver, a bad device, an unknown or double-freed pointer, a bad argument: the
//!   call returns NULL / 0 or does nothing, sets the thread's last error
//!   (`cistern_last_error`), counts (`num_abi_errors`, and `num_invalid_frees` for frees) and
//!   logs one line, at most one per second, on stderr. Out of memory is not logged: it is an
//!   expected, recoverable outcome, and the caller gets the full report from the last error.
//!   A thread that reports errors itself turns the line off for its calls (`cistern_log_errors`).
//! * The last error is never cleared by a successful call (like `errno`): read it right after
//!   a call that failed.
//! * The pool is created on first use (or by `cistern_init`) from `CISTERN_DRIVER`,
//!   `CISTERN_SIM` and `CISTERN_CONF`; see `src/global.rs` for how the driver is picked.
//!
//! # One `cistern_malloc`, from C to the driver and back
//!
//! 1. [`cistern_malloc`] enters `guard::call` (a `catch_unwind`: free unless a panic happens)
//!    and returns NULL at once for size 0.
//! 2. `global::pool` loads the global pool (one atomic load once it exists; the first call
//!    creates it, opening the driver `CISTERN_DRIVER` names).
//! 3. One match on the driver kind picks the concrete `Pool<CudaDriver>` or `Pool<SimDriver>`;
//!    the device ordinal indexes its per-device pools (created on first use).
//! 4. `DevicePool::alloc_raw(size, stream)` (`allocator/src/pool/device.rs`) rounds to 512 B
//!    and, on a cache hit, takes one uncontended arena lock and makes no driver call (the
//!    arena and its heap: `arena/mod.rs`, `heap.rs`). On a miss it grows (`pool/grow.rs`,
//!    `pool/vmm.rs`): it maps pages or allocates a segment through the driver seam
//!    (`driver/mod.rs`, then `driver/cuda/` or `driver/sim/`), or fails with an OOM report.
//! 5. The address comes back as `void*`; a failure becomes NULL and a last error
//!    ("out of memory: ..." with the report, for an OOM).
//!
//! `benches/overhead.rs` measures what steps 1-3 and 5 add to the pool's cache-hit
//! malloc/free pair.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use cistern_alloc::{Error, StreamId};

/// Writes a line to stderr, ignoring failure: `eprintln!` panics when stderr is a closed pipe,
/// and nothing here may panic (code behind the C ABI, exit hooks).
macro_rules! stderr_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

mod global;
mod graphs;
mod guard;
mod ipc;
mod observe;
mod pyframes;
mod report;
mod tags;

#[cfg(test)]
mod tests;

use global::with_pool;
pub use graphs::{cistern_release_fn_t, cistern_stream_filter_t};
use guard::fail;
pub use observe::{
    cistern_event_t, cistern_observer_t, CISTERN_EVENT_FREE_COMPLETED, CISTERN_EVENT_SEGMENT_ALLOC,
    CISTERN_EVENT_SEGMENT_FREE, CISTERN_EVENT_SEGMENT_MAP, CISTERN_EVENT_SEGMENT_UNMAP,
};

/// A CUDA stream: the same value as `cudaStream_t` / `CUstream` (NULL is the legacy default
/// stream). cistern never dereferences it; it identifies the stream to the driver.
#[allow(non_camel_case_types)]
pub type cistern_stream_t = *mut c_void;

/// The library's version, `major.minor.patch`.
const VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("the package version contains a NUL"),
    };

#[inline(always)]
fn stream_id(stream: cistern_stream_t) -> StreamId {
    StreamId(stream as usize as u64)
}

#[inline(always)]
fn addr(ptr: *mut c_void) -> u64 {
    ptr as usize as u64
}

/// Reports a failed pool call: out of memory is said first, and not logged.
#[cold]
#[inline(never)]
fn fail_with(what: String, e: &Error) {
    if e.is_oom() {
        let msg = match e {
            Error::OutOfMemory(_) => format!("{what}: {e}"),
            _ => format!("{what}: out of memory: {e}"),
        };
        fail(msg, false);
    } else {
        fail(format!("{what}: {e}"), true);
    }
}

/// Reports a call that found no pool (its creation failed earlier).
#[cold]
#[inline(never)]
fn fail_no_pool(what: &str, why: &str) {
    fail(format!("{what}: {why}"), true);
}

/// Allocates `size` bytes of device memory on device `device`, for use on `stream`.
///
/// Returns a pointer aligned to 512 bytes, or NULL: for `size` 0 (not an error), or on failure
/// (out of memory, no driver, bad device; see `cistern_last_error`). The memory may be used at
/// once by work on `stream`; to use it on another stream too, call `cistern_record_stream`.
/// PyTorch's `alloc_fn` signature.
#[no_mangle]
pub extern "C" fn cistern_malloc(
    size: usize,
    device: c_int,
    stream: cistern_stream_t,
) -> *mut c_void {
    guard::call("cistern_malloc", ptr::null_mut(), || {
        if size == 0 {
            return ptr::null_mut();
        }
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_malloc", why);
                return ptr::null_mut();
            }
        };
        let r = with_pool!(pool, |p| global::device(p, device)
            .and_then(|d| d.alloc_raw(size as u64, stream_id(stream))));
        match r {
            Ok(p) => p as usize as *mut c_void,
            Err(e) => {
                let what =
                    format!("cistern_malloc({size} bytes, device {device}, stream {stream:p})");
                if ABORT_ON_FAILURE.load(std::sync::atomic::Ordering::Relaxed) {
                    abort_with(&what, &e);
                }
                fail_with(what, &e);
                ptr::null_mut()
            }
        }
    })
}

/// Set by `cistern_abort_on_failure`: a failed `cistern_malloc` aborts instead of returning NULL.
static ABORT_ON_FAILURE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Prints the failure with its report and aborts the process (`cistern_abort_on_failure`).
#[cold]
#[inline(never)]
fn abort_with(what: &str, e: &Error) -> ! {
    stderr_line!(
        "cistern: {what} failed: {e}\ncistern: aborting, as cistern_abort_on_failure asked: the \
         caller cannot handle a NULL pointer (for PyTorch, install a C++ compiler so that \
         cistern_torch raises torch.OutOfMemoryError instead)"
    );
    std::process::abort()
}

/// Makes every later failed `cistern_malloc` of a non-zero size print its error (the OOM report)
/// on stderr and abort the process instead of returning NULL (`on` non-zero), or return NULL
/// again (`on` 0). For callers that cannot handle NULL: PyTorch's pluggable-allocator mode
/// builds a tensor on a NULL pointer, so a later kernel fails with an illegal address far from
/// the cause. Returns the previous setting.
#[no_mangle]
pub extern "C" fn cistern_abort_on_failure(on: c_int) -> c_int {
    ABORT_ON_FAILURE.swap(on != 0, std::sync::atomic::Ordering::Relaxed) as c_int
}

/// Frees `ptr` as `cistern_free` does, then returns device `device`'s cached memory to the
/// driver (as `cistern_empty_cache` does for that device). For callers that cache memory
/// themselves and give it back only to release it: PyTorch's caching allocator frees a
/// `MemPool`'s segments to their allocator on `torch.cuda.empty_cache()`, on its OOM retry and
/// when the pool goes away, and expects the memory to be free for `cudaMalloc` then.
#[no_mangle]
pub extern "C" fn cistern_free_and_release(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: cistern_stream_t,
) {
    cistern_free(ptr, size, device, stream);
    guard::call("cistern_free_and_release", (), || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => return fail_no_pool("cistern_free_and_release", why),
        };
        if let Err(e) = with_pool!(pool, |p| global::device(p, device).map(|d| d.empty_cache())) {
            fail(
                format!("cistern_free_and_release(device {device}): {e}"),
                true,
            );
        }
    })
}

/// Frees `ptr`, returned by `cistern_malloc` for device `device`.
///
/// `stream` should be the allocation's stream (PyTorch passes it); work already queued on it
/// may still use the memory: cistern reuses the block only in that stream's order, or after
/// that work has finished. `size` is not checked. Freeing NULL does nothing. An unknown or
/// already freed pointer, or one of another device, is counted (`num_invalid_frees`), logged
/// and ignored. PyTorch's `free_fn` signature.
#[no_mangle]
pub extern "C" fn cistern_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: cistern_stream_t,
) {
    guard::call("cistern_free", (), || {
        let _ = size;
        if ptr.is_null() {
            return;
        }
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => return fail_no_pool("cistern_free", why),
        };
        let r = with_pool!(pool, |p| global::device(p, device)
            .map(|d| d.free_raw(addr(ptr), stream_id(stream))));
        match r {
            Ok(Ok(())) => {}
            // The device pool has counted and logged the invalid free.
            Ok(Err(e)) => fail(
                format!("cistern_free({ptr:p}, device {device}): {e}"),
                false,
            ),
            Err(e) => fail(format!("cistern_free({ptr:p}, device {device}): {e}"), true),
        }
    })
}

/// Creates the pool now rather than on the first allocation (PyTorch's `init_fn`, called with
/// its device count). A failure (no driver, bad `CISTERN_CONF`) is reported through
/// `cistern_last_error` here and by every later call.
#[no_mangle]
pub extern "C" fn cistern_init(device_count: c_int) {
    guard::call("cistern_init", (), || {
        let _ = device_count;
        if let Err(why) = global::pool() {
            fail_no_pool("cistern_init", why);
        }
    })
}

/// Returns every device's cached memory to the driver (live blocks stay). PyTorch's
/// `reset_fn` / `torch.cuda.empty_cache()`.
#[no_mangle]
pub extern "C" fn cistern_empty_cache() {
    guard::call("cistern_empty_cache", (), || match global::pool() {
        Ok(pool) => with_pool!(pool, |p| p.empty_cache()),
        Err(why) => fail_no_pool("cistern_empty_cache", why),
    })
}

/// Limits device `device`'s reserved memory to `fraction` (in [0, 1]) of its total memory,
/// releasing cached memory above the new limit. Out-of-range values are refused (last error).
/// PyTorch's `memory_fraction_fn`.
#[no_mangle]
pub extern "C" fn cistern_set_memory_fraction(fraction: f64, device: c_int) {
    guard::call("cistern_set_memory_fraction", (), || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => return fail_no_pool("cistern_set_memory_fraction", why),
        };
        let r = with_pool!(pool, |p| global::device(p, device)
            .and_then(|d| d.set_memory_fraction(fraction)));
        if let Err(e) = r {
            fail_with(
                format!("cistern_set_memory_fraction({fraction}, device {device})"),
                &e,
            );
        }
    })
}

/// Device `device`'s per-process limit as a fraction of its memory (1.0 when none was set;
/// `cistern_set_memory_fraction` or `memory_fraction` in `CISTERN_CONF` set it), or -1.0 for a
/// bad device or no pool (last error). PyTorch's `get_per_process_memory_fraction`.
#[no_mangle]
pub extern "C" fn cistern_get_memory_fraction(device: c_int) -> f64 {
    guard::call("cistern_get_memory_fraction", -1.0, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_get_memory_fraction", why);
                return -1.0;
            }
        };
        match with_pool!(pool, |p| global::device(p, device)
            .map(|d| d.memory_fraction()))
        {
            Ok(f) => f,
            Err(e) => {
                fail_with(format!("cistern_get_memory_fraction(device {device})"), &e);
                -1.0
            }
        }
    })
}

/// The device's free and total bytes as the driver reported them at device `device`'s last
/// failed request (out of memory or over the limit), written to `*device_free` and
/// `*device_total` (each may be NULL). Returns 1, or 0 when no request has failed there yet (or
/// for a bad device: last error), writing nothing. What PyTorch's OOM observers and the `oom`
/// trace entry carry.
///
/// # Safety
///
/// `device_free` and `device_total` are each NULL or point to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cistern_last_oom(
    device: c_int,
    device_free: *mut usize,
    device_total: *mut usize,
) -> c_int {
    let found = guard::call("cistern_last_oom", None, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_last_oom", why);
                return None;
            }
        };
        match with_pool!(pool, |p| global::device(p, device).map(|d| d.last_oom())) {
            Ok(r) => r.map(|r| (r.device_free, r.device_total)),
            Err(e) => {
                fail_with(format!("cistern_last_oom(device {device})"), &e);
                None
            }
        }
    });
    let Some((free, total)) = found else {
        return 0;
    };
    if !device_free.is_null() {
        // SAFETY: non-NULL, so writable (the caller's contract).
        unsafe { device_free.write(free.min(usize::MAX as u64) as usize) };
    }
    if !device_total.is_null() {
        // SAFETY: as above.
        unsafe { device_total.write(total.min(usize::MAX as u64) as usize) };
    }
    1
}

/// What device `device` can give a workspace at once, as PyTorch's `cacheInfo` reports it for
/// cuDNN: the largest free block cached in the pool, written to `*largest_free`, and the bytes
/// growth may still map (the device's free memory, no more than the memory limit leaves),
/// written to `*room` (each may be NULL). PyTorch's answer is the larger of the two. Returns 1,
/// or 0 for a bad device (last error), writing nothing. Costs a `cuMemGetInfo` and a scan of
/// the pool's free blocks: not for a hot path.
///
/// # Safety
///
/// `largest_free` and `room` are each NULL or point to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cistern_cache_info(
    device: c_int,
    largest_free: *mut usize,
    room: *mut usize,
) -> c_int {
    let found = guard::call("cistern_cache_info", None, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_cache_info", why);
                return None;
            }
        };
        match with_pool!(pool, |p| global::device(p, device).map(|d| d.cache_info())) {
            Ok(info) => Some(info),
            Err(e) => {
                fail_with(format!("cistern_cache_info(device {device})"), &e);
                None
            }
        }
    });
    let Some(info) = found else {
        return 0;
    };
    if !largest_free.is_null() {
        // SAFETY: non-NULL, so writable (the caller's contract).
        unsafe { largest_free.write(info.largest_free.min(usize::MAX as u64) as usize) };
    }
    if !room.is_null() {
        // SAFETY: as above.
        unsafe { room.write(info.room.min(usize::MAX as u64) as usize) };
    }
    1
}

/// Whether device `device`'s pool maps pages itself (VMM: 1) or allocates `cuMemAlloc`
/// segments (`CISTERN_CONF=vmm:false`, or a device without VMM: 0); -1 for a bad device, or
/// when cistern could not start (last error). With VMM, the ranges a snapshot lists are runs
/// of pages that are unmapped and mapped elsewhere as the pool moves them, as PyTorch's
/// expandable segments are; without, they are whole segments.
#[no_mangle]
pub extern "C" fn cistern_uses_vmm(device: c_int) -> c_int {
    guard::call("cistern_uses_vmm", -1, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_uses_vmm", why);
                return -1;
            }
        };
        match with_pool!(pool, |p| global::device(p, device).map(|d| d.uses_vmm())) {
            Ok(v) => c_int::from(v),
            Err(e) => {
                fail_with(format!("cistern_uses_vmm(device {device})"), &e);
                -1
            }
        }
    })
}

/// Grants device `peer` read/write access to every mapping of device `device`'s pool, present
/// and future: VMM mappings need access per peer, which `cudaDeviceEnablePeerAccess` does not
/// give (for `vmm:false` pools that call is all a peer needs, and this one only records the
/// peer). Returns 1 on success (also when `peer` already had access), 0 on failure (`peer` is
/// `device`, does not exist or cannot access it, or the driver refused; see
/// `cistern_last_error`). PyTorch's `enablePeerAccess(dev, dev_to_access)` is this call with
/// `device = dev_to_access` and `peer = dev`.
#[no_mangle]
pub extern "C" fn cistern_enable_peer_access(device: c_int, peer: c_int) -> c_int {
    guard::call("cistern_enable_peer_access", 0, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_enable_peer_access", why);
                return 0;
            }
        };
        let r = match usize::try_from(peer) {
            Ok(peer) => with_pool!(pool, |p| global::device(p, device)
                .and_then(|d| d.enable_peer_access(peer))),
            Err(_) => Err(Error::InvalidArgument(format!(
                "peer {peer} is negative: name a device ordinal"
            ))),
        };
        match r {
            Ok(()) => 1,
            Err(e) => {
                fail_with(
                    format!("cistern_enable_peer_access(device {device}, peer {peer})"),
                    &e,
                );
                0
            }
        }
    })
}

/// Declares that `stream` uses the allocation containing `ptr` (its base or any address
/// inside it): once freed, it is not reused until the work queued on `stream` by then has
/// finished. An unknown pointer is reported (last error) and otherwise ignored. PyTorch's
/// `record_stream_fn` (`Tensor.record_stream`).
#[no_mangle]
pub extern "C" fn cistern_record_stream(ptr: *mut c_void, stream: cistern_stream_t) {
    guard::call("cistern_record_stream", (), || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => return fail_no_pool("cistern_record_stream", why),
        };
        if let Err(e) = with_pool!(pool, |p| p.record_stream(addr(ptr), stream_id(stream))) {
            fail(
                format!("cistern_record_stream({ptr:p}, {stream:p}): {e}"),
                true,
            );
        }
    })
}

/// Says that `stream` is about to be destroyed (or just was): cistern never names it again, and
/// a stream that later gets the same handle from the driver is not served the gone stream's
/// cached memory (whose last work may still be running). Live allocations made on it stay
/// valid. Call it around `cuStreamDestroy` / `cudaStreamDestroy` when streams are created and
/// destroyed while the process runs (PyTorch's streams never are). The default streams (0,
/// `cudaStreamLegacy`, `cudaStreamPerThread`) are refused (last error).
#[no_mangle]
pub extern "C" fn cistern_forget_stream(stream: cistern_stream_t) {
    guard::call("cistern_forget_stream", (), || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => return fail_no_pool("cistern_forget_stream", why),
        };
        if let Err(e) = with_pool!(pool, |p| p.forget_stream(stream_id(stream))) {
            fail(format!("cistern_forget_stream({stream:p}): {e}"), true);
        }
    })
}

/// The base address and size of the allocation that contains `ptr` (any address inside a
/// live allocation), as PyTorch's `getBaseAllocation` means it: the memory to share with
/// another process, `ptr` being at offset `ptr - base` in it. For a pool of `cuMemAlloc`
/// segments (`CISTERN_CONF=vmm:false`) that is the whole segment, whose base
/// `cudaIpcGetMemHandle` accepts; with VMM (the default) it is the allocation itself, which
/// CUDA IPC cannot share (as PyTorch's expandable segments): `cistern_ipc_share` shares either
/// kind with another process.
///
/// Writes the size to `*size` when `size` is not NULL (0 on failure). Returns NULL when `ptr`
/// is not inside a live allocation. Scans the device's blocks: meant for sharing tensors, not
/// for hot paths. PyTorch's `base_alloc_fn`.
///
/// # Safety
///
/// `size` must be NULL or point to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cistern_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    let found = guard::call("cistern_base_alloc", None, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_base_alloc", why);
                return None;
            }
        };
        let r = with_pool!(pool, |p| report::base_allocation(p, addr(ptr)));
        if r.is_none() {
            fail(
                format!("cistern_base_alloc({ptr:p}): not inside a live allocation"),
                true,
            );
        }
        r
    });
    let (base, len) = found.unwrap_or((0, 0));
    if !size.is_null() {
        // SAFETY: the caller guarantees that a non-null `size` points to a writable size_t.
        unsafe { size.write(len as usize) };
    }
    base as usize as *mut c_void
}

/// Writes device `device`'s statistics as a JSON object into `buf`, with the key names of
/// `torch.cuda.memory_stats()` (`"allocated_bytes.all.current"`, `"reserved_bytes.all.peak"`,
/// `"num_ooms"`, ...) and cistern's own counters (`"num_invalid_frees"`, `"num_abi_errors"`,
/// ...). Values are integers.
///
/// `snprintf`'s rules: returns the length of the whole document (without the NUL); writes at
/// most `cap - 1` bytes and a NUL when `cap > 0`. Call with `cap` 0 to size the buffer. On
/// failure (bad device, no driver) returns 0 and writes an empty string.
///
/// # Safety
///
/// When `cap > 0`, `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cistern_stats_json(device: c_int, buf: *mut c_char, cap: usize) -> usize {
    let text = guard::call("cistern_stats_json", String::new(), || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_stats_json", why);
                return String::new();
            }
        };
        match with_pool!(pool, |p| report::stats_json(p, device)) {
            Ok(s) => s,
            Err(e) => {
                fail_with(format!("cistern_stats_json(device {device})"), &e);
                String::new()
            }
        }
    });
    // SAFETY: the caller guarantees `buf` is NULL or has `cap` writable bytes.
    unsafe { report::write_c_string(&text, buf.cast(), cap) }
}

/// Writes a snapshot of every device pool in use as JSON into `buf`, in the schema of
/// `torch.cuda.memory._snapshot()`: `{"segments": [...], "device_traces": [[...], ...]}`, each
/// segment with its blocks (`address`, `size`, `requested_size`, `state`: `active_allocated`,
/// `active_pending_free` or `inactive`). `device_traces` lists are empty (no event history is
/// kept yet).
///
/// `snprintf`'s rules, as `cistern_stats_json`. The pool may change between a sizing call and
/// the real one: retry when the result is not below `cap`.
///
/// # Safety
///
/// When `cap > 0`, `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cistern_snapshot_json(buf: *mut c_char, cap: usize) -> usize {
    let text = guard::call(
        "cistern_snapshot_json",
        String::new(),
        || match global::pool() {
            Ok(pool) => with_pool!(pool, |p| report::snapshot_json(p)),
            Err(why) => {
                fail_no_pool("cistern_snapshot_json", why);
                String::new()
            }
        },
    );
    // SAFETY: the caller guarantees `buf` is NULL or has `cap` writable bytes.
    unsafe { report::write_c_string(&text, buf.cast(), cap) }
}

/// Sets every peak statistic of device `device` to its current value
/// (`torch.cuda.reset_peak_memory_stats`).
#[no_mangle]
pub extern "C" fn cistern_reset_peak_stats(device: c_int) {
    guard::call("cistern_reset_peak_stats", (), || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => return fail_no_pool("cistern_reset_peak_stats", why),
        };
        let r = with_pool!(pool, |p| global::device(p, device)
            .map(|d| d.reset_peak_stats()));
        if let Err(e) = r {
            fail_with(format!("cistern_reset_peak_stats(device {device})"), &e);
        }
    })
}

/// The message of the latest failed call on this thread: never NULL, "" when no call has
/// failed. Successful calls do not clear it. The string stays valid until the next failed
/// call on this thread.
#[no_mangle]
pub extern "C" fn cistern_last_error() -> *const c_char {
    guard::call("cistern_last_error", c"".as_ptr(), guard::last_error_ptr)
}

/// Whether a failed call on this thread also logs its message on stderr (`on` non-zero, the
/// default) or only sets `cistern_last_error` (`on` 0). For callers that report every error
/// themselves, such as the Python binding, which raises it: the message is then shown once.
/// Only this thread's calls are affected (PyTorch's calls into the hooks on other threads
/// still log). Returns the previous setting (1 or 0).
#[no_mangle]
pub extern "C" fn cistern_log_errors(on: c_int) -> c_int {
    guard::call("cistern_log_errors", 1, || {
        c_int::from(guard::set_log_errors(on != 0))
    })
}

/// The library's version, `"major.minor.patch"` (a static string).
#[no_mangle]
pub extern "C" fn cistern_version() -> *const c_char {
    VERSION.as_ptr()
}

/// Pushes `tag` (a NUL-terminated string, copied; invalid UTF-8 is replaced) on this thread's
/// stack of provenance tags: until it is popped, every allocation this thread makes is tagged
/// with it (the innermost tag wins; unless `CISTERN_CONF` has `provenance:off`). NULL is
/// refused, as is a stack deeper than 1024.
///
/// # Safety
///
/// `tag` must be NULL or point to a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cistern_tag_push(tag: *const c_char) {
    guard::call("cistern_tag_push", (), || {
        if tag.is_null() {
            return fail("cistern_tag_push(NULL): a tag is required".into(), true);
        }
        // SAFETY: `tag` is not null, and the caller guarantees it is NUL-terminated.
        let text = unsafe { CStr::from_ptr(tag) }
            .to_string_lossy()
            .into_owned();
        if let Err(e) = tags::push(text) {
            fail(format!("cistern_tag_push: {e}"), true);
        }
    })
}

/// Pops the innermost tag of this thread's stack (reported as an error when it is empty).
#[no_mangle]
pub extern "C" fn cistern_tag_pop() {
    guard::call("cistern_tag_pop", (), || {
        if let Err(e) = tags::pop() {
            fail(format!("cistern_tag_pop: {e}"), true);
        }
    })
}

/// Names call sites by their Python frames (`on` = 1) or by native backtraces (`on` = 0, the
/// default). With it on, each sampled stack (`CISTERN_CONF=provenance:stacks`, one allocation
/// in `stack_sample_rate`) made by a thread that runs Python code is that thread's Python
/// frames, innermost first, each `function (file:line)`, as `cistern leaks`, `cistern ps` and
/// OOM reports show them; other threads keep native backtraces. Reading the frames takes the
/// GIL on the allocating thread (as PyTorch's own history recorder does), only when a stack is
/// due, on a thread with a Python thread state. cistern_torch turns it on when it loads the
/// library, and off again at exit, before the interpreter finalises (turn it off before then
/// when calling this yourself).
///
/// Returns 1 when it is on afterwards, 0 when off, and -1 when it cannot be turned on: the
/// process runs no CPython 3.9 or later (`cistern_last_error` says so).
#[no_mangle]
pub extern "C" fn cistern_python_frames(on: c_int) -> c_int {
    guard::call("cistern_python_frames", -1, || {
        match pyframes::set(on != 0) {
            Ok(()) => c_int::from(pyframes::is_on()),
            Err(e) => {
                fail(format!("cistern_python_frames: {e}"), false);
                -1
            }
        }
    })
}
