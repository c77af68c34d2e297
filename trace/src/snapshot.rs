//! PyTorch CUDA memory snapshots (`torch.cuda.memory._snapshot()` / `_dump_snapshot()` pickles).
//!
//! A snapshot holds the allocator state at dump time (`segments`, each with its `blocks`) and,
//! when `_record_memory_history()` was on, a ring buffer of events per device
//! (`device_traces`). [`Snapshot::reconstruct`] turns one device's events into a replayable
//! [`AllocSequence`], rebuilding the blocks that were already live when the ring buffer's window
//! opened the way PyTorch's `MemoryViz.js` does: by walking back from the final state.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::addrmap::{AddrAnomaly, AddrSequencer};
use crate::pickle::{self, PickleError, Value};
use crate::sequence::AllocSequence;

mod window;
pub use window::{StartBlock, StartSegment, WindowStart};

/// Error reading a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The bytes are not a readable pickle.
    #[error("pickle: {0}")]
    Pickle(#[from] PickleError),
    /// The pickle does not have the shape of a memory snapshot.
    #[error("{path}: expected {expected}, found {found}")]
    Shape {
        /// Where, e.g. `segments[3].blocks[2].size`.
        path: String,
        /// What was expected there.
        expected: String,
        /// What was there instead.
        found: String,
    },
}

/// State of a block at dump time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out to the program.
    ActiveAllocated,
    /// Freed by the program, waiting for stream events before it can be reused.
    ActivePendingFree,
    /// Cached free memory.
    Inactive,
    /// Any other state string.
    Other(String),
}

impl BlockState {
    fn parse(s: &str) -> Self {
        match s {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" => BlockState::ActivePendingFree,
            "inactive" => BlockState::Inactive,
            other => BlockState::Other(other.to_string()),
        }
    }

    /// Whether the block still holds a live allocation (allocated or pending free).
    pub fn is_active(&self) -> bool {
        matches!(
            self,
            BlockState::ActiveAllocated | BlockState::ActivePendingFree
        )
    }
}

/// A block inside a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Device address (computed from the segment address and the sizes of the blocks before it
    /// when an old layout does not record it).
    pub address: u64,
    /// Rounded size of the block.
    pub size: u64,
    /// Bytes the program asked for, when recorded.
    pub requested_size: Option<u64>,
    /// State at dump time.
    pub state: BlockState,
}

impl Block {
    /// The requested size when known, else the block size.
    pub fn requested_or_size(&self) -> u64 {
        self.requested_size.unwrap_or(self.size)
    }
}

/// A segment (one `cudaMalloc` or one expandable mapping) at dump time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// CUDA device index.
    pub device: u64,
    /// Base address.
    pub address: u64,
    /// Reserved bytes.
    pub total_size: u64,
    /// Stream the segment belongs to.
    pub stream: u64,
    /// `"large"` or `"small"` pool, when recorded.
    pub segment_type: Option<String>,
    /// Bytes in allocated blocks, when recorded.
    pub allocated_size: Option<u64>,
    /// Bytes in active blocks, when recorded.
    pub active_size: Option<u64>,
    /// Whether the segment is (part of) an expandable segment (`is_expandable`, written by
    /// PyTorch 2.1 and later), when recorded.
    pub is_expandable: Option<bool>,
    /// The blocks, in address order.
    pub blocks: Vec<Block>,
}

/// What a trace event records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The program allocated `size` requested bytes at `addr`.
    Alloc,
    /// The program freed the block at `addr` (older snapshots call it `free`).
    FreeRequested,
    /// The block at `addr` became reusable (its stream uses completed).
    FreeCompleted,
    /// `cudaMalloc` of a new segment.
    SegmentAlloc,
    /// `cudaFree` of a segment.
    SegmentFree,
    /// Expandable segments: pages mapped.
    SegmentMap,
    /// Expandable segments: pages unmapped.
    SegmentUnmap,
    /// An allocation failed (`addr` holds the device's free bytes).
    Oom,
    /// A snapshot was taken.
    Snapshot,
    /// Any other action string.
    Other(String),
}

impl Action {
    fn parse(s: &str) -> Self {
        match s {
            "alloc" => Action::Alloc,
            "free_requested" | "free" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "oom" => Action::Oom,
            "snapshot" => Action::Snapshot,
            other => Action::Other(other.to_string()),
        }
    }
}

/// One entry of a device's trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// What happened.
    pub action: Action,
    /// Device address (for `oom`, the device's free bytes, as in [`TraceEvent::device_free`]).
    pub addr: u64,
    /// Bytes (requested size for `alloc` and frees, segment size for `segment_*`).
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Timestamp in microseconds, when recorded.
    pub time_us: Option<i64>,
    /// Innermost Python frame as `file:line function`, when the event has Python frames.
    pub top_frame: Option<Arc<str>>,
    /// For `oom`: the device's free bytes (`cudaMemGetInfo`) when the allocation failed, from
    /// the event's `device_free` key (PyTorch writes it instead of `addr`); `None` when an
    /// `oom` event lacks it, and for every other action.
    pub device_free: Option<u64>,
}

/// A parsed memory snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Allocator state at dump time.
    pub segments: Vec<Segment>,
    /// Events per device (index = device); empty when the snapshot has no history.
    pub device_traces: Vec<Vec<TraceEvent>>,
    /// The allocator's settings at dump time (`allocator_settings`, written by newer PyTorch);
    /// `None` when the snapshot has none.
    pub allocator_settings: Option<AllocatorSettings>,
}

/// `allocator_settings` of a snapshot: the caching allocator's configuration when it was
/// dumped. Typed where the replay models use the setting; every other key is kept by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocatorSettings {
    /// `PYTORCH_CUDA_ALLOC_CONF` as the program set it (PyTorch's `last_allocator_settings`).
    pub conf: Option<String>,
    /// `expandable_segments`.
    pub expandable_segments: Option<bool>,
    /// `max_split_size` in bytes; `None` when unlimited (PyTorch writes `SIZE_MAX` as -1) or
    /// absent.
    pub max_split_size: Option<u64>,
    /// `roundup_power2_divisions`, as `(interval start in MiB, divisions)` pairs in ascending
    /// order: sizes from that power of two up to the next use that many divisions (the first
    /// interval also takes everything smaller, the last everything larger). 0 or 1: off. Empty
    /// when absent.
    pub roundup_power2_divisions: Vec<(u64, u64)>,
    /// `garbage_collection_threshold` (0 when off).
    pub garbage_collection_threshold: Option<f64>,
    /// Every other key, with its value written as Python would print it.
    pub other: Vec<(String, String)>,
}

impl Eq for AllocatorSettings {}

impl AllocatorSettings {
    /// Whether any setting differs from PyTorch's defaults (a conf string alone counts only
    /// when it is not empty).
    pub fn is_default(&self) -> bool {
        self.expandable_segments != Some(true)
            && self.max_split_size.is_none()
            && self.roundup_power2_divisions.iter().all(|&(_, d)| d <= 1)
            && self.garbage_collection_threshold.unwrap_or(0.0) <= 0.0
    }
}

/// Something in a trace that does not fit the final state or itself. The reconstruction works
/// around each one so that the sequence stays valid, and reports it here. The same type as the
/// other address-keyed readers' [`AddrAnomaly`] (`event` is the index in the device trace).
pub type Anomaly = AddrAnomaly;

/// The result of [`Snapshot::reconstruct`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reconstruction {
    /// The replayable sequence.
    pub sequence: AllocSequence,
    /// For each op of `sequence.ops`, the index of the device-trace event it came from (`None`
    /// for the reconstructed initial allocations).
    pub op_events: Vec<Option<usize>>,
    /// For each initial allocation (the first `sequence.initially_live` ops, whose ids are
    /// their indices), the address of its block.
    pub initial_addrs: Vec<Option<u64>>,
    /// How many initial allocations came from frees of blocks never allocated in the window.
    pub initial_from_frees: usize,
    /// How many initial allocations came from final active blocks that never appear in the window.
    pub initial_from_segments: usize,
    /// Whether frees were taken from `free_completed` (else from `free_requested`).
    pub used_free_completed: bool,
    /// Inconsistencies found and worked around.
    pub anomalies: Vec<Anomaly>,
}

/// PyTorch's reserved bytes over a trace window, from the `segment_*` events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservedCurve {
    /// Reserved bytes when the window opened: the final total minus the window's net change.
    pub start: u64,
    /// `(event index, reserved bytes after that event)` for each segment event.
    pub points: Vec<(usize, u64)>,
    /// Reserved bytes at dump time (sum of the device's segment sizes).
    pub end: u64,
    /// The window's segment events would make the start negative (the trace and the final
    /// state disagree); `start` was clamped to 0.
    pub inconsistent: bool,
}

impl ReservedCurve {
    /// Reserved bytes just before event `event` of the window: after every segment event
    /// before it (the start when there is none).
    pub fn before(&self, event: usize) -> u64 {
        let n = self.points.partition_point(|&(i, _)| i < event);
        n.checked_sub(1).map_or(self.start, |k| self.points[k].1)
    }

    /// Largest reserved value over the window, including its start.
    pub fn peak(&self) -> u64 {
        self.points
            .iter()
            .map(|&(_, r)| r)
            .fold(self.start, u64::max)
    }
}

impl Snapshot {
    /// Read a snapshot pickle from a file.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, SnapshotError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| SnapshotError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes)
    }

    /// Parse a snapshot pickle.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SnapshotError> {
        // A real snapshot spends several bytes on each segment, block and event; a hostile one
        // could reference one shared dict millions of times and make the expansion quadratic.
        Self::from_value_limited(&pickle::from_slice(bytes)?, bytes.len())
    }

    /// Interpret an already parsed pickle. Accepts the dict layout (`segments`, optional
    /// `device_traces`) and the oldest layout, a bare list of segments.
    pub fn from_value(v: &Value) -> Result<Self, SnapshotError> {
        Self::from_value_limited(v, usize::MAX)
    }

    /// [`Snapshot::from_value`], failing once more than `max_items` segments, blocks and events
    /// have been read.
    pub fn from_value_limited(v: &Value, max_items: usize) -> Result<Self, SnapshotError> {
        let mut budget = Budget(max_items);
        let (segments_v, traces_v) = match v {
            Value::Dict(_) => (
                v.get("segments")
                    .ok_or_else(|| shape("snapshot", "a `segments` key", "none"))?,
                v.get("device_traces"),
            ),
            Value::List(_) => (v, None),
            other => return Err(shape("snapshot", "a dict or list", other.type_name())),
        };
        let segs = seq(segments_v, "segments")?;
        let mut segments = Vec::with_capacity(segs.len());
        for (i, s) in segs.iter().enumerate() {
            let path = format!("segments[{i}]");
            budget.spend(1, &path)?;
            if let Some(b) = s.get("blocks").and_then(Value::as_seq) {
                budget.spend(b.len(), &path)?;
            }
            segments.push(parse_segment(s, &path)?);
        }
        let mut device_traces = Vec::new();
        match traces_v {
            None | Some(Value::None) => {}
            Some(t) => {
                for (d, dev) in seq(t, "device_traces")?.iter().enumerate() {
                    let path = format!("device_traces[{d}]");
                    let evs = seq(dev, &path)?;
                    budget.spend(evs.len(), &path)?;
                    let mut out = Vec::with_capacity(evs.len());
                    for (i, e) in evs.iter().enumerate() {
                        out.push(parse_event(e, d, i)?);
                    }
                    device_traces.push(out);
                }
            }
        }
        let allocator_settings = match v {
            Value::Dict(_) => match v.get("allocator_settings") {
                None | Some(Value::None) => None,
                Some(a) => Some(parse_settings(a)?),
            },
            _ => None,
        };
        Ok(Snapshot {
            segments,
            device_traces,
            allocator_settings,
        })
    }

    /// The events of `device` (empty if none were recorded).
    pub fn events(&self, device: usize) -> &[TraceEvent] {
        self.device_traces
            .get(device)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The `oom` events of `device`, with their index in its trace.
    pub fn ooms(&self, device: usize) -> impl Iterator<Item = (usize, &TraceEvent)> {
        self.events(device)
            .iter()
            .enumerate()
            .filter(|(_, e)| e.action == Action::Oom)
    }

    /// Whether the snapshot recorded any event history: an event other than `snapshot` (a
    /// state-only snapshot's trace may hold just that one).
    pub fn has_history(&self) -> bool {
        self.device_traces
            .iter()
            .flatten()
            .any(|e| e.action != Action::Snapshot)
    }

    /// The segments of `device`.
    pub fn device_segments(&self, device: usize) -> impl Iterator<Item = &Segment> {
        self.segments
            .iter()
            .filter(move |s| s.device == device as u64)
    }

    /// Sum of segment sizes of `device` at dump time.
    pub fn reserved_bytes(&self, device: usize) -> u64 {
        self.device_segments(device).map(|s| s.total_size).sum()
    }

    /// Sum of requested sizes of the active blocks of `device` at dump time.
    pub fn active_requested_bytes(&self, device: usize) -> u64 {
        self.active_blocks(device)
            .map(|(_, b)| b.requested_or_size())
            .sum()
    }

    fn active_blocks(&self, device: usize) -> impl Iterator<Item = (&Segment, &Block)> {
        self.device_segments(device)
            .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
            .filter(|(_, b)| b.state.is_active())
    }

    /// PyTorch's reserved-bytes curve over `device`'s trace window, from the `segment_*` events.
    pub fn reserved_curve(&self, device: usize) -> ReservedCurve {
        let events = self.events(device);
        let delta = |e: &TraceEvent| -> i128 {
            match e.action {
                Action::SegmentAlloc | Action::SegmentMap => i128::from(e.size),
                Action::SegmentFree | Action::SegmentUnmap => -i128::from(e.size),
                _ => 0,
            }
        };
        let end = self.reserved_bytes(device);
        let net: i128 = events.iter().map(delta).sum();
        let start = i128::from(end) - net;
        let inconsistent = start < 0;
        let mut cur = start.max(0);
        let mut points = Vec::new();
        for (i, e) in events.iter().enumerate() {
            let d = delta(e);
            if d != 0 {
                cur += d;
                let clamped = u64::try_from(cur.max(0)).unwrap_or(u64::MAX);
                points.push((i, clamped));
            }
        }
        ReservedCurve {
            start: u64::try_from(start.max(0)).unwrap_or(u64::MAX),
            points,
            end,
            inconsistent,
        }
    }

    /// The replayable allocation sequence of `device` (see [`Snapshot::reconstruct`]).
    pub fn alloc_free_sequence(&self, device: usize) -> AllocSequence {
        self.reconstruct(device).sequence
    }

    /// Rebuild `device`'s allocation history as a valid sequence.
    ///
    /// * Frees are taken at `free_completed` (when memory becomes reusable), or at
    ///   `free_requested` when the trace has no `free_completed` event at all.
    /// * Blocks freed in the window but never allocated in it were live when it opened; so were
    ///   blocks active at dump time (`active_allocated` or `active_pending_free`) that the window
    ///   never mentions. Both become `Alloc`s at the start, in address order, with the free
    ///   event's size or the block's `requested_size` (its `size` in old layouts).
    /// * Blocks still live at the end are never freed.
    ///
    /// Inconsistencies are worked around and listed in [`Reconstruction::anomalies`].
    pub fn reconstruct(&self, device: usize) -> Reconstruction {
        let events = self.events(device);
        let used_free_completed = events.iter().any(|e| e.action == Action::FreeCompleted);
        let free_action = if used_free_completed {
            Action::FreeCompleted
        } else {
            Action::FreeRequested
        };

        // Pass 1 over the window with provisional keys; initial blocks get keys as discovered.
        let mut seq = AddrSequencer::default();
        for (i, e) in events.iter().enumerate() {
            if e.action == Action::Alloc {
                seq.alloc(i, e.addr, e.size, e.stream);
            } else if e.action == free_action {
                seq.free(i, e.addr, e.size, e.stream);
            }
        }
        let initial_from_frees = seq.initial_count();

        // Compare what the window leaves live with the final state; add untouched blocks.
        let mut end_blocks: HashMap<u64, u64> = HashMap::new();
        let mut initial_from_segments = 0;
        for (seg, b) in self.active_blocks(device) {
            let size = b.requested_or_size();
            end_blocks.insert(b.address, size);
            if seq.is_live(b.address) {
                continue;
            }
            if seq.was_seen(b.address) {
                seq.report(Anomaly::ActiveButFreedInWindow {
                    addr: b.address,
                    size,
                });
                continue;
            }
            seq.add_initial_at(b.address, size, seg.stream);
            initial_from_segments += 1;
        }
        for (addr, size) in seq.live_blocks() {
            match end_blocks.get(&addr) {
                None => seq.report(Anomaly::LiveButNotInSegments { addr, size }),
                Some(&seg_size) if seg_size != size => seq.report(Anomaly::EndSizeMismatch {
                    addr,
                    trace_size: size,
                    segment_size: seg_size,
                }),
                Some(_) => {}
            }
        }

        // Pass 2: final ids, initial blocks first in address order, then the window in order.
        seq.sort_initial_by_address();
        // The sequencer frees only live keys and never reuses one, so the replay fails only on
        // absurd sizes (live bytes beyond u64); that reports a zero peak rather than an error.
        let r = seq.finish_or_zero_peak(initial_from_frees);
        Reconstruction {
            sequence: r.sequence,
            op_events: r.op_events,
            initial_addrs: r.initial_addrs,
            initial_from_frees,
            initial_from_segments,
            used_free_completed,
            anomalies: r.anomalies,
        }
    }
}

/// A minimal pickle writer (protocol 2: dicts, lists, ints, floats, bools, strs), enough for
/// the layout PyTorch's snapshots use and that [`Snapshot::from_bytes`] reads back.
struct PickleWriter(Vec<u8>);

impl PickleWriter {
    fn int(&mut self, v: i128) {
        if let Ok(i) = i32::try_from(v) {
            self.0.push(b'J'); // BININT
            self.0.extend_from_slice(&i.to_le_bytes());
        } else {
            // LONG1: little-endian two's complement, minimal length.
            let bytes = v.to_le_bytes();
            let mut n = bytes.len();
            while n > 1 {
                let top = bytes[n - 1];
                let next_sign = bytes[n - 2] & 0x80;
                if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.0.push(0x8a);
            self.0.push(n as u8);
            self.0.extend_from_slice(&bytes[..n]);
        }
    }

    fn str(&mut self, s: &str) {
        self.0.push(b'X'); // BINUNICODE
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }

    fn float(&mut self, f: f64) {
        self.0.push(b'G'); // BINFLOAT, big-endian
        self.0.extend_from_slice(&f.to_be_bytes());
    }

    fn bool(&mut self, b: bool) {
        self.0.push(if b { 0x88 } else { 0x89 });
    }

    /// A dict: `items` writes each key and value in turn.
    fn dict(&mut self, items: impl FnOnce(&mut Self)) {
        self.0.extend_from_slice(b"}("); // EMPTY_DICT MARK
        items(self);
        self.0.push(b'u'); // SETITEMS
    }

    /// A list: `items` writes each item.
    fn list(&mut self, items: impl FnOnce(&mut Self)) {
        self.0.extend_from_slice(b"]("); // EMPTY_LIST MARK
        items(self);
        self.0.push(b'e'); // APPENDS
    }

    fn key_int(&mut self, k: &str, v: i128) {
        self.str(k);
        self.int(v);
    }

    fn key_str(&mut self, k: &str, v: &str) {
        self.str(k);
        self.str(v);
    }
}

impl Action {
    /// The action string PyTorch writes.
    pub fn as_str(&self) -> &str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
            Action::Other(s) => s,
        }
    }
}

impl BlockState {
    /// The state string PyTorch writes.
    pub fn as_str(&self) -> &str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
            BlockState::Other(s) => s,
        }
    }
}

impl Snapshot {
    /// The snapshot as a pickle in PyTorch's layout (`segments` with `blocks`, `device_traces`
    /// whose `oom` events carry `device_free` instead of `addr`, `allocator_settings` when
    /// present), which [`Snapshot::from_bytes`] reads back to an equal snapshot. Settings kept
    /// by name ([`AllocatorSettings::other`]) are written as strings. Frames are not kept by
    /// the reader and are written as a one-frame stack when an event has a top frame.
    pub fn to_pickle(&self) -> Vec<u8> {
        let mut w = PickleWriter(vec![0x80, 2]);
        w.dict(|w| {
            w.str("segments");
            w.list(|w| {
                for seg in &self.segments {
                    w.dict(|w| {
                        w.key_int("device", seg.device.into());
                        w.key_int("address", seg.address.into());
                        w.key_int("total_size", seg.total_size.into());
                        w.key_int("stream", seg.stream.into());
                        if let Some(t) = &seg.segment_type {
                            w.key_str("segment_type", t);
                        }
                        if let Some(a) = seg.allocated_size {
                            w.key_int("allocated_size", a.into());
                        }
                        if let Some(a) = seg.active_size {
                            w.key_int("active_size", a.into());
                        }
                        if let Some(e) = seg.is_expandable {
                            w.str("is_expandable");
                            w.bool(e);
                        }
                        w.str("blocks");
                        w.list(|w| {
                            for b in &seg.blocks {
                                w.dict(|w| {
                                    w.key_int("address", b.address.into());
                                    w.key_int("size", b.size.into());
                                    if let Some(r) = b.requested_size {
                                        w.key_int("requested_size", r.into());
                                    }
                                    w.key_str("state", b.state.as_str());
                                });
                            }
                        });
                    });
                }
            });
            w.str("device_traces");
            w.list(|w| {
                for trace in &self.device_traces {
                    w.list(|w| {
                        for e in trace {
                            w.dict(|w| {
                                w.key_str("action", e.action.as_str());
                                if e.action == Action::Oom {
                                    if let Some(f) = e.device_free {
                                        w.key_int("device_free", f.into());
                                    }
                                } else {
                                    w.key_int("addr", e.addr.into());
                                }
                                w.key_int("size", e.size.into());
                                w.key_int("stream", e.stream.into());
                                if let Some(t) = e.time_us {
                                    w.key_int("time_us", t.into());
                                }
                                if let Some(f) = &e.top_frame {
                                    write_frame(w, f);
                                }
                            });
                        }
                    });
                }
            });
            if let Some(a) = &self.allocator_settings {
                w.str("allocator_settings");
                w.dict(|w| {
                    if let Some(c) = &a.conf {
                        w.key_str("PYTORCH_CUDA_ALLOC_CONF", c);
                    }
                    if let Some(e) = a.expandable_segments {
                        w.str("expandable_segments");
                        w.bool(e);
                    }
                    w.key_int("max_split_size", a.max_split_size.map_or(-1, i128::from));
                    if let Some(g) = a.garbage_collection_threshold {
                        w.str("garbage_collection_threshold");
                        w.float(g);
                    }
                    if !a.roundup_power2_divisions.is_empty() {
                        w.str("roundup_power2_divisions");
                        w.dict(|w| {
                            for &(mb, d) in &a.roundup_power2_divisions {
                                w.key_int(&mb.to_string(), d.into());
                            }
                        });
                    }
                    for (k, v) in &a.other {
                        w.key_str(k, v);
                    }
                });
            }
        });
        w.0.push(b'.');
        w.0
    }
}

/// `frames: [{"filename", "line", "name"}]` from a `file:line name` top frame.
fn write_frame(w: &mut PickleWriter, top: &str) {
    let (loc, name) = top.split_once(' ').unwrap_or((top, "?"));
    let (file, line) = loc.rsplit_once(':').unwrap_or((loc, "0"));
    w.str("frames");
    w.list(|w| {
        w.dict(|w| {
            w.key_str("filename", file);
            w.key_int("line", line.parse::<i128>().unwrap_or(0));
            w.key_str("name", name);
        })
    });
}

/// How many more segments, blocks and events may be read.
struct Budget(usize);

impl Budget {
    fn spend(&mut self, n: usize, path: &str) -> Result<(), SnapshotError> {
        match self.0.checked_sub(n) {
            Some(left) => {
                self.0 = left;
                Ok(())
            }
            None => Err(shape(
                path,
                "fewer segments, blocks and events than input bytes",
                "more (shared objects referenced over and over)",
            )),
        }
    }
}

fn shape(path: &str, expected: &str, found: &str) -> SnapshotError {
    SnapshotError::Shape {
        path: path.to_string(),
        expected: expected.to_string(),
        found: found.to_string(),
    }
}

fn seq<'v>(v: &'v Value, path: &str) -> Result<&'v [Value], SnapshotError> {
    v.as_seq()
        .ok_or_else(|| shape(path, "a list", v.type_name()))
}

fn dict_check(v: &Value, path: &str) -> Result<(), SnapshotError> {
    match v {
        Value::Dict(_) => Ok(()),
        other => Err(shape(path, "a dict", other.type_name())),
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Int(i) => format!("int {i}"),
        Value::BigInt(i) => format!("int {i}"),
        Value::Str(s) => format!("str {s:?}"),
        other => other.type_name().to_string(),
    }
}

fn opt_u64(d: &Value, key: &str, path: &str) -> Result<Option<u64>, SnapshotError> {
    match d.get(key) {
        None | Some(Value::None) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            shape(
                &format!("{path}.{key}"),
                "a non-negative int below 2^64",
                &describe(v),
            )
        }),
    }
}

fn opt_bool(d: &Value, key: &str, path: &str) -> Result<Option<bool>, SnapshotError> {
    match d.get(key) {
        None | Some(Value::None) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(Value::Int(i)) => Ok(Some(*i != 0)),
        Some(v) => Err(shape(&format!("{path}.{key}"), "a bool", &describe(v))),
    }
}

fn req_u64(d: &Value, key: &str, path: &str) -> Result<u64, SnapshotError> {
    opt_u64(d, key, path)?.ok_or_else(|| shape(path, &format!("a `{key}` key"), "none"))
}

fn opt_str<'v>(d: &'v Value, key: &str, path: &str) -> Result<Option<&'v str>, SnapshotError> {
    match d.get(key) {
        None | Some(Value::None) => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| shape(&format!("{path}.{key}"), "a str", &describe(v))),
    }
}

fn parse_segment(s: &Value, path: &str) -> Result<Segment, SnapshotError> {
    dict_check(s, path)?;
    let address = req_u64(s, "address", path)?;
    let mut blocks = Vec::new();
    if let Some(bv) = s.get("blocks") {
        let bpath = format!("{path}.blocks");
        let mut offset = address;
        for (i, b) in seq(bv, &bpath)?.iter().enumerate() {
            let p = format!("{bpath}[{i}]");
            dict_check(b, &p)?;
            let size = req_u64(b, "size", &p)?;
            let state =
                opt_str(b, "state", &p)?.ok_or_else(|| shape(&p, "a `state` key", "none"))?;
            let addr = opt_u64(b, "address", &p)?.unwrap_or(offset);
            offset = addr.saturating_add(size);
            blocks.push(Block {
                address: addr,
                size,
                requested_size: opt_u64(b, "requested_size", &p)?,
                state: BlockState::parse(state),
            });
        }
    }
    Ok(Segment {
        device: opt_u64(s, "device", path)?.unwrap_or(0),
        address,
        total_size: req_u64(s, "total_size", path)?,
        stream: opt_u64(s, "stream", path)?.unwrap_or(0),
        segment_type: opt_str(s, "segment_type", path)?.map(str::to_string),
        allocated_size: opt_u64(s, "allocated_size", path)?,
        active_size: opt_u64(s, "active_size", path)?,
        is_expandable: opt_bool(s, "is_expandable", path)?,
        blocks,
    })
}

fn parse_event(e: &Value, device: usize, index: usize) -> Result<TraceEvent, SnapshotError> {
    let path = format!("device_traces[{device}][{index}]");
    dict_check(e, &path)?;
    let action =
        opt_str(e, "action", &path)?.ok_or_else(|| shape(&path, "an `action` key", "none"))?;
    let time_us = match e.get("time_us") {
        None | Some(Value::None) => None,
        Some(v) => Some(
            v.as_i128()
                .and_then(|t| i64::try_from(t).ok())
                .ok_or_else(|| shape(&format!("{path}.time_us"), "an int", &describe(v)))?,
        ),
    };
    let action = Action::parse(action);
    let device_free = if action == Action::Oom {
        opt_u64(e, "device_free", &path)?
    } else {
        None
    };
    let addr = opt_u64(e, "addr", &path)?;
    Ok(TraceEvent {
        addr: device_free.or(addr).unwrap_or(0),
        action,
        size: opt_u64(e, "size", &path)?.unwrap_or(0),
        stream: opt_u64(e, "stream", &path)?.unwrap_or(0),
        time_us,
        top_frame: e.get("frames").and_then(top_python_frame),
        device_free,
    })
}

/// A Python value as `repr` would print it, for settings kept by name.
fn python_repr(v: &Value) -> String {
    match v {
        Value::None => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Int(i) => i.to_string(),
        Value::BigInt(i) => i.to_string(),
        Value::Float(f) => format!("{f:?}"),
        Value::Str(s) => format!("{s:?}"),
        Value::Bytes(b) => format!("<{} bytes>", b.len()),
        Value::List(items) | Value::Tuple(items) | Value::Set(items) => {
            let inner: Vec<String> = items.iter().map(python_repr).collect();
            format!("[{}]", inner.join(", "))
        }
        Value::Dict(items) => {
            let inner: Vec<String> = items
                .iter()
                .map(|(k, v)| format!("{}: {}", python_repr(k), python_repr(v)))
                .collect();
            format!("{{{}}}", inner.join(", "))
        }
    }
}

/// `allocator_settings`: PyTorch writes `PYTORCH_CUDA_ALLOC_CONF` (the string the program set),
/// `max_split_size` (bytes, -1 for unlimited), `garbage_collection_threshold` (a float),
/// `expandable_segments` (a bool), `roundup_power2_divisions` (a dict from the interval start
/// in MiB, `"1"`, `"2"`, ..., to its divisions) and pinned-memory keys.
fn parse_settings(a: &Value) -> Result<AllocatorSettings, SnapshotError> {
    const PATH: &str = "allocator_settings";
    let items = a
        .as_dict()
        .ok_or_else(|| shape(PATH, "a dict", a.type_name()))?;
    let mut out = AllocatorSettings::default();
    for (k, v) in items.iter() {
        let Some(key) = k.as_str() else {
            out.other.push((python_repr(k), python_repr(v)));
            continue;
        };
        let path = format!("{PATH}.{key}");
        match key {
            "PYTORCH_CUDA_ALLOC_CONF" => {
                out.conf = match v {
                    Value::None => None,
                    Value::Str(s) => Some(s.to_string()),
                    other => return Err(shape(&path, "a str", &describe(other))),
                }
            }
            "expandable_segments" => {
                out.expandable_segments = match v {
                    Value::Bool(b) => Some(*b),
                    Value::Int(i) => Some(*i != 0),
                    Value::None => None,
                    other => return Err(shape(&path, "a bool", &describe(other))),
                }
            }
            "max_split_size" => {
                let n = v
                    .as_i128()
                    .ok_or_else(|| shape(&path, "an int", &describe(v)))?;
                // SIZE_MAX (unlimited) is written as an int64: -1.
                out.max_split_size = u64::try_from(n)
                    .ok()
                    .filter(|&n| n < u64::MAX && i64::try_from(n).is_ok());
            }
            "garbage_collection_threshold" => {
                out.garbage_collection_threshold = match v {
                    Value::Float(f) => Some(*f),
                    Value::Int(i) => Some(*i as f64),
                    Value::None => None,
                    other => return Err(shape(&path, "a float", &describe(other))),
                }
            }
            "roundup_power2_divisions" => {
                let mut pairs = Vec::new();
                match v {
                    Value::Dict(d) => {
                        for (ik, iv) in d.iter() {
                            let mb = ik
                                .as_str()
                                .and_then(|t| t.trim().parse::<u64>().ok())
                                .or_else(|| ik.as_u64())
                                .ok_or_else(|| {
                                    shape(&path, "interval keys in MiB", &describe(ik))
                                })?;
                            let div = iv.as_u64().ok_or_else(|| {
                                shape(&format!("{path}[{mb}]"), "an int", &describe(iv))
                            })?;
                            pairs.push((mb, div));
                        }
                    }
                    // Older PyTorch: one number for every size.
                    Value::Int(_) | Value::BigInt(_) => {
                        let div = v
                            .as_u64()
                            .ok_or_else(|| shape(&path, "a non-negative int", &describe(v)))?;
                        pairs.push((1, div));
                    }
                    Value::None => {}
                    other => return Err(shape(&path, "a dict", &describe(other))),
                }
                pairs.sort_unstable();
                out.roundup_power2_divisions = pairs;
            }
            _ => out.other.push((key.to_string(), python_repr(v))),
        }
    }
    Ok(out)
}

/// The first frame whose file is a Python source, as `file:line name`.
fn top_python_frame(frames: &Value) -> Option<Arc<str>> {
    frames.as_seq()?.iter().find_map(|f| {
        let file = f.get("filename")?.as_str()?;
        if !file.ends_with(".py") {
            return None;
        }
        let line = f.get("line").and_then(Value::as_i128).unwrap_or(0);
        let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
        Some(Arc::from(format!("{file}:{line} {name}")))
    })
}

#[cfg(test)]
mod tests;
