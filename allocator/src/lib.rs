//! cistern: a stream-ordered, VMM-backed caching allocator for CUDA device memory.
//!
//! The guide below is `allocator/README.md`; its examples run as doc tests. For the pool's
//! design read [`pool`] (and the workspace README), [`driver`] for the seam between the pool
//! and a device, and [`interop`] for pooled buffers as cudarc device memory.
//!
#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
// `unsafe` lives only in `driver::cuda` (the driver API is FFI) and `sys` (libc calls).
#![deny(unsafe_code)]
// Gauges are indexed [gauge][pool] in several parallel arrays; index loops read best there.
#![allow(clippy::needless_range_loop)]

/// Writes a line to stderr, ignoring failure: `eprintln!` panics when stderr is a closed pipe,
/// and nothing here may panic (code behind the C ABI, exit hooks).
macro_rules! stderr_line {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

pub mod config;
pub mod driver;
pub mod error;
pub mod fork;
pub(crate) mod heap;
pub mod interop;
pub mod ipc;
#[doc(hidden)]
pub mod log;
pub(crate) mod nvml;
pub mod open;
pub mod provenance;
pub mod registry;
pub mod stats;
mod sys;
pub mod trace_writer;

mod arena;
pub mod pool;

pub use config::{Config, WholeChunks};
pub use driver::cuda::CudaDriver;
pub use driver::sim::{CallCost, CaptureViolation, CostTable, SimConfig, SimDriver, SimGraph};
pub use driver::{DeviceId, Driver, StreamId};
pub use error::{Error, OomReport, Result};
pub use open::{choice_from_env, open_driver, open_driver_from_env, DriverChoice};
pub use pool::{
    BlockInfo, BlockSnapshot, BlockState, Buffer, CacheInfo, CheckpointBlock, DevicePool,
    DeviceReport, GraphPoolInfo, Imported, MempoolId, Observer, Pool, PoolCheckpoint, PoolEvent,
    PoolEventKind, PoolReport, RestoreDelta, SegmentSnapshot, StreamFilter,
};
pub use provenance::{
    group_live, site_frames, tag_name, tag_pop, tag_push, with_tag, LedgerEntry, LiveBlock,
    LiveGroup, Mark, TagGuard,
};
pub use stats::Stats;

pub(crate) use log::log_rate_limited;

/// The workspace README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct WorkspaceReadme;

/// Formats a byte count for people: `512 B`, `1.5 KiB`, `20.0 MiB`, `79.2 GiB`.
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}
