//! A client the way real programs use cistern over the driver: streams it creates itself with
//! `cuStreamCreate`, allocations and frees across them from several threads, the per-thread
//! default stream (`CU_STREAM_PER_THREAD`, a different stream on every thread), events it
//! records, streams destroyed with work still queued, and a stream of another device named in
//! `record_stream`. The fake runs simulated work (`cisternFakeLaunch`) and records a hazard
//! whenever work touches memory that unfinished, unordered work of another stream still
//! touches; the client must finish with none.
//!
//! Each check runs in a child process with the fake on the library path (see `end_to_end.rs`).

mod common;

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::process::Command;
use std::sync::Arc;

use cistern::driver::cuda::CudaDriver;
use cistern::{Config, Pool, StreamId};

const CHILD: &str = "FAKECUDA_CLIENT_CHILD";
const MIB: u64 = 1 << 20;

type Ptr = *mut c_void;

/// The driver functions the client calls, from the library cistern already loaded.
struct Cuda {
    _lib: libloading::Library,
    retain: unsafe extern "C" fn(*mut Ptr, c_int) -> c_uint,
    release: unsafe extern "C" fn(c_int) -> c_uint,
    push: unsafe extern "C" fn(Ptr) -> c_uint,
    pop: unsafe extern "C" fn(*mut Ptr) -> c_uint,
    stream_create: unsafe extern "C" fn(*mut Ptr, c_uint) -> c_uint,
    stream_destroy: unsafe extern "C" fn(Ptr) -> c_uint,
    event_create: unsafe extern "C" fn(*mut Ptr, c_uint) -> c_uint,
    event_record: unsafe extern "C" fn(Ptr, Ptr) -> c_uint,
    event_destroy: unsafe extern "C" fn(Ptr) -> c_uint,
    wait_event: unsafe extern "C" fn(Ptr, Ptr, c_uint) -> c_uint,
    launch: unsafe extern "C" fn(Ptr, c_ulonglong, usize) -> c_uint,
    complete: unsafe extern "C" fn(Ptr) -> c_uint,
    print_hazards: unsafe extern "C" fn() -> c_ulonglong,
}

// SAFETY: plain function pointers into a library that stays loaded; the driver API is
// thread-safe.
unsafe impl Send for Cuda {}
// SAFETY: as above; never mutated.
unsafe impl Sync for Cuda {}

impl Cuda {
    fn load() -> Cuda {
        // SAFETY: the fake driver, already loaded by `CudaDriver::new`; only looked up.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.expect("libcuda.so.1");
        macro_rules! f {
            ($name:literal) => {
                // SAFETY: the fake exports the function with the CUDA driver API's signature.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.expect($name)
            };
        }
        Cuda {
            retain: f!("cuDevicePrimaryCtxRetain"),
            release: f!("cuDevicePrimaryCtxRelease_v2"),
            push: f!("cuCtxPushCurrent_v2"),
            pop: f!("cuCtxPopCurrent_v2"),
            stream_create: f!("cuStreamCreate"),
            stream_destroy: f!("cuStreamDestroy_v2"),
            event_create: f!("cuEventCreate"),
            event_record: f!("cuEventRecord"),
            event_destroy: f!("cuEventDestroy_v2"),
            wait_event: f!("cuStreamWaitEvent"),
            launch: f!("cisternFakeLaunch"),
            complete: f!("cisternFakeComplete"),
            print_hazards: f!("cisternFakePrintHazards"),
            _lib: lib,
        }
    }

    /// Calls a driver function, asserting success.
    #[track_caller]
    fn ok(&self, what: &str, r: c_uint) {
        assert_eq!(r, 0, "{what} failed with CUresult {r}");
    }

    /// Device `dev`'s primary context, retained.
    fn context(&self, dev: c_int) -> Ptr {
        let mut ctx: Ptr = std::ptr::null_mut();
        // SAFETY: a live out-pointer.
        self.ok("cuDevicePrimaryCtxRetain", unsafe {
            (self.retain)(&mut ctx, dev)
        });
        ctx
    }

    fn push(&self, ctx: Ptr) {
        // SAFETY: a retained primary context.
        self.ok("cuCtxPushCurrent", unsafe { (self.push)(ctx) });
    }

    fn pop(&self) {
        let mut ctx: Ptr = std::ptr::null_mut();
        // SAFETY: a live out-pointer.
        self.ok("cuCtxPopCurrent", unsafe { (self.pop)(&mut ctx) });
    }

    /// A new blocking stream of the current context.
    fn stream(&self) -> StreamId {
        let mut s: Ptr = std::ptr::null_mut();
        // SAFETY: a live out-pointer; flags 0.
        self.ok("cuStreamCreate", unsafe { (self.stream_create)(&mut s, 0) });
        StreamId(s as usize as u64)
    }

    fn destroy(&self, s: StreamId) {
        // SAFETY: a stream this client created and destroys once.
        self.ok("cuStreamDestroy", unsafe {
            (self.stream_destroy)(s.0 as usize as Ptr)
        });
    }

    /// Work on `s` touching `[ptr, ptr + len)`.
    #[track_caller]
    fn launch(&self, s: StreamId, ptr: u64, len: u64) {
        self.ok("cisternFakeLaunch", self.try_launch(s, ptr, len));
    }

    /// [`Cuda::launch`], returning the fake's answer.
    fn try_launch(&self, s: StreamId, ptr: u64, len: u64) -> c_uint {
        // SAFETY: plain values; the fake never dereferences device addresses.
        unsafe { (self.launch)(s.0 as usize as Ptr, ptr, len as usize) }
    }

    /// The GPU finishes what `s` has queued.
    fn complete(&self, s: StreamId) {
        // SAFETY: a plain handle value.
        self.ok("cisternFakeComplete", unsafe {
            (self.complete)(s.0 as usize as Ptr)
        });
    }

    /// Makes `later` wait for the work queued on `first` so far.
    fn order(&self, first: StreamId, later: StreamId) {
        let mut ev: Ptr = std::ptr::null_mut();
        // SAFETY: live out-pointer and handles of this client's context; the event is
        // destroyed once, after the wait was queued (the wait keeps its own reference).
        unsafe {
            self.ok("cuEventCreate", (self.event_create)(&mut ev, 2));
            self.ok(
                "cuEventRecord",
                (self.event_record)(ev, first.0 as usize as Ptr),
            );
            self.ok(
                "cuStreamWaitEvent",
                (self.wait_event)(later.0 as usize as Ptr, ev, 0),
            );
            self.ok("cuEventDestroy", (self.event_destroy)(ev));
        }
    }

    fn hazards(&self) -> u64 {
        // SAFETY: no arguments.
        unsafe { (self.print_hazards)() }
    }
}

/// A tiny seeded generator (xorshift), so every run does the same.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn run_child(name: &str, knobs: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--ignored", "--nocapture"]);
    common::child_env(&mut cmd, knobs);
    cmd.env(CHILD, name);
    let out = cmd.output().expect("run the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child {name} failed ({:?})\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
}

fn is_child(name: &str) -> bool {
    let yes = std::env::var(CHILD).as_deref() == Ok(name);
    if !yes {
        eprintln!("skipping: {name} runs in a child process started by its parent test");
    }
    yes
}

#[test]
fn threads_and_streams_of_a_real_client_leave_no_hazard() {
    run_child("child_threads_and_streams", &[]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_threads_and_streams() {
    if !is_child("child_threads_and_streams") {
        return;
    }
    let pool = Arc::new(
        Pool::new(
            CudaDriver::new().expect("CudaDriver on the fake"),
            Config::default(),
        )
        .unwrap(),
    );
    let cuda = Arc::new(Cuda::load());
    let ctx = cuda.context(0) as usize;
    cuda.push(ctx as Ptr);
    let shared: Vec<StreamId> = (0..3).map(|_| cuda.stream()).collect();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (pool, cuda, shared) = (pool.clone(), cuda.clone(), shared.clone());
            std::thread::spawn(move || {
                cuda.push(ctx as Ptr);
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t + 1));
                // A stream of this thread's own, destroyed and replaced with work queued.
                let mut own = cuda.stream();
                let mut live: Vec<(u64, u64, StreamId)> = Vec::new();
                for i in 0..400 {
                    let s = match rng.below(4) {
                        0 => StreamId::PER_THREAD,
                        1 => own,
                        _ => shared[((t + i) % 3) as usize],
                    };
                    let len = (1 + rng.below(6 * MIB)) & !0xff;
                    let len = len.max(256);
                    let p = pool.alloc_raw(0, len, s).expect("alloc");
                    cuda.launch(s, p, len);
                    if rng.below(4) == 0 {
                        // A use on another stream, ordered after the allocation stream.
                        let other = shared[((t + i + 1) % 3) as usize];
                        if other != s {
                            cuda.order(s, other);
                            cuda.launch(other, p, len);
                            pool.record_stream(p, other).expect("record_stream");
                        }
                    }
                    live.push((p, len, s));
                    if live.len() > 6 {
                        let k = rng.below(live.len() as u64) as usize;
                        let (p, _, s) = live.swap_remove(k);
                        pool.free_raw(p, s).expect("free");
                    }
                    if i % 97 == 96 {
                        // The stream is destroyed with its work still queued (the driver lets
                        // the work finish); its blocks were freed on it first.
                        for (p, _, s) in std::mem::take(&mut live) {
                            pool.free_raw(p, s).expect("free");
                        }
                        // As a program that destroys streams should: the pool is told first,
                        // and never names the handle again.
                        pool.forget_stream(own).expect("forget_stream");
                        cuda.destroy(own);
                        own = cuda.stream();
                    }
                    if i % 37 == 36 {
                        // The GPU catches up with this thread's streams.
                        cuda.complete(StreamId::PER_THREAD);
                        cuda.complete(own);
                    }
                }
                for (p, _, s) in live {
                    pool.free_raw(p, s).expect("free");
                }
                cuda.complete(StreamId::PER_THREAD);
                pool.forget_stream(own).expect("forget_stream");
                cuda.destroy(own);
                cuda.pop();
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a client thread panicked");
    }
    for &s in &shared {
        cuda.complete(s);
    }
    assert_eq!(cuda.hazards(), 0, "the pool handed out memory still in use");
    pool.check_invariants().expect("invariants");
    pool.empty_cache();
    pool.check_invariants().expect("invariants");
    for s in shared {
        cuda.destroy(s);
    }
    cuda.pop();
}

#[test]
fn record_stream_with_another_devices_stream_waits_for_that_stream() {
    run_child(
        "child_record_stream_on_another_device",
        &[("CISTERN_FAKECUDA_DEVICES", "2")],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_record_stream_on_another_device() {
    if !is_child("child_record_stream_on_another_device") {
        return;
    }
    let pool = Pool::new(
        CudaDriver::new().expect("CudaDriver on the fake"),
        Config::default(),
    )
    .unwrap();
    let cuda = Cuda::load();
    let (c0, c1) = (cuda.context(0), cuda.context(1));
    cuda.push(c0);
    let s0 = cuda.stream();
    cuda.pop();
    cuda.push(c1);
    let s1 = cuda.stream();
    // Work queued on device 1's stream (on device 1's own memory), unfinished.
    let q = pool.alloc_raw(1, 4 * MIB, s1).unwrap();
    cuda.launch(s1, q, 4 * MIB);
    cuda.pop();
    // A block of device 0 that device 1's stream uses too: freeing it must wait for s1's
    // work, which means an event recorded on s1, on device 1.
    let p = pool.alloc_raw(0, 8 * MIB, s0).unwrap();
    pool.record_stream(p, s1).unwrap();
    pool.free_raw(p, s0).unwrap();
    let pending = pool.stats(0).unwrap().get("num_pending_frees");
    assert_eq!(pending, 1, "the free did not wait for device 1's stream");
    let again = pool.alloc_raw(0, 8 * MIB, s0).unwrap();
    assert_ne!(
        again, p,
        "the block was reused before device 1's stream finished"
    );
    cuda.complete(s1);
    pool.free_raw(again, s0).unwrap();
    pool.free_raw(q, s1).unwrap();
    // Once s1's work is done, the block is free again.
    let third = pool.alloc_raw(0, 8 * MIB, s0).unwrap();
    pool.free_raw(third, s0).unwrap();
    pool.check_invariants().unwrap();
    pool.empty_cache();
    cuda.destroy(s0);
    cuda.destroy(s1);
    // SAFETY: both primary contexts were retained once above.
    unsafe {
        (cuda.release)(0);
        (cuda.release)(1);
    }
}

/// `CUDA_ERROR_ILLEGAL_ADDRESS`: what work touching memory without access gets.
const ILLEGAL_ADDRESS: c_uint = 700;

/// Device 1's work reaches device 0's pool memory only where access was granted to device 1 on
/// each mapping (`cuCtxEnablePeerAccess` does not cover VMM mappings): with `peer_access:all`
/// every mapping from the start; after `enable_peer_access`, every mapping present then and
/// every later one (new growth, and pages stitched in from another stream's cache).
#[test]
fn peer_access_reaches_present_and_future_mappings() {
    run_child("child_peer_access", &[("CISTERN_FAKECUDA_DEVICES", "2")]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_peer_access() {
    if !is_child("child_peer_access") {
        return;
    }
    let new_pool = |conf: &str| {
        Pool::new(
            CudaDriver::new().expect("CudaDriver on the fake"),
            Config::parse(conf).unwrap(),
        )
        .unwrap()
    };
    let all = new_pool("peer_access:all");
    let cuda = Cuda::load();
    let (c0, c1) = (cuda.context(0), cuda.context(1));
    cuda.push(c0);
    let (s0, s0b) = (cuda.stream(), cuda.stream());
    cuda.pop();
    cuda.push(c1);
    let s1 = cuda.stream();
    cuda.pop();
    {
        let pool = all;
        assert_eq!(pool.device(0).unwrap().peers(), vec![1]);
        let (large, small) = (
            pool.alloc_raw(0, 8 * MIB, s0).unwrap(),
            pool.alloc_raw(0, 4096, s0).unwrap(),
        );
        cuda.launch(s1, large, 8 * MIB);
        cuda.launch(s1, small, 4096);
        cuda.complete(s1);
        pool.free_raw(large, s0).unwrap();
        pool.free_raw(small, s0).unwrap();
        pool.empty_cache();
    }
    let pool = new_pool("");
    assert!(pool.device(0).unwrap().peers().is_empty());
    let before = pool.alloc_raw(0, 8 * MIB, s0).unwrap();
    let donor = pool.alloc_raw(0, 40 * MIB, s0b).unwrap();
    pool.enable_peer_access(0, 1).unwrap();
    pool.enable_peer_access(0, 1).unwrap();
    assert_eq!(pool.device(0).unwrap().peers(), vec![1]);
    let grown = pool.alloc_raw(0, 64 * MIB, s0).unwrap();
    // The donor's pages, cached on s0b with no work queued, are stitched into s0's segment.
    pool.free_raw(donor, s0b).unwrap();
    let creates = pool
        .stats(0)
        .unwrap()
        .get("num_driver_calls.create_physical");
    let stitched = pool.alloc_raw(0, 40 * MIB, s0).unwrap();
    assert_eq!(
        pool.stats(0)
            .unwrap()
            .get("num_driver_calls.create_physical"),
        creates,
        "the request was not served from the donor's cached pages"
    );
    for (p, len) in [(before, 8 * MIB), (grown, 64 * MIB), (stitched, 40 * MIB)] {
        cuda.launch(s1, p, len);
    }
    cuda.complete(s1);
    for p in [before, grown, stitched] {
        pool.free_raw(p, s0).unwrap();
    }
    let own = pool.enable_peer_access(0, 0).unwrap_err().to_string();
    assert!(own.contains("own device"), "{own}");
    let missing = pool.enable_peer_access(0, 2).unwrap_err();
    assert!(
        matches!(missing, cistern::Error::InvalidDevice { device: 2, .. }),
        "{missing}"
    );
    pool.check_invariants().unwrap();
    pool.empty_cache();
    drop(pool);
    // Without peer access, device 1's work on device 0's memory is an illegal address (the
    // last check: it makes device 1's context unusable, as on a real GPU).
    let pool = new_pool("");
    let p = pool.alloc_raw(0, 8 * MIB, s0).unwrap();
    assert_eq!(cuda.try_launch(s1, p, 8 * MIB), ILLEGAL_ADDRESS);
    pool.free_raw(p, s0).unwrap();
    pool.empty_cache();
    cuda.destroy(s0);
    cuda.destroy(s0b);
    // SAFETY: both primary contexts were retained once above.
    unsafe {
        (cuda.release)(0);
        (cuda.release)(1);
    }
}

#[test]
fn the_legacy_handles_name_one_stream_and_each_devices_default_stream_is_its_own() {
    run_child("child_legacy_handles", &[("CISTERN_FAKECUDA_DEVICES", "2")]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_legacy_handles() {
    if !is_child("child_legacy_handles") {
        return;
    }
    let pool = Pool::new(
        CudaDriver::new().expect("CudaDriver on the fake"),
        Config::default(),
    )
    .unwrap();
    let cuda = Cuda::load();
    let (c0, c1) = (cuda.context(0), cuda.context(1));
    // `0` and `CU_STREAM_LEGACY` are the same stream: a block freed on one is the next
    // allocation of the other, from one arena.
    let p = pool.alloc_raw(0, 8 * MIB, StreamId::DEFAULT).unwrap();
    pool.free_raw(p, StreamId::DEFAULT).unwrap();
    let q = pool.alloc_raw(0, 8 * MIB, StreamId::LEGACY).unwrap();
    assert_eq!(q, p, "CU_STREAM_LEGACY got an arena of its own");
    assert_eq!(pool.stats(0).unwrap().get("num_streams"), 1);
    // Device 1's default stream, named `0` by a thread whose current device is 1, is another
    // stream than device 0's: its use of a device-0 block is recorded, and the free waits for
    // an event recorded on device 1's legacy stream.
    cuda.push(c1);
    let r = pool.alloc_raw(1, 4 * MIB, StreamId::DEFAULT).unwrap();
    cuda.launch(StreamId::DEFAULT, r, 4 * MIB);
    pool.record_stream(q, StreamId::DEFAULT).unwrap();
    cuda.pop();
    pool.free_raw(q, StreamId::DEFAULT).unwrap();
    assert_eq!(
        pool.stats(0).unwrap().get("num_pending_frees"),
        1,
        "device 1's default stream was taken for device 0's"
    );
    cuda.push(c1);
    cuda.complete(StreamId::DEFAULT);
    pool.free_raw(r, StreamId::DEFAULT).unwrap();
    cuda.pop();
    cuda.push(c0);
    cuda.complete(StreamId::DEFAULT);
    cuda.pop();
    let again = pool.alloc_raw(0, 8 * MIB, StreamId::DEFAULT).unwrap();
    pool.free_raw(again, StreamId::DEFAULT).unwrap();
    assert_eq!(cuda.hazards(), 0);
    pool.check_invariants().unwrap();
    pool.empty_cache();
    // SAFETY: both primary contexts were retained once above.
    unsafe {
        (cuda.release)(0);
        (cuda.release)(1);
    }
}

#[test]
fn a_thread_without_a_context_is_left_without_one() {
    run_child("child_no_context_left_behind", &[]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_no_context_left_behind() {
    if !is_child("child_no_context_left_behind") {
        return;
    }
    let pool = Pool::new(
        CudaDriver::new().expect("CudaDriver on the fake"),
        Config::default(),
    )
    .unwrap();
    let lib = Cuda::load();
    // SAFETY: the fake is loaded; `cuCtxGetCurrent` writes one pointer.
    let current = || unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn(*mut Ptr) -> c_uint> =
            lib._lib.get(b"cuCtxGetCurrent\0").unwrap();
        let mut c: Ptr = std::ptr::null_mut();
        assert_eq!(f(&mut c), 0);
        c
    };
    std::thread::scope(|t| {
        t.spawn(|| {
            assert!(current().is_null());
            let p = pool.alloc_raw(0, MIB, StreamId::DEFAULT).unwrap();
            assert!(
                current().is_null(),
                "the pool left its context current on a thread that had none"
            );
            pool.free_raw(p, StreamId::DEFAULT).unwrap();
            assert!(current().is_null());
        });
    });
    pool.empty_cache();
}
