//! What the measured loop does: the sizes of each case's live set and the fixed pseudo-random
//! order in which pairs replace live blocks.
//!
//! This module owns the cases (one small size, or the size mix of a real PyTorch trace), the
//! loading of that trace, and the deterministic sampling. It knows nothing of allocators: the
//! same [`Workload`] drives cistern and the host reference, so both see the same sizes in the
//! same order.

use std::path::PathBuf;
use std::sync::OnceLock;

use cistern_trace::{Op, Snapshot};

const GIB: u64 = 1 << 30;

/// The size of every block in the small case: 4 KiB, a 1024-element fp32 tensor.
pub const SMALL_SIZE: u64 = 4096;

/// The live-set sizes every case is measured at.
pub const LIVE_BLOCKS: [usize; 3] = [1_000, 10_000, 100_000];

/// The thread counts every case is measured at (thread `t` uses stream `t + 1`).
pub const THREADS: [usize; 2] = [1, 2];

/// The trace whose allocation sizes make the mixed case, relative to the traces folder.
pub const TRACE_FILE: &str = "pytorch_snapshots/cs336-wedsonlin__gpt-medium_train_ctx128.pickle";

/// The most live bytes one thread's live set may hold; larger sampled sets are scaled down.
///
/// The simulated device never backs memory, but its VMM region is 16 TiB and each stream's arena
/// reserves three times the device capacity of address space ([`crate::DEVICE_CAPACITY`] is
/// 160 GiB, so two streams reserve 960 GiB). Two threads of 48 GiB live sets leave the pool
/// 64 GiB of headroom for page rounding. The host reference gets the same (scaled) sizes; it
/// reserves address space for them but touches only the pages it writes metadata into.
pub const MAX_LIVE_BYTES_PER_THREAD: u64 = 48 * GIB;

/// Length of each thread's precomputed index sequence (a power of two; the loop wraps around).
pub const ORDER_LEN: usize = 1 << 16;

/// The cases: a size mix and an order of replacement.
///
/// `Small` and `Trace` replace a uniformly random live block each pair: every pair touches
/// metadata of a random block, so beyond the caches' size the cost is memory latency, for any
/// allocator (mimalloc's pair grows about as much as cistern's from 1k to 100k live blocks).
/// `SmallFifo` replaces the oldest block each pair (the queue order of activations, KV caches
/// and staging buffers): it isolates the algorithm's own dependence on the number of live
/// blocks from cache misses, which is what the flatness target is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaseKind {
    /// Every block is [`SMALL_SIZE`] bytes; random victims.
    Small,
    /// Every block is [`SMALL_SIZE`] bytes; the oldest block is replaced.
    SmallFifo,
    /// Block sizes sampled from the `Op::Alloc` sizes of [`TRACE_FILE`]; random victims.
    Trace,
}

impl CaseKind {
    /// Every kind, in report order.
    pub const ALL: [CaseKind; 3] = [CaseKind::Small, CaseKind::SmallFifo, CaseKind::Trace];

    /// The name used in reports and benchmark ids.
    pub fn name(self) -> &'static str {
        match self {
            CaseKind::Small => "small_4KiB",
            CaseKind::SmallFifo => "small_4KiB_fifo",
            CaseKind::Trace => "trace_mix",
        }
    }
}

/// A xorshift64 generator: cheap, deterministic, and the same on every platform.
#[derive(Clone, Debug)]
pub struct Xorshift64(u64);

impl Xorshift64 {
    /// A generator from `seed` (0 is replaced, since xorshift would stay at 0).
    pub fn new(seed: u64) -> Self {
        Xorshift64(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A value in `0..n` (`n > 0`; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// The seed of thread `lane`'s sizes and order: different per thread, fixed across runs.
pub fn seed_of(lane: usize) -> u64 {
    0x5EED_0000_0000_0001 ^ ((lane as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The allocation sizes of a real trace, with multiplicity (so sampling follows their frequency).
#[derive(Clone, Debug)]
pub struct SizeMix {
    /// The trace file name (for reports).
    pub name: String,
    /// Every nonzero `Op::Alloc` size of device 0, in trace order.
    pub sizes: Vec<u64>,
}

/// The traces folder: `$CISTERN_TRACES_DIR`, else `../shared/traces` beside the repository.
pub fn traces_dir() -> PathBuf {
    match std::env::var_os("CISTERN_TRACES_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"),
    }
}

/// The size mix of [`TRACE_FILE`], read once per process; `Err` says why it is unavailable
/// (print it and skip the case).
pub fn trace_mix() -> Result<&'static SizeMix, String> {
    static MIX: OnceLock<Result<SizeMix, String>> = OnceLock::new();
    MIX.get_or_init(load_trace_mix)
        .as_ref()
        .map_err(Clone::clone)
}

fn load_trace_mix() -> Result<SizeMix, String> {
    let path = traces_dir().join(TRACE_FILE);
    if !path.exists() {
        return Err(format!(
            "skipping case {}: trace {} not found (set CISTERN_TRACES_DIR to the traces folder)",
            CaseKind::Trace.name(),
            path.display()
        ));
    }
    let snap = Snapshot::read(&path).map_err(|e| {
        format!(
            "skipping case {}: cannot read {}: {e}",
            CaseKind::Trace.name(),
            path.display()
        )
    })?;
    let sizes: Vec<u64> = snap
        .alloc_free_sequence(0)
        .ops
        .iter()
        .filter_map(|op| match *op {
            Op::Alloc { size, .. } if size > 0 => Some(size),
            _ => None,
        })
        .collect();
    if sizes.is_empty() {
        return Err(format!(
            "skipping case {}: {} has no allocations on device 0",
            CaseKind::Trace.name(),
            path.display()
        ));
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(SizeMix { name, sizes })
}

/// One thread's part of a case: the size of each live slot and the order of slots to replace.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The size of the block in each slot (a replacement has its predecessor's size).
    pub sizes: Vec<u64>,
    /// Slot indices, [`ORDER_LEN`] of them; pair `i` replaces slot `order[i % ORDER_LEN]`.
    pub order: Vec<u32>,
    /// The factor the sampled sizes were multiplied by to respect
    /// [`MAX_LIVE_BYTES_PER_THREAD`] (1.0 when they were not scaled).
    pub scale: f64,
}

impl Workload {
    /// `live_blocks` blocks of `size` bytes each.
    pub fn uniform(size: u64, live_blocks: usize, seed: u64) -> Workload {
        Workload {
            sizes: vec![size; live_blocks],
            order: order(live_blocks, seed),
            scale: 1.0,
        }
    }

    /// `live_blocks` sizes drawn from `mix` (deterministically from `seed`), scaled down
    /// proportionally if they add up to more than [`MAX_LIVE_BYTES_PER_THREAD`].
    pub fn sampled(mix: &[u64], live_blocks: usize, seed: u64) -> Workload {
        assert!(!mix.is_empty(), "an empty size mix");
        let mut rng = Xorshift64::new(seed ^ 0x51_2E5);
        let mut sizes: Vec<u64> = (0..live_blocks)
            .map(|_| mix[rng.below(mix.len() as u64) as usize])
            .collect();
        let total: u64 = sizes.iter().sum();
        let mut scale = 1.0;
        if total > MAX_LIVE_BYTES_PER_THREAD {
            scale = MAX_LIVE_BYTES_PER_THREAD as f64 / total as f64;
            for s in &mut sizes {
                *s = ((*s as f64 * scale) as u64).max(1);
            }
        }
        Workload {
            sizes,
            order: order(live_blocks, seed),
            scale,
        }
    }

    /// Thread `lane`'s workload of `kind` at `live_blocks`; `Err` when the trace is unavailable.
    pub fn for_case(kind: CaseKind, live_blocks: usize, lane: usize) -> Result<Workload, String> {
        let seed = seed_of(lane);
        match kind {
            CaseKind::Small => Ok(Workload::uniform(SMALL_SIZE, live_blocks, seed)),
            CaseKind::SmallFifo => Ok(Workload {
                sizes: vec![SMALL_SIZE; live_blocks],
                order: fifo_order(live_blocks),
                scale: 1.0,
            }),
            CaseKind::Trace => Ok(Workload::sampled(&trace_mix()?.sizes, live_blocks, seed)),
        }
    }

    /// The workloads of all `threads` lanes of a case.
    pub fn for_threads(
        kind: CaseKind,
        live_blocks: usize,
        threads: usize,
    ) -> Result<Vec<Workload>, String> {
        (0..threads)
            .map(|lane| Workload::for_case(kind, live_blocks, lane))
            .collect()
    }

    /// Bytes of the live set.
    pub fn live_bytes(&self) -> u64 {
        self.sizes.iter().sum()
    }
}

/// [`ORDER_LEN`] slot indices below `live_blocks`, from `seed`.
/// Slots in allocation order, oldest first, over and over.
fn fifo_order(live_blocks: usize) -> Vec<u32> {
    (0..ORDER_LEN).map(|i| (i % live_blocks) as u32).collect()
}

fn order(live_blocks: usize, seed: u64) -> Vec<u32> {
    assert!(
        live_blocks > 0 && live_blocks <= u32::MAX as usize,
        "live_blocks must be in 1..=u32::MAX"
    );
    let mut rng = Xorshift64::new(seed);
    (0..ORDER_LEN)
        .map(|_| rng.below(live_blocks as u64) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_are_deterministic_and_in_bounds() {
        let a = Workload::uniform(SMALL_SIZE, 1_000, seed_of(0));
        let b = Workload::uniform(SMALL_SIZE, 1_000, seed_of(0));
        assert_eq!(a.order, b.order);
        assert_eq!(a.order.len(), ORDER_LEN);
        assert!(a.order.iter().all(|&k| (k as usize) < 1_000));
        let other = Workload::uniform(SMALL_SIZE, 1_000, seed_of(1));
        assert_ne!(a.order, other.order, "lanes get their own sequences");
    }

    #[test]
    fn sampled_sizes_are_scaled_under_the_cap() {
        let mix = [1 << 30, 3 << 20, 4096];
        let w = Workload::sampled(&mix, 1_000, seed_of(0));
        assert!(w.live_bytes() <= MAX_LIVE_BYTES_PER_THREAD);
        assert!(w.scale < 1.0);
        assert!(w.sizes.iter().all(|&s| s > 0));
        let small = Workload::sampled(&mix[1..], 10, seed_of(0));
        assert_eq!(small.scale, 1.0);
        assert!(small.sizes.iter().all(|s| mix[1..].contains(s)));
    }
}
