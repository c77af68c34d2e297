//! What the C ABI adds to the pool's cache-hit malloc/free pair.
//!
//! Three ways to take and give back one 4 KiB block (and one 4 MiB block) on the simulated GPU,
//! in one run: the Rust API (`DevicePool::alloc_raw` / `free_raw`, what the C ABI calls), the
//! Rust API through `Pool` (which looks the device up on each call), and the C ABI
//! (`cistern_malloc` / `cistern_free` of the built `libcistern.so`, called through function
//! pointers as PyTorch calls them). Target: the C ABI adds at most 20 ns to the pair.
//!
//! `cargo bench -p cistern-ffi --bench overhead`. Besides criterion's report it prints one
//! summary line per size from its own interleaved timing loop (best of 7 rounds).

use std::ffi::c_void;
use std::hint::black_box;
use std::time::Instant;

use cistern_alloc::{Config, DevicePool, Pool, SimConfig, SimDriver, StreamId};
use criterion::{criterion_group, Criterion};

#[path = "../tests/common/mod.rs"]
mod common;

const STREAM: u64 = 0x1000;

fn abi() -> &'static common::Abi {
    common::load_with_env(&[("CISTERN_DRIVER", "sim")])
}

fn rust_pool() -> (Pool<SimDriver>, std::sync::Arc<DevicePool<SimDriver>>) {
    let pool = Pool::new(SimDriver::new(SimConfig::default()), Config::default()).unwrap();
    let dev = pool.device(0).unwrap().clone();
    (pool, dev)
}

fn pair_rust(dev: &DevicePool<SimDriver>, size: u64) {
    let p = dev.alloc_raw(black_box(size), StreamId(STREAM)).unwrap();
    dev.free_raw(black_box(p), StreamId(STREAM)).unwrap();
}

fn pair_rust_pool(pool: &Pool<SimDriver>, size: u64) {
    let p = pool
        .alloc_raw(0, black_box(size), StreamId(STREAM))
        .unwrap();
    pool.free_raw(black_box(p), StreamId(STREAM)).unwrap();
}

fn pair_c(abi: &common::Abi, size: usize) {
    let s = STREAM as usize as *mut c_void;
    // SAFETY: the exports are called with their documented argument types.
    unsafe {
        let p = (abi.malloc)(black_box(size), 0, s);
        assert!(!p.is_null());
        (abi.free)(black_box(p), size, 0, s);
    }
}

fn bench(c: &mut Criterion) {
    let abi = abi();
    let (pool, dev) = rust_pool();
    for size in [4096u64, 4 << 20] {
        let mut g = c.benchmark_group(format!("malloc_free_pair/{size}B"));
        g.bench_function("rust_device_pool", |b| b.iter(|| pair_rust(&dev, size)));
        g.bench_function("rust_pool", |b| b.iter(|| pair_rust_pool(&pool, size)));
        g.bench_function("c_abi", |b| b.iter(|| pair_c(abi, size as usize)));
        g.finish();
    }
}

/// ns per pair of `f`, best of `rounds` runs of `n` pairs.
fn time(n: u32, f: &mut impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

fn summary() {
    let abi = abi();
    let (pool, dev) = rust_pool();
    for size in [4096u64, 4 << 20] {
        let (mut rust, mut via_pool, mut c) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..7 {
            rust = rust.min(time(200_000, &mut || pair_rust(&dev, size)));
            via_pool = via_pool.min(time(200_000, &mut || pair_rust_pool(&pool, size)));
            c = c.min(time(200_000, &mut || pair_c(abi, size as usize)));
        }
        println!(
            "overhead summary, {size} B: DevicePool alloc_raw+free_raw {rust:.1} ns, \
             Pool {via_pool:.1} ns, C ABI {c:.1} ns: the C ABI adds {:.1} ns (target <= 20)",
            c - rust
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}

fn main() {
    benches();
    summary();
    Criterion::default().configure_from_args().final_summary();
}
