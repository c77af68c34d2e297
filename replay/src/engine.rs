//! The replay engine: runs an [`AllocSequence`] through an [`AllocatorModel`] and measures it
//! ([`replay`]), finds the smallest device that runs it ([`min_capacity`]), and evaluates a list
//! of allocators on one sequence ([`evaluate`]).
//!
//! Metrics, per allocator (the fragmentation suite's definitions):
//! * `peak_reserved`: the most bytes the allocator held from the device after any operation;
//! * `peak_live`: the most *requested* bytes live at once (before any rounding);
//! * `frag` = `1 - peak_live / peak_reserved`;
//! * `internal_waste`: at the moment of peak reserved, bytes in live blocks as the allocator
//!   sized them minus the bytes requested (rounding, unsplit remainders);
//! * `min_capacity`: the smallest simulated device, at a 2 MiB resolution, that replays the
//!   whole sequence without running out of memory;
//! * `driver_calls` by kind, and `ops_per_sec`: allocator operations per second of the replay
//!   loop (which also does the engine's own bookkeeping: a hash-map update and a `reserved()`
//!   read per operation, the same for every model; the criterion bench measures the bare
//!   throughput);
//! * `driver_time_us`: modelled host time of the driver calls, each priced by the
//!   [`CostTable`] the model was made with (default: published per-call figures; see
//!   [`cistern::driver::sim::cost`]). Host waits add nothing unless the table prices them;
//! * `host_waits`: calls that blocked the host on GPU work (event, stream or device
//!   synchronisation, `cudaFree`'s implicit device synchronisation); their cost is GPU idle
//!   time, which a trace without kernels cannot tell;
//! * `pages_moved`: physical pages unmapped from one place and mapped again at another
//!   (cistern: stitched pages; 0 for the other models, which never move a page);
//! * `steady_driver_calls`: driver calls made after the operation at which peak reserved was
//!   first reached: the churn that repeats once an allocator has all the memory it will hold.

use std::collections::BTreeMap;
use std::time::Instant;

use cistern_trace::{AllocSequence, Op, WindowStart};
use rustc_hash::FxHashMap;

use cistern::CostTable;

use crate::catalog::make_with;
use crate::model::{AllocatorModel, Oom, SeedError};

/// At most this many points are kept in [`ReplayResult::series`].
pub const MAX_SERIES_POINTS: usize = 2000;
/// Resolution of [`min_capacity`]: one 2 MiB page, the driver's granularity.
pub const CAPACITY_RESOLUTION: u64 = 2 << 20;
/// Bound on the replays one [`min_capacity`] search makes.
pub const MAX_BISECTION_STEPS: u32 = 40;
/// The capacity [`evaluate`] uses when none is given: an 80 GiB device.
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

/// One point of the reserved/live curve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Point {
    /// Index of the operation after which the values were taken.
    pub op: usize,
    /// Reserved bytes.
    pub reserved: u64,
    /// Live requested bytes.
    pub live: u64,
}

/// Where a replay ran out of memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OomAt {
    /// Index of the failing `Alloc` in the sequence.
    pub op_index: usize,
    /// What the model said.
    pub oom: Oom,
}

/// The measurements of one allocator on one sequence. Serializes as
/// `{"allocator", "peak_reserved", "peak_live", "frag", "internal_waste", "min_capacity",
/// "driver_calls", "driver_time_us", "host_waits", "pages_moved", "hazards",
/// "steady_driver_calls", "ops_per_sec", "ops", "capacity", "oom", "pre_window_bytes",
/// "seeded", "note"}` (the last three only when set); the time series is kept out of the JSON
/// (it is for plots).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplayResult {
    /// Allocator name.
    pub allocator: String,
    /// Most bytes reserved after any operation.
    pub peak_reserved: u64,
    /// Most requested bytes live at once (over the operations replayed).
    pub peak_live: u64,
    /// `1 - peak_live / peak_reserved` (0 when nothing was reserved).
    pub frag: f64,
    /// Live block bytes minus requested bytes at the peak of reserved, when the model knows.
    pub internal_waste: Option<u64>,
    /// Smallest capacity that replays without OOM, when computed.
    pub min_capacity: Option<u64>,
    /// Driver calls by kind.
    pub driver_calls: BTreeMap<String, u64>,
    /// Modelled host time of the driver calls, in microseconds.
    pub driver_time_us: f64,
    /// Driver calls that blocked the host on GPU work.
    pub host_waits: u64,
    /// Physical pages unmapped and mapped again elsewhere (cistern's stitched pages).
    pub pages_moved: u64,
    /// Memory unmapped, released or handed out under pending simulated GPU work (only with
    /// `--gpu-lag`): 0 unless the model has a bug.
    pub hazards: u64,
    /// Driver calls made after the operation at which peak reserved was first reached.
    pub steady_driver_calls: u64,
    /// Allocator operations per second of the replay loop (`None` for recorded rows).
    pub ops_per_sec: Option<f64>,
    /// Operations replayed (all of them unless the model ran out of memory).
    pub ops: usize,
    /// Simulated device capacity, for models.
    pub capacity: Option<u64>,
    /// The first allocation that failed, if any; the replay stops there.
    pub oom: Option<OomAt>,
    /// Recorded rows: the bytes the recording allocator held when the trace's window opened
    /// (segments cached or in use before the first event), when the trace records them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pre_window_bytes: Option<u64>,
    /// Models: whether the replay started from the recorded allocator state at the window's
    /// start ([`run_from`]) instead of an empty device.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub seeded: bool,
    /// Anything a reader of the numbers should know.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Reserved and live over the sequence, downsampled to at most [`MAX_SERIES_POINTS`]
    /// points (each the highest-reserved point of its stretch of operations).
    #[serde(skip)]
    pub series: Vec<Point>,
}

/// One trace's results, serialized as the CLI's `--json` document for a trace:
/// `{"trace": ..., "results": [...]}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TraceReport {
    /// The trace's name (file name or workload name).
    pub trace: String,
    /// One row per allocator, in the order asked.
    pub results: Vec<ReplayResult>,
}

/// `1 - live / reserved`, or 0 when nothing was reserved.
pub fn frag(peak_live: u64, peak_reserved: u64) -> f64 {
    if peak_reserved == 0 {
        0.0
    } else {
        1.0 - peak_live as f64 / peak_reserved as f64
    }
}

/// Keeps the highest-reserved point of each stretch of `stride` operations.
pub(crate) struct SeriesBuilder {
    stride: usize,
    points: Vec<Point>,
    best: Option<Point>,
    in_bucket: usize,
}

impl SeriesBuilder {
    pub(crate) fn new(n_ops: usize) -> Self {
        SeriesBuilder {
            stride: n_ops.div_ceil(MAX_SERIES_POINTS).max(1),
            points: Vec::new(),
            best: None,
            in_bucket: 0,
        }
    }

    pub(crate) fn push(&mut self, p: Point) {
        match self.best {
            Some(b) if b.reserved >= p.reserved => {}
            _ => self.best = Some(p),
        }
        self.in_bucket += 1;
        if self.in_bucket == self.stride {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if let Some(b) = self.best.take() {
            self.points.push(b);
        }
        self.in_bucket = 0;
    }

    pub(crate) fn finish(mut self) -> Vec<Point> {
        self.flush();
        self.points
    }
}

/// Replays `seq` through `model`, stopping at the first allocation that fails.
pub fn replay(seq: &AllocSequence, model: &mut dyn AllocatorModel) -> ReplayResult {
    let mut sizes: FxHashMap<u64, u64> = FxHashMap::default();
    let mut live = 0u64;
    let mut peak_live = 0u64;
    let mut peak_reserved = 0u64;
    let mut waste_at_peak: Option<u64> = None;
    // Calls made before the first operation (a pool's setup) are not churn either.
    let mut calls_at_peak = model.total_driver_calls();
    let mut series = SeriesBuilder::new(seq.ops.len());
    let mut oom = None;
    let mut done = 0usize;
    let start = Instant::now();
    for (i, op) in seq.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, stream } => {
                if let Err(e) = model.alloc(id, size, stream) {
                    oom = Some(OomAt {
                        op_index: i,
                        oom: e,
                    });
                    break;
                }
                sizes.insert(id, size);
                live += size;
                peak_live = peak_live.max(live);
            }
            Op::Free { id } => {
                if let Some(s) = sizes.remove(&id) {
                    live -= s;
                }
                model.free(id);
            }
        }
        done = i + 1;
        let reserved = model.reserved();
        if reserved > peak_reserved {
            peak_reserved = reserved;
            waste_at_peak = model.allocated().map(|a| a.saturating_sub(live));
            calls_at_peak = model.total_driver_calls();
        }
        series.push(Point {
            op: i,
            reserved,
            live,
        });
    }
    let secs = start.elapsed().as_secs_f64();
    let cost = model.cost();
    ReplayResult {
        allocator: model.name().to_string(),
        peak_reserved,
        peak_live,
        frag: frag(peak_live, peak_reserved),
        internal_waste: waste_at_peak,
        min_capacity: None,
        driver_calls: model.driver_calls(),
        driver_time_us: cost.driver_time_us,
        host_waits: cost.host_waits,
        pages_moved: cost.pages_moved,
        hazards: cost.hazards,
        // No peak reached (nothing reserved): no steady state to speak of.
        steady_driver_calls: if peak_reserved == 0 {
            0
        } else {
            model.total_driver_calls().saturating_sub(calls_at_peak)
        },
        ops_per_sec: (secs > 0.0).then(|| done as f64 / secs),
        ops: done,
        capacity: None,
        oom,
        pre_window_bytes: None,
        seeded: false,
        note: None,
        series: series.finish(),
    }
}

/// The result of a model that could not start from a recorded state because the device
/// cannot hold it: out of memory before its first operation.
fn failed_to_seed(model: &dyn AllocatorModel, oom: Oom) -> ReplayResult {
    let cost = model.cost();
    // Nothing ran: no peak, and the seed's own calls (reset by the model) belong to no window.
    ReplayResult {
        allocator: model.name().to_string(),
        peak_reserved: 0,
        peak_live: 0,
        frag: 0.0,
        internal_waste: None,
        min_capacity: None,
        driver_calls: model.driver_calls(),
        driver_time_us: cost.driver_time_us,
        host_waits: cost.host_waits,
        pages_moved: cost.pages_moved,
        hazards: cost.hazards,
        steady_driver_calls: 0,
        ops_per_sec: None,
        ops: 0,
        capacity: None,
        oom: Some(OomAt { op_index: 0, oom }),
        pre_window_bytes: None,
        seeded: true,
        note: None,
        series: Vec::new(),
    }
}

/// Makes the model `name` with `capacity` and replays `seq` on it, pricing driver calls with
/// the default [`CostTable`].
pub fn run(seq: &AllocSequence, name: &str, capacity: u64) -> Result<ReplayResult, String> {
    run_with(seq, name, capacity, &CostTable::default())
}

/// [`run`] with driver calls priced by `costs`.
pub fn run_with(
    seq: &AllocSequence,
    name: &str,
    capacity: u64,
    costs: &CostTable,
) -> Result<ReplayResult, String> {
    let mut m = make_with(name, capacity, costs)?;
    let mut r = replay(seq, m.as_mut());
    r.capacity = Some(capacity);
    Ok(r)
}

/// [`run_with`] starting from the recorded allocator state `start` (a snapshot's
/// [`WindowStart`], taken with the reconstruction `seq` came from): the model reserves the
/// recorded segments and places the blocks live then before the first operation, whose
/// initial allocations bind to them ([`AllocatorModel::seed`]). The result says `seeded`.
/// A model that cannot start from a recorded state is an error; a device too small for it is
/// an out-of-memory result at operation 0.
pub fn run_from(
    seq: &AllocSequence,
    name: &str,
    capacity: u64,
    costs: &CostTable,
    start: &WindowStart,
) -> Result<ReplayResult, String> {
    let mut m = make_with(name, capacity, costs)?;
    let mut r = match m.seed(start) {
        Ok(anew) => {
            let mut r = replay(seq, m.as_mut());
            if anew > 0 {
                r.note = Some(format!(
                    "{anew} blocks live at the window's start fit no recorded place and were \
                     allocated anew"
                ));
            }
            r
        }
        Err(SeedError::Unsupported(e)) => return Err(e),
        Err(SeedError::Oom(oom)) => failed_to_seed(m.as_ref(), oom),
    };
    r.seeded = true;
    r.capacity = Some(capacity);
    Ok(r)
}

/// [`min_capacity`] for runs that start from `start` ([`run_from`]).
pub fn min_capacity_from(
    seq: &AllocSequence,
    allocator: &str,
    start: &WindowStart,
) -> Result<u64, String> {
    let costs = CostTable::default();
    bisect_capacity(seq, allocator, CAPACITY_RESOLUTION, start.bytes(), |cap| {
        run_from(seq, allocator, cap, &costs, start)
    })
}

/// The smallest device capacity (a multiple of [`CAPACITY_RESOLUTION`]) on which `allocator`
/// replays `seq` without running out of memory, found by bisection.
///
/// The search first finds a capacity that works (the peak reserved of a run on a device four
/// times the peak live, doubling until one succeeds), then bisects between the peak live bytes
/// (no allocator can run on less) and that. Runs are deterministic, so each capacity has one
/// answer; an allocator whose success is not monotonic in the capacity gets *a* boundary.
pub fn min_capacity(seq: &AllocSequence, allocator: &str) -> Result<u64, String> {
    min_capacity_with(seq, allocator, CAPACITY_RESOLUTION)
}

/// [`min_capacity`] at a chosen resolution (bytes, at least 1).
pub fn min_capacity_with(
    seq: &AllocSequence,
    allocator: &str,
    resolution: u64,
) -> Result<u64, String> {
    bisect_capacity(seq, allocator, resolution, 0, |cap| {
        run(seq, allocator, cap)
    })
}

/// The search of [`min_capacity_with`], with `run` replaying on a device of the given bytes;
/// every run needs `floor` bytes besides the sequence's live bytes (a seeded run's recorded
/// state).
fn bisect_capacity(
    seq: &AllocSequence,
    allocator: &str,
    resolution: u64,
    floor: u64,
    run: impl Fn(u64) -> Result<ReplayResult, String>,
) -> Result<u64, String> {
    let res = resolution.max(1);
    let ok =
        |units: u64| -> Result<bool, String> { Ok(run(units.saturating_mul(res))?.oom.is_none()) };
    let peak_live = seq.peak_live_requested.max(seq.peak_live());
    let mut probe = (peak_live.saturating_mul(4))
        .max(1 << 30)
        .max(floor.saturating_add(peak_live).saturating_mul(2))
        .div_ceil(res);
    let mut steps = 0;
    let hi_run = loop {
        let r = run(probe.saturating_mul(res))?;
        steps += 1;
        if r.oom.is_none() {
            break r;
        }
        if steps >= 12 {
            return Err(format!(
                "{allocator}: runs out of memory even with {} bytes",
                probe.saturating_mul(res)
            ));
        }
        probe = probe.saturating_mul(2);
    };
    // A run that never failed behaves the same on any device at least as large as its peak.
    let mut hi = hi_run.peak_reserved.div_ceil(res).max(1).min(probe);
    if hi < probe {
        steps += 1;
        if !ok(hi)? {
            hi = probe;
        }
    }
    let mut lo = (peak_live.max(floor) / res).max(1).min(hi);
    while lo < hi && steps < MAX_BISECTION_STEPS {
        let mid = lo + (hi - lo) / 2;
        steps += 1;
        if ok(mid)? {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(hi.saturating_mul(res))
}

/// What [`evaluate`] computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalOptions {
    /// Simulated device capacity for the main replay.
    pub capacity: u64,
    /// Also bisect for the smallest capacity (costs about 20 replays per allocator).
    pub min_capacity: bool,
    /// The price of each driver call kind (default: the published figures).
    pub costs: CostTable,
}

impl Default for EvalOptions {
    fn default() -> Self {
        EvalOptions {
            capacity: DEFAULT_CAPACITY,
            min_capacity: true,
            costs: CostTable::default(),
        }
    }
}

/// Replays `seq` on each allocator in `allocators`, in order.
pub fn evaluate(
    seq: &AllocSequence,
    allocators: &[&str],
    opts: EvalOptions,
) -> Result<Vec<ReplayResult>, String> {
    allocators
        .iter()
        .map(|name| {
            let mut r = run_with(seq, name, opts.capacity, &opts.costs)?;
            if opts.min_capacity {
                r.min_capacity = Some(min_capacity(seq, name)?);
            }
            Ok(r)
        })
        .collect()
}
