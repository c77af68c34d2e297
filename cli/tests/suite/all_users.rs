//! `--all-users`: `ps` and `doctor` read every user's registry directory in the standard places
//! (under `CISTERN_FAKE_REGISTRY_ROOT` here), checking each against the uid in its name; a
//! directory with the wrong owner, an open mode or a symlink is refused by name and never read.

use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use crate::common::*;
use cistern::registry::{self, State};
use serde_json::{json, Value};

fn mkdir(p: &Path, mode: u32) {
    std::fs::create_dir_all(p).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn paths(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["path"]
                .as_str()
                .unwrap_or_else(|| d.as_str().unwrap())
                .to_string()
        })
        .collect()
}

#[test]
fn every_users_directory_is_read_and_unsafe_ones_are_refused_by_name() {
    let tmp = TempDir::new("all-users");
    let root = tmp.path().join("root");
    let me = registry::euid();
    let other = me + 4242;
    let (pid, start) = crate::common::me();
    // Mine, in /dev/shm: read.
    let shm_mine = root.join(format!("dev/shm/cistern-{me}"));
    mkdir(&root.join("dev/shm"), 0o1777);
    publish(
        &shm_mine,
        identity(pid, start, "python mine.py"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    // Mine, under /run/user/<uid>: read too.
    let run_mine = root.join(format!("run/user/{me}/cistern"));
    publish(
        &run_mine,
        identity(dead_pid(0), 7, "python run.py"),
        vec![],
        State::Exited,
        vec![],
        vec![],
    );
    // Named for another uid but owned by me: refused (whoever made it could plant records).
    let planted = root.join(format!("tmp/cistern-{other}"));
    publish(
        &planted,
        identity(dead_pid(1), 8, "planted"),
        vec![device(0, "GPU-aaaa", GIB, GIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    // Mine but open to others: refused.
    let open = root.join(format!("tmp/cistern-{me}"));
    mkdir(&open, 0o777);
    // A symlink: refused, not followed.
    symlink(&shm_mine, root.join(format!("dev/shm/cistern-{}", me + 2))).unwrap();
    // Other names are not registry directories.
    mkdir(&root.join("tmp/cistern-cli-something"), 0o700);
    // In my directory, a record that claims to be another user's: refused, not shown.
    let mut claim = identity(dead_pid(2), 9, "claims root");
    claim.uid = other;
    publish(
        &shm_mine,
        claim,
        vec![device(0, "GPU-aaaa", GIB, GIB, &[])],
        State::Running,
        vec![],
        vec![],
    );

    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": GIB, "free": 79 * GIB,
                         "processes": [{"pid": pid, "used_bytes": GIB, "kind": "compute"}]}]}),
    );
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .args(["ps", "--all-users", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc = json(&out);
    let read = paths(&doc["registry_dirs"]);
    assert_eq!(
        read,
        [
            shm_mine.display().to_string(),
            run_mine.display().to_string()
        ],
        "{doc}"
    );
    let refused = &doc["refused_registry_dirs"];
    let by_path = |p: &Path| {
        refused
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["path"] == p.display().to_string())
            .unwrap_or_else(|| panic!("{} not refused: {doc}", p.display()))["reason"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(by_path(&planted).contains(&format!("owned by uid {me}, not by uid {other}")));
    assert!(by_path(&open).contains("0777"));
    assert!(by_path(&root.join(format!("dev/shm/cistern-{}", me + 2))).contains("symlink"));
    assert_eq!(refused.as_array().unwrap().len(), 3, "{doc}");
    // The planted record was never read.
    let cmds: Vec<&str> = doc["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["command"].as_str().unwrap())
        .collect();
    assert_eq!(cmds, ["python mine.py", "python run.py"], "{doc}");
    let claims: Vec<&str> = doc["refused_records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["error"].as_str().unwrap())
        .collect();
    assert_eq!(
        claims,
        [format!(
            "claims uid {other} in the directory of uid {me}: refused"
        )],
        "{doc}"
    );

    // The text names each refused directory with its reason.
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .args(["ps", "--all-users"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(&format!(
            "registry directory {} refused (not read)",
            planted.display()
        )),
        "{text}"
    );
    // doctor: unsafe directories need attention.
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .args(["doctor", "--all-users", "--json"])
        .output()
        .unwrap();
    let doc = json(&out);
    assert_eq!(out.status.code(), Some(1), "{doc}");
    let refused = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "refused-registry-dir" && f["severity"] == "attention")
        .count();
    assert_eq!(refused, 3, "{doc}");
    // Without the unsafe ones, the node is healthy (my exited process is information).
    std::fs::remove_dir_all(&planted).unwrap();
    std::fs::remove_dir_all(&open).unwrap();
    std::fs::remove_file(root.join(format!("dev/shm/cistern-{}", me + 2))).unwrap();
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .args(["doctor", "--all-users"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{text}");
    // Without --all-users, one directory as before.
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .args(["ps", "--json", "--registry-dir"])
        .arg(&run_mine)
        .output()
        .unwrap();
    assert_eq!(
        paths(&json(&out)["registry_dirs"]),
        [run_mine.display().to_string()]
    );
}

#[test]
fn all_users_keeps_an_explicit_directory_and_refuses_a_bad_cistern_conf() {
    let tmp = TempDir::new("all-users-conf");
    let root = tmp.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let out = cistern(None)
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .env("CISTERN_CONF", "bogus_key:1")
        .args(["ps", "--all-users"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("bogus_key") && err.contains("--registry-dir"),
        "{err}"
    );
    let mine = tmp.path().join("mine");
    let (pid, start) = crate::common::me();
    publish(
        &mine,
        identity(pid, start, "python mine.py"),
        vec![],
        State::Running,
        vec![],
        vec![],
    );
    let out = cistern(None)
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .args(["ps", "--all-users", "--json", "--registry-dir"])
        .arg(&mine)
        .output()
        .unwrap();
    let doc = json(&out);
    assert_eq!(paths(&doc["registry_dirs"]), [mine.display().to_string()]);
    assert_eq!(doc["processes"].as_array().unwrap().len(), 1);
}

/// Node-wide, a record must be its directory's user's: one whose file another user wrote, or
/// that names a live process running as another user (anyone can read a pid and its start
/// time in /proc), is refused and takes no NVML memory. Needs root (to chown a file and to
/// start a process as another user); elsewhere it says so and passes.
#[test]
fn records_of_another_user_are_refused_node_wide() {
    use std::os::unix::fs::chown;
    let me = registry::euid();
    if me != 0 {
        eprintln!("skipping: needs root to write as, and run as, another user");
        return;
    }
    let tmp = TempDir::new("impostors");
    let root = tmp.path().join("root");
    mkdir(&root.join("dev/shm"), 0o1777);
    let mine = root.join(format!("dev/shm/cistern-{me}"));
    let (pid, start) = crate::common::me();
    publish(
        &mine,
        identity(pid, start, "python mine.py"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    // A file another user wrote into my directory.
    let planted = publish(
        &mine,
        identity(dead_pid(3), 3, "planted"),
        vec![],
        State::Running,
        vec![],
        vec![],
    );
    chown(&planted, Some(4242), Some(4242)).unwrap();
    // A record naming a live process of another user.
    let other = crate::common::holders::Killed(
        std::process::Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "sleep",
                "30",
            ])
            .spawn()
            .expect("setpriv (util-linux) runs"),
    );
    let other_pid = other.0.id();
    // Wait until it runs as 65534 (setpriv has dropped its privileges and exec'd).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{other_pid}/status"))
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.contains("65534"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "setpriv did not drop to 65534"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let other_start = registry::process_start_time(other_pid).unwrap();
    publish(
        &mine,
        identity(other_pid, other_start, "sleep 30"),
        vec![device(0, "GPU-aaaa", GIB, GIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    let nvml = fake_nvml(
        tmp.path(),
        json!({"gpus": [{"index": 0, "uuid": "GPU-aaaa", "total": 80 * GIB, "used": 2 * GIB,
                         "free": 78 * GIB, "processes": [
                             {"pid": pid, "used_bytes": GIB, "kind": "compute"},
                             {"pid": other_pid, "used_bytes": GIB, "kind": "compute"}]}]}),
    );
    let out = cistern(Some(&nvml))
        .env("CISTERN_FAKE_REGISTRY_ROOT", &root)
        .args(["ps", "--all-users", "--json"])
        .output()
        .unwrap();
    let doc = json(&out);
    let errors: Vec<String> = doc["refused_records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["error"].as_str().unwrap().to_string())
        .collect();
    assert!(
        errors.iter().any(|e| e.contains(&format!(
            "written by uid 4242 into the directory of uid {me}"
        ))),
        "{doc}"
    );
    assert!(
        errors.iter().any(|e| e.contains(&format!(
            "names pid {other_pid}, which runs as uid 65534, not as uid {me}"
        ))),
        "{doc}"
    );
    // Only my record is shown; the other user's process is NVML's, with no record.
    let rows = doc["processes"].as_array().unwrap();
    let mine_row = rows.iter().find(|p| p["pid"] == pid).unwrap();
    assert_eq!(mine_row["command"], "python mine.py", "{doc}");
    let other_row = rows.iter().find(|p| p["pid"] == other_pid).unwrap();
    assert_eq!(other_row["state"], "no-record", "{doc}");
}
