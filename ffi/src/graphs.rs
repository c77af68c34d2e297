//! The graph-pool exports: CUDA graphs' private memory (PyTorch's `beginAllocateToPool`,
//! `endAllocateToPool`, `releasePool`, `createOrIncrefPool`, `getPoolUseCount`), with the C
//! stream filter a window takes and the release of its context. The pool's side is
//! `cistern_alloc::pool::graphs`.

use std::ffi::{c_int, c_void};

use cistern_alloc::StreamId;

use crate::global::{self, with_pool};
use crate::{cistern_stream_t, fail_no_pool, fail_with, guard};

/// A stream filter of an allocation window (`cistern_begin_allocate_to_pool`): returns 1 for the
/// streams whose allocations go to the graph pool, 0 for the others, and a negative value when
/// it cannot tell (the allocation then fails, rather than be served from memory reused outside
/// the graph). It is called with `ctx` from any thread that allocates while the window is open,
/// under cistern's graph-pool lock (so never after `cistern_end_allocate_to_pool` returned); it
/// must be thread-safe, must not unwind or throw, and must not call cistern.
#[allow(non_camel_case_types)]
pub type cistern_stream_filter_t =
    Option<unsafe extern "C" fn(ctx: *mut c_void, stream: cistern_stream_t) -> c_int>;

/// Releases the context of a stream filter (`cistern_begin_allocate_to_pool`); called once,
/// from any thread and with no lock of cistern's held, when cistern no longer needs it. Must not
/// unwind or throw.
#[allow(non_camel_case_types)]
pub type cistern_release_fn_t = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

/// A caller's context for a callback (a stream filter, an observer) and the function that
/// releases it, called once when this is dropped.
pub(crate) struct CallerContext {
    pub(crate) ctx: *mut c_void,
    pub(crate) release: cistern_release_fn_t,
}

// SAFETY: the contracts of the exports that take a context (`cistern_begin_allocate_to_pool`,
// `cistern_set_observer`) make their callbacks, with the context, and its release callable
// from any thread; cistern never dereferences `ctx`.
unsafe impl Send for CallerContext {}
// SAFETY: as above: shared calls are allowed by those contracts.
unsafe impl Sync for CallerContext {}

impl Drop for CallerContext {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            // SAFETY: called once, with the context the caller gave for it.
            unsafe { release(self.ctx) }
        }
    }
}

/// A C stream filter and its context, as the pool's [`StreamFilter`] holds it: the context is
/// released when the last copy of the filter is dropped.
struct CFilter {
    filter: cistern_stream_filter_t,
    cx: CallerContext,
}

impl CFilter {
    fn accepts(&self, stream: StreamId) -> std::result::Result<bool, String> {
        match self.filter {
            Some(f) => {
                // SAFETY: a filter the caller gave with this context, callable from any thread.
                let r = unsafe { f(self.cx.ctx, stream.0 as usize as cistern_stream_t) };
                if r < 0 {
                    Err(format!("the C filter returned {r}"))
                } else {
                    Ok(r != 0)
                }
            }
            None => Ok(true),
        }
    }
}

/// Opens an *allocation window* into the graph pool `(pool_id_0, pool_id_1)` of device `device`
/// (PyTorch's `beginAllocateToPool`, keyed by its `MempoolId_t`): until
/// `cistern_end_allocate_to_pool`, allocations on the streams `filter` accepts (every stream
/// when `filter` is NULL) come from the pool's private memory, which is reused only by later
/// allocations into the same pool and is never moved, taken by other streams or released until
/// the pool's last use is released (`cistern_release_pool`). Each call is one use of the pool.
/// While any window of the device is open, cistern makes no call that a CUDA stream capture
/// forbids (no event query or synchronisation): call it before `cudaStreamBeginCapture` and end
/// the window after `cudaStreamEndCapture`, as PyTorch does.
///
/// `release` (may be NULL) is called with `ctx` once the window no longer needs the filter:
/// when the window ends or its pool is released, or at once when this call fails. Returns 1 on
/// success, 0 on failure (a bad device; see `cistern_last_error`).
#[no_mangle]
pub extern "C" fn cistern_begin_allocate_to_pool(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
    filter: cistern_stream_filter_t,
    ctx: *mut c_void,
    release: cistern_release_fn_t,
) -> c_int {
    let filter = CFilter {
        filter,
        cx: CallerContext { ctx, release },
    };
    guard::call("cistern_begin_allocate_to_pool", 0, move || {
        let what = format!(
            "cistern_begin_allocate_to_pool(device {device}, pool ({pool_id_0}, {pool_id_1}))"
        );
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool(&what, why);
                return 0;
            }
        };
        let id = cistern_alloc::MempoolId(pool_id_0, pool_id_1);
        let f: cistern_alloc::StreamFilter = std::sync::Arc::new(move |s| filter.accepts(s));
        match with_pool!(pool, |p| global::device(p, device)
            .map(|d| d.begin_allocate_to_pool(id, Some(f))))
        {
            Ok(()) => 1,
            Err(e) => {
                fail_with(what, &e);
                0
            }
        }
    })
}

/// Closes the latest allocation window into graph pool `(pool_id_0, pool_id_1)` of device
/// `device` (PyTorch's `endAllocateToPool`). The pool's memory stays the graph's until
/// `cistern_release_pool`. Returns 1, or 0 when no such window is open (last error).
#[no_mangle]
pub extern "C" fn cistern_end_allocate_to_pool(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
) -> c_int {
    guard::call("cistern_end_allocate_to_pool", 0, || {
        pool_call(
            "cistern_end_allocate_to_pool",
            device,
            pool_id_0,
            pool_id_1,
            |d, id| d.end_allocate_to_pool(id),
        )
    })
}

/// Drops one use of graph pool `(pool_id_0, pool_id_1)` of device `device` (PyTorch's
/// `releasePool`, when a graph or `MemPool` that used it is destroyed). At the last use the
/// pool's blocks still allocated stay valid and can be freed, and its memory returns to the
/// device's cache once the device's work is done. Returns 1, or 0 when the device has no such
/// pool (last error).
#[no_mangle]
pub extern "C" fn cistern_release_pool(device: c_int, pool_id_0: u64, pool_id_1: u64) -> c_int {
    guard::call("cistern_release_pool", 0, || {
        pool_call(
            "cistern_release_pool",
            device,
            pool_id_0,
            pool_id_1,
            |d, id| d.release_pool(id),
        )
    })
}

/// Returns the cached memory of graph pool `(pool_id_0, pool_id_1)` to the driver, on every
/// device where the pool's last use is released (PyTorch's `emptyCache(mempool_id)`): its
/// blocks still allocated stay, and a pool still in use, or one that never existed, keeps or
/// releases nothing. Devices this process has not used are not touched. Returns 1, or 0 when
/// cistern could not start (last error).
#[no_mangle]
pub extern "C" fn cistern_empty_pool_cache(pool_id_0: u64, pool_id_1: u64) -> c_int {
    guard::call("cistern_empty_pool_cache", 0, || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_empty_pool_cache", why);
                return 0;
            }
        };
        let id = cistern_alloc::MempoolId(pool_id_0, pool_id_1);
        with_pool!(pool, |p| p.empty_pool_cache(id));
        1
    })
}

/// One more use of graph pool `(pool_id_0, pool_id_1)` of device `device`, made if new, without
/// opening a window (PyTorch's `createOrIncrefPool`, when a `MemPool` is made); released by
/// `cistern_release_pool`. Returns 1, or 0 for a bad device (last error).
#[no_mangle]
pub extern "C" fn cistern_create_or_incref_pool(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
) -> c_int {
    guard::call("cistern_create_or_incref_pool", 0, || {
        pool_call(
            "cistern_create_or_incref_pool",
            device,
            pool_id_0,
            pool_id_1,
            |d, id| {
                d.create_or_incref_pool(id);
                Ok(())
            },
        )
    })
}

/// Whether graph pool `(pool_id_0, pool_id_1)` of device `device` serves, with its free blocks,
/// allocations outside it that run out of memory (`on` non-zero): PyTorch's
/// `MemPool(use_on_oom=True)` (`setUseOnOOM`). The block taken stays the pool's; the failed
/// attempt still counts in `num_ooms`. Returns 1, or 0 for a bad device or a pool that does
/// not exist (last error).
#[no_mangle]
pub extern "C" fn cistern_set_use_on_oom(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
    on: c_int,
) -> c_int {
    guard::call("cistern_set_use_on_oom", 0, || {
        pool_call(
            "cistern_set_use_on_oom",
            device,
            pool_id_0,
            pool_id_1,
            |d, id| d.set_use_on_oom(id, on != 0),
        )
    })
}

/// The uses of graph pool `(pool_id_0, pool_id_1)` of device `device` not yet released (0 when
/// there is none); -1 for a bad device (last error). PyTorch's `getPoolUseCount`.
#[no_mangle]
pub extern "C" fn cistern_pool_use_count(device: c_int, pool_id_0: u64, pool_id_1: u64) -> i64 {
    guard::call("cistern_pool_use_count", -1, || {
        let mut n = 0u64;
        let ok = pool_call(
            "cistern_pool_use_count",
            device,
            pool_id_0,
            pool_id_1,
            |d, id| {
                n = d.pool_use_count(id);
                Ok(())
            },
        );
        if ok == 1 {
            n.min(i64::MAX as u64) as i64
        } else {
            -1
        }
    })
}

/// The live blocks of graph pool `(pool_id_0, pool_id_1)` of device `device`: writes up to
/// `cap` of their addresses, in order, to `out` (which may be NULL when `cap` is 0) and
/// returns how many there are (call again with a larger buffer when that is more than `cap`);
/// -1 for a bad device or a pool that does not exist (last error). PyTorch's
/// `checkPoolLiveAllocations` compares them with the tensors it knows to be alive.
///
/// # Safety
///
/// `out` must be valid for writing `cap` pointers, or `cap` must be 0.
#[no_mangle]
pub unsafe extern "C" fn cistern_pool_live_blocks(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
    out: *mut *mut c_void,
    cap: usize,
) -> i64 {
    guard::call("cistern_pool_live_blocks", -1, || {
        let mut blocks = Vec::new();
        let ok = pool_call(
            "cistern_pool_live_blocks",
            device,
            pool_id_0,
            pool_id_1,
            |d, id| {
                blocks = d.pool_live_blocks(id)?;
                Ok(())
            },
        );
        if ok != 1 {
            return -1;
        }
        if !out.is_null() {
            for (i, &b) in blocks.iter().take(cap).enumerate() {
                // SAFETY: the caller gave room for `cap` pointers at `out`; `i < cap`.
                unsafe { *out.add(i) = b as *mut c_void };
            }
        }
        blocks.len().min(i64::MAX as usize) as i64
    })
}

/// A checkpoint of a graph pool's live blocks (`cistern_pool_checkpoint`), opaque; freed with
/// `cistern_checkpoint_free`.
#[allow(non_camel_case_types)]
pub struct cistern_checkpoint_t {
    device: c_int,
    cp: cistern_alloc::PoolCheckpoint,
}

/// A checkpoint of graph pool `(pool_id_0, pool_id_1)` of device `device`: its live blocks now
/// (PyTorch's `getCheckpointState`, which CUDA graph trees take after each recording). NULL for
/// a bad device or a pool that does not exist (last error). Free it with
/// `cistern_checkpoint_free`.
#[no_mangle]
pub extern "C" fn cistern_pool_checkpoint(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
) -> *mut cistern_checkpoint_t {
    guard::call("cistern_pool_checkpoint", std::ptr::null_mut(), || {
        let mut cp = None;
        let ok = pool_call(
            "cistern_pool_checkpoint",
            device,
            pool_id_0,
            pool_id_1,
            |d, id| {
                cp = Some(d.checkpoint_pool(id)?);
                Ok(())
            },
        );
        match cp {
            Some(cp) if ok == 1 => Box::into_raw(Box::new(cistern_checkpoint_t { device, cp })),
            _ => std::ptr::null_mut(),
        }
    })
}

/// Frees a checkpoint. NULL does nothing.
///
/// # Safety
///
/// `cp` must be NULL or a checkpoint from `cistern_pool_checkpoint` not freed yet.
#[no_mangle]
pub unsafe extern "C" fn cistern_checkpoint_free(cp: *mut cistern_checkpoint_t) {
    guard::call("cistern_checkpoint_free", (), || {
        if !cp.is_null() {
            // SAFETY: made by Box::into_raw in cistern_pool_checkpoint, freed once (contract).
            drop(unsafe { Box::from_raw(cp) });
        }
    })
}

/// Called by `cistern_pool_restore` for each block it changed: `allocated` 0 for a block that
/// was live and is now free (`size` 0, `stream` NULL), 1 for a checkpoint block live again
/// (`size`: the bytes asked for; `stream`: its allocation's stream). Must not unwind, throw or
/// call cistern.
#[allow(non_camel_case_types)]
pub type cistern_restore_fn_t = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        allocated: c_int,
        ptr: *mut c_void,
        size: usize,
        stream: cistern_stream_t,
    ),
>;

/// Puts the graph pool of checkpoint `cp` back to it (PyTorch's `setCheckpointPoolState`):
/// frees every block live in the pool now and makes the checkpoint's blocks live again at
/// their addresses, then calls `each` (when not NULL) with `ctx` for every block freed and
/// every block made live, in that order. Returns 1; 0 (last error) for a NULL checkpoint, a
/// pool released since, an allocation window open on the device, or a checkpoint whose block
/// ranges are not free after the frees (then the pool's blocks are freed and `each` hears of
/// no block).
///
/// # Safety
///
/// `cp` must be NULL or a live checkpoint from `cistern_pool_checkpoint`; `each` must follow
/// `cistern_restore_fn_t`'s contract.
#[no_mangle]
pub unsafe extern "C" fn cistern_pool_restore(
    cp: *const cistern_checkpoint_t,
    each: cistern_restore_fn_t,
    ctx: *mut c_void,
) -> c_int {
    guard::call("cistern_pool_restore", 0, || {
        if cp.is_null() {
            fail_with(
                "cistern_pool_restore".to_string(),
                &cistern_alloc::Error::InvalidArgument(
                    "the checkpoint is NULL: pass one from cistern_pool_checkpoint".into(),
                ),
            );
            return 0;
        }
        // SAFETY: a live checkpoint (contract), only read here.
        let cp = unsafe { &*cp };
        let mut delta = None;
        let ok = pool_call(
            "cistern_pool_restore",
            cp.device,
            cp.cp.id.0,
            cp.cp.id.1,
            |d, _| {
                delta = Some(d.restore_pool(&cp.cp)?);
                Ok(())
            },
        );
        let Some(delta) = delta.filter(|_| ok == 1) else {
            return 0;
        };
        if let Some(f) = each {
            for &p in &delta.freed {
                // SAFETY: the caller's callback, under its contract.
                unsafe { f(ctx, 0, p as *mut c_void, 0, std::ptr::null_mut()) };
            }
            for b in &delta.allocated {
                // SAFETY: as above.
                unsafe {
                    f(
                        ctx,
                        1,
                        b.ptr as *mut c_void,
                        b.requested as usize,
                        b.stream.0 as cistern_stream_t,
                    )
                };
            }
        }
        1
    })
}

/// Runs a graph-pool call `f` on device `device`: 1 on success, 0 with a last error.
fn pool_call(
    name: &str,
    device: c_int,
    a: u64,
    b: u64,
    mut f: impl FnMut(&dyn GraphPools, cistern_alloc::MempoolId) -> cistern_alloc::Result<()>,
) -> c_int {
    let what = format!("{name}(device {device}, pool ({a}, {b}))");
    let pool = match global::pool() {
        Ok(p) => p,
        Err(why) => {
            fail_no_pool(&what, why);
            return 0;
        }
    };
    let id = cistern_alloc::MempoolId(a, b);
    match with_pool!(pool, |p| global::device(p, device)
        .and_then(|d| f(&**d, id)))
    {
        Ok(()) => 1,
        Err(e) => {
            fail_with(what, &e);
            0
        }
    }
}

/// The graph-pool calls of a device pool, whatever its driver.
trait GraphPools {
    fn end_allocate_to_pool(&self, id: cistern_alloc::MempoolId) -> cistern_alloc::Result<()>;
    fn release_pool(&self, id: cistern_alloc::MempoolId) -> cistern_alloc::Result<()>;
    fn create_or_incref_pool(&self, id: cistern_alloc::MempoolId);
    fn pool_use_count(&self, id: cistern_alloc::MempoolId) -> u64;
    fn set_use_on_oom(&self, id: cistern_alloc::MempoolId, on: bool) -> cistern_alloc::Result<()>;
    fn pool_live_blocks(&self, id: cistern_alloc::MempoolId) -> cistern_alloc::Result<Vec<u64>>;
    fn checkpoint_pool(
        &self,
        id: cistern_alloc::MempoolId,
    ) -> cistern_alloc::Result<cistern_alloc::PoolCheckpoint>;
    fn restore_pool(
        &self,
        cp: &cistern_alloc::PoolCheckpoint,
    ) -> cistern_alloc::Result<cistern_alloc::RestoreDelta>;
}

impl<D: cistern_alloc::Driver> GraphPools for cistern_alloc::DevicePool<D> {
    fn end_allocate_to_pool(&self, id: cistern_alloc::MempoolId) -> cistern_alloc::Result<()> {
        cistern_alloc::DevicePool::end_allocate_to_pool(self, id)
    }
    fn release_pool(&self, id: cistern_alloc::MempoolId) -> cistern_alloc::Result<()> {
        cistern_alloc::DevicePool::release_pool(self, id)
    }
    fn create_or_incref_pool(&self, id: cistern_alloc::MempoolId) {
        cistern_alloc::DevicePool::create_or_incref_pool(self, id)
    }
    fn pool_use_count(&self, id: cistern_alloc::MempoolId) -> u64 {
        cistern_alloc::DevicePool::pool_use_count(self, id)
    }
    fn set_use_on_oom(&self, id: cistern_alloc::MempoolId, on: bool) -> cistern_alloc::Result<()> {
        cistern_alloc::DevicePool::set_use_on_oom(self, id, on)
    }
    fn pool_live_blocks(&self, id: cistern_alloc::MempoolId) -> cistern_alloc::Result<Vec<u64>> {
        cistern_alloc::DevicePool::pool_live_blocks(self, id)
    }
    fn checkpoint_pool(
        &self,
        id: cistern_alloc::MempoolId,
    ) -> cistern_alloc::Result<cistern_alloc::PoolCheckpoint> {
        cistern_alloc::DevicePool::checkpoint_pool(self, id)
    }
    fn restore_pool(
        &self,
        cp: &cistern_alloc::PoolCheckpoint,
    ) -> cistern_alloc::Result<cistern_alloc::RestoreDelta> {
        cistern_alloc::DevicePool::restore_pool(self, cp)
    }
}
