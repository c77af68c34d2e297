//! `cistern doctor`: health checks for a shared GPU host. Finds orphaned GPU contexts (NVML
//! pids that no longer exist), zombies holding GPU memory, processes that hold `/dev/nvidia*`
//! after their process group's leader died (data-loader workers of a killed job), and stale
//! records. It suggests; it never kills, and removes nothing but stale records, and those only
//! with `--clean-stale`.
//!
//! Exit status: 0 healthy, 1 something needs attention, 2 error.

use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;
use std::process::ExitCode;

use cistern::format_bytes;
use cistern::registry::{self, Liveness};
use serde::Serialize;

use crate::gpu;
use crate::ps::{self, PsState, Snapshot};
use crate::table::{self, printable};
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
    /// `recently-dead`, `refused-record`, `nvml-unavailable`, `holders-unreadable`.
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
    pub registry_dir: PathBuf,
    pub grace_seconds: f64,
    pub findings: Vec<Finding>,
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

/// Examines a snapshot; with `clean`, removes stale records.
pub fn examine(s: &Snapshot, grace_ms: u64, clean: bool) -> DoctorReport {
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
                let mut f = finding(
                    "orphaned-context",
                    Severity::Attention,
                    format!(
                        "pid {} no longer exists but NVML lists it on {gpu_names} holding {}{}",
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
            PsState::DeadRecordOnly | PsState::PidReused => {
                dead_pids.insert(p.pid);
                let age_ms = s
                    .now_ms
                    .saturating_sub(p.updated_unix_ms.unwrap_or(s.now_ms));
                let other_boot = p.liveness == Some(Liveness::OtherBoot);
                let stale = age_ms >= grace_ms;
                let mut f = finding(
                    if stale {
                        "stale-record"
                    } else {
                        "recently-dead"
                    },
                    if stale {
                        Severity::Attention
                    } else {
                        Severity::Info
                    },
                    format!(
                        "record of pid {} ({}{}), last written {:.0} s ago: {}",
                        p.pid,
                        p.state.name(),
                        if other_boot {
                            ", from an earlier boot"
                        } else {
                            ""
                        },
                        age_ms as f64 / 1e3,
                        p.command
                    ),
                    if stale {
                        "`cistern leaks <pid>` shows what it held; `cistern doctor --clean-stale` \
                         removes the record"
                    } else {
                        "within the grace period: nothing to do yet"
                    },
                );
                f.pid = Some(p.pid);
                f.record = p.record.clone();
                if stale && clean {
                    if let Some(path) = &p.record {
                        f.cleaned = clean_one(path, p.pid);
                        if f.cleaned {
                            f.severity = Severity::Info;
                            f.suggestion = "removed".into();
                        }
                    }
                }
                out.push(f);
            }
            _ => {}
        }
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
    DoctorReport {
        healthy: !out.iter().any(|f| f.severity == Severity::Attention),
        nvml_available: s.gpus.is_ok(),
        registry_dir: s.dir.clone(),
        grace_seconds: grace_ms as f64 / 1e3,
        findings: out,
    }
}

/// Removes one stale record after checking again that its process is dead and that the file
/// still names it.
fn clean_one(path: &PathBuf, pid: u32) -> bool {
    let Ok(r) = registry::read_record(path) else {
        return false;
    };
    if r.pid != pid
        || !matches!(
            r.liveness(),
            Liveness::Dead | Liveness::PidReused | Liveness::OtherBoot
        )
    {
        return false;
    }
    fs::remove_file(path).is_ok()
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
    let dir = ps::registry_dir(args.registry_dir.as_deref())?;
    let snap = Snapshot::take(view.as_ref(), &dir)?;
    let report = examine(&snap, (args.grace * 1e3) as u64, args.clean_stale);
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
