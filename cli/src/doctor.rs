//! `cistern doctor`: health checks for a shared GPU host. Finds orphaned GPU contexts (NVML
//! pids that no longer exist), zombies holding GPU memory, processes that hold `/dev/nvidia*`
//! after their process group's leader died (data-loader workers of a killed job), stale
//! records of killed processes, unsafe registry directories (`--all-users`), and the GPU
//! driver's recent Xid errors (fatal ones need attention). A process that exited cleanly is
//! information, never attention: a node where every process exited cleanly is healthy. It
//! suggests; it never kills, and removes nothing but records: expired ones of exited processes
//! (`registry_expire`), and stale ones only with `--clean-stale`, in this user's directories.
//!
//! Exit status: 0 healthy, 1 something needs attention, 2 error.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use cistern::format_bytes;
use cistern::registry::{self, Liveness, State};
use serde::Serialize;

use crate::gpu;
use crate::ps::{self, PsState, Snapshot};
use crate::table::{self, printable};
use crate::xid::{XidReport, XidSeverity};
use crate::DoctorArgs;

/// How serious a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Counts against health (exit status 1).
    Attention,
    /// Worth knowing; does not.
    Info,
}

/// One finding.
#[derive(Debug, Serialize)]
pub struct Finding {
    /// `orphaned-context`, `zombie-context`, `orphaned-holder`, `stale-record`,
    /// `recently-dead`, `exited`, `exited-with-leaks`, `refused-record`,
    /// `refused-registry-dir`, `registry-dir-unreadable`, `xid`, `xid-unavailable`,
    /// `nvml-unavailable`, `holders-unreadable`, `imported-from-dead`.
    pub kind: &'static str,
    pub severity: Severity,
    pub pid: Option<u32>,
    pub gpu: Option<String>,
    pub bytes: Option<u64>,
    pub record: Option<PathBuf>,
    pub message: String,
    pub suggestion: String,
    /// Whether `--clean-stale` removed the record.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cleaned: bool,
}

/// The `doctor` document.
#[derive(Debug, Serialize)]
pub struct DoctorReport {
    pub healthy: bool,
    pub nvml_available: bool,
    /// The registry directory read (the first, when several were).
    pub registry_dir: PathBuf,
    /// Every registry directory read.
    pub registry_dirs: Vec<PathBuf>,
    pub grace_seconds: f64,
    pub findings: Vec<Finding>,
    /// Records of exited processes removed as expired (`registry_expire`) by this run.
    pub expired_records: Vec<PathBuf>,
    /// The GPU driver's recent Xid errors, when they were looked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xid: Option<XidReport>,
}

fn finding(kind: &'static str, severity: Severity, message: String, suggestion: &str) -> Finding {
    Finding {
        kind,
        severity,
        pid: None,
        gpu: None,
        bytes: None,
        record: None,
        message,
        suggestion: suggestion.to_string(),
        cleaned: false,
    }
}

/// Examines a snapshot (and the kernel log's Xid errors, when given); with `clean`, removes
/// stale records.
pub fn examine(s: &Snapshot, grace_ms: u64, clean: bool, xid: Option<&XidReport>) -> DoctorReport {
    let psr = ps::build(s);
    let mut out = Vec::new();
    if let Err(e) = &s.gpus {
        out.push(finding(
            "nvml-unavailable",
            Severity::Info,
            format!("{e}: GPU contexts not checked, only the registry and /dev/nvidia* holders"),
            "run where libnvidia-ml.so.1 can be loaded to check GPU contexts",
        ));
    }
    let mut dead_pids: HashSet<u32> = HashSet::new();
    // Records whose memory other processes map (senders of received CUDA tensors).
    let senders: HashSet<&std::path::Path> = psr
        .imports
        .iter()
        .filter_map(|i| i.from_record.as_deref())
        .collect();
    for p in &psr.processes {
        let gpu_names = p
            .gpus
            .iter()
            .filter(|d| d.nvml_used.is_some() || d.kind.is_some())
            .map(|d| {
                d.gpu_index
                    .map(|i| format!("GPU {i}"))
                    .or_else(|| d.uuid.clone())
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join(", ");
        let held = p.nvml_used;
        match p.state {
            PsState::DeadButMemoryHeld => {
                dead_pids.insert(p.pid);
                // An Xid naming the pid explains the crash: say so here, in one place.
                let named = xid
                    .map(|x| {
                        x.events
                            .iter()
                            .filter(|e| e.pid == Some(p.pid))
                            .map(|e| {
                                format!(
                                    "; the driver logged Xid {} for it: {}",
                                    e.xid,
                                    e.meaning.unwrap_or(&e.message)
                                )
                            })
                            .collect::<String>()
                    })
                    .unwrap_or_default();
                let mut f = finding(
                    "orphaned-context",
                    Severity::Attention,
                    format!(
                        "pid {} no longer exists but NVML lists it on {gpu_names} holding {}{}{named}",
                        p.pid,
                        held.map(format_bytes).unwrap_or_else(|| "memory".into()),
                        if p.record.is_some() {
                            " (it used cistern: `cistern leaks` shows its last state)"
                        } else {
                            ""
                        }
                    ),
                    "the driver frees a dead process's context once every process sharing it \
                     has closed it: look for orphaned holders below (children that inherited \
                     it) and end them; in a container the pid may belong to another pid \
                     namespace (check on the host); if it persists with no holder, a GPU reset \
                     (`nvidia-smi -r`, nothing else running) frees it",
                );
                f.pid = Some(p.pid);
                f.gpu = Some(gpu_names);
                f.bytes = held;
                f.record = p.record.clone();
                out.push(f);
            }
            PsState::Zombie if held.is_some() || p.record.is_some() => {
                let ppid = gpu::proc_stat(p.pid).map(|s| s.ppid);
                let mut f = finding(
                    "zombie-context",
                    if held.is_some() {
                        Severity::Attention
                    } else {
                        Severity::Info
                    },
                    format!(
                        "pid {} is a zombie (exited, not reaped by its parent{}){}",
                        p.pid,
                        ppid.map(|pp| format!(" {pp}")).unwrap_or_default(),
                        held.map(|b| format!(" and NVML still lists it with {}", format_bytes(b)))
                            .unwrap_or_default()
                    ),
                    "its parent must wait() for it, or exit (then init reaps it); the context is \
                     freed when it is reaped",
                );
                f.pid = Some(p.pid);
                f.bytes = held;
                f.record = p.record.clone();
                out.push(f);
            }
            PsState::NotVisible => {
                let mut f = finding(
                    "not-visible",
                    Severity::Info,
                    format!(
                        "record of pid {} (in pid namespace {}, {}) names a process this reader \
                         cannot see: it may be running; its record is neither expired nor \
                         cleaned from here",
                        p.pid,
                        record_of(s, p)
                            .and_then(|r| r.pid_ns)
                            .map(|n| n.to_string())
                            .unwrap_or_else(|| "?".into()),
                        p.command
                    ),
                    "run `cistern doctor` on the host (or in a pod with hostPID) to see it",
                );
                f.pid = Some(p.pid);
                f.record = p.record.clone();
                out.push(f);
            }
            PsState::DeadRecordOnly | PsState::PidReused => {
                dead_pids.insert(p.pid);
                let age_ms = s
                    .now_ms
                    .saturating_sub(p.updated_unix_ms.unwrap_or(s.now_ms));
                let other_boot = p.liveness == Some(Liveness::OtherBoot);
                let past_grace = age_ms >= grace_ms;
                let record = p
                    .record
                    .as_ref()
                    .and_then(|path| s.records.iter().find(|(q, _, _)| q == path))
                    .map(|(_, r, _)| r);
                let exited = p.record_state == Some(State::Exited);
                let leaked = record.is_some_and(|r| !r.leaks.is_empty() || r.leaks_truncated);
                // A clean exit is the normal end of a process: information, never attention.
                let (kind, severity, suggestion) = if exited && !leaked {
                    (
                        "exited",
                        Severity::Info,
                        "nothing to do: the record is removed once `registry_expire` (default \
                         1 h) has passed",
                    )
                } else if exited {
                    (
                        "exited-with-leaks",
                        Severity::Info,
                        if p.record.as_deref().is_some_and(|r| senders.contains(r)) {
                            "`cistern leaks <pid>` shows the blocks it never freed (the driver \
                             freed them with the process, except what other processes still \
                             map: imported-from-dead below); `cistern doctor --clean-stale` \
                             removes the record"
                        } else {
                            "`cistern leaks <pid>` shows the blocks it never freed (the driver \
                             freed them with the process); `cistern doctor --clean-stale` removes \
                             the record"
                        },
                    )
                } else if past_grace {
                    (
                        "stale-record",
                        Severity::Attention,
                        "it was killed or crashed: `cistern leaks <pid>` shows what it held; \
                         `cistern doctor --clean-stale` removes the record",
                    )
                } else {
                    (
                        "recently-dead",
                        Severity::Info,
                        "within the grace period: nothing to do yet",
                    )
                };
                let what = if exited {
                    "exited cleanly".to_string()
                } else {
                    p.state.name().to_string()
                };
                let mut f = finding(
                    kind,
                    severity,
                    format!(
                        "record of pid {} ({what}{}), last written {:.0} s ago: {}",
                        p.pid,
                        if other_boot {
                            ", from an earlier boot"
                        } else {
                            ""
                        },
                        age_ms as f64 / 1e3,
                        p.command
                    ),
                    suggestion,
                );
                f.pid = Some(p.pid);
                f.record = p.record.clone();
                if past_grace && clean {
                    if let Some(path) = &p.record {
                        match clean_one(path, p.container_pid.unwrap_or(p.pid)) {
                            Ok(()) => {
                                f.cleaned = true;
                                f.severity = Severity::Info;
                                f.suggestion = "removed".into();
                            }
                            Err(why) => f.suggestion = format!("{why}; {}", f.suggestion),
                        }
                    }
                }
                out.push(f);
            }
            _ => {}
        }
    }

    // Memory a running process maps from a dead one's pool (CUDA tensors it received): the
    // driver keeps it, with no running owner, until the receiver lets go of it.
    for i in psr.imports.iter().filter(|i| i.sender_dead()) {
        let sender = match (&i.from_command, i.from_reader_pid) {
            (Some(cmd), Some(here)) => format!("pid {} (pid {here} here; {cmd})", i.from_pid),
            (Some(cmd), None) => format!("pid {} ({cmd})", i.from_pid),
            (None, _) => format!("pid {} (no record of it)", i.from_pid),
        };
        let mut f = finding(
            "imported-from-dead",
            Severity::Info,
            format!(
                "pid {} maps {} on device {} that {sender} created and, dead, no longer \
                 holds: the driver keeps that memory for pid {} until it lets go",
                i.pid,
                format_bytes(i.bytes),
                i.device,
                i.pid
            ),
            format!(
                "it is the memory of CUDA tensors pid {} received from the dead process \
                 (torch.multiprocessing, CUDA IPC): to free it, have pid {} drop them and every \
                 view or storage that shares them (`del`, then `gc.collect()`), or restart pid {}",
                i.pid, i.pid, i.pid
            )
            .as_str(),
        );
        f.pid = Some(i.pid);
        f.gpu = i.uuid.clone();
        f.bytes = Some(i.bytes);
        out.push(f);
    }

    // Holders of /dev/nvidia* whose process group leader is gone.
    let (holders, unreadable) = gpu::dev_nvidia_holders();
    for h in holders {
        let Some(st) = gpu::proc_stat(h.pid) else {
            continue;
        };
        if st.pgid == 0 || st.pgid == h.pid || gpu::pid_exists(st.pgid) {
            continue;
        }
        let leader_known = dead_pids.contains(&st.pgid);
        let mut f = finding(
            "orphaned-holder",
            Severity::Attention,
            format!(
                "pid {} ({}) holds {} open, but its process group leader {} is dead{}",
                h.pid,
                gpu::command_of(h.pid),
                h.files.join(" "),
                st.pgid,
                if leader_known { " (listed above)" } else { "" }
            ),
            "a child left behind (e.g. a data-loader worker) keeps the dead leader's GPU \
             context alive: check it is not needed, then end it (`kill <pid>`)",
        );
        f.pid = Some(h.pid);
        out.push(f);
    }
    if unreadable > 0 {
        out.push(finding(
            "holders-unreadable",
            Severity::Info,
            format!("{unreadable} processes' open files could not be read (other users')"),
            "run as root to check every process's /dev/nvidia* handles",
        ));
    }
    for (path, e) in &s.refused {
        let mut f = finding(
            "refused-record",
            Severity::Info,
            format!("record {} {e}", path.display()),
            "not written by this cistern, or damaged; remove it by hand if it is not needed",
        );
        f.record = Some(path.clone());
        out.push(f);
    }
    for d in &s.dirs.refused {
        let mut f = finding(
            "refused-registry-dir",
            Severity::Attention,
            format!(
                "registry directory {} {} (not read)",
                d.path.display(),
                d.reason
            ),
            "a registry directory must be its user's own (mode 0700, no symlink): records in \
             one that is not could have been planted by anyone; find out who made it",
        );
        f.record = Some(d.path.clone());
        out.push(f);
    }
    for d in &s.dirs.unreadable {
        out.push(finding(
            "registry-dir-unreadable",
            Severity::Info,
            format!("registry directory {} {}", d.path.display(), d.reason),
            "run as root to check every user's processes",
        ));
    }
    if let Some(x) = xid {
        if let Some(why) = &x.unavailable {
            out.push(finding(
                "xid-unavailable",
                Severity::Info,
                format!("the GPU driver's Xid errors were not checked: {why}"),
                "run as root to check the kernel log",
            ));
        }
        for e in &x.events {
            let fatal = e.severity == XidSeverity::Fatal;
            let gpu = match (e.gpu_index, &e.pci) {
                (Some(i), Some(p)) => format!("GPU {i} ({p})"),
                (Some(i), None) => format!("GPU {i}"),
                (None, Some(p)) => format!("the GPU at PCI {p}"),
                (None, None) => "a GPU".into(),
            };
            let mut f = finding(
                "xid",
                if fatal {
                    Severity::Attention
                } else {
                    Severity::Info
                },
                format!(
                    "{gpu}: Xid {}{}{}: {} (driver: {})",
                    e.xid,
                    e.age_s
                        .map(|a| format!(" {:.0} min ago", a / 60.0))
                        .unwrap_or_default(),
                    match (e.pid, &e.process_name) {
                        (Some(pid), Some(n)) => format!(", pid {pid} ({n})"),
                        (Some(pid), None) => format!(", pid {pid}"),
                        _ => String::new(),
                    },
                    e.meaning.unwrap_or("see NVIDIA's Xid catalog"),
                    e.message
                ),
                if fatal {
                    "drain the GPU's jobs, then reset it (`nvidia-smi -r -i <index>` with nothing \
                     running) or reboot; memory held since the error is freed then; if it \
                     recurs, have the GPU checked (docs.nvidia.com/deploy/xid-errors)"
                } else {
                    "most often the process's own error: check its log; the same code across \
                     unrelated jobs on one GPU points at the hardware"
                },
            );
            f.pid = e.pid;
            f.gpu = e.gpu_uuid.clone().or_else(|| e.pci.clone());
            out.push(f);
        }
    }
    DoctorReport {
        healthy: !out.iter().any(|f| f.severity == Severity::Attention),
        nvml_available: s.gpus.is_ok(),
        registry_dir: s.dir.clone(),
        registry_dirs: s.dirs.paths(),
        grace_seconds: grace_ms as f64 / 1e3,
        findings: out,
        expired_records: s.expired.clone(),
        xid: xid.cloned(),
    }
}

/// Removes one stale record after checking again that its process is dead and that the file
/// still names it; only in a registry directory of this user's (another user's directory can be
/// swapped under the path by its owner: its records are the owner's to remove). The error says
/// why it was kept.
fn clean_one(path: &Path, pid: u32) -> Result<(), String> {
    let own = path
        .parent()
        .is_some_and(|d| registry::check_dir(d).is_ok());
    if !own {
        return Err(
            "kept: not in a registry directory of this user's; its owner's `cistern doctor \
             --clean-stale` removes it"
                .into(),
        );
    }
    let r = registry::read_record(path).map_err(|e| format!("kept: the record {e}"))?;
    if r.pid != pid
        || !matches!(
            r.liveness(),
            Liveness::Dead | Liveness::PidReused | Liveness::OtherBoot
        )
    {
        return Err("kept: the record changed, or its process runs".into());
    }
    fs::remove_file(path).map_err(|e| format!("kept: removing it failed: {e}"))
}

/// The record a `ps` row was built from.
fn record_of<'a>(s: &'a Snapshot, p: &ps::ProcRow) -> Option<&'a registry::Record> {
    let path = p.record.as_ref()?;
    s.records
        .iter()
        .find(|(q, _, _)| q == path)
        .map(|(_, r, _)| r)
}

/// Renders the document as text.
pub fn render(r: &DoctorReport, colour: bool) -> String {
    let mut out = String::new();
    for f in &r.findings {
        let (label, code) = match (f.severity, f.cleaned) {
            (_, true) => ("cleaned", table::GREEN),
            (Severity::Attention, _) => ("attention", table::RED),
            (Severity::Info, _) => ("info", table::YELLOW),
        };
        let label = if colour {
            format!("{code}{label}\x1b[0m")
        } else {
            label.to_string()
        };
        out.push_str(&format!(
            "{label} [{}] {}\n    -> {}\n",
            f.kind,
            printable(&f.message),
            printable(&f.suggestion)
        ));
    }
    out.push_str(if r.healthy {
        "healthy\n"
    } else {
        "needs attention\n"
    });
    out
}

pub fn run(args: &DoctorArgs) -> Result<ExitCode, String> {
    if !(args.grace >= 0.0 && args.grace.is_finite()) {
        return Err(format!("--grace {}: not a duration in seconds", args.grace));
    }
    let view = gpu::from_env()?;
    let dirs = crate::registry_dirs::registry_dirs(args.registry_dir.as_deref(), args.all_users)?;
    let mut snap = Snapshot::take_dirs(view.as_ref(), &dirs)?;
    snap.expire(ps::registry_expire());
    let xid = crate::xid::recent(&ps::gpu_infos(&snap), ps::XID_WINDOW);
    let report = examine(
        &snap,
        (args.grace * 1e3) as u64,
        args.clean_stale,
        Some(&xid),
    );
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", render(&report, table::use_colour()));
    }
    Ok(if report.healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
