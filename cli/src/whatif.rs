//! `cistern whatif`: for each OOM recorded in a PyTorch snapshot, whether it would have fitted
//! with other PyTorch settings or with cistern; presented as a sentence, a table, `--json` and
//! a `--plot` of reserved and live around each OOM. The analysis is
//! [`cistern_replay::whatif`]; this module owns the arguments, the loading and the output.

use std::path::PathBuf;

use cistern::format_bytes;
use cistern_replay::whatif::{
    self, candidates, gib, CapacityReport, OomReport, PytorchSettings, Verdict, WhatifOptions,
};
use cistern_trace::load::{self, Loaded};

use crate::plot::{self, Chart, Series};
use crate::replay::{load_options, parse_size_with_unit};
use crate::table::{self, Align, Table};

/// Arguments of `cistern whatif`.
#[derive(clap::Args, Debug)]
pub struct WhatifArgs {
    /// PyTorch memory snapshots with history (.pickle, .pickle.gz), e.g. from
    /// cistern_torch.record_oom_snapshot(); other traces `replay` reads with --capacity.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Replay at this capacity (with its unit, e.g. 40GiB) instead of the one reconstructed at
    /// each OOM; for a file without OOM, asks whether the whole trace runs on it.
    #[arg(long, short = 'c')]
    pub capacity: Option<String>,
    /// Print one JSON document instead of the text.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot of reserved and live memory around each OOM per allocator.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Skip the search for each allocator's headroom (only whether the request fits).
    #[arg(long)]
    pub no_headroom: bool,
    /// The most bytes taken from each input, read and decompressed (e.g. 16GiB).
    #[arg(long, value_name = "SIZE")]
    pub max_input: Option<String>,
}

/// One file's answers.
struct FileReport {
    file: String,
    ooms: Vec<OomReport>,
    at_capacity: Vec<CapacityReport>,
    note: Option<String>,
}

/// What a replay cannot know, said once after the answers.
const CANNOT_KNOW: &str = "What the replay cannot know: memory held outside this allocator \
     (other processes, the CUDA context, cuBLAS/cuDNN/NCCL workspaces, other libraries' \
     cudaMalloc calls) is in the capacity as it was at the OOM, and is assumed not to change; \
     a program that would behave differently with more memory (cuDNN picking another \
     algorithm, a retry with a smaller batch) is replayed as recorded; and a \
     set_per_process_memory_fraction limit is not in the snapshot.";

pub fn run(args: &WhatifArgs) -> Result<(), String> {
    let capacity = args
        .capacity
        .as_deref()
        .map(|c| parse_size_with_unit("--capacity", c))
        .transpose()?;
    let opts = WhatifOptions {
        capacity,
        headroom: !args.no_headroom,
        series: args.plot.is_some(),
        ..WhatifOptions::default()
    };
    let load_opts = load_options(args.max_input.as_deref())?;
    let mut reports = Vec::new();
    for path in &args.files {
        let shown = path.display().to_string();
        let loaded = load::load_any(path, &load_opts).map_err(|e| {
            let mut m = e.to_string();
            if m.contains("pickle:") {
                m.push_str(" (a truncated or damaged snapshot? dump it again)");
            }
            m
        })?;
        reports.push(analyze_file(&shown, loaded, &opts)?);
    }
    if let Some(path) = &args.plot {
        plot::write_file(path, &charts(&reports), args.json)?;
    }
    if args.json {
        // `{"ooms": [...]}`, each OOM with its file; files without OOM under `at_capacity`.
        let mut ooms = Vec::new();
        let mut at = Vec::new();
        let mut notes = Vec::new();
        for r in &reports {
            for o in &r.ooms {
                let mut v = serde_json::to_value(o).map_err(|e| e.to_string())?;
                v["file"] = r.file.clone().into();
                v["answer"] = o.answer().into();
                ooms.push(v);
            }
            for c in &r.at_capacity {
                let mut v = serde_json::to_value(c).map_err(|e| e.to_string())?;
                v["file"] = r.file.clone().into();
                at.push(v);
            }
            notes.extend(r.note.clone());
        }
        let doc = serde_json::json!({
            "ooms": ooms,
            "at_capacity": at,
            "notes": notes,
            "cannot_know": CANNOT_KNOW,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?
        );
    } else {
        print_text(&reports);
    }
    Ok(())
}

fn analyze_file(name: &str, loaded: Loaded, opts: &WhatifOptions) -> Result<FileReport, String> {
    let (settings, traces, ooms, what) = match loaded {
        Loaded::Snapshot(snap, traces) => {
            if !snap.has_history() {
                // What a state-only snapshot does tell: the memory at the dump, per device.
                let mut devices: Vec<u64> = snap.segments.iter().map(|s| s.device).collect();
                devices.sort_unstable();
                devices.dedup();
                let state: Vec<String> = devices
                    .iter()
                    .map(|&d| {
                        let d = d as usize;
                        format!(
                            "cuda:{d}: {} reserved, {} live",
                            gib(snap.reserved_bytes(d)),
                            gib(snap.active_requested_bytes(d))
                        )
                    })
                    .collect();
                let state = if state.is_empty() {
                    String::new()
                } else {
                    format!(" (at the dump: {})", state.join("; "))
                };
                return Err(format!("{name}{state}: {}", whatif::NO_HISTORY));
            }
            let ooms = whatif::analyze_snapshot(&snap, opts).map_err(|e| format!("{name}: {e}"))?;
            let s = PytorchSettings::recorded(snap.allocator_settings.as_ref()).unwrap_or_default();
            (s, traces, ooms, None)
        }
        Loaded::Other(format, traces, failures) => {
            if !failures.is_empty() {
                return analyze_failures(name, format.name(), &traces, &failures, opts);
            }
            (
                PytorchSettings::default(),
                traces,
                Vec::new(),
                Some(format.name()),
            )
        }
    };
    if !ooms.is_empty() {
        return Ok(FileReport {
            file: name.to_string(),
            ooms,
            at_capacity: Vec::new(),
            note: None,
        });
    }
    let no_oom = match what {
        None => format!("{name}: no OOM recorded (no `oom` event in its device_traces)"),
        Some(what) => format!(
            "{name}: {what}: no OOM recorded (whatif finds OOMs in PyTorch snapshots' `oom` \
             events; this format records none with the capacity it failed at)"
        ),
    };
    let Some(capacity) = opts.capacity else {
        return Err(format!(
            "{no_oom}; ask whether it runs on a smaller device with --capacity SIZE, e.g. \
             cistern whatif {name} --capacity 40GiB"
        ));
    };
    if traces.is_empty() {
        return Err(format!("{no_oom}, and it holds no allocation to replay"));
    }
    let mut cands = candidates(&settings);
    if what.is_some() {
        // Not a snapshot: no recorded settings; the first row is PyTorch with its defaults.
        for c in &mut cands {
            c.recorded = false;
        }
    }
    let at = traces
        .iter()
        .map(|t| whatif::at_capacity(&t.name, t.device, &t.sequence, capacity, &cands, opts))
        .collect();
    Ok(FileReport {
        file: name.to_string(),
        ooms: Vec::new(),
        at_capacity: at,
        note: Some(no_oom),
    })
}

/// A trace whose failed allocations carry no capacity (an RMM log): replayed at `--capacity`.
fn analyze_failures(
    name: &str,
    what: &str,
    traces: &[load::Trace],
    failures: &[load::FailedAlloc],
    opts: &WhatifOptions,
) -> Result<FileReport, String> {
    let Some(capacity) = opts.capacity else {
        return Err(format!(
            "{name}: {what}: {} failed allocations recorded, but the log does not say how much \
             memory the device had: pass --capacity SIZE (what the pool could use, e.g. \
             --capacity 80GiB) to ask whether they would have fitted",
            failures.len()
        ));
    };
    let mut ooms = Vec::new();
    for t in traces {
        let here: Vec<_> = failures
            .iter()
            .filter(|f| f.device == t.device)
            .map(|f| (f.ops_before, f.size, f.stream, f.time_ns))
            .collect();
        ooms.extend(whatif::analyze_failures(
            t.device,
            &t.sequence,
            &here,
            capacity,
            opts,
        ));
    }
    if ooms.is_empty() {
        // Every allocation failed: nothing was replayed, but the requests are still answered.
        let empty = cistern_trace::AllocSequence::default();
        let here: Vec<_> = failures
            .iter()
            .map(|f| (0, f.size, f.stream, f.time_ns))
            .collect();
        ooms = whatif::analyze_failures(0, &empty, &here, capacity, opts);
    }
    Ok(FileReport {
        file: name.to_string(),
        ooms,
        at_capacity: Vec::new(),
        note: None,
    })
}

fn signed(h: Option<i64>) -> String {
    match h {
        Some(h) if h >= 0 => format!("+{}", gib(h.unsigned_abs())),
        Some(h) => format!("-{}", gib(h.unsigned_abs())),
        None => "-".into(),
    }
}

fn verdict_table(results: &[Verdict]) -> String {
    let colour = table::use_colour();
    let mut t = Table::new(&[
        ("allocator", Align::Left),
        ("fits", Align::Left),
        ("headroom", Align::Right),
        ("needs", Align::Right),
        ("reserved", Align::Right),
        ("", Align::Left),
    ]);
    for v in results {
        let (fits, c) = match v.fits {
            Some(true) => ("yes", Some(table::GREEN)),
            Some(false) => ("no", Some(table::RED)),
            None => ("?", Some(table::YELLOW)),
        };
        let mut note = v.note.clone().unwrap_or_default();
        if let Some(e) = v.earlier_oom {
            note = format!(
                "runs out earlier: op {} ({})",
                e.op_index,
                format_bytes(e.size)
            );
        }
        if v.recorded && !v.conf.is_empty() {
            note = if note.is_empty() {
                v.conf.clone()
            } else {
                format!("{}; {note}", v.conf)
            };
        }
        t.row_coloured(vec![
            (v.label(), None),
            (fits.to_string(), c),
            (signed(v.headroom), None),
            (v.needed.map_or("-".into(), gib), None),
            (v.reserved.map_or("-".into(), gib), None),
            (note, None),
        ]);
    }
    t.render(colour)
}

fn print_text(reports: &[FileReport]) {
    let mut first = true;
    for rep in reports {
        let file = table::printable(&rep.file);
        let n = rep.ooms.len();
        for (i, o) in rep.ooms.iter().enumerate() {
            if !first {
                println!();
            }
            first = false;
            println!("{}", o.answer());
            let when = o.time_us.map(|t| format!(" at {t} us")).unwrap_or_default();
            // PyTorch's streams are pointers (hex); the default stream is 0.
            let stream = if o.stream < 1 << 16 {
                o.stream.to_string()
            } else {
                format!("{:#x}", o.stream)
            };
            println!(
                "  {file}: OOM {} of {n} on cuda:{}, stream {stream}{when}: {} requested{}",
                i + 1,
                o.device,
                gib(o.size),
                o.frame
                    .as_deref()
                    .map(|f| format!(" at {}", table::printable(f)))
                    .unwrap_or_default()
            );
            let cap = match (o.capacity_source, o.device_free) {
                (whatif::CapacitySource::Given, _) => format!("{} (given)", gib(o.capacity)),
                (_, Some(f)) => format!(
                    "{} (recorded reserved {} + device_free {})",
                    gib(o.capacity),
                    gib(o.recorded_reserved),
                    gib(f)
                ),
                (_, None) => gib(o.capacity),
            };
            println!(
                "  capacity {cap}; live {}; {} operations before it",
                gib(o.live),
                o.ops_before
            );
            for note in &o.notes {
                println!("  note: {}", table::printable(note));
            }
            print!("{}", verdict_table(&o.results));
        }
        for c in &rep.at_capacity {
            if !first {
                println!();
            }
            first = false;
            if let Some(n) = &rep.note {
                println!("{}.", table::printable(n));
            }
            let fit: Vec<String> = c
                .results
                .iter()
                .filter(|v| v.fits == Some(true))
                .map(|v| v.label())
                .collect();
            let head = if fit.is_empty() {
                format!(
                    "On {} no allocator tried runs {} (peak live {}).",
                    gib(c.capacity),
                    table::printable(&c.trace),
                    gib(c.peak_live)
                )
            } else {
                format!(
                    "On {} {} runs with: {}.",
                    gib(c.capacity),
                    table::printable(&c.trace),
                    fit.join(", ")
                )
            };
            println!("{head}");
            print!("{}", verdict_table(&c.results));
        }
    }
    println!();
    println!("{CANNOT_KNOW}");
}

fn charts(reports: &[FileReport]) -> Vec<Chart> {
    let mut out = Vec::new();
    for rep in reports {
        for (i, o) in rep.ooms.iter().enumerate() {
            let mut series: Vec<Series> = o
                .results
                .iter()
                .filter(|v| !v.series.is_empty())
                .map(|v| Series {
                    name: format!("{} (reserved)", v.label()),
                    points: v
                        .series
                        .iter()
                        .map(|p| (p.op as f64, p.reserved as f64))
                        .collect(),
                    dashed: false,
                })
                .collect();
            if !o.recorded_series.is_empty() {
                series.push(Series {
                    name: "pytorch-recorded (reserved)".into(),
                    points: o
                        .recorded_series
                        .iter()
                        .map(|p| (p.op as f64, p.reserved as f64))
                        .collect(),
                    dashed: true,
                });
                series.push(Series {
                    name: "live (requested)".into(),
                    points: o
                        .recorded_series
                        .iter()
                        .map(|p| (p.op as f64, p.live as f64))
                        .collect(),
                    dashed: true,
                });
                let (x0, x1) = (
                    o.recorded_series[0].op as f64,
                    o.recorded_series[o.recorded_series.len() - 1].op as f64,
                );
                series.push(Series {
                    name: "capacity".into(),
                    points: vec![(x0, o.capacity as f64), (x1, o.capacity as f64)],
                    dashed: true,
                });
            }
            out.push(Chart {
                title: format!(
                    "{}: OOM {} on cuda:{} ({} requested)",
                    rep.file,
                    i + 1,
                    o.device,
                    gib(o.size)
                ),
                x_label: "operation".into(),
                series,
            });
        }
        for c in &rep.at_capacity {
            let mut series: Vec<Series> = c
                .results
                .iter()
                .filter(|v| !v.series.is_empty())
                .map(|v| Series {
                    name: format!("{} (reserved)", v.label()),
                    points: v
                        .series
                        .iter()
                        .map(|p| (p.op as f64, p.reserved as f64))
                        .collect(),
                    dashed: false,
                })
                .collect();
            if let Some(v) = c.results.iter().find(|v| !v.series.is_empty()) {
                series.push(Series {
                    name: "live (requested)".into(),
                    points: v
                        .series
                        .iter()
                        .map(|p| (p.op as f64, p.live as f64))
                        .collect(),
                    dashed: true,
                });
            }
            out.push(Chart {
                title: format!("{} on {}", c.trace, gib(c.capacity)),
                x_label: "operation".into(),
                series,
            });
        }
    }
    out
}
