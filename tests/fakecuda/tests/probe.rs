//! The fake answers the capture probe as the real driver did: `scripts/gpu/capture_rules.py`
//! (600 probes: each call the pool makes during a capture, in each capture mode, from the
//! capturing thread and another, with and without the thread's mode exchanged to relaxed) runs
//! on the fake, and every answer (the call's result, whether the capture survived, what
//! `cuStreamEndCapture` said) must equal the one driver 580 gave on an H200, committed as
//! `tests/fakecuda/capture-rules-h200.json` by `scripts/gpu-check.sh`'s `capture_rules` step.
//! When a rule of the fake drifts from the GPU's, this test names the probes that differ.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_fake_answers_the_capture_probe_as_the_h200_did() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = root.join("scripts/gpu/capture_rules.py");
    let reference = Path::new(env!("CARGO_MANIFEST_DIR")).join("capture-rules-h200.json");
    let out = std::env::temp_dir().join(format!("cistern-probe-{}.json", std::process::id()));
    let mut cmd = Command::new("python3");
    cmd.arg(&script)
        .arg("--out")
        .arg(&out)
        .arg("--compare")
        .arg(&reference);
    common::child_env(&mut cmd, &[]);
    let res = cmd.output().unwrap_or_else(|e| {
        panic!("python3 runs the probe ({e}): install python3, which the test command needs")
    });
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&res.stdout);
    let differ: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("differs:"))
        .collect();
    assert!(
        res.status.success() && differ.is_empty(),
        "the probe on the fake exited with {:?}; {} probes differ from {}:\n{}\nstderr:\n{}",
        res.status.code(),
        differ.len(),
        reference.display(),
        differ.join("\n"),
        String::from_utf8_lossy(&res.stderr)
    );
    let summary = stdout.lines().last().expect("the probe prints a summary");
    assert!(
        summary.starts_with("0 of 600 probes differ"),
        "every probe ran and was compared: {summary}"
    );
}
