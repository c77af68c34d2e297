//! The text of `cistern ps`: a [`PsReport`] as tables, each process's last OOM line and the
//! driver's recent Xid errors.

use super::*;

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
        let dirs = r
            .registry_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        out.push_str(&format!(
            "{}\nshowing cistern's registry alone ({})\n\n",
            printable(e),
            printable(if dirs.is_empty() {
                "no registry directory found"
            } else {
                &dirs
            })
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
            ("pending", Align::Right),
            ("overhead", Align::Right),
            ("top tags", Align::Left),
            ("command", Align::Left),
        ]);
        for p in &r.processes {
            let state = (p.state.name().to_string(), p.state.colour());
            let command = command_cell(p);
            if p.gpus.is_empty() {
                t.row_coloured(vec![
                    (p.pid.to_string(), None),
                    state,
                    ((if p.simulated { "sim" } else { "-" }).into(), None),
                    (opt_bytes(p.nvml_used), None),
                    (format_bytes(p.reserved), None),
                    (format_bytes(p.live), None),
                    (format_bytes(p.cached), None),
                    (format_bytes(p.pending), None),
                    ("-".into(), None),
                    (String::new(), None),
                    (command, None),
                ]);
                continue;
            }
            for (i, d) in p.gpus.iter().enumerate() {
                let gpu = match (d.gpu_index, &d.uuid) {
                    _ if p.simulated => format!("sim{}", d.device.unwrap_or(0)),
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
                    (format_bytes(d.pending), None),
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
    // Senders beyond those a receiver's record names, one line per receiver and device.
    let others: Vec<(u32, u32, u64)> = r
        .processes
        .iter()
        .filter(|p| p.state == PsState::Running)
        .flat_map(|p| {
            p.gpus
                .iter()
                .filter(|g| g.imported_other > 0)
                .map(move |g| (p.pid, g.device.unwrap_or(0), g.imported_other))
        })
        .collect();
    if !r.imports.is_empty() || !others.is_empty() {
        out.push_str(
            "\nmemory mapped from other processes (CUDA tensors received; the sender's, not in \
             the receiver's reserved):\n",
        );
        for i in r.imports.iter().take(MAX_IMPORT_LINES) {
            out.push_str(&format!("  {}\n", import_line(i)));
        }
        if r.imports.len() > MAX_IMPORT_LINES {
            out.push_str(&format!(
                "  ... and {} more (`--json` lists them all)\n",
                r.imports.len() - MAX_IMPORT_LINES
            ));
        }
        for (pid, device, bytes) in others {
            out.push_str(&format!(
                "  pid {pid} maps {} on device {device} from more senders (its record names the \
                 {} largest)\n",
                format_bytes(bytes),
                registry::MAX_TOP
            ));
        }
    }
    if r.processes.iter().any(|p| p.simulated) {
        out.push_str("gpu simN: the process ran on cistern's simulated GPU (no device memory)\n");
    }
    for f in &r.refused_records {
        out.push_str(&format!(
            "record {} refused: {}\n",
            printable(&f.path.display().to_string()),
            printable(&f.error)
        ));
    }
    for d in &r.refused_registry_dirs {
        out.push_str(&format!(
            "registry directory {} refused (not read): {}\n",
            printable(&d.path.display().to_string()),
            printable(&d.reason)
        ));
    }
    for d in &r.unreadable_registry_dirs {
        out.push_str(&format!(
            "registry directory {} not read: {}\n",
            printable(&d.path.display().to_string()),
            printable(&d.reason)
        ));
    }
    let ooms: Vec<&ProcRow> = r
        .processes
        .iter()
        .filter(|p| p.last_oom.is_some())
        .collect();
    if !ooms.is_empty() {
        out.push_str("\nlast out-of-memory reports:\n");
        for p in ooms {
            if let Some(o) = &p.last_oom {
                out.push_str(&format!("  pid {}: {}\n", p.pid, oom_line(o)));
            }
        }
    }
    if let Some(x) = &r.xid {
        if !x.events.is_empty() {
            out.push('\n');
            out.push_str(&xid_section(x));
        }
    }
    out
}

/// The command cell: the command, after the container (short id) and the pid inside it.
fn command_cell(p: &ProcRow) -> String {
    let mut prefix = String::new();
    if let Some(c) = &p.container_id {
        let short: String = c.chars().take(12).collect();
        prefix = match p.container_pid {
            Some(inner) => format!("[ctr {short} pid {inner}] "),
            None => format!("[ctr {short}] "),
        };
    } else if let Some(inner) = p.container_pid {
        prefix = format!("[pid {inner} inside] ");
    }
    format!("{prefix}{}", p.command).chars().take(72).collect()
}

/// How many of an OOM report's other processes its line names.
const OOM_OTHERS: usize = 3;

/// One OOM report in a line: what was asked, what the process held (live + cached + pending),
/// what the device had, why it failed, and the other processes using cistern that held memory
/// on the GPU then (the largest [`OOM_OTHERS`], from their records at the time).
pub fn oom_line(o: &OomRecord) -> String {
    let mut line = format!(
        "device {} stream {}: requested {} (rounded {}) holding {} reserved = {} live + {} \
         cached + {} pending, largest free range {}; device {} free of {}, limit {}: {}",
        o.device,
        o.stream,
        format_bytes(o.requested),
        format_bytes(o.rounded),
        format_bytes(o.reserved),
        format_bytes(o.live),
        format_bytes(o.cached),
        format_bytes(o.pending),
        format_bytes(o.largest_free),
        format_bytes(o.device_free),
        format_bytes(o.device_total),
        format_bytes(o.limit),
        printable(&o.reason)
    );
    if !o.other_processes.is_empty() {
        let named: Vec<String> = o
            .other_processes
            .iter()
            .take(OOM_OTHERS)
            .map(|p| {
                let command: String = printable(&p.command).chars().take(40).collect();
                let note = if p.nvml_only {
                    "; NVML, no cistern record"
                } else {
                    ""
                };
                let bytes = if p.nvml_only && p.bytes == 0 {
                    "?".to_string()
                } else {
                    format_bytes(p.bytes)
                };
                format!("pid {} {bytes} ({command}{note})", p.pid)
            })
            .collect();
        line.push_str(&format!("; other processes then: {}", named.join(", ")));
        let more = o.other_processes.len().saturating_sub(OOM_OTHERS);
        if more > 0 {
            line.push_str(&format!(" and {more} more"));
        }
    }
    line
}

fn ago(s: Option<f64>) -> String {
    match s {
        None => "at an unknown time".into(),
        Some(s) if s < 120.0 => format!("{s:.0} s ago"),
        Some(s) if s < 7200.0 => format!("{:.0} min ago", s / 60.0),
        Some(s) => format!("{:.1} h ago", s / 3600.0),
    }
}

/// The "recent Xid errors" section.
pub fn xid_section(x: &XidReport) -> String {
    let mut out = format!(
        "recent Xid errors (the GPU driver's, from {}, last {:.0} h):\n",
        x.source.as_deref().unwrap_or("the kernel log"),
        x.window_s / 3600.0
    );
    for e in &x.events {
        let gpu = match (e.gpu_index, &e.pci) {
            (Some(i), Some(p)) => format!("GPU {i} ({p})"),
            (Some(i), None) => format!("GPU {i}"),
            (None, Some(p)) => format!("PCI {p}"),
            (None, None) => "a GPU".into(),
        };
        let who = match (e.pid, &e.process_name) {
            (Some(pid), Some(n)) => format!(", pid {pid} ({})", printable(n)),
            (Some(pid), None) => format!(", pid {pid}"),
            _ => String::new(),
        };
        let sev = match e.severity {
            crate::xid::XidSeverity::Fatal => "fatal",
            crate::xid::XidSeverity::Application => "application",
        };
        out.push_str(&format!(
            "  {gpu}: Xid {} ({sev}) {}{who}: {}\n",
            e.xid,
            ago(e.age_s),
            printable(e.meaning.unwrap_or(&e.message))
        ));
    }
    if x.left_out > 0 {
        out.push_str(&format!("  ({} older ones left out)\n", x.left_out));
    }
    out
}

/// Import lines shown; the largest first.
const MAX_IMPORT_LINES: usize = 32;

/// `pid 200 maps 4.0 GiB on device 0 from pid 100 (dead-record-only: python train.py)`.
pub(crate) fn import_line(i: &ImportRow) -> String {
    let from = match (&i.from_state, &i.from_command) {
        (Some(st), Some(cmd)) => format!(" ({}: {})", st.name(), printable(cmd)),
        _ if i.sender_dead() => " (dead; no record of it here)".into(),
        _ => {
            " (no record of it here: it does not use cistern, or its registry is elsewhere)".into()
        }
    };
    let here = i
        .from_reader_pid
        .map(|r| format!(" (pid {r} here)"))
        .unwrap_or_default();
    format!(
        "pid {} maps {} on device {} from pid {}{here}{from}",
        i.pid,
        format_bytes(i.bytes),
        i.device,
        i.from_pid
    )
}
