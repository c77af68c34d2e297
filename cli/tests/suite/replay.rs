//! End-to-end tests of `cistern replay`: the binary, its JSON, its plot and its errors.

use std::path::PathBuf;

use crate::common::{bin as cistern, json, traces_dir};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cistern-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// `cistern replay ARGS`, which must succeed, as its JSON document.
fn replay_json(args: &[&str]) -> serde_json::Value {
    let out = cistern().arg("replay").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    json(&out)
}

/// `cistern replay ARGS`, which must fail, as its standard error.
fn replay_fails(args: &[&str]) -> String {
    let out = cistern().arg("replay").args(args).output().unwrap();
    assert!(!out.status.success(), "replay {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The allocator of each row of one trace's JSON report.
fn row_names(doc: &serde_json::Value) -> Vec<&str> {
    doc["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["allocator"].as_str().unwrap())
        .collect()
}

#[test]
fn json_for_one_workload_has_every_field() {
    let out = cistern()
        .args(["replay", "-w", "rmm-random", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(doc["trace"].as_str().unwrap().starts_with("rmm-random"));
    let results = doc["results"].as_array().unwrap();
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["allocator"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "cistern",
            "cistern-novmm",
            "pytorch",
            "pytorch-expandable",
            "cudamalloc",
            "ideal"
        ]
    );
    for r in results {
        for key in [
            "peak_reserved",
            "peak_live",
            "frag",
            "min_capacity",
            "driver_calls",
            "driver_time_us",
            "host_waits",
            "pages_moved",
            "hazards",
            "steady_driver_calls",
            "ops_per_sec",
        ] {
            assert!(!r[key].is_null(), "{key} missing in {r}");
        }
        let live = r["peak_live"].as_u64().unwrap();
        let reserved = r["peak_reserved"].as_u64().unwrap();
        assert!(reserved >= live, "{r}");
        assert!(r["min_capacity"].as_u64().unwrap() >= live, "{r}");
    }
    // The ideal allocator reserves exactly what is live.
    let ideal = &results[5];
    assert_eq!(ideal["frag"].as_f64().unwrap(), 0.0);
}

#[test]
fn several_traces_give_a_list_and_a_plot() {
    let svg = tmp("plot.svg");
    let out = cistern()
        .args(["replay", "-w", "rmm-random", "-w", "rmm-random-normal"])
        .args([
            "-a",
            "cistern,pytorch",
            "--no-min-capacity",
            "--json",
            "--plot",
        ])
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = doc.as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["results"].as_array().unwrap().len(), 2);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"));
    // Two charts, each with two allocators and the live line.
    assert_eq!(text.matches("<polyline").count(), 6);
}

#[test]
fn table_output_names_the_trace_and_allocators() {
    let out = cistern()
        .args(["replay", "-w", "rmm-random", "-a", "cistern,ideal"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("rmm-random"), "{text}");
    assert!(text.contains("peak reserved"), "{text}");
    for col in ["drv ms", "waits", "steady"] {
        assert!(text.contains(col), "no {col} column: {text}");
    }
    assert!(text.lines().any(|l| l.starts_with("cistern ")), "{text}");
    assert!(!text.contains('\x1b'), "colour despite NO_COLOR: {text}");
}

#[test]
fn bad_input_names_the_fix() {
    let out = cistern()
        .args(["replay", "-a", "tcmalloc", "-w", "rmm-random"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tcmalloc") && err.contains("cistern"), "{err}");

    let out = cistern()
        .args(["replay", "-w", "no-such-workload"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-workload"));

    let bad = tmp("bad.trace");
    std::fs::write(&bad, "# cistern-trace v1\na 1 100 0\nf 2\n").unwrap();
    let out = cistern().arg("replay").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.trace") && err.contains("line 3"), "{err}");

    assert!(replay_fails(&["-w", "rmm-random", "--capacity", "lots"]).contains("--capacity"));
}

#[test]
fn a_recorded_trace_replays_with_its_baseline() {
    let path = tmp("own.trace");
    std::fs::write(
        &path,
        "# cistern-trace v1\nr 4194304\na 1 3000000 0\na 2 1000 0\nf 1\na 3 500000 0\n",
    )
    .unwrap();
    let out = cistern()
        .arg("replay")
        .arg(&path)
        .args(["-a", "cistern", "--json", "--no-min-capacity"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results[0]["allocator"], "recorded");
    assert_eq!(results[0]["peak_reserved"], 4194304);
    assert_eq!(results[1]["allocator"], "cistern");
    assert_eq!(results[1]["peak_live"], 3001000);
}

#[test]
fn a_pytorch_snapshot_shows_pytorch_recorded() {
    let Some(dir) = traces_dir() else {
        eprintln!("skipping: no traces folder (../shared/traces or CISTERN_TRACES_DIR)");
        return;
    };
    let path =
        dir.join("pytorch_snapshots/cs336-silmont2000__transformer-lm_forward_fp32_ctx128.pickle");
    let out = cistern()
        .arg("replay")
        .arg(&path)
        .args(["-a", "cistern,pytorch", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = doc["results"].as_array().unwrap();
    assert_eq!(r[0]["allocator"], "pytorch-recorded");
    let recorded = r[0]["peak_reserved"].as_u64().unwrap();
    let cistern = r[1]["peak_reserved"].as_u64().unwrap();
    let live = r[1]["peak_live"].as_u64().unwrap();
    assert!(
        cistern <= recorded,
        "cistern {cistern} > recorded {recorded}"
    );
    assert!(r[1]["min_capacity"].as_u64().unwrap() as f64 <= live as f64 * 1.03);
}

#[test]
fn convert_round_trips_through_rmm_and_cistern_formats() {
    let src = tmp("src.trace");
    std::fs::write(
        &src,
        "# cistern-trace v1\na 1 3000000 0\na 2 1000 7\nf 1\na 3 500000 0\nf 3\n",
    )
    .unwrap();
    let rmm = tmp("out.csv");
    let out = cistern()
        .args(["convert", "--to", "rmm", "-o"])
        .arg(&rmm)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let csv = std::fs::read_to_string(&rmm).unwrap();
    assert!(
        csv.starts_with("Thread,Time,Action,Pointer,Size,Stream"),
        "{csv}"
    );
    // Back to cistern's format: the same operations.
    let out = cistern().args(["convert"]).arg(&rmm).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let ops: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("a ") || l.starts_with("f "))
        .collect();
    assert_eq!(ops.len(), 5, "{text}");
    assert!(
        ops[0].starts_with("a ") && ops[0].contains(" 3000000 "),
        "{text}"
    );
    assert!(ops[1].ends_with(" 7"), "stream kept: {text}");
}

#[test]
fn costs_file_prices_the_calls_and_a_bad_one_names_the_fix() {
    let run = |costs: &std::path::Path| {
        cistern()
            .args([
                "replay",
                "-w",
                "training:iters=2,seq=256",
                "-a",
                "pytorch",
                "--json",
            ])
            .args(["--no-min-capacity", "--costs"])
            .arg(costs)
            .output()
            .unwrap()
    };
    // A table where cudaMalloc costs 1 ms flat and everything else nothing.
    let good = tmp("costs.json");
    let mut zero = serde_json::Map::new();
    for k in [
        "device_count",
        "capabilities",
        "mem_info",
        "reserve_va",
        "free_va",
        "create_physical",
        "release_physical",
        "map",
        "unmap",
        "set_access",
        "mem_free",
        "event_create",
        "event_record",
        "event_query",
        "event_synchronize",
        "event_destroy",
        "stream_wait_event",
        "device_synchronize",
        "stream_synchronize",
    ] {
        zero.insert(k.into(), 0.0.into());
    }
    zero.insert(
        "mem_alloc".into(),
        serde_json::json!({"per_call_us": 1000.0}),
    );
    std::fs::write(&good, serde_json::Value::Object(zero).to_string()).unwrap();
    let out = run(&good);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = &doc["results"][0];
    let allocs = r["driver_calls"]["mem_alloc"].as_f64().unwrap();
    assert_eq!(
        r["driver_time_us"].as_f64().unwrap(),
        1000.0 * allocs,
        "{r}"
    );

    let bad = tmp("bad-costs.json");
    std::fs::write(&bad, r#"{"cuMemMap": 1.5}"#).unwrap();
    let out = run(&bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--costs") && err.contains("bad-costs.json"),
        "{err}"
    );
    assert!(
        err.contains("unknown key `cuMemMap`") && err.contains("map, unmap"),
        "{err}"
    );
    assert!(err.contains("a100-published.json"), "{err}");

    let out = run(&tmp("missing-costs.json"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("missing-costs.json") && err.contains("cannot read"),
        "{err}"
    );
}

#[test]
fn capacity_runs_report_costs_under_memory_pressure() {
    let out = cistern()
        .args([
            "replay",
            "-w",
            "rmm-random",
            "-a",
            "pytorch,cistern",
            "--json",
        ])
        .args(["--no-min-capacity", "--capacity", "1300MiB"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for r in doc["results"].as_array().unwrap() {
        assert!(r["driver_time_us"].as_f64().unwrap() > 0.0, "{r}");
        assert!(
            r["host_waits"].is_u64() && r["steady_driver_calls"].is_u64(),
            "{r}"
        );
    }
}

/// Runs `cistern replay ARGS` with `input` on its standard input (a pipe).
fn replay_piped(args: &[&str], input: &[u8]) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cistern()
        .arg("replay")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // The reader may stop early (and close the pipe): a failed write is its answer.
    let _ = stdin.write_all(input);
    drop(stdin);
    child.wait_with_output().unwrap()
}

#[test]
fn a_trace_on_a_pipe_is_read_once() {
    let trace = b"# cistern-trace v1\nr 4194304\na 1 3000000 0\na 2 1000 0\nf 1\n";
    let out = replay_piped(
        &["/dev/stdin", "-a", "cistern", "--json", "--no-min-capacity"],
        trace,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = doc["results"].as_array().unwrap();
    // The format (hence the baseline's label) comes from the same single read.
    assert_eq!(results[0]["allocator"], "recorded");
    assert_eq!(results[1]["peak_live"], 3001000);
}

#[test]
fn a_capacity_needs_a_unit_and_a_hopeless_one_is_named() {
    for bare in ["80", "80.5", " 1024 "] {
        let out = cistern()
            .args(["replay", "-w", "rmm-random", "-c", bare])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "-c {bare}: {err}");
        assert!(
            err.contains("--capacity") && err.contains("needs a unit") && err.contains("GiB"),
            "-c {bare}: {err}"
        );
    }
    let path = tmp("capacity.trace");
    std::fs::write(
        &path,
        "# cistern-trace v1\na 1 3000000 0\na 2 1000 0\nf 1\n",
    )
    .unwrap();
    let run = |cap: &str| {
        let out = cistern()
            .arg("replay")
            .arg(&path)
            .args(["-a", "cistern,pytorch,cudamalloc", "--no-min-capacity"])
            .args(["-c", cap])
            .output()
            .unwrap();
        assert!(out.status.success(), "-c {cap}: {out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Bytes, when asked for with their unit: every allocator fails the first allocation.
    let err = run("80B");
    assert!(
        err.contains("capacity.trace")
            && err.contains("first allocation")
            && err.contains("capacity is likely wrong"),
        "{err}"
    );
    assert!(!run("8GiB").contains("likely wrong"));
}

/// Waits for `child` at most `secs` seconds (killing it then: a reader that never stops).
fn wait_at_most(mut child: std::process::Child, secs: u64) -> std::process::Output {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("still reading after {secs} s: {out:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn what_a_reader_takes_is_capped_and_an_empty_trace_is_named() {
    use std::process::Stdio;
    // No trace at all: refused from its first bytes, not read to the end of memory.
    let child = cistern()
        .args(["replay", "/dev/zero", "-a", "cistern"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_at_most(child, 20);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("/dev/zero: byte 0: expected"), "{err}");

    // A trace larger than --max-input, as a file and through a pipe.
    let mut big = String::from("# cistern-trace v1\n");
    for i in 0..100_000 {
        big.push_str(&format!("a {i} 4096 0\nf {i}\n"));
    }
    assert!(big.len() > 1 << 20);
    let path = tmp("big.trace");
    std::fs::write(&path, &big).unwrap();
    let args = ["-a", "cistern", "--no-min-capacity", "--max-input", "1MiB"];
    let file = cistern()
        .arg("replay")
        .arg(&path)
        .args(args)
        .output()
        .unwrap();
    let mut piped = vec!["/dev/stdin"];
    piped.extend(args);
    for (how, out) in [
        ("file", file),
        ("pipe", replay_piped(&piped, big.as_bytes())),
    ] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{how}: {err}");
        assert!(
            err.contains("more than the input limit of 1 MiB") && err.contains("--max-input SIZE"),
            "{how}: {err}"
        );
    }
    // Within the limit it replays.
    let out = cistern()
        .arg("replay")
        .arg(&path)
        .args(["-a", "cistern", "--no-min-capacity", "--max-input", "4MiB"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = cistern()
        .arg("replay")
        .arg(&path)
        .args(["--max-input", "1048576"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs a unit"));

    // A trace that parses but holds no allocation is named, even beside a workload.
    let empty = tmp("empty.trace");
    std::fs::write(&empty, "# cistern-trace v1\nname nothing\n").unwrap();
    let out = cistern()
        .arg("replay")
        .arg(&empty)
        .args(["-w", "rmm-random", "-a", "cistern", "--no-min-capacity"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("empty.trace") && err.contains("holds no allocation"),
        "{err}"
    );
}

#[test]
fn a_trace_name_from_the_file_is_escaped_in_the_table() {
    let path = tmp("named.trace");
    std::fs::write(
        &path,
        "# cistern-trace v1\nname evil\x1b]0;pwned\x07\x1b[2J\na 1 3000000 0\nf 1\n",
    )
    .unwrap();
    let out = cistern()
        .arg("replay")
        .arg(&path)
        .args(["-a", "cistern", "--no-min-capacity"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("evil\\u{1b}]0;pwned\\u{7}\\u{1b}[2J") && !text.contains('\x1b'),
        "{text}"
    );
}

/// `x live` and the other columns are explained in words, under the tables and in `--help`.
#[test]
fn the_columns_are_explained_under_the_tables_and_in_help() {
    let out = cistern()
        .args(["replay", "-w", "rmm-random", "-a", "cistern"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("x live "))
        .unwrap_or_else(|| panic!("x live is not explained: {text}"));
    assert!(line.contains("min capacity / peak live"), "{line}");
    let help = cistern().args(["replay", "--help"]).output().unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for col in [
        "x live",
        "peak reserved",
        "min capacity",
        "drv ms",
        "steady",
    ] {
        assert!(help.contains(col), "--help does not explain {col}: {help}");
    }
}

/// The colour of each allocator's legend swatch in a plot.
fn plot_colours(allocators: &str) -> Vec<(String, String)> {
    let svg = tmp(&format!("colours-{}.svg", allocators.replace(',', "-")));
    let out = cistern()
        .args([
            "replay",
            "-w",
            "rmm-random",
            "--no-min-capacity",
            "-a",
            allocators,
        ])
        .arg("--plot")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the plot parses as XML");
    let nodes: Vec<_> = doc.descendants().collect();
    let mut colours = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if let Some(label) = n.text().filter(|_| n.has_tag_name("text")) {
            if let Some(name) = label.strip_suffix(" (reserved)") {
                let swatch = nodes[..i]
                    .iter()
                    .rev()
                    .find(|n| n.has_tag_name("line"))
                    .unwrap();
                colours.push((
                    name.to_string(),
                    swatch.attribute("stroke").unwrap().to_string(),
                ));
            }
        }
    }
    colours
}

#[test]
fn an_allocator_has_the_same_colour_in_every_plot() {
    let a = plot_colours("pytorch,cistern");
    let b = plot_colours("cudamalloc,cistern,pytorch-expandable,pytorch");
    assert_eq!(a.len(), 2, "{a:?}");
    for (name, colour) in &a {
        let other = b.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(colour, &other.1, "{name}: {a:?} vs {b:?}");
    }
}

/// A snapshot recorded with `expandable_segments:True` (a public one committed as test data)
/// is also replayed by default under its own settings: `pytorch-as-recorded` runs the
/// expandable model, and says so; asked for by name it runs the same.
#[test]
fn a_snapshot_replays_under_its_recorded_settings() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../trace/testdata/public-snapshots/cs336-bolongcheng__xl-fwd_ctx512_bf16.pickle.gz");
    let run = |args: &[&str]| -> serde_json::Value {
        let out = cistern()
            .arg("replay")
            .arg(&path)
            .args(args)
            .args(["--json", "--no-min-capacity"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let doc = run(&[]);
    let rows = doc["results"].as_array().unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["allocator"].as_str().unwrap())
        .collect();
    let at = |n: &str| {
        names
            .iter()
            .position(|x| *x == n)
            .unwrap_or_else(|| panic!("{n}: {names:?}"))
    };
    assert_eq!(
        at("pytorch-as-recorded"),
        at("pytorch-expandable") + 1,
        "{names:?}"
    );
    let row = &rows[at("pytorch-as-recorded")];
    assert_eq!(
        row["peak_reserved"],
        rows[at("pytorch-expandable")]["peak_reserved"],
        "{doc}"
    );
    assert!(
        row["note"]
            .as_str()
            .unwrap()
            .starts_with("recorded settings: pytorch-expandable"),
        "{row}"
    );
    let doc = run(&["-a", "pytorch,pytorch-as-recorded"]);
    let rows = doc["results"].as_array().unwrap();
    assert_eq!(rows.last().unwrap()["allocator"], "pytorch-as-recorded");
    // A built-in workload records no settings: the row says PyTorch's defaults were assumed.
    let out = cistern()
        .args([
            "replay",
            "-w",
            "rmm-random",
            "-a",
            "pytorch-as-recorded",
            "--json",
            "--no-min-capacity",
        ])
        .output()
        .unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        doc["results"][0]["note"]
            .as_str()
            .unwrap()
            .contains("PyTorch's defaults assumed"),
        "{doc}"
    );
}

/// A snapshot whose recording held memory from before its window: the recorded row says how
/// much (`pre_window_bytes`, and in the table), `pytorch-as-recorded` starts from that state
/// (`seeded`), and `--seeded` starts the other PyTorch models from it too.
#[test]
fn memory_from_before_the_window_is_reported_and_seeded() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../trace/testdata/public-snapshots/cs336-nothanmin__forward-mixed.pickle.gz");
    let run = |args: &[&str]| -> std::process::Output {
        let out = cistern()
            .arg("replay")
            .arg(&path)
            .args([
                "-a",
                "pytorch,pytorch-as-recorded,cistern",
                "--no-min-capacity",
            ])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    let doc: serde_json::Value = serde_json::from_slice(&run(&["--json"]).stdout).unwrap();
    let rows = doc["results"].as_array().unwrap();
    let row = |n: &str| {
        rows.iter()
            .find(|r| r["allocator"] == n)
            .unwrap_or_else(|| panic!("{n}: {doc}"))
    };
    // 1722 segments, 45,046 MiB, at the dump; the window has no segment event.
    let pre = row("pytorch-recorded")["pre_window_bytes"]
        .as_u64()
        .unwrap();
    assert_eq!(pre, 45_046 << 20);
    assert_eq!(row("pytorch-as-recorded")["seeded"], true);
    assert!(row("pytorch").get("seeded").is_none(), "{doc}");
    assert_eq!(
        row("pytorch-as-recorded")["peak_reserved"].as_u64(),
        Some(pre)
    );
    assert!(row("pytorch")["peak_reserved"].as_u64().unwrap() < pre);

    let doc: serde_json::Value =
        serde_json::from_slice(&run(&["--json", "--seeded"]).stdout).unwrap();
    let rows = doc["results"].as_array().unwrap();
    for r in rows {
        let want = r["allocator"] != "cistern" && r["allocator"] != "pytorch-recorded";
        assert_eq!(r.get("seeded").is_some(), want, "{r}");
    }

    let table = String::from_utf8(run(&[]).stdout).unwrap();
    assert!(table.contains("when its window opened"), "{table}");
    assert!(
        table.contains("started from the recorded state at the window's start"),
        "{table}"
    );
}

/// A recording that held far more memory before its window than the window ever has live:
/// the default device must hold that state too, or the seeded row would run out of memory
/// before its first operation.
#[test]
fn the_default_device_holds_the_recorded_state_of_a_seeded_row() {
    use crate::oom_traces::{Recorder, MIB};
    let base = 0x7f00_0000_0000u64;
    let mut r = Recorder::default();
    // 16 GiB of 1 GiB segments cached before the window; the window allocates 1 MiB + 512 KiB.
    for k in 0..16u64 {
        r.segment(0, base + (k << 30), 1 << 30, 0);
    }
    r.open_window()
        .alloc(0, base, 3 * MIB / 2, 0)
        .free(0, base, 0);
    let dir = std::env::temp_dir().join(format!("cistern-seeded-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cached.pickle");
    std::fs::write(&path, r.snapshot().to_pickle()).unwrap();
    let out = cistern()
        .arg("replay")
        .arg(&path)
        .args(["-a", "pytorch-as-recorded", "--json"])
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = doc["results"].as_array().unwrap();
    let row = rows
        .iter()
        .find(|r| r["allocator"] == "pytorch-as-recorded")
        .unwrap();
    assert!(row["oom"].is_null(), "{row}");
    assert_eq!(row["seeded"], true);
    assert_eq!(row["peak_reserved"].as_u64(), Some(16 << 30));
    // The smallest device holds the 16 GiB recorded, no more (the request fits in it).
    assert_eq!(row["min_capacity"].as_u64(), Some(16 << 30));
}

/// A `cistern:` spec takes several settings in CISTERN_CONF syntax, commas and all, inside
/// the comma-separated `--allocators` list: a piece that is a setting, not an allocator,
/// belongs to the spec before it.
#[test]
fn a_cistern_spec_keeps_its_settings_in_the_allocator_list() {
    let doc = replay_json(&[
        "-w",
        "rmm-random",
        "-a",
        "cistern:chunk_size:2MiB,stream_sync:always,pytorch,cistern:grow_whole_chunks:on",
        "--json",
        "--no-min-capacity",
    ]);
    assert_eq!(
        row_names(&doc),
        [
            "cistern:chunk_size:2MiB,stream_sync:always",
            "pytorch",
            "cistern:grow_whole_chunks:on"
        ]
    );
    // A setting that follows no cistern spec is still an unknown allocator.
    let out = cistern()
        .args([
            "replay",
            "-w",
            "rmm-random",
            "-a",
            "pytorch,stream_sync:always",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("stream_sync"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--gpu-lag N` replays every cistern model on a GPU N kernels behind the host (its rows say
/// `@lag=N`), leaves the other models as they are, and a lag on a PyTorch model is refused
/// with the reason.
#[test]
fn gpu_lag_applies_to_cistern_models() {
    let packed_a = |lag: &str, allocators: &str| {
        replay_json(&[
            "-w",
            "packed-A",
            "--no-min-capacity",
            "--json",
            "--gpu-lag",
            lag,
            "-a",
            allocators,
        ])
    };
    let doc = packed_a(
        "2",
        "cistern:stream_sync:pressure,cistern:chunk_size:2MiB,pytorch",
    );
    assert_eq!(
        row_names(&doc),
        [
            "cistern:stream_sync:pressure@lag=2",
            "cistern:chunk_size:2MiB@lag=2",
            "pytorch"
        ]
    );
    // On the lagging GPU, `stream_sync:pressure` leaves busy pages and buys more: the flag
    // reached the model.
    let peak = |i: usize| doc["results"][i]["peak_reserved"].as_u64().unwrap();
    let eager = packed_a("0", "cistern:stream_sync:pressure");
    assert_eq!(
        eager["results"][0]["allocator"], "cistern:stream_sync:pressure",
        "a lag of 0 is no lag"
    );
    assert!(peak(0) > eager["results"][0]["peak_reserved"].as_u64().unwrap());
    assert_eq!(doc["results"][0]["hazards"], 0);
    let out = cistern()
        .args(["replay", "-w", "packed-A", "-a", "pytorch@lag=2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("only cistern's models run GPU work"), "{err}");
}

/// `--seed` draws another program of the same kind, names the seed in the row, and gives the
/// same rows again for the same seed; the default seed's rows carry no seed.
#[test]
fn seed_draws_another_program_and_says_so() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "-w",
            "rmm-random",
            "-a",
            "ideal",
            "--no-min-capacity",
            "--json",
        ];
        args.extend_from_slice(extra);
        let doc = replay_json(&args);
        let name = doc["trace"].as_str().unwrap().to_string();
        (name, doc["results"][0]["peak_live"].as_u64().unwrap())
    };
    let (default_name, default_live) = run(&[]);
    assert!(!default_name.contains("seed"), "{default_name}");
    assert_eq!(run(&["--seed", "42"]), (default_name.clone(), default_live));
    let (name7, live7) = run(&["--seed", "7"]);
    assert!(name7.ends_with(" seed 7"), "{name7}");
    assert_ne!(live7, default_live, "seed 7 drew the default program");
    assert_eq!(run(&["--seed", "7"]), (name7, live7));
    assert!(replay_fails(&["-w", "rmm-random", "--seed", "x"]).contains("--seed"));
}
