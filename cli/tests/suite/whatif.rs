//! End-to-end tests of `cistern whatif`: the binary on OOM snapshots built with known answers
//! (`replay/tests/suite/common/oom_traces.rs`), its JSON, its plot and its errors; and on the
//! public snapshots in `../shared/traces` when present.

use std::path::PathBuf;
use std::process::{Command, Output};

use crate::common::{bin as cistern, traces_dir};
use crate::oom_traces::{self, MIB};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cistern-whatif-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write(name: &str, r: &oom_traces::Recorder) -> PathBuf {
    let p = tmp(name);
    std::fs::write(&p, r.snapshot().to_pickle()).unwrap();
    p
}

fn whatif(args: &[&str]) -> Output {
    cistern().arg("whatif").args(args).output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "status {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn err(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr.clone()).unwrap()
}

#[test]
fn text_answer_first_then_the_table() {
    let p = write("stranded.pickle", &oom_traces::stranded(0, 0));
    let text = ok(&whatif(&[p.to_str().unwrap()]));
    let first = text.lines().next().unwrap();
    assert!(
        first.starts_with(
            "The recorded settings (PyTorch's default settings) reproduce the OOM (30 MiB \
             short); with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it fits with 10 MiB \
             to spare; with cistern"
        ),
        "{text}"
    );
    assert!(
        text.contains("capacity 170 MiB (recorded reserved 160 MiB + device_free 10 MiB)"),
        "{text}"
    );
    assert!(text.contains("live 120 MiB"), "{text}");
    assert!(text.contains("train.py:42 forward"), "{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("pytorch (recorded)"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains(" no ") && row.contains("-30 MiB"), "{row}");
    let row = text
        .lines()
        .find(|l| l.starts_with("pytorch expandable_segments:True"))
        .unwrap();
    assert!(row.contains(" yes ") && row.contains("+10 MiB"), "{row}");
    assert!(text.contains("What the replay cannot know"), "{text}");
}

#[test]
fn json_has_the_issue_shape_for_each_oom() {
    // Two OOMs in one file: device 0 (stranded), device 1 on stream 7 (cross-stream); gzipped.
    let mut r = oom_traces::stranded(0, 0);
    let other = oom_traces::other_stream(1, 7).snapshot();
    let mut s = r.snapshot();
    s.segments.extend(other.segments);
    s.device_traces.push(other.device_traces[1].clone());
    r.settings = None;
    let p = tmp("two.pickle");
    std::fs::write(&p, s.to_pickle()).unwrap();
    let st = Command::new("gzip").arg("-kf").arg(&p).status().unwrap();
    assert!(st.success());
    let gz = p.with_extension("pickle.gz");
    let doc: serde_json::Value =
        serde_json::from_str(&ok(&whatif(&[gz.to_str().unwrap(), "--json"]))).unwrap();
    let ooms = doc["ooms"].as_array().unwrap();
    assert_eq!(ooms.len(), 2, "{doc}");
    for (o, (device, stream, capacity, live)) in ooms
        .iter()
        .zip([(0, 0, 170 * MIB, 120 * MIB), (1, 7, 100 * MIB, 60 * MIB)])
    {
        assert_eq!(o["device"], device);
        assert_eq!(o["stream"], stream);
        assert_eq!(o["size"], 40 * MIB);
        assert_eq!(o["capacity"], capacity);
        assert_eq!(o["live"], live);
        assert_eq!(o["reproduced"], true);
        assert!(o["time_us"].is_i64() && o["device_free"].is_u64());
        let results = o["results"].as_array().unwrap();
        assert_eq!(results[0]["allocator"], "pytorch");
        assert_eq!(results[0]["recorded"], true);
        assert_eq!(results[0]["fits"], false);
        assert!(results
            .iter()
            .any(|r| r["allocator"] == "cistern" && r["fits"].is_boolean()));
        for r in results {
            assert!(
                r.get("headroom").is_some() && r.get("fits").is_some(),
                "{r}"
            );
        }
    }
}

#[test]
fn plot_has_one_chart_per_oom() {
    let p = write("plot.pickle", &oom_traces::stranded(0, 0));
    let svg = tmp("plot.svg");
    ok(&whatif(&[
        p.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        "--no-headroom",
    ]));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") || text.contains("<svg"), "{text}");
    assert!(text.contains("pytorch (recorded) (reserved)"), "{text}");
    assert!(text.contains("pytorch-recorded (reserved)") && text.contains("capacity"));
}

#[test]
fn a_file_without_oom_says_so_and_takes_a_capacity() {
    let mut r = oom_traces::Recorder::default();
    r.segment(0, 1 << 30, 80 * MIB, 0)
        .alloc(0, 1 << 30, 60 * MIB, 0);
    let p = write("no-oom.pickle", &r);
    let e = err(&whatif(&[p.to_str().unwrap()]));
    assert!(
        e.contains("no OOM recorded") && e.contains("--capacity 40GiB"),
        "{e}"
    );
    let text = ok(&whatif(&[p.to_str().unwrap(), "--capacity", "64MiB"]));
    assert!(text.contains("no OOM recorded"), "{text}");
    // 60 MiB live: PyTorch's own 60 MiB segment fits in 64 MiB with 4 MiB to spare.
    let row = text
        .lines()
        .find(|l| l.starts_with("pytorch (recorded)"))
        .unwrap();
    assert!(row.contains(" yes ") && row.contains("+4 MiB"), "{text}");
    let text = ok(&whatif(&[p.to_str().unwrap(), "--capacity", "50MiB"]));
    assert!(text.contains("no allocator tried runs"), "{text}");
    // A bare number is refused.
    let e = err(&whatif(&[p.to_str().unwrap(), "--capacity", "40"]));
    assert!(e.contains("a size needs a unit"), "{e}");
}

#[test]
fn bad_input_gets_a_clear_message() {
    // An oom event without device_free.
    let mut r = oom_traces::stranded(0, 0);
    r.oom(0, MIB, 0, None);
    let p = write("no-free.pickle", &r);
    let e = err(&whatif(&[p.to_str().unwrap()]));
    assert!(
        e.contains("without `device_free`") && e.contains("--capacity"),
        "{e}"
    );
    // ... which --capacity answers.
    ok(&whatif(&[
        p.to_str().unwrap(),
        "--capacity",
        "1GiB",
        "--no-headroom",
    ]));
    // A truncated file.
    let bytes = oom_traces::stranded(0, 0).snapshot().to_pickle();
    let t = tmp("truncated.pickle");
    std::fs::write(&t, &bytes[..bytes.len() / 2]).unwrap();
    let e = err(&whatif(&[t.to_str().unwrap()]));
    assert!(e.contains("truncated"), "{e}");
    // An OOM on a device with no segments.
    let mut s = oom_traces::stranded(0, 0).snapshot();
    s.segments.clear();
    s.device_traces[0].retain(|e| e.action != cistern_trace::snapshot::Action::SegmentAlloc);
    let p = tmp("no-segments.pickle");
    std::fs::write(&p, s.to_pickle()).unwrap();
    let e = err(&whatif(&[p.to_str().unwrap()]));
    assert!(e.contains("no segment on cuda:0"), "{e}");
    // Not a snapshot: an RMM log without OOM and without a capacity.
    let rmm = tmp("log.csv");
    std::fs::write(
        &rmm,
        "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x10,1024,0x0\n",
    )
    .unwrap();
    let e = err(&whatif(&[rmm.to_str().unwrap()]));
    assert!(e.contains("rmm log: no OOM recorded"), "{e}");
    let text = ok(&whatif(&[rmm.to_str().unwrap(), "--capacity", "1GiB"]));
    // An RMM log records no PyTorch settings: no row claims them.
    assert!(!text.contains("(recorded)"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("pytorch ") && l.contains(" yes ")),
        "{text}"
    );
}

#[test]
fn rmm_allocate_failures_are_answered_at_a_given_capacity() {
    let log = tmp("fail.csv");
    let mib = |n: u64| (n * MIB).to_string();
    std::fs::write(
        &log,
        format!(
            "Thread,Time,Action,Pointer,Size,Stream\n\
             1,10:00:00.000001,allocate,0x10000000,{},0x0\n\
             1,10:00:00.000002,allocate,0x90000000,{},0x0\n\
             1,10:00:00.000003,free,0x10000000,{},0x0\n\
             1,10:00:00.000004,allocate failure,(nil),{},0x0\n",
            mib(600),
            mib(300),
            mib(600),
            mib(700)
        ),
    )
    .unwrap();
    let e = err(&whatif(&[log.to_str().unwrap()]));
    assert!(
        e.contains("1 failed allocations recorded") && e.contains("--capacity"),
        "{e}"
    );
    // 300 MiB live + 700 MiB asked on 1 GiB: PyTorch frees its cached 600 MiB segment and fits,
    // with 24 MiB to spare.
    let doc: serde_json::Value = serde_json::from_str(&ok(&whatif(&[
        log.to_str().unwrap(),
        "--capacity",
        "1GiB",
        "--json",
    ])))
    .unwrap();
    let o = &doc["ooms"][0];
    assert_eq!(o["live"], 300 * MIB);
    assert_eq!(o["size"], 700 * MIB);
    assert!(o["reproduced"].is_null(), "{o}");
    let py = &o["results"][0];
    assert_eq!(
        (py["allocator"].as_str(), py["recorded"].as_bool()),
        (Some("pytorch"), Some(false))
    );
    assert_eq!(py["fits"], true);
    assert_eq!(py["headroom"], 24 * MIB);
    assert!(
        o["answer"].as_str().unwrap().starts_with(
            "On 1.0 GiB the failed 700 MiB request fits with: pytorch (24 MiB to spare)"
        ),
        "{o}"
    );
    let text = ok(&whatif(&[log.to_str().unwrap(), "--capacity", "900MiB"]));
    assert!(
        text.starts_with("On 900 MiB no allocator can fit"),
        "{text}"
    );
}

#[test]
fn public_snapshots() {
    let Some(dir) = traces_dir() else {
        eprintln!("skipped: no ../shared/traces (set CISTERN_TRACES_DIR)");
        return;
    };
    // A state-only OOM capture: no history to replay, said so.
    let state = dir.join("pytorch_state_snapshots/flexgen-fork__opt_offload_oom_state.pickle");
    if state.exists() {
        let e = err(&whatif(&[state.to_str().unwrap()]));
        assert!(
            e.contains("without memory history") && e.contains("record_oom_snapshot"),
            "{e}"
        );
    }
    // A snapshot with history but no OOM, asked about a capacity.
    let snap = dir.join("pytorch_snapshots/cs336-silmont2000__small_mem_snapshot.pickle");
    if snap.exists() {
        let out = whatif(&[snap.to_str().unwrap(), "--capacity", "80GiB", "--json"]);
        let doc: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
        assert_eq!(doc["ooms"].as_array().unwrap().len(), 0);
        let at = &doc["at_capacity"][0];
        assert!(
            at["results"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["fits"] != false),
            "{at}"
        );
    }
}
