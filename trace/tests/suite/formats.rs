//! Every reader on the development traces (skipped visibly when absent), the common loader, and
//! the workload generators: determinism and valid sequences. Prints the numbers per trace.

use std::path::Path;
use std::time::Instant;

use cistern_trace::{kineto, load, own, rmm, workloads, Op, Trace};

fn summary(t: &Trace) -> String {
    let stats = t.sequence.replay().expect("valid sequence");
    format!(
        "{} (dev {}): {} ops, {} allocs, {} initially live, peak live {:.1} MiB, recorded peak reserved {}",
        t.name,
        t.device,
        t.sequence.ops.len(),
        stats.allocs,
        t.sequence.initially_live,
        stats.peak_live as f64 / (1 << 20) as f64,
        t.recorded_peak_reserved
            .map(|r| format!("{:.1} MiB", r as f64 / (1 << 20) as f64))
            .unwrap_or_else(|| "-".into()),
    )
}

fn check_trace(t: &Trace) {
    let stats = t
        .sequence
        .replay()
        .unwrap_or_else(|e| panic!("{}: {e}", t.name));
    assert_eq!(
        stats.peak_live, t.sequence.peak_live_requested,
        "{}",
        t.name
    );
    if let Some(r) = &t.recorded_reserved {
        assert_eq!(
            r.first().map(|p| p.0),
            Some(0),
            "{}: first point at op 0",
            t.name
        );
        assert!(
            r.windows(2).all(|w| w[0].0 < w[1].0),
            "{}: points in op order",
            t.name
        );
        assert!(r.last().is_some_and(|p| p.0 < t.sequence.ops.len()));
        let peak = r.iter().map(|p| p.1).max();
        assert!(t.recorded_peak_reserved >= peak, "{}", t.name);
    }
}

#[test]
fn kineto_dev_trace() {
    let Some(dir) = crate::common::traces_dir("kineto dev trace") else {
        return;
    };
    let path = dir.join("kineto/hta__v100-2gpu-ddp-rank1_profiler-memory-events.json.gz");
    if !path.is_file() {
        eprintln!("skipping: {} not found", path.display());
        return;
    }
    let t0 = Instant::now();
    let devs = kineto::read(&path).unwrap();
    assert_eq!(
        devs.len(),
        1,
        "one CUDA device (the CPU events are skipped)"
    );
    let d = &devs[0];
    assert_eq!(d.device, 1);
    assert_eq!(d.events, 26_770);
    assert!(
        d.anomalies.is_empty(),
        "{:?}",
        &d.anomalies[..d.anomalies.len().min(5)]
    );
    // In timestamp order, live bytes follow `Total Allocated` exactly: the untracked block plus
    // the window's blocks.
    assert_eq!(d.initial_from_frees, 0);
    assert!(d.untracked_bytes > 0);
    let stats = d.sequence.replay().unwrap();
    eprintln!(
        "kineto {}: {} events, {} ops, {} allocs, untracked {} B, peak live {} B, peak reserved {} B, {:?}",
        crate::common::name(&path),
        d.events,
        d.sequence.ops.len(),
        stats.allocs,
        d.untracked_bytes,
        stats.peak_live,
        d.peak_reserved,
        t0.elapsed()
    );
    assert!(stats.peak_live <= d.peak_reserved);
    let traces = load(&path).unwrap();
    assert_eq!(traces.len(), 1);
    check_trace(&traces[0]);
    eprintln!("  {}", summary(&traces[0]));
}

#[test]
fn load_every_dev_trace() {
    let Some(dir) = crate::common::traces_dir("load every dev trace") else {
        return;
    };
    let mut files = Vec::new();
    for (sub, ext) in [
        ("pytorch_snapshots", ".pickle"),
        ("pytorch_state_snapshots", ".pickle"),
        ("static_lifetimes/minimalloc_challenging", ".csv"),
    ] {
        files.extend(crate::common::files(&dir, sub, ext));
    }
    assert!(!files.is_empty());
    for f in &files {
        let traces = load(f).unwrap_or_else(|e| panic!("{e}"));
        assert!(!traces.is_empty(), "{}: no trace", f.display());
        for t in &traces {
            check_trace(t);
            if f.to_string_lossy().contains("pytorch_snapshots/") {
                assert!(t.recorded_reserved.is_some(), "{}", t.name);
            }
            if f.to_string_lossy().contains("minimalloc") {
                // 64 MiB is the packing bound; some instances never have all of it live.
                assert!(t.sequence.peak_live_requested <= 64 << 20, "{}", t.name);
            }
            eprintln!("{}", summary(t));
        }
    }
}

#[test]
fn own_format_round_trips_a_real_snapshot() {
    let Some(dir) = crate::common::traces_dir("own round trip") else {
        return;
    };
    let path = dir.join("pytorch_snapshots/cs336-silmont2000__small_mem_snapshot.pickle");
    let Ok(traces) = load(&path) else {
        eprintln!("skipping: {} not readable", path.display());
        return;
    };
    let t = &traces[0];
    let mut buf = Vec::new();
    let reserved = t.recorded_reserved.clone().unwrap_or_default();
    own::write_with(&t.sequence, Some(&t.name), t.device, &reserved, &mut buf).unwrap();
    let back = own::parse(std::str::from_utf8(&buf).unwrap()).unwrap();
    assert_eq!(back.sequence, t.sequence);
    assert_eq!(back.recorded_reserved, reserved);
    let mut csv = Vec::new();
    own::export_rmm_csv(&t.sequence, &mut csv).unwrap();
    let log = rmm::parse(std::str::from_utf8(&csv).unwrap()).unwrap();
    assert_eq!(
        log.sequence.peak_live_requested,
        t.sequence.peak_live_requested
    );
    assert_eq!(log.sequence.ops.len(), t.sequence.ops.len());
}

#[test]
fn workloads_are_deterministic_and_valid() {
    for &name in workloads::names() {
        let t0 = Instant::now();
        let a = match workloads::generate(name, 42) {
            Ok(t) => t,
            Err(e) if name.starts_with("minimalloc-") => {
                eprintln!("skipping {name}: {e}");
                continue;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        let took = t0.elapsed();
        let b = workloads::generate(name, 42).unwrap();
        assert_eq!(a, b, "{name}: same seed, same trace");
        check_trace(&a);
        let stats = a.sequence.replay().unwrap();
        assert!(stats.allocs > 0);
        assert!(
            a.sequence.ops.len() < 200_000,
            "{name}: {} ops",
            a.sequence.ops.len()
        );
        if !name.starts_with("minimalloc-") {
            let c = workloads::generate(name, 43).unwrap();
            assert_ne!(a.sequence, c.sequence, "{name}: the seed matters");
        }
        eprintln!("{} [generated in {took:?}]", summary(&a));
    }
}

#[test]
fn training_varies_sequence_length_and_recomputes() {
    let t = workloads::generate("training", 1).unwrap();
    let mut sizes: Vec<u64> = t
        .sequence
        .ops
        .iter()
        .filter_map(|o| match o {
            Op::Alloc { size, .. } => Some(*size),
            _ => None,
        })
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    // Activations of several sequence lengths: b*s*h*2 for s in at least two buckets.
    let bsh = |s: u64| 8 * s * 1024 * 2;
    let n = [128, 256, 512, 1024]
        .iter()
        .filter(|&&s| sizes.binary_search(&bsh(s)).is_ok())
        .count();
    assert!(n >= 2, "{n} sequence lengths");
}

#[test]
fn serving_caches_grow_by_chunks() {
    let t = workloads::generate_from("llm-serving", 5, Path::new("/nonexistent")).unwrap();
    let kv = 128 * 1024u64;
    let grow = t
        .sequence
        .ops
        .windows(2)
        .filter(|w| matches!((w[0], w[1]), (Op::Alloc { size, .. }, Op::Free { .. }) if size % (16 * kv) == 0))
        .count();
    assert!(grow > 100, "{grow} re-allocations");
}
