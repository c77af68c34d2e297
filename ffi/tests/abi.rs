//! The exports of the built `libcistern.so`, loaded with libloading as a C program or PyTorch
//! (ctypes) would use them, on the simulated GPU (`CISTERN_DRIVER=sim`, 10 devices, so that
//! tests that count exactly use a device of their own).
//!
//! Tests named `child_*` run only in a child process that `run_child` starts with its own
//! environment (the library reads its environment once, when its pool is created).

mod common;

use std::ffi::{c_char, c_int, c_void, CString};
use std::process::Command;
use std::ptr;
use std::sync::{Mutex, MutexGuard};

use common::{Abi, Stream};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const CAPACITY: usize = 80 * GIB;

/// Whether this process is a child started by `run_child`.
fn is_child() -> bool {
    std::env::var_os("CISTERN_ABI_CHILD").is_some()
}

/// The library on the simulator, and a lock that runs the tests one at a time (the snapshot
/// covers every device, and the error log is shared).
fn abi() -> (&'static Abi, MutexGuard<'static, ()>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    assert!(!is_child(), "a parent test runs in the parent only");
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let abi = common::load_with_env(&[
        ("CISTERN_DRIVER", "sim"),
        ("CISTERN_SIM", "devices:10"),
        ("CISTERN_CONF", "registry:off"),
    ]);
    (abi, guard)
}

fn stream(n: usize) -> Stream {
    n as *mut c_void
}

fn malloc(abi: &Abi, size: usize, dev: c_int, s: Stream) -> *mut c_void {
    // SAFETY: the export's documented types.
    unsafe { (abi.malloc)(size, dev, s) }
}

fn free(abi: &Abi, p: *mut c_void, size: usize, dev: c_int, s: Stream) {
    // SAFETY: the export's documented types; invalid pointers are part of its contract.
    unsafe { (abi.free)(p, size, dev, s) }
}

/// Runs test `name` of this binary in a child process with `env` (and nothing else of
/// cistern's environment); returns its output after checking that it passed.
fn run_child(name: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("CISTERN_ABI_CHILD", "1")
        .env("CISTERN_LIB", common::library_path())
        .env_remove("CISTERN_DRIVER")
        .env_remove("CISTERN_SIM")
        // No record in the user's registry unless a test asks (its env comes after).
        .env("CISTERN_CONF", "registry:off");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the child test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {name} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child {name} did not run:\n{text}"
    );
    text
}

#[test]
fn version_and_a_fresh_threads_last_error() {
    let (abi, _g) = abi();
    // SAFETY: a static NUL-terminated string.
    let v = unsafe { std::ffi::CStr::from_ptr((abi.version)()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    let fresh = std::thread::scope(|s| s.spawn(|| abi.last_error()).join().unwrap());
    assert_eq!(fresh, "", "a thread that made no failed call has no error");
}

#[test]
fn stats_json_follows_snprintf() {
    let (abi, _g) = abi();
    let p = malloc(abi, 1000, 1, stream(0));
    assert!(!p.is_null());
    let call = |buf: *mut c_char, cap: usize| {
        // SAFETY: callers pass a buffer of at least `cap` bytes.
        unsafe { (abi.stats_json)(1, buf, cap) }
    };
    let full = abi.json(call);
    let need = full.len();
    assert!(full.starts_with('{') && full.ends_with('}'));
    assert!(
        full.contains("\"allocated_bytes.all.current\":1024"),
        "{full}"
    );

    // cap 0: nothing written, even with a buffer.
    let mut buf = vec![b'x'; need + 8];
    assert_eq!(call(buf.as_mut_ptr().cast(), 0), need);
    assert!(buf.iter().all(|&b| b == b'x'));
    // NULL buffer with cap 0.
    assert_eq!(call(ptr::null_mut(), 0), need);
    // cap 1: only the NUL.
    assert_eq!(call(buf.as_mut_ptr().cast(), 1), need);
    assert_eq!(buf[0], 0);
    assert_eq!(buf[1], b'x');
    // A small cap: a prefix of cap - 1 bytes and a NUL, nothing past cap.
    buf.fill(b'x');
    assert_eq!(call(buf.as_mut_ptr().cast(), 10), need);
    assert_eq!(&buf[..9], &full.as_bytes()[..9]);
    assert_eq!(buf[9], 0);
    assert_eq!(buf[10], b'x');
    // cap == need: one byte short, truncated.
    buf.fill(b'x');
    assert_eq!(call(buf.as_mut_ptr().cast(), need), need);
    assert_eq!(&buf[..need - 1], &full.as_bytes()[..need - 1]);
    assert_eq!(buf[need - 1], 0);
    assert_eq!(buf[need], b'x');
    // cap == need + 1: exactly enough.
    buf.fill(b'x');
    assert_eq!(call(buf.as_mut_ptr().cast(), need + 1), need);
    assert_eq!(&buf[..need], full.as_bytes());
    assert_eq!(buf[need], 0);
    assert_eq!(buf[need + 1], b'x');

    free(abi, p, 1000, 1, stream(0));
    assert_eq!(abi.stat(1, "allocated_bytes.all.current"), 0);
}

#[test]
fn snapshot_json_follows_snprintf() {
    let (abi, _g) = abi();
    let p = malloc(abi, 5 * MIB, 7, stream(0x70));
    let call = |buf: *mut c_char, cap: usize| {
        // SAFETY: callers pass a buffer of at least `cap` bytes.
        unsafe { (abi.snapshot_json)(buf, cap) }
    };
    let full = abi.json(call);
    let need = full.len();
    let mut buf = vec![b'x'; need + 2];
    assert_eq!(call(buf.as_mut_ptr().cast(), 0), need);
    assert_eq!(buf[0], b'x');
    assert_eq!(call(buf.as_mut_ptr().cast(), 16), need);
    assert_eq!(&buf[..15], &full.as_bytes()[..15]);
    assert_eq!((buf[15], buf[16]), (0, b'x'));
    assert_eq!(call(buf.as_mut_ptr().cast(), need), need);
    assert_eq!(buf[need - 1], 0);
    assert_eq!(call(buf.as_mut_ptr().cast(), need + 1), need);
    assert_eq!(&buf[..need], full.as_bytes());
    assert_eq!(buf[need], 0);
    free(abi, p, 5 * MIB, 7, stream(0x70));
}

#[test]
fn snapshot_is_in_pytorchs_schema() {
    let (abi, _g) = abi();
    let s = stream(0x77);
    let small = malloc(abi, 1000, 7, s);
    let large = malloc(abi, 3 * MIB + 7, 7, s);
    let gone = malloc(abi, 4096, 7, s);
    free(abi, gone, 4096, 7, s);
    let snap = abi.snapshot();
    assert_eq!(snap["device_traces"].as_array().unwrap().len(), 10);
    let segs: Vec<_> = snap["segments"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["device"] == 7)
        .collect();
    assert!(!segs.is_empty());
    let mut found = std::collections::HashMap::new();
    for seg in &segs {
        for key in [
            "address",
            "total_size",
            "allocated_size",
            "active_size",
            "requested_size",
            "stream",
            "segment_type",
            "segment_pool_id",
            "is_expandable",
            "frames",
            "blocks",
        ] {
            assert!(seg.get(key).is_some(), "segment lacks {key}: {seg}");
        }
        assert_eq!(seg["stream"], 0x77);
        // Blocks tile the segment (what `_memory_viz.segsum` asserts).
        let mut at = seg["address"].as_u64().unwrap();
        let mut allocated = 0;
        for b in seg["blocks"].as_array().unwrap() {
            assert_eq!(b["address"].as_u64().unwrap(), at);
            at += b["size"].as_u64().unwrap();
            let state = b["state"].as_str().unwrap();
            assert!(
                ["active_allocated", "active_pending_free", "inactive"].contains(&state),
                "{state}"
            );
            if state == "active_allocated" {
                allocated += b["size"].as_u64().unwrap();
            }
            found.insert(b["address"].as_u64().unwrap(), b.clone());
        }
        assert_eq!(
            at,
            seg["address"].as_u64().unwrap() + seg["total_size"].as_u64().unwrap()
        );
        assert_eq!(seg["allocated_size"].as_u64().unwrap(), allocated);
    }
    let b = &found[&(small as u64)];
    assert_eq!(
        (&b["state"], &b["size"], &b["requested_size"]),
        (&"active_allocated".into(), &1024.into(), &1000.into())
    );
    let b = &found[&(large as u64)];
    assert_eq!(b["requested_size"], 3 * MIB + 7);
    assert_eq!(b["size"], 3 * MIB + 512);
    if let Some(b) = found.get(&(gone as u64)) {
        assert_eq!(b["state"], "inactive");
    }
    free(abi, small, 1000, 7, s);
    free(abi, large, 3 * MIB + 7, 7, s);
}

#[test]
fn base_alloc_of_an_interior_pointer() {
    let (abi, _g) = abi();
    let p = malloc(abi, 3000, 2, stream(0));
    let mut size = 0usize;
    // SAFETY: `size` is a live usize.
    let base = unsafe { (abi.base_alloc)(p.cast::<u8>().add(1000).cast(), &mut size) };
    // VMM (the default): the allocation itself.
    assert_eq!(base, p);
    assert_eq!(size, 3072);
    // SAFETY: NULL size is allowed.
    assert_eq!(unsafe { (abi.base_alloc)(p, ptr::null_mut()) }, p);
    free(abi, p, 3000, 2, stream(0));
    // A freed or unknown pointer: NULL and size 0.
    size = 7;
    // SAFETY: as above.
    assert!(unsafe { (abi.base_alloc)(p, &mut size) }.is_null());
    assert_eq!(size, 0);
    assert!(
        abi.last_error().contains("cistern_base_alloc"),
        "{}",
        abi.last_error()
    );
    // SAFETY: as above.
    assert!(unsafe { (abi.base_alloc)(0x10 as *mut c_void, &mut size) }.is_null());
}

#[test]
fn base_alloc_with_linear_segments_is_the_segment() {
    if is_child() {
        return;
    }
    run_child(
        "child_linear_segments",
        &[
            ("CISTERN_DRIVER", "sim"),
            ("CISTERN_CONF", "vmm:false,registry:off"),
        ],
    );
}

#[test]
fn child_linear_segments() {
    if !is_child() {
        return;
    }
    let abi = common::load_with_env(&[]);
    let a = malloc(abi, 4096, 0, stream(0));
    let b = malloc(abi, 4096, 0, stream(0));
    let mut size = 0usize;
    // SAFETY: `size` is a live usize.
    let base = unsafe { (abi.base_alloc)(b.cast::<u8>().add(100).cast(), &mut size) };
    // Small requests share a 2 MiB cuMemAlloc segment: the base is the segment's.
    assert_eq!(size, 2 * MIB, "{}", abi.last_error());
    assert!(base <= a.min(b) && (b as usize) < base as usize + size);
    free(abi, a, 4096, 0, stream(0));
    free(abi, b, 4096, 0, stream(0));
}

#[test]
fn python_frames_are_refused_outside_python() {
    let (abi, _g) = abi();
    // SAFETY: the export takes an int.
    assert_eq!(unsafe { (abi.python_frames)(1) }, -1);
    let err = abi.last_error();
    assert!(
        err.contains("no CPython 3.9 or later") && err.contains("only in a Python process"),
        "{err}"
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { (abi.python_frames)(0) },
        0,
        "off is always possible"
    );
}

#[test]
fn snapshot_blocks_carry_their_sampled_frames() {
    if is_child() {
        return;
    }
    run_child(
        "child_snapshot_frames",
        &[
            ("CISTERN_DRIVER", "sim"),
            (
                "CISTERN_CONF",
                "registry:off,provenance:stacks,stack_sample_rate:2",
            ),
        ],
    );
}

#[test]
fn child_snapshot_frames() {
    if !is_child() {
        return;
    }
    let abi = common::load_with_env(&[]);
    // One allocation in two carries a site (the first one included).
    let sampled = malloc(abi, 3 * MIB, 0, stream(0));
    let unsampled = malloc(abi, 3 * MIB, 0, stream(0));
    // SAFETY: `json` passes a buffer of the capacity it names.
    let text = abi.json(|b, c| unsafe { (abi.snapshot_json)(b, c) });
    let snap: serde_json::Value = serde_json::from_str(&text).unwrap();
    let block = |p: *mut c_void| {
        snap["segments"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s["blocks"].as_array().unwrap())
            .find(|b| b["address"].as_u64() == Some(p as u64))
            .unwrap_or_else(|| panic!("no block at {p:?}: {text}"))
            .clone()
    };
    let frames = block(sampled)["frames"].as_array().unwrap().clone();
    assert!(
        frames.iter().any(|f| {
            f["name"]
                .as_str()
                .unwrap()
                .contains("child_snapshot_frames")
                && f["filename"].as_str().unwrap().ends_with("abi.rs")
                && f["line"].as_u64().unwrap() > 0
        }),
        "{frames:?}"
    );
    assert_eq!(block(unsampled)["frames"], serde_json::json!([]));
    free(abi, sampled, 3 * MIB, 0, stream(0));
    free(abi, unsampled, 3 * MIB, 0, stream(0));
}

#[test]
fn record_stream_on_an_unknown_pointer_is_harmless() {
    let (abi, _g) = abi();
    // SAFETY: unknown pointers are part of the contract.
    unsafe { (abi.record_stream)(0x10 as *mut c_void, stream(5)) };
    assert!(
        abi.last_error().contains("cistern_record_stream"),
        "{}",
        abi.last_error()
    );
    // SAFETY: as above.
    unsafe { (abi.record_stream)(ptr::null_mut(), stream(5)) };
    // The pool still works, and a real record_stream on an interior pointer is accepted.
    let p = malloc(abi, 8192, 3, stream(0x30));
    assert!(!p.is_null());
    // SAFETY: `p + 100` is inside a live allocation.
    unsafe { (abi.record_stream)(p.cast::<u8>().add(100).cast(), stream(0x31)) };
    free(abi, p, 8192, 3, stream(0x30));
    assert_eq!(abi.stat(3, "allocation.all.current"), 0);
    assert!(abi.stat(3, "num_record_streams") >= 1);
}

#[test]
fn threads_allocate_and_free_concurrently() {
    let (abi, _g) = abi();
    const THREADS: usize = 8;
    const OPS: usize = 3000;
    std::thread::scope(|sc| {
        for t in 0..THREADS {
            sc.spawn(move || {
                // Half the threads share one stream, half have their own.
                let s = stream(if t % 2 == 0 { 0x400 } else { 0x400 + t });
                let mut seed = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t as u64 + 1);
                let mut live: Vec<(*mut c_void, usize)> = Vec::new();
                for _ in 0..OPS {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    if seed % 100 < 55 || live.is_empty() {
                        let size = [0, 1, 512, 4096, 100_000, 2 * MIB, 6 * MIB][seed as usize % 7];
                        let p = malloc(abi, size, 4, s);
                        assert_eq!(p.is_null(), size == 0, "{}", abi.last_error());
                        if !p.is_null() {
                            live.push((p, size));
                        }
                    } else {
                        let (p, size) = live.swap_remove(seed as usize % live.len());
                        free(abi, p, size, 4, s);
                    }
                }
                for (p, size) in live {
                    free(abi, p, size, 4, s);
                }
            });
        }
    });
    let st = abi.stats(4);
    assert_eq!(st["allocated_bytes.all.current"], 0);
    assert_eq!(st["allocation.all.current"], 0);
    assert_eq!(st["requested_bytes.all.current"], 0);
    assert_eq!(st["num_invalid_frees"], 0);
    assert_eq!(
        st["allocation.all.allocated"].as_i64(),
        st["allocation.all.freed"].as_i64()
    );
}

#[test]
fn an_impossible_request_is_null_with_an_oom_report() {
    let (abi, _g) = abi();
    let p = malloc(abi, 1 << 50, 5, stream(0));
    assert!(p.is_null());
    let e = abi.last_error();
    assert!(e.contains("out of memory"), "{e}");
    assert!(e.contains("device 5"), "{e}");
    assert!(abi.stat(5, "num_ooms") >= 1);
    // The driver's view at the failure, as PyTorch's OOM observers get it.
    let (mut free_b, mut total_b) = (0usize, 0usize);
    // SAFETY (each call): the export's documented types; both outputs are live usizes or NULL.
    unsafe {
        assert_eq!((abi.last_oom)(5, &mut free_b, &mut total_b), 1);
        assert_eq!((abi.last_oom)(5, ptr::null_mut(), ptr::null_mut()), 1);
        assert_eq!(
            (abi.last_oom)(9, &mut free_b, ptr::null_mut()),
            0,
            "device 9 never failed"
        );
        assert_eq!((abi.last_oom)(99, ptr::null_mut(), ptr::null_mut()), 0);
    }
    assert_eq!(total_b, CAPACITY);
    assert!(free_b > 0 && free_b <= CAPACITY, "{free_b}");
    // The pool stays healthy (ACCEPTANCE A.4).
    let q = malloc(abi, MIB, 5, stream(0));
    assert!(!q.is_null());
    free(abi, q, MIB, 5, stream(0));
    assert_eq!(abi.stat(5, "allocated_bytes.all.current"), 0);
}

#[test]
fn memory_fraction_limits_growth() {
    let (abi, _g) = abi();
    // SAFETY: the export's documented types.
    unsafe { (abi.set_memory_fraction)(0.5, 8) };
    let big = malloc(abi, CAPACITY / 2 - CAPACITY / 100, 8, stream(0));
    assert!(!big.is_null(), "{}", abi.last_error());
    free(abi, big, 0, 8, stream(0));
    assert!(malloc(abi, CAPACITY * 6 / 10, 8, stream(0)).is_null());
    assert!(
        abi.last_error().contains("out of memory"),
        "{}",
        abi.last_error()
    );
    assert_eq!(abi.stat(8, "memory_limit"), (CAPACITY / 2) as i64);
    // SAFETY (each call): the export's documented types; bad devices are part of its contract.
    unsafe {
        assert_eq!((abi.get_memory_fraction)(8), 0.5);
        assert_eq!(
            (abi.get_memory_fraction)(7),
            1.0,
            "another device's limit changed"
        );
        assert_eq!((abi.get_memory_fraction)(99), -1.0);
    }
    assert!(abi.last_error().contains("99"), "{}", abi.last_error());
    // Out of range: refused, nothing changes.
    // SAFETY: as above.
    unsafe { (abi.set_memory_fraction)(1.5, 8) };
    assert!(
        abi.last_error().contains("outside [0, 1]"),
        "{}",
        abi.last_error()
    );
    assert_eq!(abi.stat(8, "memory_limit"), (CAPACITY / 2) as i64);
    // SAFETY: as above.
    unsafe {
        (abi.set_memory_fraction)(1.0, 8);
        (abi.empty_cache)();
    }
    assert_eq!(abi.stat(8, "reserved_bytes.all.current"), 0);
}

#[test]
fn enable_peer_access_grants_or_says_why_not() {
    let (abi, _g) = abi();
    let p = malloc(abi, 8 << 20, 3, stream(0));
    assert!(!p.is_null());
    // SAFETY (each call): the export's documented types; bad ordinals are part of its contract.
    let enable = |dev, peer| unsafe { (abi.enable_peer_access)(dev, peer) };
    assert_eq!(enable(3, 4), 1, "{}", abi.last_error());
    assert_eq!(enable(3, 4), 1, "granting twice is fine");
    assert_eq!(enable(3, 3), 0);
    assert!(
        abi.last_error().contains("own device"),
        "{}",
        abi.last_error()
    );
    assert_eq!(enable(3, 99), 0);
    assert!(abi.last_error().contains("99"), "{}", abi.last_error());
    assert_eq!(enable(3, -1), 0);
    assert!(
        abi.last_error().contains("negative"),
        "{}",
        abi.last_error()
    );
    assert_eq!(enable(-2, 1), 0);
    free(abi, p, 8 << 20, 3, stream(0));
}

/// The filter of the graph-pool test: accepts the stream its context names.
unsafe extern "C" fn only_stream(ctx: *mut c_void, s: Stream) -> c_int {
    std::ptr::eq(ctx, s) as c_int
}

/// Counts the releases of filter contexts.
static RELEASED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn count_release(_ctx: *mut c_void) {
    RELEASED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// Whether the snapshot puts `p` in a segment of graph pool `(a, b)`.
fn in_pool(abi: &Abi, p: *mut c_void, a: u64, b: u64) -> bool {
    let snap = abi.snapshot();
    snap["segments"].as_array().unwrap().iter().any(|s| {
        let lo = s["address"].as_u64().unwrap();
        let hi = lo + s["total_size"].as_u64().unwrap();
        let id = &s["segment_pool_id"];
        (lo..hi).contains(&(p as u64)) && id[0] == a && id[1] == b
    })
}

#[test]
fn graph_pools_route_a_windows_streams_and_release_their_filters() {
    let (abi, _g) = abi();
    use std::sync::atomic::Ordering::SeqCst;
    let dev = 9;
    let released = RELEASED.load(SeqCst);
    // SAFETY (each call): the exports' documented types; bad ids are part of their contract.
    let begin = |d, a, b| unsafe {
        (abi.begin_allocate_to_pool)(
            d,
            a,
            b,
            Some(only_stream),
            7 as *mut c_void,
            Some(count_release),
        )
    };
    let end = |d, a, b| unsafe { (abi.end_allocate_to_pool)(d, a, b) };
    let release = |d, a, b| unsafe { (abi.release_pool)(d, a, b) };
    assert_eq!(begin(dev, 4, 0), 1, "{}", abi.last_error());
    let inside = malloc(abi, MIB, dev, stream(7));
    let outside = malloc(abi, MIB, dev, stream(8));
    assert!(!inside.is_null() && !outside.is_null());
    assert!(in_pool(abi, inside, 4, 0), "not served from the graph pool");
    assert!(!in_pool(abi, outside, 4, 0), "a stream the filter refused");
    assert_eq!(
        RELEASED.load(SeqCst),
        released,
        "released while the window is open"
    );
    assert_eq!(end(dev, 4, 0), 1, "{}", abi.last_error());
    assert_eq!(
        RELEASED.load(SeqCst),
        released + 1,
        "the window's filter was not released"
    );
    // Freed, the block stays the graph's: the same stream outside a window gets other memory.
    free(abi, inside, MIB, dev, stream(7));
    let after = malloc(abi, MIB, dev, stream(7));
    assert_ne!(after, inside);
    assert!(!in_pool(abi, after, 4, 0));
    assert_eq!(end(dev, 4, 0), 0);
    assert!(
        abi.last_error().contains("begin_allocate_to_pool"),
        "{}",
        abi.last_error()
    );
    // SAFETY: the export's documented types.
    let empty_pool = |a, b| unsafe { (abi.empty_pool_cache)(a, b) };
    let reserved = || abi.stat(dev, "reserved_bytes.all.current");
    let before = reserved();
    assert_eq!(empty_pool(4, 0), 1, "{}", abi.last_error());
    assert_eq!(reserved(), before, "a pool in use gave its memory back");
    assert_eq!(release(dev, 4, 0), 1, "{}", abi.last_error());
    assert_eq!(empty_pool(4, 0), 1, "{}", abi.last_error());
    assert!(reserved() < before, "the released pool's cache stayed");
    assert_eq!(release(dev, 4, 0), 0);
    assert!(
        abi.last_error().contains("no graph pool (4, 0)"),
        "{}",
        abi.last_error()
    );
    // MemPool's bookkeeping: a use without a window.
    // SAFETY (each call): the exports' documented types.
    let uses = |d, a, b| unsafe { (abi.pool_use_count)(d, a, b) };
    assert_eq!(uses(dev, 0, 3), 0);
    // SAFETY: as above.
    assert_eq!(unsafe { (abi.create_or_incref_pool)(dev, 0, 3) }, 1);
    assert_eq!(uses(dev, 0, 3), 1);
    // MemPool(use_on_oom=True): only for a pool that exists (served blocks: suite graphs).
    // SAFETY: as above.
    let use_on_oom = |d, a, b, on| unsafe { (abi.set_use_on_oom)(d, a, b, on) };
    assert_eq!(use_on_oom(dev, 0, 3, 1), 1, "{}", abi.last_error());
    assert_eq!(use_on_oom(dev, 0, 3, 0), 1, "{}", abi.last_error());
    assert_eq!(use_on_oom(dev, 0, 4, 1), 0);
    assert!(
        abi.last_error().contains("no graph pool (0, 4)"),
        "{}",
        abi.last_error()
    );
    assert_eq!(use_on_oom(99, 0, 3, 1), 0);
    assert_eq!(release(dev, 0, 3), 1);
    assert_eq!(uses(dev, 0, 3), 0);
    assert_eq!(uses(99, 0, 3), -1);
    // SAFETY: as above; a bad device is part of the contract.
    assert_eq!(unsafe { (abi.create_or_incref_pool)(99, 0, 3) }, 0);
    // A failed call releases the context at once.
    assert_eq!(begin(99, 4, 0), 0);
    assert!(abi.last_error().contains("99"), "{}", abi.last_error());
    assert_eq!(RELEASED.load(SeqCst), released + 2);
    // NULL filter and release: every stream is routed.
    // SAFETY: as above.
    let r = unsafe { (abi.begin_allocate_to_pool)(dev, 0, 9, None, ptr::null_mut(), None) };
    assert_eq!(r, 1);
    let any = malloc(abi, MIB, dev, stream(8));
    assert!(in_pool(abi, any, 0, 9));
    assert_eq!(
        release(dev, 0, 9),
        1,
        "releasing the pool closes its window"
    );
    for (p, s) in [(after, 7), (outside, 8), (any, 8)] {
        free(abi, p, MIB, dev, stream(s));
    }
    // A MemPool's segment given back: its memory goes back to the driver at once.
    let seg = malloc(abi, 64 * MIB, dev, stream(7));
    assert!(
        abi.stats(dev)["reserved_bytes.all.current"]
            .as_u64()
            .unwrap()
            >= 64 * MIB as u64
    );
    // SAFETY: a pointer from cistern_malloc, freed once.
    unsafe { (abi.free_and_release)(seg, 64 * MIB, dev, stream(7)) };
    let st = abi.stats(dev);
    assert_eq!(st["allocated_bytes.all.current"], 0);
    assert_eq!(st["reserved_bytes.all.current"], 0, "cached memory kept");
}

/// What `cistern_pool_restore` reported: (allocated, ptr, size, stream) per block.
unsafe extern "C" fn note_restored(
    ctx: *mut c_void,
    allocated: c_int,
    ptr: *mut c_void,
    size: usize,
    stream: *mut c_void,
) {
    // SAFETY: the test passes a live Vec as the context.
    let v = unsafe { &mut *(ctx as *mut Vec<(c_int, usize, usize, usize)>) };
    v.push((allocated, ptr as usize, size, stream as usize));
}

/// CUDA graph trees' checkpoints through the C ABI: the live blocks, a checkpoint, and a
/// restore that reports the blocks it freed and made live again (their requested sizes and
/// streams); NULL and unknown pools are errors.
#[test]
fn graph_pool_checkpoints_restore_through_the_abi() {
    let (abi, _g) = abi();
    let dev = 8;
    // SAFETY (each call): the exports' documented types; bad ids are part of their contract.
    let begin =
        |a, b| unsafe { (abi.begin_allocate_to_pool)(dev, a, b, None, ptr::null_mut(), None) };
    let end = |a, b| unsafe { (abi.end_allocate_to_pool)(dev, a, b) };
    let live = |a, b| {
        let mut v = vec![ptr::null_mut(); 8];
        // SAFETY: room for 8 pointers.
        let n = unsafe { (abi.pool_live_blocks)(dev, a, b, v.as_mut_ptr(), v.len()) };
        v.truncate(n.max(0) as usize);
        (n, v.into_iter().map(|p| p as usize).collect::<Vec<_>>())
    };
    assert_eq!(begin(6, 0), 1, "{}", abi.last_error());
    let a = malloc(abi, 3 * MIB, dev, stream(5));
    let b = malloc(abi, 5 * MIB + 1, dev, stream(5));
    assert_eq!(end(6, 0), 1);
    // SAFETY: as above.
    let cp = unsafe { (abi.pool_checkpoint)(dev, 6, 0) };
    assert!(!cp.is_null(), "{}", abi.last_error());
    free(abi, b, 5 * MIB + 1, dev, stream(5));
    assert_eq!(live(6, 0), (1, vec![a as usize]));
    // SAFETY: a NULL buffer with no room only counts.
    assert_eq!(
        unsafe { (abi.pool_live_blocks)(dev, 6, 0, ptr::null_mut(), 0) },
        1
    );

    let mut seen: Vec<(c_int, usize, usize, usize)> = Vec::new();
    // SAFETY: a live checkpoint; the callback and its context follow the contract.
    let ok =
        unsafe { (abi.pool_restore)(cp, Some(note_restored), &mut seen as *mut _ as *mut c_void) };
    assert_eq!(ok, 1, "{}", abi.last_error());
    let s5 = stream(5) as usize;
    assert_eq!(
        seen,
        vec![
            (0, a as usize, 0, 0),
            (1, a as usize, 3 * MIB, s5),
            (1, b as usize, 5 * MIB + 1, s5)
        ]
    );
    let mut both = vec![a as usize, b as usize];
    both.sort_unstable();
    assert_eq!(live(6, 0), (2, both));
    // SAFETY: as above; NULL is an error, not a crash.
    assert_eq!(
        unsafe { (abi.pool_restore)(ptr::null(), None, ptr::null_mut()) },
        0
    );
    assert!(abi.last_error().contains("NULL"), "{}", abi.last_error());
    // SAFETY: as above.
    assert!(unsafe { (abi.pool_checkpoint)(dev, 7, 7) }.is_null());
    assert!(
        abi.last_error().contains("no graph pool (7, 7)"),
        "{}",
        abi.last_error()
    );
    assert_eq!(live(7, 7).0, -1);
    free(abi, a, 3 * MIB, dev, stream(5));
    free(abi, b, 5 * MIB + 1, dev, stream(5));
    // SAFETY: as above.
    assert_eq!(unsafe { (abi.release_pool)(dev, 6, 0) }, 1);
    // A checkpoint of a released pool: an error naming it.
    // SAFETY: the checkpoint is still live.
    assert_eq!(unsafe { (abi.pool_restore)(cp, None, ptr::null_mut()) }, 0);
    assert!(
        abi.last_error().contains("no graph pool (6, 0)"),
        "{}",
        abi.last_error()
    );
    // SAFETY: freed once; NULL does nothing.
    unsafe {
        (abi.checkpoint_free)(cp);
        (abi.checkpoint_free)(ptr::null_mut());
    }
    assert_eq!(abi.stats(dev)["allocated_bytes.all.current"], 0);
}

/// With `cistern_abort_on_failure`, a failed allocation aborts the process with the report
/// instead of returning NULL (for PyTorch's pluggable mode without the OOM shim).
#[test]
fn abort_on_failure_aborts_with_the_report_instead_of_null() {
    use std::os::unix::process::ExitStatusExt;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "child_abort_on_failure",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("CISTERN_ABI_CHILD", "1")
    .env("CISTERN_LIB", common::library_path())
    .env("CISTERN_DRIVER", "sim")
    .env("CISTERN_SIM", "capacity:1GiB")
    .env("CISTERN_CONF", "registry:off");
    let out = cmd.output().expect("run the child test");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(6), "not aborted: {out:?}");
    assert!(
        err.contains("out of memory") && err.contains("aborting"),
        "{err}"
    );
    assert!(
        err.contains("REACHED"),
        "the switch off was not honoured: {err}"
    );
}

#[test]
fn child_abort_on_failure() {
    if !is_child() {
        return;
    }
    let abi = common::load_with_env(&[]);
    // SAFETY (each call): the export's documented types.
    unsafe {
        assert_eq!((abi.abort_on_failure)(1), 0);
        assert_eq!((abi.abort_on_failure)(0), 1);
    }
    assert!(
        malloc(abi, 4 * GIB, 0, stream(0)).is_null(),
        "NULL while it is off"
    );
    eprintln!("REACHED");
    // SAFETY: as above.
    unsafe { (abi.abort_on_failure)(1) };
    let p = malloc(abi, 4 * GIB, 0, stream(0));
    panic!("returned {p:p} instead of aborting");
}

#[test]
fn stats_count_as_pytorch_does_and_peaks_reset() {
    // ACCEPTANCE E.20 and E.24, through the JSON.
    let (abi, _g) = abi();
    let s = stream(0x60);
    let ten = 10 * MIB;
    let mut live: Vec<_> = (0..10).map(|_| malloc(abi, ten, 6, s)).collect();
    for p in live.iter().step_by(2) {
        free(abi, *p, ten, 6, s);
    }
    live = live.into_iter().skip(1).step_by(2).collect();
    let st = abi.stats(6);
    let get = |st: &serde_json::Map<_, _>, k: &str| st[k].as_i64().unwrap() as usize;
    assert_eq!(get(&st, "allocated_bytes.all.current"), 50 * MIB);
    assert_eq!(get(&st, "allocation.all.current"), 5);
    assert_eq!(get(&st, "allocated_bytes.all.peak"), 100 * MIB);
    assert_eq!(get(&st, "allocation.all.peak"), 10);
    assert_eq!(get(&st, "allocated_bytes.all.allocated"), 100 * MIB);
    live.extend((0..10).map(|_| malloc(abi, ten, 6, s)));
    for p in live {
        free(abi, p, ten, 6, s);
    }
    let st = abi.stats(6);
    assert_eq!(get(&st, "allocated_bytes.all.current"), 0);
    assert_eq!(get(&st, "allocated_bytes.all.peak"), 150 * MIB);
    assert_eq!(get(&st, "allocation.all.peak"), 15);
    assert_eq!(get(&st, "allocated_bytes.all.allocated"), 200 * MIB);
    assert_eq!(get(&st, "allocation.all.allocated"), 20);
    // SAFETY: the export's documented types.
    unsafe { (abi.reset_peak_stats)(6) };
    let st = abi.stats(6);
    assert_eq!(get(&st, "allocated_bytes.all.peak"), 0);
    assert_eq!(
        get(&st, "reserved_bytes.all.peak"),
        get(&st, "reserved_bytes.all.current")
    );
}

#[test]
fn bad_devices_and_pointers_are_reported_not_fatal() {
    let (abi, _g) = abi();
    let before = abi.stat(0, "num_invalid_frees");
    let errors = abi.stat(0, "num_abi_errors");
    assert!(malloc(abi, 64, 10, stream(0)).is_null());
    assert!(
        abi.last_error().contains("invalid device 10"),
        "{}",
        abi.last_error()
    );
    assert!(malloc(abi, 64, -1, stream(0)).is_null());
    assert!(
        abi.last_error().contains("negative"),
        "{}",
        abi.last_error()
    );
    let mut buf = [b'x'; 4];
    // SAFETY: `buf` has 4 bytes.
    assert_eq!(
        unsafe { (abi.stats_json)(99, buf.as_mut_ptr().cast(), 4) },
        0
    );
    assert_eq!(buf[0], 0);
    // SAFETY: the export's documented types.
    unsafe { (abi.reset_peak_stats)(-3) };
    assert!(abi.last_error().contains("reset_peak_stats"));

    let p = malloc(abi, 4096, 0, stream(0));
    free(abi, p, 4096, 0, stream(0));
    free(abi, p, 4096, 0, stream(0)); // double free
    assert!(
        abi.last_error().contains("cistern_free"),
        "{}",
        abi.last_error()
    );
    free(abi, 0xdead_0000 as *mut c_void, 16, 0, stream(0)); // unknown
    free(abi, 0xdead_0001 as *mut c_void, 16, 0, stream(0)); // unaligned
    free(abi, ptr::null_mut(), 0, 0, stream(0)); // NULL: fine
    free(abi, p, 4096, 42, stream(0)); // bad device
    assert_eq!(abi.stat(0, "num_invalid_frees"), before + 3);
    assert!(abi.stat(0, "num_abi_errors") >= errors + 8);
    assert_eq!(abi.stat(0, "num_abi_panics"), 0);
    assert_eq!(abi.stat(0, "allocated_bytes.all.current"), 0);
}

#[test]
fn tags_survive_bad_input() {
    let (abi, _g) = abi();
    let bad_utf8 = b"\xff\xfeoptimizer\0";
    // SAFETY: NUL-terminated strings, and NULL, which the export refuses.
    unsafe {
        (abi.tag_push)(bad_utf8.as_ptr().cast());
        (abi.tag_push)(CString::new("forward").unwrap().as_ptr());
        (abi.tag_pop)();
        (abi.tag_pop)();
        (abi.tag_push)(ptr::null());
    }
    assert!(abi.last_error().contains("cistern_tag_push(NULL)"));
    // SAFETY: as above.
    unsafe { (abi.tag_pop)() };
    assert!(
        abi.last_error().contains("no tag to pop"),
        "{}",
        abi.last_error()
    );
    // Allocation goes on as before.
    let p = malloc(abi, 100, 0, stream(0));
    assert!(!p.is_null());
    free(abi, p, 100, 0, stream(0));
}

#[test]
fn a_missing_driver_is_reported_on_every_call() {
    if is_child() {
        return;
    }
    let out = run_child(
        "child_no_driver",
        &[("CISTERN_DRIVER", "cuda"), ("LD_LIBRARY_PATH", "")],
    );
    print!("{out}");
}

#[test]
fn child_no_driver() {
    if !is_child() {
        return;
    }
    let abi = common::load_with_env(&[]);
    // SAFETY: the export's documented types.
    unsafe { (abi.init)(1) };
    let e = abi.last_error();
    if e.is_empty() {
        eprintln!("SKIPPED child_no_driver: a CUDA driver is installed");
        return;
    }
    assert!(e.contains("CISTERN_DRIVER=sim"), "{e}");
    assert!(malloc(abi, 64, 0, stream(0)).is_null());
    free(abi, 0x1000 as *mut c_void, 64, 0, stream(0));
    // SAFETY: as above.
    unsafe {
        assert_eq!((abi.stats_json)(0, ptr::null_mut(), 0), 0);
        assert_eq!((abi.snapshot_json)(ptr::null_mut(), 0), 0);
        (abi.empty_cache)();
    }
    assert_eq!(
        abi.last_error(),
        e.replace("cistern_init", "cistern_empty_cache")
    );
    free(abi, ptr::null_mut(), 0, 0, stream(0));
}

#[test]
fn bad_settings_name_the_fix() {
    if is_child() {
        return;
    }
    run_child(
        "child_bad_conf",
        &[("CISTERN_DRIVER", "sim"), ("CISTERN_CONF", "bogus:1")],
    );
    run_child("child_bad_driver", &[("CISTERN_DRIVER", "opencl")]);
}

#[test]
fn child_bad_conf() {
    if !is_child() {
        return;
    }
    let abi = common::load_with_env(&[]);
    assert!(malloc(abi, 64, 0, stream(0)).is_null());
    let e = abi.last_error();
    assert!(e.contains("bogus") && e.contains("CISTERN_CONF"), "{e}");
}

#[test]
fn child_bad_driver() {
    if !is_child() {
        return;
    }
    let abi = common::load_with_env(&[]);
    assert!(malloc(abi, 64, 0, stream(0)).is_null());
    let e = abi.last_error();
    assert!(e.contains("opencl") && e.contains("sim"), "{e}");
}

/// `CISTERN_SIM=devices:4294967295` used to abort the process inside `cistern_init` (a vector
/// of 4 billion devices), and `granularity:512` to take gigabytes of page tables on the first
/// allocation; both are refused with an error that names the range, and nothing aborts.
#[test]
fn out_of_range_sim_settings_fail_init_instead_of_aborting() {
    if is_child() {
        return;
    }
    for (sim, says) in [
        ("devices:4294967295", "use 1 to 64"),
        ("granularity:512", "power of two of at least 65536"),
        ("capacity:16TiB,granularity:64KiB", "larger granularity"),
    ] {
        run_child(
            "child_bad_sim",
            &[
                ("CISTERN_DRIVER", "sim"),
                ("CISTERN_SIM", sim),
                ("CISTERN_TEST_SAYS", says),
            ],
        );
    }
}

#[test]
fn child_bad_sim() {
    if !is_child() {
        return;
    }
    let says = std::env::var("CISTERN_TEST_SAYS").unwrap();
    let abi = common::load_with_env(&[]);
    // SAFETY: the export's documented types.
    unsafe { (abi.init)(1) };
    let e = abi.last_error();
    assert!(
        e.contains("cistern_init") && e.contains("CISTERN_SIM") && e.contains(&says),
        "{e}"
    );
    assert!(malloc(abi, 4096, 0, stream(0)).is_null());
    assert!(abi.last_error().contains(&says));
}

/// `record:PATH` in a directory that does not exist used to let `cistern_init` succeed and
/// every allocation fail as an "invalid argument"; `cistern_init` now fails, naming the path,
/// what is wrong with it and the fix.
#[test]
fn an_unwritable_record_path_fails_init() {
    if is_child() {
        return;
    }
    run_child(
        "child_bad_record",
        &[
            ("CISTERN_DRIVER", "sim"),
            (
                "CISTERN_CONF",
                "registry:off,record:/nonexistent-cistern-dir/run.trace",
            ),
        ],
    );
}

#[test]
fn child_bad_record() {
    if !is_child() {
        return;
    }
    let abi = common::load_with_env(&[]);
    // SAFETY: the export's documented types.
    unsafe { (abi.init)(1) };
    let e = abi.last_error();
    for says in [
        "cistern_init",
        "CISTERN_CONF",
        "record",
        "/nonexistent-cistern-dir/run.trace",
        "No such file",
        "record:none",
    ] {
        assert!(e.contains(says), "{says}: {e}");
    }
    assert!(malloc(abi, 4096, 0, stream(0)).is_null());
    assert!(abi
        .last_error()
        .contains("/nonexistent-cistern-dir/run.trace"));
}

/// A `fork()` child of a process whose threads are allocating used to hang in `cistern_malloc`
/// (5 to 10 children in 10) on a lock a parent thread held at the fork; the child is now told,
/// without taking a lock, that the parent's pool cannot be used after fork.
#[test]
fn a_fork_child_is_refused_and_never_hangs() {
    if is_child() {
        return;
    }
    run_child(
        "child_forks_while_threads_allocate",
        &[("CISTERN_DRIVER", "sim")],
    );
}

#[test]
fn child_forks_while_threads_allocate() {
    if !is_child() {
        return;
    }
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let abi = common::load_with_env(&[]);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut i = 0usize;
                while !stop.load(Relaxed) {
                    let p = malloc(abi, 4096 << (i % 8), 0, stream(t + 1));
                    assert!(!p.is_null(), "{}", abi.last_error());
                    // SAFETY: the export's documented types; `p` came from cistern_malloc.
                    unsafe { (abi.free)(p, 4096 << (i % 8), 0, stream(t + 1)) };
                    i += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(50));
    for _ in 0..10 {
        // SAFETY: the child only calls cistern and `_exit`, both fine in a fork child.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let p = malloc(abi, 4096, 0, stream(9));
            let told = abi.last_error().contains("fork()");
            // SAFETY: ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if p.is_null() && told { 0 } else { 3 }) };
        }
        let mut status = 0;
        let mut waited = 0;
        loop {
            // SAFETY: our own child; `status` is a live int.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            waited += 1;
            if waited > 1000 {
                // SAFETY: our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("the fork child hung in cistern_malloc");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the fork child was not refused with an error naming fork(): status {status}"
        );
    }
    stop.store(true, Relaxed);
    for w in workers {
        w.join().unwrap();
    }
}

static EVENTS: Mutex<Vec<common::Event>> = Mutex::new(Vec::new());

unsafe extern "C" fn keep_event(ctx: *mut c_void, e: *const common::Event) {
    assert_eq!(ctx as usize, 11);
    // SAFETY: cistern passes a valid event for the duration of the call.
    EVENTS.lock().unwrap().push(unsafe { *e });
}

/// `cistern_set_observer`: mappings and completed frees reach the C observer with their
/// device and range; removing it releases its context and stops the events.
#[test]
fn the_observer_hears_mappings_and_completed_frees() {
    let (abi, _g) = abi();
    use std::sync::atomic::Ordering::SeqCst;
    let dev = 8;
    let released = RELEASED.load(SeqCst);
    EVENTS.lock().unwrap().clear();
    // SAFETY (each call): the export's documented types.
    let r = unsafe { (abi.set_observer)(Some(keep_event), 11 as *mut c_void, Some(count_release)) };
    assert_eq!(r, 1, "{}", abi.last_error());
    let size = 300 * MIB;
    let p = malloc(abi, size, dev, stream(5));
    assert!(!p.is_null());
    let mapped: usize = EVENTS
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind == 1 && e.device == dev)
        .map(|e| e.bytes as usize)
        .sum();
    assert!(
        mapped >= size,
        "mapped {mapped} bytes for a {size}-byte block"
    );
    assert!(EVENTS
        .lock()
        .unwrap()
        .iter()
        .all(|e| (e.pool_id_0, e.pool_id_1) == (0, 0)));
    // Memory of a graph pool is named by the pool's id.
    // SAFETY (each call): the exports' documented types.
    let begin = unsafe { (abi.begin_allocate_to_pool)(dev, 0, 21, None, ptr::null_mut(), None) };
    assert_eq!(begin, 1, "{}", abi.last_error());
    let g = malloc(abi, 5 * MIB, dev, stream(6));
    // SAFETY: as above.
    assert_eq!(unsafe { (abi.end_allocate_to_pool)(dev, 0, 21) }, 1);
    assert!(EVENTS
        .lock()
        .unwrap()
        .iter()
        .any(|e| e.kind == 1 && e.device == dev && (e.pool_id_0, e.pool_id_1) == (0, 21)));
    free(abi, g, 5 * MIB, dev, stream(6));
    // SAFETY: as above.
    assert_eq!(unsafe { (abi.release_pool)(dev, 0, 21) }, 1);
    free(abi, p, size, dev, stream(5));
    assert!(
        EVENTS
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == 5 && e.device == dev && e.addr == p as u64),
        "no free_completed for the block"
    );
    // Unmaps come with empty_cache.
    // SAFETY: the export's documented type.
    unsafe { (abi.empty_cache)() };
    assert!(EVENTS
        .lock()
        .unwrap()
        .iter()
        .any(|e| e.kind == 2 && e.device == dev));
    assert_eq!(RELEASED.load(SeqCst), released, "released while in use");
    // SAFETY: as above; NULL removes the observer.
    assert_eq!(
        unsafe { (abi.set_observer)(None, ptr::null_mut(), None) },
        1
    );
    assert_eq!(
        RELEASED.load(SeqCst),
        released + 1,
        "the context was not released"
    );
    let n = EVENTS.lock().unwrap().len();
    let q = malloc(abi, size, dev, stream(5));
    free(abi, q, size, dev, stream(5));
    assert_eq!(
        EVENTS.lock().unwrap().len(),
        n,
        "events after the observer was removed"
    );
}

/// `cistern_cache_info` (PyTorch's `cacheInfo`, for cuDNN's workspaces): the largest cached free
/// block and the room to grow; NULL outputs are allowed, a bad device is an error.
#[test]
fn cache_info_reports_what_a_workspace_may_take() {
    let (abi, _g) = abi();
    let dev = 4;
    let s = stream(0x4c1);
    let p = malloc(abi, 64 * MIB, dev, s);
    assert!(!p.is_null(), "{}", abi.last_error());
    free(abi, p, 64 * MIB, dev, s);
    let (mut largest, mut room) = (0usize, 0usize);
    // SAFETY (each call): two writable size_t, or NULL, as the export documents.
    assert_eq!(unsafe { (abi.cache_info)(dev, &mut largest, &mut room) }, 1);
    assert!(largest >= 64 * MIB, "largest free block {largest}");
    assert!(room > 0, "room {room}");
    // SAFETY: as above.
    assert_eq!(
        unsafe { (abi.cache_info)(dev, ptr::null_mut(), ptr::null_mut()) },
        1
    );
    // SAFETY: as above.
    assert_eq!(unsafe { (abi.cache_info)(10, &mut largest, &mut room) }, 0);
    assert!(
        abi.last_error().contains("cistern_cache_info(device 10)"),
        "{}",
        abi.last_error()
    );
    // The simulator maps pages (VMM) unless told otherwise.
    // SAFETY (each call): the export's documented types; a bad device is part of its contract.
    assert_eq!(unsafe { (abi.uses_vmm)(dev) }, 1, "{}", abi.last_error());
    assert_eq!(unsafe { (abi.uses_vmm)(10) }, -1);
    assert!(
        abi.last_error().contains("cistern_uses_vmm(device 10)"),
        "{}",
        abi.last_error()
    );
}
