//! Prints every allocator's metrics on the dev traces (PyTorch snapshots with history, and the
//! MiniMalloc instances scaled by 64):
//! `cargo run --release -p cistern-replay --example suite [-- --no-min-capacity] [FILES...]`.
//! Traces come from `CISTERN_TRACES_DIR` or `../shared/traces` next to the workspace. (The CLI's
//! `cistern replay` is the user-facing command; this is the crate's own quick look.)

use std::path::PathBuf;

use cistern_replay::ReplayResult;
use cistern_replay::{default_allocators, evaluate, evaluate_snapshot, EvalOptions, ALLOCATORS};
use cistern_trace::{AllocSequence, Snapshot};

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
        let root = std::env::var_os("CISTERN_TRACES_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces")
            });
        for sub in [
            "pytorch_snapshots",
            "static_lifetimes/minimalloc_challenging",
        ] {
            let dir = root.join(sub);
            let Ok(rd) = std::fs::read_dir(&dir) else {
                eprintln!("skipping: no traces at {}", dir.display());
                continue;
            };
            let mut v: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
            v.sort();
            files.extend(v);
        }
    }
    let opts = EvalOptions {
        min_capacity: min_cap,
        ..EvalOptions::default()
    };
    for f in files {
        if f.extension().is_some_and(|e| e == "csv") {
            match cistern_trace::minimalloc::read_csv(&f, 64) {
                Ok(seq) => {
                    let name = f
                        .file_name()
                        .map(|n| n.to_string_lossy())
                        .unwrap_or_default();
                    // The instance packs exactly into the size in its name (1 MiB), times 64.
                    let optimum = 64 << 20;
                    header(
                        &format!("{name} x64 (optimum {:.0} MiB)", mib(optimum)),
                        &seq,
                    );
                    let rows = evaluate(&seq, ALLOCATORS, opts).unwrap_or_else(|e| {
                        eprintln!("  {e}");
                        Vec::new()
                    });
                    print_rows(rows);
                }
                Err(e) => eprintln!("{}: {e}", f.display()),
            }
            continue;
        }
        let snap = match Snapshot::read(&f) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{}: {e}", f.display());
                continue;
            }
        };
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        header(&name, &snap.reconstruct(0).sequence);
        match evaluate_snapshot(&snap, 0, &default_allocators(true), opts) {
            Ok(rows) => print_rows(rows),
            Err(e) => eprintln!("  {e}"),
        }
    }
}

fn header(name: &str, seq: &AllocSequence) {
    println!(
        "\n{} ({} ops, {} initially live, peak live {:.1} MiB)",
        name,
        seq.ops.len(),
        seq.initially_live,
        mib(seq.peak_live_requested)
    );
    println!(
        "  {:<20} {:>12} {:>12} {:>7} {:>10} {:>12} {:>9}  driver calls",
        "allocator", "reserved MiB", "live MiB", "F %", "waste MiB", "min cap MiB", "Mops/s"
    );
}

fn print_rows(rows: Vec<ReplayResult>) {
    for r in rows {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_string());
        println!(
            "  {:<20} {:>12.1} {:>12.1} {:>7.2} {:>10} {:>12} {:>9}  {:?}{}",
            r.allocator,
            mib(r.peak_reserved),
            mib(r.peak_live),
            100.0 * r.frag,
            opt(r.internal_waste.map(|w| format!("{:.1}", mib(w)))),
            opt(r.min_capacity.map(|c| format!("{:.0}", mib(c)))),
            opt(r.ops_per_sec.map(|o| format!("{:.2}", o / 1e6))),
            r.driver_calls,
            r.oom
                .map(|o| format!("  OOM at op {}", o.op_index))
                .unwrap_or_default()
        );
    }
}
