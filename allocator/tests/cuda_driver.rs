//! The CUDA backend against whatever driver this machine has.
//!
//! Without `libcuda.so`, `CudaDriver::new()` must fail cleanly (no panic) with `NoDriver` and a
//! message naming the fix. With a driver and a GPU, the remaining tests exercise every call; on
//! machines without one they print `skipping: ...` and pass.

use std::sync::Arc;

use cistern::driver::cuda::{CudaDriver, CUDA_SYMBOLS};
use cistern::driver::{Driver, DriverCall, DriverErrorKind, EventId, StreamId};

/// The driver, or `None` (with a visible note) when this machine has no usable CUDA driver.
fn gpu(test: &str) -> Option<CudaDriver> {
    match CudaDriver::new() {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipping: {test}: no usable CUDA driver here ({e})");
            None
        }
    }
}

#[test]
fn new_fails_cleanly_without_a_driver() {
    match CudaDriver::new() {
        Ok(d) => eprintln!(
            "skipping: new_fails_cleanly_without_a_driver: a CUDA driver is present ({} device(s))",
            d.device_count().unwrap_or(0)
        ),
        Err(e) => {
            assert!(
                e.message.contains("CISTERN_DRIVER=sim"),
                "the error must name the fix: {e}"
            );
            assert!(
                e.message.contains("install the NVIDIA driver"),
                "the error must name the fix: {e}"
            );
            if e.message.starts_with("no CUDA driver (libcuda.so) found") {
                assert_eq!(e.kind, DriverErrorKind::NoDriver, "{e}");
                assert_eq!(e.call, DriverCall::DeviceCount);
                assert_eq!(
                    e.message,
                    "no CUDA driver (libcuda.so) found: install the NVIDIA driver, or set \
                     CISTERN_DRIVER=sim to run on the simulated GPU"
                );
            }
        }
    }
}

#[test]
fn new_can_be_retried_without_panicking() {
    for _ in 0..3 {
        let first = CudaDriver::new().map(|_| ());
        let again = CudaDriver::new().map(|_| ());
        assert_eq!(first.is_ok(), again.is_ok());
    }
}

#[test]
fn is_a_shareable_driver() {
    fn shareable<D: Driver + Send + Sync + 'static>() {}
    shareable::<CudaDriver>();
    shareable::<Arc<CudaDriver>>();
}

#[test]
fn symbols_name_the_versioned_entry_points() {
    for s in [
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemGetInfo_v2",
        "cuEventDestroy_v2",
    ] {
        assert!(CUDA_SYMBOLS.contains(&s), "{s}");
    }
    assert!(!CUDA_SYMBOLS.contains(&"cuMemAlloc"));
}

// ---- with a GPU ----

#[test]
fn gpu_devices_and_capabilities() {
    let Some(d) = gpu("gpu_devices_and_capabilities") else {
        return;
    };
    assert_eq!(d.name(), "cuda");
    let n = d.device_count().unwrap();
    assert!(n >= 1);
    for dev in 0..n {
        let caps = d.capabilities(dev).unwrap();
        assert!(caps.total_memory > 0, "{caps:?}");
        assert!(caps.vmm, "every supported GPU has VMM: {caps:?}");
        assert!(caps.granularity.is_power_of_two(), "{caps:?}");
        assert!(!caps.name.is_empty(), "{caps:?}");
        let uuid = caps.uuid.clone().expect("a UUID");
        assert!(uuid.starts_with("GPU-") && uuid.len() == 40, "{uuid}");
        assert_eq!(d.capabilities(dev).unwrap(), caps, "cached caps differ");
        let info = d.mem_info(dev).unwrap();
        assert!(info.free <= info.total && info.total > 0, "{info:?}");
        eprintln!("device {dev}: {caps:?} {info:?}");
    }
}

#[test]
fn gpu_out_of_range_devices_are_refused() {
    let Some(d) = gpu("gpu_out_of_range_devices_are_refused") else {
        return;
    };
    let n = d.device_count().unwrap();
    let kind = |r: Result<(), cistern::driver::DriverError>| r.unwrap_err().kind;
    assert_eq!(
        kind(d.capabilities(n).map(|_| ())),
        DriverErrorKind::InvalidDevice
    );
    assert_eq!(
        kind(d.mem_alloc(n, 1 << 20).map(|_| ())),
        DriverErrorKind::InvalidDevice
    );
    assert_eq!(
        kind(d.reserve_va(n + 7, 2 << 20, 2 << 20).map(|_| ())),
        DriverErrorKind::InvalidDevice
    );
    assert_eq!(
        kind(d.device_synchronize(usize::MAX)),
        DriverErrorKind::InvalidDevice
    );
}

#[test]
fn gpu_vmm_round_trip() {
    let Some(d) = gpu("gpu_vmm_round_trip") else {
        return;
    };
    let g = d.capabilities(0).unwrap().granularity;
    let va = d.reserve_va(0, 8 * g, g).unwrap();
    assert_ne!(va, 0);
    assert_eq!(va % g, 0);
    let a = d.create_physical(0, g).unwrap();
    let b = d.create_physical(0, 2 * g).unwrap();
    d.map(0, va, g, a).unwrap();
    d.map(0, va + g, 2 * g, b).unwrap();
    // One set_access may span several mappings.
    d.set_access(0, va, 3 * g, &[]).unwrap();
    // Mapping over a mapped range is refused.
    assert!(d.map(0, va, g, a).is_err());
    d.unmap(0, va + g, 2 * g).unwrap();
    d.unmap(0, va, g).unwrap();
    d.release_physical(0, a).unwrap();
    d.release_physical(0, b).unwrap();
    d.free_va(0, va, 8 * g).unwrap();
}

/// What a move ordered on the device relies on (Note [Moves ordered on the device] in
/// `pool/pages.rs`): one handle mapped at two addresses at once, access granted on both, and
/// either mapping unmapped while the other stays. (That work through one mapping is ordered
/// and undisturbed needs kernels: the PyTorch checks of `scripts/gpu-check.sh` cover it.)
#[test]
fn gpu_one_handle_at_two_addresses() {
    let Some(d) = gpu("gpu_one_handle_at_two_addresses") else {
        return;
    };
    let g = d.capabilities(0).unwrap().granularity;
    let old = d.reserve_va(0, 4 * g, g).unwrap();
    let new = d.reserve_va(0, 4 * g, g).unwrap();
    let h = d.create_physical(0, 2 * g).unwrap();
    d.map(0, old, 2 * g, h).unwrap();
    d.set_access(0, old, 2 * g, &[]).unwrap();
    d.map(0, new + g, 2 * g, h).unwrap();
    d.set_access(0, new + g, 2 * g, &[]).unwrap();
    d.unmap(0, old, 2 * g).unwrap();
    // The old range is free for another handle while the first stays mapped at the new one.
    let other = d.create_physical(0, 2 * g).unwrap();
    d.map(0, old, 2 * g, other).unwrap();
    d.set_access(0, old, 2 * g, &[]).unwrap();
    d.device_synchronize(0).unwrap();
    d.unmap(0, old, 2 * g).unwrap();
    d.unmap(0, new + g, 2 * g).unwrap();
    d.release_physical(0, other).unwrap();
    d.release_physical(0, h).unwrap();
    d.free_va(0, old, 4 * g).unwrap();
    d.free_va(0, new, 4 * g).unwrap();
}

#[test]
fn gpu_physical_memory_beyond_the_device_is_out_of_memory() {
    let Some(d) = gpu("gpu_physical_memory_beyond_the_device_is_out_of_memory") else {
        return;
    };
    let caps = d.capabilities(0).unwrap();
    let g = caps.granularity;
    let size = (caps.total_memory * 2).div_ceil(g) * g;
    let e = d.create_physical(0, size).unwrap_err();
    assert_eq!(e.call, DriverCall::CreatePhysical);
    assert!(e.is_oom(), "{e}");
    assert_eq!(e.code, 2, "{e}");
}

#[test]
fn gpu_linear_alloc_and_free() {
    let Some(d) = gpu("gpu_linear_alloc_and_free") else {
        return;
    };
    let p = d.mem_alloc(0, 3 << 20).unwrap();
    assert_ne!(p, 0);
    let q = d.mem_alloc(0, 512).unwrap();
    assert_ne!(p, q);
    d.mem_free(0, q).unwrap();
    d.mem_free(0, p).unwrap();
}

#[test]
fn gpu_events_on_the_default_stream() {
    let Some(d) = gpu("gpu_events_on_the_default_stream") else {
        return;
    };
    let ev = d.event_create(0).unwrap();
    assert_ne!(ev, EventId(0));
    // A fresh event has no work captured: it is complete.
    assert!(d.event_query(0, ev).unwrap());
    d.event_record(0, ev, StreamId::DEFAULT).unwrap();
    d.event_synchronize(0, ev).unwrap();
    assert!(d.event_query(0, ev).unwrap());
    d.stream_wait_event(0, StreamId::DEFAULT, ev).unwrap();
    d.device_synchronize(0).unwrap();
    d.event_destroy(0, ev).unwrap();
    // A null event is refused without reaching the driver.
    assert_eq!(
        d.event_query(0, EventId(0)).unwrap_err().kind,
        DriverErrorKind::InvalidValue
    );
}

#[test]
fn gpu_calls_from_many_threads() {
    let Some(d) = gpu("gpu_calls_from_many_threads") else {
        return;
    };
    let d = Arc::new(d);
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || {
                let dev = i % d.device_count().unwrap();
                for _ in 0..50 {
                    let p = d.mem_alloc(dev, 1 << 20).unwrap();
                    let ev = d.event_create(dev).unwrap();
                    d.event_record(dev, ev, StreamId::DEFAULT).unwrap();
                    d.event_synchronize(dev, ev).unwrap();
                    d.event_destroy(dev, ev).unwrap();
                    d.mem_free(dev, p).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// A stream of device 0 created with `flags` for the capture tests, with the device's primary
/// context (retained by `d` first) pushed and left current on this thread until
/// [`drop_capture_stream`].
fn capture_stream(d: &CudaDriver, flags: u32) -> cudarc::driver::sys::CUstream {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    d.mem_info(0).unwrap(); // retains device 0's primary context inside the driver
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: every pointer is a live local of the right type; `ctx` is the primary context the
    // driver returned, current on this thread until `drop_capture_stream`.
    unsafe {
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
        assert_eq!(sys::cuStreamCreate(&mut s, flags), CUDA_SUCCESS);
    }
    s
}

/// Destroys a [`capture_stream`] and pops and releases its context.
fn drop_capture_stream(s: cudarc::driver::sys::CUstream) {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    // SAFETY: the stream and context `capture_stream` made, no longer used.
    unsafe {
        assert_eq!(sys::cuStreamDestroy_v2(s), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxPopCurrent_v2(std::ptr::null_mut()), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
    }
}

/// Begins a capture of `s` (a stream of the caller's) in `mode`, which must succeed.
fn begin_capture(s: cudarc::driver::sys::CUstream, mode: cudarc::driver::sys::CUstreamCaptureMode) {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    // SAFETY: `s` is a live stream of the caller's; the mode is a valid enum value.
    let r = unsafe { sys::cuStreamBeginCapture_v2(s, mode) };
    assert_eq!(r, CUDA_SUCCESS, "beginning a {mode:?} capture");
}

/// Ends the capture of `s`, destroying the graph it made; what `cuStreamEndCapture` said.
fn end_capture(s: cudarc::driver::sys::CUstream) -> cudarc::driver::sys::CUresult {
    use cudarc::driver::sys::{self, CUresult::CUDA_SUCCESS};
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: `graph` is a live, writable CUgraph; `s` a stream of the caller's.
    let r = unsafe { sys::cuStreamEndCapture(s, &mut graph) };
    if !graph.is_null() {
        // SAFETY: the graph the capture returned, destroyed once.
        assert_eq!(unsafe { sys::cuGraphDestroy(graph) }, CUDA_SUCCESS);
    }
    r
}

/// While a stream captures a graph, resolving it must not break the capture: the driver
/// refuses `cuStreamGetId` of a capturing stream and invalidates the capture (driver 580,
/// `scripts/gpu/capture_rules.py`), so the backend names it by its handle, and says it is
/// capturing; the stream's own id comes back once the capture is over.
#[test]
fn gpu_a_capturing_stream_is_resolved_without_breaking_the_capture() {
    use cudarc::driver::sys::{CUresult::CUDA_SUCCESS, CUstreamCaptureMode::*};
    let Some(d) = gpu("gpu_a_capturing_stream_is_resolved_without_breaking_the_capture") else {
        return;
    };
    let s = capture_stream(&d, 1);
    let stream = StreamId(s as usize as u64);
    let before = d.stream_info(0, stream).unwrap();
    assert!(!before.capturing);
    assert_eq!(d.stream_capturing(0, stream), Ok(false));
    for mode in [
        CU_STREAM_CAPTURE_MODE_GLOBAL,
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CU_STREAM_CAPTURE_MODE_RELAXED,
    ] {
        begin_capture(s, mode);
        let during = d.stream_info(0, stream).unwrap();
        assert!(during.capturing, "{mode:?}");
        assert_eq!(during.id, cistern::driver::CAPTURING_ID | stream.0);
        assert_eq!(during.device, 0);
        assert_eq!(d.stream_capturing(0, stream), Ok(true));
        assert_eq!(d.stream_capturing(0, StreamId::DEFAULT), Ok(false));
        assert_eq!(
            end_capture(s),
            CUDA_SUCCESS,
            "resolving the stream invalidated the {mode:?} capture"
        );
        assert_eq!(d.stream_info(0, stream).unwrap(), before);
    }
    drop_capture_stream(s);
}

/// Whether this is the child process that runs the test `name` alone: if not, runs it there
/// (this test binary again, filtered to it), checks it passed, and returns false. For tests
/// whose capture would break, or be broken by, other tests' use of the legacy stream and the
/// device.
fn in_child(name: &str) -> bool {
    const CHILD: &str = "CISTERN_CUDA_DRIVER_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("the test binary runs again");
    // Its words (a "skipping: ..." among them) reach this test's output.
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the child process failed: {:?}",
        out.status
    );
    false
}

/// A device synchronisation (`cuCtxSynchronize`) invalidates a capture under way in every
/// mode, from any thread (driver 580, `scripts/gpu/capture_rules.py`). The backend refuses it
/// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) while it can see a capture: a blocking stream's,
/// which the legacy stream reveals, or that of a stream it found capturing before; the capture
/// stays valid, and after it the device synchronises again. A stream it was told is gone
/// (`forget_stream`) is not asked of. In a process of its own: the captures would refuse the
/// other tests' synchronisations.
#[test]
fn gpu_a_device_synchronisation_is_refused_during_a_capture() {
    use cudarc::driver::sys::{CUresult::*, CUstreamCaptureMode::*};
    const NAME: &str = "gpu_a_device_synchronisation_is_refused_during_a_capture";
    if !in_child(NAME) {
        return;
    }
    let Some(d) = gpu(NAME) else {
        return;
    };
    for flags in [0, 1] {
        let s = capture_stream(&d, flags);
        let id = StreamId(s as usize as u64);
        for mode in [
            CU_STREAM_CAPTURE_MODE_GLOBAL,
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CU_STREAM_CAPTURE_MODE_RELAXED,
        ] {
            begin_capture(s, mode);
            if flags == 1 {
                // A non-blocking stream's capture: seen once the backend has met it.
                assert_eq!(d.stream_capturing(0, id), Ok(true));
            }
            let e = d.device_synchronize(0).unwrap_err();
            assert_eq!(
                e.code, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as i32,
                "flags {flags} {mode:?}: {e}"
            );
            assert!(e.message.contains("capturing a CUDA graph"), "{e}");
            assert_eq!(
                end_capture(s),
                CUDA_SUCCESS,
                "the refused synchronisation invalidated the {mode:?} capture (flags {flags})"
            );
            d.device_synchronize(0).unwrap();
        }
        if flags == 1 {
            // A stream the backend was told is gone is not asked of: the backend does not
            // refuse the synchronisation; the driver does, and the capture is broken.
            begin_capture(s, CU_STREAM_CAPTURE_MODE_RELAXED);
            assert_eq!(d.stream_capturing(0, id), Ok(true));
            d.forget_stream(id);
            let e = d.device_synchronize(0).unwrap_err();
            assert!(e.message.starts_with("cuCtxSynchronize"), "{e}");
            assert_eq!(end_capture(s), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        drop_capture_stream(s);
    }
}

/// While a *blocking* stream captures, every use of the legacy stream (an event record, a
/// stream wait, even `cuStreamGetId`) is an implicit dependency on the capture, refused and
/// invalidating it (driver 580, `scripts/gpu/capture_rules.py`). The backend asks
/// `cuStreamIsCapturing` instead, which answers without harm, and reports the legacy stream
/// (and the null handle naming it) as capturing, named by its handle; once the capture is over
/// it resolves as before.
///
/// It runs in a process of its own: during the capture every other thread's use of the legacy
/// stream would fail too (the other tests of this file use it).
#[test]
fn gpu_the_legacy_stream_beside_a_blocking_capture_is_reported_capturing() {
    use cudarc::driver::sys::{CUresult::CUDA_SUCCESS, CUstreamCaptureMode::*};
    const NAME: &str = "gpu_the_legacy_stream_beside_a_blocking_capture_is_reported_capturing";
    if !in_child(NAME) {
        return;
    }
    let Some(d) = gpu(NAME) else {
        return;
    };
    // Flags 0: a blocking stream, which the legacy stream synchronises with.
    let s = capture_stream(&d, 0);
    let before = d.stream_info(0, StreamId::LEGACY).unwrap();
    assert!(!before.capturing);
    for mode in [
        CU_STREAM_CAPTURE_MODE_GLOBAL,
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CU_STREAM_CAPTURE_MODE_RELAXED,
    ] {
        begin_capture(s, mode);
        for legacy in [StreamId::LEGACY, StreamId::DEFAULT] {
            assert_eq!(
                d.stream_capturing(0, legacy),
                Ok(true),
                "{mode:?} {legacy:?}"
            );
            let during = d.stream_info(0, legacy).unwrap();
            assert!(during.capturing, "{mode:?} {legacy:?}");
            // The null handle and CU_STREAM_LEGACY are one stream: one id.
            assert_eq!(
                during.id,
                cistern::driver::CAPTURING_ID | StreamId::LEGACY.0
            );
        }
        // The per-thread stream does not synchronise with other blocking streams.
        assert_eq!(d.stream_capturing(0, StreamId::PER_THREAD), Ok(false));
        assert_eq!(
            end_capture(s),
            CUDA_SUCCESS,
            "asking about the legacy stream invalidated the {mode:?} capture"
        );
        assert_eq!(d.stream_info(0, StreamId::LEGACY).unwrap(), before);
        assert_eq!(d.stream_capturing(0, StreamId::LEGACY), Ok(false));
    }
    drop_capture_stream(s);
}
