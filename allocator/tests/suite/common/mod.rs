//! Helpers shared by the integration tests: pools on a `SimDriver`, in both VMM and
//! `cuMemAlloc`-segment modes, an invariant-checking wrapper, and a tiny seeded RNG.
#![allow(dead_code)]

use std::sync::Arc;

use cistern::{Config, Pool, SimConfig, SimDriver, StreamId};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const PAGE: u64 = 2 * MIB;

pub type SimPool = Pool<Arc<SimDriver>>;

/// A pool over a fresh simulator of `cap` bytes, with `conf` appended to the mode's settings.
pub fn pool_with(sim: SimConfig, vmm: bool, conf: &str) -> (Arc<SimDriver>, SimPool) {
    let sim = Arc::new(SimDriver::new(sim));
    let text = if conf.is_empty() {
        format!("vmm:{vmm}")
    } else {
        format!("vmm:{vmm},{conf}")
    };
    let config = Config::parse(&text).unwrap();
    let pool = Pool::new(sim.clone(), config).unwrap();
    (sim, pool)
}

/// A pool over a simulator of `cap` bytes.
pub fn pool(cap: u64, vmm: bool) -> (Arc<SimDriver>, SimPool) {
    pool_with(SimConfig::default().capacity(cap), vmm, "")
}

/// The two pool modes every behaviour should hold in.
pub const MODES: [bool; 2] = [true, false];

/// Runs `f` once per mode (VMM, then segments), naming the mode if it panics.
pub fn both(mut f: impl FnMut(bool)) {
    for vmm in MODES {
        eprintln!("-- vmm:{vmm}");
        f(vmm);
    }
}

/// Checks the pool's invariants, with context on failure.
#[track_caller]
pub fn check(pool: &SimPool) {
    if let Err(e) = pool.check_invariants() {
        panic!("invariants violated: {e}");
    }
}

/// Allocates and checks invariants.
#[track_caller]
pub fn alloc(pool: &SimPool, size: u64, stream: u64) -> u64 {
    let p = pool
        .alloc_raw(0, size, StreamId(stream))
        .unwrap_or_else(|e| panic!("alloc of {size} on stream {stream} failed: {e}"));
    check(pool);
    p
}

/// Frees and checks invariants.
#[track_caller]
pub fn free(pool: &SimPool, ptr: u64, stream: u64) {
    pool.free_raw(ptr, StreamId(stream))
        .unwrap_or_else(|e| panic!("free of {ptr:#x} on stream {stream} failed: {e}"));
    check(pool);
}

/// A stat of device 0.
pub fn stat(pool: &SimPool, key: &str) -> i64 {
    pool.stats(0).unwrap().get(key)
}

/// Asserts that live blocks of device 0 do not overlap and are 512 B aligned.
#[track_caller]
pub fn assert_disjoint(pool: &SimPool) {
    let blocks = pool.device(0).unwrap().live_blocks();
    for w in blocks.windows(2) {
        let (a, alen, b) = (w[0].ptr, w[0].size, w[1].ptr);
        assert!(
            a + alen <= b,
            "live blocks overlap: {a:#x}+{alen} and {b:#x}"
        );
    }
    for p in blocks.iter().map(|b| b.ptr) {
        assert_eq!(p % 512, 0, "{p:#x} is not 512 B aligned");
    }
}

/// Frees everything, empties the cache, drops the pool and asserts the simulator holds nothing.
#[track_caller]
pub fn assert_no_leak(sim: &SimDriver, pool: SimPool) {
    pool.empty_cache();
    check(&pool);
    assert_eq!(
        sim.committed_bytes(0),
        0,
        "committed bytes after empty_cache"
    );
    assert_eq!(sim.live_handles(0), 0, "physical handles after empty_cache");
    assert_eq!(sim.mapped_bytes(0), 0, "mapped bytes after empty_cache");
    assert_eq!(
        sim.live_linear_allocations(0),
        0,
        "linear allocations after empty_cache"
    );
    drop(pool);
    assert_eq!(sim.reserved_va_bytes(0), 0, "VA reservations after drop");
    assert_eq!(sim.live_events(0), 0, "events after drop");
}

/// xorshift64*: deterministic, seedable, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}
