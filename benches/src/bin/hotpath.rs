//! The quick mode of the hot-path benchmark, for scripts: every case in well under 30 s.
//!
//! ```text
//! cargo run --release -p cistern-benches --bin hotpath -- [--json] [--check-targets]
//!     [--case small_4KiB|trace_mix] [--live N] [--threads N] [--reps N] [--rep-ms MS]
//!     [--verbose]
//! ```
//!
//! For every case, live-set size and thread count it builds a cistern harness and a host
//! mimalloc harness on the same workloads, calibrates a number of pairs per repetition (about
//! `--rep-ms` of work), runs `--reps` repetitions alternating between the two, and reports the
//! medians. `--json` prints one JSON object per line; otherwise a table. `--check-targets`
//! then prints PASS/FAIL for each performance target with its numbers; it is informational
//! and the exit code stays 0. This file owns only the command line, the timing policy and the
//! reports; the measured loop is [`cistern_benches::run_pairs`].

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cistern_benches::backend::Backend;
use cistern_benches::workload::{trace_mix, TRACE_FILE};
use cistern_benches::{CaseKind, Cistern, Harness, HostMimalloc, Workload, LIVE_BLOCKS, THREADS};

const USAGE: &str = "usage: hotpath [--json] [--check-targets] [--case small_4KiB|trace_mix] \
                     [--live N] [--threads N] [--reps N] [--rep-ms MS] [--verbose]";

/// Calibration stops growing the batch once one run takes this long.
const CALIBRATE_MIN: Duration = Duration::from_millis(4);

struct Options {
    json: bool,
    verbose: bool,
    check_targets: bool,
    cases: Vec<CaseKind>,
    live: Vec<usize>,
    threads: Vec<usize>,
    reps: usize,
    rep_time: Duration,
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        json: false,
        verbose: false,
        check_targets: false,
        cases: CaseKind::ALL.to_vec(),
        live: LIVE_BLOCKS.to_vec(),
        threads: THREADS.to_vec(),
        reps: 5,
        rep_time: Duration::from_millis(20),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--json" => o.json = true,
            "--verbose" => o.verbose = true,
            "--check-targets" => o.check_targets = true,
            "--case" => {
                let v = value("--case")?;
                let kind = CaseKind::ALL
                    .into_iter()
                    .find(|k| k.name() == v)
                    .ok_or(format!("unknown case `{v}`"))?;
                o.cases = vec![kind];
            }
            "--live" => {
                let v = value("--live")?;
                let n = v
                    .parse()
                    .ok()
                    .filter(|n| LIVE_BLOCKS.contains(n))
                    .ok_or(format!("--live wants one of {LIVE_BLOCKS:?}, not `{v}`"))?;
                o.live = vec![n];
            }
            "--threads" => {
                let v = value("--threads")?;
                let n = v
                    .parse()
                    .ok()
                    .filter(|n| THREADS.contains(n))
                    .ok_or(format!("--threads wants one of {THREADS:?}, not `{v}`"))?;
                o.threads = vec![n];
            }
            "--reps" => {
                let v = value("--reps")?;
                o.reps = v
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or(format!("--reps wants a positive integer, not `{v}`"))?;
            }
            "--rep-ms" => {
                let v = value("--rep-ms")?;
                let ms: u64 = v
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or(format!("--rep-ms wants a positive integer, not `{v}`"))?;
                o.rep_time = Duration::from_millis(ms);
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(o)
}

/// One measured (case, live blocks, threads) point.
struct Row {
    case: CaseKind,
    live_blocks: usize,
    threads: usize,
    cistern_ns: f64,
    host_ns: f64,
    /// Throughput over the 1-thread row of the same case and live blocks.
    cistern_speedup: Option<f64>,
    host_speedup: Option<f64>,
    timed_driver_calls: u64,
    live_bytes: u64,
    scale: f64,
    cistern_pairs: u64,
    host_pairs: u64,
    reps: usize,
    /// Setup, calibration and repetitions of both backends.
    elapsed: Duration,
}

/// Pairs per thread for one repetition of about `rep_time`, found by doubling.
fn calibrate<B: Backend>(h: &Harness<B>, rep_time: Duration) -> u64 {
    let mut pairs = 1_000u64;
    loop {
        let d = h.run(pairs);
        if d >= CALIBRATE_MIN || pairs >= 1 << 26 {
            let per_pair = d.as_secs_f64() / pairs as f64;
            return ((rep_time.as_secs_f64() / per_pair.max(1e-12)) as u64).clamp(1_000, 1 << 26);
        }
        pairs *= 2;
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn ns_per_pair(d: Duration, pairs_per_thread: u64) -> f64 {
    d.as_nanos() as f64 / pairs_per_thread as f64
}

fn measure(kind: CaseKind, live_blocks: usize, threads: usize, o: &Options) -> Option<Row> {
    let started = Instant::now();
    let workloads = match Workload::for_threads(kind, live_blocks, threads) {
        Ok(w) => w,
        Err(msg) => {
            eprintln!("{msg}");
            return None;
        }
    };
    let phase = |what: &str, since: Instant| {
        if o.verbose {
            eprintln!(
                "  {} {live_blocks} x{threads}: {what} {:.2} s",
                kind.name(),
                since.elapsed().as_secs_f64()
            );
        }
        Instant::now()
    };
    let t = Instant::now();
    let cistern = Harness::new(Arc::new(Cistern::new()), workloads.clone());
    let t = phase("cistern setup+warm-up", t);
    let host = Harness::new(Arc::new(HostMimalloc), workloads);
    let t = phase("mimalloc setup+warm-up", t);
    let cistern_pairs = calibrate(&cistern, o.rep_time);
    let host_pairs = calibrate(&host, o.rep_time);
    let t = phase("calibration", t);
    let (mut c, mut h) = (Vec::new(), Vec::new());
    for _ in 0..o.reps {
        c.push(ns_per_pair(cistern.run(cistern_pairs), cistern_pairs));
        h.push(ns_per_pair(host.run(host_pairs), host_pairs));
    }
    phase("repetitions", t);
    let calls = cistern.assert_cache_hits().map_or(0, |c| c.total);
    Some(Row {
        case: kind,
        live_blocks,
        threads,
        cistern_ns: median(c),
        host_ns: median(h),
        cistern_speedup: None,
        host_speedup: None,
        timed_driver_calls: calls,
        live_bytes: cistern.live_bytes(),
        scale: cistern.scale(),
        cistern_pairs,
        host_pairs,
        reps: o.reps,
        elapsed: started.elapsed(),
    })
}

fn json_num(x: Option<f64>) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{v:.3}"),
        _ => "null".into(),
    }
}

fn print_json(r: &Row) {
    println!(
        "{{\"case\":\"{}\",\"live_blocks\":{},\"threads\":{},\"cistern_ns_per_pair\":{},\
         \"host_ns_per_pair\":{},\"ratio\":{},\"cistern_speedup_vs_1_thread\":{},\
         \"host_speedup_vs_1_thread\":{},\"timed_driver_calls\":{},\"live_bytes\":{},\
         \"size_scale\":{},\"cistern_pairs_per_rep\":{},\"host_pairs_per_rep\":{},\"reps\":{},\"seconds\":{:.2}}}",
        r.case.name(),
        r.live_blocks,
        r.threads,
        json_num(Some(r.cistern_ns)),
        json_num(Some(r.host_ns)),
        json_num(Some(r.cistern_ns / r.host_ns)),
        json_num(r.cistern_speedup),
        json_num(r.host_speedup),
        r.timed_driver_calls,
        r.live_bytes,
        json_num(Some(r.scale)),
        r.cistern_pairs,
        r.host_pairs,
        r.reps,
        r.elapsed.as_secs_f64(),
    );
}

fn print_table_header() {
    println!(
        "{:<11} {:>7} {:>3} {:>11} {:>11} {:>6} {:>8} {:>8} {:>6} {:>10} {:>6} {:>6}",
        "case",
        "live",
        "thr",
        "cistern ns",
        "mimalloc ns",
        "ratio",
        "c-speed",
        "h-speed",
        "calls",
        "live MiB",
        "scale",
        "secs"
    );
}

fn print_table_row(r: &Row) {
    let sp = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}x"));
    println!(
        "{:<11} {:>7} {:>3} {:>11.1} {:>11.1} {:>6.2} {:>8} {:>8} {:>6} {:>10.1} {:>6.3} {:>6.2}",
        r.case.name(),
        r.live_blocks,
        r.threads,
        r.cistern_ns,
        r.host_ns,
        r.cistern_ns / r.host_ns,
        sp(r.cistern_speedup),
        sp(r.host_speedup),
        r.timed_driver_calls,
        r.live_bytes as f64 / (1 << 20) as f64,
        r.scale,
        r.elapsed.as_secs_f64()
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

/// Prints PASS/FAIL for each target (informational; targets are never enforced).
fn check_targets(rows: &[Row]) {
    let find = |case: CaseKind, live: usize, threads: usize| {
        rows.iter()
            .find(|r| r.case == case && r.live_blocks == live && r.threads == threads)
    };
    println!("targets (informational; medians of this run):");
    println!("1. cache-hit pair <= 100 ns median, 1 thread");
    for r in rows.iter().filter(|r| r.threads == 1) {
        println!(
            "   {} {:<11} {:>7} live: {:.1} ns",
            verdict(r.cistern_ns <= 100.0),
            r.case.name(),
            r.live_blocks,
            r.cistern_ns
        );
    }
    println!("2. cache-hit pair <= 5x the host mimalloc pair, 1 thread");
    for r in rows.iter().filter(|r| r.threads == 1) {
        let ratio = r.cistern_ns / r.host_ns;
        println!(
            "   {} {:<11} {:>7} live: {:.2}x ({:.1} ns vs {:.1} ns)",
            verdict(ratio <= 5.0),
            r.case.name(),
            r.live_blocks,
            ratio,
            r.cistern_ns,
            r.host_ns
        );
    }
    println!("3. pair at 100k live blocks <= 1.3x the pair at 1k");
    for case in CaseKind::ALL {
        for threads in THREADS {
            let (Some(small), Some(big)) =
                (find(case, 1_000, threads), find(case, 100_000, threads))
            else {
                continue;
            };
            let g = big.cistern_ns / small.cistern_ns;
            println!(
                "   {} {:<11} {} thr: {:.2}x ({:.1} ns at 100k vs {:.1} ns at 1k; mimalloc {:.2}x)",
                verdict(g <= 1.3),
                case.name(),
                threads,
                g,
                big.cistern_ns,
                small.cistern_ns,
                big.host_ns / small.host_ns
            );
        }
    }
    println!("4. 2 threads on 2 streams >= 1.6x the 1-thread throughput");
    for r in rows.iter().filter(|r| r.threads == 2) {
        let Some(s) = r.cistern_speedup else { continue };
        println!(
            "   {} {:<11} {:>7} live: {:.2}x (mimalloc {})",
            verdict(s >= 1.6),
            r.case.name(),
            r.live_blocks,
            s,
            r.host_speedup.map_or("-".into(), |h| format!("{h:.2}x"))
        );
    }
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("hotpath: {msg}");
            }
            eprintln!("{USAGE}");
            return if msg.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            };
        }
    };
    let started = Instant::now();
    if o.cases.contains(&CaseKind::Trace) {
        match trace_mix() {
            Ok(mix) => eprintln!(
                "trace_mix: {} allocation sizes from {TRACE_FILE}",
                mix.sizes.len()
            ),
            Err(msg) => eprintln!("{msg}"),
        }
    }
    if !o.json {
        print_table_header();
    }
    let mut rows: Vec<Row> = Vec::new();
    for &case in &o.cases {
        'live: for &live in &o.live {
            for &threads in &o.threads {
                let Some(mut r) = measure(case, live, threads, &o) else {
                    break 'live;
                };
                if let Some(one) = rows
                    .iter()
                    .find(|x| x.case == case && x.live_blocks == live && x.threads == 1)
                {
                    let t = threads as f64;
                    r.cistern_speedup = Some(t * one.cistern_ns / r.cistern_ns);
                    r.host_speedup = Some(t * one.host_ns / r.host_ns);
                }
                if o.json {
                    print_json(&r);
                } else {
                    print_table_row(&r);
                }
                rows.push(r);
            }
        }
    }
    if !o.json {
        println!(
            "ns = median per-thread cost of one free+alloc pair (wall * threads / pairs); \
             ratio = cistern / mimalloc; speed = throughput over 1 thread; calls = driver calls \
             during timed runs; {:.1} s in all",
            started.elapsed().as_secs_f64()
        );
    }
    if o.check_targets {
        check_targets(&rows);
    }
    ExitCode::SUCCESS
}
