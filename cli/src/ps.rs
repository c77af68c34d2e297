//! `cistern ps`: who holds GPU memory. NVML's per-GPU and per-process numbers joined (by GPU
//! UUID, never by index) with the records cistern's processes publish in the registry.
//!
//! Per GPU: used = Σ processes + driver reserved + unattributed. Per process: NVML's used
//! memory = cistern's reserved (live + cached + pending) + overhead (context, kernels,
//! libraries, other allocators). Every record and every NVML process is shown, whatever its
//! state; nothing is dropped silently (records of exited processes expire: `registry_expire`).
//! Processes on the simulated GPU are marked; a process in a container is shown by the pid the
//! reader sees (the host's), with its container; the last OOM report of each process and the
//! driver's recent Xid errors follow the table. `--all-users` reads every user's registry
//! ([`crate::registry_dirs`]).
//!
//! This file gathers and joins ([`Snapshot`], [`build`]); `render` (beside it) writes the
//! report as text.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cistern::format_bytes;
use cistern::registry::{
    self, AttributionRecord, ImportRecord, Liveness, OomRecord, Record, State,
};
use serde::Serialize;

use crate::gpu::{self, GpuInfo, GpuProcess, GpuView, ProcKind};
use crate::registry_dirs::{Dirs, SkippedDir};
use crate::table::{self, printable, Align, Table};
use crate::xid::XidReport;
use crate::PsArgs;

mod imports;
mod render;
mod trust;
use imports::import_rows;
pub use imports::ImportRow;
pub use render::{oom_line, render};
pub use trust::doubt;
use trust::{impostor, named_uid};

/// How many tags a process row names.
const TOP_TAGS: usize = 3;

/// Everything the commands read once: the GPUs with their processes, and the registry.
pub struct Snapshot {
    /// The registry directory read first (the only one, unless node-wide).
    pub dir: PathBuf,
    /// Every directory read, and those refused or unreadable.
    pub dirs: Dirs,
    /// Each GPU and the processes NVML lists on it, or why NVML could not be used.
    pub gpus: Result<Vec<(GpuInfo, Vec<GpuProcess>)>, String>,
    /// Readable records with their process's liveness.
    pub records: Vec<(PathBuf, Record, Liveness)>,
    /// Record files that were refused, and why.
    pub refused: Vec<(PathBuf, String)>,
    /// The pid, in this reader's pid namespace, of each record's process that is visible here
    /// (by record path): the host pid of a process in a container, when the reader is on the
    /// host. NVML lists processes by this pid.
    pub pids: HashMap<PathBuf, u32>,
    /// Records removed as expired ([`Snapshot::expire`]).
    pub expired: Vec<PathBuf>,
    /// When the snapshot was taken (Unix ms).
    pub now_ms: u64,
}

/// The registry directory: `--registry-dir`, else `CISTERN_CONF`'s `registry_dir`, else the
/// default. An invalid `CISTERN_CONF` is an error (reading the default registry instead would
/// show other processes than the ones the setting names, without a word).
pub fn registry_dir(arg: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(d) = arg {
        return Ok(d.to_path_buf());
    }
    match cistern::Config::from_env() {
        Ok(c) => Ok(c.registry_dir.unwrap_or_else(registry::default_dir)),
        Err(e) => Err(format!(
            "{e}\n(the registry directory is read from CISTERN_CONF: fix it, or name the \
             directory with --registry-dir)"
        )),
    }
}

/// How long exited processes' records stay (`CISTERN_CONF`'s `registry_expire`, default one
/// hour). An invalid `CISTERN_CONF` removes nothing (the commands that need it say so).
pub fn registry_expire() -> Option<Duration> {
    cistern::Config::from_env()
        .ok()
        .and_then(|c| c.registry_expire)
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What [`Snapshot::gather`] found besides the snapshot.
pub struct Gathered {
    /// The GPUs and the records.
    pub snapshot: Snapshot,
    /// Directories that could not be read (also in the snapshot's `dirs.refused`).
    pub failed: Vec<SkippedDir>,
    /// Directories named by the caller that were read although the library would refuse them,
    /// and why (their records may have been written by another user).
    pub doubts: Vec<(PathBuf, String)>,
}

impl Snapshot {
    /// Reads the GPUs and one registry directory (see [`Snapshot::take_dirs`]).
    pub fn take(view: &dyn GpuView, dir: &Path) -> Result<Snapshot, String> {
        Snapshot::take_dirs(view, &Dirs::one(dir.to_path_buf()))
    }

    /// Reads the GPUs and every directory of `dirs` ([`crate::registry_dirs::registry_dirs`]).
    ///
    /// A directory named by the caller (no uid: `--registry-dir`, `CISTERN_CONF`) that is a
    /// symlink or cannot be listed is an error; one the library would refuse to publish in
    /// (another user's, or open to others) is read with a warning. A directory found node-wide
    /// was checked already; if reading it fails now, it joins `dirs.refused`.
    pub fn take_dirs(view: &dyn GpuView, dirs: &Dirs) -> Result<Snapshot, String> {
        let g = Snapshot::gather(view, dirs);
        if let Some(f) = g.failed.iter().find(|f| f.uid.is_none()) {
            return Err(f.reason.clone());
        }
        for (dir, why) in &g.doubts {
            eprintln!(
                "cistern: warning: registry directory {}: {}",
                printable(&dir.display().to_string()),
                printable(why)
            );
        }
        Ok(g.snapshot)
    }

    /// Reads the GPUs and every directory of `dirs`, printing nothing and failing on nothing:
    /// the snapshot, with the directories that could not be read moved to `dirs.refused` (and
    /// listed in [`Gathered::failed`]), and the doubts about directories that were read anyway
    /// ([`doubt`]). The one-shot commands ([`Snapshot::take_dirs`]) and the exporter (which
    /// must not repeat a warning on every scrape) decide what to do with them.
    pub fn gather(view: &dyn GpuView, dirs: &Dirs) -> Gathered {
        let gpus = view.gpus().map(|gs| {
            gs.into_iter()
                .map(|g| {
                    let p = view.processes(&g);
                    (g, p)
                })
                .collect()
        });
        let mut dirs = dirs.clone();
        let mut files = Vec::new();
        let mut failed = Vec::new();
        let mut doubts = Vec::new();
        for d in &dirs.dirs {
            match registry::read_all(&d.path) {
                Ok(f) => {
                    // What is in a directory the library would refuse may have been planted.
                    if d.uid.is_none() && !f.is_empty() {
                        if let Some(why) = doubt(&d.path) {
                            doubts.push((d.path.clone(), why));
                        }
                    }
                    // Whose records these must be: the uid a node-wide scan found the directory
                    // under, or the one a `cistern-<uid>` name gives.
                    let owner = d.uid.or_else(|| named_uid(&d.path));
                    files.extend(f.into_iter().map(|(p, r)| (p, r, owner)));
                }
                Err(e) => failed.push(SkippedDir {
                    path: d.path.clone(),
                    uid: d.uid,
                    reason: e.to_string(),
                }),
            }
        }
        dirs.dirs
            .retain(|d| !failed.iter().any(|f| f.path == d.path));
        dirs.refused.extend(failed.iter().cloned());
        let mut records = Vec::new();
        let mut refused = Vec::new();
        let mut pids = HashMap::new();
        let mut resolver = registry::PidResolver::new();
        for (path, r, dir_uid) in files {
            match r {
                Ok(rec) => {
                    let (l, pid) = rec.liveness_with(&mut resolver);
                    if let Some(why) = dir_uid.and_then(|u| impostor(&path, &rec, l, pid, u)) {
                        refused.push((path, why));
                        continue;
                    }
                    if let Some(pid) = pid {
                        pids.insert(path.clone(), pid);
                    }
                    records.push((path, rec, l));
                }
                Err(e) => refused.push((path, e.to_string())),
            }
        }
        Gathered {
            snapshot: Snapshot {
                dir: dirs
                    .dirs
                    .first()
                    .map(|d| d.path.clone())
                    .unwrap_or_default(),
                dirs,
                gpus,
                records,
                refused,
                pids,
                expired: Vec::new(),
                now_ms: now_ms(),
            },
            failed,
            doubts,
        }
    }

    /// The pid of a record's process in this reader's namespace, when it is visible here.
    pub fn pid_of(&self, record: &Path) -> Option<u32> {
        self.pids.get(record).copied()
    }

    /// Removes the expired records of exited processes (`registry_expire`, see
    /// [`registry::expire_records`]) from the directories this user owns, except those of
    /// processes NVML lists (they hold memory), and drops them from the snapshot. `None`
    /// removes nothing.
    pub fn expire(&mut self, max_age: Option<Duration>) {
        let Some(age) = max_age else {
            return;
        };
        let nvml: HashSet<u32> = self.nvml_processes().keys().map(|k| k.1).collect();
        let held: HashSet<(u32, u64)> = self
            .records
            .iter()
            .filter(|(p, r, _)| nvml.contains(&self.pid_of(p).unwrap_or(r.pid)))
            .map(|(_, r, _)| (r.pid, r.start_time))
            .collect();
        let holds = |r: &Record| held.contains(&(r.pid, r.start_time)) || nvml.contains(&r.pid);
        let mut removed = Vec::new();
        for d in &self.dirs.dirs {
            removed.extend(registry::expire_records(&d.path, age, self.now_ms, &holds));
        }
        self.records.retain(|(p, _, _)| !removed.contains(p));
        self.expired.extend(removed);
    }

    /// NVML's processes merged per (GPU UUID, pid): a process with compute and graphics
    /// contexts is one entry (its memory is reported once per context type, the same bytes).
    pub fn nvml_processes(&self) -> BTreeMap<(String, u32), (Option<u64>, String)> {
        let mut out: BTreeMap<(String, u32), (Option<u64>, String)> = BTreeMap::new();
        if let Ok(gpus) = &self.gpus {
            for (g, procs) in gpus {
                for p in procs {
                    let kind = match p.kind {
                        ProcKind::Compute => "C",
                        ProcKind::Graphics => "G",
                    };
                    let e = out
                        .entry((g.uuid.clone(), p.pid))
                        .or_insert((p.used_bytes, String::new()));
                    e.0 = match (e.0, p.used_bytes) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                    if !e.1.split('+').any(|k| k == kind) {
                        if !e.1.is_empty() {
                            e.1.push('+');
                        }
                        e.1.push_str(kind);
                    }
                }
            }
        }
        out
    }
}

/// The `ps` document.
#[derive(Debug, Serialize)]
pub struct PsReport {
    /// Whether NVML answered, and why not.
    pub nvml: NvmlStatus,
    /// The registry directory read (the first, when several were).
    pub registry_dir: PathBuf,
    /// Every registry directory read.
    pub registry_dirs: Vec<PathBuf>,
    /// Directories found (`--all-users`) but refused: wrong owner, open mode, a symlink.
    pub refused_registry_dirs: Vec<SkippedDir>,
    /// Directories found but not readable by this user.
    pub unreadable_registry_dirs: Vec<SkippedDir>,
    /// Per GPU.
    pub gpus: Vec<GpuRow>,
    /// Per process (one row per record, and one per NVML process with no record).
    pub processes: Vec<ProcRow>,
    /// Memory processes map from other processes' pools (CUDA tensors they received), per
    /// receiver, device and sender, most bytes first.
    pub imports: Vec<ImportRow>,
    /// Record files that could not be read.
    pub refused_records: Vec<Refused>,
    /// Records of exited processes removed as expired (`registry_expire`) by this run.
    pub expired_records: Vec<PathBuf>,
    /// The GPU driver's recent Xid errors (from the kernel log), when they were looked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xid: Option<XidReport>,
}

#[derive(Debug, Serialize)]
pub struct NvmlStatus {
    pub available: bool,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Refused {
    pub path: PathBuf,
    pub error: String,
}

/// One GPU: used = processes + driver_reserved + unattributed.
#[derive(Debug, Serialize)]
pub struct GpuRow {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total: u64,
    pub free: u64,
    /// total - free.
    pub used: u64,
    /// Σ of NVML's per-process used memory.
    pub processes: u64,
    /// Set aside by the driver (0 when unknown).
    pub driver_reserved: u64,
    /// used - processes - driver_reserved (negative when NVML's numbers disagree).
    pub unattributed: i64,
    /// Of `processes`, what cistern's live records hold from the driver (simulated processes
    /// not counted).
    pub cistern_reserved: u64,
    pub cistern_live: u64,
    pub cistern_cached: u64,
    pub cistern_pending: u64,
    pub compute_mode: String,
    pub mps: bool,
    pub mig: Option<String>,
}

/// A process's state, as `ps` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PsState {
    /// Alive (its record's pid and start time match a running process).
    Running,
    /// Exited, not reaped by its parent.
    Zombie,
    /// Dead, but NVML still lists its pid with memory (the driver has not cleaned up, or a
    /// child keeps the context alive).
    DeadButMemoryHeld,
    /// Dead; only its record remains.
    DeadRecordOnly,
    /// Its pid now belongs to another process; the recorded one is dead.
    PidReused,
    /// NVML lists it, but it publishes no record (it does not use cistern, or its registry is
    /// elsewhere).
    NoRecord,
    /// Its record is from a pid namespace this reader cannot see (another container's, read
    /// without the host's pid namespace): it may be running. Run on the host (or with
    /// `hostPID`) to know.
    NotVisible,
}

impl PsState {
    pub fn name(self) -> &'static str {
        match self {
            PsState::Running => "running",
            PsState::Zombie => "zombie",
            PsState::DeadButMemoryHeld => "dead-but-memory-held",
            PsState::DeadRecordOnly => "dead-record-only",
            PsState::PidReused => "pid-reused",
            PsState::NoRecord => "no-record",
            PsState::NotVisible => "not-visible",
        }
    }

    fn colour(self) -> Option<&'static str> {
        match self {
            PsState::Running => Some(table::GREEN),
            PsState::DeadButMemoryHeld | PsState::Zombie => Some(table::RED),
            PsState::DeadRecordOnly | PsState::PidReused => Some(table::YELLOW),
            PsState::NoRecord | PsState::NotVisible => None,
        }
    }
}

/// One process.
#[derive(Debug, Serialize)]
pub struct ProcRow {
    /// The pid in this reader's namespace (the host's, for a process in a container seen from
    /// the host): the one NVML, `kill` and `nvidia-smi` use.
    pub pid: u32,
    /// The pid the process saw itself, when it differs (it runs in another pid namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_pid: Option<u32>,
    /// Whether the record was written on the simulated GPU (its devices hold no memory).
    pub simulated: bool,
    pub state: PsState,
    /// The recorded process's liveness (none without a record).
    pub liveness: Option<Liveness>,
    /// The record's own state (`running` or `exited`).
    pub record_state: Option<State>,
    pub start_time: Option<u64>,
    pub uid: Option<u32>,
    /// The pid namespace the record's process ran in, when the record says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid_ns: Option<u64>,
    pub command: String,
    /// When the record was last rewritten (Unix ms).
    pub updated_unix_ms: Option<u64>,
    pub record: Option<PathBuf>,
    /// NVML's total for this pid over all GPUs.
    pub nvml_used: Option<u64>,
    /// Cistern's reserved bytes over all devices: live + cached + pending.
    pub reserved: u64,
    pub live: u64,
    pub cached: u64,
    /// Freed bytes waiting on other streams' work.
    pub pending: u64,
    /// The cgroup, container, pod and runtime the record names.
    pub cgroup: Option<String>,
    pub container_id: Option<String>,
    pub pod_uid: Option<String>,
    pub runtime: Option<String>,
    /// The process's last out-of-memory report, from its record.
    pub last_oom: Option<OomRecord>,
    pub gpus: Vec<ProcGpu>,
}

/// One process on one device.
#[derive(Debug, Serialize)]
pub struct ProcGpu {
    /// The physical GPU's UUID (from the record, or NVML).
    pub uuid: Option<String>,
    /// NVML's index of that GPU, when NVML knows it.
    pub gpu_index: Option<u32>,
    /// The process's own device ordinal (after `CUDA_VISIBLE_DEVICES`), from the record.
    pub device: Option<u32>,
    /// NVML's used memory for the pid on this GPU.
    pub nvml_used: Option<u64>,
    /// `C`, `G` or `C+G`, when NVML lists it.
    pub kind: Option<String>,
    pub reserved: u64,
    pub live: u64,
    pub cached: u64,
    pub pending: u64,
    /// nvml_used - reserved: context, kernels, libraries, other allocators.
    pub overhead: Option<i64>,
    pub top_tags: Vec<AttributionRecord>,
    /// Memory the process maps from other processes (received CUDA tensors), by sender: not in
    /// `reserved` (the sender's), kept alive by this process even after the sender exits.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub imported: Vec<ImportRecord>,
    /// Bytes mapped from senders beyond those `imported` names (a record names the largest
    /// [`registry::MAX_TOP`]).
    #[serde(skip_serializing_if = "is_zero")]
    pub imported_other: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Whether NVML's listing of `pid` belongs to the process a record describes.
fn nvml_owns(l: Liveness) -> bool {
    matches!(l, Liveness::Alive | Liveness::Zombie | Liveness::Dead)
}

/// Builds the `ps` document.
pub fn build(s: &Snapshot) -> PsReport {
    let nvml = s.nvml_processes();
    let gpus: &[(GpuInfo, Vec<GpuProcess>)] = s.gpus.as_deref().unwrap_or(&[]);
    let index_of: HashMap<&str, u32> = gpus
        .iter()
        .map(|(g, _)| (g.uuid.as_str(), g.index))
        .collect();
    let mut claimed: std::collections::HashSet<(String, u32)> = Default::default();
    let mut rows = Vec::new();

    // The newest record of a pid claims NVML's entries for it; older ones (pid reused, or
    // stale duplicates) do not.
    let mut records: Vec<&(PathBuf, Record, Liveness)> = s.records.iter().collect();
    let vpid = |path: &Path, r: &Record| s.pid_of(path).unwrap_or(r.pid);
    records.sort_by_key(|(p, r, _)| (vpid(p, r), std::cmp::Reverse(r.updated_unix_ms)));
    for (path, r, l) in records {
        let pid = vpid(path, r);
        // A simulated process's devices are not NVML's GPUs, whatever their UUIDs look like.
        // A record whose pid could not be put in this reader's namespace (a dead container
        // process, read on the host) names a pid of its own namespace: NVML's pids are the
        // host's, and the same number there is another process.
        let may_claim = nvml_owns(*l) && !r.simulated() && s.pid_of(path).is_some();
        let mut devs = Vec::new();
        let mut held = false;
        for d in &r.devices {
            let key = d.uuid.clone().map(|u| (u, pid));
            let entry = key
                .as_ref()
                .filter(|k| may_claim && !claimed.contains(*k))
                .and_then(|k| nvml.get(k));
            if let (Some(k), Some(_)) = (&key, entry) {
                claimed.insert(k.clone());
                held = true;
            }
            let nvml_used = entry.and_then(|e| e.0);
            devs.push(ProcGpu {
                uuid: d.uuid.clone(),
                gpu_index: d.uuid.as_deref().and_then(|u| index_of.get(u).copied()),
                device: Some(d.index),
                nvml_used,
                kind: entry.map(|e| e.1.clone()),
                reserved: d.reserved,
                live: d.live,
                cached: d.cached,
                pending: d.pending,
                overhead: nvml_used.map(|u| u as i64 - d.reserved as i64),
                top_tags: d.top_tags.iter().take(TOP_TAGS).cloned().collect(),
                imported: d.imported.clone(),
                imported_other: d.imported_other,
            });
        }
        // NVML may list the process on GPUs its record does not name (a context with no pool).
        if may_claim {
            for ((uuid, npid), (used, kind)) in &nvml {
                if *npid != pid || claimed.contains(&(uuid.clone(), *npid)) {
                    continue;
                }
                claimed.insert((uuid.clone(), *npid));
                held = true;
                devs.push(ProcGpu {
                    uuid: Some(uuid.clone()),
                    gpu_index: index_of.get(uuid.as_str()).copied(),
                    device: None,
                    nvml_used: *used,
                    kind: Some(kind.clone()),
                    reserved: 0,
                    live: 0,
                    cached: 0,
                    pending: 0,
                    overhead: used.map(|u| u as i64),
                    top_tags: Vec::new(),
                    imported: Vec::new(),
                    imported_other: 0,
                });
            }
        }
        let state = match l {
            Liveness::Alive => PsState::Running,
            Liveness::Zombie => PsState::Zombie,
            Liveness::Dead if held => PsState::DeadButMemoryHeld,
            Liveness::Dead | Liveness::OtherBoot => PsState::DeadRecordOnly,
            Liveness::PidReused => PsState::PidReused,
            Liveness::Unseen => PsState::NotVisible,
        };
        let sum = |f: fn(&ProcGpu) -> u64| devs.iter().map(f).fold(0, u64::saturating_add);
        rows.push(ProcRow {
            pid,
            container_pid: (pid != r.pid).then_some(r.pid),
            simulated: r.simulated(),
            state,
            liveness: Some(*l),
            record_state: Some(r.state),
            start_time: Some(r.start_time),
            uid: Some(r.uid),
            pid_ns: r.pid_ns,
            command: r.cmdline.join(" "),
            updated_unix_ms: Some(r.updated_unix_ms),
            record: Some(path.clone()),
            nvml_used: sum_opt(devs.iter().map(|d| d.nvml_used)),
            reserved: sum(|d| d.reserved),
            live: sum(|d| d.live),
            cached: sum(|d| d.cached),
            pending: sum(|d| d.pending),
            cgroup: r.cgroup.clone(),
            container_id: r.container_id.clone(),
            pod_uid: r.pod_uid.clone(),
            runtime: r.runtime.clone(),
            last_oom: r.last_oom.clone(),
            gpus: devs,
        });
    }

    // NVML processes no record claimed.
    let mut unclaimed: BTreeMap<u32, Vec<ProcGpu>> = BTreeMap::new();
    for ((uuid, pid), (used, kind)) in &nvml {
        if claimed.contains(&(uuid.clone(), *pid)) {
            continue;
        }
        unclaimed.entry(*pid).or_default().push(ProcGpu {
            uuid: Some(uuid.clone()),
            gpu_index: index_of.get(uuid.as_str()).copied(),
            device: None,
            nvml_used: *used,
            kind: Some(kind.clone()),
            reserved: 0,
            live: 0,
            cached: 0,
            pending: 0,
            overhead: None,
            top_tags: Vec::new(),
            imported: Vec::new(),
            imported_other: 0,
        });
    }
    for (pid, devs) in unclaimed {
        let stat = gpu::proc_stat(pid);
        let state = match stat {
            Some(st) if st.state == 'Z' || st.state == 'X' => PsState::Zombie,
            Some(_) => PsState::NoRecord,
            None if gpu::pid_exists(pid) => PsState::NoRecord,
            None => PsState::DeadButMemoryHeld,
        };
        rows.push(ProcRow {
            pid,
            container_pid: None,
            simulated: false,
            state,
            liveness: None,
            record_state: None,
            start_time: stat.map(|s| s.start_time),
            uid: None,
            pid_ns: None,
            command: gpu::command_of(pid),
            updated_unix_ms: None,
            record: None,
            nvml_used: sum_opt(devs.iter().map(|d| d.nvml_used)),
            reserved: 0,
            live: 0,
            cached: 0,
            pending: 0,
            cgroup: None,
            container_id: None,
            pod_uid: None,
            runtime: None,
            last_oom: None,
            gpus: devs,
        });
    }
    rows.sort_by_key(|r| (r.state, r.pid, std::cmp::Reverse(r.updated_unix_ms)));
    let imports = import_rows(&rows);

    let gpu_rows = gpus
        .iter()
        .map(|(g, _)| {
            let processes: u64 = nvml
                .iter()
                .filter(|((u, _), _)| *u == g.uuid)
                .filter_map(|(_, (b, _))| *b)
                .fold(0, u64::saturating_add);
            let driver_reserved = g.reserved.unwrap_or(0);
            let used = g.total.saturating_sub(g.free);
            let mine = rows
                .iter()
                .filter(|r| r.state == PsState::Running || r.state == PsState::Zombie)
                .filter(|r| !r.simulated)
                .flat_map(|r| r.gpus.iter())
                .filter(|d| d.uuid.as_deref() == Some(g.uuid.as_str()));
            // Records are untrusted input: sums saturate rather than overflow.
            let (mut cr, mut cl, mut cc, mut cp) = (0u64, 0u64, 0u64, 0u64);
            for d in mine {
                cr = cr.saturating_add(d.reserved);
                cl = cl.saturating_add(d.live);
                cc = cc.saturating_add(d.cached);
                cp = cp.saturating_add(d.pending);
            }
            GpuRow {
                index: g.index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                total: g.total,
                free: g.free,
                used,
                processes,
                driver_reserved,
                unattributed: used as i64 - processes as i64 - driver_reserved as i64,
                cistern_reserved: cr,
                cistern_live: cl,
                cistern_cached: cc,
                cistern_pending: cp,
                compute_mode: g.compute_mode.clone(),
                mps: g.mps,
                mig: g.mig.clone(),
            }
        })
        .collect();

    PsReport {
        nvml: NvmlStatus {
            available: s.gpus.is_ok(),
            error: s.gpus.as_ref().err().cloned(),
        },
        registry_dir: s.dir.clone(),
        registry_dirs: s.dirs.paths(),
        refused_registry_dirs: s.dirs.refused.clone(),
        unreadable_registry_dirs: s.dirs.unreadable.clone(),
        gpus: gpu_rows,
        processes: rows,
        imports,
        refused_records: s
            .refused
            .iter()
            .map(|(p, e)| Refused {
                path: p.clone(),
                error: e.clone(),
            })
            .collect(),
        expired_records: s.expired.clone(),
        xid: None,
    }
}

fn sum_opt(it: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    it.fold(None, |acc, x| match (acc, x) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    })
}

/// How far back `ps` and `doctor` look for Xid errors.
pub const XID_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// The GPUs of a snapshot (for naming Xid errors' devices).
pub fn gpu_infos(s: &Snapshot) -> Vec<GpuInfo> {
    s.gpus
        .as_ref()
        .map(|g| g.iter().map(|(i, _)| i.clone()).collect())
        .unwrap_or_default()
}

/// The shortest and longest watch-mode interval `-i` takes, in seconds.
const INTERVAL_RANGE: (f64, f64) = (0.01, 86_400.0);

/// The watch-mode interval: `-i SECONDS` must be a finite number of seconds from 0.01 to 86400
/// (one day), so that it converts to a [`Duration`].
fn watch_interval(secs: Option<f64>) -> Result<Option<Duration>, String> {
    let Some(secs) = secs else {
        return Ok(None);
    };
    let (lo, hi) = INTERVAL_RANGE;
    if !(lo..=hi).contains(&secs) {
        return Err(format!(
            "-i/--interval {secs}: expected a number of seconds from {lo} to {hi} (one day), \
             e.g. `-i 2`; leave it out to print once"
        ));
    }
    Ok(Some(Duration::from_secs_f64(secs)))
}

pub fn run(args: &PsArgs) -> Result<(), String> {
    let watch = watch_interval(args.interval)?;
    let view = gpu::from_env()?;
    let dirs = crate::registry_dirs::registry_dirs(args.registry_dir.as_deref(), args.all_users)?;
    let expire = registry_expire();
    let colour = table::use_colour();
    let mut n = 0u64;
    loop {
        let mut snap = Snapshot::take_dirs(view.as_ref(), &dirs)?;
        snap.expire(expire);
        let mut report = build(&snap);
        report.xid = Some(crate::xid::recent(&gpu_infos(&snap), XID_WINDOW));
        if args.json {
            let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
            if watch.is_some() {
                // One document per line, for a stream of them.
                println!(
                    "{}",
                    serde_json::to_string(&report).map_err(|e| e.to_string())?
                );
            } else {
                println!("{text}");
            }
        } else {
            if watch.is_some() && colour {
                print!("\x1b[2J\x1b[H");
            } else if n > 0 {
                println!();
            }
            print!("{}", render(&report, colour));
        }
        n += 1;
        let Some(interval) = watch else {
            return Ok(());
        };
        if args.iterations.is_some_and(|max| n >= max) {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}
