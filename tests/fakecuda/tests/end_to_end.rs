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
const A: StreamId = StreamId(0x1000);
const B: StreamId = StreamId(0x2000);

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
        info.free, info.total,
        "driver memory left after empty_cache"
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
    assert_eq!((info.free, info.total), (GIB, GIB));

    let pool = Pool::new(d, Config::default()).unwrap();
    assert!(pool.device(0).unwrap().uses_vmm());

    // Swiss cheese: 40 × (20 MiB + 2 MiB), every other 20 MiB block freed.
    let mut live = Vec::new();
    let mut big = Vec::new();
    for _ in 0..40 {
        big.push(pool.alloc_raw(0, 20 * MIB, A).unwrap());
        live.push((pool.alloc_raw(0, 2 * MIB, A).unwrap(), A));
    }
    for (i, p) in big.into_iter().enumerate() {
        if i % 2 == 0 {
            pool.free_raw(p, A).unwrap();
        } else {
            live.push((p, A));
        }
    }
    check(&pool);
    assert_eq!(stat(&pool, "allocated_bytes.all.current"), 480 * MIB as i64);
    // 300 MiB from the holes, stitched: no new physical memory.
    let device_allocs = stat(&pool, "num_device_alloc");
    let p = pool.alloc_raw(0, 300 * MIB, A).unwrap();
    assert_eq!(stat(&pool, "num_device_alloc"), device_allocs);
    assert!(stat(&pool, "num_stitches") >= 1);
    live.push((p, A));
    check(&pool);

    // record_stream: the block is reused only after B's work (none here) completes.
    let q = pool.alloc_raw(0, 4 * MIB, A).unwrap();
    pool.record_stream(q, B).unwrap();
    pool.free_raw(q, A).unwrap();
    assert_eq!(stat(&pool, "num_record_streams"), 1);
    let r = pool.alloc_raw(0, 4 * MIB, A).unwrap();
    live.push((r, A));
    check(&pool);

    // OOM is a typed error with a report, and the pool stays consistent.
    let e = pool.alloc_raw(0, 2 * GIB, A).unwrap_err();
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

    let pool = Pool::new(d, Config::default()).unwrap();
    assert!(!pool.device(0).unwrap().uses_vmm());
    let mut live = Vec::new();
    for (i, size) in [512, 4096, MIB, 3 * MIB, 20 * MIB, 100 * MIB]
        .into_iter()
        .enumerate()
    {
        let s = if i % 2 == 0 { A } else { B };
        live.push((pool.alloc_raw(0, size, s).unwrap(), s));
    }
    check(&pool);
    let (p, s) = live.pop().unwrap();
    pool.record_stream(p, A).unwrap();
    pool.free_raw(p, s).unwrap();
    live.push((pool.alloc_raw(0, 100 * MIB, B).unwrap(), B));
    check(&pool);
    let e = pool.alloc_raw(0, GIB, A).unwrap_err();
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
    let pool = Pool::new(driver(), Config::default()).unwrap();
    // The first cuMemCreate (one 2 MiB page) succeeds; every later one fails with
    // CUDA_ERROR_OUT_OF_MEMORY.
    let p = pool.alloc_raw(0, 2 * MIB, A).unwrap();
    let e = pool.alloc_raw(0, 500 * MIB, A).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    check(&pool);
    assert!(stat(&pool, "num_ooms") >= 1);
    // What was allocated still works, and its memory can be reused.
    pool.free_raw(p, A).unwrap();
    let q = pool.alloc_raw(0, 2 * MIB, A).unwrap();
    drain(&pool, vec![(q, A)]);
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
    let pool = Pool::new(driver(), Config::default()).unwrap();
    // The first capability query (cuDeviceGetAttribute) fails: no device pool, a typed error.
    match pool.alloc_raw(0, MIB, A) {
        Err(Error::Driver(e)) => {
            assert_eq!(e.call, DriverCall::Capabilities, "{e}");
            assert_eq!(e.code, 999, "{e}");
        }
        other => panic!("expected a driver error, got {other:?}"),
    }
    // The first cuMemMap fails with CUDA_ERROR_UNKNOWN: an error or a recovered allocation,
    // never a crash, and the pool stays consistent.
    let mut live = Vec::new();
    match pool.alloc_raw(0, 8 * MIB, A) {
        Ok(p) => live.push((p, A)),
        Err(Error::Driver(e)) => {
            assert_eq!(e.call, DriverCall::Map, "{e}");
            assert_eq!(e.code, 999, "{e}");
        }
        Err(e) => panic!("unexpected error {e}"),
    }
    check(&pool);
    assert!(stat(&pool, "num_driver_errors") >= 1);
    live.push((pool.alloc_raw(0, 8 * MIB, A).unwrap(), A));
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
    let pool = Pool::new(driver(), Config::default()).unwrap();
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
    let a = pool.alloc_raw(0, 10 * MIB, A).unwrap();
    let b = pool.alloc_raw(1, 10 * MIB, A).unwrap();
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
    pool.free_raw(b, A).unwrap();
    pool.empty_cache();
    assert_eq!(pool.driver().mem_info(1).unwrap().free, 512 * MIB);
    drain(&pool, vec![(a, A)]);
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
    let pool = Arc::new(Pool::new(driver(), Config::default()).unwrap());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                let s = StreamId(0x100 * (t + 1));
                let other = StreamId(0x100 * (((t + 1) % 4) + 1));
                let mut live = Vec::new();
                let mut x = t + 1;
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
