//! `cistern ps`: who holds GPU memory. NVML's per-GPU and per-process numbers joined (by GPU
//! UUID, never by index) with the records cistern's processes publish in the registry.
//!
//! Per GPU: used = Σ processes + driver reserved + unattributed. Per process: NVML's used
//! memory = cistern's reserved (live + cached + pending) + overhead (context, kernels,
//! libraries, other allocators). Every record and every NVML process is shown, whatever its
//! state; nothing is dropped silently.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cistern::format_bytes;
use cistern::registry::{self, AttributionRecord, Liveness, Record, State};
use serde::Serialize;

use crate::gpu::{self, GpuInfo, GpuProcess, GpuView, ProcKind};
use crate::table::{self, printable, Align, Table};
use crate::PsArgs;

/// How many tags a process row names.
const TOP_TAGS: usize = 3;

/// Everything the commands read once: the GPUs with their processes, and the registry.
pub struct Snapshot {
    /// The registry directory read.
    pub dir: PathBuf,
    /// Each GPU and the processes NVML lists on it, or why NVML could not be used.
    pub gpus: Result<Vec<(GpuInfo, Vec<GpuProcess>)>, String>,
    /// Readable records with their process's liveness.
    pub records: Vec<(PathBuf, Record, Liveness)>,
    /// Record files that were refused, and why.
    pub refused: Vec<(PathBuf, String)>,
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

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Snapshot {
    /// Reads the GPUs and the registry.
    pub fn take(view: &dyn GpuView, dir: &Path) -> Result<Snapshot, String> {
        let gpus = view.gpus().map(|gs| {
            gs.into_iter()
                .map(|g| {
                    let p = view.processes(&g);
                    (g, p)
                })
                .collect()
        });
        let files = registry::read_all(dir).map_err(|e| e.to_string())?;
        // A directory the library would refuse to publish in (another user's, or open to
        // others) is still read, so that its records can be examined, but never silently: what
        // is in it may have been planted.
        if !files.is_empty() {
            if let Err(e) = registry::check_dir(dir) {
                eprintln!(
                    "cistern: warning: {}; its records may have been written by another user",
                    crate::table::printable(&e.to_string())
                );
            }
        }
        let mut records = Vec::new();
        let mut refused = Vec::new();
        for (path, r) in files {
            match r {
                Ok(rec) => {
                    let l = rec.liveness();
                    records.push((path, rec, l));
                }
                Err(e) => refused.push((path, e.to_string())),
            }
        }
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            gpus,
            records,
            refused,
            now_ms: now_ms(),
        })
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
    /// The registry directory read.
    pub registry_dir: PathBuf,
    /// Per GPU.
    pub gpus: Vec<GpuRow>,
    /// Per process (one row per record, and one per NVML process with no record).
    pub processes: Vec<ProcRow>,
    /// Record files that could not be read.
    pub refused_records: Vec<Refused>,
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
    /// Of `processes`, what cistern's live records hold from the driver.
    pub cistern_reserved: u64,
    pub cistern_live: u64,
    pub cistern_cached: u64,
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
        }
    }

    fn colour(self) -> Option<&'static str> {
        match self {
            PsState::Running => Some(table::GREEN),
            PsState::DeadButMemoryHeld | PsState::Zombie => Some(table::RED),
            PsState::DeadRecordOnly | PsState::PidReused => Some(table::YELLOW),
            PsState::NoRecord => None,
        }
    }
}

/// One process.
#[derive(Debug, Serialize)]
pub struct ProcRow {
    pub pid: u32,
    pub state: PsState,
    /// The recorded process's liveness (none without a record).
    pub liveness: Option<Liveness>,
    /// The record's own state (`running` or `exited`).
    pub record_state: Option<State>,
    pub start_time: Option<u64>,
    pub uid: Option<u32>,
    pub command: String,
    /// When the record was last rewritten (Unix ms).
    pub updated_unix_ms: Option<u64>,
    pub record: Option<PathBuf>,
    /// NVML's total for this pid over all GPUs.
    pub nvml_used: Option<u64>,
    /// Cistern's reserved bytes over all devices.
    pub reserved: u64,
    pub live: u64,
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
    records.sort_by_key(|(_, r, _)| (r.pid, std::cmp::Reverse(r.updated_unix_ms)));
    for (path, r, l) in records {
        let may_claim = nvml_owns(*l);
        let mut devs = Vec::new();
        let mut held = false;
        for d in &r.devices {
            let key = d.uuid.clone().map(|u| (u, r.pid));
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
            });
        }
        // NVML may list the process on GPUs its record does not name (a context with no pool).
        if may_claim {
            for ((uuid, pid), (used, kind)) in &nvml {
                if *pid != r.pid || claimed.contains(&(uuid.clone(), *pid)) {
                    continue;
                }
                claimed.insert((uuid.clone(), *pid));
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
                });
            }
        }
        let state = match l {
            Liveness::Alive => PsState::Running,
            Liveness::Zombie => PsState::Zombie,
            Liveness::Dead if held => PsState::DeadButMemoryHeld,
            Liveness::Dead | Liveness::OtherBoot => PsState::DeadRecordOnly,
            Liveness::PidReused => PsState::PidReused,
        };
        rows.push(ProcRow {
            pid: r.pid,
            state,
            liveness: Some(*l),
            record_state: Some(r.state),
            start_time: Some(r.start_time),
            uid: Some(r.uid),
            command: r.cmdline.join(" "),
            updated_unix_ms: Some(r.updated_unix_ms),
            record: Some(path.clone()),
            nvml_used: sum_opt(devs.iter().map(|d| d.nvml_used)),
            reserved: devs.iter().map(|d| d.reserved).fold(0, u64::saturating_add),
            live: devs.iter().map(|d| d.live).fold(0, u64::saturating_add),
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
            state,
            liveness: None,
            record_state: None,
            start_time: stat.map(|s| s.start_time),
            uid: None,
            command: gpu::command_of(pid),
            updated_unix_ms: None,
            record: None,
            nvml_used: sum_opt(devs.iter().map(|d| d.nvml_used)),
            reserved: 0,
            live: 0,
            gpus: devs,
        });
    }
    rows.sort_by_key(|r| (r.state, r.pid, std::cmp::Reverse(r.updated_unix_ms)));

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
                .flat_map(|r| r.gpus.iter())
                .filter(|d| d.uuid.as_deref() == Some(g.uuid.as_str()));
            // Records are untrusted input: sums saturate rather than overflow.
            let (mut cr, mut cl, mut cc) = (0u64, 0u64, 0u64);
            for d in mine {
                cr = cr.saturating_add(d.reserved);
                cl = cl.saturating_add(d.live);
                cc = cc.saturating_add(d.cached);
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
        gpus: gpu_rows,
        processes: rows,
        refused_records: s
            .refused
            .iter()
            .map(|(p, e)| Refused {
                path: p.clone(),
                error: e.clone(),
            })
            .collect(),
    }
}

fn sum_opt(it: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    it.fold(None, |acc, x| match (acc, x) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    })
}

fn signed_bytes(v: i64) -> String {
    if v < 0 {
        format!("-{}", format_bytes(v.unsigned_abs()))
    } else {
        format_bytes(v as u64)
    }
}

fn opt_bytes(v: Option<u64>) -> String {
    v.map(format_bytes).unwrap_or_else(|| "-".into())
}

/// Renders the document as tables.
pub fn render(r: &PsReport, colour: bool) -> String {
    let mut out = String::new();
    if let Some(e) = &r.nvml.error {
        out.push_str(&format!(
            "{}\nshowing cistern's registry alone ({})\n\n",
            printable(e),
            printable(&r.registry_dir.display().to_string())
        ));
    }
    if !r.gpus.is_empty() {
        let mut t = Table::new(&[
            ("gpu", Align::Right),
            ("name", Align::Left),
            ("used", Align::Right),
            ("total", Align::Right),
            ("processes", Align::Right),
            ("driver", Align::Right),
            ("unattributed", Align::Right),
            ("cistern reserved", Align::Right),
            ("mode", Align::Left),
            ("mps", Align::Left),
            ("mig", Align::Left),
        ]);
        for g in &r.gpus {
            t.row_coloured(vec![
                (g.index.to_string(), None),
                (g.name.clone(), None),
                (format_bytes(g.used), None),
                (format_bytes(g.total), None),
                (format_bytes(g.processes), None),
                (format_bytes(g.driver_reserved), None),
                (signed_bytes(g.unattributed), None),
                (format_bytes(g.cistern_reserved), None),
                (g.compute_mode.clone(), None),
                ((if g.mps { "yes" } else { "no" }).into(), None),
                (g.mig.clone().unwrap_or_else(|| "-".into()), None),
            ]);
        }
        out.push_str(&t.render(colour));
        out.push('\n');
    }
    if r.processes.is_empty() {
        out.push_str("no processes: NVML lists none and the registry holds no record\n");
    } else {
        let mut t = Table::new(&[
            ("pid", Align::Right),
            ("state", Align::Left),
            ("gpu", Align::Right),
            ("nvml used", Align::Right),
            ("reserved", Align::Right),
            ("live", Align::Right),
            ("cached", Align::Right),
            ("overhead", Align::Right),
            ("top tags", Align::Left),
            ("command", Align::Left),
        ]);
        for p in &r.processes {
            let state = (p.state.name().to_string(), p.state.colour());
            let command: String = p.command.chars().take(60).collect();
            if p.gpus.is_empty() {
                t.row_coloured(vec![
                    (p.pid.to_string(), None),
                    state,
                    ("-".into(), None),
                    (opt_bytes(p.nvml_used), None),
                    (format_bytes(p.reserved), None),
                    (format_bytes(p.live), None),
                    ("-".into(), None),
                    ("-".into(), None),
                    (String::new(), None),
                    (command, None),
                ]);
                continue;
            }
            for (i, d) in p.gpus.iter().enumerate() {
                let gpu = match (d.gpu_index, &d.uuid) {
                    (Some(i), _) => i.to_string(),
                    (None, Some(u)) => u.chars().take(12).collect(),
                    (None, None) => d.device.map(|d| format!("dev{d}?")).unwrap_or_default(),
                };
                let tags = d
                    .top_tags
                    .iter()
                    .map(|a| {
                        let name = if a.name.is_empty() {
                            "(untagged)"
                        } else {
                            &a.name
                        };
                        format!("{name} {}", format_bytes(a.bytes))
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                let first = i == 0;
                t.row_coloured(vec![
                    (
                        if first {
                            p.pid.to_string()
                        } else {
                            String::new()
                        },
                        None,
                    ),
                    if first {
                        state.clone()
                    } else {
                        (String::new(), None)
                    },
                    (gpu, None),
                    (opt_bytes(d.nvml_used), None),
                    (format_bytes(d.reserved), None),
                    (format_bytes(d.live), None),
                    (format_bytes(d.cached), None),
                    (
                        d.overhead.map(signed_bytes).unwrap_or_else(|| "-".into()),
                        None,
                    ),
                    (tags, None),
                    (
                        if first {
                            command.clone()
                        } else {
                            String::new()
                        },
                        None,
                    ),
                ]);
            }
        }
        out.push_str(&t.render(colour));
    }
    for f in &r.refused_records {
        out.push_str(&format!(
            "record {} refused: {}\n",
            printable(&f.path.display().to_string()),
            printable(&f.error)
        ));
    }
    out
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
    let dir = registry_dir(args.registry_dir.as_deref())?;
    let colour = table::use_colour();
    let mut n = 0u64;
    loop {
        let snap = Snapshot::take(view.as_ref(), &dir)?;
        let report = build(&snap);
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
