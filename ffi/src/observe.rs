//! The observer export: a C callback told of every device's mappings, segments and completed
//! frees (`cistern_alloc::PoolEvent`), for a caller that keeps its own history (cistern_torch's
//! native mode records them in PyTorch's trace as `segment_map`, `segment_unmap`,
//! `segment_alloc`, `segment_free` and `free_completed`).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cistern_alloc::{PoolEvent, PoolEventKind};

use crate::global::{self, with_pool};
use crate::graphs::{cistern_release_fn_t, CallerContext};
use crate::{fail_no_pool, guard};

/// `cistern_event_t.kind`: physical memory mapped (VMM), with access granted.
pub const CISTERN_EVENT_SEGMENT_MAP: c_int = 1;
/// `cistern_event_t.kind`: memory unmapped (moved elsewhere in the pool, or released).
pub const CISTERN_EVENT_SEGMENT_UNMAP: c_int = 2;
/// `cistern_event_t.kind`: a `cuMemAlloc` segment (without VMM).
pub const CISTERN_EVENT_SEGMENT_ALLOC: c_int = 3;
/// `cistern_event_t.kind`: a segment given back with `cuMemFree`.
pub const CISTERN_EVENT_SEGMENT_FREE: c_int = 4;
/// `cistern_event_t.kind`: a freed block (`bytes`: the size asked for) is free for reuse: at its
/// free, or, when other streams used it (`cistern_record_stream`), once their work has
/// completed.
pub const CISTERN_EVENT_FREE_COMPLETED: c_int = 5;

/// One event: `kind` (a `CISTERN_EVENT_*`), on `device`, for the `bytes` bytes at `addr`.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy)]
pub struct cistern_event_t {
    /// What happened: a `CISTERN_EVENT_*`.
    pub kind: c_int,
    /// The device it happened on.
    pub device: c_int,
    /// The first address of the range (or block).
    pub addr: u64,
    /// Its length in bytes.
    pub bytes: u64,
    /// The graph pool (PyTorch's `MempoolId_t`) whose memory or block it is; `(0, 0)`
    /// outside graph pools.
    pub pool_id_0: u64,
    /// The second half of the pool's id.
    pub pool_id_1: u64,
}

/// An observer (`cistern_set_observer`): called with its context and the event on the thread
/// that caused it, with cistern's locks held: it must return quickly, must be thread-safe, must
/// not unwind or throw, and must not call cistern.
#[allow(non_camel_case_types)]
pub type cistern_observer_t =
    Option<unsafe extern "C" fn(ctx: *mut c_void, event: *const cistern_event_t)>;

/// A C observer and its context; the context is released when the last copy is dropped.
struct CObserver {
    f: unsafe extern "C" fn(ctx: *mut c_void, event: *const cistern_event_t),
    cx: CallerContext,
}

impl CObserver {
    fn tell(&self, e: &PoolEvent) {
        let kind = match e.kind {
            PoolEventKind::SegmentMap => CISTERN_EVENT_SEGMENT_MAP,
            PoolEventKind::SegmentUnmap => CISTERN_EVENT_SEGMENT_UNMAP,
            PoolEventKind::SegmentAlloc => CISTERN_EVENT_SEGMENT_ALLOC,
            PoolEventKind::SegmentFree => CISTERN_EVENT_SEGMENT_FREE,
            PoolEventKind::FreeCompleted => CISTERN_EVENT_FREE_COMPLETED,
        };
        let ev = cistern_event_t {
            kind,
            device: e.device as c_int,
            addr: e.addr,
            bytes: e.bytes,
            pool_id_0: e.pool.0,
            pool_id_1: e.pool.1,
        };
        // SAFETY: the caller's observer with its context, callable from any thread; `ev`
        // outlives the call.
        unsafe { (self.f)(self.cx.ctx, &ev) }
    }
}

/// Sets the observer of every device's mappings, segments and completed frees, present and
/// created later (a `cistern_event_t` per event), replacing any earlier one; NULL `observer`
/// removes it. `release` (may be NULL) is called with `ctx` once cistern no longer needs it:
/// after the observer is replaced or removed and no call to it is under way, or at once when
/// this call fails. Off by default; when set, each event costs a call, under cistern's locks.
/// Returns 1, or 0 when the pool cannot be created (see `cistern_last_error`).
#[no_mangle]
pub extern "C" fn cistern_set_observer(
    observer: cistern_observer_t,
    ctx: *mut c_void,
    release: cistern_release_fn_t,
) -> c_int {
    let cx = CallerContext { ctx, release };
    let obs = match observer {
        Some(f) => Some(CObserver { f, cx }),
        None => {
            // No observer to hold the context: released at once.
            drop(cx);
            None
        }
    };
    guard::call("cistern_set_observer", 0, move || {
        let pool = match global::pool() {
            Ok(p) => p,
            Err(why) => {
                fail_no_pool("cistern_set_observer", why);
                return 0; // `obs`, if any, is dropped: its context released.
            }
        };
        let o: Option<cistern_alloc::Observer> =
            obs.map(|o| Arc::new(move |e: &PoolEvent| o.tell(e)) as cistern_alloc::Observer);
        with_pool!(pool, |p| p.set_observer(o));
        1
    })
}
