//! The seeded mode: PyTorch's models started from the allocator state a snapshot's window
//! opened on (its segments, and the blocks live then at their offsets), so that a recording
//! that held memory from before its window is compared like with like.
//!
//! The hand-made traces are written by [`common::oom_traces::Recorder`] as PyTorch records
//! them: a history whose beginning is cut off by [`Recorder::open_window`], and segment
//! events that follow `CUDACachingAllocator.cpp`'s rules, so what PyTorch reserved is known.

use std::path::PathBuf;

use crate::common::oom_traces::{Recorder, MIB};
use cistern_replay::recorded::reserved_per_op;
use cistern_replay::{
    min_capacity_from, recorded, run, run_from, CostTable, PytorchConfig, PytorchModel,
};
use cistern_trace::{Op, Snapshot};

const A: u64 = 0x7f00_0000_0000;
const B: u64 = 0x7f00_4000_0000;

/// Before the window: a 20 MiB segment with two 4 MiB blocks live at offsets 0 and 12 MiB
/// (the space between them freed earlier). In the window a 9 MiB request fits neither gap
/// (8 MiB and 4 MiB), so PyTorch made a second 20 MiB segment (`get_allocation_size`: below
/// 10 MiB, a 20 MiB segment).
fn gapped() -> Snapshot {
    let mut r = Recorder::default();
    r.segment(0, A, 20 * MIB, 0)
        .alloc(0, A, 4 * MIB, 0)
        .alloc(0, A + 4 * MIB, 8 * MIB, 0)
        .alloc(0, A + 12 * MIB, 4 * MIB, 0)
        .free(0, A + 4 * MIB, 0)
        .open_window()
        .segment(0, B, 20 * MIB, 0)
        .alloc(0, B, 9 * MIB, 0)
        .free(0, B, 0);
    r.snapshot()
}

#[test]
fn a_seeded_model_follows_the_recorded_layout_op_by_op() {
    let snap = gapped();
    let recon = snap.reconstruct(0);
    let start = snap.window_start(0, &recon);
    assert_eq!(start.bytes(), 20 * MIB);
    assert_eq!(start.live.len(), 2);
    let rec = recorded(&snap, 0, &recon);
    assert_eq!(rec.peak_reserved, 40 * MIB);
    assert_eq!(rec.pre_window_bytes, Some(20 * MIB));

    let seeded = run_from(
        &recon.sequence,
        "pytorch",
        80 << 30,
        &CostTable::default(),
        &start,
    )
    .unwrap();
    assert!(seeded.seeded);
    assert_eq!(seeded.peak_reserved, 40 * MIB);
    // Started empty, the model packs the two live blocks together and the 9 MiB request fits
    // the 12 MiB left after them: it reads half of what PyTorch reserved.
    let empty = run(&recon.sequence, "pytorch", 80 << 30).unwrap();
    assert!(!empty.seeded);
    assert_eq!(empty.peak_reserved, 20 * MIB);

    // Op by op: the seeded model's reserved bytes are PyTorch's.
    let curve = reserved_per_op(&snap, 0, &recon);
    let mut m = PytorchModel::new("pytorch", PytorchConfig::default(), 80 << 30);
    m.seed(&start).unwrap();
    m.check_invariants().unwrap();
    for (i, op) in recon.sequence.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, stream } => {
                cistern_replay::AllocatorModel::alloc(&mut m, id, size, stream).unwrap()
            }
            Op::Free { id } => cistern_replay::AllocatorModel::free(&mut m, id),
        }
        m.check_invariants().unwrap();
        assert_eq!(
            cistern_replay::AllocatorModel::reserved(&m),
            curve[i],
            "after op {i} ({op:?})"
        );
    }
}

#[test]
fn cached_segments_from_before_the_window_are_reused_not_counted_again() {
    // Before the window a 64 MiB block was allocated and freed: its segment stays cached. The
    // window's 50 MiB request takes it (best fit), splitting off 14 MiB.
    let mut r = Recorder::default();
    r.segment(0, A, 64 * MIB, 0)
        .alloc(0, A, 64 * MIB, 0)
        .free(0, A, 0)
        .open_window()
        .alloc(0, A, 50 * MIB, 0)
        .free(0, A, 0);
    let snap = r.snapshot();
    let recon = snap.reconstruct(0);
    let start = snap.window_start(0, &recon);
    assert_eq!(recon.sequence.initially_live, 0);
    assert_eq!(start.bytes(), 64 * MIB);
    assert!(start.live.is_empty());
    let rec = recorded(&snap, 0, &recon);
    let costs = CostTable::default();
    let seeded = run_from(&recon.sequence, "pytorch", 80 << 30, &costs, &start).unwrap();
    assert_eq!(seeded.peak_reserved, rec.peak_reserved);
    assert_eq!(seeded.peak_reserved, 64 * MIB);
    // The segment was bought before the window: the window made no driver call.
    assert!(seeded.driver_calls.is_empty(), "{:?}", seeded.driver_calls);
    assert_eq!(seeded.driver_time_us, 0.0);
    let empty = run(&recon.sequence, "pytorch", 80 << 30).unwrap();
    assert_eq!(empty.peak_reserved, 50 * MIB);
    assert_eq!(empty.driver_calls.get("mem_alloc"), Some(&1));
}

#[test]
fn a_device_too_small_for_the_recorded_state_fails_before_the_first_op() {
    let snap = gapped();
    let recon = snap.reconstruct(0);
    let start = snap.window_start(0, &recon);
    let r = run_from(
        &recon.sequence,
        "pytorch",
        10 * MIB,
        &CostTable::default(),
        &start,
    )
    .unwrap();
    let oom = r.oom.expect("20 MiB of segments on a 10 MiB device");
    assert_eq!(oom.op_index, 0);
    assert!(
        oom.oom.detail.contains("window's start"),
        "{}",
        oom.oom.detail
    );
    assert_eq!(r.ops, 0);
    assert!(r.seeded);
    // The smallest device holds the recorded segment and the one the window adds.
    assert_eq!(
        min_capacity_from(&recon.sequence, "pytorch", &start).unwrap(),
        40 * MIB
    );
}

#[test]
fn only_the_pytorch_models_start_from_a_recorded_state() {
    let snap = gapped();
    let recon = snap.reconstruct(0);
    let start = snap.window_start(0, &recon);
    for name in ["cistern", "cudamalloc", "ideal"] {
        let e = run_from(
            &recon.sequence,
            name,
            80 << 30,
            &CostTable::default(),
            &start,
        )
        .unwrap_err();
        assert!(e.contains("only the PyTorch models"), "{name}: {e}");
    }
    for name in [
        "pytorch",
        "pytorch-expandable",
        "pytorch:max_split_size_mb:64",
    ] {
        let r = run_from(
            &recon.sequence,
            name,
            80 << 30,
            &CostTable::default(),
            &start,
        );
        assert!(r.is_ok_and(|r| r.oom.is_none()), "{name}");
    }
}

fn public(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../trace/testdata/public-snapshots")
        .join(name)
}

/// Real snapshots with memory from before their windows (plain segments, and expandable ones
/// under the expandable model): after seeding, the model holds exactly the recorded start,
/// and its block structure stays sound through the whole window.
#[test]
fn seeded_replays_of_public_snapshots_keep_the_model_sound() {
    for (file, expandable) in [
        ("cs336-bcrafton__transformer-lm.pickle.gz", false),
        (
            "cs336-linyunlinyun__xl-full-step_ctx512_fp32.pickle.gz",
            false,
        ),
        ("cs336-nothanmin__forward-mixed.pickle.gz", false),
        ("cs336-bolongcheng__xl-fwd_ctx2048_fp32.pickle.gz", true),
    ] {
        let traces = cistern_trace::load(&public(file)).unwrap();
        let t = &traces[0];
        let start = t.window_start.as_ref().expect("history");
        assert!(start.bytes() > 0, "{file}");
        let config = PytorchConfig {
            expandable_segments: expandable,
            ..PytorchConfig::default()
        };
        let mut m = PytorchModel::new("pytorch", config, 141 << 30);
        m.seed(start).unwrap();
        m.check_invariants()
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        use cistern_replay::AllocatorModel;
        assert_eq!(m.reserved(), start.bytes(), "{file}");
        for (i, op) in t.sequence.ops.iter().enumerate() {
            match *op {
                Op::Alloc { id, size, stream } => m.alloc(id, size, stream).unwrap(),
                Op::Free { id } => m.free(id),
            }
            assert!(m.reserved() >= start.bytes(), "{file}: op {i}");
            if i % 97 == 0 {
                m.check_invariants()
                    .unwrap_or_else(|e| panic!("{file}: after op {i}: {e}"));
            }
        }
        m.check_invariants()
            .unwrap_or_else(|e| panic!("{file}: {e}"));
    }
}

/// A live block's size, where the recording does not show it, is PyTorch's: its rounded
/// request, grown over a remainder that `should_split` would not have split off (1 MiB or
/// less in the large pool). Seen in the model's allocated bytes (its internal waste).
#[test]
fn seeded_blocks_keep_the_remainders_pytorch_would_not_split() {
    let mut r = Recorder::default();
    // 19.5 MiB in a 20 MiB segment: the 0.5 MiB remainder is not split off.
    r.segment(0, A, 20 * MIB, 0)
        .alloc(0, A, 39 * MIB / 2, 0)
        .open_window()
        .free(0, A, 0);
    let snap = r.snapshot();
    let recon = snap.reconstruct(0);
    let start = snap.window_start(0, &recon);
    assert_eq!(
        start.live[0].block_size, None,
        "freed in the window: size not shown"
    );
    let mut m = PytorchModel::new("pytorch", PytorchConfig::default(), 80 << 30);
    assert_eq!(m.seed(&start), Ok(0));
    use cistern_replay::AllocatorModel;
    m.alloc(0, 39 * MIB / 2, 0).unwrap();
    assert_eq!(m.allocated(), Some(20 * MIB));
    m.check_invariants().unwrap();
}

/// Where the final state shows the same block (live from before the window to the dump),
/// its recorded size is kept, even where a fresh placement would have split it: here a
/// 12 MiB block holding a 10 MiB request leaves no 2 MiB gap for the window's 1.5 MiB
/// request, so PyTorch made a segment, and so does the seeded model.
#[test]
fn seeded_blocks_keep_the_sizes_the_final_state_shows() {
    let mut r = Recorder::default();
    r.segment(0, A, 20 * MIB, 0)
        .alloc(0, A, 10 * MIB, 0)
        .alloc(0, A + 12 * MIB, 8 * MIB, 0)
        .open_window()
        .segment(0, B, 20 * MIB, 0)
        .alloc(0, B, 3 * MIB / 2, 0);
    let mut snap = r.snapshot();
    let seg = snap.segments.iter_mut().find(|s| s.address == A).unwrap();
    seg.blocks.retain(|b| b.state.is_active());
    seg.blocks[0].size = 12 * MIB;
    let recon = snap.reconstruct(0);
    let start = snap.window_start(0, &recon);
    assert_eq!(start.live[0].block_size, Some(12 * MIB));
    let costs = CostTable::default();
    let seeded = run_from(&recon.sequence, "pytorch", 80 << 30, &costs, &start).unwrap();
    assert_eq!(seeded.peak_reserved, 40 * MIB);
    assert_eq!(
        seeded.peak_reserved,
        recorded(&snap, 0, &recon).peak_reserved
    );
    // Sized by the request alone, the block would leave [10, 12) MiB free, and the request
    // would fit there.
    let mut shown = start.clone();
    shown.live[0].block_size = None;
    let fresh = run_from(&recon.sequence, "pytorch", 80 << 30, &costs, &shown).unwrap();
    assert_eq!(fresh.peak_reserved, 20 * MIB);
}

/// An expandable run that is no whole number of its pool's pages cannot be mapped as it was
/// recorded: it is seeded as a plain segment of its exact size, so the seeded model holds
/// exactly the recorded bytes, and a block in a run after it lands at its recorded offset.
#[test]
fn expandable_runs_are_seeded_at_their_recorded_offsets() {
    use cistern_trace::snapshot::{StartBlock, StartSegment, WindowStart};
    let run = |address: u64, size: u64| StartSegment {
        address,
        size,
        stream: 0,
        small: false,
        expandable: true,
    };
    let start = WindowStart {
        // 30 MiB is no whole number of 20 MiB pages; the runs at +40 and +80 MiB are.
        segments: vec![
            run(A, 30 * MIB),
            run(A + 40 * MIB, 20 * MIB),
            run(A + 80 * MIB, 20 * MIB),
        ],
        live: vec![StartBlock {
            id: 0,
            address: A + 90 * MIB,
            requested: 10 * MIB,
            block_size: None,
            segment: 2,
        }],
        unplaced: vec![],
        inconsistent: 0,
    };
    let config = PytorchConfig {
        expandable_segments: true,
        ..PytorchConfig::default()
    };
    let mut m = PytorchModel::new("pytorch-expandable", config, 80 << 30);
    assert_eq!(m.seed(&start), Ok(0));
    m.check_invariants().unwrap();
    use cistern_replay::AllocatorModel;
    assert_eq!(m.reserved(), 70 * MIB);
    m.alloc(0, 10 * MIB, 0).unwrap();
    // The live block is the second half of the last run: its first half, [80, 90) MiB, is
    // free and takes a 10 MiB request with no growth; the 20 MiB run at +40 takes 20 MiB.
    m.alloc(1, 10 * MIB, 0).unwrap();
    m.alloc(2, 20 * MIB, 0).unwrap();
    assert_eq!(m.reserved(), 70 * MIB);
    m.check_invariants().unwrap();
}

/// A snapshot without history has no window, so nothing to start from: the library's
/// `pytorch-as-recorded` row is not seeded, as the CLI's is not.
#[test]
fn a_snapshot_without_history_is_not_seeded() {
    let mut r = Recorder::default();
    r.segment(0, A, 20 * MIB, 0)
        .alloc(0, A, 4 * MIB, 0)
        .open_window();
    let mut snap = r.snapshot();
    snap.device_traces.clear();
    let opts = cistern_replay::EvalOptions {
        min_capacity: false,
        ..Default::default()
    };
    let rows =
        cistern_replay::evaluate_snapshot(&snap, 0, &[cistern_replay::AS_RECORDED], opts).unwrap();
    assert!(!rows[0].seeded, "{:?}", rows[0]);
}
