//! The replay engine: metrics, the time series, min-capacity bisection, the registry, JSON.

use cistern_replay::{evaluate, make, min_capacity, replay, run, EvalOptions, ALLOCATORS};
use cistern_trace::{AllocSequence, Op};

const MIB: u64 = 1 << 20;

fn seq(ops: Vec<Op>) -> AllocSequence {
    AllocSequence::new(ops, 0).unwrap()
}

fn a(id: u64, size: u64) -> Op {
    Op::Alloc {
        id,
        size,
        stream: 0,
    }
}

/// Two 12 MiB blocks, the first freed, then a 13 MiB block: PyTorch's model cannot reuse the
/// freed 12 MiB segment for 13 MiB.
fn sample() -> AllocSequence {
    seq(vec![
        a(0, 12 * MIB),
        a(1, 12 * MIB),
        Op::Free { id: 0 },
        a(2, 13 * MIB),
    ])
}

#[test]
fn metrics_of_a_small_sequence() {
    let s = sample();
    let r = run(&s, "pytorch", 1 << 30).unwrap();
    assert_eq!(r.peak_reserved, 38 * MIB);
    assert_eq!(r.peak_live, 25 * MIB);
    assert!((r.frag - (1.0 - 25.0 / 38.0)).abs() < 1e-12);
    assert_eq!(r.internal_waste, Some(MIB)); // 13 MiB in a 14 MiB segment, unsplit
    assert_eq!(r.ops, 4);
    assert!(r.oom.is_none());
    assert_eq!(r.driver_calls.get("mem_alloc"), Some(&3));
    assert_eq!(r.series.len(), 4);
    assert_eq!(r.series[3].reserved, 38 * MIB);
    assert_eq!(r.series[3].live, 25 * MIB);

    let ideal = run(&s, "ideal", 1 << 30).unwrap();
    assert_eq!(ideal.peak_reserved, 25 * MIB);
    assert_eq!(ideal.frag, 0.0);
}

#[test]
fn oom_stops_the_replay_at_its_op() {
    let r = run(&sample(), "pytorch", 30 * MIB).unwrap();
    // 24 MiB live + 14 MiB > 30 MiB; releasing the cached 12 MiB segment makes room.
    assert!(r.oom.is_none(), "{:?}", r.oom);
    assert_eq!(r.peak_reserved, 26 * MIB);
    let r = run(&sample(), "pytorch", 24 * MIB).unwrap();
    let oom = r.oom.expect("must run out of memory");
    assert_eq!(oom.op_index, 3);
    assert_eq!(r.ops, 3);
}

#[test]
fn min_capacity_bisects_to_the_boundary() {
    let s = sample();
    assert_eq!(min_capacity(&s, "pytorch").unwrap(), 26 * MIB);
    assert_eq!(min_capacity(&s, "ideal").unwrap(), 26 * MIB); // 25 MiB, at 2 MiB resolution
    assert_eq!(min_capacity(&s, "cudamalloc").unwrap(), 26 * MIB);
    let c = min_capacity(&s, "cistern").unwrap();
    assert!((26 * MIB..=28 * MIB).contains(&c), "{c}");
}

#[test]
fn every_registered_allocator_replays() {
    let s = sample();
    let rows = evaluate(&s, ALLOCATORS, EvalOptions::default()).unwrap();
    assert_eq!(rows.len(), ALLOCATORS.len());
    for (r, name) in rows.iter().zip(ALLOCATORS) {
        assert_eq!(r.allocator, *name);
        assert!(r.oom.is_none(), "{name}: {:?}", r.oom);
        assert!(r.peak_reserved >= 25 * MIB, "{name}");
        assert_eq!(r.peak_live, 25 * MIB);
        assert!(r.min_capacity.is_some());
    }
}

#[test]
fn unknown_names_list_the_valid_ones() {
    let e = make("tlsf", 1 << 30).err().unwrap();
    assert!(e.contains("unknown allocator `tlsf`"), "{e}");
    for n in ALLOCATORS {
        assert!(e.contains(n), "{e}");
    }
    let e = make("pytorch:max_split_size_mb:8", 1 << 30).err().unwrap();
    assert!(e.contains("N > 20"), "{e}");
    let e = make("pytorch-recorded", 1 << 30).err().unwrap();
    assert!(e.contains("not a model"), "{e}");
}

/// `max_split_size_mb:N` with N MiB past 64 bits used to wrap (`N << 20`: 2^44 MiB gave a
/// max_split_size of 0) and silently replay another setting; it is refused, naming the range.
#[test]
fn max_split_size_mb_out_of_range_is_refused() {
    let max = u64::MAX >> 20;
    for base in ["pytorch", "pytorch-expandable"] {
        for n in [1u64 << 44, max + 1, u64::MAX] {
            let spec = format!("{base}:max_split_size_mb:{n}");
            let e = make(&spec, 1 << 30).err().unwrap();
            assert!(
                e.contains("too large") && e.contains(&max.to_string()),
                "{e}"
            );
        }
        for bad in ["20", "0", "-5", "1e3", "nan", "99999999999999999999999"] {
            let spec = format!("{base}:max_split_size_mb:{bad}");
            let e = make(&spec, 1 << 30).err().unwrap();
            assert!(e.contains("N > 20"), "{spec}: {e}");
        }
        let e = make(
            &format!("{base}:max_split_size_mb:99999999999999999999"),
            1 << 30,
        )
        .err()
        .unwrap();
        assert!(e.contains("too large"), "{e}");
        // PyTorch's other settings are not simulated: refused, naming the setting.
        for key in [
            "roundup_power2_divisions:4",
            "garbage_collection_threshold:0.8",
        ] {
            let e = make(&format!("{base}:{key}"), 1 << 30).err().unwrap();
            assert!(e.contains("does not simulate"), "{e}");
        }
        assert!(make(&format!("{base}:max_split_size_mb:{max}"), 1 << 30).is_ok());
        assert!(make(&format!("{base}:max_split_size_mb:21"), 1 << 30).is_ok());
    }
}

#[test]
fn json_has_the_documented_keys() {
    let r = run(&sample(), "pytorch", 1 << 30).unwrap();
    let v: serde_json::Value = serde_json::to_value(&r).unwrap();
    for k in [
        "allocator",
        "peak_reserved",
        "peak_live",
        "frag",
        "min_capacity",
        "driver_calls",
        "driver_time_us",
        "host_waits",
        "pages_moved",
        "steady_driver_calls",
        "ops_per_sec",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
    assert_eq!(v["allocator"], "pytorch");
    assert_eq!(v["driver_calls"]["mem_alloc"], 3);
    assert!(v["driver_time_us"].as_f64().unwrap() > 0.0);
    assert_eq!(v["host_waits"], 0);
    assert_eq!(v["pages_moved"], 0);
    assert_eq!(v["steady_driver_calls"], 0);
    assert!(v.get("series").is_none());
    let doc = cistern_replay::TraceReport {
        trace: "sample".into(),
        results: vec![r],
    };
    let v = serde_json::to_value(&doc).unwrap();
    assert_eq!(v["trace"], "sample");
    assert_eq!(v["results"][0]["allocator"], "pytorch");
}

#[test]
fn series_is_downsampled_and_keeps_the_peak() {
    let mut ops = Vec::new();
    for i in 0..5000u64 {
        ops.push(a(i, (1 + i % 7) * MIB));
        if i % 2 == 1 {
            ops.push(Op::Free { id: i - 1 });
        }
    }
    let s = seq(ops);
    let mut m = make("pytorch", 1 << 40).unwrap();
    let r = replay(&s, m.as_mut());
    assert!(r.series.len() <= 2000, "{}", r.series.len());
    assert!(r.series.len() >= 1000);
    let max = r.series.iter().map(|p| p.reserved).max().unwrap();
    assert_eq!(max, r.peak_reserved);
    assert!(r.series.windows(2).all(|w| w[0].op < w[1].op));
}

#[test]
fn max_split_size_is_selectable_by_name() {
    // With max_split_size 32 MiB the freed 40 MiB block is oversize: a 12 MiB request may not
    // split it, so a second segment is made.
    let s = seq(vec![a(0, 40 * MIB), Op::Free { id: 0 }, a(1, 12 * MIB)]);
    let r = run(&s, "pytorch:max_split_size_mb:32", 1 << 30).unwrap();
    assert_eq!(r.allocator, "pytorch:max_split_size_mb:32");
    assert_eq!(r.peak_reserved, 52 * MIB);
    assert_eq!(run(&s, "pytorch", 1 << 30).unwrap().peak_reserved, 40 * MIB);
}
