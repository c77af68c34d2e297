//! What-if analysis of recorded out-of-memory errors (`cistern whatif`): for each `oom` event of
//! a PyTorch snapshot, the capacity the allocator had at that moment, and whether the request
//! would have fitted under other allocators and settings.
//!
//! This module owns:
//! * the reconstruction of an OOM's moment ([`find_ooms`]): the capacity is PyTorch's recorded
//!   reserved bytes on that device just before the `oom` event (walked back from the final
//!   `segments` through the window's `segment_*` events, so segments from before the window
//!   count) plus the event's `device_free`; the live bytes are the reconstructed sequence's at
//!   that point;
//! * the candidates tried ([`candidates`]): PyTorch with the snapshot's own `allocator_settings`
//!   (the model's verdict against the recording: [`OomReport::reproduced`]), PyTorch with one
//!   setting changed the way people try (`expandable_segments:True`, `max_split_size_mb`,
//!   `roundup_power2_divisions`, `garbage_collection_threshold`), and cistern with its defaults;
//! * the replays ([`analyze_oom`], [`at_capacity`]): each candidate replays the operations before
//!   the OOM on a device of that capacity, then asks for the failed size on its stream; the
//!   headroom is how much smaller (or, negative, larger) the device could have been for that to
//!   fit, found by bisection at [`RESOLUTION`];
//! * the one-line answer ([`OomReport::answer`]).
//!
//! `roundup_power2_divisions` is replayed by rounding each request the way PyTorch's
//! `round_size` does before handing it to the model (the model's own rounding then leaves it as
//! is, and every placement rule of PyTorch's sees the rounded size, as in PyTorch).
//! `garbage_collection_threshold` is not simulated: PyTorch applies it only under
//! `set_per_process_memory_fraction`, and at an OOM its caching allocator already releases every
//! unsplit cached block before giving up, so the threshold cannot free more at that moment.

use cistern::CostTable;
use cistern_trace::snapshot::{Reconstruction, Snapshot};
use cistern_trace::{AllocSequence, Op};
use rustc_hash::FxHashMap;

use crate::catalog::make_with;
use crate::engine::Point;
use crate::model::AllocatorModel;
use crate::pytorch::PytorchModel;
use crate::recorded::reserved_per_op;

mod answer;
mod candidates;

pub use answer::*;
pub use candidates::*;

/// An allocation that failed before the point asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EarlierOom {
    /// Index of the failing operation in the sequence.
    pub op_index: usize,
    /// Its size (as requested).
    pub size: u64,
}

/// One candidate's answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Verdict {
    /// `pytorch` or `cistern`.
    pub allocator: String,
    /// Its configuration (see [`Candidate::conf`]).
    pub conf: String,
    /// The setting changed from the recorded ones, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub change: Option<String>,
    /// Whether these are the recorded settings.
    pub recorded: bool,
    /// Whether the request fits (and everything before it ran); `None`: not simulated.
    pub fits: Option<bool>,
    /// The capacity minus the smallest capacity (at [`RESOLUTION`]) on which it fits: bytes to
    /// spare, or, negative, bytes short. `None`: not simulated, not searched, or it fits on no
    /// device the search tried.
    pub headroom: Option<i64>,
    /// That smallest capacity.
    pub needed: Option<u64>,
    /// The model's reserved bytes when the request came (after the operations before it).
    pub reserved: Option<u64>,
    /// The operation that failed first, when one before the request did.
    pub earlier_oom: Option<EarlierOom>,
    /// Anything a reader of the verdict should know.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Reserved and live over the operations before the request (at most [`PLOT_WINDOW`]).
    #[serde(skip)]
    pub series: Vec<Point>,
}

impl Verdict {
    /// The label of [`Candidate::label`].
    pub fn label(&self) -> String {
        Candidate {
            allocator: self.allocator.clone(),
            conf: self.conf.clone(),
            change: self.change.clone(),
            recorded: self.recorded,
            spec: Spec::NotSimulated(String::new()),
        }
        .label()
    }
}

/// How a report's capacity was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CapacitySource {
    /// Recorded reserved bytes plus `device_free`.
    Reconstructed,
    /// Given by the caller (`--capacity`).
    Given,
}

/// One OOM of a snapshot, with the verdicts. Serializes as `{"device", "stream", "time_us",
/// "size", "device_free", "capacity", "live", "reproduced", "results", ...}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OomReport {
    /// CUDA device.
    pub device: usize,
    /// Stream of the failed request.
    pub stream: u64,
    /// Time of the `oom` event, when recorded.
    pub time_us: Option<i64>,
    /// The failed request, in bytes (PyTorch records it rounded).
    pub size: u64,
    /// The device's free bytes at the OOM.
    pub device_free: Option<u64>,
    /// The capacity the candidates replay on.
    pub capacity: u64,
    /// How [`OomReport::capacity`] was found.
    pub capacity_source: CapacitySource,
    /// PyTorch's recorded reserved bytes on the device at the OOM.
    pub recorded_reserved: u64,
    /// Requested bytes live at the OOM (reconstructed).
    pub live: u64,
    /// Whether the model with the recorded settings fails this request at this capacity (and
    /// not earlier); `None` when it cannot tell.
    pub reproduced: Option<bool>,
    /// Index of the `oom` event in the device's trace.
    pub event: usize,
    /// How many operations of the reconstructed sequence came before it.
    pub ops_before: usize,
    /// Innermost Python frame of the failed request, when recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frame: Option<String>,
    /// One verdict per candidate, in the order of [`candidates`].
    pub results: Vec<Verdict>,
    /// What the reader of the numbers should know (assumptions made).
    pub notes: Vec<String>,
    /// PyTorch's recorded reserved and the live bytes over the operations plotted.
    #[serde(skip)]
    pub recorded_series: Vec<Point>,
}

/// The verdicts on a whole trace at a given capacity (a file without OOM).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CapacityReport {
    /// The trace's name.
    pub trace: String,
    /// CUDA device.
    pub device: usize,
    /// The capacity asked about.
    pub capacity: u64,
    /// Most requested bytes live at once.
    pub peak_live: u64,
    /// One verdict per candidate (`fits`: the whole trace runs).
    pub results: Vec<Verdict>,
}

/// What the analysis does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WhatifOptions {
    /// Replay at this capacity instead of the reconstructed one.
    pub capacity: Option<u64>,
    /// Search each candidate's headroom (about 15 more replays per candidate).
    pub headroom: bool,
    /// Keep series for plots.
    pub series: bool,
    /// Prices of driver calls (they do not change the verdicts).
    pub costs: CostTable,
}

impl Default for WhatifOptions {
    fn default() -> Self {
        WhatifOptions {
            capacity: None,
            headroom: true,
            series: false,
            costs: CostTable::default(),
        }
    }
}

/// A recorded OOM's moment, before any replay.
#[derive(Debug, Clone, PartialEq)]
pub struct OomPoint {
    /// CUDA device.
    pub device: usize,
    /// Index of the `oom` event in the device's trace.
    pub event: usize,
    /// Stream of the request.
    pub stream: u64,
    /// Time, when recorded.
    pub time_us: Option<i64>,
    /// The failed request.
    pub size: u64,
    /// `device_free`.
    pub device_free: Option<u64>,
    /// Recorded reserved bytes just before the event.
    pub recorded_reserved: u64,
    /// Recorded reserved plus `device_free` (`None` without `device_free`).
    pub capacity: Option<u64>,
    /// Live requested bytes.
    pub live: u64,
    /// Operations of the reconstruction before the event.
    pub ops_before: usize,
    /// Innermost Python frame.
    pub frame: Option<String>,
}

/// The OOMs of `device`, located in `recon` (which must be `snapshot.reconstruct(device)`).
pub fn find_ooms(snapshot: &Snapshot, device: usize, recon: &Reconstruction) -> Vec<OomPoint> {
    let curve = snapshot.reserved_curve(device);
    let live = recon.sequence.live_curve();
    snapshot
        .ooms(device)
        .map(|(event, e)| {
            let ops_before = recon
                .op_events
                .partition_point(|o| o.map_or(true, |ev| ev < event));
            let recorded_reserved = curve.before(event);
            OomPoint {
                device,
                event,
                stream: e.stream,
                time_us: e.time_us,
                size: e.size,
                device_free: e.device_free,
                recorded_reserved,
                capacity: e.device_free.map(|f| recorded_reserved.saturating_add(f)),
                live: ops_before.checked_sub(1).map_or(0, |i| live[i]),
                ops_before,
                frame: e.top_frame.as_deref().map(str::to_string),
            }
        })
        .collect()
}

/// Every OOM of `snapshot` on every device, analysed. Errors name what is wrong with the
/// input and how to get an answer anyway.
pub fn analyze_snapshot(
    snapshot: &Snapshot,
    opts: &WhatifOptions,
) -> Result<Vec<OomReport>, String> {
    if !snapshot.has_history() {
        return Err(NO_HISTORY.into());
    }
    let recorded = PytorchSettings::recorded(snapshot.allocator_settings.as_ref());
    let mut settings_note = None;
    let settings = recorded.clone().unwrap_or_else(|| {
        settings_note = Some(
            "the snapshot records no allocator_settings (PyTorch before 2.1?): PyTorch's \
             defaults assumed"
                .to_string(),
        );
        PytorchSettings::default()
    });
    let cands = candidates(&settings);
    let mut out = Vec::new();
    for device in 0..snapshot.device_traces.len() {
        if snapshot.ooms(device).next().is_none() {
            continue;
        }
        let recon = snapshot.reconstruct(device);
        let curve = snapshot.reserved_curve(device);
        let recorded_per_op = opts
            .series
            .then(|| reserved_per_op(snapshot, device, &recon));
        for p in find_ooms(snapshot, device, &recon) {
            let here = format!(
                "device_traces[{device}][{}] (the oom on cuda:{device}{})",
                p.event,
                p.time_us.map(|t| format!(" at {t} us")).unwrap_or_default()
            );
            let (capacity, source) = match (opts.capacity, p.capacity) {
                (Some(c), _) => (c, CapacitySource::Given),
                (None, None) => {
                    return Err(format!(
                        "{here}: an `oom` event without `device_free`: the capacity at the OOM \
                         cannot be reconstructed; pass --capacity SIZE (e.g. the GPU's memory, \
                         --capacity 80GiB) to ask about a capacity you know"
                    ))
                }
                (None, Some(_)) if curve.inconsistent => {
                    return Err(format!(
                        "{here}: the window's segment events free more than the final segments \
                         hold: the reserved bytes at the OOM cannot be reconstructed (a \
                         truncated or edited snapshot?); pass --capacity SIZE to ask about a \
                         capacity you know"
                    ))
                }
                (None, Some(_)) if p.live > p.recorded_reserved => {
                    let why = if snapshot.device_segments(device).next().is_none() {
                        format!("the snapshot has no segment on cuda:{device}")
                    } else {
                        "the segments do not match the events".to_string()
                    };
                    return Err(format!(
                        "{here}: {} live but only {} reserved on the device: {why}, so the \
                         capacity at the OOM cannot be reconstructed; pass --capacity SIZE to \
                         ask about a capacity you know",
                        cistern::format_bytes(p.live),
                        cistern::format_bytes(p.recorded_reserved)
                    ));
                }
                (None, Some(c)) => (c, CapacitySource::Reconstructed),
            };
            let mut rep = analyze_oom(&recon.sequence, &p, capacity, &cands, opts);
            rep.capacity_source = source;
            if let Some(n) = &settings_note {
                rep.notes.push(n.clone());
            }
            if settings.garbage_collection_threshold.is_some() {
                rep.notes.push(
                    "the recorded garbage_collection_threshold is not simulated (see the \
                     garbage_collection_threshold row)"
                        .into(),
                );
            }
            if !recon.anomalies.is_empty() {
                rep.notes.push(format!(
                    "{} inconsistencies in the trace were worked around (see `cistern replay`)",
                    recon.anomalies.len()
                ));
            }
            if let Some(per_op) = &recorded_per_op {
                let live = recon.sequence.live_curve();
                let from = p.ops_before.saturating_sub(PLOT_WINDOW);
                rep.recorded_series = (from..p.ops_before)
                    .map(|i| Point {
                        op: i,
                        reserved: per_op[i],
                        live: live[i],
                    })
                    .chain(std::iter::once(Point {
                        op: p.ops_before,
                        reserved: p.recorded_reserved,
                        live: p.live,
                    }))
                    .collect();
            }
            out.push(rep);
        }
    }
    Ok(out)
}

/// The message for a snapshot without event history.
pub const NO_HISTORY: &str = "a PyTorch snapshot without memory history (no device_traces \
     events): it shows what was live when it was dumped, not the allocations that led there, so \
     an OOM in it cannot be replayed. Record one with history: call \
     cistern_torch.record_oom_snapshot(\"oom.pickle\") at the top of the script (or \
     torch.cuda.memory._record_memory_history() before the run), then run cistern whatif \
     oom.pickle";

/// The candidates for a trace recorded by an allocator other than PyTorch's (an RMM log):
/// no row stands for recorded settings, so no verdict says whether the failure reproduces.
pub fn foreign_candidates() -> Vec<Candidate> {
    let mut c = candidates(&PytorchSettings::default());
    for x in &mut c {
        x.recorded = false;
    }
    c
}

/// Failed allocations of a trace without capacity records (an RMM log's `allocate failure`
/// rows at `(ops_before, size, stream, time_ns)`), replayed on a device of `capacity` bytes
/// (which the caller knows: the file does not say).
pub fn analyze_failures(
    device: usize,
    seq: &AllocSequence,
    failures: &[(usize, u64, u64, Option<u64>)],
    capacity: u64,
    opts: &WhatifOptions,
) -> Vec<OomReport> {
    let cands = foreign_candidates();
    let live = seq.live_curve();
    failures
        .iter()
        .enumerate()
        .map(|(i, &(ops_before, size, stream, time_ns))| {
            let ops_before = ops_before.min(seq.ops.len());
            let p = OomPoint {
                device,
                event: i,
                stream,
                time_us: time_ns.and_then(|t| i64::try_from(t / 1000).ok()),
                size,
                device_free: None,
                recorded_reserved: 0,
                capacity: Some(capacity),
                live: ops_before.checked_sub(1).map_or(0, |k| live[k]),
                ops_before,
                frame: None,
            };
            let mut rep = analyze_oom(seq, &p, capacity, &cands, opts);
            rep.capacity_source = CapacitySource::Given;
            rep.notes.push(
                "recorded by another allocator: its own placement is not modelled, so whether \
                 the replay reproduces the failure is unknown"
                    .into(),
            );
            rep
        })
        .collect()
}

/// The verdicts of `cands` at the OOM `p` of `seq` on a device of `capacity` bytes.
pub fn analyze_oom(
    seq: &AllocSequence,
    p: &OomPoint,
    capacity: u64,
    cands: &[Candidate],
    opts: &WhatifOptions,
) -> OomReport {
    let ops = &seq.ops[..p.ops_before.min(seq.ops.len())];
    let request = Some((p.size, p.stream));
    let results = verdicts(
        ops,
        request,
        p.live.saturating_add(p.size),
        capacity,
        cands,
        opts,
    );
    let reproduced = results
        .iter()
        .find(|v| v.recorded)
        .and_then(|v| v.fits.map(|fits| !fits && v.earlier_oom.is_none()));
    let mut notes = Vec::new();
    if let Some(v) = results.iter().find(|v| v.recorded) {
        if let Some(e) = v.earlier_oom {
            notes.push(format!(
                "with the recorded settings the model runs out earlier, at operation {} ({}), \
                 where PyTorch did not",
                e.op_index,
                cistern::format_bytes(e.size)
            ));
        }
    }
    OomReport {
        device: p.device,
        stream: p.stream,
        time_us: p.time_us,
        size: p.size,
        device_free: p.device_free,
        capacity,
        capacity_source: CapacitySource::Reconstructed,
        recorded_reserved: p.recorded_reserved,
        live: p.live,
        reproduced,
        event: p.event,
        ops_before: p.ops_before,
        frame: p.frame.clone(),
        results,
        notes,
        recorded_series: Vec::new(),
    }
}

/// The verdicts of `cands` on all of `seq` at `capacity` (a trace without OOM): `fits` when
/// the whole trace runs.
pub fn at_capacity(
    trace: &str,
    device: usize,
    seq: &AllocSequence,
    capacity: u64,
    cands: &[Candidate],
    opts: &WhatifOptions,
) -> CapacityReport {
    CapacityReport {
        trace: trace.to_string(),
        device,
        capacity,
        peak_live: seq.peak_live_requested,
        results: verdicts(
            &seq.ops,
            None,
            seq.peak_live_requested,
            capacity,
            cands,
            opts,
        ),
    }
}

/// What one replay saw.
struct Trial {
    earlier: Option<EarlierOom>,
    fits: bool,
    reserved: u64,
    series: Vec<Point>,
}

fn build(spec: &Spec, capacity: u64, costs: &CostTable) -> Option<Box<dyn AllocatorModel>> {
    match spec {
        Spec::Catalog(name) => make_with(name, capacity, costs).ok(),
        Spec::Pytorch(s) => Some(Box::new(PytorchModel::with_costs(
            "pytorch",
            s.model_config(),
            capacity,
            costs,
        ))),
        Spec::NotSimulated(_) => None,
    }
}

/// Replays `ops` on `spec` at `capacity`, then asks for `request` (`(size, stream)`).
fn trial(
    spec: &Spec,
    ops: &[Op],
    request: Option<(u64, u64)>,
    capacity: u64,
    costs: &CostTable,
    keep_series: bool,
) -> Option<Trial> {
    let mut m = build(spec, capacity, costs)?;
    let rounding = match spec {
        Spec::Pytorch(s) if !s.roundup_power2_divisions.is_empty() => Some(s),
        _ => None,
    };
    let round = |size: u64| rounding.map_or(size, |s| s.round(size));
    let mut sizes: FxHashMap<u64, u64> = FxHashMap::default();
    let mut live = 0u64;
    let mut max_id = 0u64;
    let from = ops.len().saturating_sub(PLOT_WINDOW);
    let mut series = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, stream } => {
                max_id = max_id.max(id);
                if m.alloc(id, round(size), stream).is_err() {
                    return Some(Trial {
                        earlier: Some(EarlierOom { op_index: i, size }),
                        fits: false,
                        reserved: m.reserved(),
                        series,
                    });
                }
                sizes.insert(id, size);
                live += size;
            }
            Op::Free { id } => {
                if let Some(s) = sizes.remove(&id) {
                    live -= s;
                }
                m.free(id);
            }
        }
        if keep_series && i >= from {
            series.push(Point {
                op: i,
                reserved: m.reserved(),
                live,
            });
        }
    }
    let reserved = m.reserved();
    let fits = match request {
        None => true,
        Some((size, stream)) => {
            let ok = m
                .alloc(max_id.wrapping_add(1).max(1), round(size), stream)
                .is_ok();
            if keep_series {
                series.push(Point {
                    op: ops.len(),
                    reserved: m.reserved(),
                    live: live + if ok { size } else { 0 },
                });
            }
            ok
        }
    };
    Some(Trial {
        earlier: None,
        fits,
        reserved,
        series,
    })
}

fn verdicts(
    ops: &[Op],
    request: Option<(u64, u64)>,
    floor: u64,
    capacity: u64,
    cands: &[Candidate],
    opts: &WhatifOptions,
) -> Vec<Verdict> {
    let one = |c: &Candidate| -> Verdict {
        let mut v = Verdict {
            allocator: c.allocator.clone(),
            conf: c.conf.clone(),
            change: c.change.clone(),
            recorded: c.recorded,
            fits: None,
            headroom: None,
            needed: None,
            reserved: None,
            earlier_oom: None,
            note: None,
            series: Vec::new(),
        };
        let Some(t) = trial(&c.spec, ops, request, capacity, &opts.costs, opts.series) else {
            v.note = Some(match &c.spec {
                Spec::NotSimulated(why) => why.clone(),
                Spec::Catalog(name) => format!("`{name}` could not be built"),
                Spec::Pytorch(_) => "could not be built".into(),
            });
            return v;
        };
        v.fits = Some(t.fits);
        v.reserved = Some(t.reserved);
        v.earlier_oom = t.earlier;
        v.series = t.series;
        if opts.headroom {
            let ok = |cap: u64| {
                trial(&c.spec, ops, request, cap, &opts.costs, false).is_some_and(|t| t.fits)
            };
            v.needed = smallest_fit(ok, t.fits, floor, capacity);
            v.headroom = v.needed.map(|n| {
                if n <= capacity {
                    i64::try_from(capacity - n).unwrap_or(i64::MAX)
                } else {
                    -i64::try_from(n - capacity).unwrap_or(i64::MAX)
                }
            });
            if v.needed.is_none() && !t.fits {
                v.note =
                    Some("fits on no device the search tried (up to 64 times this one)".into());
            }
        }
        v
    };
    // The candidates are independent: one thread each (the machine decides how many run).
    std::thread::scope(|s| {
        let handles: Vec<_> = cands.iter().map(|c| s.spawn(move || one(c))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a whatif replay panicked"))
            .collect()
    })
}

/// The smallest capacity, a multiple of [`RESOLUTION`] or `capacity` itself, on which `ok`
/// holds, given whether it holds at `capacity`; no capacity below `floor` (the live bytes plus
/// the request) can hold. Found by bisection (a boundary, if `ok` is not monotonic).
fn smallest_fit(ok: impl Fn(u64) -> bool, fits: bool, floor: u64, capacity: u64) -> Option<u64> {
    let res = RESOLUTION;
    if fits {
        // Units k give k * res; the last unit is `capacity` itself.
        let top = capacity.div_ceil(res);
        let value = |k: u64| if k >= top { capacity } else { k * res };
        let (mut lo, mut hi) = ((floor / res).min(top), top);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if ok(value(mid)) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        return Some(value(hi));
    }
    // Grow until it fits (at most 64 times the capacity), then bisect down.
    let mut lo = capacity / res + 1;
    let mut step = (capacity / 16).max(res).div_ceil(res);
    let limit = capacity.saturating_mul(64).max(floor.saturating_mul(2)) / res + 1;
    let mut hi = (floor.div_ceil(res)).max(lo);
    loop {
        if ok(hi.saturating_mul(res)) {
            break;
        }
        lo = hi + 1;
        hi = hi.saturating_add(step);
        step = step.saturating_mul(2);
        if hi > limit {
            return None;
        }
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if ok(mid * res) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(hi * res)
}
