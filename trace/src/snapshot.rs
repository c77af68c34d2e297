//! PyTorch CUDA memory snapshots (`torch.cuda.memory._snapshot()` / `_dump_snapshot()` pickles).
//!
//! A snapshot holds the allocator state at dump time (`segments`, each with its `blocks`) and,
//! when `_record_memory_history()` was on, a ring buffer of events per device
//! (`device_traces`). [`Snapshot::reconstruct`] turns one device's events into a replayable
//! [`AllocSequence`], rebuilding the blocks that were already live when the ring buffer's window
//! opened the way PyTorch's `MemoryViz.js` does: by walking back from the final state.
//!
//! Beside this file: `parse` reads a pickle's values into these types, `write` writes them
//! back as a pickle ([`Snapshot::to_pickle`]), and `window` rebuilds the allocator's state at
//! the window's start ([`Snapshot::window_start`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::addrmap::{AddrAnomaly, AddrSequencer};
use crate::pickle::{self, PickleError, Value};
use crate::sequence::AllocSequence;

mod parse;
mod window;
mod write;
use parse::{parse_event, parse_segment, parse_settings, seq, shape, Budget};
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

#[cfg(test)]
mod tests;
