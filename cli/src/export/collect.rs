//! One scrape's samples: the registry directories and NVML read into `ps`'s snapshot, and
//! `ps`'s report built from it (so `export` and `ps` classify and add up processes the same way), turned into the
//! families of [`super::metrics::METRICS`], with bounded labels (commands and tags cut to a
//! length, the top N tags per process and GPU and the rest summed as `tag="other"`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use cistern::registry::{self, AttributionRecord, DeviceRecord, Record, State};

use super::kube::KubeNames;
use super::metrics::{Exposition, Labels, Value};
use crate::gpu::GpuView;
use crate::ps::{self, ProcRow, PsState, Snapshot};
use crate::registry_dirs::Dirs;
use crate::table::printable;
use crate::xid;

/// A `command` label is cut to this many characters (a process's whole command line would make
/// every series as long as its arguments).
pub const MAX_COMMAND_CHARS: usize = 120;
/// A `tag` label is cut to this many characters.
pub const MAX_TAG_CHARS: usize = 128;
/// A `dir` label is cut to this many characters.
pub const MAX_DIR_CHARS: usize = 256;
/// A `container_id`, `pod_uid` or `UUID` label is cut to this many characters (ids are 64 and
/// 36, GPU UUIDs 40).
pub const MAX_ID_CHARS: usize = 80;
/// The tag under which bytes beyond the top N tags are summed.
pub const OTHER_TAG: &str = "other";

/// What a scrape needs besides the registry and NVML.
#[derive(Debug, Clone)]
pub struct Options {
    /// How many tags per process and GPU are named; the rest are summed as `tag="other"`.
    pub top_tags: usize,
    /// The `Hostname` label of GPU metrics (dcgm-exporter's: the node's name).
    pub hostname: String,
    /// Whether the `command` label is the whole command line (cut to [`MAX_COMMAND_CHARS`]),
    /// or only the program (and the script it runs): arguments can hold secrets, and the
    /// exposition is readable by whoever reaches the port.
    pub full_command: bool,
    /// The kubelet's container log folder ([`super::kube`]), read on each scrape for the names
    /// of the pods the processes run in; `None` reads none.
    pub kube_logs: Option<PathBuf>,
}

/// Where a process runs, for Kubernetes: the ids its record carries (parsed from its cgroup
/// by the process itself) and the names the kubelet's log folder gives them ([`KubeNames`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Workload {
    pub container: Option<String>,
    pub pod: Option<String>,
    pub namespace: Option<String>,
    pub container_id: Option<String>,
    pub pod_uid: Option<String>,
}

/// The workload of a record's process (nothing for a process outside containers, or without a
/// record). For a process that runs, with its pid in this reader's namespace (`live_pid`), the
/// kernel's word is taken (`/proc/<pid>/cgroup`, as this reader sees it), not the record's: a
/// record is another user's text and could name someone else's pod, and a container with a
/// private cgroup namespace sees only `0::/` itself. A dead process's ids are its record's.
pub fn workload(record: Option<&Record>, live_pid: Option<u32>, kube: &KubeNames) -> Workload {
    let Some(r) = record else {
        return Workload::default();
    };
    let seen = live_pid
        .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")).ok())
        .map(|text| registry::parse_cgroup(&text));
    let (container_id, pod_uid) = match seen {
        Some(p) => (p.container_id, p.pod_uid),
        None => (r.container_id.clone(), r.pod_uid.clone()),
    };
    let names = container_id.as_deref().and_then(|id| kube.get(id));
    Workload {
        container: names.map(|n| n.container.clone()),
        pod: names.map(|n| n.pod.clone()),
        namespace: names.map(|n| n.namespace.clone()),
        container_id: container_id.as_deref().map(|v| bounded(v, MAX_ID_CHARS)),
        pod_uid: pod_uid.as_deref().map(|v| bounded(v, MAX_ID_CHARS)),
    }
}

/// The exporter's state for one scrape, in the words of the `state` label.
pub fn state_name(state: PsState, record_state: Option<State>) -> &'static str {
    match (state, record_state) {
        // Dead with only its record left: a clean exit wrote a final `exited` record; a record
        // still saying `running` is the last word of a process that was killed or crashed.
        (PsState::DeadRecordOnly, Some(State::Exited)) => "exited",
        (s, _) => s.name(),
    }
}

/// Whether a process in this state may still hold the memory its record names (running, a
/// zombie, or dead while NVML lists its memory); the byte counts of its record are exported
/// only then.
pub fn may_hold_memory(state: PsState) -> bool {
    matches!(
        state,
        PsState::Running | PsState::Zombie | PsState::DeadButMemoryHeld
    )
}

/// Cuts `s` to at most `max` characters.
pub fn bounded(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

/// The top `n` tags of a device by live bytes, and the rest of `live` as [`OTHER_TAG`]. Tags
/// are merged by name after being cut to [`MAX_TAG_CHARS`] (records are untrusted input, and
/// two names may cut to one); a tag that is itself named `other` is summed into the rest. With
/// no published tags (provenance off), nothing: the bytes are not attributed.
pub fn fold_tags(tags: &[AttributionRecord], live: u64, n: usize) -> Vec<(String, u64)> {
    if tags.is_empty() {
        return Vec::new();
    }
    let mut merged: HashMap<String, u64> = HashMap::new();
    for t in tags {
        let name = bounded(&t.name, MAX_TAG_CHARS);
        if name == OTHER_TAG {
            continue;
        }
        let e = merged.entry(name).or_insert(0);
        *e = e.saturating_add(t.bytes);
    }
    let mut sorted: Vec<(String, u64)> = merged.into_iter().collect();
    sorted.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    sorted.truncate(n);
    let named = sorted.iter().fold(0u64, |s, (_, b)| s.saturating_add(*b));
    let rest = live.saturating_sub(named);
    if rest > 0 {
        sorted.push((OTHER_TAG.to_string(), rest));
    }
    sorted
}

/// Messages about registry directories, each printed once until it changes (a scrape every few
/// seconds must not repeat the same warning for ever).
#[derive(Debug, Default)]
pub struct Warnings(Mutex<HashMap<PathBuf, String>>);

impl Warnings {
    /// Forgets the directories that are no longer among `dirs` (users come and go).
    fn keep_only(&self, dirs: &Dirs) {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|p, _| {
            dirs.dirs.iter().any(|d| &d.path == p)
                || dirs.refused.iter().any(|d| &d.path == p)
                || dirs.unreadable.iter().any(|d| &d.path == p)
        });
    }

    /// Prints `msg` about `dir` unless it is what was printed last (and says whether it
    /// printed); `None` clears it.
    fn note(&self, dir: &Path, msg: Option<String>) -> bool {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match msg {
            Some(m) if seen.get(dir) != Some(&m) => {
                eprintln!(
                    "cistern export: warning: registry directory {}: {}",
                    printable(&dir.display().to_string()),
                    printable(&m)
                );
                seen.insert(dir.to_path_buf(), m);
                true
            }
            Some(_) => false,
            None => {
                seen.remove(dir);
                false
            }
        }
    }
}

/// The program of a command line, without its arguments: the first word's file name, and the
/// file name of the script an interpreter runs (`python train.py --token=…` is
/// `python train.py`).
pub fn program(command: &str) -> String {
    let base = |w: &str| w.rsplit('/').next().unwrap_or(w).to_string();
    let mut words = command.split(' ').filter(|w| !w.is_empty());
    let Some(first) = words.next() else {
        return String::new();
    };
    let prog = base(first);
    let script = words.next().filter(|w| {
        const SCRIPTS: [&str; 6] = [".py", ".sh", ".js", ".rb", ".pl", ".lua"];
        !w.starts_with('-') && SCRIPTS.iter().any(|e| w.ends_with(e))
    });
    match script {
        Some(s) => format!("{prog} {}", base(s)),
        None => prog,
    }
}

fn process_labels(
    row: &ProcRow,
    record: Option<&Record>,
    kube: &KubeNames,
    full_command: bool,
) -> Labels {
    let mut l: Labels = vec![
        ("pid", row.pid.to_string()),
        (
            "command",
            if full_command {
                bounded(&row.command, MAX_COMMAND_CHARS)
            } else {
                bounded(&program(&row.command), MAX_COMMAND_CHARS)
            },
        ),
    ];
    if let Some(uid) = row.uid {
        l.push(("uid", uid.to_string()));
    }
    let live_pid = matches!(row.state, PsState::Running | PsState::Zombie).then_some(row.pid);
    let w = workload(record, live_pid, kube);
    for (k, v) in [
        ("container", w.container),
        ("pod", w.pod),
        ("namespace", w.namespace),
        ("container_id", w.container_id),
        ("pod_uid", w.pod_uid),
        // On the simulated GPU (a test or a replay): its GPU is not one of the node's.
        ("simulated", row.simulated.then(|| "true".to_string())),
    ] {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            l.push((k, v));
        }
    }
    l
}

fn with_gpu(base: &Labels, gpu_index: Option<u32>, uuid: Option<&str>) -> Labels {
    let mut l = base.clone();
    if let Some(i) = gpu_index {
        l.push(("gpu", i.to_string()));
    }
    if let Some(u) = uuid {
        l.push(("UUID", bounded(u, MAX_ID_CHARS)));
    }
    l
}

fn with(base: &Labels, k: &'static str, v: String) -> Labels {
    let mut l = base.clone();
    l.push((k, v));
    l
}

/// Reads the registry directories and NVML and builds one scrape's samples (the exporter's own
/// health included, except the scrape counter, which the server adds).
pub fn collect(view: &dyn GpuView, dirs: &Dirs, opts: &Options, warnings: &Warnings) -> Exposition {
    let started = Instant::now();
    let gathered = Snapshot::gather(view, dirs);
    for d in &dirs.dirs {
        let doubt = gathered.doubts.iter().find(|(p, _)| *p == d.path);
        let failed = gathered.failed.iter().find(|f| f.path == d.path);
        let msg = match (doubt, failed) {
            (_, Some(f)) => Some(format!("cannot be read: {}", f.reason)),
            (Some((_, why)), None) => Some(why.clone()),
            (None, None) => None,
        };
        warnings.note(&d.path, msg);
    }
    for d in dirs.refused.iter().chain(&dirs.unreadable) {
        warnings.note(&d.path, Some(format!("not read: {}", d.reason)));
    }
    let gathered_failed: Vec<PathBuf> = gathered.failed.iter().map(|f| f.path.clone()).collect();
    warnings.keep_only(dirs);
    let snap = gathered.snapshot;
    let kube = opts
        .kube_logs
        .as_deref()
        .map(KubeNames::read)
        .unwrap_or_default();
    let report = ps::build(&snap);
    let by_path: HashMap<&Path, &Record> = snap
        .records
        .iter()
        .map(|(p, r, _)| (p.as_path(), r))
        .collect();
    let mut x = Exposition::default();

    // Rows come sorted by state (running first), then pid, newest record first: the first row
    // of a pid is the one whose series are kept (the exposition refuses a second label set).
    let mut dead_held: BTreeMap<&str, u64> = BTreeMap::new();
    for row in &report.processes {
        let record = row.record.as_deref().and_then(|p| by_path.get(p).copied());
        let proc = process_labels(row, record, &kube, opts.full_command);
        x.add(
            "cistern_process_state",
            with(
                &proc,
                "state",
                state_name(row.state, row.record_state).into(),
            ),
            Value::Int(1),
        );
        if let Some(r) = record {
            x.add(
                "cistern_process_oom_reported",
                proc.clone(),
                Value::Int(r.last_oom.is_some() as i64),
            );
            if let Some(oom) = &r.last_oom {
                x.bytes(
                    "cistern_process_last_oom_requested_bytes",
                    proc.clone(),
                    oom.requested,
                );
            }
            x.add(
                "cistern_process_record_updated_timestamp_seconds",
                proc.clone(),
                Value::Float(r.updated_unix_ms as f64 / 1000.0),
            );
        }
        let mut used_devices: Vec<bool> = vec![false; record.map_or(0, |r| r.devices.len())];
        for g in &row.gpus {
            let l = with_gpu(&proc, g.gpu_index, g.uuid.as_deref());
            if let Some(b) = g.nvml_used {
                x.bytes("cistern_process_gpu_used_bytes", l.clone(), b);
                if row.state == PsState::DeadButMemoryHeld {
                    if let Some(u) = g.uuid.as_deref() {
                        let e = dead_held.entry(u).or_insert(0);
                        *e = e.saturating_add(b);
                    }
                }
            }
            if let Some(o) = g.overhead {
                x.add("cistern_process_overhead_bytes", l.clone(), Value::Int(o));
            }
            // The record's own device for this row (by ordinal and UUID, each used once).
            let dev: Option<&DeviceRecord> = record.and_then(|r| {
                let i = r.devices.iter().enumerate().position(|(i, d)| {
                    !used_devices[i] && Some(d.index) == g.device && d.uuid == g.uuid
                })?;
                used_devices[i] = true;
                Some(&r.devices[i])
            });
            let Some(d) = dev else { continue };
            if !may_hold_memory(row.state) {
                // Its memory is gone with it: the last numbers of its record would add to
                // every sum as if still held. Its state says it is there.
                continue;
            }
            x.bytes("cistern_process_reserved_bytes", l.clone(), d.reserved);
            x.bytes("cistern_process_live_bytes", l.clone(), d.live);
            x.bytes("cistern_process_cached_bytes", l.clone(), d.cached);
            x.bytes("cistern_process_pending_bytes", l.clone(), d.pending);
            x.bytes(
                "cistern_process_peak_reserved_bytes",
                l.clone(),
                d.peak_reserved,
            );
            x.bytes("cistern_process_peak_live_bytes", l.clone(), d.peak_live);
            x.bytes("cistern_process_limit_bytes", l.clone(), d.limit);
            x.add(
                "cistern_process_allocations_total",
                l.clone(),
                Value::Count(d.allocations),
            );
            x.add(
                "cistern_process_ooms_total",
                l.clone(),
                Value::Count(d.ooms),
            );
            for (tag, b) in fold_tags(&d.top_tags, d.live, opts.top_tags) {
                x.bytes("cistern_process_tag_live_bytes", with(&l, "tag", tag), b);
            }
            // One series per sender pid: a dead sender and the later process given its pid are
            // two imports of one pid.
            let mut by_pid: BTreeMap<u32, u64> = BTreeMap::new();
            for i in &d.imported {
                let e = by_pid.entry(i.from_pid).or_default();
                *e = e.saturating_add(i.bytes);
            }
            for (from_pid, bytes) in by_pid {
                x.bytes(
                    "cistern_process_imported_bytes",
                    with(&l, "from_pid", from_pid.to_string()),
                    bytes,
                );
            }
            if d.imported_other > 0 {
                // Senders beyond those the record names: one series, as tags past the top fold.
                x.bytes(
                    "cistern_process_imported_bytes",
                    with(&l, "from_pid", "other".to_string()),
                    d.imported_other,
                );
            }
        }
    }

    for g in &report.gpus {
        let l: Labels = vec![
            ("gpu", g.index.to_string()),
            ("UUID", g.uuid.clone()),
            ("device", format!("nvidia{}", g.index)),
            ("Hostname", opts.hostname.clone()),
        ];
        x.add(
            "cistern_gpu_info",
            with(&l, "model_name", g.name.clone()),
            Value::Int(1),
        );
        x.bytes("cistern_gpu_memory_total_bytes", l.clone(), g.total);
        x.bytes("cistern_gpu_memory_used_bytes", l.clone(), g.used);
        x.bytes(
            "cistern_gpu_memory_driver_reserved_bytes",
            l.clone(),
            g.driver_reserved,
        );
        x.bytes("cistern_gpu_memory_processes_bytes", l.clone(), g.processes);
        x.add(
            "cistern_gpu_memory_unattributed_bytes",
            l.clone(),
            Value::Int(g.unattributed),
        );
        x.bytes(
            "cistern_gpu_memory_dead_held_bytes",
            l.clone(),
            dead_held.get(g.uuid.as_str()).copied().unwrap_or(0),
        );
        x.bytes(
            "cistern_gpu_cistern_reserved_bytes",
            l.clone(),
            g.cistern_reserved,
        );
        x.bytes("cistern_gpu_cistern_live_bytes", l.clone(), g.cistern_live);
        x.bytes("cistern_gpu_cistern_cached_bytes", l, g.cistern_cached);
    }

    // Xid errors, counted per GPU (as NVML names it, when the bus id matches), code and
    // severity.
    let xids = xid::recent(&ps::gpu_infos(&snap), ps::XID_WINDOW);
    let mut counts: BTreeMap<Labels, i64> = BTreeMap::new();
    for e in &xids.events {
        let mut l: Labels = Vec::new();
        if let Some(i) = e.gpu_index {
            l.push(("gpu", i.to_string()));
        }
        if let Some(u) = &e.gpu_uuid {
            l.push(("UUID", u.clone()));
        }
        if let Some(i) = e.gpu_index {
            l.push(("device", format!("nvidia{i}")));
        }
        l.push(("Hostname", opts.hostname.clone()));
        if let Some(p) = &e.pci {
            l.push(("pci", p.clone()));
        }
        l.push(("xid", e.xid.to_string()));
        l.push(("severity", e.severity.name().to_string()));
        *counts.entry(l).or_insert(0) += 1;
    }
    for (l, n) in counts {
        x.add("cistern_gpu_xid_errors", l, Value::Int(n));
    }
    x.add(
        "cistern_exporter_kernel_log_up",
        vec![],
        Value::Int(xids.unavailable.is_none() as i64),
    );
    x.add(
        "cistern_exporter_xid_events_left_out",
        vec![],
        Value::Int(xids.left_out as i64),
    );
    x.add(
        "cistern_exporter_build_info",
        vec![("version", env!("CARGO_PKG_VERSION").to_string())],
        Value::Int(1),
    );
    x.add(
        "cistern_exporter_nvml_up",
        vec![],
        Value::Int(report.nvml.available as i64),
    );
    // Each directory this scrape tried to read: read (1) or failing to list (0). Those a
    // node-wide scan refused or may not read are counted, not named (anyone can make
    // directories there: one series each would let them grow the exposition at will).
    for d in &dirs.dirs {
        let up = !gathered_failed.iter().any(|f| f == &d.path);
        x.add(
            "cistern_exporter_registry_dir_up",
            vec![("dir", bounded(&d.path.display().to_string(), MAX_DIR_CHARS))],
            Value::Int(up as i64),
        );
    }
    x.add(
        "cistern_exporter_registry_dirs_refused",
        vec![],
        Value::Int((dirs.refused.len() + dirs.unreadable.len()) as i64),
    );
    x.add(
        "cistern_exporter_records",
        vec![],
        Value::Int(snap.records.len() as i64),
    );
    x.add(
        "cistern_exporter_records_refused",
        vec![],
        Value::Int(snap.refused.len() as i64),
    );
    let dropped = x.dropped as i64;
    x.add(
        "cistern_exporter_series_dropped",
        vec![],
        Value::Int(dropped),
    );
    x.add(
        "cistern_exporter_scrape_duration_seconds",
        vec![],
        Value::Float(started.elapsed().as_secs_f64()),
    );
    x
}

#[cfg(test)]
mod tests;
