//! The unit tests of the module beside this folder.
use super::*;
use crate::sequence::{alloc, Op};

fn ev(action: Action, addr: u64, size: u64) -> TraceEvent {
    TraceEvent {
        action,
        addr,
        size,
        stream: 0,
        time_us: None,
        top_frame: None,
        device_free: None,
    }
}

fn block(address: u64, size: u64, state: BlockState) -> Block {
    Block {
        address,
        size,
        requested_size: Some(size),
        state,
    }
}

#[test]
fn reconstruct_window_with_initial_blocks() {
    // Final state: block at 0x100 (live throughout, never in the window), block at 0x300
    // (allocated in the window), 0x200 freed in the window without its alloc.
    let snap = Snapshot {
        segments: vec![Segment {
            device: 0,
            address: 0x100,
            total_size: 0x1000,
            stream: 0,
            segment_type: None,
            allocated_size: None,
            active_size: None,
            is_expandable: None,
            blocks: vec![
                block(0x100, 16, BlockState::ActiveAllocated),
                block(0x200, 32, BlockState::Inactive),
                block(0x300, 8, BlockState::ActivePendingFree),
            ],
        }],
        device_traces: vec![vec![
            ev(Action::FreeRequested, 0x200, 32),
            ev(Action::FreeCompleted, 0x200, 32),
            ev(Action::Alloc, 0x200, 4),
            ev(Action::FreeRequested, 0x200, 4),
            ev(Action::FreeCompleted, 0x200, 4),
            ev(Action::Alloc, 0x300, 8),
            ev(Action::FreeRequested, 0x300, 8),
        ]],
        allocator_settings: None,
    };
    let r = snap.reconstruct(0);
    assert!(r.anomalies.is_empty(), "{:?}", r.anomalies);
    assert!(r.used_free_completed);
    assert_eq!(r.initial_from_frees, 1);
    assert_eq!(r.initial_from_segments, 1);
    assert_eq!(
        r.sequence.ops,
        vec![
            alloc(0, 16, 0),
            alloc(1, 32, 0),
            Op::Free { id: 1 },
            alloc(2, 4, 0),
            Op::Free { id: 2 },
            alloc(3, 8, 0),
        ]
    );
    assert_eq!(
        r.op_events,
        vec![None, None, Some(1), Some(2), Some(4), Some(5)]
    );
    assert_eq!(r.sequence.peak_live_requested, 48);
    let stats = r.sequence.replay().unwrap();
    assert_eq!(stats.live_bytes_at_end(), snap.active_requested_bytes(0));
}

#[test]
fn anomalies_are_worked_around() {
    let snap = Snapshot {
        segments: vec![],
        device_traces: vec![vec![
            ev(Action::Alloc, 0x10, 4),
            ev(Action::Alloc, 0x10, 4),
            ev(Action::FreeRequested, 0x10, 4),
            ev(Action::FreeRequested, 0x10, 4),
            ev(Action::Alloc, 0x20, 4),
        ]],
        allocator_settings: None,
    };
    let r = snap.reconstruct(0);
    assert_eq!(
        r.anomalies,
        vec![
            Anomaly::AllocOverLive {
                event: 1,
                addr: 0x10
            },
            Anomaly::DoubleFree {
                event: 3,
                addr: 0x10
            },
            Anomaly::LiveButNotInSegments {
                addr: 0x20,
                size: 4
            },
        ]
    );
    assert!(!r.used_free_completed);
    assert!(r.sequence.replay().is_ok());
}

#[test]
fn reserved_curve_from_segment_events() {
    let snap = Snapshot {
        segments: vec![Segment {
            device: 0,
            address: 0,
            total_size: 100,
            stream: 0,
            segment_type: None,
            allocated_size: None,
            active_size: None,
            is_expandable: None,
            blocks: vec![],
        }],
        device_traces: vec![vec![
            ev(Action::SegmentAlloc, 0, 50),
            ev(Action::Alloc, 0, 1),
            ev(Action::SegmentFree, 0, 80),
            ev(Action::SegmentMap, 0, 30),
        ]],
        allocator_settings: None,
    };
    let c = snap.reserved_curve(0);
    assert_eq!(c.start, 100);
    assert_eq!(c.points, vec![(0, 150), (2, 70), (3, 100)]);
    assert_eq!(c.peak(), 150);
    assert!(!c.inconsistent);
}

#[test]
fn shape_errors_name_the_place() {
    // {'segments': [{'address': 'x'}]}
    let p: &[u8] = b"\x80\x04}(\x8c\x08segments]}(\x8c\x07address\x8c\x01xuau.";
    let e = Snapshot::from_bytes(p).unwrap_err();
    assert_eq!(
        e.to_string(),
        "segments[0].address: expected a non-negative int below 2^64, found str \"x\""
    );
    // {'segments': 5}
    let e = Snapshot::from_bytes(b"\x80\x04}\x8c\x08segmentsK\x05s.").unwrap_err();
    assert_eq!(e.to_string(), "segments: expected a list, found int");
    let e = Snapshot::from_bytes(b"\x80\x04}.").unwrap_err();
    assert_eq!(
        e.to_string(),
        "snapshot: expected a `segments` key, found none"
    );
    // {'segments': [s, s, s, ...]} with one shared segment dict referenced 1000 times.
    let mut p = b"\x80\x04}(\x8c\x08segments](}\x94(\x8c\x07address".to_vec();
    p.extend(b"K\x00\x8c\ntotal_sizeK\x00u");
    p.extend(std::iter::repeat(&b"h\x00"[..]).take(1000).flatten());
    p.extend(b"eu.");
    let v = pickle::from_slice(&p).unwrap();
    assert_eq!(Snapshot::from_value(&v).unwrap().segments.len(), 1001);
    let e = Snapshot::from_value_limited(&v, 1000).unwrap_err();
    assert!(
        e.to_string().starts_with("segments[1000]: expected fewer"),
        "{e}"
    );
    let e = Snapshot::from_bytes(b"\x80\x04}").unwrap_err();
    assert!(matches!(e, SnapshotError::Pickle(_)), "{e}");
}

#[test]
fn oom_events_and_settings_survive_a_pickle_round_trip() {
    let mut oom = ev(Action::Oom, 7 << 20, 3 << 30);
    oom.device_free = Some(7 << 20);
    oom.stream = 5;
    oom.time_us = Some(-3);
    oom.top_frame = Some(Arc::from("train.py:12 step"));
    let snap = Snapshot {
        segments: vec![Segment {
            device: 0,
            address: 1 << 40,
            total_size: 20 << 20,
            stream: 0,
            segment_type: Some("large".into()),
            allocated_size: None,
            active_size: None,
            is_expandable: None,
            blocks: vec![block(1 << 40, 20 << 20, BlockState::Inactive)],
        }],
        device_traces: vec![vec![ev(Action::SegmentAlloc, 1 << 40, 20 << 20), oom]],
        allocator_settings: Some(AllocatorSettings {
            conf: Some("max_split_size_mb:256,foo:bar".into()),
            expandable_segments: Some(false),
            max_split_size: Some(256 << 20),
            roundup_power2_divisions: vec![(1, 0), (2, 4), (1024, 8)],
            garbage_collection_threshold: Some(0.5),
            other: vec![("pinned_num_register_threads".into(), "1".into())],
        }),
    };
    let back = Snapshot::from_bytes(&snap.to_pickle()).unwrap();
    // A number kept by name is written as a string; read back, it is its repr.
    let mut want = snap.clone();
    want.allocator_settings.as_mut().unwrap().other[0].1 = "\"1\"".into();
    assert_eq!(back, want);
    let ooms: Vec<_> = back.ooms(0).collect();
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].0, 1);
    assert_eq!(ooms[0].1.device_free, Some(7 << 20));
    assert_eq!(ooms[0].1.addr, 7 << 20);
    assert_eq!(back.reserved_curve(0).before(1), 20 << 20);
    assert_eq!(back.reserved_curve(0).before(0), 0);
    assert!(!back.allocator_settings.unwrap().is_default());

    // Unlimited max_split_size is written as -1; an oom without device_free reads as None.
    let bare = Snapshot {
        device_traces: vec![vec![ev(Action::Oom, 0, 1 << 20)]],
        allocator_settings: Some(AllocatorSettings::default()),
        ..Snapshot::default()
    };
    let bytes = bare.to_pickle();
    assert!(bytes.windows(5).any(|w| w == b"J\xff\xff\xff\xff"));
    let s = Snapshot::from_bytes(&bytes).unwrap();
    assert_eq!(s, bare);
    assert_eq!(s.device_traces[0][0].device_free, None);
}

fn seg(address: u64, total_size: u64, kind: &str, blocks: Vec<Block>) -> Segment {
    Segment {
        device: 0,
        address,
        total_size,
        stream: 0,
        segment_type: Some(kind.into()),
        allocated_size: None,
        active_size: None,
        is_expandable: None,
        blocks,
    }
}

const MIB: u64 = 1 << 20;

#[test]
fn window_start_walks_segments_back_and_places_the_live_blocks() {
    // At the dump: a 20 MiB segment allocated in the window, and a 2 MiB small segment that
    // existed before it, holding a block live throughout (0x2000_0200) and one the window
    // frees (0x2000_0000). A 40 MiB segment existed before the window and was freed in it.
    let snap = Snapshot {
        segments: vec![
            seg(0x1000_0000, 20 * MIB, "large", vec![]),
            seg(
                0x2000_0000,
                2 * MIB,
                "small",
                vec![
                    block(0x2000_0000, 512, BlockState::Inactive),
                    block(0x2000_0200, 1024, BlockState::ActiveAllocated),
                ],
            ),
        ],
        device_traces: vec![vec![
            ev(Action::FreeRequested, 0x2000_0000, 512),
            ev(Action::FreeCompleted, 0x2000_0000, 512),
            ev(Action::SegmentFree, 0x3000_0000, 40 * MIB),
            ev(Action::SegmentAlloc, 0x1000_0000, 20 * MIB),
            ev(Action::Alloc, 0x1000_0000, 5 * MIB),
            ev(Action::FreeRequested, 0x1000_0000, 5 * MIB),
            ev(Action::FreeCompleted, 0x1000_0000, 5 * MIB),
        ]],
        allocator_settings: None,
    };
    let r = snap.reconstruct(0);
    assert_eq!(r.initial_addrs, vec![Some(0x2000_0000), Some(0x2000_0200)]);
    let w = snap.window_start(0, &r);
    assert_eq!(
        w.segments,
        vec![
            StartSegment {
                address: 0x2000_0000,
                size: 2 * MIB,
                stream: 0,
                small: true,
                expandable: false,
            },
            StartSegment {
                address: 0x3000_0000,
                size: 40 * MIB,
                stream: 0,
                small: false,
                expandable: false,
            },
        ]
    );
    assert_eq!(w.bytes(), snap.reserved_curve(0).start);
    assert_eq!(w.inconsistent, 0);
    assert!(w.unplaced.is_empty());
    assert_eq!(
        w.live,
        vec![
            // Freed in the window: the final block at that address is another one.
            StartBlock {
                id: 0,
                address: 0x2000_0000,
                requested: 512,
                block_size: None,
                segment: 0,
            },
            // Live from before the window to the dump, untouched: its final size is known.
            StartBlock {
                id: 1,
                address: 0x2000_0200,
                requested: 1024,
                block_size: Some(1024),
                segment: 0,
            },
        ]
    );
    assert_eq!(w.live_bytes(), 1536);
}

#[test]
fn window_start_of_expandable_segments_joins_their_mapped_runs() {
    // At the dump one expandable run of 60 MiB at B. In the window [B+60, B+80) was unmapped
    // and then [B+40, B+60) mapped: at the start [B, B+40) and [B+60, B+80) were mapped.
    let b = 0x7000_0000_0000;
    let mut s = seg(b, 60 * MIB, "large", vec![]);
    s.is_expandable = Some(true);
    let snap = Snapshot {
        segments: vec![s],
        device_traces: vec![vec![
            ev(Action::SegmentUnmap, b + 60 * MIB, 20 * MIB),
            ev(Action::SegmentMap, b + 40 * MIB, 20 * MIB),
        ]],
        allocator_settings: None,
    };
    let w = snap.window_start(0, &snap.reconstruct(0));
    let runs: Vec<(u64, u64, bool, bool)> = w
        .segments
        .iter()
        .map(|s| (s.address - b, s.size, s.small, s.expandable))
        .collect();
    assert_eq!(
        runs,
        vec![
            (0, 40 * MIB, false, true),
            (60 * MIB, 20 * MIB, false, true)
        ]
    );
    assert_eq!(w.bytes(), snap.reserved_curve(0).start);
    assert_eq!(w.inconsistent, 0);

    // Mapping [B+40, B+60) before unmapping [B+60, B+80) leaves one joined run at the start.
    let mut joined = snap.clone();
    joined.segments[0].total_size = 80 * MIB;
    joined.device_traces[0] = vec![
        ev(Action::SegmentUnmap, b + 60 * MIB, 20 * MIB),
        ev(Action::SegmentMap, b + 60 * MIB, 20 * MIB),
    ];
    let w = joined.window_start(0, &joined.reconstruct(0));
    assert_eq!(w.segments.len(), 1, "{:?}", w.segments);
    assert_eq!(w.segments[0].size, 80 * MIB);
}

#[test]
fn window_start_counts_segment_events_that_contradict_the_final_state() {
    // A segment freed in the window cannot overlap one that exists at the dump, and one
    // allocated in the window must exist (or be freed later): both are skipped and counted.
    let snap = Snapshot {
        segments: vec![seg(0x1000_0000, 20 * MIB, "large", vec![])],
        device_traces: vec![vec![
            ev(Action::SegmentFree, 0x1000_0000, 20 * MIB),
            ev(Action::SegmentAlloc, 0x5000_0000, 2 * MIB),
        ]],
        allocator_settings: None,
    };
    let w = snap.window_start(0, &snap.reconstruct(0));
    assert_eq!(w.inconsistent, 2);
    assert_eq!(w.bytes(), 20 * MIB);
}

#[test]
fn window_start_leaves_blocks_outside_every_segment_unplaced() {
    // A block freed in the window at an address no start segment covers.
    let snap = Snapshot {
        segments: vec![seg(0x1000_0000, 2 * MIB, "small", vec![])],
        device_traces: vec![vec![
            ev(Action::FreeRequested, 0x9000_0000, 4096),
            ev(Action::FreeCompleted, 0x9000_0000, 4096),
        ]],
        allocator_settings: None,
    };
    let w = snap.window_start(0, &snap.reconstruct(0));
    assert_eq!(w.unplaced, vec![0]);
    assert!(w.live.is_empty());
}

#[test]
fn is_expandable_survives_a_pickle_round_trip() {
    let mut s = seg(0x1000, 20 * MIB, "large", vec![]);
    s.is_expandable = Some(true);
    let snap = Snapshot {
        segments: vec![s],
        device_traces: vec![],
        allocator_settings: None,
    };
    let back = Snapshot::from_bytes(&snap.to_pickle()).unwrap();
    assert_eq!(back, snap);
}

#[test]
fn window_start_refuses_ranges_past_the_end_of_the_address_space() {
    // A segment that would wrap, an empty one, and a segment event that would wrap: each is
    // counted and left out, never cut short or made empty.
    let snap = Snapshot {
        segments: vec![
            seg(u64::MAX - MIB + 1, 40 * MIB, "large", vec![]),
            seg(0x1000_0000, 0, "large", vec![]),
            seg(0x2000_0000, 2 * MIB, "small", vec![]),
        ],
        device_traces: vec![vec![ev(Action::SegmentFree, u64::MAX - 5, 4 << 60)]],
        allocator_settings: None,
    };
    let w = snap.window_start(0, &snap.reconstruct(0));
    assert_eq!(w.inconsistent, 3);
    assert_eq!(w.segments.len(), 1);
    assert!(w.segments.iter().all(|s| s.size > 0));
    assert_eq!(w.bytes(), 2 * MIB);
}

#[test]
fn window_start_takes_a_range_s_pool_from_the_blocks_seen_in_it() {
    // An expandable run of 20 MiB unmapped in the window, alone in its reservation: its size
    // says "large pool", but the window served 512 B requests from it, which only the small
    // pool does. A plain 20 MiB segment freed in the window after serving a 4 MiB request
    // stays large.
    let b = 0x7000_0000_0000;
    let snap = Snapshot {
        segments: vec![],
        device_traces: vec![vec![
            ev(Action::Alloc, b + 4096, 512),
            ev(Action::FreeRequested, b + 4096, 512),
            ev(Action::FreeCompleted, b + 4096, 512),
            ev(Action::SegmentUnmap, b, 20 * MIB),
            ev(Action::Alloc, 0x1000_0000, 4 * MIB),
            ev(Action::FreeRequested, 0x1000_0000, 4 * MIB),
            ev(Action::FreeCompleted, 0x1000_0000, 4 * MIB),
            ev(Action::SegmentFree, 0x1000_0000, 20 * MIB),
        ]],
        allocator_settings: None,
    };
    let w = snap.window_start(0, &snap.reconstruct(0));
    let pools: Vec<(u64, bool, bool)> = w
        .segments
        .iter()
        .map(|s| (s.address, s.small, s.expandable))
        .collect();
    assert_eq!(pools, vec![(0x1000_0000, false, false), (b, true, true)]);
}
