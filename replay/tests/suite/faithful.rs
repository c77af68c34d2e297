//! Proof that the `pytorch` model is a faithful baseline: on the dev traces (real PyTorch
//! memory snapshots with event history), the model's peak reserved bytes are within 2% of
//! what PyTorch itself reserved (`pytorch-recorded`, from the snapshot's `segment_*` events),
//! on at least 80% of them.
//!
//! # What is compared
//!
//! A snapshot's history is a ring buffer: the window opens mid-run with blocks already live.
//! The reconstructed sequence starts with those blocks as `Alloc`s (in address order), then
//! replays the window. PyTorch's recorded reserved curve starts at the level of the window's
//! start (the final segments minus the window's net segment events). Both peaks therefore cover
//! the same window from the same live set; the model's only unknown is *how* PyTorch laid out
//! the blocks that were live at the start (and which cached free segments it held then), which
//! depends on the run's history before the window.
//!
//! Three of the traces record segment events in the window (`small_mem`: 9 `segment_alloc`s
//! from an empty allocator; `decomfl`: 61; `gpt-medium_train_ctx512`: 1); on the others PyTorch's
//! reserved bytes are flat over the window, so the model's peak is compared with that level.
//! Both groups are checked: each must meet the 80%/2% bar on its own.
//!
//! # Residual differences (all within 2% at the time of writing)
//!
//! * Traces that start from an empty allocator (`small_mem`, `decomfl`) match exactly: the
//!   model sees the whole history.
//! * `magma27 transformer-lm` (-0.7%) and the `gpt-medium` traces (within ±0.5%): the window
//!   starts with hundreds of live blocks (parameters, optimizer state). PyTorch placed them over
//!   a history the window does not show, which also left some cached free segments that the
//!   model never creates (the model reads low), or packed some blocks tighter than a fresh
//!   best-fit placement in address order does (the model reads high, e.g. `train_ctx256`,
//!   +0.45%). Simulated addresses also differ from the real ones, so ties between equal-sized
//!   free blocks (broken by address in PyTorch's ordering) can go the other way.
//!
//! Any trace that misses the 2% bar is printed with its difference; if one ever does, the
//! explanation belongs in the list above.

use std::path::PathBuf;

use cistern_replay::recorded::reserved_per_op;
use cistern_replay::{
    make, recorded, run, AllocatorModel, PytorchConfig, PytorchModel, ReplayResult,
};
use cistern_trace::{Op, Snapshot};

fn traces_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("CISTERN_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"));
    let snaps = dir.join("pytorch_snapshots");
    if snaps.is_dir() {
        Some(snaps)
    } else {
        eprintln!(
            "skipping: no dev traces at {} (set CISTERN_TRACES_DIR)",
            snaps.display()
        );
        None
    }
}

struct Row {
    name: String,
    /// PyTorch's reserved bytes after each op, when the window starts from an empty allocator.
    empty_start_curve: Option<(cistern_trace::AllocSequence, Vec<u64>)>,
    segment_events: bool,
    recorded: ReplayResult,
    model: ReplayResult,
}

impl Row {
    fn diff(&self) -> f64 {
        (self.model.peak_reserved as f64 - self.recorded.peak_reserved as f64)
            / self.recorded.peak_reserved as f64
    }

    fn within(&self) -> bool {
        self.diff().abs() <= 0.02
    }
}

/// Every snapshot's rows, computed once for all tests of this file.
fn rows(dir: &std::path::Path) -> &'static [Row] {
    static ROWS: std::sync::OnceLock<Vec<Row>> = std::sync::OnceLock::new();
    ROWS.get_or_init(|| compute_rows(dir))
}

fn compute_rows(dir: &std::path::Path) -> Vec<Row> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("readable traces dir")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let snap = Snapshot::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let recon = snap.reconstruct(0);
        let rec = recorded(&snap, 0, &recon);
        let curve = snap.reserved_curve(0);
        // 80 GiB: larger than the device any of these traces ran on, so the model never hits
        // an OOM that PyTorch did not.
        let model = run(&recon.sequence, "pytorch", 80 << 30).expect("pytorch is registered");
        assert!(model.oom.is_none(), "{}: {:?}", f.display(), model.oom);
        let empty_start_curve = (recon.sequence.initially_live == 0)
            .then(|| (recon.sequence.clone(), reserved_per_op(&snap, 0, &recon)));
        out.push(Row {
            empty_start_curve,
            name: f
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            segment_events: !curve.points.is_empty(),
            recorded: rec,
            model,
        });
    }
    out
}

#[test]
fn pytorch_model_matches_recorded_peak_reserved() {
    let Some(dir) = traces_dir() else { return };
    let rows = rows(&dir);
    assert!(!rows.is_empty(), "no snapshots in {}", dir.display());
    eprintln!(
        "{:<62} {:>9} {:>13} {:>13} {:>8}",
        "trace", "seg evts", "recorded MiB", "model MiB", "diff %"
    );
    for r in rows {
        eprintln!(
            "{:<62} {:>9} {:>13.1} {:>13.1} {:>+8.2}{}",
            r.name,
            if r.segment_events { "yes" } else { "flat" },
            r.recorded.peak_reserved as f64 / (1 << 20) as f64,
            r.model.peak_reserved as f64 / (1 << 20) as f64,
            100.0 * r.diff(),
            if r.within() { "" } else { "  <- over 2%" }
        );
    }
    for (group, with_events) in [("with segment events", true), ("flat reserved", false)] {
        let g: Vec<&Row> = rows
            .iter()
            .filter(|r| r.segment_events == with_events)
            .collect();
        if g.is_empty() {
            continue;
        }
        let ok = g.iter().filter(|r| r.within()).count();
        assert!(
            ok * 5 >= g.len() * 4,
            "{group}: only {ok} of {} traces within 2% of PyTorch's recorded peak",
            g.len()
        );
    }
}

/// The recorded row's curve is consistent with the sequence: its live bytes are the
/// sequence's, and reserved never drops below live where PyTorch recorded segment events.
#[test]
fn recorded_rows_are_consistent() {
    let Some(dir) = traces_dir() else { return };
    for r in rows(&dir) {
        assert_eq!(r.recorded.peak_live, r.model.peak_live, "{}", r.name);
        assert!(
            r.recorded.peak_reserved >= r.recorded.peak_live,
            "{}",
            r.name
        );
        assert_eq!(r.recorded.allocator, "pytorch-recorded");
        let max = r.recorded.series.iter().map(|p| p.reserved).max();
        assert!(max <= Some(r.recorded.peak_reserved), "{}", r.name);
    }
}

/// Where the window starts from an empty allocator, the model sees PyTorch's whole history, so
/// its reserved bytes must equal PyTorch's after *every* operation, not just at the peak.
#[test]
fn empty_start_traces_match_after_every_op() {
    let Some(dir) = traces_dir() else { return };
    let mut checked = 0;
    for r in rows(&dir) {
        let Some((seq, curve)) = &r.empty_start_curve else {
            continue;
        };
        let mut m = make("pytorch", 80 << 30).expect("registered");
        let mut ids = std::collections::HashSet::new();
        for (i, op) in seq.ops.iter().enumerate() {
            match *op {
                cistern_trace::Op::Alloc { id, size, stream } => {
                    m.alloc(id, size, stream).expect("80 GiB is enough");
                    ids.insert(id);
                }
                cistern_trace::Op::Free { id } => m.free(id),
            }
            assert_eq!(
                m.reserved(),
                curve[i],
                "{}: reserved after op {i} ({op:?})",
                r.name
            );
        }
        checked += 1;
    }
    eprintln!("{checked} traces start from an empty allocator and match op by op");
}

/// `evaluate_snapshot` puts the recorded row beside the models, in the order asked.
#[test]
fn evaluate_snapshot_rows_in_order() {
    let Some(dir) = traces_dir() else { return };
    let snap = Snapshot::read(dir.join("cs336-silmont2000__small_mem_snapshot.pickle"))
        .expect("dev trace");
    let opts = cistern_replay::EvalOptions {
        min_capacity: false,
        ..Default::default()
    };
    let names = cistern_replay::default_allocators(true);
    let rows = cistern_replay::evaluate_snapshot(&snap, 0, &names, opts).expect("evaluates");
    let got: Vec<&str> = rows.iter().map(|r| r.allocator.as_str()).collect();
    assert_eq!(got, names);
    assert_eq!(rows[0].peak_reserved, 3606 << 20);
    assert_eq!(rows[0].driver_calls.get("mem_alloc"), Some(&9));
}

/// Every snapshot to check: the dev traces when present, and the public snapshots committed in
/// `trace/testdata/public-snapshots` (always), parsed, in file-name order.
fn all_snapshots() -> Vec<(String, Snapshot)> {
    let mut files: Vec<PathBuf> = Vec::new();
    if let Some(dir) = traces_dir() {
        files.extend(
            std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == "pickle")),
        );
    }
    let public =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../trace/testdata/public-snapshots");
    files.extend(
        std::fs::read_dir(&public)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(".pickle.gz")),
    );
    files.sort();
    files
        .iter()
        .map(|f| {
            let bytes = std::fs::read(f).unwrap();
            // Gzipped or not.
            let plain = cistern_trace::kineto::decompress(&bytes).unwrap();
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            (name, Snapshot::from_bytes(&plain).unwrap())
        })
        .collect()
}

/// Traces where `pytorch-as-recorded` is allowed more than 5% off the recording, each with
/// the reason (none at the time of writing; see the model's module docs for the misses of
/// the unseeded `pytorch` row).
const EXPLAINED_OVER_5_PERCENT: &[(&str, &str)] = &[];

/// `pytorch-as-recorded` (the recorded settings, started from the recorded state at the
/// window's start where the recording held memory from before it) against
/// `pytorch-recorded`, on every snapshot with history: the dev traces when present, and the
/// public snapshots committed in `trace/testdata/public-snapshots`, always. Within 2% on at
/// least 90% of them, and none further than 5% without a written reason.
#[test]
fn as_recorded_matches_the_recording_on_every_snapshot() {
    let opts = cistern_replay::EvalOptions {
        min_capacity: false,
        ..Default::default()
    };
    let names = [
        cistern_replay::RECORDED,
        cistern_replay::AS_RECORDED,
        "pytorch",
    ];
    let (mut n, mut within) = (0, 0);
    let mut unexplained = Vec::new();
    eprintln!(
        "{:<58} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "trace", "recorded", "pre-window", "pytorch", "as-rec.", "diff %"
    );
    for (name, snap) in all_snapshots() {
        if !snap.has_history() {
            continue;
        }
        let rows = cistern_replay::evaluate_snapshot(&snap, 0, &names, opts).unwrap();
        let (rec, asr, py) = (&rows[0], &rows[1], &rows[2]);
        assert_eq!(asr.allocator, cistern_replay::AS_RECORDED);
        let pre = rec.pre_window_bytes.unwrap_or(0);
        assert_eq!(asr.seeded, pre > 0, "{name}");
        let diff = (asr.peak_reserved as f64 - rec.peak_reserved as f64) / rec.peak_reserved as f64;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        eprintln!(
            "{:<58} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>+8.2}",
            name,
            mib(rec.peak_reserved),
            mib(pre),
            mib(py.peak_reserved),
            mib(asr.peak_reserved),
            100.0 * diff
        );
        n += 1;
        if diff.abs() <= 0.02 {
            within += 1;
        }
        if diff.abs() > 0.05
            && !EXPLAINED_OVER_5_PERCENT
                .iter()
                .any(|(t, _)| name.starts_with(t))
        {
            unexplained.push(format!("{name}: {:+.1}%", 100.0 * diff));
        }
    }
    assert!(n >= 15, "only {n} snapshots with history");
    assert!(
        within * 10 >= n * 9,
        "only {within} of {n} snapshots within 2% of the recording"
    );
    assert!(
        unexplained.is_empty(),
        "over 5% without a reason: {unexplained:?}"
    );
}

/// Three streams, written by hand as PyTorch's caching allocator would record them, with the
/// segment events its source gives (`CUDACachingAllocator.cpp`; each step names the rule).
/// The model, replaying the reconstructed sequence on a 100 MiB device, must reserve what
/// PyTorch reserved after every operation.
#[test]
fn three_streams_follow_the_source_op_by_op() {
    use crate::common::oom_traces::{Recorder, MIB};
    const S1: u64 = 0x11;
    const S2: u64 = 0x22;
    const S3: u64 = 0x33;
    let seg = |k: u64| 0x7f00_0000_0000 + k * 0x1000_0000;
    let (a, b, c, d, e, f, g) = (seg(0), seg(1), seg(2), seg(3), seg(4), seg(5), seg(6));
    let mut r = Recorder::default();
    // x1: S1's pools are empty: get_allocation_size(4 MiB) = 20 MiB (kLargeBuffer).
    r.segment(0, a, 20 * MIB, S1).alloc(0, a, 4 * MIB, S1);
    // y1: S1's free remainder of A is not S2's (pools order blocks by (stream, size, ptr)).
    r.segment(0, b, 20 * MIB, S2).alloc(0, b, 4 * MIB, S2);
    // x1 was used on S2 (record_stream) and freed: insert_events; it stays out of the pool.
    r.free_requested(0, a, S1);
    // x2, 18 MiB on S1: x1's event has not completed, so A offers 16 MiB, too little; a
    // segment of its own (>= kMinLargeAlloc: rounded to 2 MiB).
    r.segment(0, c, 18 * MIB, S1).alloc(0, c, 18 * MIB, S1);
    // process_events at the next malloc: x1's event completed, free_block merges A whole.
    r.free_completed(0, a, S1);
    // x3, 18 MiB on S1: best fit is A (20 MiB), split (remainder 2 MiB > kSmallSize).
    r.alloc(0, a, 18 * MIB, S1);
    // z1, 512 KiB on S3: the small pool, a 2 MiB segment (kSmallBuffer).
    r.segment(0, d, 2 * MIB, S3).alloc(0, d, 512 << 10, S3);
    // y2, 16 MiB on S2: B's 16 MiB remainder, exactly.
    r.alloc(0, b + 4 * MIB, 16 * MIB, S2);
    // z2, 15 MiB on S3: a 16 MiB segment; the 1 MiB remainder is not split off.
    r.segment(0, e, 16 * MIB, S3)
        .alloc(0, e, 15 * MIB, S3)
        .free(0, e, S3);
    // x4, 14 MiB on S1: E is free but S3's; A's remainder is 2 MiB: a new segment.
    r.segment(0, f, 14 * MIB, S1).alloc(0, f, 14 * MIB, S1);
    // x3 freed (A whole again); x4 used on S2 and freed: pending.
    r.free(0, a, S1).free_requested(0, f, S1);
    // y3, 30 MiB on S2 with 90 of 100 MiB reserved: cudaMalloc fails; no max_split_size,
    // so release_available_cached_blocks does nothing; release_cached_blocks synchronises
    // every outstanding event first (x4 completes) and frees every unsplit cached segment
    // of every stream, large pool in (stream, size, ptr) order: F (S1, 14), A (S1, 20),
    // E (S3, 16); D (split by z1), B, C are kept. The retry succeeds.
    r.free_completed(0, f, S1)
        .segment_free(0, f, S1)
        .segment_free(0, a, S1)
        .segment_free(0, e, S3)
        .segment(0, g, 30 * MIB, S2)
        .alloc(0, g, 30 * MIB, S2);
    let snap = Snapshot::from_bytes(&r.snapshot().to_pickle()).expect("round trip");
    let recon = snap.reconstruct(0);
    assert!(recon.anomalies.is_empty(), "{:?}", recon.anomalies);
    assert_eq!(recon.sequence.initially_live, 0);
    let curve = reserved_per_op(&snap, 0, &recon);
    // PyTorch's reserved MiB after each alloc and each completed free, by the steps above.
    let expected_mib = [20, 40, 58, 58, 58, 60, 60, 76, 76, 90, 90, 90, 70];
    let got: Vec<u64> = curve.iter().map(|b| b >> 20).collect();
    assert_eq!(
        got, expected_mib,
        "the recorded curve is the hand derivation"
    );

    let mut m = PytorchModel::new("pytorch", PytorchConfig::default(), 100 * MIB);
    for (i, op) in recon.sequence.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, stream } => m.alloc(id, size, stream).unwrap(),
            Op::Free { id } => m.free(id),
        }
        m.check_invariants().unwrap();
        assert_eq!(m.reserved(), curve[i], "after op {i} ({op:?})");
    }
    assert_eq!(m.counters().num_alloc_retries, 1);
    // Freed at free_requested instead (a trace without free_completed), x2 would have fit in
    // A: the model would read 18 MiB lower from op 2 on. The timing is what makes it match.
    let mut early = Recorder::default();
    early
        .segment(0, a, 20 * MIB, S1)
        .alloc(0, a, 4 * MIB, S1)
        .free(0, a, S1)
        .alloc(0, a, 18 * MIB, S1);
    let snap = early.snapshot();
    let recon = snap.reconstruct(0);
    let r = cistern_replay::run(&recon.sequence, "pytorch", 100 * MIB).unwrap();
    assert_eq!(r.peak_reserved, 20 * MIB);
}

/// Seeded, the model follows PyTorch's reserved bytes after every operation, not only at the
/// peak, on every snapshot whose recording held memory from before its window: it
/// needs no segment PyTorch did not make, and makes the ones PyTorch made when PyTorch did.
#[test]
fn seeded_models_follow_the_recorded_curve_op_by_op() {
    let (mut checked, mut with_growth) = (0, 0);
    for (name, snap) in all_snapshots() {
        let recon = snap.reconstruct(0);
        let start = snap.window_start(0, &recon);
        if !snap.has_history() || start.is_empty() {
            continue;
        }
        let curve = reserved_per_op(&snap, 0, &recon);
        let config = PytorchConfig {
            expandable_segments: snap
                .allocator_settings
                .as_ref()
                .and_then(|a| a.expandable_segments)
                .unwrap_or(false),
            ..PytorchConfig::default()
        };
        let mut m = PytorchModel::new("pytorch", config, 141 << 30);
        m.seed(&start).unwrap();
        for (i, op) in recon.sequence.ops.iter().enumerate() {
            match *op {
                Op::Alloc { id, size, stream } => m.alloc(id, size, stream).unwrap(),
                Op::Free { id } => m.free(id),
            }
            assert_eq!(m.reserved(), curve[i], "{name}: after op {i} ({op:?})");
        }
        checked += 1;
        with_growth += usize::from(curve.last() != curve.first());
    }
    eprintln!("{checked} seeded snapshots follow their curve ({with_growth} grow in the window)");
    // The public snapshots alone have 19.
    assert!(checked >= 19, "{checked}");
}
