//! Every development trace parses, and every reconstruction is consistent with the final state.

use std::time::Instant;

use cistern_trace::minimalloc;
use cistern_trace::snapshot::{Action, Snapshot};
use cistern_trace::Op;

/// Check one device's reconstruction; returns a one-line summary.
fn check_device(file: &str, snap: &Snapshot, device: usize) -> String {
    let r = snap.reconstruct(device);
    assert!(
        r.anomalies.is_empty(),
        "{file} device {device}: anomalies {:?}",
        r.anomalies
    );
    let stats = r
        .sequence
        .replay()
        .unwrap_or_else(|e| panic!("{file} device {device}: invalid sequence: {e}"));
    assert_eq!(stats.peak_live, r.sequence.peak_live_requested);
    assert_eq!(r.op_events.len(), r.sequence.ops.len());

    // The final live set equals the final active blocks (as a multiset of requested sizes).
    let mut trace_end: Vec<u64> = stats.live_at_end.iter().map(|&(_, s)| s).collect();
    let mut seg_end: Vec<u64> = snap
        .device_segments(device)
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state.is_active())
        .map(|b| b.requested_or_size())
        .collect();
    trace_end.sort_unstable();
    seg_end.sort_unstable();
    assert_eq!(
        trace_end, seg_end,
        "{file} device {device}: final live set differs from the final active blocks"
    );
    assert_eq!(
        stats.live_bytes_at_end(),
        snap.active_requested_bytes(device)
    );

    // Live bytes never exceed what PyTorch had reserved at that moment (checked at every
    // op that comes from an event; reserved is piecewise constant between segment events).
    let curve = snap.reserved_curve(device);
    assert!(!curve.inconsistent, "{file} device {device}: reserved < 0");
    let live = r.sequence.live_curve();
    let mut reserved = curve.start;
    let mut points = curve.points.iter().peekable();
    for (k, ev) in r.op_events.iter().enumerate() {
        if let Some(ev) = ev {
            while let Some(&&(i, v)) = points.peek() {
                if i > *ev {
                    break;
                }
                reserved = v;
                points.next();
            }
            assert!(
                live[k] <= reserved,
                "{file} device {device}: op {k} (event {ev}) live {} > reserved {reserved}",
                live[k]
            );
        }
    }
    assert_eq!(curve.points.last().map_or(curve.start, |p| p.1), curve.end);

    // The state at the window's start: the segments walked back from the final ones hold
    // exactly the reserved bytes the curve starts from, and every block live then lies in one
    // of them, inside its bounds, no two overlapping.
    let w = snap.window_start(device, &r);
    assert_eq!(w.inconsistent, 0, "{file} device {device}: segment events");
    assert_eq!(
        w.bytes(),
        curve.start,
        "{file} device {device}: start bytes"
    );
    assert!(
        w.unplaced.is_empty(),
        "{file} device {device}: unplaced {:?}",
        w.unplaced
    );
    assert_eq!(w.live.len(), r.sequence.initially_live);
    for pair in w.live.windows(2) {
        assert!(
            pair[0].address + pair[0].requested <= pair[1].address,
            "{file} device {device}: live blocks overlap at {:#x}",
            pair[1].address
        );
    }
    for b in &w.live {
        let s = &w.segments[b.segment];
        assert!(b.address >= s.address && b.address + b.requested <= s.address + s.size);
    }

    let n_alloc = snap
        .events(device)
        .iter()
        .filter(|e| e.action == Action::Alloc)
        .count();
    format!(
        "dev {device}: {} events ({n_alloc} alloc), {} ops, initially live {} ({} from frees, {} from segments), \
         peak live {} B, live at end {} B, reserved start {} / peak {} / end {} B, {} segments at the start, frees at {}",
        snap.events(device).len(),
        r.sequence.ops.len(),
        r.sequence.initially_live,
        r.initial_from_frees,
        r.initial_from_segments,
        r.sequence.peak_live_requested,
        stats.live_bytes_at_end(),
        curve.start,
        curve.peak(),
        curve.end,
        w.segments.len(),
        if r.used_free_completed { "free_completed" } else { "free_requested" },
    )
}

fn check_snapshot_dir(sub: &str, test: &str) -> usize {
    let Some(dir) = crate::common::traces_dir(test) else {
        return 0;
    };
    let files = crate::common::files(&dir, sub, ".pickle");
    for path in &files {
        let file = crate::common::name(path);
        let bytes = std::fs::read(path).unwrap();
        let t = Instant::now();
        let snap = Snapshot::from_bytes(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        let parse = t.elapsed();
        eprintln!(
            "{file}: {} bytes parsed in {:.0} ms, {} segments",
            bytes.len(),
            parse.as_secs_f64() * 1e3,
            snap.segments.len()
        );
        // Generous even for a debug build on a loaded machine; typical is far lower.
        assert!(parse.as_secs() < 10, "{file}: parsing took {parse:?}");
        let devices = snap.device_traces.len().max(
            snap.segments
                .iter()
                .map(|s| s.device as usize + 1)
                .max()
                .unwrap_or(0),
        );
        for d in 0..devices {
            eprintln!("  {}", check_device(&file, &snap, d));
        }
    }
    files.len()
}

#[test]
fn history_snapshots_parse_and_reconstruct_consistently() {
    let n = check_snapshot_dir("pytorch_snapshots", "history snapshots");
    eprintln!("{n} history snapshots checked");
}

#[test]
fn state_snapshots_parse_and_reconstruct_consistently() {
    let n = check_snapshot_dir("pytorch_state_snapshots", "state snapshots");
    eprintln!("{n} state snapshots checked");
}

/// Numbers computed with Python's own `pickle` module on the same files: event counts and the
/// final state's totals (which do not depend on the reconstruction), and the peaks of a separate
/// Python implementation of the same reconstruction rule.
#[test]
fn history_snapshots_match_python_pickle() {
    let Some(dir) = crate::common::traces_dir("python cross-check") else {
        return;
    };
    // file, events, segments, active blocks, final reserved, peak live, reserved at start
    type Row = (&'static str, usize, usize, usize, u64, u64, u64);
    let expected: &[Row] = &[
        (
            "cs336-silmont2000__small_mem_snapshot.pickle",
            97,
            9,
            10,
            3_781_165_056,
            3_249_143_816,
            0,
        ),
        (
            "cs336-wedsonlin__gpt-medium_train_ctx512.pickle",
            22_332,
            400,
            885,
            12_660_506_624,
            12_426_629_128,
            12_593_397_760,
        ),
        (
            "decomfl__federated-zeroth-order-llm-finetune.pickle",
            23_105,
            61,
            397,
            1_897_922_560,
            1_783_664_516,
            0,
        ),
    ];
    for &(file, events, segments, active, reserved, peak_live, reserved_start) in expected {
        let path = dir.join("pytorch_snapshots").join(file);
        if !path.exists() {
            eprintln!("skipping {file}: not present");
            continue;
        }
        let snap = Snapshot::read(&path).unwrap();
        assert_eq!(snap.events(0).len(), events, "{file}");
        assert_eq!(snap.segments.len(), segments, "{file}");
        let n_active = snap
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state.is_active())
            .count();
        assert_eq!(n_active, active, "{file}");
        assert_eq!(snap.reserved_bytes(0), reserved, "{file}");
        assert_eq!(
            snap.alloc_free_sequence(0).peak_live_requested,
            peak_live,
            "{file}"
        );
        assert_eq!(snap.reserved_curve(0).start, reserved_start, "{file}");
    }
}

#[test]
fn minimalloc_challenging_instances_fit_their_capacity() {
    let Some(dir) = crate::common::traces_dir("minimalloc") else {
        return;
    };
    let files = crate::common::files(&dir, "static_lifetimes/minimalloc_challenging", ".csv");
    for path in &files {
        let file = crate::common::name(path);
        // The capacity is the number in the file name, e.g. `A.1048576.csv`.
        let capacity: u64 = file
            .split('.')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("{file}: no capacity in the name"));
        let s = minimalloc::read_csv(path, 1).unwrap_or_else(|e| panic!("{file}: {e}"));
        let stats = s.replay().unwrap();
        assert_eq!(stats.allocs, stats.frees, "{file}: every buffer is freed");
        assert!(
            s.peak_live_requested <= capacity,
            "{file}: peak live {} above capacity {capacity}",
            s.peak_live_requested
        );
        let scaled = minimalloc::read_csv(path, 3).unwrap();
        assert_eq!(scaled.peak_live_requested, 3 * s.peak_live_requested);
        // Same order of ops whatever the scale.
        let ids = |s: &cistern_trace::AllocSequence| -> Vec<u64> {
            s.ops
                .iter()
                .map(|o| match *o {
                    Op::Alloc { id, .. } | Op::Free { id } => id,
                })
                .collect()
        };
        assert_eq!(ids(&s), ids(&scaled));
        eprintln!(
            "{file}: {} buffers, peak live {} = {:.3} of capacity",
            stats.allocs,
            s.peak_live_requested,
            s.peak_live_requested as f64 / capacity as f64
        );
    }
    eprintln!("{} minimalloc instances checked", files.len());
}

/// The public snapshots committed in `trace/testdata/public-snapshots` (gzip-compressed, with
/// their sources in its README): always present, so this runs everywhere, CI included. Every
/// one parses, and every device's reconstruction is consistent with its final state.
#[test]
fn public_snapshots_parse_and_reconstruct_consistently() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/public-snapshots");
    let files = crate::common::files(&dir, ".", ".pickle.gz");
    assert!(
        files.len() >= 31,
        "{} snapshots in {}",
        files.len(),
        dir.display()
    );
    for path in &files {
        let file = crate::common::name(path);
        let gz = std::fs::read(path).unwrap();
        let bytes =
            cistern_trace::kineto::decompress(&gz).unwrap_or_else(|e| panic!("{file}: {e}"));
        let snap = Snapshot::from_bytes(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        let devices = snap.device_traces.len().max(
            snap.segments
                .iter()
                .map(|s| s.device as usize + 1)
                .max()
                .unwrap_or(0),
        );
        for d in 0..devices {
            eprintln!("{file}: {}", check_device(&file, &snap, d));
        }
    }
}
