//! The real `CudaDriver` and a `cistern::Pool` on the fake driver, end to end.
//!
//! The dynamic loader reads `LD_LIBRARY_PATH` when a process starts, so each check runs in a
//! child process: a parent test re-runs this test binary with the fake on the library path,
//! `CISTERN_FAKECUDA=1`, its knobs, and a filter that selects one `#[ignore]`d child test. The
//! child tests do nothing unless `FAKECUDA_CHILD` names them (so `cargo test -- --ignored`
//! alone passes without running them on a missing driver).

mod common;

use std::process::Command;
use std::sync::Arc;

use cistern::driver::cuda::CudaDriver;
use cistern::driver::{Driver, DriverCall, DriverErrorKind};
use cistern::{Config, Error, Pool, StreamId};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const CHILD: &str = "FAKECUDA_CHILD";
/// The driver's reserve the children run with (`CISTERN_FAKECUDA_RESERVE`): what
/// `cuMemGetInfo` shows as used with nothing allocated.
const RESERVE: u64 = 64 * MIB;

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
    let reserve = format!("{RESERVE}");
    let mut all = vec![("CISTERN_FAKECUDA_RESERVE", reserve.as_str())];
    all.extend_from_slice(knobs);
    common::child_env(&mut cmd, &all);
    cmd.env(CHILD, name);
    let out = cmd.output().expect("run the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "child {name} failed ({:?})\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("1 passed"),
        "child {name} did not run exactly one test\n{stdout}"
    );
    assert!(
        !stderr.contains("still live"),
        "child {name} leaked driver memory or events\n{stderr}"
    );
    stderr
}

/// Whether this process is the child for `name` (else the child test is a no-op).
fn is_child(name: &str) -> bool {
    let yes = std::env::var(CHILD).as_deref() == Ok(name);
    if !yes {
        eprintln!("skipping: {name} runs in a child process started by its parent test");
    }
    yes
}

/// A new stream of device `dev`'s primary context (the strict fake refuses made-up stream
/// values), made with the context pushed and popped so the caller's current context is kept.
fn new_stream(d: &CudaDriver, dev: usize) -> StreamId {
    new_stream_flags(d, dev, 0)
}

/// Destroys a stream `new_stream` made.
fn destroy_stream(s: StreamId) {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    // SAFETY: a stream the fake created, destroyed once.
    let r = unsafe { sys::cuStreamDestroy_v2(s.0 as usize as sys::CUstream) };
    assert_eq!(r, CUDA_SUCCESS, "destroying stream {s}");
}

/// As [`new_stream`], with `cuStreamCreate`'s `flags` (1: `CU_STREAM_NON_BLOCKING`).
fn new_stream_flags(d: &CudaDriver, dev: usize, flags: u32) -> StreamId {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    // Retains the primary context inside CudaDriver, so the fake has one to push.
    d.mem_info(dev).unwrap();
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: every pointer is a live local of the right type; `ctx` is a primary context the
    // fake returned, pushed and popped again before the function returns.
    unsafe {
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev as i32),
            CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut s, flags), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(std::ptr::null_mut()), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(dev as i32), CUDA_SUCCESS);
    }
    StreamId(s as usize as u64)
}

/// Begins a capture of stream `s` (one the fake created) in `mode`.
fn begin_capture(s: StreamId, mode: cudarc::driver::sys::CUstreamCaptureMode) {
    use cudarc::driver::sys;
    // SAFETY: `s` is a stream the fake created; the mode is a valid enum value.
    let r = unsafe { sys::cuStreamBeginCapture_v2(s.0 as usize as sys::CUstream, mode) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "beginning a capture");
}

/// `cuStreamIsCapturing` of stream `s`: 0 none, 1 active, 2 invalidated.
fn capture_status(s: StreamId) -> u32 {
    use cudarc::driver::sys;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `status` is a live, writable status; `s` a stream the fake created.
    let r = unsafe { sys::cuStreamIsCapturing(s.0 as usize as sys::CUstream, &mut status) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuStreamIsCapturing");
    status as u32
}

/// Ends the capture of stream `s`, destroying the graph it made; `CUDA_SUCCESS` unless the
/// capture was invalidated.
fn end_capture(s: StreamId) -> cudarc::driver::sys::CUresult {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: `graph` is a live, writable CUgraph; `s` a stream the fake created.
    let r = unsafe { sys::cuStreamEndCapture(s.0 as usize as sys::CUstream, &mut graph) };
    if !graph.is_null() {
        // SAFETY: the graph the capture returned, destroyed once.
        assert_eq!(unsafe { sys::cuGraphDestroy(graph) }, CUDA_SUCCESS);
    }
    r
}

fn driver() -> CudaDriver {
    CudaDriver::new().unwrap_or_else(|e| panic!("CudaDriver::new on the fake: {e}"))
}

fn check(pool: &Pool<CudaDriver>) {
    if let Err(e) = pool.check_invariants() {
        panic!("invariants violated: {e}");
    }
}

fn stat(pool: &Pool<CudaDriver>, key: &str) -> i64 {
    pool.stats(0).unwrap().get(key)
}

/// Frees everything in `live`, empties the cache, and checks the device is back to empty.
fn drain(pool: &Pool<CudaDriver>, live: Vec<(u64, StreamId)>) {
    for (p, s) in live {
        pool.free_raw(p, s).unwrap();
    }
    check(pool);
    assert_eq!(stat(pool, "allocated_bytes.all.current"), 0);
    pool.empty_cache();
    check(pool);
    assert_eq!(stat(pool, "reserved_bytes.all.current"), 0);
    let info = pool.driver().mem_info(0).unwrap();
    assert_eq!(
        info.total - info.free,
        RESERVE,
        "driver memory beyond the driver's reserve left after empty_cache"
    );
}

// ---- VMM pool -------------------------------------------------------------------------------

#[test]
fn vmm_pool_on_the_fake_driver() {
    run_child("child_vmm_pool", &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")]);
}

#[test]
#[ignore = "child process of vmm_pool_on_the_fake_driver"]
fn child_vmm_pool() {
    if !is_child("child_vmm_pool") {
        return;
    }
    let d = driver();
    assert_eq!(d.name(), "cuda");
    assert_eq!(d.device_count().unwrap(), 1);
    let caps = d.capabilities(0).unwrap();
    assert!(caps.vmm, "{caps:?}");
    assert_eq!(caps.granularity, 2 * MIB);
    assert_eq!(caps.total_memory, GIB);
    assert_eq!(caps.name, "cistern-sim");
    assert_eq!(
        caps.uuid.as_deref(),
        Some("GPU-5157a1d0-0000-4000-8000-000000000000")
    );
    let info = d.mem_info(0).unwrap();
    // The driver's reserve is in use before anything is allocated.
    assert_eq!((info.free, info.total), (GIB - RESERVE, GIB));

    let (sa, sb) = (new_stream(&d, 0), new_stream(&d, 0));
    let pool = Pool::new(d, Config::default()).unwrap();
    assert!(pool.device(0).unwrap().uses_vmm());

    // Swiss cheese: 40 × (20 MiB + 2 MiB), every other 20 MiB block freed.
    let mut live = Vec::new();
    let mut big = Vec::new();
    for _ in 0..40 {
        big.push(pool.alloc_raw(0, 20 * MIB, sa).unwrap());
        live.push((pool.alloc_raw(0, 2 * MIB, sa).unwrap(), sa));
    }
    for (i, p) in big.into_iter().enumerate() {
        if i % 2 == 0 {
            pool.free_raw(p, sa).unwrap();
        } else {
            live.push((p, sa));
        }
    }
    check(&pool);
    assert_eq!(stat(&pool, "allocated_bytes.all.current"), 480 * MIB as i64);
    // 300 MiB from the holes, stitched: no new physical memory.
    let device_allocs = stat(&pool, "num_device_alloc");
    let p = pool.alloc_raw(0, 300 * MIB, sa).unwrap();
    assert_eq!(stat(&pool, "num_device_alloc"), device_allocs);
    assert!(stat(&pool, "num_stitches") >= 1);
    live.push((p, sa));
    check(&pool);

    // record_stream: the block is reused only after B's work (none here) completes.
    let q = pool.alloc_raw(0, 4 * MIB, sa).unwrap();
    pool.record_stream(q, sb).unwrap();
    pool.free_raw(q, sa).unwrap();
    assert_eq!(stat(&pool, "num_record_streams"), 1);
    let r = pool.alloc_raw(0, 4 * MIB, sa).unwrap();
    live.push((r, sa));
    check(&pool);

    // OOM is a typed error with a report, and the pool stays consistent.
    let e = pool.alloc_raw(0, 2 * GIB, sa).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(e.oom_report().is_some());
    assert_eq!(stat(&pool, "num_ooms"), 1);
    check(&pool);

    let live_bytes: u64 = 20 * 20 * MIB + 40 * 2 * MIB + 300 * MIB + 4 * MIB;
    assert_eq!(
        stat(&pool, "allocated_bytes.all.current"),
        live_bytes as i64
    );
    assert!(stat(&pool, "reserved_bytes.all.current") >= live_bytes as i64);
    assert_eq!(stat(&pool, "num_driver_errors"), 0);
    drain(&pool, live);
}

// ---- linear fallback ------------------------------------------------------------------------

#[test]
fn linear_pool_when_vmm_is_off() {
    run_child(
        "child_linear_pool",
        &[
            ("CISTERN_FAKECUDA_CAPACITY", "512MiB"),
            ("CISTERN_FAKECUDA_VMM", "0"),
        ],
    );
}

#[test]
#[ignore = "child process of linear_pool_when_vmm_is_off"]
fn child_linear_pool() {
    if !is_child("child_linear_pool") {
        return;
    }
    let d = driver();
    let caps = d.capabilities(0).unwrap();
    assert!(!caps.vmm, "{caps:?}");
    assert_eq!(caps.granularity, 2 * MIB);
    // The VMM calls are refused as on a device without VMM.
    let e = d.reserve_va(0, 2 * MIB, 2 * MIB).unwrap_err();
    assert_eq!(e.kind, DriverErrorKind::NotSupported, "{e}");
    assert_eq!(e.code, 801);

    let (sa, sb) = (new_stream(&d, 0), new_stream(&d, 0));
    let pool = Pool::new(d, Config::default()).unwrap();
    assert!(!pool.device(0).unwrap().uses_vmm());
    let mut live = Vec::new();
    for (i, size) in [512, 4096, MIB, 3 * MIB, 20 * MIB, 100 * MIB]
        .into_iter()
        .enumerate()
    {
        let s = if i % 2 == 0 { sa } else { sb };
        live.push((pool.alloc_raw(0, size, s).unwrap(), s));
    }
    check(&pool);
    let (p, s) = live.pop().unwrap();
    pool.record_stream(p, sa).unwrap();
    pool.free_raw(p, s).unwrap();
    live.push((pool.alloc_raw(0, 100 * MIB, sb).unwrap(), sb));
    check(&pool);
    let e = pool.alloc_raw(0, GIB, sa).unwrap_err();
    assert!(e.is_oom(), "{e}");
    assert!(stat(&pool, "num_ooms") >= 1);
    assert!(stat(&pool, "num_device_alloc") >= 1);
    drain(&pool, live);
}

// ---- fault injection ------------------------------------------------------------------------

#[test]
fn injected_out_of_memory_is_a_typed_error() {
    run_child(
        "child_injected_oom",
        &[
            ("CISTERN_FAKECUDA_CAPACITY", "1GiB"),
            ("CISTERN_FAKECUDA_FAIL", "cuMemCreate:2+"),
        ],
    );
}

#[test]
#[ignore = "child process of injected_out_of_memory_is_a_typed_error"]
fn child_injected_oom() {
    if !is_child("child_injected_oom") {
        return;
    }
    let d = driver();
    let sa = new_stream(&d, 0);
    let pool = Pool::new(d, Config::default()).unwrap();
    // The first cuMemCreate (one 2 MiB page) succeeds; every later one fails with
    // CUDA_ERROR_OUT_OF_MEMORY.
    let p = pool.alloc_raw(0, 2 * MIB, sa).unwrap();
    let e = pool.alloc_raw(0, 500 * MIB, sa).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    check(&pool);
    assert!(stat(&pool, "num_ooms") >= 1);
    // What was allocated still works, and its memory can be reused.
    pool.free_raw(p, sa).unwrap();
    let q = pool.alloc_raw(0, 2 * MIB, sa).unwrap();
    drain(&pool, vec![(q, sa)]);
}

#[test]
fn injected_driver_failures_are_typed_errors() {
    run_child(
        "child_injected_failures",
        &[("CISTERN_FAKECUDA_FAIL", "cuMemMap:1,cuDeviceGetAttribute:1")],
    );
}

#[test]
#[ignore = "child process of injected_driver_failures_are_typed_errors"]
fn child_injected_failures() {
    if !is_child("child_injected_failures") {
        return;
    }
    let d = driver();
    let sa = new_stream(&d, 0);
    let pool = Pool::new(d, Config::default()).unwrap();
    // The first capability query (cuDeviceGetAttribute) fails: no device pool, a typed error.
    match pool.alloc_raw(0, MIB, sa) {
        Err(Error::Driver(e)) => {
            assert_eq!(e.call, DriverCall::Capabilities, "{e}");
            assert_eq!(e.code, 999, "{e}");
        }
        other => panic!("expected a driver error, got {other:?}"),
    }
    // The first cuMemMap fails with CUDA_ERROR_UNKNOWN: an error or a recovered allocation,
    // never a crash, and the pool stays consistent.
    let mut live = Vec::new();
    match pool.alloc_raw(0, 8 * MIB, sa) {
        Ok(p) => live.push((p, sa)),
        Err(Error::Driver(e)) => {
            assert_eq!(e.call, DriverCall::Map, "{e}");
            assert_eq!(e.code, 999, "{e}");
        }
        Err(e) => panic!("unexpected error {e}"),
    }
    check(&pool);
    assert!(stat(&pool, "num_driver_errors") >= 1);
    live.push((pool.alloc_raw(0, 8 * MIB, sa).unwrap(), sa));
    drain(&pool, live);
}

// ---- several devices and threads ------------------------------------------------------------

#[test]
fn two_devices_and_the_callers_context() {
    run_child(
        "child_two_devices",
        &[
            ("CISTERN_FAKECUDA_DEVICES", "2"),
            ("CISTERN_FAKECUDA_CAPACITY", "512MiB"),
        ],
    );
}

#[test]
#[ignore = "child process of two_devices_and_the_callers_context"]
fn child_two_devices() {
    use cudarc::driver::sys;
    if !is_child("child_two_devices") {
        return;
    }
    let d = driver();
    let (sa, sa1) = (new_stream(&d, 0), new_stream(&d, 1));
    let pool = Pool::new(d, Config::default()).unwrap();
    assert_eq!(pool.device_count(), 2);
    // The caller's current context is device 1's; a call on device 0 must leave it current.
    let mut ctx1: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx1` is a live, writable CUcontext; the fake is initialised (CudaDriver::new).
    let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx1, 1) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: a context the driver returned.
    assert_eq!(
        unsafe { sys::cuCtxSetCurrent(ctx1) },
        sys::CUresult::CUDA_SUCCESS
    );
    let a = pool.alloc_raw(0, 10 * MIB, sa).unwrap();
    let b = pool.alloc_raw(1, 10 * MIB, sa1).unwrap();
    assert!(pool.device(0).unwrap().owns(a) && !pool.device(0).unwrap().owns(b));
    assert!(pool.device(1).unwrap().owns(b));
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `cur` is a live, writable CUcontext.
    assert_eq!(
        unsafe { sys::cuCtxGetCurrent(&mut cur) },
        sys::CUresult::CUDA_SUCCESS
    );
    assert_eq!(
        cur, ctx1,
        "CudaDriver did not put the caller's context back"
    );
    let info1 = pool.driver().mem_info(1).unwrap();
    assert_eq!(info1.total, 512 * MIB);
    assert!(info1.free < info1.total);
    pool.free_raw(b, sa1).unwrap();
    pool.empty_cache();
    assert_eq!(pool.driver().mem_info(1).unwrap().free, 512 * MIB - RESERVE);
    drain(&pool, vec![(a, sa)]);
    // SAFETY: releases the retain above.
    assert_eq!(
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(1) },
        sys::CUresult::CUDA_SUCCESS
    );
}

#[test]
fn many_threads_share_a_pool() {
    run_child("child_threads", &[("CISTERN_FAKECUDA_CAPACITY", "4GiB")]);
}

#[test]
#[ignore = "child process of many_threads_share_a_pool"]
fn child_threads() {
    if !is_child("child_threads") {
        return;
    }
    let d = driver();
    let streams: Vec<StreamId> = (0..4).map(|_| new_stream(&d, 0)).collect();
    let pool = Arc::new(Pool::new(d, Config::default()).unwrap());
    let threads: Vec<_> = (0..4usize)
        .map(|t| {
            let pool = Arc::clone(&pool);
            let (s, other) = (streams[t], streams[(t + 1) % 4]);
            std::thread::spawn(move || {
                let mut x = t as u64 + 1;
                let mut live = Vec::new();
                for i in 0..300u64 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let size = [512, 4096, 70_000, MIB, 3 * MIB, 24 * MIB][(x >> 33) as usize % 6];
                    live.push(pool.alloc_raw(0, size, s).unwrap());
                    if i % 7 == 0 {
                        pool.record_stream(*live.last().unwrap(), other).unwrap();
                    }
                    if live.len() > 20 {
                        let p = live.swap_remove((x >> 40) as usize % live.len());
                        pool.free_raw(p, s).unwrap();
                    }
                }
                for p in live {
                    pool.free_raw(p, s).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    check(&pool);
    drain(&pool, Vec::new());
}

// ---- knobs and the guard --------------------------------------------------------------------

#[test]
fn unusable_knobs_are_reported_and_defaulted() {
    let stderr = run_child(
        "child_bad_knobs",
        &[
            ("CISTERN_FAKECUDA_CAPACITY", "lots"),
            ("CISTERN_FAKECUDA_DEVICES", "zero"),
            ("CISTERN_FAKECUDA_FAIL", "cuNothing:1"),
        ],
    );
    for needle in [
        "CISTERN_FAKECUDA_CAPACITY=\"lots\"",
        "CISTERN_FAKECUDA_DEVICES=\"zero\"",
        "cuNothing",
    ] {
        assert!(
            stderr.contains(needle),
            "no message about {needle}:\n{stderr}"
        );
    }
}

#[test]
#[ignore = "child process of unusable_knobs_are_reported_and_defaulted"]
fn child_bad_knobs() {
    if !is_child("child_bad_knobs") {
        return;
    }
    let d = driver();
    assert_eq!(d.device_count().unwrap(), 1);
    assert_eq!(d.capabilities(0).unwrap().total_memory, 16 * GIB);
}

#[test]
fn the_fake_refuses_to_start_without_its_guard() {
    let stderr = run_child("child_guard", &[("CISTERN_FAKECUDA", "0")]);
    assert!(stderr.contains("refuses to start"), "{stderr}");
}

#[test]
#[ignore = "child process of the_fake_refuses_to_start_without_its_guard"]
fn child_guard() {
    if !is_child("child_guard") {
        return;
    }
    let e = CudaDriver::new().unwrap_err();
    assert_eq!(e.kind, DriverErrorKind::NoDriver, "{e}");
    assert_eq!(e.code, 34, "CUDA_ERROR_STUB_LIBRARY: {e}");
    assert!(e.message.contains("CISTERN_DRIVER=sim"), "{e}");
}

// ---- the C API's own semantics, call by call ------------------------------------------------

#[test]
fn raw_driver_calls_behave_like_the_driver() {
    run_child(
        "child_raw_calls",
        &[
            ("CISTERN_FAKECUDA_DEVICES", "2"),
            ("CISTERN_FAKECUDA_CAPACITY", "256MiB"),
        ],
    );
}

#[test]
#[ignore = "child process of raw_driver_calls_behave_like_the_driver"]
fn child_raw_calls() {
    use cudarc::driver::sys::{self, CUresult::*};
    use std::ptr::{null, null_mut};
    if !is_child("child_raw_calls") {
        return;
    }
    // SAFETY (whole block): every pointer passed is null on purpose or points to a live local
    // of the right type; handles are the fake's own values, never dereferenced by it.
    unsafe {
        let mut n = 0;
        // Before cuInit, calls are refused; error strings work.
        assert_eq!(sys::cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
        let mut text = null();
        assert_eq!(
            sys::cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &mut text),
            CUDA_SUCCESS
        );
        assert_eq!(
            std::ffi::CStr::from_ptr(text).to_str().unwrap(),
            "out of memory"
        );
        assert_eq!(sys::cuInit(1), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuInit(0), CUDA_SUCCESS);
        assert_eq!(sys::cuInit(0), CUDA_SUCCESS);

        // Devices.
        assert_eq!(sys::cuDeviceGetCount(null_mut()), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuDeviceGetCount(&mut n), CUDA_SUCCESS);
        assert_eq!(n, 2);
        let mut dev = -1;
        assert_eq!(sys::cuDeviceGet(&mut dev, 2), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(sys::cuDeviceGet(&mut dev, -1), CUDA_ERROR_INVALID_DEVICE);
        assert_eq!(sys::cuDeviceGet(&mut dev, 1), CUDA_SUCCESS);
        assert_eq!(dev, 1);
        let mut name = [1 as std::ffi::c_char; 8];
        assert_eq!(sys::cuDeviceGetName(name.as_mut_ptr(), 4, 0), CUDA_SUCCESS);
        assert_eq!(
            std::ffi::CStr::from_ptr(name.as_ptr()).to_str().unwrap(),
            "cis"
        );
        assert_eq!(
            sys::cuDeviceGetName(name.as_mut_ptr(), 0, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuDeviceGetName(null_mut(), 8, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        let mut total = 0usize;
        assert_eq!(sys::cuDeviceTotalMem_v2(&mut total, 1), CUDA_SUCCESS);
        assert_eq!(total as u64, 256 * MIB);
        assert_eq!(
            sys::cuDeviceTotalMem_v2(&mut total, 9),
            CUDA_ERROR_INVALID_DEVICE
        );
        let mut v = -1;
        let vmm_attr =
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED;
        assert_eq!(sys::cuDeviceGetAttribute(&mut v, vmm_attr, 0), CUDA_SUCCESS);
        assert_eq!(v, 1);
        assert_eq!(
            sys::cuDeviceGetAttribute(null_mut(), vmm_attr, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        assert_eq!(sys::cuDeviceGetUuid_v2(&mut uuid, 1), CUDA_SUCCESS);
        assert_eq!(uuid.bytes[15], 1);

        // Contexts: none current; context-bound calls are refused until one is.
        let mut cur: sys::CUcontext = null_mut();
        assert_eq!(sys::cuCtxGetCurrent(&mut cur), CUDA_SUCCESS);
        assert!(cur.is_null());
        let mut p: sys::CUdeviceptr = 0;
        assert_eq!(sys::cuMemAlloc_v2(&mut p, 4096), CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(sys::cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
        let (mut c0, mut c0b, mut c1) = (null_mut(), null_mut(), null_mut());
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut c0, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut c0b, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut c1, 1), CUDA_SUCCESS);
        assert!(
            !c0.is_null() && c0 == c0b && c0 != c1,
            "{c0:?} {c0b:?} {c1:?}"
        );
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(null_mut(), 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuCtxSetCurrent(0x1234 as sys::CUcontext),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(sys::cuCtxSetCurrent(c1), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxGetCurrent(&mut cur), CUDA_SUCCESS);
        assert_eq!(cur, c1);
        // The current context is per thread.
        let other = std::thread::spawn(current_is_null);
        assert_eq!(other.join().unwrap(), (CUDA_SUCCESS, true));

        // Linear memory on the current context's device (1).
        assert_eq!(
            sys::cuMemAlloc_v2(null_mut(), 4096),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(sys::cuMemAlloc_v2(&mut p, 0), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            sys::cuMemAlloc_v2(&mut p, (GIB) as usize),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(sys::cuMemAlloc_v2(&mut p, 3 * MIB as usize), CUDA_SUCCESS);
        let (mut free, mut tot) = (0usize, 0usize);
        assert_eq!(sys::cuMemGetInfo_v2(&mut free, &mut tot), CUDA_SUCCESS);
        assert_eq!((tot as u64 - free as u64), 3 * MIB + RESERVE);
        assert_eq!(
            sys::cuMemGetInfo_v2(null_mut(), &mut tot),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(sys::cuMemFree_v2(p + 512), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuMemFree_v2(p), CUDA_SUCCESS);
        assert_eq!(sys::cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);

        // VMM on device 0.
        assert_eq!(sys::cuCtxSetCurrent(c0), CUDA_SUCCESS);
        let mut prop = sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            },
            win32HandleMetaData: null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        };
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        let mut g = 0usize;
        assert_eq!(
            sys::cuMemGetAllocationGranularity(&mut g, &prop, minimum),
            CUDA_SUCCESS
        );
        assert_eq!(g as u64, 2 * MIB);
        assert_eq!(
            sys::cuMemGetAllocationGranularity(&mut g, null(), minimum),
            CUDA_ERROR_INVALID_VALUE
        );
        prop.location.id = 7;
        assert_eq!(
            sys::cuMemGetAllocationGranularity(&mut g, &prop, minimum),
            CUDA_ERROR_INVALID_DEVICE
        );
        prop.location.id = 0;
        let mut va: sys::CUdeviceptr = 0;
        assert_eq!(
            sys::cuMemAddressReserve(&mut va, 8 * g, 0, 0, 1),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuMemAddressReserve(&mut va, 8 * g, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert!(va != 0 && va & (g as u64 - 1) == 0);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        assert_eq!(sys::cuMemCreate(&mut h, 2 * g, &prop, 0), CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemCreate(&mut h, 2 * g + 1, &prop, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuMemCreate(&mut h, GIB as usize, &prop, 0),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(sys::cuMemMap(va, 2 * g, g, h, 0), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            sys::cuMemMap(va, 2 * g, 0, h + 1000, 0),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(sys::cuMemMap(va, 2 * g, 0, h, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuMemMap(va, 2 * g, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
        let mut desc = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        assert_eq!(
            sys::cuMemSetAccess(va, 2 * g, &desc, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuMemSetAccess(va, 2 * g, null(), 1),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(sys::cuMemSetAccess(va, 2 * g, &desc, 1), CUDA_SUCCESS);
        // Device 1 can access device 0's memory (two devices are peers by default).
        desc.location.id = 1;
        assert_eq!(sys::cuMemSetAccess(va, 2 * g, &desc, 1), CUDA_SUCCESS);
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ;
        assert_eq!(
            sys::cuMemSetAccess(va, 2 * g, &desc, 1),
            CUDA_ERROR_NOT_SUPPORTED
        );
        assert_eq!(
            sys::cuMemAddressFree(va, 8 * g),
            CUDA_ERROR_INVALID_VALUE,
            "still mapped"
        );
        assert_eq!(
            sys::cuMemUnmap(va, g),
            CUDA_ERROR_INVALID_VALUE,
            "part of a mapping"
        );
        // Released while mapped: the handle is gone, its memory stays until the unmap.
        assert_eq!(sys::cuMemRelease(h), CUDA_SUCCESS);
        assert_eq!(sys::cuMemRelease(h), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuMemUnmap(va, 2 * g), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(va, 8 * g), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(va, 8 * g), CUDA_ERROR_INVALID_VALUE);

        // Events.
        let mut ev: sys::CUevent = null_mut();
        assert_eq!(sys::cuEventCreate(&mut ev, 0x40), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuEventCreate(&mut ev, 0x4), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuEventCreate(null_mut(), 2), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sys::cuEventCreate(&mut ev, 2), CUDA_SUCCESS);
        assert!(!ev.is_null());
        assert_eq!(sys::cuEventQuery(ev), CUDA_SUCCESS);
        assert_eq!(
            sys::cuEventRecord(ev, 0x5000 as sys::CUstream),
            CUDA_ERROR_INVALID_HANDLE,
            "a made-up stream"
        );
        let mut stream: sys::CUstream = null_mut();
        assert_eq!(sys::cuStreamCreate(&mut stream, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuEventRecord(ev, stream), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamWaitEvent(null_mut(), ev, 0), CUDA_SUCCESS);
        assert_eq!(
            sys::cuStreamWaitEvent(null_mut(), ev, 2),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(sys::cuEventSynchronize(ev), CUDA_SUCCESS);
        assert_eq!(sys::cuEventQuery(ev), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxSynchronize(), CUDA_SUCCESS);
        assert_eq!(sys::cuEventDestroy_v2(ev), CUDA_SUCCESS);
        assert_eq!(sys::cuEventDestroy_v2(ev), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(sys::cuStreamDestroy_v2(stream), CUDA_SUCCESS);
        assert_eq!(
            sys::cuEventRecord(null_mut(), stream),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(sys::cuEventQuery(null_mut()), CUDA_ERROR_INVALID_HANDLE);

        // Releasing: counts go down to zero, then further releases are refused, and a released
        // context no longer serves calls.
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
        assert_eq!(
            sys::cuDevicePrimaryCtxRelease_v2(0),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(
            sys::cuMemGetInfo_v2(&mut free, &mut tot),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(1), CUDA_SUCCESS);
        assert_eq!(
            sys::cuDevicePrimaryCtxRelease_v2(5),
            CUDA_ERROR_INVALID_DEVICE
        );
        assert_eq!(sys::cuCtxSetCurrent(null_mut()), CUDA_SUCCESS);
    }
}

/// Whether the calling thread has no current context (and the query succeeded).
fn current_is_null() -> (cudarc::driver::sys::CUresult, bool) {
    let mut c: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `c` is a live, writable CUcontext.
    let r = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut c) };
    (r, c.is_null())
}

#[test]
fn a_leak_at_context_release_is_reported() {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args(["child_leak", "--exact", "--ignored", "--nocapture"]);
    common::child_env(&mut cmd, &[]);
    cmd.env(CHILD, "child_leak");
    let out = cmd.output().expect("run the child test");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("device 0 was released with 0 physical handle(s), 0 mapped byte(s), 0 reserved byte(s), 1 linear allocation(s) and 0 event(s) still live"),
        "{stderr}"
    );
}

#[test]
#[ignore = "child process of a_leak_at_context_release_is_reported"]
fn child_leak() {
    if !is_child("child_leak") {
        return;
    }
    let d = driver();
    d.mem_alloc(0, MIB).unwrap();
    drop(d);
}

// ---- stream capture ---------------------------------------------------------------------------

/// Before the fix, an allocation during a user's global-mode capture (PyTorch's
/// `torch.cuda.graph` default) polled pending frees with `cuEventQuery`, a potentially unsafe
/// call that invalidated the capture; the backend now relaxes the thread's mode for its calls.
#[test]
fn an_allocation_during_stream_capture_keeps_the_capture_valid() {
    run_child(
        "child_capture_pool",
        &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")],
    );
}

#[test]
#[ignore = "child process of an_allocation_during_stream_capture_keeps_the_capture_valid"]
fn child_capture_pool() {
    use cudarc::driver::sys::{self, CUresult::*};
    if !is_child("child_capture_pool") {
        return;
    }
    let d = driver();
    let (sa, sb) = (new_stream(&d, 0), new_stream(&d, 0));
    let pool = Pool::new(d, Config::default()).unwrap();
    // A free with a pending event: used on sb too, so its reuse waits for sb's event.
    let p = pool.alloc_raw(0, MIB, sa).unwrap();
    pool.record_stream(p, sb).unwrap();
    pool.free_raw(p, sa).unwrap();
    begin_capture(sa, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL);
    // PyTorch allocates during capture, on the capturing stream.
    let q = pool.alloc_raw(0, MIB, sa);
    assert_eq!(
        end_capture(sa),
        CUDA_SUCCESS,
        "the pool's calls during the capture invalidated it"
    );
    drain(&pool, vec![(q.unwrap(), sa)]);
}

/// A capture cistern was not told of (no graph pool window: a cudarc program's own) on a
/// stream whose growth would take a busy donor's cached pages: a move ordered on the device
/// would make the capturing stream wait on an event recorded outside the capture, which the
/// driver refuses and which invalidates the capture (driver 580, `capture_rules.py`). The move
/// falls back instead, and the capture stays valid.
#[test]
fn a_busy_donor_during_a_capture_keeps_the_capture_valid() {
    run_child(
        "child_capture_busy_donor",
        &[("CISTERN_FAKECUDA_CAPACITY", "2GiB")],
    );
}

#[test]
#[ignore = "child process of a_busy_donor_during_a_capture_keeps_the_capture_valid"]
fn child_capture_busy_donor() {
    use cudarc::driver::sys::{CUresult::*, CUstreamCaptureMode::*};
    if !is_child("child_capture_busy_donor") {
        return;
    }
    let d = driver();
    let (a, b) = (new_stream(&d, 0), new_stream(&d, 0));
    let pool = Pool::new(d, Config::default()).unwrap();
    // Swiss cheese on A: 20 MiB holes between live blocks, then work queued on A over one.
    let (mut big, mut live) = (Vec::new(), Vec::new());
    for _ in 0..40 {
        big.push(pool.alloc_raw(0, 20 * MIB, a).unwrap());
        live.push((pool.alloc_raw(0, 2 * MIB, a).unwrap(), a));
    }
    for (i, p) in big.into_iter().enumerate() {
        if i % 2 == 0 {
            pool.free_raw(p, a).unwrap();
        } else {
            live.push((p, a));
        }
    }
    let x = pool.alloc_raw(0, 20 * MIB, a).unwrap();
    type Launch = unsafe extern "C" fn(u64, u64, usize) -> u32;
    // SAFETY: the fake is loaded; the hook has this signature (the fake's README), and the
    // stream and range are live.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").unwrap();
        let launch: libloading::Symbol<Launch> = lib.get(b"cisternFakeLaunch\0").unwrap();
        assert_eq!(launch(a.0, x, (20 * MIB) as usize), 0);
    }
    pool.free_raw(x, a).unwrap();
    // B's first allocation (its arena made before the capture), then its capture.
    live.push((pool.alloc_raw(0, MIB, b).unwrap(), b));
    begin_capture(b, CU_STREAM_CAPTURE_MODE_GLOBAL);
    let p = pool.alloc_raw(0, 300 * MIB, b).unwrap();
    check(&pool);
    assert_eq!(
        end_capture(b),
        CUDA_SUCCESS,
        "the pool's calls invalidated the capture"
    );
    assert_eq!(
        stat(&pool, "num_ordered_moves"),
        0,
        "a move was ordered on a capturing stream"
    );
    live.push((p, b));
    // Outside the capture the same growth orders moves again (so the capture's growth met a
    // move to order, and fell back).
    let q = pool.alloc_raw(0, 300 * MIB, b).unwrap();
    check(&pool);
    assert!(
        stat(&pool, "num_ordered_moves") > 0,
        "no move to order: the test tests nothing"
    );
    live.push((q, b));
    drain(&pool, live);
}

/// Another stream's growth looks at the cached pages of a stream that is capturing a graph
/// cistern was not told of: an event recorded there would be a captured event, and querying it
/// breaks the capture whatever the mode (driver 580, `capture_rules.py`). The capturing
/// stream's pages are then not known to be idle, and are left; the capture stays valid.
#[test]
fn growth_beside_a_capturing_stream_keeps_the_capture_valid() {
    run_child(
        "child_capture_donor",
        &[("CISTERN_FAKECUDA_CAPACITY", "160MiB")],
    );
}

#[test]
#[ignore = "child process of growth_beside_a_capturing_stream_keeps_the_capture_valid"]
fn child_capture_donor() {
    use cudarc::driver::sys::{CUresult::*, CUstreamCaptureMode::*};
    if !is_child("child_capture_donor") {
        return;
    }
    let d = driver();
    let (s, t) = (new_stream(&d, 0), new_stream(&d, 0));
    let pool = Pool::new(d, Config::default()).unwrap();
    let x = pool.alloc_raw(0, 64 * MIB, s).unwrap();
    let keep = pool.alloc_raw(0, 2 * MIB, s).unwrap();
    pool.free_raw(x, s).unwrap();
    begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    // A block of T's that the capturing stream used: its event cannot be recorded on S during
    // the capture, so the block stays pending (not reused) until after it.
    let u = pool.alloc_raw(0, 4 * MIB, t).unwrap();
    pool.record_stream(u, s).unwrap();
    pool.free_raw(u, t).unwrap();
    let u2 = pool.alloc_raw(0, 4 * MIB, t).unwrap();
    assert_ne!(
        u2, u,
        "a block the capturing stream used was reused during its capture"
    );
    // T needs more than new memory leaves: S's cached pages are the rest.
    let y = pool.alloc_raw(0, 80 * MIB, t);
    check(&pool);
    assert_eq!(
        end_capture(s),
        CUDA_SUCCESS,
        "the pool's calls invalidated the capture"
    );
    after_capture(&pool, vec![(keep, s), (u2, t)], y, t);
}

/// The tail of the tests whose growth on `t` looked at a capturing stream's cached pages:
/// that growth (`y`) may have run out of memory during the capture; after it, another 80 MiB
/// on `t` is served (those pages are now seen idle and taken), and everything is drained.
fn after_capture(
    pool: &Pool<CudaDriver>,
    mut live: Vec<(u64, StreamId)>,
    y: cistern::Result<u64>,
    t: StreamId,
) {
    match y {
        Ok(y) => live.push((y, t)),
        Err(e) => assert!(e.is_oom(), "{e}"),
    }
    let z = pool.alloc_raw(0, 80 * MIB, t).unwrap();
    live.push((z, t));
    drain(pool, live);
}

/// The legacy stream while a blocking stream captures a graph: naming it (`cuStreamGetId`),
/// recording an event on it or ordering it after another would each be an implicit dependency
/// on the capture, which the driver refuses and which breaks the capture (driver 580,
/// `capture_rules.py`). cistern asks `cuStreamIsCapturing` of it, which answers without harm,
/// and treats it as a capturing stream: allocations on it are served, its frees wait until
/// after the capture, its cached pages are not known to be idle; the capture stays valid.
#[test]
fn the_legacy_stream_beside_a_blocking_capture_keeps_the_capture_valid() {
    run_child(
        "child_legacy_beside_capture",
        &[("CISTERN_FAKECUDA_CAPACITY", "160MiB")],
    );
}

#[test]
#[ignore = "child process of the_legacy_stream_beside_a_blocking_capture_keeps_the_capture_valid"]
fn child_legacy_beside_capture() {
    use cudarc::driver::sys::{CUresult::*, CUstreamCaptureMode::*};
    if !is_child("child_legacy_beside_capture") {
        return;
    }
    for (mode, legacy) in [
        (CU_STREAM_CAPTURE_MODE_GLOBAL, StreamId::LEGACY),
        (CU_STREAM_CAPTURE_MODE_RELAXED, StreamId::DEFAULT),
    ] {
        let d = driver();
        // Both created blocking (flags 0): the legacy stream synchronises with them.
        let (s, t) = (new_stream(&d, 0), new_stream(&d, 0));
        let pool = Pool::new(d, Config::default()).unwrap();
        // Cached on the legacy stream: a small block (for its allocations during the capture,
        // which leave the large one whole) and a large one (for T's growth to look at).
        let small = pool.alloc_raw(0, MIB / 2, legacy).unwrap();
        let keep = pool.alloc_raw(0, 2 * MIB, legacy).unwrap();
        let x = pool.alloc_raw(0, 64 * MIB, legacy).unwrap();
        pool.free_raw(small, legacy).unwrap();
        pool.free_raw(x, legacy).unwrap();
        let used = pool.alloc_raw(0, 4 * MIB, t).unwrap();
        pool.record_stream(used, legacy).unwrap();
        begin_capture(s, mode);
        // Allocations on the legacy stream, a free there, and reuse, also through its other
        // handle (the null handle and CU_STREAM_LEGACY are one stream, with one arena).
        let a = pool.alloc_raw(0, MIB / 2, legacy).unwrap();
        let reserved = stat(&pool, "reserved_bytes.all.current");
        pool.free_raw(a, legacy).unwrap();
        let other = if legacy == StreamId::LEGACY {
            StreamId::DEFAULT
        } else {
            StreamId::LEGACY
        };
        let a2 = pool.alloc_raw(0, MIB / 2, other).unwrap();
        assert_eq!(
            a2, a,
            "the legacy stream's other handle did not reuse its block"
        );
        assert_eq!(stat(&pool, "reserved_bytes.all.current"), reserved);
        // A block of T's that the legacy stream used: no event can be recorded there now.
        pool.free_raw(used, t).unwrap();
        let u2 = pool.alloc_raw(0, 4 * MIB, t).unwrap();
        assert_ne!(
            u2, used,
            "a block the legacy stream used was reused while its use could not be ordered"
        );
        // T needs more than new memory leaves: the legacy stream's cached pages are the rest.
        let y = pool.alloc_raw(0, 80 * MIB, t);
        check(&pool);
        assert_eq!(
            end_capture(s),
            CUDA_SUCCESS,
            "the pool's calls on the legacy stream invalidated the capture ({mode:?}, {legacy:?})"
        );
        after_capture(&pool, vec![(keep, legacy), (a2, legacy), (u2, t)], y, t);
    }
}

/// A synchronisation of the device while a graph capture is under way invalidates it, in
/// every capture mode (`cuCtxSynchronize`, driver 580). A free whose block a destroyed stream
/// used needs one (no event can be recorded there), and so does `empty_cache` for it: while a
/// capture is seen under way the backend refuses them, the block stays pending, the capture
/// stays valid, and the block comes back with the first synchronisation after it. Three
/// captures: a blocking stream's that cistern never met (the legacy stream reveals it), in
/// global mode; a non-blocking stream's that cistern meets by allocating on it during the
/// capture, in relaxed mode (where the synchronisation is as fatal); and one of a non-blocking
/// stream used before its capture, whose allocation during it is served from the thread's
/// cache without a driver call (the pool asks its streams before synchronising).
#[test]
fn a_device_synchronisation_waits_for_a_capture_to_end() {
    let stderr = run_child(
        "child_sync_beside_capture",
        &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")],
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
#[ignore = "child process of a_device_synchronisation_waits_for_a_capture_to_end"]
fn child_sync_beside_capture() {
    use cudarc::driver::sys::{CUresult::*, CUstreamCaptureMode::*};
    if !is_child("child_sync_beside_capture") {
        return;
    }
    // Whether cistern meets the capturing stream: never, during the capture, before it.
    for (flags, mode, meet) in [
        (0, CU_STREAM_CAPTURE_MODE_GLOBAL, 0),
        (1, CU_STREAM_CAPTURE_MODE_RELAXED, 1),
        (1, CU_STREAM_CAPTURE_MODE_RELAXED, 2),
    ] {
        let d = driver();
        let (a, gone, s) = (
            new_stream(&d, 0),
            new_stream(&d, 0),
            new_stream_flags(&d, 0, flags),
        );
        let pool = Pool::new(d, Config::default()).unwrap();
        let p = pool.alloc_raw(0, 8 * MIB, a).unwrap();
        pool.record_stream(p, gone).unwrap();
        destroy_stream(gone);
        if meet == 2 {
            let warm = pool.alloc_raw(0, MIB, s).unwrap();
            pool.free_raw(warm, s).unwrap();
        }
        begin_capture(s, mode);
        let mut live = Vec::new();
        if meet > 0 {
            // An allocation on the capturing stream: its first (the backend is asked what the
            // stream is), or one served from the cache the warm-up left.
            let devices = stat(&pool, "num_device_alloc");
            live.push((pool.alloc_raw(0, MIB, s).unwrap(), s));
            if meet == 2 {
                assert_eq!(stat(&pool, "num_device_alloc"), devices);
            }
        }
        pool.free_raw(p, a).unwrap();
        pool.empty_cache();
        check(&pool);
        assert_eq!(
            capture_status(s),
            1,
            "the pool's calls invalidated the capture ({mode:?}, flags {flags}, meet {meet})"
        );
        assert_eq!(
            pool.driver().device_synchronize(0).map_err(|e| e.code),
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as i32),
            "a device synchronisation was not refused during the capture (flags {flags})"
        );
        assert_eq!(
            end_capture(s),
            CUDA_SUCCESS,
            "a device synchronisation invalidated the capture ({mode:?}, flags {flags})"
        );
        // After the capture: synchronised at last, the block is free again and serves A.
        pool.empty_cache();
        check(&pool);
        let q = pool.alloc_raw(0, 8 * MIB, a).unwrap();
        live.push((q, a));
        drain(&pool, live);
        destroy_stream(s);
        destroy_stream(a);
    }
}

/// An out-of-memory error names, beside the processes using cistern, those NVML lists on the
/// GPU without a cistern record (a process that does not use cistern: here `sleep`), with the
/// memory NVML counts for them and their command line, and says what NVML counts for this
/// process, as PyTorch's OOM message does. Not when NVML does not list this process: its pids
/// are then another pid namespace's (a container's view), which cannot be told from ours.
#[test]
fn an_oom_names_the_processes_nvml_lists() {
    run_child("child_oom_nvml", &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")]);
}

#[test]
#[ignore = "child process of an_oom_names_the_processes_nvml_lists"]
fn child_oom_nvml() {
    if !is_child("child_oom_nvml") {
        return;
    }
    struct Sleeper(std::process::Child);
    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let other = Sleeper(Command::new("sleep").arg("60").spawn().unwrap());
    let (me, pid) = (std::process::id(), other.0.id());
    // Until its exec is complete its command line reads empty (`spawn` may return before).
    let started = std::time::Instant::now();
    while std::fs::read(format!("/proc/{pid}/cmdline")).map_or(true, |c| c.is_empty()) {
        assert!(started.elapsed().as_secs() < 10, "sleep did not start");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let dir = std::env::temp_dir().join(format!("cistern-oom-nvml-{me}"));
    std::fs::create_dir_all(&dir).unwrap();
    let nvml = dir.join("nvml.json");
    // The fake driver's GPU, as NVML would list it.
    let uuid = "GPU-5157a1d0-0000-4000-8000-000000000000";
    let write = |processes: &str| {
        let doc = format!(r#"{{"gpus": [{{"uuid": "{uuid}", "processes": [{processes}]}}]}}"#);
        std::fs::write(&nvml, doc).unwrap();
    };
    write(&format!(
        r#"{{"pid": {me}, "used_bytes": {}}}, {{"pid": {pid}, "used_bytes": {}}}"#,
        300 * MIB,
        512 * MIB
    ));
    std::env::set_var("CISTERN_FAKE_NVML", &nvml);
    let config = Config::parse("registry:off").unwrap();
    let oom = |pool: &Pool<CudaDriver>, s: StreamId| {
        let e = pool.alloc_raw(0, 2 * GIB, s).unwrap_err();
        assert!(e.is_oom(), "{e}");
        e.to_string()
    };

    let d = driver();
    let s = new_stream(&d, 0);
    let pool = Pool::new(d, config.clone()).unwrap();
    let text = oom(&pool, s);
    assert!(
        text.contains(&format!(
            "    pid {pid:>7}     512.0 MiB  sleep 60  [NVML; no cistern record]"
        )),
        "{text}"
    );
    assert!(
        text.contains("  this process, as NVML counts it: 300.0 MiB"),
        "{text}"
    );
    let last = pool
        .device(0)
        .unwrap()
        .last_oom()
        .expect("a last OOM report");
    assert_eq!(last.process_nvml_bytes, Some(300 * MIB));
    assert_eq!(
        last.other_processes
            .iter()
            .map(|p| (p.pid, p.nvml_only))
            .collect::<Vec<_>>(),
        [(pid, true)]
    );
    drop(pool);

    // NVML's list without this process: nothing of it is used.
    write(&format!(r#"{{"pid": {pid}, "used_bytes": {}}}"#, 512 * MIB));
    let d = driver();
    let s = new_stream(&d, 0);
    let pool = Pool::new(d, config).unwrap();
    let text = oom(&pool, s);
    assert!(!text.contains("NVML"), "{text}");
    assert!(!text.contains("other processes on this device"), "{text}");
    drop(pool);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A block used by a stream destroyed before the free: the driver can say nothing of that
/// stream (not even whether it captures), no event can be recorded there, and the free waits
/// for the device instead; the block comes back, and nothing is left at the end.
#[test]
fn a_use_by_a_destroyed_stream_does_not_pin_its_block() {
    run_child(
        "child_destroyed_use",
        &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")],
    );
}

#[test]
#[ignore = "child process of a_use_by_a_destroyed_stream_does_not_pin_its_block"]
fn child_destroyed_use() {
    use cudarc::driver::sys::{self, CUresult::*};
    if !is_child("child_destroyed_use") {
        return;
    }
    let d = driver();
    let (a, gone) = (new_stream(&d, 0), new_stream(&d, 0));
    let pool = Pool::new(d, Config::default()).unwrap();
    let p = pool.alloc_raw(0, 8 * MIB, a).unwrap();
    pool.record_stream(p, gone).unwrap();
    // SAFETY: a stream the fake created, destroyed once; the pool is not told
    // (forget_stream), as a careless caller would not.
    assert_eq!(
        unsafe { sys::cuStreamDestroy_v2(gone.0 as usize as sys::CUstream) },
        CUDA_SUCCESS
    );
    pool.free_raw(p, a).unwrap();
    check(&pool);
    assert_eq!(stat(&pool, "allocated_bytes.all.current"), 0);
    let q = pool.alloc_raw(0, 8 * MIB, a).unwrap();
    assert_eq!(q, p, "the block stayed pending");
    drain(&pool, vec![(q, a)]);
}

/// Found on a GPU (driver 580): the driver refuses `cuStreamGetId` of a capturing stream, in
/// every mode, and invalidates the capture, so growth on the capturing stream (which resolves
/// its stream) broke every `torch.cuda.graph` that allocated. Now a capturing stream is named by
/// its handle: in each mode, a stream the pool first meets inside its capture grows there (on
/// first use, past its cache, with a free another stream used), the capture stays valid, and
/// after it the same stream's next growth finds its real id and goes on.
#[test]
fn growth_on_a_capturing_stream_keeps_the_capture_valid() {
    run_child(
        "child_capture_growth",
        &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")],
    );
}

#[test]
#[ignore = "child process of growth_on_a_capturing_stream_keeps_the_capture_valid"]
fn child_capture_growth() {
    use cudarc::driver::sys::{CUresult::*, CUstreamCaptureMode::*};
    if !is_child("child_capture_growth") {
        return;
    }
    let d = driver();
    let other = new_stream(&d, 0);
    let pool = Pool::new(d, Config::default()).unwrap();
    let mut live = Vec::new();
    for mode in [
        CU_STREAM_CAPTURE_MODE_GLOBAL,
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CU_STREAM_CAPTURE_MODE_RELAXED,
    ] {
        let sn = new_stream(pool.driver(), 0);
        begin_capture(sn, mode);
        let a = pool.alloc_raw(0, 3 * MIB, sn).unwrap();
        let b = pool.alloc_raw(0, 40 * MIB, sn).unwrap();
        // A use by its own stream (met by handle) is none; one by a stream outside the capture
        // is an event there, queried at the next allocation (the other stream has no work:
        // the block is free again at once).
        pool.record_stream(b, sn).unwrap();
        pool.record_stream(a, other).unwrap();
        pool.free_raw(a, sn).unwrap();
        let c = pool.alloc_raw(0, 3 * MIB, sn).unwrap();
        assert_eq!(c, a);
        check(&pool);
        assert_eq!(
            end_capture(sn),
            CUDA_SUCCESS,
            "the pool's calls invalidated the {mode:?} capture"
        );
        // After the capture: the stream has its id again.
        let e = pool.alloc_raw(0, 64 * MIB, sn).unwrap();
        check(&pool);
        live.extend([(b, sn), (c, sn), (e, sn)]);
    }
    drain(&pool, live);
}

/// A graph pool over the real backend under the fake's strict capture rules: a capture that
/// forks a side stream, allocates, frees a block the side stream used (its event must wait for
/// the capture's end: an event recorded on a capturing stream is a captured event, which no
/// query may touch) and allocates again, grows on a stream outside the capture meanwhile, and
/// ends valid; then the pool's memory stays apart from the rest until released.
#[test]
fn a_graph_pool_keeps_a_forked_capture_valid() {
    run_child("child_graph_pool", &[("CISTERN_FAKECUDA_CAPACITY", "1GiB")]);
}

#[test]
#[ignore = "child process of a_graph_pool_keeps_a_forked_capture_valid"]
fn child_graph_pool() {
    use cudarc::driver::sys::{self, CUresult::*};
    use std::sync::Arc;
    if !is_child("child_graph_pool") {
        return;
    }
    let d = driver();
    let (sa, sb, sc) = (new_stream(&d, 0), new_stream(&d, 0), new_stream(&d, 0));
    let pool = Pool::new(d, Config::default()).unwrap();
    let dev = pool.device(0).unwrap();
    let id = cistern::MempoolId(1, 0);
    // Before the capture: a free on sc waiting on sb's work, and cached memory on sc.
    let p = pool.alloc_raw(0, 8 * MIB, sc).unwrap();
    pool.record_stream(p, sb).unwrap();
    pool.free_raw(p, sc).unwrap();
    let q = pool.alloc_raw(0, 32 * MIB, sc).unwrap();
    pool.free_raw(q, sc).unwrap();

    let (a, b) = (
        sa.0 as usize as sys::CUstream,
        sb.0 as usize as sys::CUstream,
    );
    let mut fork: sys::CUevent = std::ptr::null_mut();
    let mut join: sys::CUevent = std::ptr::null_mut();
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    let filter: cistern::StreamFilter = Arc::new(move |s: StreamId| Ok(s == sa || s == sb));
    dev.begin_allocate_to_pool(id, Some(filter));
    // SAFETY: streams the fake created, live events created here, valid enum values; the
    // primary context is current on this thread for the events, and popped at the end.
    unsafe {
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
        assert_eq!(sys::cuEventCreate(&mut fork, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuEventCreate(&mut join, 0), CUDA_SUCCESS);
        let global = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        assert_eq!(sys::cuStreamBeginCapture_v2(a, global), CUDA_SUCCESS);
        // The side stream joins the capture.
        assert_eq!(sys::cuEventRecord(fork, a), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamWaitEvent(b, fork, 0), CUDA_SUCCESS);
    }
    let x = pool.alloc_raw(0, 16 * MIB, sa).unwrap();
    let y = pool.alloc_raw(0, 4 * MIB, sb).unwrap();
    pool.record_stream(x, sb).unwrap();
    pool.free_raw(x, sa).unwrap();
    let z = pool.alloc_raw(0, 16 * MIB, sa).unwrap();
    assert_ne!(z, x, "a block the side stream may still use was reused");
    // A stream outside the capture grows past its cache and polls its pending free.
    let o = pool.alloc_raw(0, 64 * MIB, sc).unwrap();
    pool.free_raw(o, sc).unwrap();
    pool.empty_cache();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: as above; `graph` is a live, writable CUgraph.
    unsafe {
        assert_eq!(sys::cuEventRecord(join, b), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamWaitEvent(a, join, 0), CUDA_SUCCESS);
        let r = sys::cuStreamEndCapture(a, &mut graph);
        assert_eq!(r, CUDA_SUCCESS, "the pool's calls invalidated the capture");
        assert_eq!(sys::cuGraphDestroy(graph), CUDA_SUCCESS);
    }
    dev.end_allocate_to_pool(id).unwrap();
    check(&pool);
    // Outside the window the graph's memory is not handed out.
    let pools: Vec<(u64, u64)> = dev
        .segments_snapshot()
        .into_iter()
        .filter(|s| s.pool_id == (1, 0))
        .map(|s| (s.address, s.address + s.total_size))
        .collect();
    assert!(!pools.is_empty());
    let w = pool.alloc_raw(0, 16 * MIB, sa).unwrap();
    assert!(pools.iter().all(|&(lo, hi)| w + 16 * MIB <= lo || w >= hi));
    dev.release_pool(id).unwrap();
    // SAFETY: events created above, no longer used.
    unsafe {
        assert_eq!(sys::cuEventDestroy_v2(fork), CUDA_SUCCESS);
        assert_eq!(sys::cuEventDestroy_v2(join), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(std::ptr::null_mut()), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
    }
    drain(&pool, vec![(y, sb), (z, sa), (w, sa)]);
}

// ---- sharing between processes ----------------------------------------------------------------

/// `cisternFakeOrigin` of `ptr`: (process, handle or allocation there, offset in it).
fn origin(ptr: u64) -> (u64, u64, u64) {
    type Origin = unsafe extern "C" fn(u64, *mut u64, *mut u64, *mut u64) -> u32;
    // SAFETY: the fake libcuda.so.1 is already loaded (the driver opened it); the hook has this
    // signature (the fake's README) and writes three integers through live locals.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").expect("libcuda.so.1");
        let f: libloading::Symbol<Origin> = lib.get(b"cisternFakeOrigin\0").expect("the hook");
        let (mut p, mut a, mut o) = (0, 0, 0);
        assert_eq!(f(ptr, &mut p, &mut a, &mut o), 0, "origin of {ptr:#x}");
        (p, a, o)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn blocks_are_shared_with_another_process() {
    run_child("child_share_receiver", &[("CISTERN_FAKECUDA_DEVICES", "2")]);
}

/// A receiver whose own pool is `vmm:false` still maps VMM memory (the device supports it),
/// as PyTorch's receiver does whatever its own setting.
#[test]
fn a_vmm_false_receiver_opens_vmm_memory() {
    run_child(
        "child_share_receiver",
        &[
            ("CISTERN_FAKECUDA_DEVICES", "2"),
            ("SHARE_RECEIVER_CONF", "vmm:false"),
        ],
    );
}

#[test]
fn linear_blocks_are_shared_through_cuda_ipc() {
    run_child("child_share_receiver", &[("CISTERN_FAKECUDA_VMM", "0")]);
}

/// The sender: shares blocks of several sizes (VMM: whole chunks, blocks across chunks, a
/// block on chunks of mixed sizes), prints each as PyTorch's bytes with where its memory is,
/// and keeps them live until the receiver says it is done.
#[test]
#[ignore = "child process of child_share_receiver"]
fn child_share_sender() {
    if !is_child("child_share_sender") {
        return;
    }
    use cistern::ipc::{encode, TorchFormat};
    use std::io::BufRead;
    let d = driver();
    let s = new_stream(&d, 0);
    let pool = Pool::new(d, Config::parse("grow_whole_chunks:off").unwrap()).unwrap();
    let mut live = Vec::new();
    for size in [4096, 3 * MIB, 30 * MIB, 100 * MIB] {
        live.push((pool.alloc_raw(0, size, s).unwrap(), size));
    }
    // Chunks of two sizes under one block: a 20 MiB chunk freed, then a larger block that takes
    // it and grows past it.
    let big = pool.alloc_raw(0, 20 * MIB, s).unwrap();
    pool.free_raw(big, s).unwrap();
    live.push((pool.alloc_raw(0, 26 * MIB, s).unwrap(), 26 * MIB));
    let mut formats = [TorchFormat::V1, TorchFormat::V3].into_iter().cycle();
    for &(p, size) in &live {
        for at in [p, p + size / 2] {
            let (dev, share) = pool.share(at).unwrap();
            assert_eq!(dev, 0);
            let (pid, alloc, off) = origin(at);
            assert_eq!(pid, u64::from(std::process::id()));
            let bytes = encode(&share.memory, formats.next().unwrap());
            println!("SHARE {} {} {pid} {alloc} {off}", hex(&bytes), share.offset);
        }
    }
    println!("READY");
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "DONE");
    drain(&pool, live.into_iter().map(|(p, _)| (p, s)).collect());
}

/// The receiver: starts the sender as its child (so that `pidfd_getfd` is allowed even under
/// Yama's ptrace_scope 1), opens each shared block and checks that its pointer is the
/// sender's memory at the sender's offset.
#[test]
#[ignore = "child process of blocks_are_shared_with_another_process"]
fn child_share_receiver() {
    if !is_child("child_share_receiver") {
        return;
    }
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    let exe = std::env::current_exe().unwrap();
    let mut sender = Command::new(exe)
        .args([
            "child_share_sender",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "child_share_sender")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sender.stdout.take().unwrap()).lines();
    let mut shares = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        // libtest's "test child_share_sender ... " may begin the first line.
        if line.ends_with("READY") {
            break;
        }
        if let Some(rest) = line.find("SHARE ").map(|i| &line[i + 6..]) {
            let f: Vec<&str> = rest.split(' ').collect();
            let n = |i: usize| f[i].parse::<u64>().unwrap();
            shares.push((unhex(f[0]), n(1), (n(2), n(3), n(4))));
        }
    }
    assert_eq!(shares.len(), 10, "the sender shared ten pointers");
    let d = driver();
    let conf = std::env::var("SHARE_RECEIVER_CONF").unwrap_or_default();
    let pool = Pool::new(d, Config::parse(&conf).unwrap()).unwrap();
    // What the sender shares: VMM memory where the device supports it (the sender's pool uses
    // VMM then), whatever this pool's own setting.
    let vmm = pool.device(0).unwrap().caps().vmm;
    let mut opened = Vec::new();
    let mut ranges = Vec::new();
    let mut kinds = std::collections::BTreeSet::new();
    for (bytes, offset, sent) in &shares {
        let memory = cistern::ipc::decode(bytes).unwrap();
        kinds.insert(bytes[1]);
        let base = pool.open_shared(0, &memory).unwrap();
        ranges.push((base, memory.len()));
        assert_eq!(origin(base + offset), *sent, "{memory:?} + {offset}");
        // The range's last byte is the sender's too.
        if vmm {
            let last = base + memory.len() - 1;
            assert_eq!(origin(last).0, sent.0);
        }
        opened.push(base);
    }
    // PyTorch's formats where the handles are uniform, cistern's where they are not.
    if vmm {
        assert!(kinds.contains(&b'e') && kinds.contains(&b'v'), "{kinds:?}");
    } else {
        assert_eq!(kinds.into_iter().collect::<Vec<_>>(), vec![b'c']);
    }
    if vmm {
        // A peer granted afterwards reaches the opened ranges too: work of device 1 on them
        // is no illegal address.
        let s1 = new_stream(pool.driver(), 1);
        pool.enable_peer_access(0, 1).unwrap();
        type Launch = unsafe extern "C" fn(u64, u64, usize) -> u32;
        type Complete = unsafe extern "C" fn(u64) -> u32;
        // SAFETY: the fake is loaded; the hooks have these signatures (the fake's README), and
        // the stream and ranges are live.
        unsafe {
            let lib = libloading::Library::new("libcuda.so.1").unwrap();
            let launch: libloading::Symbol<Launch> = lib.get(b"cisternFakeLaunch\0").unwrap();
            let complete: libloading::Symbol<Complete> = lib.get(b"cisternFakeComplete\0").unwrap();
            for &(base, len) in &ranges {
                assert_eq!(launch(s1.0, base, len as usize), 0, "device 1 on {base:#x}");
            }
            assert_eq!(complete(s1.0), 0);
        }
    }
    // What the registry publishes: the bytes mapped from the sender, each physical handle once
    // however often it was opened, alone or under several ranges (CUDA IPC opens name no
    // process).
    let dev = pool.device(0).unwrap();
    if vmm {
        let mut distinct = std::collections::HashSet::new();
        let mut senders = std::collections::HashSet::new();
        for (bytes, _, _) in &shares {
            if let cistern::ipc::Shared::Handles { pid, handles } =
                cistern::ipc::decode(bytes).unwrap()
            {
                senders.insert(pid);
                distinct.extend(handles);
            }
        }
        assert_eq!(senders.len(), 1);
        let pid = senders.into_iter().next().unwrap();
        assert_ne!(pid, std::process::id());
        let total: u64 = distinct.iter().map(|h| h.1).sum();
        // With the sender's start time, read when the memory was opened (the sender runs).
        let start = cistern::registry::process_start_time(pid).ok();
        assert!(start.is_some());
        assert_eq!(
            dev.imported(),
            vec![cistern::Imported {
                from_pid: pid,
                from_start_time: start,
                bytes: total
            }]
        );
    } else {
        assert_eq!(dev.imported(), vec![]);
    }
    // Each pointer was opened once per share: the same description opened again is the same
    // range, counted; every open is closed.
    for base in opened {
        pool.close_shared(0, base).unwrap();
    }
    assert!(pool.close_shared(0, 0x1000).is_err());
    assert_eq!(
        dev.imported(),
        vec![],
        "nothing is mapped from the sender any more"
    );
    let info = pool.driver().mem_info(0).unwrap();
    assert_eq!(info.total - info.free, RESERVE, "opened memory left mapped");
    let mut stdin = sender.stdin.take().unwrap();
    writeln!(stdin, "DONE").unwrap();
    drop(stdin);
    for _ in lines {}
    assert!(sender.wait().unwrap().success(), "the sender failed");
}

/// Where the driver refuses exportable handles the device reports (some containers), growth
/// goes on with plain handles, and sharing says why it cannot and what to do.
#[test]
fn refused_exportable_handles_fall_back_to_plain_ones() {
    run_child("child_fd_refused", &[("CISTERN_FAKECUDA_FD_REFUSED", "1")]);
}

#[test]
#[ignore = "child process of refused_exportable_handles_fall_back_to_plain_ones"]
fn child_fd_refused() {
    if !is_child("child_fd_refused") {
        return;
    }
    let d = driver();
    assert!(d.capabilities(0).unwrap().posix_fd_handles);
    let s = new_stream(&d, 0);
    let pool = Pool::new(d, Config::default()).unwrap();
    let live: Vec<(u64, StreamId)> = [3 * MIB, 40 * MIB]
        .into_iter()
        .map(|size| (pool.alloc_raw(0, size, s).unwrap(), s))
        .collect();
    check(&pool);
    let e = pool.share(live[0].0).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && msg.contains("vmm:false"),
        "{msg}"
    );
    drain(&pool, live);
}
