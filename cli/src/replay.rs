//! `cistern replay`: load traces (or generate workloads), replay them against allocator models,
//! and present the comparison as tables, JSON and an SVG plot.

use cistern::{format_bytes, CostTable};
use cistern_replay::catalog::{self, as_recorded, ALLOCATORS, AS_RECORDED, GPU_LAG};
use cistern_replay::engine::{self, ReplayResult, TraceReport};
use cistern_trace::load::{self, Format, LoadOptions, Trace};
use cistern_trace::sequence::Op;
use cistern_trace::workloads;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::plot::{self, Chart, Series};
use crate::table::{self, Align, Table};
use crate::ReplayArgs;

/// The seed of generated workloads unless `--seed` names another (fixed, so that runs compare).
const SEED: u64 = 42;

/// A trace to replay, with where its recorded baseline came from.
struct Input {
    trace: Trace,
    /// The label of the recorded reserved curve, when the trace carries one.
    recorded_label: Option<&'static str>,
}

pub fn run(args: &ReplayArgs) -> Result<(), String> {
    if args.allocators.iter().any(|a| a == "list") {
        println!("allocators (--allocators a,b,...):");
        for a in ALLOCATORS {
            println!("  {a}");
        }
        println!("  pytorch:max_split_size_mb:N, pytorch-expandable:max_split_size_mb:N");
        println!(
            "  cistern@lag=N, cistern:KEY:VALUE,...@lag=N (on a GPU N kernels behind the host; \
             --gpu-lag N for every cistern model)"
        );
        println!(
            "  {AS_RECORDED} (PyTorch with the settings a snapshot recorded; added for snapshots \
             that record them)"
        );
        println!("recorded baselines are added automatically when a trace carries one");
        return Ok(());
    }
    if args.workloads.iter().any(|w| w == "list") {
        let available = workloads::available();
        println!("workloads (--workload NAME):");
        for w in workloads::names() {
            let note = if available.contains(w) {
                ""
            } else {
                "  (needs google/minimalloc's CSV in $CISTERN_TRACES_DIR)"
            };
            println!("  {w}{note}");
        }
        return Ok(());
    }
    let defaults = args.allocators.is_empty();
    let mut allocators: Vec<String> = if defaults {
        ALLOCATORS.iter().map(|s| s.to_string()).collect()
    } else {
        join_cistern_settings(&args.allocators)
    };
    if let Some(lag) = args.gpu_lag.filter(|&l| l > 0) {
        for a in &mut allocators {
            if catalog::runs_gpu_work(a) && !a.contains(GPU_LAG) {
                a.push_str(&format!("{GPU_LAG}{lag}"));
            }
        }
    }
    for a in allocators.iter().filter(|a| *a != AS_RECORDED) {
        catalog::make(a, 1 << 30).map_err(|e| format!("--allocators: {e}"))?;
    }
    let costs = match &args.costs {
        Some(path) => CostTable::from_json_file(path).map_err(|e| {
            format!(
                "--costs: {e}\n(see replay/costs/a100-published.json for the format: an object \
                 keyed by call kind, each {{\"per_call_us\": N}} or a number)"
            )
        })?,
        None => CostTable::default(),
    };
    let capacity = match &args.capacity {
        Some(c) => Some(parse_capacity(c)?),
        None => None,
    };

    let inputs = gather(args)?;
    if inputs.is_empty() {
        return Err("nothing to replay: no trace in the given files".into());
    }

    let total = (inputs.len() * allocators.len()) as u64;
    let bar = progress(total, args.json);
    let mut reports = Vec::new();
    let mut warnings = Vec::new();
    for input in &inputs {
        let seq = &input.trace.sequence;
        // The state the recording held when its window opened, when there was one.
        let start = input.trace.window_start.as_ref().filter(|w| !w.is_empty());
        let cap = match capacity {
            Some(c) => c,
            // A seeded row holds the recorded state besides the window's live bytes.
            None => auto_capacity(
                seq.peak_live_requested
                    .saturating_add(start.map_or(0, |w| w.bytes())),
            )
            .map_err(|e| format!("{}: {e}", input.trace.name))?,
        };
        let mut results = Vec::new();
        if let Some(label) = input.recorded_label {
            if let Some(r) = recorded_row(&input.trace, label) {
                results.push(r);
            }
        }
        // By default, a trace that recorded its allocator's settings is also replayed under
        // them, next to PyTorch's two defaults.
        let mut names = allocators.clone();
        if defaults && input.trace.allocator_settings.is_some() {
            let at = names
                .iter()
                .position(|a| a == "pytorch-expandable")
                .map_or(names.len(), |i| i + 1);
            names.insert(at, AS_RECORDED.to_string());
        }
        for a in &names {
            bar.set_message(format!("{} / {a}", input.trace.name));
            let (spec, mut note) = if a == AS_RECORDED {
                let (spec, note) = as_recorded(input.trace.allocator_settings.as_ref());
                (spec, Some(note))
            } else {
                (a.clone(), None)
            };
            let seed = start.filter(|_| a == AS_RECORDED || (args.seeded && is_pytorch(a)));
            let mut r = match seed {
                Some(w) => engine::run_from(seq, &spec, cap, &costs, w)?,
                None => engine::run_with(seq, &spec, cap, &costs)?,
            };
            let mut search_note = None;
            if !args.no_min_capacity {
                r.min_capacity = match seed {
                    // A recorded state no device holds (the search gives up) is this row's
                    // finding, not an error of the whole run.
                    Some(w) => match engine::min_capacity_from(seq, &spec, w) {
                        Ok(c) => Some(c),
                        Err(e) => {
                            search_note = Some(format!("min capacity: {e}"));
                            None
                        }
                    },
                    None => Some(engine::min_capacity(seq, &spec)?),
                };
            }
            if let Some(w) = seed {
                let mut s = seeded_note(w);
                if let Some(n) = search_note {
                    s.push_str(&format!("; {n}"));
                }
                note = Some(match note {
                    Some(n) => format!("{n}; {s}"),
                    None => s,
                });
            }
            if let Some(note) = note {
                r.allocator = a.clone();
                r.note = Some(match r.note.take() {
                    Some(own) => format!("{note}; {own}"),
                    None => note,
                });
            }
            results.push(r);
            bar.inc(1);
        }
        warnings.extend(capacity_warning(&input.trace, &results, cap));
        for r in results.iter().filter(|r| r.hazards > 0) {
            warnings.push(format!(
                "{}: {} on {}: {} hazards (memory unmapped, released or handed out while \
                 simulated GPU work still used it): a bug in the model; please report it with \
                 this command",
                input.trace.name,
                r.allocator,
                format_bytes(cap),
                r.hazards
            ));
        }
        reports.push(TraceReport {
            trace: input.trace.name.clone(),
            results,
        });
    }
    bar.finish_and_clear();
    for w in &warnings {
        eprintln!("cistern: warning: {}", table::printable(w));
    }

    if let Some(path) = &args.plot {
        plot::write_file(path, &charts(&reports), args.json)?;
    }
    if args.json {
        let doc = if reports.len() == 1 {
            serde_json::to_string_pretty(&reports[0])
        } else {
            serde_json::to_string_pretty(&reports)
        };
        println!("{}", doc.map_err(|e| e.to_string())?);
    } else {
        print_tables(&reports);
    }
    Ok(())
}

/// `--allocators` splits at commas, and so does a `cistern:KEY:VALUE,KEY:VALUE` spec (its
/// settings in CISTERN_CONF syntax): a piece that names no allocator but is a `KEY:VALUE`
/// setting, following a `cistern:` spec, is one more of that spec's settings.
fn join_cistern_settings(pieces: &[String]) -> Vec<String> {
    let names_an_allocator = |p: &str| {
        let p = p.split(GPU_LAG).next().unwrap_or(p);
        let base = p.split(':').next().unwrap_or(p).trim();
        ALLOCATORS.contains(&base)
            || base == AS_RECORDED
            || base == catalog::RECORDED
            || base == "list"
    };
    let mut out: Vec<String> = Vec::new();
    for p in pieces {
        match out.last_mut() {
            Some(last)
                if last.starts_with("cistern:") && p.contains(':') && !names_an_allocator(p) =>
            {
                last.push(',');
                last.push_str(p);
            }
            _ => out.push(p.clone()),
        }
    }
    out
}

/// Whether the model `name` is one of the PyTorch models (which can start from a recorded
/// state).
fn is_pytorch(name: &str) -> bool {
    let base = name.split(':').next().unwrap_or(name);
    matches!(base, "pytorch" | "pytorch-expandable" | AS_RECORDED)
}

/// The note of a row that started from the recorded state at the window's start.
fn seeded_note(w: &cistern_trace::WindowStart) -> String {
    format!(
        "started from the recorded state at the window's start ({} in {} segments, {} of it \
         live)",
        format_bytes(w.bytes()),
        w.segments.len(),
        format_bytes(w.live_bytes())
    )
}

/// Loads the files and generates the workloads asked for (the built-in ones when neither).
fn gather(args: &ReplayArgs) -> Result<Vec<Input>, String> {
    let mut inputs = Vec::new();
    let opts = load_options(args.max_input.as_deref())?;
    for path in &args.files {
        // Read once: a pipe gives its bytes only once.
        let (format, traces) = load::load_file(path, &opts).map_err(|e| e.to_string())?;
        if traces.is_empty() {
            return Err(format!(
                "{}: {}: read, but it holds no allocation: nothing to replay (leave it out)",
                path.display(),
                format.name()
            ));
        }
        for trace in traces {
            // Snapshots and profiler traces (gzipped or not) record PyTorch's reserved bytes;
            // cistern's own traces record the recording allocator's.
            let recorded_label = trace.recorded_reserved.as_ref().map(|_| match format {
                Format::Own => "recorded",
                _ => "pytorch-recorded",
            });
            inputs.push(Input {
                trace,
                recorded_label,
            });
        }
    }
    let names: Vec<String> = if args.files.is_empty() && args.workloads.is_empty() {
        // The built-in set reads no file: the same rows on every machine.
        workloads::builtin().iter().map(|s| s.to_string()).collect()
    } else {
        args.workloads.clone()
    };
    let seed = args.seed.unwrap_or(SEED);
    for name in names {
        let mut trace = workloads::generate(&name, seed).map_err(|e| format!("--workload: {e}"))?;
        if seed != SEED && workloads::is_random(&name) {
            trace.name = format!("{} seed {seed}", trace.name);
        }
        inputs.push(Input {
            trace,
            recorded_label: None,
        });
    }
    Ok(inputs)
}

/// `--capacity SIZE`: a size with its unit. A bare number is refused: `-c 80` would be 80
/// bytes, on which every allocator fails (`80B` asks for bytes).
fn parse_capacity(text: &str) -> Result<u64, String> {
    parse_size_with_unit("--capacity", text)
}

/// A size option's value: a number with its unit (`80GiB`, `512MB`, `4096B`); a bare number
/// is refused, since bytes are rarely what was meant.
pub fn parse_size_with_unit(flag: &str, text: &str) -> Result<u64, String> {
    let t = text.trim();
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(format!(
            "{flag} {t}: a size needs a unit, e.g. {t}GiB, {t}GB or {t}MiB ({t}B for bytes)"
        ));
    }
    cistern::config::parse_size(t).map_err(|e| format!("{flag}: {e}"))
}

/// The reader's options: `--max-input` caps what each input may take.
pub fn load_options(max_input: Option<&str>) -> Result<LoadOptions, String> {
    Ok(LoadOptions {
        max_input_bytes: max_input
            .map(|m| parse_size_with_unit("--max-input", m))
            .transpose()?,
        ..LoadOptions::default()
    })
}

/// When every modelled allocator failed the trace's very first allocation on a device of
/// `capacity` bytes, the capacity, not the allocators, is likely what is wrong: says so.
fn capacity_warning(trace: &Trace, results: &[ReplayResult], capacity: u64) -> Option<String> {
    let first = trace
        .sequence
        .ops
        .iter()
        .position(|op| matches!(op, Op::Alloc { .. }))?;
    let mut models = results
        .iter()
        .filter(|r| r.ops_per_sec.is_some())
        .peekable();
    models.peek()?;
    if !models.all(|r| r.oom.as_ref().is_some_and(|o| o.op_index == first)) {
        return None;
    }
    let Op::Alloc { size, .. } = trace.sequence.ops[first] else {
        return None;
    };
    Some(format!(
        "{}: every allocator failed the first allocation ({}) on the {} device: the capacity \
         is likely wrong (--capacity takes a unit, e.g. 80GiB)",
        trace.name,
        format_bytes(size),
        format_bytes(capacity)
    ))
}

/// A simulated device comfortably larger than the trace: four times its peak live bytes, at
/// least 8 GiB, rounded up to a GiB; capped at the largest whole GiB a `u64` holds (it used to
/// wrap to 0 above a 2^62-byte peak). Capacity costs the simulator nothing. A peak above that
/// cap is an error: no device this replay can simulate holds it.
fn auto_capacity(peak_live: u64) -> Result<u64, String> {
    const GIB: u64 = 1 << 30;
    const LARGEST: u64 = u64::MAX / GIB * GIB;
    let want = peak_live.saturating_mul(4).max(8 * GIB).div_ceil(GIB);
    let cap = want.checked_mul(GIB).unwrap_or(LARGEST);
    if peak_live > cap {
        return Err(format!(
            "its peak of {peak_live} live bytes is above the largest device a replay can \
             simulate ({LARGEST} bytes); the trace's sizes are likely corrupt"
        ));
    }
    Ok(cap)
}

/// The row of a trace's recorded reserved curve.
fn recorded_row(trace: &Trace, label: &str) -> Option<ReplayResult> {
    let points = trace.recorded_reserved.as_ref()?;
    let seq = &trace.sequence;
    let live = seq.live_curve();
    let peak_reserved = trace
        .recorded_peak_reserved
        .unwrap_or_else(|| points.iter().map(|p| p.1).max().unwrap_or(0));
    let peak_live = seq.peak_live_requested;
    let mut note = "recorded by the allocator that produced the trace".to_string();
    if let Some(w) = trace.window_start.as_ref().filter(|w| !w.is_empty()) {
        note.push_str(&format!(
            "; held {} when its window opened, for {} live",
            format_bytes(w.bytes()),
            format_bytes(w.live_bytes())
        ));
    }
    // Reserved per op, stepping at each point.
    let mut series = Vec::new();
    let mut next = 0;
    let mut reserved = 0;
    let stride = live.len().div_ceil(engine::MAX_SERIES_POINTS).max(1);
    for (i, &l) in live.iter().enumerate() {
        while next < points.len() && points[next].0 <= i {
            reserved = points[next].1;
            next += 1;
        }
        if i % stride == 0 || i + 1 == live.len() {
            series.push(engine::Point {
                op: i,
                reserved,
                live: l,
            });
        }
    }
    Some(ReplayResult {
        allocator: label.to_string(),
        peak_reserved,
        peak_live,
        frag: engine::frag(peak_live, peak_reserved),
        internal_waste: None,
        min_capacity: None,
        driver_calls: Default::default(),
        driver_time_us: 0.0,
        host_waits: 0,
        pages_moved: 0,
        hazards: 0,
        steady_driver_calls: 0,
        ops_per_sec: None,
        ops: live.len(),
        capacity: None,
        oom: None,
        pre_window_bytes: trace.window_start.as_ref().map(|w| w.bytes()),
        seeded: false,
        note: Some(note),
        series,
    })
}

fn progress(total: u64, quiet: bool) -> ProgressBar {
    use std::io::IsTerminal;
    if quiet || !std::io::stderr().is_terminal() || total < 2 {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} replays  {msg}") {
        bar.set_style(style);
    }
    bar
}

fn pct(f: f64) -> String {
    format!("{:.1}%", f * 100.0)
}

/// What the table's columns mean: printed under the tables and by `cistern replay --help`.
pub const COLUMNS: &str = "\
Columns:
  peak reserved  the most device memory the allocator held (green: the least of the models)
  F              fragmentation: 1 - peak live / peak reserved
  min capacity   the smallest device on which the trace runs without running out (bisection)
  x live         min capacity / peak live: the device the allocator needs, in multiples of
                 the live bytes (1.000: no overhead; -: not searched, with --no-min-capacity
                 or for a recorded baseline)
  driver calls   calls to the simulated driver (reserve, map, alloc, free, ...)
  drv ms         their modelled host time, priced by the cost table (--costs)
  waits          calls that block the host on GPU work (counted, not timed)
  steady         driver calls after peak reserved was first reached (churn)
  ops/s          replay speed of the model on this machine (- for a recorded baseline)";

fn print_tables(reports: &[TraceReport]) {
    let colour = table::use_colour();
    for (i, rep) in reports.iter().enumerate() {
        if i > 0 {
            println!();
        }
        let live = rep.results.first().map_or(0, |r| r.peak_live);
        // The name may come from the file's content (a cistern trace's `name` line).
        println!(
            "{}  (peak live {})",
            table::printable(&rep.trace),
            format_bytes(live)
        );
        let best = rep
            .results
            .iter()
            .filter(|r| r.oom.is_none() && r.ops_per_sec.is_some() && r.allocator != "ideal")
            .map(|r| r.peak_reserved)
            .min();
        let mut t = Table::new(&[
            ("allocator", Align::Left),
            ("peak reserved", Align::Right),
            ("F", Align::Right),
            ("min capacity", Align::Right),
            ("x live", Align::Right),
            ("driver calls", Align::Right),
            ("drv ms", Align::Right),
            ("waits", Align::Right),
            ("steady", Align::Right),
            ("ops/s", Align::Right),
            ("", Align::Left),
        ]);
        for r in &rep.results {
            let calls: u64 = r.driver_calls.values().sum();
            let min_cap = r.min_capacity.map_or("-".to_string(), format_bytes);
            let ratio = r
                .min_capacity
                .filter(|_| r.peak_live > 0)
                .map_or("-".to_string(), |m| {
                    format!("{:.3}", m as f64 / r.peak_live as f64)
                });
            // Recorded rows have no simulated driver: their costs are unknown.
            let modelled = r.ops_per_sec.is_some();
            let (drv_ms, waits, steady) = if modelled {
                (
                    format!("{:.1}", r.driver_time_us / 1000.0),
                    r.host_waits.to_string(),
                    r.steady_driver_calls.to_string(),
                )
            } else {
                ("-".into(), "-".into(), "-".into())
            };
            let ops = r
                .ops_per_sec
                .map_or("-".to_string(), |o| format!("{:.2}M", o / 1e6));
            let mut note = String::new();
            if let Some(o) = &r.oom {
                note = format!("OOM at op {}", o.op_index);
            } else if let Some(n) = &r.note {
                note = n.clone();
            }
            let good = best == Some(r.peak_reserved) && r.ops_per_sec.is_some();
            let bad = r.oom.is_some();
            t.row_coloured(vec![
                (r.allocator.clone(), None),
                (
                    format_bytes(r.peak_reserved),
                    if good {
                        Some(table::GREEN)
                    } else if bad {
                        Some(table::RED)
                    } else {
                        None
                    },
                ),
                (pct(r.frag), None),
                (min_cap, None),
                (ratio, None),
                (calls.to_string(), None),
                (drv_ms, None),
                (waits, None),
                (steady, None),
                (ops, None),
                (note, bad.then_some(table::RED)),
            ]);
        }
        print!("{}", t.render(colour));
    }
    if !reports.is_empty() {
        println!();
        println!("{COLUMNS}");
    }
}

fn charts(reports: &[TraceReport]) -> Vec<Chart> {
    reports
        .iter()
        .map(|rep| {
            let mut series: Vec<Series> = rep
                .results
                .iter()
                .filter(|r| r.allocator != "ideal")
                .map(|r| Series {
                    name: format!("{} (reserved)", r.allocator),
                    points: r
                        .series
                        .iter()
                        .map(|p| (p.op as f64, p.reserved as f64))
                        .collect(),
                    dashed: r.ops_per_sec.is_none(),
                })
                .collect();
            if let Some(r) = rep.results.iter().find(|r| !r.series.is_empty()) {
                series.push(Series {
                    name: "live (requested)".into(),
                    points: r
                        .series
                        .iter()
                        .map(|p| (p.op as f64, p.live as f64))
                        .collect(),
                    dashed: true,
                });
            }
            Chart {
                title: rep.trace.clone(),
                x_label: "operation".into(),
                series,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_capacity_is_generous_and_rounded() {
        assert_eq!(auto_capacity(0), Ok(8 << 30));
        assert_eq!(auto_capacity(3 << 30), Ok(12 << 30));
        assert_eq!(auto_capacity((3 << 30) + 1), Ok(13 << 30));
    }

    /// A peak above 2^62 used to wrap the capacity to 0 (four times the peak saturated, then
    /// rounding up to a GiB overflowed), so even `ideal` ran out; the capacity now saturates
    /// at the largest whole GiB and always holds the peak, or the trace gets an error.
    #[test]
    fn auto_capacity_of_a_huge_peak_never_wraps() {
        const GIB: u64 = 1 << 30;
        let largest = u64::MAX / GIB * GIB;
        for peak in [(1 << 62) + 1, 1 << 63, largest - 1, largest] {
            let cap = auto_capacity(peak).unwrap();
            assert!(cap >= peak && cap.is_multiple_of(GIB), "{peak}: {cap}");
            let mut m = cistern_replay::make("ideal", cap).unwrap();
            let op = cistern_trace::Op::Alloc {
                id: 1,
                size: peak,
                stream: 0,
            };
            let seq = cistern_trace::AllocSequence::new(vec![op], 0).unwrap();
            let r = cistern_replay::replay(&seq, m.as_mut());
            assert!(r.oom.is_none(), "{peak}: {:?}", r.oom);
        }
        let e = auto_capacity(largest + 1).unwrap_err();
        assert!(e.contains("largest device"), "{e}");
        assert!(auto_capacity(u64::MAX).is_err());
    }
}
