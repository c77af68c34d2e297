//! Contexts: each device's reference-counted primary context (the only kind the fake has:
//! `cuCtxCreate` is not exported), the per-thread context stack, `cuCtxGetDevice` and
//! `cuCtxSynchronize`.
//!
//! The driver API's "Context Management": "a CUDA context stack is maintained per CPU thread";
//! `cuCtxPushCurrent` "pushes the given context onto the CPU thread's stack of current
//! contexts", `cuCtxPopCurrent` pops it, and `cuCtxSetCurrent` "binds the specified CUDA context
//! to the calling CPU thread ... If there exists a CUDA context stack on the calling CPU thread,
//! this will replace the top of that stack with ctx. If ctx is NULL then this will be equivalent
//! to popping the top of the calling CPU thread's CUDA context stack (or a no-op if the calling
//! CPU thread's CUDA context stack is empty)."

use std::cell::RefCell;
use std::ffi::c_int;
use std::sync::atomic::Ordering;

use cistern::driver::Driver;

use crate::CUresult::{self, *};
use crate::{capture, entry, fake, put, CUcontext, CUdevice};

thread_local! {
    /// The thread's context stack (`PrimaryCtx` addresses), the current context last.
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's current context (a `PrimaryCtx` address), 0 for none (also while the
/// thread's locals are being destroyed).
pub(crate) fn top() -> usize {
    STACK
        .try_with(|s| s.borrow().last().copied().unwrap_or(0))
        .unwrap_or(0)
}

fn with_stack<T>(f: impl FnOnce(&mut Vec<usize>) -> T) -> Result<T, CUresult> {
    STACK
        .try_with(|s| f(&mut s.borrow_mut()))
        .map_err(|_| CUDA_ERROR_DEINITIALIZED)
}

/// `cuDevicePrimaryCtxRetain`: the device's primary context (stable, non-null), its count
/// raised by one.
///
/// # Safety
///
/// `pctx` is null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    entry("cuDevicePrimaryCtxRetain", || {
        let f = fake()?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.device(dev)?;
        f.ctxs[d].refs.fetch_add(1, Ordering::AcqRel);
        // SAFETY: `pctx` is non-null and writable (contract).
        unsafe { put(pctx, f.ctx_ptr(d)) }
    })
}

/// `cuDevicePrimaryCtxRelease_v2`: lowers the primary context's count;
/// `CUDA_ERROR_INVALID_CONTEXT` when it was not retained.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    entry("cuDevicePrimaryCtxRelease_v2", || {
        let f = fake()?;
        let d = f.device(dev)?;
        let before = f.ctxs[d]
            .refs
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| r.checked_sub(1))
            .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        if before == 1 {
            f.report_leaks(d);
        }
        Ok(())
    })
}

/// `cuCtxGetCurrent`: the top of the thread's context stack, or NULL.
///
/// # Safety
///
/// `pctx` is null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    entry("cuCtxGetCurrent", || {
        fake()?;
        // SAFETY: `pctx` is null or writable (contract); `put` refuses null.
        unsafe { put(pctx, top() as CUcontext) }
    })
}

/// `cuCtxSetCurrent`: replaces the top of the thread's context stack with `ctx` (pushes it on
/// an empty stack); NULL pops the top (a no-op on an empty stack), as the docs say.
///
/// # Safety
///
/// None: `ctx` is only compared with the fake's own contexts, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    entry("cuCtxSetCurrent", || {
        let f = fake()?;
        let addr = ctx as usize;
        if addr != 0 && f.ctx_at(addr).is_none() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        with_stack(|s| {
            s.pop();
            if addr != 0 {
                s.push(addr);
            }
        })
    })
}

/// `cuCtxPushCurrent_v2`: pushes `ctx` on the thread's context stack ("the specified context
/// becomes the CPU thread's current context"). A context that is not one of the fake's is
/// `CUDA_ERROR_INVALID_CONTEXT`.
///
/// # Safety
///
/// None: `ctx` is only compared with the fake's own contexts, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    entry("cuCtxPushCurrent_v2", || {
        let f = fake()?;
        let addr = ctx as usize;
        if f.ctx_at(addr).is_none() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        with_stack(|s| s.push(addr))
    })
}

/// `cuCtxPopCurrent_v2`: pops the thread's current context and stores it in `*pctx` when
/// `pctx` is not NULL; the previous context (if any) becomes current. An empty stack is
/// `CUDA_ERROR_INVALID_CONTEXT`.
///
/// # Safety
///
/// `pctx` is null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    entry("cuCtxPopCurrent_v2", || {
        fake()?;
        let popped = with_stack(|s| s.pop())?.ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            // SAFETY: `pctx` is non-null and writable (contract).
            unsafe { put(pctx, popped as CUcontext) }?;
        }
        Ok(())
    })
}

/// `cuCtxGetDevice`: "Returns in *device the ordinal of the current context's device";
/// `CUDA_ERROR_INVALID_CONTEXT` without a current (retained) context.
///
/// # Safety
///
/// `device` is null or valid for writing a `CUdevice`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    entry("cuCtxGetDevice", || {
        let f = fake()?;
        if device.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.current(&f.state())?;
        // SAFETY: `device` is non-null and writable (contract).
        unsafe { put(device, d as c_int) }
    })
}

/// `cuCtxSynchronize`: "Blocks until the device has completed all preceding requested tasks"
/// of the current context: completes the simulated work of the current context's device (and
/// its streams' work on other devices' memory). A potentially unsafe call during stream capture
/// (see [`capture`]).
///
/// # Safety
///
/// None beyond the C API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    entry("cuCtxSynchronize", || {
        let f = fake()?;
        let mut st = f.state();
        let d = f.current(&st)?;
        capture::unsafe_call(&mut st)?;
        capture::no_capture_on(&mut st, d)?;
        f.sim.device_synchronize(d).map_err(|e| crate::code(&e))?;
        let peers: Vec<u64> = st
            .streams
            .iter()
            .filter(|(_, s)| s.dev == d && s.work_devs & !(1 << d) != 0)
            .map(|(&sid, _)| sid)
            .collect();
        for sid in peers {
            f.complete_peer_work(&st, sid);
        }
        Ok(())
    })
}
