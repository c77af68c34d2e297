//! The PyTorch model's rules on tiny hand-made sequences: segment sizes, split thresholds,
//! stream separation, best fit, merging, `max_split_size`, free-and-retry on OOM, and
//! expandable segments.

use cistern_replay::pytorch::{allocation_size, round_size};
use cistern_replay::{AllocatorModel, PytorchConfig, PytorchModel};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn model(capacity: u64) -> PytorchModel {
    PytorchModel::new("pytorch", PytorchConfig::default(), capacity)
}

fn expandable(capacity: u64) -> PytorchModel {
    PytorchModel::new(
        "pytorch-expandable",
        PytorchConfig {
            expandable_segments: true,
            ..PytorchConfig::default()
        },
        capacity,
    )
}

fn ok(m: &PytorchModel) {
    m.check_invariants().unwrap();
}

#[test]
fn rounding_and_segment_sizes() {
    assert_eq!(round_size(1), 512);
    assert_eq!(round_size(512), 512);
    assert_eq!(round_size(513), 1024);
    assert_eq!(allocation_size(512), 2 * MIB);
    assert_eq!(allocation_size(MIB), 2 * MIB);
    assert_eq!(allocation_size(MIB + 512), 20 * MIB);
    assert_eq!(allocation_size(10 * MIB - 512), 20 * MIB);
    assert_eq!(allocation_size(10 * MIB), 10 * MIB);
    assert_eq!(allocation_size(11 * MIB + 512), 12 * MIB);

    let mut m = model(GIB);
    m.alloc(0, 1000, 0).unwrap(); // small pool: one 2 MiB segment
    m.alloc(1, 100 * KIB, 0).unwrap(); // packed into it
    assert_eq!(m.segment_sizes(), vec![2 * MIB]);
    m.alloc(2, MIB + 1, 0).unwrap(); // large pool, under 10 MiB: a 20 MiB segment
    m.alloc(3, 10 * MIB, 0).unwrap(); // best fit: the 20 MiB segment's free rest
    m.alloc(4, 11 * MIB + 1, 0).unwrap(); // no room left: its own segment, rounded to 2 MiB
    let mut segs = m.segment_sizes();
    segs.sort_unstable();
    assert_eq!(segs, vec![2 * MIB, 12 * MIB, 20 * MIB]);
    assert_eq!(m.reserved(), 34 * MIB);
    assert_eq!(
        m.allocated(),
        Some(1024 + 100 * KIB + MIB + 512 + 10 * MIB + 12 * MIB)
    );
    assert_eq!(m.driver_calls().get("mem_alloc"), Some(&3));
    ok(&m);
    let mut m = model(GIB);
    m.alloc(0, 10 * MIB, 0).unwrap(); // 10 MiB and up: a segment of its own
    assert_eq!(m.segment_sizes(), vec![10 * MIB]);
}

#[test]
fn split_thresholds() {
    // Large pool: the remainder must exceed 1 MiB to be split off.
    let mut m = model(GIB);
    m.alloc(0, 19 * MIB, 0).unwrap(); // from a fresh 20 MiB segment: 1 MiB left, not split
    assert_eq!(m.allocated(), Some(20 * MIB));
    m.free(0);
    m.alloc(1, 18 * MIB + 512 * KIB, 0).unwrap(); // 1.5 MiB left: split
    assert_eq!(m.allocated(), Some(18 * MIB + 512 * KIB));
    m.alloc(2, MIB + 512 * KIB, 0).unwrap(); // takes exactly the remainder
    assert_eq!(m.reserved(), 20 * MIB);
    ok(&m);

    // Small pool: any remainder of at least 512 B is split off.
    let mut m = model(GIB);
    m.alloc(0, MIB, 0).unwrap();
    m.alloc(1, MIB - 512, 0).unwrap();
    m.alloc(2, 512, 0).unwrap();
    assert_eq!(m.reserved(), 2 * MIB, "three blocks fill one small segment");
    assert_eq!(m.allocated(), Some(2 * MIB));
    m.alloc(3, 1, 0).unwrap();
    assert_eq!(m.reserved(), 4 * MIB);
    ok(&m);
}

#[test]
fn streams_do_not_share_blocks() {
    let mut m = model(GIB);
    m.alloc(0, 4 * MIB, 1).unwrap();
    m.free(0);
    m.alloc(1, 4 * MIB, 2).unwrap(); // stream 2 cannot use stream 1's cached segment
    assert_eq!(m.reserved(), 40 * MIB);
    m.alloc(2, 4 * MIB, 1).unwrap(); // stream 1 can
    assert_eq!(m.reserved(), 40 * MIB);
    ok(&m);
}

#[test]
fn best_fit_and_merge() {
    let mut m = model(GIB);
    m.alloc(0, 30 * MIB, 0).unwrap();
    m.alloc(1, 12 * MIB, 0).unwrap();
    m.free(0);
    m.free(1);
    // 11 MiB: the smallest free block that fits is the 12 MiB segment (1 MiB left, unsplit).
    m.alloc(2, 11 * MIB, 0).unwrap();
    assert_eq!(m.allocated(), Some(12 * MIB));
    assert_eq!(m.reserved(), 42 * MIB);

    // Three blocks carved from one 20 MiB segment merge back into one on free.
    let mut m = model(GIB);
    for id in 0..3 {
        m.alloc(id, 4 * MIB, 0).unwrap();
    }
    assert_eq!(m.reserved(), 20 * MIB);
    m.free(1);
    m.free(0);
    m.free(2);
    ok(&m);
    m.alloc(9, 20 * MIB, 0).unwrap(); // the whole segment again, no new cudaMalloc
    assert_eq!(m.reserved(), 20 * MIB);
    assert_eq!(m.driver_calls().get("mem_alloc"), Some(&1));
    ok(&m);
}

#[test]
fn free_cached_segments_and_retry_on_oom() {
    let mut m = model(40 * MIB);
    m.alloc(0, 20 * MIB, 0).unwrap();
    m.free(0); // cached, too small for the next request
    m.alloc(1, 30 * MIB, 0).unwrap(); // cudaMalloc fails, the cache is released, retry works
    assert_eq!(m.reserved(), 30 * MIB);
    assert_eq!(m.counters().num_alloc_retries, 1);
    assert_eq!(m.driver_calls().get("mem_free"), Some(&1));
    ok(&m);
    // Nothing cached left to release: a real OOM, which changes nothing.
    let e = m.alloc(2, 20 * MIB, 0).unwrap_err();
    assert_eq!(e.requested, 20 * MIB);
    assert_eq!(m.reserved(), 30 * MIB);
    assert_eq!(m.counters().num_ooms, 1);
    m.free(2); // the failed id is unknown: ignored
    ok(&m);
}

#[test]
fn max_split_size_rules() {
    let cfg = PytorchConfig {
        max_split_size: 32 * MIB,
        ..PytorchConfig::default()
    };
    let mut m = PytorchModel::new("pytorch", cfg, GIB);
    m.alloc(0, 40 * MIB, 0).unwrap();
    m.free(0);
    // A request under max_split_size never takes an oversize block.
    m.alloc(1, 12 * MIB, 0).unwrap();
    assert_eq!(m.reserved(), 52 * MIB);
    // An oversize request takes an oversize block wasting less than 20 MiB, unsplit.
    m.alloc(2, 36 * MIB, 0).unwrap();
    assert_eq!(m.reserved(), 52 * MIB);
    assert_eq!(m.allocated(), Some(52 * MIB));
    ok(&m);

    // release_available_cached_blocks frees just the oversize block that is big enough.
    let mut m = PytorchModel::new("pytorch", cfg, 64 * MIB);
    m.alloc(0, 40 * MIB, 0).unwrap();
    m.free(0);
    m.alloc(1, 30 * MIB, 0).unwrap();
    assert_eq!(m.reserved(), 30 * MIB);
    assert_eq!(m.counters().num_alloc_retries, 0, "no full cache release");
    ok(&m);
}

#[test]
fn expandable_segments_grow_by_pages() {
    let mut m = expandable(GIB);
    m.alloc(0, 3 * MIB, 0).unwrap(); // one 20 MiB page of the large segment
    assert_eq!(m.reserved(), 20 * MIB);
    m.alloc(1, 25 * MIB, 0).unwrap(); // 17 MiB free at the end + one more page
    assert_eq!(m.reserved(), 40 * MIB);
    m.alloc(2, 1000, 0).unwrap(); // the small segment maps 2 MiB pages
    assert_eq!(m.reserved(), 42 * MIB);
    m.alloc(3, 1000, 7).unwrap(); // another stream, another segment
    assert_eq!(m.reserved(), 44 * MIB);
    ok(&m);
    let calls = m.driver_calls();
    assert_eq!(calls.get("create_physical"), Some(&4));
    assert_eq!(calls.get("reserve_va"), Some(&3));
}

#[test]
fn expandable_segments_unmap_free_pages_on_oom() {
    let mut m = expandable(60 * MIB);
    m.alloc(0, 50 * MIB, 0).unwrap(); // three 20 MiB pages: the whole device
    assert_eq!(m.reserved(), 60 * MIB);
    m.free(0);
    m.alloc(1, 30 * MIB, 1).unwrap(); // stream 1 needs two pages: stream 0's are unmapped
    assert_eq!(m.reserved(), 40 * MIB);
    assert_eq!(m.counters().num_alloc_retries, 1);
    assert_eq!(m.driver_calls().get("unmap"), Some(&3));
    ok(&m);
}

#[test]
fn zero_sized_allocations_touch_nothing() {
    let mut m = model(GIB);
    m.alloc(0, 0, 0).unwrap();
    assert_eq!(m.reserved(), 0);
    m.free(0);
    assert!(m.driver_calls().is_empty());
}

/// Random mixes of sizes, streams and frees on a small device: the block structure stays
/// consistent after every operation, through OOMs, cache releases and unmaps.
#[test]
fn random_sequences_keep_invariants() {
    for (seed, exp, mss) in [
        (1u64, false, u64::MAX),
        (2, true, u64::MAX),
        (3, false, 24 * MIB),
        (4, true, u64::MAX),
    ] {
        let cfg = PytorchConfig {
            max_split_size: mss,
            expandable_segments: exp,
        };
        let mut m = PytorchModel::new("pytorch", cfg, 256 * MIB);
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut live: Vec<u64> = Vec::new();
        for id in 0..3000u64 {
            if live.len() > 40 || (!live.is_empty() && rnd() % 3 == 0) {
                let i = (rnd() % live.len() as u64) as usize;
                m.free(live.swap_remove(i));
            } else {
                let size = match rnd() % 4 {
                    0 => rnd() % (64 * KIB),
                    1 => rnd() % (2 * MIB),
                    2 => rnd() % (12 * MIB),
                    _ => rnd() % (48 * MIB),
                };
                if m.alloc(id, size, rnd() % 2).is_ok() {
                    live.push(id);
                }
            }
            if let Err(e) = m.check_invariants() {
                panic!("seed {seed}, op {id}: {e}");
            }
        }
    }
}
