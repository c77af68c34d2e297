//! The multi-process scenario of the provenance issue, end to end: three processes use
//! `libcistern.so` through the real CUDA backend over the fake libcuda, each with its own tag;
//! one is killed with SIGKILL, one exits cleanly leaving a block it never freed. `cistern ps`,
//! `leaks` and `doctor` must account for all three from the registry alone (no NVML here).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::holders::HolderKit;

const MIB: u64 = 1 << 20;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cistern-e2e-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A fresh registry directory: private, as registry directories must be.
fn registry_dir(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = tmpdir(name);
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    d
}

fn cistern(registry: &Path, args: &[&str]) -> (i32, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cistern"))
        .args(args)
        .arg("--registry-dir")
        .arg(registry)
        .env("NO_COLOR", "1")
        .env_remove("CISTERN_FAKE_NVML")
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code().unwrap_or(-1),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn process(ps: &serde_json::Value, pid: u32) -> Option<&serde_json::Value> {
    ps["processes"]
        .as_array()?
        .iter()
        .find(|p| p["pid"].as_u64() == Some(pid as u64))
}

/// Polls `ps --json` until `ok` holds (records refresh at most once a second).
fn wait_for(registry: &Path, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let (_, ps, err) = cistern(registry, &["ps", "--json"]);
        if ok(&ps) {
            return ps;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out; last ps: {ps}\n{err}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn three_processes_one_killed_one_exited() {
    let work = tmpdir("work");
    let Some(kit) = HolderKit::new(&work) else {
        return;
    };
    let registry = registry_dir("registry");

    let mut weights = kit.spawn(&registry, "weights", 40, "wait");
    let acts = kit.spawn(&registry, "activations", 24, "wait");
    let mut exited = kit.spawn(&registry, "loader", 8, "exit");
    let exited_pid = exited.pid();
    let status = exited.0.wait().unwrap();
    let mut err = String::new();
    if let Some(mut e) = exited.0.stderr.take() {
        e.read_to_string(&mut err).unwrap();
    }
    assert!(status.success(), "{err}");

    // All three appear, with their tags' live bytes.
    let ps = wait_for(&registry, |ps| {
        [weights.pid(), acts.pid(), exited_pid]
            .iter()
            .all(|&p| process(ps, p).is_some_and(|p| p["live"].as_u64().unwrap_or(0) > 0))
    });
    let w = process(&ps, weights.pid()).unwrap();
    assert_eq!(w["state"], "running", "{w}");
    assert!(w["live"].as_u64().unwrap() >= 40 * MIB, "{w}");
    assert!(w.to_string().contains("weights"), "{w}");
    let e = process(&ps, exited_pid).unwrap();
    assert_eq!(e["record_state"], "exited", "{e}");
    // Real records say where they ran and on which driver (the CUDA backend, not the simulator).
    assert_eq!(w["simulated"], false, "{w}");
    if std::fs::metadata("/proc/self/cgroup").is_ok() {
        assert!(w["cgroup"].is_string(), "no cgroup in a real record: {w}");
    }

    // SIGKILL one: it stays listed, as dead, with its last state.
    weights.0.kill().unwrap();
    weights.0.wait().unwrap();
    let ps = wait_for(&registry, |ps| {
        process(ps, weights.pid()).is_some_and(|p| p["state"] != "running")
    });
    let w = process(&ps, weights.pid()).unwrap();
    assert!(
        w["state"].as_str().unwrap().starts_with("dead"),
        "killed process not shown as dead: {w}"
    );
    assert!(
        w["live"].as_u64().unwrap() >= 40 * MIB,
        "last state lost: {w}"
    );
    assert_eq!(
        process(&ps, acts.pid()).unwrap()["state"],
        "running",
        "the other holder is still alive"
    );

    // leaks of the dead process: its live bytes by tag, summing to what it held.
    let (code, leaks, err) = cistern(&registry, &["leaks", &weights.pid().to_string(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let total = leaks["total_bytes"].as_u64().unwrap();
    assert_eq!(
        total,
        leaks["record_live_bytes"].as_u64().unwrap(),
        "{leaks}"
    );
    assert!(total >= 40 * MIB, "{leaks}");
    assert!(leaks.to_string().contains("weights"), "{leaks}");

    // The clean exit left a leak summary naming the block it never freed.
    let (code, leaks, err) = cistern(&registry, &["leaks", &exited_pid.to_string(), "--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(leaks["source"], "leak-summary", "{leaks}");
    assert!(leaks.to_string().contains("loader"), "{leaks}");
    assert!(leaks["total_bytes"].as_u64().unwrap() >= 8 * MIB, "{leaks}");

    // doctor: the dead record needs attention once the grace period is over.
    let (code, _, err) = cistern(&registry, &["doctor", "--json", "--grace", "0"]);
    assert_eq!(
        code, 1,
        "doctor should flag the killed process's record: {err}"
    );

    drop(acts);
    let _ = std::fs::remove_dir_all(&work);
    let _ = std::fs::remove_dir_all(&registry);
}

/// An OOM names the other processes holding memory on the GPU, from their records: a holder
/// publishes its 40 MiB, then a second process asks for more than the device has; its error
/// (what `cistern_last_error` says, and the holder program prints) names the first by pid,
/// bytes and command line.
#[test]
fn an_oom_names_the_other_processes_on_the_gpu() {
    let work = tmpdir("oom-work");
    let Some(kit) = HolderKit::new(&work) else {
        return;
    };
    let registry = registry_dir("oom-registry");
    let weights = kit.spawn(&registry, "weights", 40, "wait");
    wait_for(&registry, |ps| {
        process(ps, weights.pid()).is_some_and(|p| p["reserved"].as_u64().unwrap_or(0) >= 40 * MIB)
    });
    // More than the fake device's 4 GiB.
    let out = kit
        .command(&registry, "greedy", 8192, "exit")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "the request did not fail: {err}"
    );
    assert!(err.contains("out of memory"), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains(&format!("pid {:>7}", weights.pid())))
        .unwrap_or_else(|| panic!("the holder {} is not named:\n{err}", weights.pid()));
    assert!(line.contains("holder weights 40 wait"), "{line}");
    assert!(err.contains("other processes on this device:"), "{err}");
}
