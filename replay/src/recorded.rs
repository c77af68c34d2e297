//! PyTorch's recorded baseline: the `pytorch-recorded` row, built from a snapshot's own
//! `segment_*` events (what PyTorch really reserved over the trace window), not from a model.

use std::collections::BTreeMap;

use cistern_trace::snapshot::{Action, Reconstruction, Snapshot};

use cistern_trace::WindowStart;

use crate::catalog::{as_recorded, AS_RECORDED, RECORDED};
use crate::engine::{
    evaluate, frag, min_capacity, min_capacity_from, run_from, run_with, EvalOptions, Point,
    ReplayResult, SeriesBuilder,
};

/// PyTorch's reserved bytes after each operation of `recon.sequence` (which must be
/// `snapshot.reconstruct(device)`): the level of the last segment event at or before the
/// operation's trace event; the window's starting level for the reconstructed initial
/// allocations.
pub fn reserved_per_op(snapshot: &Snapshot, device: usize, recon: &Reconstruction) -> Vec<u64> {
    let curve = snapshot.reserved_curve(device);
    let mut reserved = curve.start;
    let mut next_point = 0;
    (0..recon.sequence.ops.len())
        .map(|i| {
            if let Some(Some(ev)) = recon.op_events.get(i) {
                while let Some(&(pe, r)) = curve.points.get(next_point) {
                    if pe > *ev {
                        break;
                    }
                    reserved = r;
                    next_point += 1;
                }
            }
            reserved
        })
        .collect()
}

/// The `pytorch-recorded` row of `device`'s window, aligned with `recon`'s operations (which
/// must be `snapshot.reconstruct(device)`).
///
/// * `peak_reserved`: the highest point of [`Snapshot::reserved_curve`], including its start
///   (the reserved bytes when the window opened, computed back from the final segments);
/// * `peak_live`: the reconstructed sequence's peak of requested bytes;
/// * `pre_window_bytes`: the bytes of the segments that existed when the window opened
///   ([`Snapshot::window_start`]);
/// * `driver_calls`: `segment_alloc` counted as `mem_alloc`, `segment_free` as `mem_free`,
///   `segment_map` as `map`, `segment_unmap` as `unmap` (the window's events only);
/// * `internal_waste`, `min_capacity`, `ops_per_sec`: unknown (`None`);
/// * `driver_time_us`, `host_waits`, `pages_moved`, `steady_driver_calls`: not known from
///   segment events (0).
pub fn recorded(snapshot: &Snapshot, device: usize, recon: &Reconstruction) -> ReplayResult {
    let start = snapshot.window_start(device, recon);
    recorded_with(snapshot, device, recon, &start)
}

/// [`recorded()`] with `start`, the snapshot's [`Snapshot::window_start`], already computed.
fn recorded_with(
    snapshot: &Snapshot,
    device: usize,
    recon: &Reconstruction,
    start: &WindowStart,
) -> ReplayResult {
    let curve = snapshot.reserved_curve(device);
    let events = snapshot.events(device);
    let mut calls: BTreeMap<String, u64> = BTreeMap::new();
    for e in events {
        let key = match e.action {
            Action::SegmentAlloc => "mem_alloc",
            Action::SegmentFree => "mem_free",
            Action::SegmentMap => "map",
            Action::SegmentUnmap => "unmap",
            _ => continue,
        };
        *calls.entry(key.to_string()).or_default() += 1;
    }
    let live = recon.sequence.live_curve();
    let mut series = SeriesBuilder::new(live.len());
    for (i, (&l, reserved)) in live
        .iter()
        .zip(reserved_per_op(snapshot, device, recon))
        .enumerate()
    {
        series.push(Point {
            op: i,
            reserved,
            live: l,
        });
    }
    let peak_reserved = curve.peak();
    let peak_live = recon.sequence.peak_live_requested;
    let mut notes = Vec::new();
    if curve.points.is_empty() {
        notes.push("no segment events in the window: reserved is flat".to_string());
    }
    if curve.inconsistent {
        notes.push("segment events disagree with the final segments; start clamped to 0".into());
    }
    ReplayResult {
        allocator: RECORDED.to_string(),
        peak_reserved,
        peak_live,
        frag: frag(peak_live, peak_reserved),
        internal_waste: None,
        min_capacity: None,
        driver_calls: calls,
        driver_time_us: 0.0,
        host_waits: 0,
        pages_moved: 0,
        hazards: 0,
        steady_driver_calls: 0,
        ops_per_sec: None,
        ops: live.len(),
        capacity: None,
        oom: None,
        // The segments walked back from the final ones (`Snapshot::window_start`), as the
        // seeded models start from them; the curve's start is the same sum when the events
        // agree with the final state.
        pre_window_bytes: Some(start.bytes()),
        seeded: false,
        note: (!notes.is_empty()).then(|| notes.join("; ")),
        series: series.finish(),
    }
}

/// Evaluates `device`'s window of `snapshot` on each of `allocators`, in order; the name
/// [`RECORDED`] (`pytorch-recorded`) stands for the [`recorded()`] row, [`AS_RECORDED`] for
/// PyTorch's model with the recorded settings started from the recorded state at the window's
/// start, and the others are models replayed by [`evaluate`] on the reconstructed sequence
/// from an empty device.
pub fn evaluate_snapshot(
    snapshot: &Snapshot,
    device: usize,
    allocators: &[&str],
    opts: EvalOptions,
) -> Result<Vec<ReplayResult>, String> {
    let recon = snapshot.reconstruct(device);
    // A snapshot without history reconstructs no window: its ops are its final state, and
    // there is no earlier state to start from.
    let window_start = snapshot.window_start(device, &recon);
    let none = WindowStart::default();
    let start = if snapshot.events(device).is_empty() {
        &none
    } else {
        &window_start
    };
    allocators
        .iter()
        .map(|&name| {
            if name == RECORDED {
                Ok(recorded_with(snapshot, device, &recon, &window_start))
            } else if name == AS_RECORDED {
                as_recorded_row(snapshot, &recon, start, opts)
            } else {
                evaluate(&recon.sequence, &[name], opts)?
                    .pop()
                    .ok_or_else(|| format!("{name}: no result"))
            }
        })
        .collect()
}

/// The [`AS_RECORDED`] row: PyTorch's model with the snapshot's recorded settings, started
/// from the recorded state at the window's start when there was one ([`run_from`]).
fn as_recorded_row(
    snapshot: &Snapshot,
    recon: &Reconstruction,
    start: &WindowStart,
    opts: EvalOptions,
) -> Result<ReplayResult, String> {
    let (spec, mut note) = as_recorded(snapshot.allocator_settings.as_ref());
    let seq = &recon.sequence;
    let mut r = if start.is_empty() {
        run_with(seq, &spec, opts.capacity, &opts.costs)?
    } else {
        note.push_str("; started from the recorded state at the window's start");
        run_from(seq, &spec, opts.capacity, &opts.costs, start)?
    };
    if opts.min_capacity {
        r.min_capacity = Some(if start.is_empty() {
            min_capacity(seq, &spec)?
        } else {
            min_capacity_from(seq, &spec, start)?
        });
    }
    r.allocator = AS_RECORDED.to_string();
    r.note = Some(note);
    Ok(r)
}

/// The rows a report shows by default: `pytorch-recorded` first for snapshots, then every
/// model of [`crate::ALLOCATORS`].
pub fn default_allocators(is_snapshot: bool) -> Vec<&'static str> {
    let mut v = Vec::with_capacity(crate::ALLOCATORS.len() + 1);
    if is_snapshot {
        v.push(RECORDED);
    }
    v.extend_from_slice(crate::ALLOCATORS);
    v
}
