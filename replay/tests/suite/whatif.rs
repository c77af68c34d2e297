//! `cistern_replay::whatif` on OOM snapshots whose answers are known by construction
//! (`common/oom_traces.rs`), and on the public snapshots in `../shared/traces` when present.

use crate::common::oom_traces::{self, MIB};
use cistern_replay::whatif::{
    analyze_snapshot, at_capacity, candidates, round_size, PytorchSettings, Verdict, WhatifOptions,
};
use cistern_trace::snapshot::Snapshot;
use cistern_trace::{AllocSequence, Op};

fn row<'a>(results: &'a [Verdict], label: &str) -> &'a Verdict {
    results
        .iter()
        .find(|v| v.label() == label)
        .unwrap_or_else(|| {
            panic!(
                "no row {label}: {:?}",
                results.iter().map(Verdict::label).collect::<Vec<_>>()
            )
        })
}

fn analyze(s: &Snapshot) -> Vec<cistern_replay::whatif::OomReport> {
    // Through the pickle, as the command reads it.
    let back = Snapshot::from_bytes(&s.to_pickle()).unwrap();
    analyze_snapshot(&back, &WhatifOptions::default()).unwrap()
}

#[test]
fn stranded_bytes_reproduce_and_expandable_segments_fit() {
    // The program caught the OOM and went on freeing: only what came before it is replayed.
    let mut r = oom_traces::stranded(0, 0);
    r.free(0, 0x7f00_0000_0000, 0);
    let reps = analyze(&r.snapshot());
    assert_eq!(reps.len(), 1);
    let o = &reps[0];
    assert_eq!(o.recorded_reserved, 160 * MIB);
    assert_eq!(o.capacity, 170 * MIB);
    assert_eq!(o.live, 120 * MIB);
    assert_eq!(o.size, 40 * MIB);
    assert_eq!(o.reproduced, Some(true));
    let rec = row(&o.results, "pytorch (recorded)");
    assert_eq!(rec.fits, Some(false));
    assert_eq!(rec.reserved, Some(160 * MIB));
    // Without expandable segments it needs a new 40 MiB segment: 200 MiB.
    assert_eq!(rec.needed, Some(200 * MIB));
    assert_eq!(rec.headroom, Some(-30 * MIB as i64));
    let exp = row(&o.results, "pytorch expandable_segments:True");
    assert_eq!(exp.fits, Some(true));
    assert_eq!(exp.needed, Some(160 * MIB));
    assert_eq!(exp.headroom, Some(10 * MIB as i64));
    for mb in [512, 256, 128] {
        let v = row(&o.results, &format!("pytorch max_split_size_mb:{mb}"));
        assert_eq!(v.fits, Some(false), "{mb}");
    }
    let gc = row(&o.results, "pytorch garbage_collection_threshold:0.8");
    assert_eq!(gc.fits, None);
    assert!(gc.note.as_deref().unwrap().contains("not simulated"));
    let answer = o.answer();
    assert!(
        answer.starts_with("The recorded settings (PyTorch's default settings) reproduce the OOM (30 MiB short); with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it fits with 10 MiB to spare"),
        "{answer}"
    );
}

#[test]
fn segments_from_before_the_window_count() {
    // The ring buffer lost the first segment_alloc and alloc: the segment is still in the final
    // `segments`, and its block comes back as live at the window's start.
    let mut s = oom_traces::stranded(0, 0).snapshot();
    s.device_traces[0].drain(..2);
    let o = &analyze(&s)[0];
    assert_eq!(o.recorded_reserved, 160 * MIB);
    assert_eq!(o.capacity, 170 * MIB);
    assert_eq!(o.live, 120 * MIB);
    assert_eq!(o.reproduced, Some(true));
    assert_eq!(
        row(&o.results, "pytorch expandable_segments:True").headroom,
        Some(10 * MIB as i64)
    );
}

#[test]
fn a_request_larger_than_what_is_left_fits_nowhere() {
    let reps = analyze(&oom_traces::fits_nowhere().snapshot());
    let o = &reps[0];
    assert_eq!(o.reproduced, Some(true));
    for v in &o.results {
        assert_ne!(v.fits, Some(true), "{}", v.label());
        // 120 MiB live + 100 MiB asked: at least 50 MiB short of 170 MiB, whoever allocates.
        if let Some(h) = v.headroom {
            assert!(h <= -50 * MIB as i64, "{}: {h}", v.label());
        }
    }
    assert!(
        o.answer().contains("no allocator can fit it"),
        "{}",
        o.answer()
    );
}

#[test]
fn an_oom_on_a_second_stream_and_a_second_device() {
    let mut r = oom_traces::other_stream(1, 0x7);
    // Device 0 has its own, unrelated history.
    r.segment(0, 0x1000_0000, 20 * MIB, 0)
        .alloc(0, 0x1000_0000, 4 * MIB, 0);
    let s = r.snapshot();
    let reps = analyze(&s);
    assert_eq!(reps.len(), 1);
    let o = &reps[0];
    assert_eq!((o.device, o.stream), (1, 7));
    assert_eq!(o.capacity, 100 * MIB);
    assert_eq!(o.live, 60 * MIB);
    assert_eq!(o.reproduced, Some(true));
    let exp = row(&o.results, "pytorch expandable_segments:True");
    assert_eq!(exp.fits, Some(true), "{exp:?}");

    // The same request on stream 0 reuses the free 40 MiB block: the model then disagrees
    // with a recording that says it failed.
    let mut same = s.clone();
    let last = same.device_traces[1].len() - 1;
    same.device_traces[1][last].stream = 0;
    let o = &analyze(&same)[0];
    assert_eq!(o.reproduced, Some(false));
    assert_eq!(row(&o.results, "pytorch (recorded)").headroom, Some(0));
    assert!(
        o.answer()
            .starts_with("The model disagrees with the recording"),
        "{}",
        o.answer()
    );
}

#[test]
fn a_given_capacity_replaces_the_reconstructed_one() {
    let s = Snapshot::from_bytes(&oom_traces::stranded(0, 0).snapshot().to_pickle()).unwrap();
    let opts = WhatifOptions {
        capacity: Some(200 * MIB),
        ..WhatifOptions::default()
    };
    let o = &analyze_snapshot(&s, &opts).unwrap()[0];
    assert_eq!(o.capacity, 200 * MIB);
    assert_eq!(o.reproduced, Some(false));
    assert_eq!(row(&o.results, "pytorch (recorded)").headroom, Some(0));
}

#[test]
fn bad_input_gets_a_message_not_an_answer() {
    // No device_free.
    let mut r = oom_traces::stranded(0, 0);
    r.oom(0, 8 * MIB, 0, None);
    let e = analyze_snapshot(&r.snapshot(), &WhatifOptions::default()).unwrap_err();
    assert!(
        e.contains("without `device_free`") && e.contains("--capacity"),
        "{e}"
    );
    // An OOM on a device with no segments but live allocations.
    let mut s = oom_traces::stranded(0, 0).snapshot();
    s.segments.clear();
    s.device_traces[0]
        .retain(|e| !matches!(e.action, cistern_trace::snapshot::Action::SegmentAlloc));
    let e = analyze_snapshot(&s, &WhatifOptions::default()).unwrap_err();
    assert!(
        e.contains("no segment on cuda:0") && e.contains("--capacity"),
        "{e}"
    );
    // State only.
    let state = Snapshot {
        segments: s.segments.clone(),
        ..Snapshot::default()
    };
    let e = analyze_snapshot(&state, &WhatifOptions::default()).unwrap_err();
    assert!(e.contains("without memory history"), "{e}");
}

#[test]
fn recorded_settings_are_the_first_candidate() {
    let mut r = oom_traces::stranded(0, 0);
    let st = r.settings.as_mut().unwrap();
    st.expandable_segments = Some(true);
    st.conf = Some("expandable_segments:True".into());
    let o = &analyze(&r.snapshot())[0];
    // Recorded with expandable segments: the OOM does not reproduce (it fits, 10 MiB spare).
    assert_eq!(o.reproduced, Some(false));
    assert_eq!(o.results[0].conf, "expandable_segments:True");
    assert!(!o
        .results
        .iter()
        .any(|v| v.change.as_deref() == Some("expandable_segments:True")));
}

#[test]
fn roundup_power2_divisions_change_the_verdict() {
    // 60 MiB live on a 62 MiB device: PyTorch's own 60 MiB segment fits; rounded up to 64 MiB
    // by roundup_power2_divisions:4 it does not.
    let seq = AllocSequence::new(
        vec![Op::Alloc {
            id: 0,
            size: 60 * MIB,
            stream: 0,
        }],
        0,
    )
    .unwrap();
    let cands = candidates(&PytorchSettings::default());
    let rep = at_capacity("t", 0, &seq, 62 * MIB, &cands, &WhatifOptions::default());
    assert_eq!(rep.results[0].fits, Some(true));
    assert_eq!(rep.results[0].headroom, Some(2 * MIB as i64));
    let round = row(&rep.results, "pytorch roundup_power2_divisions:4");
    assert_eq!(round.fits, Some(false));
    assert_eq!(round.needed, Some(64 * MIB));
    assert_eq!(round.headroom, Some(-2 * MIB as i64));
}

#[test]
fn roundup_power2_divisions_round_as_pytorch() {
    // roundup_power2_next_division: 60 MiB with 4 divisions of [32, 64) -> 64 MiB.
    assert_eq!(round_size(60 * MIB, 4), 64 * MIB);
    assert_eq!(round_size(40 * MIB, 4), 40 * MIB);
    assert_eq!(round_size(33 * MIB, 4), 40 * MIB);
    assert_eq!(round_size(64 * MIB, 4), 64 * MIB);
    assert_eq!(round_size(1000, 4), 1024);
    assert_eq!(round_size(100, 4), 512);
    // Below 512 * divisions: the plain 512-byte rounding.
    assert_eq!(round_size(1500, 4), 1536);
    let s = PytorchSettings::parse_conf(
        "roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True",
    )
    .unwrap();
    assert!(s.expandable_segments);
    // [256, 512) MiB and below: 1 division (off); [512, 1024): 2; from 1 GiB (`>`): 8.
    assert_eq!(s.round(300 * MIB), 300 * MIB);
    assert_eq!(s.round(600 * MIB), 768 * MIB);
    assert_eq!(s.round(1500 * MIB), 1536 * MIB);
    assert_eq!(s.round(3 * MIB + 1), 3 * MIB + 512);
    let one = PytorchSettings::parse_conf("roundup_power2_divisions:4").unwrap();
    assert_eq!(one.round(60 * MIB), 64 * MIB);
    assert_eq!(one.conf(), "roundup_power2_divisions:4");
    assert!(PytorchSettings::parse_conf("max_split_size_mb:x").is_err());
    assert!(candidates(&PytorchSettings::default()).len() >= 7);
}
