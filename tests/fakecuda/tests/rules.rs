//! One test per rule of the real CUDA driver that the fake follows: each shows the fake refuses
//! what the driver refuses and accepts what it accepts. Every check runs in a child process with
//! the fake on the library path (as in `end_to_end.rs`); the child tests do nothing unless
//! `FAKECUDA_CHILD` names them.

mod common;

use std::ffi::{c_int, c_ulonglong};
use std::process::Command;
use std::ptr::null_mut;

use cudarc::driver::sys::{self, CUresult, CUresult::*};

const MIB: usize = 1 << 20;
const CHILD: &str = "FAKECUDA_CHILD";

/// Runs the child test `name` on the fake with `knobs`; returns its stderr.
fn run_child(name: &str, knobs: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args([
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    common::child_env(&mut cmd, knobs);
    cmd.env(CHILD, name);
    let out = cmd.output().expect("run the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child {name} failed ({:?})\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    stderr
}

fn is_child(name: &str) -> bool {
    std::env::var(CHILD).as_deref() == Ok(name)
}

/// The test hooks, from the fake cudarc loaded (the same library: the loader returns the
/// already loaded `libcuda.so`).
struct Hooks {
    _lib: libloading::Library,
    launch: unsafe extern "C" fn(sys::CUstream, sys::CUdeviceptr, usize) -> CUresult,
    complete: unsafe extern "C" fn(sys::CUstream) -> CUresult,
    hazards: unsafe extern "C" fn() -> c_ulonglong,
}

fn hooks() -> Hooks {
    // SAFETY: the library is the fake already loaded by cudarc; the signatures are the hooks'
    // (see src/hooks.rs), and the function pointers do not outlive `_lib`, kept in the struct.
    unsafe {
        let lib = libloading::Library::new("libcuda.so").expect("the fake is loaded");
        let launch = *lib.get(b"cisternFakeLaunch").unwrap();
        let complete = *lib.get(b"cisternFakeComplete").unwrap();
        let hazards = *lib.get(b"cisternFakeHazards").unwrap();
        Hooks {
            _lib: lib,
            launch,
            complete,
            hazards,
        }
    }
}

/// cuInit, and device `dev`'s primary context retained (not made current).
fn init_ctx(dev: c_int) -> sys::CUcontext {
    let mut ctx = null_mut();
    // SAFETY: `ctx` is a live, writable CUcontext.
    unsafe {
        assert_eq!(sys::cuInit(0), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), CUDA_SUCCESS);
    }
    ctx
}

fn prop(dev: c_int) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        win32HandleMetaData: null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn rw(dev: c_int) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn stream_id(s: sys::CUstream) -> Result<u64, CUresult> {
    let mut id: c_ulonglong = 0;
    // SAFETY: `id` is a live, writable u64.
    match unsafe { sys::cuStreamGetId(s, &mut id) } {
        CUDA_SUCCESS => Ok(id),
        r => Err(r),
    }
}

const LEGACY: sys::CUstream = 0x1 as sys::CUstream;
const PER_THREAD: sys::CUstream = 0x2 as sys::CUstream;

// ---- streams (cuStreamCreate, special handles, validation) ---------------------------------

#[test]
fn streams_are_real_objects_of_a_context() {
    run_child("child_streams", &[("CISTERN_FAKECUDA_DEVICES", "2")]);
}

#[test]
#[ignore = "child process of streams_are_real_objects_of_a_context"]
fn child_streams() {
    if !is_child("child_streams") {
        return;
    }
    let h = hooks();
    let c0 = init_ctx(0);
    let c1 = init_ctx(1);
    // SAFETY (whole block): every pointer is null on purpose or a live local of the right
    // type; handles are the fake's values (or made up on purpose), never dereferenced by it.
    unsafe {
        // The special handles and cuStreamCreate need a current context.
        let mut s: sys::CUstream = null_mut();
        assert_eq!(sys::cuStreamCreate(&mut s, 0), CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(sys::cuStreamQuery(null_mut()), CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(stream_id(PER_THREAD), Err(CUDA_ERROR_INVALID_CONTEXT));
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut s, 2), CUDA_ERROR_INVALID_VALUE);
        let (mut s1, mut s2) = (null_mut(), null_mut());
        assert_eq!(sys::cuStreamCreate(&mut s1, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut s2, 1), CUDA_SUCCESS);
        // Unique non-zero ids; 0 and CU_STREAM_LEGACY are the same stream.
        let ids = [
            stream_id(s1).unwrap(),
            stream_id(s2).unwrap(),
            stream_id(null_mut()).unwrap(),
            stream_id(PER_THREAD).unwrap(),
        ];
        assert_eq!(stream_id(LEGACY).unwrap(), ids[2]);
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 4, "{ids:?}");
        assert!(ids.iter().all(|&i| i != 0));
        // Another thread has its own per-thread stream; device 1's legacy stream is another.
        let c0u = c0 as usize;
        let other = std::thread::spawn(move || {
            assert_eq!(
                sys::cuCtxPushCurrent_v2(c0u as sys::CUcontext),
                CUDA_SUCCESS
            );
            let ids = (
                stream_id(PER_THREAD).unwrap(),
                stream_id(null_mut()).unwrap(),
            );
            assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
            ids
        })
        .join()
        .unwrap();
        assert_ne!(other.0, ids[3], "per-thread streams are per thread");
        assert_eq!(other.1, ids[2], "the legacy stream is the context's");
        assert_eq!(sys::cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
        assert_ne!(stream_id(null_mut()).unwrap(), ids[2]);
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        let mut ctx = null_mut();
        assert_eq!(sys::cuStreamGetCtx(s1, &mut ctx), CUDA_SUCCESS);
        assert_eq!(ctx, c0);

        // Made-up and destroyed handles are refused everywhere.
        let mut ev = null_mut();
        assert_eq!(sys::cuEventCreate(&mut ev, 2), CUDA_SUCCESS);
        let bogus = 0x5000 as sys::CUstream;
        assert_eq!(sys::cuEventRecord(ev, bogus), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            sys::cuStreamWaitEvent(bogus, ev, 0),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(sys::cuStreamSynchronize(bogus), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuStreamQuery(bogus), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(stream_id(bogus), Err(CUDA_ERROR_INVALID_HANDLE));
        assert_eq!(
            sys::cuStreamGetCtx(bogus, &mut ctx),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(sys::cuStreamDestroy_v2(s2), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamDestroy_v2(s2), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuEventRecord(ev, s2), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            sys::cuStreamDestroy_v2(null_mut()),
            CUDA_ERROR_INVALID_HANDLE
        );

        // An event and a stream of different devices: cuEventRecord refuses, a wait is allowed.
        assert_eq!(sys::cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
        let (mut ev1, mut t1) = (null_mut(), null_mut());
        assert_eq!(sys::cuEventCreate(&mut ev1, 2), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut t1, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        assert_eq!(sys::cuEventRecord(ev1, s1), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuEventRecord(ev1, t1), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamWaitEvent(s1, ev1, 0), CUDA_SUCCESS);

        // Destroying a stream with queued work returns at once; the work completes later and
        // events recorded before stay queryable.
        let mut mem: sys::CUdeviceptr = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut mem, MIB), CUDA_SUCCESS);
        let mut s3 = null_mut();
        assert_eq!(sys::cuStreamCreate(&mut s3, 0), CUDA_SUCCESS);
        assert_eq!((h.launch)(s3, mem, MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuEventRecord(ev, s3), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamQuery(s3), CUDA_ERROR_NOT_READY);
        assert_eq!(sys::cuStreamDestroy_v2(s3), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUDA_ERROR_NOT_READY);
        assert_eq!(sys::cuEventSynchronize(ev), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUDA_SUCCESS);

        // Hazards: unordered work of two streams on the same memory is one; ordering the second
        // after the first through an event removes it.
        assert_eq!((h.hazards)(), 0);
        assert_eq!((h.launch)(s1, mem, MIB), CUDA_SUCCESS);
        let mut s4 = null_mut();
        assert_eq!(sys::cuStreamCreate(&mut s4, 1), CUDA_SUCCESS);
        assert_eq!((h.launch)(s4, mem, 4096), CUDA_SUCCESS);
        assert_eq!((h.hazards)(), 1);
        assert_eq!(sys::cuEventRecord(ev, s4), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamWaitEvent(s1, ev, 0), CUDA_SUCCESS);
        assert_eq!((h.launch)(s1, mem, MIB), CUDA_SUCCESS);
        assert_eq!((h.hazards)(), 1, "ordered after s4's work");
        assert_eq!((h.complete)(s1), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamQuery(s1), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamSynchronize(s4), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamQuery(s4), CUDA_SUCCESS);
        assert_eq!(sys::cuMemFree_v2(mem), CUDA_SUCCESS);
    }
}

// ---- contexts (the per-thread stack, which calls need one) ----------------------------------

#[test]
fn the_current_context_is_a_per_thread_stack() {
    run_child("child_contexts", &[("CISTERN_FAKECUDA_DEVICES", "2")]);
}

#[test]
#[ignore = "child process of the_current_context_is_a_per_thread_stack"]
fn child_contexts() {
    if !is_child("child_contexts") {
        return;
    }
    let c0 = init_ctx(0);
    let c1 = init_ctx(1);
    let current = || {
        let mut c = null_mut();
        // SAFETY: `c` is a live, writable CUcontext.
        assert_eq!(unsafe { sys::cuCtxGetCurrent(&mut c) }, CUDA_SUCCESS);
        c
    };
    let device = || {
        let mut d = -1;
        // SAFETY: `d` is a live, writable CUdevice.
        match unsafe { sys::cuCtxGetDevice(&mut d) } {
            CUDA_SUCCESS => Ok(d),
            r => Err(r),
        }
    };
    // SAFETY (whole block): as in child_streams.
    unsafe {
        assert_eq!(device(), Err(CUDA_ERROR_INVALID_CONTEXT));
        assert_eq!(
            sys::cuCtxPopCurrent_v2(null_mut()),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(
            sys::cuCtxSetCurrent(null_mut()),
            CUDA_SUCCESS,
            "a no-op when empty"
        );
        assert_eq!(
            sys::cuCtxPushCurrent_v2(0x1234 as sys::CUcontext),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(sys::cuCtxPushCurrent_v2(c0), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
        assert_eq!((current(), device()), (c1, Ok(1)));
        // cuCtxSetCurrent replaces the top; NULL pops it.
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        assert_eq!(device(), Ok(0));
        assert_eq!(sys::cuCtxSetCurrent(null_mut()), CUDA_SUCCESS);
        assert_eq!((current(), device()), (c0, Ok(0)));
        let mut popped = null_mut();
        assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), CUDA_SUCCESS);
        assert_eq!((popped, current()), (c0, null_mut()));

        // Without a context: event creation and reservations are refused; the VMM calls that
        // name their device or object work.
        let mut ev = null_mut();
        assert_eq!(sys::cuEventCreate(&mut ev, 2), CUDA_ERROR_INVALID_CONTEXT);
        let mut va = 0;
        assert_eq!(
            sys::cuMemAddressReserve(&mut va, 2 * MIB, 0, 0, 0),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(sys::cuCtxPushCurrent_v2(c0), CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemAddressReserve(&mut va, 4 * MIB, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        let mut h = 0;
        let p = prop(0);
        let d = rw(0);
        assert_eq!(sys::cuMemCreate(&mut h, 2 * MIB, &p, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuMemMap(va, 2 * MIB, 0, h, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuMemSetAccess(va, 2 * MIB, &d, 1), CUDA_SUCCESS);
        assert_eq!(sys::cuMemUnmap(va, 2 * MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(h), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(va, 4 * MIB), CUDA_SUCCESS);
        let (mut free, mut total) = (0, 0);
        assert_eq!(
            sys::cuMemGetInfo_v2(&mut free, &mut total),
            CUDA_ERROR_INVALID_CONTEXT
        );
    }
}
