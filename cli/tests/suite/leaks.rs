//! `cistern leaks PID` end to end.

use crate::common::*;
use cistern::registry::{LeakEntry, MarkRecord, ProcessSnapshot, State};

#[test]
fn leaks_of_an_exited_process_sum_to_its_record() {
    let tmp = TempDir::new("leaks");
    let dir = tmp.path().join("registry");
    let pid = dead_pid(0);
    publish(
        &dir,
        identity(pid, 99, "python done.py"),
        vec![device(0, "GPU-aaaa", 64 * MIB, 4 * MIB, &[])],
        State::Exited,
        vec![
            LeakEntry {
                tag: "loader".into(),
                site: Some("load.py:12".into()),
                device: 0,
                bytes: 3 * MIB,
                blocks: 3,
                oldest_age_ms: Some(5000),
            },
            LeakEntry {
                tag: String::new(),
                site: None,
                device: 0,
                bytes: MIB,
                blocks: 1,
                oldest_age_ms: None,
            },
        ],
        vec![],
    );
    let out = cistern(None)
        .args(["leaks", &pid.to_string(), "--json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc = json(&out);
    assert_eq!(doc["source"], "leak-summary");
    assert_eq!(doc["liveness"], "dead");
    assert_eq!(doc["total_bytes"], 4 * MIB);
    assert_eq!(doc["total_bytes"], doc["record_live_bytes"]);
    assert_eq!(doc["total_blocks"], 4);
    let g = &doc["groups"][0];
    assert_eq!(
        (&g["tag"], &g["site"], &g["oldest_age_ms"]),
        (&"loader".into(), &"load.py:12".into(), &5000.into())
    );
    let text = cistern(None)
        .args(["leaks", &pid.to_string(), "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("loader") && text.contains("(untagged)"),
        "{text}"
    );
    assert!(!text.contains('\x1b'));
}

#[test]
fn leaks_of_a_running_record_group_by_tag_and_show_marks() {
    let tmp = TempDir::new("leaks-running");
    let dir = tmp.path().join("registry");
    let (pid, start) = me();
    // An older record of the pid, from a process that had it before: not the one shown.
    publish(
        &dir,
        identity(pid, start + 1, "old"),
        vec![device(0, "GPU-aaaa", MIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    publish(
        &dir,
        identity(pid, start, "python train.py"),
        vec![
            device(
                0,
                "GPU-aaaa",
                GIB,
                600 * MIB,
                &[("model", 400 * MIB, 4), ("activations", 150 * MIB, 30)],
            ),
            device(1, "GPU-bbbb", GIB, 100 * MIB, &[("model", 100 * MIB, 1)]),
        ],
        State::Running,
        vec![],
        vec![MarkRecord {
            id: 2,
            label: Some("epoch 2".into()),
            unix_ms: 1,
            live_bytes_since: 50 * MIB,
            live_blocks_since: 5,
        }],
    );
    let out = cistern(None)
        .args(["leaks", &pid.to_string(), "--json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let doc = json(&out);
    assert_eq!(doc["source"], "live-by-tag");
    assert_eq!(doc["liveness"], "alive");
    assert_eq!(doc["total_bytes"], 700 * MIB);
    assert_eq!(doc["record_live_bytes"], 700 * MIB);
    let other: Vec<_> = doc["groups"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["tag"] == "(other)")
        .collect();
    assert_eq!(other.len(), 1);
    assert_eq!(other[0]["bytes"], 50 * MIB);
    assert_eq!(doc["marks"][0]["live_bytes_since"], 50 * MIB);
}

#[test]
fn leaks_of_an_unknown_pid_is_an_error() {
    let tmp = TempDir::new("leaks-none");
    let out = cistern(None)
        .args(["leaks", "4", "--registry-dir"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no record of pid 4"));
}

/// The record's last OOM report, shown nowhere before: `leaks` prints it and puts it in JSON.
#[test]
fn leaks_shows_the_last_oom_report() {
    let tmp = TempDir::new("leaks-oom");
    let dir = tmp.path().join("registry");
    let pid = dead_pid(0);
    publish_aged(
        &dir,
        identity(pid, 99, "python oom.py"),
        ProcessSnapshot {
            devices: vec![device(
                0,
                "GPU-aaaa",
                GIB,
                5 * MIB,
                &[("model", 5 * MIB, 1)],
            )],
            last_oom: Some(oom(3 * GIB)),
            ..ProcessSnapshot::default()
        },
        State::Running,
        vec![],
        0,
    );
    let out = cistern(None)
        .args(["leaks", &pid.to_string(), "--json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let doc = json(&out);
    assert_eq!(doc["last_oom"]["requested"], 3 * GIB);
    assert_eq!(doc["last_oom"]["pending"], GIB);
    let out = cistern(None)
        .args(["leaks", &pid.to_string(), "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("last out-of-memory report: device 0 stream 7: requested 3.0 GiB")
            && text.contains("1.0 GiB pending")
            && text.contains("the device is full"),
        "{text}"
    );
}
