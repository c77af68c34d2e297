//! Prints every allocator's metrics on the dev traces (PyTorch snapshots with history):
//! `cargo run --release -p cistern-replay --example suite [-- --no-min-capacity] [FILES...]`.
//! Traces come from `CISTERN_TRACES_DIR` or `../shared/traces` next to the workspace.

use std::path::PathBuf;

use cistern_replay::{evaluate, recorded, EvalOptions, ALLOCATORS};
use cistern_trace::Snapshot;

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let min_cap = !args.iter().any(|a| a == "--no-min-capacity");
    let mut files: Vec<PathBuf> = args
        .iter()
        .filter(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .collect();
    if files.is_empty() {
        let dir = std::env::var_os("CISTERN_TRACES_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces")
            })
            .join("pytorch_snapshots");
        let Ok(rd) = std::fs::read_dir(&dir) else {
            eprintln!("skipping: no traces at {}", dir.display());
            return;
        };
        files = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
    }
    for f in files {
        let snap = match Snapshot::read(&f) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{}: {e}", f.display());
                continue;
            }
        };
        let recon = snap.reconstruct(0);
        let seq = &recon.sequence;
        println!(
            "\n{} ({} ops, {} initially live, peak live {:.1} MiB)",
            f.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default(),
            seq.ops.len(),
            seq.initially_live,
            mib(seq.peak_live_requested)
        );
        println!(
            "  {:<20} {:>12} {:>12} {:>7} {:>10} {:>12} {:>12}  driver calls",
            "allocator", "reserved MiB", "live MiB", "F %", "waste MiB", "min cap MiB", "Mops/s"
        );
        let mut rows = vec![recorded(&snap, 0, &recon)];
        match evaluate(
            seq,
            ALLOCATORS,
            EvalOptions {
                min_capacity: min_cap,
                ..EvalOptions::default()
            },
        ) {
            Ok(r) => rows.extend(r),
            Err(e) => eprintln!("  {e}"),
        }
        for r in rows {
            println!(
                "  {:<20} {:>12.1} {:>12.1} {:>7.2} {:>10} {:>12} {:>12}  {:?}{}",
                r.allocator,
                mib(r.peak_reserved),
                mib(r.peak_live),
                100.0 * r.frag,
                r.internal_waste
                    .map(|w| format!("{:.1}", mib(w)))
                    .unwrap_or("-".into()),
                r.min_capacity
                    .map(|c| format!("{:.0}", mib(c)))
                    .unwrap_or("-".into()),
                r.ops_per_sec
                    .map(|o| format!("{:.2}", o / 1e6))
                    .unwrap_or("-".into()),
                r.driver_calls,
                r.oom
                    .map(|o| format!("  OOM at op {}", o.op_index))
                    .unwrap_or_default()
            );
        }
    }
}
