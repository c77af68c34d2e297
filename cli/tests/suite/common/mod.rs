//! Shared by the `ps`, `leaks` and `doctor` tests: a temporary registry with records written
//! for fake identities, a fake NVML (`CISTERN_FAKE_NVML`), and the `cistern` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use cistern::registry::{
    self, AttributionRecord, DeviceRecord, Identity, LeakEntry, MarkRecord, ProcessSnapshot,
    Registry, State,
};

pub mod holders;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// A fresh directory under the system's temporary directory (removed on drop).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "cistern-cli-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn identity(pid: u32, start_time: u64, command: &str) -> Identity {
    Identity {
        pid,
        start_time,
        boot_id: registry::boot_id().unwrap(),
        uid: registry::euid(),
        cmdline: command.split(' ').map(str::to_string).collect(),
        cmdline_truncated: false,
        placement: Default::default(),
    }
}

/// This process: alive.
pub fn me() -> (u32, u64) {
    let pid = std::process::id();
    (pid, registry::process_start_time(pid).unwrap())
}

/// A pid no process has (`n`-th one, counting down from the top of the pid range).
pub fn dead_pid(n: usize) -> u32 {
    let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(32768);
    (1..max)
        .rev()
        .filter(|p| !Path::new(&format!("/proc/{p}")).exists())
        .nth(n)
        .unwrap()
}

pub fn device(
    index: u32,
    uuid: &str,
    reserved: u64,
    live: u64,
    tags: &[(&str, u64, u64)],
) -> DeviceRecord {
    DeviceRecord {
        allocations: 0,
        ooms: 0,
        index,
        uuid: Some(uuid.to_string()),
        name: "Fake GPU".into(),
        total_memory: 80 * GIB,
        limit: 80 * GIB,
        reserved,
        live,
        cached: reserved - live,
        pending: 0,
        peak_reserved: reserved,
        peak_live: live,
        top_tags: tags
            .iter()
            .map(|(n, b, k)| AttributionRecord {
                name: n.to_string(),
                bytes: *b,
                blocks: *k,
            })
            .collect(),
        top_sites: Vec::new(),
        imported: Vec::new(),
        imported_other: 0,
    }
}

pub fn publish(
    dir: &Path,
    id: Identity,
    devices: Vec<DeviceRecord>,
    state: State,
    leaks: Vec<LeakEntry>,
    marks: Vec<MarkRecord>,
) -> PathBuf {
    let r = Registry::with_identity(dir, id).unwrap();
    r.publish(
        &ProcessSnapshot {
            devices,
            last_oom: None,
            marks,
            driver: None,
        },
        state,
        leaks,
    )
    .unwrap();
    r.record_path()
}

/// Writes a fake NVML JSON file and returns its path.
pub fn fake_nvml(dir: &Path, doc: serde_json::Value) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join("fake-nvml.json");
    std::fs::write(&p, serde_json::to_vec(&doc).unwrap()).unwrap();
    p
}

/// Writes a record of `id` from a whole snapshot, as if last written `age_ms` ago.
pub fn publish_aged(
    dir: &Path,
    id: Identity,
    snapshot: ProcessSnapshot,
    state: State,
    leaks: Vec<LeakEntry>,
    age_ms: u64,
) -> PathBuf {
    let r = Registry::with_identity(dir, id.clone()).unwrap();
    let mut rec = registry::build_record(&id, &snapshot, state, leaks);
    rec.updated_unix_ms -= age_ms;
    let bytes = registry::encode_record(&mut rec);
    registry::write_atomic(dir, &rec.file_name(), &bytes, false).unwrap();
    r.record_path()
}

/// An OOM report as a process would publish it.
pub fn oom(requested: u64) -> registry::OomRecord {
    registry::OomRecord {
        device: 0,
        stream: 7,
        requested,
        rounded: requested,
        limit: 80 * GIB,
        device_free: GIB,
        device_total: 80 * GIB,
        reserved: GIB + 306 * MIB,
        live: 5 * MIB,
        pending: GIB,
        cached: 301 * MIB,
        largest_free: 300 * MIB,
        top_tags: vec![],
        top_sites: vec![],
        other_processes: vec![],
        process_nvml_bytes: None,
        reason: "the device is full".into(),
    }
}

/// The built `cistern` with no colour and nothing else set (the replay and whatif tests').
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cistern"));
    c.env("NO_COLOR", "1");
    c
}

/// The dev traces (`$CISTERN_TRACES_DIR`, else `../shared/traces`), when present.
pub fn traces_dir() -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("CISTERN_TRACES_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces")
        });
    dir.is_dir().then_some(dir)
}

/// The `cistern` binary, with no colour, no `CISTERN_CONF`, the fake NVML when given, and an
/// empty kernel log (`CISTERN_FAKE_KMSG=/dev/null`: the host's Xid errors play no part).
pub fn cistern(nvml: Option<&Path>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cistern"));
    c.env("NO_COLOR", "1")
        .env_remove("CISTERN_CONF")
        .env_remove("CISTERN_FAKE_REGISTRY_ROOT")
        .env("CISTERN_FAKE_KMSG", "/dev/null");
    match nvml {
        Some(p) => c.env("CISTERN_FAKE_NVML", p),
        None => c.env_remove("CISTERN_FAKE_NVML"),
    };
    c
}

/// `cistern ps --registry-dir DIR` (the fake NVML when given): add `--json` or other flags.
pub fn ps_in(nvml: Option<&Path>, dir: &Path) -> Command {
    let mut c = cistern(nvml);
    c.args(["ps", "--registry-dir"]).arg(dir);
    c
}

/// `cistern ps --json` over registry `dir`, parsed.
pub fn ps_json(nvml: Option<&Path>, dir: &Path) -> serde_json::Value {
    json(&ps_in(nvml, dir).arg("--json").output().unwrap())
}

/// `cistern ps`'s table over registry `dir`.
pub fn ps_text(nvml: Option<&Path>, dir: &Path) -> String {
    String::from_utf8(ps_in(nvml, dir).output().unwrap().stdout).unwrap()
}

pub fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}
