//! `cistern doctor` end to end: exit status, grace period, `--clean-stale`, quiet when every
//! process exited cleanly, records expiring, the driver's Xid errors.

use crate::common::*;
use cistern::registry::{LeakEntry, ProcessSnapshot, State};
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

/// The target of issue 13: three scripts that exited cleanly long ago leave a healthy node. The
/// old doctor called each `attention [stale-record]` and exited 1.
#[test]
fn a_node_where_every_process_exited_cleanly_is_healthy() {
    let tmp = TempDir::new("doctor-exited");
    let dir = tmp.path().join("registry");
    for n in 0..3 {
        publish_aged(
            &dir,
            identity(dead_pid(n), 40 + n as u64, &format!("python script{n}.py")),
            ProcessSnapshot {
                devices: vec![device(0, "GPU-aaaa", 0, 0, &[])],
                ..ProcessSnapshot::default()
            },
            State::Exited,
            vec![],
            10 * 60 * 1000,
        );
    }
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": 0, "free": 80 * GIB,
                         "processes": []}]}),
    );
    let (code, doc) = doctor(&dir, &nvml, &[]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["healthy"], true);
    assert!(kinds(&doc).is_empty(), "{doc}");
    let exited = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "exited" && f["severity"] == "info")
        .count();
    assert_eq!(exited, 3, "{doc}");
    let out = cistern(Some(&nvml))
        .args(["doctor", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        !text.contains("attention") && text.ends_with("healthy\n"),
        "{text}"
    );
}

/// Records of exited processes expire (`registry_expire`) and the reader removes them, except
/// those holding memory (NVML lists the pid; a killed process's record with reserved bytes) or
/// with leaks, which stay until `--clean-stale`.
#[test]
fn expired_records_are_removed_by_the_reader_except_those_holding_memory_or_leaks() {
    let tmp = TempDir::new("doctor-expire");
    let dir = tmp.path().join("registry");
    let hour = 3600 * 1000;
    let empty = || ProcessSnapshot::default();
    let old_exit = publish_aged(
        &dir,
        identity(dead_pid(0), 1, "old"),
        empty(),
        State::Exited,
        vec![],
        2 * hour,
    );
    let young_exit = publish_aged(
        &dir,
        identity(dead_pid(1), 2, "young"),
        empty(),
        State::Exited,
        vec![],
        hour / 2,
    );
    let leaked = publish_aged(
        &dir,
        identity(dead_pid(2), 3, "leaky"),
        empty(),
        State::Exited,
        vec![LeakEntry {
            tag: "t".into(),
            site: None,
            device: 0,
            bytes: MIB,
            blocks: 1,
            oldest_age_ms: None,
        }],
        2 * hour,
    );
    let killed = publish_aged(
        &dir,
        identity(dead_pid(3), 4, "killed"),
        ProcessSnapshot {
            devices: vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
            ..ProcessSnapshot::default()
        },
        State::Running,
        vec![],
        2 * hour,
    );
    let listed_pid = dead_pid(4);
    let listed = publish_aged(
        &dir,
        identity(listed_pid, 5, "listed"),
        empty(),
        State::Exited,
        vec![],
        2 * hour,
    );
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-zzzz", "total": 80 * GIB, "used": GIB, "free": 79 * GIB,
                         "processes": [{"pid": listed_pid, "used_bytes": GIB, "kind": "compute"}]}]}),
    );
    // `never` keeps everything.
    let out = cistern(Some(&nvml))
        .env("CISTERN_CONF", "registry_expire:never")
        .args(["doctor", "--json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        old_exit.exists(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // The default, one hour.
    let (_, doc) = doctor(&dir, &nvml, &[]);
    let expired: Vec<&str> = doc["expired_records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(expired, [old_exit.to_str().unwrap()], "{doc}");
    assert!(!old_exit.exists());
    for kept in [&young_exit, &leaked, &killed, &listed] {
        assert!(kept.exists(), "{} was removed: {doc}", kept.display());
    }
    // `ps` expires too, by the configured time.
    let out = ps_in(Some(&nvml), &dir)
        .env("CISTERN_CONF", "registry_expire:10m")
        .arg("--json")
        .output()
        .unwrap();
    let doc = json(&out);
    assert_eq!(doc["expired_records"].as_array().unwrap().len(), 1, "{doc}");
    assert!(!young_exit.exists());
    assert!(leaked.exists() && killed.exists() && listed.exists());
    // What stays is removed by --clean-stale.
    let (_, doc) = doctor(&dir, &nvml, &["--clean-stale"]);
    assert!(!leaked.exists() && !killed.exists(), "{doc}");
}

/// The driver's Xid errors from recorded kernel-log lines: a fatal one needs attention and
/// names NVML's GPU by its bus id; an application's error is information; a dead process
/// holding memory is explained by the Xid that names its pid.
#[test]
fn xid_errors_are_findings_fatal_ones_attention() {
    let tmp = TempDir::new("doctor-xid");
    let dir = tmp.path().join("registry");
    std::fs::create_dir_all(tmp.path()).unwrap();
    let held = dead_pid(0);
    let kmsg = tmp.path().join("kmsg");
    std::fs::write(
        &kmsg,
        format!(
            "6,100,1000000,-;usb 1-1: new high-speed USB device\n\
             4,101,2000000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid={held}, name=python, Graphics Exception: ESR 0x405840\n\
             3,102,3000000,-;NVRM: Xid (PCI:0000:86:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
        ),
    )
    .unwrap();
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [
            {"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": GIB, "free": 79 * GIB,
             "pci_bus_id": "00000000:3B:00.0",
             "processes": [{"pid": held, "used_bytes": GIB, "kind": "compute"}]},
            {"index": 1, "uuid": "GPU-bbbb", "total": 80 * GIB, "used": 0, "free": 80 * GIB,
             "pci_bus_id": "00000000:86:00.0", "processes": []}]}),
    );
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_KMSG", &kmsg)
        .args(["doctor", "--json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let doc = json(&out);
    assert_eq!(out.status.code(), Some(1), "{doc}");
    let xids: Vec<(&str, &str, u64)> = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "xid")
        .map(|f| {
            (
                f["severity"].as_str().unwrap(),
                f["gpu"].as_str().unwrap(),
                f["pid"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        xids,
        [
            ("info", "GPU-aaaa", held as u64),
            ("attention", "GPU-bbbb", 1234)
        ]
    );
    let orphan = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "orphaned-context")
        .unwrap();
    assert!(
        orphan["message"].as_str().unwrap().contains("Xid 13"),
        "{orphan}"
    );
    assert_eq!(doc["xid"]["events"].as_array().unwrap().len(), 2);
    assert_eq!(doc["xid"]["events"][1]["gpu_index"], 1);
    // Unreadable: said, not fatal.
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_KMSG", tmp.path().join("missing"))
        .args(["doctor", "--json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let doc = json(&out);
    assert!(
        doc["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["kind"] == "xid-unavailable" && f["severity"] == "info"),
        "{doc}"
    );
}

/// `--clean-stale` removes records only in a directory of this user's: in one open to others
/// (or another user's) the path could be swapped by whoever controls the directory.
#[test]
fn clean_stale_keeps_records_in_a_directory_that_is_not_this_users() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = TempDir::new("doctor-clean-foreign");
    let dir = tmp.path().join("registry");
    let stale = publish(
        &dir,
        identity(dead_pid(0), 5, "python killed.py"),
        vec![],
        State::Running,
        vec![],
        vec![],
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let nvml = fake_nvml(tmp.path(), json!({"gpus": []}));
    let (code, doc) = doctor(&dir, &nvml, &["--grace", "0", "--clean-stale"]);
    assert!(stale.exists(), "{doc}");
    assert_eq!(code, 1);
    let f = &doc["findings"][0];
    assert_eq!(f["kind"], "stale-record");
    assert!(
        f["suggestion"]
            .as_str()
            .unwrap()
            .starts_with("kept: not in a registry directory of this user's"),
        "{f}"
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let (code, doc) = doctor(&dir, &nvml, &["--grace", "0", "--clean-stale"]);
    assert!(!stale.exists(), "{doc}");
    assert_eq!(code, 0, "{doc}");
}

/// A trainer sent CUDA tensors to a worker and exited; the worker still maps them. `ps` says
/// who maps whose memory, and `doctor` explains memory that outlives its dead owner.
#[test]
fn memory_received_from_a_dead_process_is_attributed_to_its_receiver() {
    let tmp = TempDir::new("doctor-imports");
    let dir = tmp.path().join("registry");
    let (me, start) = me();
    let trainer = dead_pid(0);
    let mut worker = device(0, "GPU-aaaa", GIB, MIB, &[]);
    worker.imported = vec![
        cistern::registry::ImportRecord {
            from_pid: trainer,
            from_start_time: 5,
            bytes: 3 * GIB,
        },
        // A sender with no record and no start time (an older receiver): named, with no
        // state, and not known to be dead.
        cistern::registry::ImportRecord {
            from_pid: dead_pid(1),
            from_start_time: 0,
            bytes: 2 * MIB,
        },
    ];
    // Senders beyond those the record names.
    worker.imported_other = 5 * MIB;
    publish(
        &dir,
        identity(me, start, "python rollout_worker.py"),
        vec![worker],
        State::Running,
        vec![],
        vec![],
    );
    publish(
        &dir,
        identity(trainer, 5, "python trainer.py"),
        vec![device(0, "GPU-aaaa", 4 * GIB, 3 * GIB, &[])],
        State::Exited,
        vec![LeakEntry {
            tag: "weights".into(),
            site: None,
            device: 0,
            bytes: 3 * GIB,
            blocks: 1,
            oldest_age_ms: None,
        }],
        vec![],
    );
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": 4 * GIB,
                         "free": 76 * GIB,
                         "processes": [{"pid": me, "used_bytes": 4 * GIB, "kind": "compute"}]}]}),
    );

    let doc = ps_json(Some(&nvml), &dir);
    let imports = doc["imports"].as_array().unwrap();
    assert_eq!(imports.len(), 2, "{doc}");
    assert_eq!(imports[0]["pid"], me);
    assert_eq!(imports[0]["from_pid"], trainer);
    assert_eq!(imports[0]["bytes"], 3 * GIB);
    assert_eq!(imports[0]["from_state"], "dead-record-only");
    assert_eq!(imports[0]["from_command"], "python trainer.py");
    assert_eq!(imports[1]["from_state"], serde_json::Value::Null);
    // The receiver's own reserved bytes are its pool's only.
    let row = doc["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == me)
        .unwrap();
    assert_eq!(row["reserved"], GIB);
    assert_eq!(row["gpus"][0]["imported"][0]["bytes"], 3 * GIB);
    assert_eq!(row["gpus"][0]["imported_other"], 5 * MIB);

    let text = ps_text(Some(&nvml), &dir);
    assert!(
        text.contains(&format!(
            "pid {me} maps 3.0 GiB on device 0 from pid {trainer} (dead-record-only: python \
             trainer.py)"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "pid {me} maps 5.0 MiB on device 0 from more senders (its record names the 32 \
             largest)"
        )),
        "{text}"
    );

    let (code, doc) = doctor(&dir, &nvml, &[]);
    assert_eq!(code, 0, "information, not attention: {doc}");
    let findings = doc["findings"].as_array().unwrap();
    let f = findings
        .iter()
        .find(|f| f["kind"] == "imported-from-dead")
        .unwrap_or_else(|| panic!("{doc}"));
    assert_eq!(f["pid"], me);
    assert_eq!(f["bytes"], 3 * GIB);
    let msg = f["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("pid {trainer} (python trainer.py)")),
        "{msg}"
    );
    // Only the dead sender's memory is a finding; the sender with no record is not.
    assert_eq!(
        findings
            .iter()
            .filter(|f| f["kind"] == "imported-from-dead")
            .count(),
        1
    );
    // The dead sender's leak finding no longer says the driver freed everything.
    let leak = findings
        .iter()
        .find(|f| f["kind"] == "exited-with-leaks")
        .unwrap();
    assert!(
        leak["suggestion"]
            .as_str()
            .unwrap()
            .contains("except what other processes still map"),
        "{leak}"
    );
}

/// A receiver records its sender's start time, so that a record of an earlier process given
/// the same pid is not taken for the sender: a running sender with no record is not called
/// dead, and a dead one with no record still is.
#[test]
fn imports_are_matched_to_their_sender_by_start_time() {
    let tmp = TempDir::new("doctor-imports-start");
    let dir = tmp.path().join("registry");
    let (me, start) = me();
    // The running sender: a child with no record, whose pid an earlier (dead) process used.
    let child = crate::common::holders::Killed(
        std::process::Command::new("sleep")
            .arg("3600")
            .spawn()
            .unwrap(),
    );
    let sender = child.pid();
    let sender_start = cistern::registry::process_start_time(sender).unwrap();
    let gone = dead_pid(2);
    let mut worker = device(0, "GPU-aaaa", GIB, MIB, &[]);
    worker.imported = vec![
        cistern::registry::ImportRecord {
            from_pid: sender,
            from_start_time: sender_start,
            bytes: 2 * GIB,
        },
        cistern::registry::ImportRecord {
            from_pid: gone,
            from_start_time: 12345,
            bytes: GIB,
        },
    ];
    publish(
        &dir,
        identity(me, start, "python learner.py"),
        vec![worker],
        State::Running,
        vec![],
        vec![],
    );
    // The earlier owner of the sender's pid: killed, its record left behind.
    publish(
        &dir,
        identity(
            sender,
            sender_start.saturating_sub(100),
            "python old_trainer.py",
        ),
        vec![device(0, "GPU-aaaa", GIB, GIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": GIB,
                         "free": 79 * GIB,
                         "processes": [{"pid": me, "used_bytes": GIB, "kind": "compute"}]}]}),
    );

    let doc = ps_json(Some(&nvml), &dir);
    let imports = doc["imports"].as_array().unwrap();
    assert_eq!(imports.len(), 2, "{doc}");
    let live = &imports[0];
    assert_eq!(live["from_pid"], sender);
    assert_eq!(live["from_start_time"], sender_start);
    assert_eq!(live["from_state"], serde_json::Value::Null, "{doc}");
    assert_eq!(live["from_liveness"], "alive", "{doc}");
    assert_eq!(live["from_command"], serde_json::Value::Null);
    let dead = &imports[1];
    assert_eq!(dead["from_pid"], gone);
    // Dead (or, should another process have taken the free pid meanwhile, reused).
    assert!(
        dead["from_liveness"] == "dead" || dead["from_liveness"] == "pid-reused",
        "{doc}"
    );
    let text = ps_text(Some(&nvml), &dir);
    assert!(
        text.contains(&format!("from pid {sender} (no record of it here")),
        "{text}"
    );
    assert!(
        text.contains(&format!("from pid {gone} (dead; no record of it here)")),
        "{text}"
    );

    let (_, doc) = doctor(&dir, &nvml, &[]);
    let found: Vec<&serde_json::Value> = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "imported-from-dead")
        .collect();
    assert_eq!(found.len(), 1, "only the dead sender's memory: {doc}");
    assert_eq!(found[0]["bytes"], GIB);
    let msg = found[0]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("pid {gone} (no record of it)")),
        "{msg}"
    );
    let fix = found[0]["suggestion"].as_str().unwrap();
    assert!(fix.contains(&format!("restart pid {me}")), "{fix}");
    drop(child);
}
