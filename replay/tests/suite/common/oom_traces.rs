//! OOM snapshots whose answers are known by construction, shared by the whatif tests of
//! `cistern-replay` and `cistern-cli` (the latter includes this file by path).
//!
//! A [`Recorder`] writes the events PyTorch's caching allocator would record for a script of
//! segment allocations, allocations and frees at explicit addresses, and builds the final
//! `segments` from the state at the end, so the snapshot is consistent.
#![allow(dead_code)]

use std::collections::BTreeMap;

use cistern_trace::snapshot::{
    Action, AllocatorSettings, Block, BlockState, Segment, Snapshot, TraceEvent,
};

pub const MIB: u64 = 1 << 20;

/// Records events per device and builds the snapshot.
#[derive(Default)]
pub struct Recorder {
    traces: Vec<Vec<TraceEvent>>,
    /// Per device: segment base -> (size, stream).
    segments: Vec<BTreeMap<u64, (u64, u64)>>,
    /// Per device: live block address -> size.
    live: Vec<BTreeMap<u64, u64>>,
    time: i64,
    pub settings: Option<AllocatorSettings>,
}

impl Recorder {
    fn dev(&mut self, d: usize) {
        while self.traces.len() <= d {
            self.traces.push(Vec::new());
            self.segments.push(BTreeMap::new());
            self.live.push(BTreeMap::new());
        }
    }

    fn push(&mut self, d: usize, action: Action, addr: u64, size: u64, stream: u64) {
        self.dev(d);
        self.time += 10;
        self.traces[d].push(TraceEvent {
            action,
            addr,
            size,
            stream,
            time_us: Some(self.time),
            top_frame: Some("train.py:42 forward".into()),
            device_free: None,
        });
    }

    /// `cudaMalloc` of a segment.
    pub fn segment(&mut self, d: usize, addr: u64, size: u64, stream: u64) -> &mut Self {
        self.push(d, Action::SegmentAlloc, addr, size, stream);
        self.segments[d].insert(addr, (size, stream));
        self
    }

    /// `cudaFree` of a segment.
    pub fn segment_free(&mut self, d: usize, addr: u64, stream: u64) -> &mut Self {
        self.dev(d);
        let (size, _) = self.segments[d].remove(&addr).expect("no such segment");
        self.push(d, Action::SegmentFree, addr, size, stream);
        self
    }

    pub fn alloc(&mut self, d: usize, addr: u64, size: u64, stream: u64) -> &mut Self {
        self.push(d, Action::Alloc, addr, size, stream);
        self.live[d].insert(addr, size);
        self
    }

    pub fn free(&mut self, d: usize, addr: u64, stream: u64) -> &mut Self {
        self.dev(d);
        let size = self.live[d].remove(&addr).expect("not live");
        self.push(d, Action::FreeRequested, addr, size, stream);
        self.push(d, Action::FreeCompleted, addr, size, stream);
        self
    }

    /// The program frees the block (`free_requested`) but a stream recorded on it
    /// (`record_stream`) still has work queued: PyTorch keeps it out of the pool until its
    /// events complete ([`Recorder::free_completed`]).
    pub fn free_requested(&mut self, d: usize, addr: u64, stream: u64) -> &mut Self {
        let size = self.live[d].get(&addr).copied().expect("not live");
        self.push(d, Action::FreeRequested, addr, size, stream);
        self
    }

    /// The events of a block freed with [`Recorder::free_requested`] completed: it is back in
    /// its pool (`process_events` -> `free_block`).
    pub fn free_completed(&mut self, d: usize, addr: u64, stream: u64) -> &mut Self {
        let size = self.live[d].remove(&addr).expect("not live");
        self.push(d, Action::FreeCompleted, addr, size, stream);
        self
    }

    /// The history recording starts here: everything recorded so far happened before the
    /// window (the ring buffer lost it), and only its effect on the state remains.
    pub fn open_window(&mut self) -> &mut Self {
        for t in &mut self.traces {
            t.clear();
        }
        self
    }

    pub fn oom(&mut self, d: usize, size: u64, stream: u64, device_free: Option<u64>) -> &mut Self {
        self.push(d, Action::Oom, device_free.unwrap_or(0), size, stream);
        self.traces[d].last_mut().unwrap().device_free = device_free;
        self
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::new();
        for (d, segs) in self.segments.iter().enumerate() {
            for (&addr, &(size, stream)) in segs {
                let mut blocks = Vec::new();
                let mut cursor = addr;
                for (&a, &s) in self.live[d].range(addr..addr + size) {
                    if a > cursor {
                        blocks.push(block(cursor, a - cursor, BlockState::Inactive, 0));
                    }
                    blocks.push(block(a, s, BlockState::ActiveAllocated, s));
                    cursor = a + s;
                }
                if cursor < addr + size {
                    blocks.push(block(cursor, addr + size - cursor, BlockState::Inactive, 0));
                }
                segments.push(Segment {
                    device: d as u64,
                    address: addr,
                    total_size: size,
                    stream,
                    // kSmallBuffer: only the small pool makes 2 MiB segments.
                    segment_type: Some(if size == 2 * MIB { "small" } else { "large" }.into()),
                    allocated_size: None,
                    active_size: None,
                    is_expandable: None,
                    blocks,
                });
            }
        }
        Snapshot {
            segments,
            device_traces: self.traces.clone(),
            allocator_settings: self.settings.clone(),
        }
    }
}

fn block(address: u64, size: u64, state: BlockState, requested: u64) -> Block {
    Block {
        address,
        size,
        requested_size: Some(requested),
        state,
    }
}

/// PyTorch's default settings, as a snapshot records them.
pub fn default_settings() -> AllocatorSettings {
    AllocatorSettings {
        conf: Some(String::new()),
        expandable_segments: Some(false),
        max_split_size: None,
        roundup_power2_divisions: (0..16).map(|i| (1u64 << i, 0)).collect(),
        garbage_collection_threshold: Some(0.0),
        other: vec![("pinned_num_register_threads".into(), "1".into())],
    }
}

/// Best fit with splitting strands exactly 40 MiB: two 80 MiB segments, each reused by a
/// 60 MiB block after its first block was freed, leave two 20 MiB free pieces (each the tail
/// of a segment still in use, so PyTorch's OOM retry cannot release them). 120 MiB live, 160 MiB
/// reserved, 10 MiB free on the device: a 40 MiB request fails. With expandable segments the
/// two free pieces are whole 20 MiB pages, unmapped on the retry, so it fits on 160 MiB (10 MiB
/// to spare); without, it needs a new 40 MiB segment: 200 MiB (30 MiB short).
pub fn stranded(device: usize, stream: u64) -> Recorder {
    let mut r = Recorder {
        settings: Some(default_settings()),
        ..Recorder::default()
    };
    let (a, b) = (0x7f00_0000_0000u64, 0x7f00_0000_0000u64 + 80 * MIB);
    r.segment(device, a, 80 * MIB, stream)
        .alloc(device, a, 80 * MIB, stream)
        .segment(device, b, 80 * MIB, stream)
        .alloc(device, b, 80 * MIB, stream)
        .free(device, a, stream)
        .alloc(device, a, 60 * MIB, stream)
        .free(device, b, stream)
        .alloc(device, b, 60 * MIB, stream)
        .oom(device, 40 * MIB, stream, Some(10 * MIB));
    r
}

/// The cross-stream case: on stream 0 an 80 MiB segment is split by a 40 MiB block after its
/// first block was freed, and a 20 MiB segment stays live; then a 40 MiB request on `stream`
/// (not 0) finds no block of its own stream, and the device is full (0 free): 60 MiB live,
/// 100 MiB reserved. On stream 0 the same request would reuse the free 40 MiB.
pub fn other_stream(device: usize, stream: u64) -> Recorder {
    let mut r = Recorder {
        settings: Some(default_settings()),
        ..Recorder::default()
    };
    let (a, b) = (0x7e00_0000_0000u64, 0x7e00_0000_0000u64 + 80 * MIB);
    r.segment(device, a, 80 * MIB, 0)
        .alloc(device, a, 80 * MIB, 0)
        .segment(device, b, 20 * MIB, 0)
        .alloc(device, b, 20 * MIB, 0)
        .free(device, a, 0)
        .alloc(device, a, 40 * MIB, 0)
        .oom(device, 40 * MIB, stream, Some(0));
    r
}

/// A request no allocator can fit: 120 MiB live of a 170 MiB device, 100 MiB asked.
pub fn fits_nowhere() -> Recorder {
    let mut r = stranded(0, 0);
    let last = r.traces[0].len() - 1;
    r.traces[0][last].size = 100 * MIB;
    r
}
