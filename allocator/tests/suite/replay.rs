//! Replays the alloc/free sequences of the dev traces (`/work/shared/traces`, or
//! `CISTERN_TRACES_DIR`) on a simulated GPU and reports peak reserved / peak live, in VMM mode
//! and, for comparison, with `cuMemAlloc` segments.
//!
//! Peak live is the largest sum of requested bytes live at once; peak reserved is
//! `reserved_bytes.all.peak`. The target is a ratio of at most 1.03 on every PyTorch snapshot
//! with history; `BOUNDS` holds what each trace is held to (see there).

use std::collections::HashMap;
use std::path::PathBuf;

use crate::common::*;
use cistern::{SimConfig, StreamId};
use cistern_trace::sequence::{AllocSequence, Op};
use cistern_trace::snapshot::Snapshot;

fn traces_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("CISTERN_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"));
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!(
            "skipping: no trace directory at {} (set CISTERN_TRACES_DIR)",
            dir.display()
        );
        None
    }
}

struct Replay {
    peak_live: u64,
    peak_reserved: u64,
    stitched: i64,
    driver_calls: u64,
    ooms: usize,
}

impl Replay {
    fn ratio(&self) -> f64 {
        self.peak_reserved as f64 / self.peak_live.max(1) as f64
    }
}

/// Replays `seq` on a fresh pool; invariants are checked every 1,000 operations and at the
/// end (after every operation would make the longest traces take minutes in debug builds).
fn replay(seq: &AllocSequence, vmm: bool) -> Replay {
    replay_with(seq, vmm, "")
}

/// [`replay`] with a pool configuration (`CISTERN_CONF` syntax).
fn replay_with(seq: &AllocSequence, vmm: bool, conf: &str) -> Replay {
    let cap = (2 * seq.peak_live_requested).div_ceil(GIB).max(8) * GIB;
    replay_on(seq, vmm, conf, cap)
}

/// [`replay_with`] on a device of `cap` bytes.
fn replay_on(seq: &AllocSequence, vmm: bool, conf: &str, cap: u64) -> Replay {
    let (sim, pool) = pool_with(SimConfig::default().capacity(cap), vmm, conf);
    let mut streams: HashMap<u64, StreamId> = HashMap::new();
    let mut live: HashMap<u64, (u64, u64, StreamId)> = HashMap::new();
    let (mut cur, mut peak_live, mut ooms) = (0u64, 0u64, 0usize);
    for (i, op) in seq.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, stream } => {
                let n = streams.len() as u64;
                let s = *streams.entry(stream).or_insert(StreamId(n));
                match pool.alloc_raw(0, size, s) {
                    Ok(p) => {
                        live.insert(id, (p, size, s));
                        cur += size;
                        peak_live = peak_live.max(cur);
                    }
                    Err(e) if e.is_oom() => ooms += 1,
                    Err(e) => panic!("op {i}: {e}"),
                }
            }
            Op::Free { id } => {
                if let Some((p, size, s)) = live.remove(&id) {
                    pool.free_raw(p, s).unwrap();
                    cur -= size;
                }
            }
        }
        if i % 1000 == 0 {
            check(&pool);
        }
    }
    check(&pool);
    let driver_calls = sim.call_counts().values().sum();
    let r = Replay {
        peak_live,
        peak_reserved: stat(&pool, "reserved_bytes.all.peak") as u64,
        stitched: stat(&pool, "num_stitched_pages"),
        driver_calls,
        ooms,
    };
    for (_, (p, _, s)) in live {
        pool.free_raw(p, s).unwrap();
    }
    assert_no_leak(&sim, pool);
    r
}

/// The target for peak reserved / peak live. Every dev trace meets it today. The
/// closest is the bf16 forward pass at 1.0300 (766 MiB reserved for 743.7 MiB live): 22 MiB
/// of it are large-heap pages only partly covered by live blocks (at most one per live large
/// block, the bound stitching leaves), 2 MiB the small heap's slack.
const TARGET: f64 = 1.03;

fn row(name: &str, v: &Replay, w: &Replay) {
    eprintln!(
        "{name:<60} {:>10.1} {:>10.1} {:>6.4} {:>8} {:>7} {:>10.1} {:>6.3}{}",
        v.peak_live as f64 / MIB as f64,
        v.peak_reserved as f64 / MIB as f64,
        v.ratio(),
        v.stitched,
        v.driver_calls,
        w.peak_reserved as f64 / MIB as f64,
        w.ratio(),
        if v.ooms + w.ooms > 0 {
            format!("  OOMs {}/{}", v.ooms, w.ooms)
        } else {
            String::new()
        }
    );
}

fn header() {
    eprintln!(
        "{:<60} {:>10} {:>10} {:>6} {:>8} {:>7} {:>10} {:>6}",
        "trace", "live MiB", "rsv MiB", "ratio", "stitched", "calls", "seg rsv", "ratio"
    );
}

#[test]
fn pytorch_snapshots_stay_near_peak_live() {
    let Some(dir) = traces_dir() else { return };
    let mut files: Vec<_> = match std::fs::read_dir(dir.join("pytorch_snapshots")) {
        Ok(d) => d.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) => {
            eprintln!("skipping: {e}");
            return;
        }
    };
    files.retain(|p| p.extension().is_some_and(|e| e == "pickle"));
    files.sort();
    header();
    let mut failures = Vec::new();
    for path in files {
        let snap = Snapshot::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        for dev in 0..snap.device_traces.len() {
            if snap.device_traces[dev].is_empty() {
                continue;
            }
            let seq = snap.alloc_free_sequence(dev);
            if seq.peak_live_requested == 0 {
                continue;
            }
            // Memory first (`grow_whole_chunks:off`, what `auto` falls back to as memory
            // runs short) on a device with room: the peak is held to the target.
            let v = replay_with(&seq, true, "grow_whole_chunks:off");
            let w = replay(&seq, false);
            let label = format!("{name} dev {dev}");
            row(&label, &v, &w);
            assert_eq!(v.ooms, 0, "{label}: OOM with VMM");
            assert_eq!(v.peak_live, seq.peak_live_requested, "{label}");
            if v.ratio() > TARGET {
                failures.push(format!("{label}: ratio {:.5} > {TARGET}", v.ratio()));
            }
            // The default settings map whole chunks while memory is plentiful, which costs
            // peak reserved on a device with room; on a device of TARGET x peak live (whole
            // granules) the trace must still run.
            let tight = (TARGET * seq.peak_live_requested as f64) as u64 / (2 * MIB) * (2 * MIB);
            let d = replay_on(&seq, true, "", tight);
            row(
                &format!("{label} (default, {} MiB device)", tight / MIB),
                &d,
                &w,
            );
            if d.ooms > 0 {
                failures.push(format!(
                    "{label}: {} OOMs with the default settings on a {} MiB device",
                    d.ooms,
                    tight / MIB
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// minimalloc's static-lifetime instances (each packs exactly into 1 MiB), scaled by 1024 to
/// 1 GiB so that most sizes are in the large heap; sizes are tens of KiB to MiB, comparable to a
/// page, so this is the harder case for page-granular stitching.
///
/// Page-granular stitching (`chunk_size:2MiB,grow_whole_chunks:off`) is held to the
/// snapshots' target. Memory-first chunks (handles of up to 20 MiB, at most a quarter of a
/// request; see Note [Chunks]) trade memory for far fewer driver calls, and this packed,
/// static workload is where that trade costs most: measured up to 1.22 (instance K), held
/// under 1.25 so that a change of the chunking policy that costs more memory here fails.
#[test]
fn minimalloc_instances_report() {
    let Some(dir) = traces_dir() else { return };
    let Ok(d) = std::fs::read_dir(dir.join("static_lifetimes/minimalloc_challenging")) else {
        eprintln!("skipping: no minimalloc instances");
        return;
    };
    let mut files: Vec<_> = d.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    header();
    for path in files {
        let seq = cistern_trace::minimalloc::read_csv(&path, 1024).unwrap();
        let v = replay_with(&seq, true, "chunk_size:2MiB,grow_whole_chunks:off");
        let w = replay(&seq, false);
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        row(&format!("{name} (pages)"), &v, &w);
        assert_eq!(v.ooms, 0);
        // Measured at most 1.016: held to the same target as the snapshots.
        assert!(v.ratio() <= TARGET, "{}", v.ratio());
        let c = replay_with(&seq, true, "grow_whole_chunks:off");
        row(&format!("{name} (chunks)"), &c, &w);
        assert_eq!(c.ooms, 0);
        assert!(c.ratio() <= 1.25, "{}", c.ratio());
        // The default settings map whole chunks while memory is plentiful (more peak reserved
        // on a device with room), and still run on a device of the same bound.
        let tight = (1.25 * seq.peak_live_requested as f64) as u64 / (2 * MIB) * (2 * MIB);
        let d = replay_on(&seq, true, "", tight);
        row(
            &format!("{name} (default, {} MiB device)", tight / MIB),
            &d,
            &w,
        );
        assert_eq!(
            d.ooms,
            0,
            "{name}: the default settings on a {} MiB device",
            tight / MIB
        );
    }
}
