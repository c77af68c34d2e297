//! One test per rule of the real CUDA driver that the fake follows: each shows the fake refuses
//! what the driver refuses and accepts what it accepts. Every check runs in a child process with
//! the fake on the library path (as in `end_to_end.rs`); the child tests do nothing unless
//! `FAKECUDA_CHILD` names them.

mod common;

use std::ffi::{c_int, c_ulonglong};
use std::process::Command;
use std::ptr::{null, null_mut};

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

/// `bytes` of device `dev`'s memory, reserved, mapped and read-write for `dev` (the current
/// context must be `dev`'s, for the reservation).
fn mapped(dev: c_int, bytes: usize) -> (sys::CUdeviceptr, sys::CUmemGenericAllocationHandle) {
    let (mut va, mut h) = (0, 0);
    let p = prop(dev);
    let d = rw(dev);
    // SAFETY: every pointer is a live local; the handles are the fake's.
    unsafe {
        assert_eq!(
            sys::cuMemAddressReserve(&mut va, bytes, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuMemCreate(&mut h, bytes, &p, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuMemMap(va, bytes, 0, h, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuMemSetAccess(va, bytes, &d, 1), CUDA_SUCCESS);
    }
    (va, h)
}

fn status(s: sys::CUstream) -> Result<sys::CUstreamCaptureStatus, CUresult> {
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `st` is a live, writable status.
    match unsafe { sys::cuStreamIsCapturing(s, &mut st) } {
        CUDA_SUCCESS => Ok(st),
        r => Err(r),
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
        // The wait on another device's event is satisfied by completing the event's work then.
        assert_eq!(sys::cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
        let mut mem1: sys::CUdeviceptr = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut mem1, MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        assert_eq!((h.launch)(t1, mem1, MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuEventRecord(ev1, t1), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev1), CUDA_ERROR_NOT_READY);
        assert_eq!(sys::cuStreamWaitEvent(s1, ev1, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev1), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamQuery(t1), CUDA_SUCCESS);
        // Device 0's stream touching device 1's linear memory (no peer access for cuMemAlloc
        // memory without cuCtxEnablePeerAccess) is an illegal address, on device 0's context:
        // checked at the end, as it corrupts the context.

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
        assert_eq!(sys::cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
        assert_eq!(sys::cuMemFree_v2(mem1), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAlloc_v2(&mut mem1, MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        assert_eq!((h.launch)(s1, mem1, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuStreamQuery(s1), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuStreamQuery(t1), CUDA_SUCCESS, "device 1 is fine");
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

// ---- stream capture --------------------------------------------------------------------------

fn begin(s: sys::CUstream, mode: sys::CUstreamCaptureMode) -> CUresult {
    // SAFETY: a stream handle of the fake's, and a valid mode.
    unsafe { sys::cuStreamBeginCapture_v2(s, mode) }
}

fn end(s: sys::CUstream) -> (CUresult, sys::CUgraph) {
    let mut g: sys::CUgraph = 0x99 as sys::CUgraph;
    // SAFETY: `g` is a live, writable CUgraph.
    let r = unsafe { sys::cuStreamEndCapture(s, &mut g) };
    (r, g)
}

fn exchange(mode: sys::CUstreamCaptureMode) -> sys::CUstreamCaptureMode {
    let mut m = mode;
    // SAFETY: `m` is a live, readable and writable mode.
    assert_eq!(
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) },
        CUDA_SUCCESS
    );
    m
}

#[test]
fn stream_capture_prohibits_unsafe_calls() {
    run_child("child_capture", &[]);
}

#[test]
#[ignore = "child process of stream_capture_prohibits_unsafe_calls"]
fn child_capture() {
    use sys::CUstreamCaptureMode::*;
    use sys::CUstreamCaptureStatus::*;
    if !is_child("child_capture") {
        return;
    }
    let h = hooks();
    let c0 = init_ctx(0);
    // SAFETY (whole block): as in child_streams.
    unsafe {
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let (mut s, mut nb, mut ev) = (null_mut(), null_mut(), null_mut());
        assert_eq!(sys::cuStreamCreate(&mut s, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut nb, 1), CUDA_SUCCESS);
        assert_eq!(sys::cuEventCreate(&mut ev, 2), CUDA_SUCCESS);
        let mut mem: sys::CUdeviceptr = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut mem, MIB), CUDA_SUCCESS);

        // Beginning and ending: the legacy stream cannot be captured, a capture cannot begin
        // twice, a stream not capturing cannot end one.
        assert_eq!(
            begin(null_mut(), CU_STREAM_CAPTURE_MODE_GLOBAL),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(end(s).0, CUDA_ERROR_ILLEGAL_STATE);
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
        assert_eq!(end(s).0, CUDA_SUCCESS);

        // A potentially unsafe call during a global capture fails and invalidates it.
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
        assert_eq!(
            begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
            CUDA_ERROR_ILLEGAL_STATE
        );
        assert_eq!(status(s), Ok(CU_STREAM_CAPTURE_STATUS_ACTIVE));
        let mut p: sys::CUdeviceptr = 0;
        assert_eq!(
            sys::cuMemAlloc_v2(&mut p, MIB),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(status(s), Ok(CU_STREAM_CAPTURE_STATUS_INVALIDATED));
        let (r, g) = end(s);
        assert_eq!((r, g), (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, null_mut()));
        assert_eq!(status(s), Ok(CU_STREAM_CAPTURE_STATUS_NONE));
        for call in [
            |_: sys::CUstream, _: sys::CUevent, m: sys::CUdeviceptr| sys::cuMemFree_v2(m),
            |_, e, _| sys::cuEventQuery(e),
            |_, e, _| sys::cuEventSynchronize(e),
            |_, _, _| sys::cuCtxSynchronize(),
            |s, _, _| sys::cuStreamSynchronize(s),
            |s, _, _| sys::cuStreamQuery(s),
        ] {
            assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
            assert_eq!(call(nb, ev, mem), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }

        // Querying an event recorded in a capture under way is refused and breaks that capture,
        // even from a relaxed thread (driver 580: scripts/gpu/capture_rules.py).
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
        assert_eq!(sys::cuEventRecord(ev, s), CUDA_SUCCESS);
        exchange(CU_STREAM_CAPTURE_MODE_RELAXED);
        assert_eq!(sys::cuEventQuery(ev), CUDA_ERROR_CAPTURED_EVENT);
        exchange(CU_STREAM_CAPTURE_MODE_GLOBAL);
        assert_eq!(status(s), Ok(CU_STREAM_CAPTURE_STATUS_INVALIDATED));
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        assert_eq!(sys::cuEventRecord(ev, s), CUDA_SUCCESS);

        // Work on a capturing stream is recorded, not run; its event is a captured event, which
        // no thread may query. The VMM calls are not unsafe.
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
        assert_eq!((h.launch)(s, mem, MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuEventRecord(ev, s), CUDA_SUCCESS);
        let mut info = (
            CU_STREAM_CAPTURE_STATUS_NONE,
            0u64,
            null_mut(),
            null(),
            7usize,
        );
        assert_eq!(
            sys::cuStreamGetCaptureInfo_v2(
                s,
                &mut info.0,
                &mut info.1,
                &mut info.2,
                &mut info.3,
                &mut info.4
            ),
            CUDA_SUCCESS
        );
        assert_eq!(info.0, CU_STREAM_CAPTURE_STATUS_ACTIVE);
        assert!(info.1 != 0 && !info.2.is_null() && info.4 == 0, "{info:?}");
        let (va, handle) = mapped(0, 2 * MIB);
        assert_eq!(
            exchange(CU_STREAM_CAPTURE_MODE_RELAXED),
            CU_STREAM_CAPTURE_MODE_GLOBAL
        );
        assert_eq!(sys::cuMemAlloc_v2(&mut p, MIB), CUDA_SUCCESS, "relaxed");
        assert_eq!(sys::cuMemFree_v2(p), CUDA_SUCCESS);
        assert_eq!(
            exchange(CU_STREAM_CAPTURE_MODE_GLOBAL),
            CU_STREAM_CAPTURE_MODE_RELAXED
        );
        // Cross-stream capture: a stream waiting on a captured event joins the capture.
        let mut joined = null_mut();
        assert_eq!(sys::cuStreamCreate(&mut joined, 1), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamWaitEvent(joined, ev, 0), CUDA_SUCCESS);
        assert_eq!(status(joined), Ok(CU_STREAM_CAPTURE_STATUS_ACTIVE));
        assert_eq!(end(joined).0, CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
        let (r, g) = end(s);
        assert_eq!(r, CUDA_SUCCESS);
        assert!(info.2 == g && !g.is_null());
        assert_eq!(status(joined), Ok(CU_STREAM_CAPTURE_STATUS_NONE));
        assert_eq!(sys::cuGraphDestroy(g), CUDA_SUCCESS);
        assert_eq!(sys::cuGraphDestroy(g), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            sys::cuStreamQuery(s),
            CUDA_SUCCESS,
            "captured work never ran"
        );
        // Recorded in a capture that has ended: refused until recorded again (driver 580:
        // `CUDA_ERROR_INVALID_VALUE`, scripts/gpu/capture_rules.py).
        assert_eq!(
            sys::cuEventQuery(ev),
            CUDA_ERROR_INVALID_VALUE,
            "until recorded again"
        );
        assert_eq!(sys::cuEventRecord(ev, s), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUDA_SUCCESS);
        assert_eq!(sys::cuMemUnmap(va, 2 * MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(handle), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(va, 2 * MIB), CUDA_SUCCESS);

        // The legacy stream while a blocking stream captures: an implicit dependency, refused
        // (and invalidating); a non-blocking stream's capture does not matter.
        assert_eq!(begin(nb, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
        assert_eq!(sys::cuEventRecord(ev, null_mut()), CUDA_SUCCESS);
        assert_eq!(end(nb).0, CUDA_SUCCESS);
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
        assert_eq!(status(null_mut()), Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT));
        assert_eq!(
            status(s),
            Ok(CU_STREAM_CAPTURE_STATUS_ACTIVE),
            "a query does not invalidate"
        );
        assert_eq!(
            sys::cuEventRecord(ev, LEGACY),
            CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        );
        assert_eq!(status(s), Ok(CU_STREAM_CAPTURE_STATUS_INVALIDATED));
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

        // Other threads: a global capture prohibits unsafe calls in every thread in global
        // mode; a thread-local capture only in its own thread; a thread in relaxed or
        // thread-local mode ignores others' captures. A non-relaxed capture must end on its
        // own thread.
        let c = c0 as usize;
        let other = move |mode: sys::CUstreamCaptureMode, s: usize| {
            std::thread::spawn(move || {
                assert_eq!(sys::cuCtxPushCurrent_v2(c as sys::CUcontext), CUDA_SUCCESS);
                exchange(mode);
                let mut p: sys::CUdeviceptr = 0;
                let r = sys::cuMemAlloc_v2(&mut p, MIB);
                if r == CUDA_SUCCESS {
                    assert_eq!(sys::cuMemFree_v2(p), CUDA_SUCCESS);
                }
                let e = end(s as sys::CUstream).0;
                (r, e)
            })
            .join()
            .unwrap()
        };
        let su = s as usize;
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
        assert_eq!(
            other(CU_STREAM_CAPTURE_MODE_GLOBAL, su),
            (
                CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
            )
        );
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        for mode in [
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CU_STREAM_CAPTURE_MODE_RELAXED,
        ] {
            assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
            assert_eq!(other(mode, su).0, CUDA_SUCCESS);
            assert_eq!(end(s).0, CUDA_SUCCESS);
        }
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), CUDA_SUCCESS);
        assert_eq!(other(CU_STREAM_CAPTURE_MODE_GLOBAL, su).0, CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemAlloc_v2(&mut p, MIB),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "its own thread"
        );
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        // A relaxed capture may be ended by another thread.
        assert_eq!(begin(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
        assert_eq!(
            other(CU_STREAM_CAPTURE_MODE_GLOBAL, su),
            (CUDA_SUCCESS, CUDA_SUCCESS)
        );

        // Beyond the documentation, as driver 580 answered on an H200
        // (scripts/gpu/capture_rules.py), in every capture mode: naming a capturing stream
        // (cuStreamGetId) is refused, though its context may be read; a device synchronisation
        // from a relaxed thread still breaks the capture; a capturing stream may not wait on an
        // event recorded outside the capture.
        let ctx_sync_relaxed = move || {
            std::thread::spawn(move || {
                assert_eq!(sys::cuCtxPushCurrent_v2(c as sys::CUcontext), CUDA_SUCCESS);
                exchange(CU_STREAM_CAPTURE_MODE_RELAXED);
                sys::cuCtxSynchronize()
            })
            .join()
            .unwrap()
        };
        for mode in [
            CU_STREAM_CAPTURE_MODE_GLOBAL,
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CU_STREAM_CAPTURE_MODE_RELAXED,
        ] {
            let mut id = 0;
            let mut ctx = null_mut();
            assert_eq!(begin(s, mode), CUDA_SUCCESS);
            assert_eq!(sys::cuStreamGetId(nb, &mut id), CUDA_SUCCESS);
            assert_eq!(sys::cuStreamGetCtx(s, &mut ctx), CUDA_SUCCESS);
            assert_eq!(status(s), Ok(CU_STREAM_CAPTURE_STATUS_ACTIVE));
            assert_eq!(
                sys::cuStreamGetId(s, &mut id),
                CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "{mode:?}"
            );
            assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

            assert_eq!(begin(s, mode), CUDA_SUCCESS);
            assert_eq!(ctx_sync_relaxed(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{mode:?}");

            assert_eq!(sys::cuEventRecord(ev, nb), CUDA_SUCCESS);
            assert_eq!(begin(s, mode), CUDA_SUCCESS);
            assert_eq!(
                sys::cuStreamWaitEvent(s, ev, 0),
                CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            );
            assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{mode:?}");
        }

        // The error strings are the driver's.
        for (r, text) in [
            (
                CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "operation not permitted when stream is capturing",
            ),
            (
                CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                "operation failed due to a previous error during capture",
            ),
            (
                CUDA_ERROR_CAPTURED_EVENT,
                "operation not permitted on an event last recorded in a capturing stream",
            ),
            (
                CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                "operation would make the legacy stream depend on a capturing blocking stream",
            ),
            (
                CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                "dependency created on uncaptured work in another stream",
            ),
        ] {
            let mut t = std::ptr::null();
            assert_eq!(sys::cuGetErrorString(r, &mut t), CUDA_SUCCESS);
            assert_eq!(std::ffi::CStr::from_ptr(t).to_str().unwrap(), text);
        }
        assert_eq!(sys::cuMemFree_v2(mem), CUDA_SUCCESS);
    }
}

// ---- peers and sticky errors -----------------------------------------------------------------

#[test]
fn peers_need_access_and_an_illegal_address_is_sticky() {
    run_child("child_peers", &[("CISTERN_FAKECUDA_DEVICES", "3")]);
}

#[test]
#[ignore = "child process of peers_need_access_and_an_illegal_address_is_sticky"]
fn child_peers() {
    if !is_child("child_peers") {
        return;
    }
    let h = hooks();
    let c0 = init_ctx(0);
    let c1 = init_ctx(1);
    let c2 = init_ctx(2);
    // SAFETY (whole block): as in child_streams.
    unsafe {
        let mut can = -1;
        assert_eq!(sys::cuDeviceCanAccessPeer(&mut can, 0, 1), CUDA_SUCCESS);
        assert_eq!(can, 1);
        assert_eq!(sys::cuDeviceCanAccessPeer(&mut can, 1, 1), CUDA_SUCCESS);
        assert_eq!(can, 0);
        assert_eq!(
            sys::cuDeviceCanAccessPeer(&mut can, 0, 3),
            CUDA_ERROR_INVALID_DEVICE
        );
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let (va, handle) = mapped(0, 4 * MIB);
        let (mut s1, mut s2) = (null_mut(), null_mut());
        assert_eq!(sys::cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut s1, 1), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxSetCurrent(c2), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut s2, 1), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        // Device 1 granted access: its work may touch device 0's memory, and completes with a
        // synchronisation of its stream.
        let d1 = rw(1);
        assert_eq!(sys::cuMemSetAccess(va, 4 * MIB, &d1, 1), CUDA_SUCCESS);
        assert_eq!((h.launch)(s1, va, 4 * MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamQuery(s1), CUDA_ERROR_NOT_READY);
        assert_eq!(sys::cuStreamSynchronize(s1), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamQuery(s1), CUDA_SUCCESS);
        // Revoked, or never granted: an illegal address, which corrupts the toucher's context
        // for good; other contexts go on.
        let mut none = rw(1);
        none.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        assert_eq!(sys::cuMemSetAccess(va, 4 * MIB, &none, 1), CUDA_SUCCESS);
        assert_eq!((h.launch)(s2, va, MIB), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuStreamQuery(s2), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuCtxPushCurrent_v2(c2), CUDA_SUCCESS);
        let (mut free, mut total, mut ev, mut s) = (0, 0, null_mut(), null_mut());
        assert_eq!(
            sys::cuMemGetInfo_v2(&mut free, &mut total),
            CUDA_ERROR_ILLEGAL_ADDRESS
        );
        assert_eq!(sys::cuEventCreate(&mut ev, 2), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuStreamCreate(&mut s, 0), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(null_mut()), CUDA_SUCCESS);
        assert_eq!(sys::cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
        let mut n = 0;
        assert_eq!(sys::cuDeviceGetCount(&mut n), CUDA_SUCCESS, "no context");
        // Memory of no allocation is an illegal address too.
        assert_eq!((h.launch)(s1, 0x10, 4), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuStreamQuery(s1), CUDA_ERROR_ILLEGAL_ADDRESS);
        let mut t = std::ptr::null();
        assert_eq!(
            sys::cuGetErrorString(CUDA_ERROR_ILLEGAL_ADDRESS, &mut t),
            CUDA_SUCCESS
        );
        assert_eq!(
            std::ffi::CStr::from_ptr(t).to_str().unwrap(),
            "an illegal memory access was encountered"
        );
        assert_eq!(sys::cuMemUnmap(va, 4 * MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(handle), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(va, 4 * MIB), CUDA_SUCCESS);
    }
}

#[test]
fn without_peer_support_access_for_another_device_is_refused() {
    run_child(
        "child_no_peers",
        &[
            ("CISTERN_FAKECUDA_DEVICES", "2"),
            ("CISTERN_FAKECUDA_PEERS", "0"),
        ],
    );
}

#[test]
#[ignore = "child process of without_peer_support_access_for_another_device_is_refused"]
fn child_no_peers() {
    if !is_child("child_no_peers") {
        return;
    }
    let c0 = init_ctx(0);
    // SAFETY (whole block): as in child_streams.
    unsafe {
        let mut can = -1;
        assert_eq!(sys::cuDeviceCanAccessPeer(&mut can, 0, 1), CUDA_SUCCESS);
        assert_eq!(can, 0);
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let (va, handle) = mapped(0, 2 * MIB);
        let d1 = rw(1);
        assert_eq!(
            sys::cuMemSetAccess(va, 2 * MIB, &d1, 1),
            CUDA_ERROR_INVALID_DEVICE
        );
        assert_eq!(sys::cuMemUnmap(va, 2 * MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(handle), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(va, 2 * MIB), CUDA_SUCCESS);
    }
}

#[test]
fn an_injected_sticky_error_corrupts_the_context() {
    run_child(
        "child_sticky",
        &[(
            "CISTERN_FAKECUDA_FAIL",
            "cuEventQuery:2=719,cuMemGetInfo:1=2",
        )],
    );
}

#[test]
#[ignore = "child process of an_injected_sticky_error_corrupts_the_context"]
fn child_sticky() {
    if !is_child("child_sticky") {
        return;
    }
    let c0 = init_ctx(0);
    // SAFETY (whole block): as in child_streams.
    unsafe {
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let (mut free, mut total) = (0, 0);
        // A non-sticky coded fault fails once.
        assert_eq!(
            sys::cuMemGetInfo_v2(&mut free, &mut total),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(sys::cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
        let mut ev = null_mut();
        assert_eq!(sys::cuEventCreate(&mut ev, 2), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUDA_ERROR_LAUNCH_FAILED);
        // From now on every call on the context fails the same way.
        assert_eq!(sys::cuEventQuery(ev), CUDA_ERROR_LAUNCH_FAILED);
        assert_eq!(sys::cuEventRecord(ev, null_mut()), CUDA_ERROR_LAUNCH_FAILED);
        assert_eq!(
            sys::cuMemGetInfo_v2(&mut free, &mut total),
            CUDA_ERROR_LAUNCH_FAILED
        );
        let mut p = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut p, MIB), CUDA_ERROR_LAUNCH_FAILED);
        assert_eq!(sys::cuCtxSynchronize(), CUDA_ERROR_LAUNCH_FAILED);
        assert_eq!(sys::cuEventDestroy_v2(ev), CUDA_ERROR_LAUNCH_FAILED);
    }
}

// ---- process exit ----------------------------------------------------------------------------

extern "C" fn after_the_fakes_atexit() {
    let mut n = 0;
    // SAFETY: `n` is a live, writable c_int; the fake is still loaded during exit.
    let r = unsafe { sys::cuDeviceGetCount(&mut n) };
    eprintln!("at exit: cuDeviceGetCount = {}", r as i32);
}

#[test]
fn calls_during_exit_are_deinitialized() {
    let stderr = run_child("child_exit", &[]);
    assert!(
        stderr.contains("before exit: cuDeviceGetCount = 0"),
        "{stderr}"
    );
    assert!(stderr.contains("at exit: cuDeviceGetCount = 4"), "{stderr}");
}

#[test]
#[ignore = "child process of calls_during_exit_are_deinitialized"]
fn child_exit() {
    if !is_child("child_exit") {
        return;
    }
    // Registered before cuInit registers the fake's hook, so it runs after it.
    // SAFETY: a plain `extern "C" fn()` that does not unwind.
    assert_eq!(unsafe { libc::atexit(after_the_fakes_atexit) }, 0);
    let mut n = 0;
    // SAFETY: `n` is a live, writable c_int.
    unsafe {
        assert_eq!(sys::cuInit(0), CUDA_SUCCESS);
        eprintln!(
            "before exit: cuDeviceGetCount = {}",
            sys::cuDeviceGetCount(&mut n) as i32
        );
    }
}

// ---- memory: one address space, reserve, granularity, deferred release, properties -----------

#[test]
fn one_address_space_under_a_limit() {
    run_child(
        "child_address_space",
        &[
            ("CISTERN_FAKECUDA_DEVICES", "2"),
            ("CISTERN_FAKECUDA_VA_LIMIT", "64MiB"),
        ],
    );
}

#[test]
#[ignore = "child process of one_address_space_under_a_limit"]
fn child_address_space() {
    if !is_child("child_address_space") {
        return;
    }
    let c0 = init_ctx(0);
    let c1 = init_ctx(1);
    // SAFETY (whole block): as in child_streams.
    unsafe {
        let (mut a, mut b, mut c) = (0, 0, 0);
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemAddressReserve(&mut a, 32 * MIB, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxSetCurrent(c1), CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemAddressReserve(&mut b, 32 * MIB, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert!(
            a + 32 * MIB as u64 <= b || b + 32 * MIB as u64 <= a,
            "{a:#x} {b:#x}"
        );
        // The limit counts every device's reservations.
        assert_eq!(
            sys::cuMemAddressReserve(&mut c, 2 * MIB, 0, 0, 0),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(sys::cuMemAddressFree(a, 32 * MIB), CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemAddressReserve(&mut c, 2 * MIB, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuMemAddressFree(c, 2 * MIB), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(b, 32 * MIB), CUDA_SUCCESS);
    }
}

#[test]
fn rlimit_as_limits_the_address_space() {
    run_child("child_rlimit", &[]);
}

#[test]
#[ignore = "child process of rlimit_as_limits_the_address_space"]
fn child_rlimit() {
    if !is_child("child_rlimit") {
        return;
    }
    const TIB: usize = 1 << 40;
    let lim = libc::rlimit {
        rlim_cur: TIB as libc::rlim_t,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: `lim` is a live rlimit; lowering the soft limit of this child only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) }, 0);
    let c0 = init_ctx(0);
    // SAFETY (whole block): as in child_streams.
    unsafe {
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let mut a = 0;
        assert_eq!(
            sys::cuMemAddressReserve(&mut a, 2 * TIB, 0, 0, 0),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(
            sys::cuMemAddressReserve(&mut a, TIB / 2, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuMemAddressFree(a, TIB / 2), CUDA_SUCCESS);
    }
}

#[test]
fn the_driver_reserve_and_granularities() {
    run_child(
        "child_reserve",
        &[
            ("CISTERN_FAKECUDA_CAPACITY", "1GiB"),
            ("CISTERN_FAKECUDA_RESERVE", "128MiB"),
        ],
    );
}

#[test]
#[ignore = "child process of the_driver_reserve_and_granularities"]
fn child_reserve() {
    if !is_child("child_reserve") {
        return;
    }
    let c0 = init_ctx(0);
    // SAFETY (whole block): as in child_streams.
    unsafe {
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let (mut free, mut total) = (0, 0);
        assert_eq!(sys::cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
        assert_eq!((free, total), (896 * MIB, 1024 * MIB));
        let p = prop(0);
        let mut h = 0;
        assert_eq!(
            sys::cuMemCreate(&mut h, 960 * MIB, &p, 0),
            CUDA_ERROR_OUT_OF_MEMORY,
            "the reserve is not for cuMemCreate"
        );
        let mut lin = 0;
        assert_eq!(
            sys::cuMemAlloc_v2(&mut lin, 960 * MIB),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(sys::cuMemCreate(&mut h, 896 * MIB, &p, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(h), CUDA_SUCCESS);
        let (mut min, mut rec) = (0, 0);
        use sys::CUmemAllocationGranularity_flags::*;
        assert_eq!(
            sys::cuMemGetAllocationGranularity(&mut min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuMemGetAllocationGranularity(&mut rec, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            CUDA_SUCCESS
        );
        assert_eq!((min, rec), (2 * MIB, 4 * MIB));
    }
}

#[test]
fn a_mapped_handle_is_released_at_its_last_unmap() {
    run_child(
        "child_deferred_release",
        &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")],
    );
}

#[test]
#[ignore = "child process of a_mapped_handle_is_released_at_its_last_unmap"]
fn child_deferred_release() {
    if !is_child("child_deferred_release") {
        return;
    }
    let c0 = init_ctx(0);
    let used = || {
        let (mut free, mut total) = (0, 0);
        // SAFETY: both are live, writable usizes.
        assert_eq!(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            CUDA_SUCCESS
        );
        total - free
    };
    // SAFETY (whole block): as in child_streams.
    unsafe {
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let before = used();
        let (va, h) = mapped(0, 8 * MIB);
        let p = prop(0);
        let mut h2 = 0;
        assert_eq!(sys::cuMemCreate(&mut h2, 8 * MIB, &p, 0), CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemMap(va + 8 * MIB as u64, 0, 0, h2, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(used(), before + 16 * MIB);
        assert_eq!(sys::cuMemRelease(h), CUDA_SUCCESS, "still mapped");
        assert_eq!(used(), before + 16 * MIB, "freed only at the unmap");
        assert_eq!(sys::cuMemRelease(h), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            sys::cuMemMap(va, 8 * MIB, 0, h, 0),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(sys::cuMemUnmap(va, 8 * MIB), CUDA_SUCCESS);
        assert_eq!(used(), before + 8 * MIB);
        assert_eq!(sys::cuMemRelease(h2), CUDA_SUCCESS);
        assert_eq!(used(), before);
        assert_eq!(sys::cuMemAddressFree(va, 8 * MIB), CUDA_SUCCESS);
    }
}

#[test]
fn allocation_properties_are_checked() {
    run_child("child_properties", &[]);
    run_child(
        "child_properties_supported",
        &[
            ("CISTERN_FAKECUDA_FABRIC", "1"),
            ("CISTERN_FAKECUDA_RDMA", "1"),
        ],
    );
}

fn create_with(p: &sys::CUmemAllocationProp) -> CUresult {
    let mut h = 0;
    // SAFETY: `h` and `p` are live locals.
    let r = unsafe { sys::cuMemCreate(&mut h, 2 * MIB, p, 0) };
    if r == CUDA_SUCCESS {
        // SAFETY: the handle just created.
        assert_eq!(unsafe { sys::cuMemRelease(h) }, CUDA_SUCCESS);
    }
    r
}

fn with_handle_types(bits: u32) -> sys::CUmemAllocationProp {
    let mut p = prop(0);
    // SAFETY: the field is a C enum read as an integer by the fake; the value is passed, never
    // matched on in Rust.
    p.requestedHandleTypes =
        unsafe { std::mem::transmute::<u32, sys::CUmemAllocationHandleType>(bits) };
    p
}

#[test]
#[ignore = "child process of allocation_properties_are_checked"]
fn child_properties() {
    if !is_child("child_properties") {
        return;
    }
    // SAFETY: a plain flags value.
    assert_eq!(unsafe { sys::cuInit(0) }, CUDA_SUCCESS);
    assert_eq!(create_with(&prop(0)), CUDA_SUCCESS);
    assert_eq!(create_with(&with_handle_types(1)), CUDA_SUCCESS, "POSIX fd");
    assert_eq!(
        create_with(&with_handle_types(2)),
        CUDA_ERROR_NOT_SUPPORTED,
        "Win32"
    );
    assert_eq!(create_with(&with_handle_types(4)), CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(
        create_with(&with_handle_types(8)),
        CUDA_ERROR_NOT_SUPPORTED,
        "fabric"
    );
    assert_eq!(
        create_with(&with_handle_types(0x10)),
        CUDA_ERROR_INVALID_VALUE
    );
    let mut p = prop(0);
    p.allocFlags.gpuDirectRDMACapable = 1;
    assert_eq!(create_with(&p), CUDA_ERROR_NOT_SUPPORTED);
    p.allocFlags.gpuDirectRDMACapable = 2;
    assert_eq!(create_with(&p), CUDA_ERROR_INVALID_VALUE);
    let mut p = prop(0);
    p.allocFlags.compressionType = 1;
    assert_eq!(create_with(&p), CUDA_ERROR_NOT_SUPPORTED);
    let mut p = prop(0);
    p.allocFlags.usage = 2;
    assert_eq!(create_with(&p), CUDA_ERROR_INVALID_VALUE);
    let mut p = prop(0);
    p.allocFlags.reserved[3] = 1;
    assert_eq!(create_with(&p), CUDA_ERROR_INVALID_VALUE);
}

#[test]
#[ignore = "child process of allocation_properties_are_checked"]
fn child_properties_supported() {
    if !is_child("child_properties_supported") {
        return;
    }
    // SAFETY: a plain flags value.
    assert_eq!(unsafe { sys::cuInit(0) }, CUDA_SUCCESS);
    assert_eq!(create_with(&with_handle_types(8 | 1)), CUDA_SUCCESS);
    let mut p = prop(0);
    p.allocFlags.gpuDirectRDMACapable = 1;
    assert_eq!(create_with(&p), CUDA_SUCCESS);
}

#[test]
fn sharing_follows_the_drivers_rules() {
    run_child("child_sharing", &[]);
    run_child(
        "child_sharing_refused",
        &[("CISTERN_FAKECUDA_FD_REFUSED", "1")],
    );
}

#[test]
#[ignore = "child process of sharing_follows_the_drivers_rules"]
fn child_sharing() {
    if !is_child("child_sharing") {
        return;
    }
    // The handle types as the driver's type (read back from a property).
    let (fd_t, fabric_t) = (
        with_handle_types(1).requestedHandleTypes,
        with_handle_types(8).requestedHandleTypes,
    );
    let ctx = init_ctx(0);
    // SAFETY: every pointer is a live local; handles and addresses are the fake's own; each
    // descriptor the fake gives is closed once.
    unsafe {
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
        let mut v = 0;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
        assert_eq!(sys::cuDeviceGetAttribute(&mut v, attr, 0), CUDA_SUCCESS);
        assert_eq!(v, 1);
        let mut fd: c_int = -1;
        let out = (&mut fd as *mut c_int).cast();
        // A handle created without the type cannot be exported.
        let mut plain = 0;
        assert_eq!(
            sys::cuMemCreate(&mut plain, 2 * MIB, &prop(0), 0),
            CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuMemExportToShareableHandle(out, plain, fd_t, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(sys::cuMemRelease(plain), CUDA_SUCCESS);
        let mut h = 0;
        assert_eq!(
            sys::cuMemCreate(&mut h, 2 * MIB, &with_handle_types(1), 0),
            CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuMemExportToShareableHandle(out, h, fabric_t, 0),
            CUDA_ERROR_NOT_SUPPORTED
        );
        assert_eq!(
            sys::cuMemExportToShareableHandle(out, h, fd_t, 1),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuMemExportToShareableHandle(out, h, fd_t, 0),
            CUDA_SUCCESS
        );
        assert!(fd >= 0);
        // Imported, in this process too: a new handle of the same memory, released on its own.
        let mut h2 = 0;
        let os = fd as usize as *mut std::ffi::c_void;
        assert_eq!(
            sys::cuMemImportFromShareableHandle(&mut h2, os, fd_t),
            CUDA_SUCCESS
        );
        assert_ne!(h2, h);
        assert_eq!(sys::cuMemRelease(h2), CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(h), CUDA_SUCCESS);
        // A descriptor that is not an exported handle.
        let bad = libc::memfd_create(c"not-a-handle".as_ptr(), 0);
        let os = bad as usize as *mut std::ffi::c_void;
        assert_eq!(
            sys::cuMemImportFromShareableHandle(&mut h2, os, fd_t),
            CUDA_ERROR_INVALID_VALUE
        );
        libc::close(bad);
        libc::close(fd);
        // Linear memory: any pointer inside names the allocation; this process cannot open it.
        let mut p = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut p, 4 * MIB), CUDA_SUCCESS);
        let mut ipc = sys::CUipcMemHandle_st { reserved: [0; 64] };
        assert_eq!(sys::cuIpcGetMemHandle(&mut ipc, p + 4096), CUDA_SUCCESS);
        let mut q = 0;
        assert_eq!(
            sys::cuIpcOpenMemHandle_v2(&mut q, ipc, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuIpcOpenMemHandle_v2(&mut q, ipc, 1),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(sys::cuIpcCloseMemHandle(p), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            sys::cuIpcGetMemHandle(&mut ipc, 0x10),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(sys::cuMemFree_v2(p), CUDA_SUCCESS);
        let mut popped = null_mut();
        assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), CUDA_SUCCESS);
    }
}

#[test]
#[ignore = "child process of sharing_follows_the_drivers_rules"]
fn child_sharing_refused() {
    if !is_child("child_sharing_refused") {
        return;
    }
    // SAFETY: a plain flags value.
    assert_eq!(unsafe { sys::cuInit(0) }, CUDA_SUCCESS);
    assert_eq!(create_with(&with_handle_types(1)), CUDA_ERROR_NOT_PERMITTED);
    assert_eq!(create_with(&prop(0)), CUDA_SUCCESS);
}
