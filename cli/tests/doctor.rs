//! `cistern doctor` end to end: exit status, grace period, `--clean-stale`.

mod common;

use cistern::registry::State;
use common::*;
use serde_json::json;

fn doctor(
    dir: &std::path::Path,
    nvml: &std::path::Path,
    extra: &[&str],
) -> (i32, serde_json::Value) {
    let out = cistern(Some(nvml))
        .args(["doctor", "--json", "--registry-dir"])
        .arg(dir)
        .args(extra)
        .output()
        .unwrap();
    (out.status.code().unwrap(), json(&out))
}

fn kinds(doc: &serde_json::Value) -> Vec<String> {
    doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "attention")
        .map(|f| f["kind"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn doctor_is_healthy_when_clean_and_flags_stale_records_after_the_grace_period() {
    let tmp = TempDir::new("doctor");
    let dir = tmp.path().join("registry");
    let (me, start) = me();
    publish(
        &dir,
        identity(me, start, "python train.py"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": GIB, "free": 79 * GIB,
                         "processes": [{"pid": me, "used_bytes": GIB, "kind": "compute"}]}]}),
    );
    let (code, doc) = doctor(&dir, &nvml, &[]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["healthy"], true);

    let dead = dead_pid(0);
    let stale = publish(
        &dir,
        identity(dead, 5, "python killed.py"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    // Within the grace period: information only.
    let (code, doc) = doctor(&dir, &nvml, &["--grace", "3600"]);
    assert_eq!(code, 0, "{doc}");
    // Past it: attention.
    let (code, doc) = doctor(&dir, &nvml, &["--grace", "0"]);
    assert_eq!(code, 1, "{doc}");
    assert_eq!(kinds(&doc), ["stale-record"]);
    assert!(
        stale.exists(),
        "doctor removed a record without --clean-stale"
    );
    // The text form suggests, with no colour.
    let out = cistern(Some(&nvml))
        .args(["doctor", "--grace", "0", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("--clean-stale") && text.contains("needs attention"),
        "{text}"
    );
    assert!(!text.contains('\x1b'));
}

#[test]
fn clean_stale_removes_only_dead_records_nvml_does_not_list() {
    let tmp = TempDir::new("doctor-clean");
    let dir = tmp.path().join("registry");
    let (me, start) = me();
    let alive = publish(
        &dir,
        identity(me, start, "alive"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    let held_pid = dead_pid(0);
    let held = publish(
        &dir,
        identity(held_pid, 5, "killed, memory held"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    let gone = publish(
        &dir,
        identity(dead_pid(1), 6, "exited"),
        vec![],
        State::Exited,
        vec![],
        vec![],
    );
    let junk = dir.join("123-456.json");
    std::fs::write(&junk, b"not a record").unwrap();
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": 2 * GIB, "free": 78 * GIB,
                         "processes": [{"pid": me, "used_bytes": GIB, "kind": "compute"},
                                       {"pid": held_pid, "used_bytes": GIB, "kind": "compute"}]}]}),
    );
    // A recent record survives --clean-stale with the default grace.
    let (_, _) = doctor(&dir, &nvml, &["--clean-stale"]);
    assert!(gone.exists());

    let (code, doc) = doctor(&dir, &nvml, &["--grace", "0", "--clean-stale"]);
    assert!(!gone.exists(), "the stale record was kept: {doc}");
    assert!(alive.exists() && held.exists() && junk.exists(), "{doc}");
    // The orphaned context still needs attention; it is never "cleaned".
    assert_eq!(code, 1);
    assert_eq!(kinds(&doc), ["orphaned-context"]);
    let cleaned = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["cleaned"] == true)
        .count();
    assert_eq!(cleaned, 1);
}

#[test]
fn doctor_exits_2_on_an_unusable_fake() {
    let tmp = TempDir::new("doctor-err");
    let bad = tmp.path().join("nvml.json");
    std::fs::create_dir_all(tmp.path()).unwrap();
    std::fs::write(&bad, b"{").unwrap();
    let out = cistern(Some(&bad))
        .args(["doctor", "--registry-dir"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
