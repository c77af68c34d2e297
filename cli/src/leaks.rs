//! `cistern leaks PID`: what a process holds, from its record: the one of the process that has
//! the pid now, else the newest (a dead process's last record).
//!
//! An `exited` record carries the leak summary written at exit (blocks still live, by tag and
//! site, with the oldest block's age). A `running` record (alive, or left by a killed process)
//! carries live bytes per device with the top tags: those are listed, and what the top tags do
//! not cover is one `(other)` group, so the groups always sum to the record's live bytes.

use cistern::format_bytes;
use cistern::registry::{Liveness, MarkRecord, OomRecord, Record, State};
use serde::Serialize;

use crate::ps::{registry_dir, Snapshot};
use crate::table::{self, printable, Align, Table};
use crate::LeaksArgs;

/// One group of live blocks.
#[derive(Debug, Serialize)]
pub struct Group {
    /// The tag (`""` untagged, `(other)` for what the record's lists do not cover).
    pub tag: String,
    /// The call site, when known.
    pub site: Option<String>,
    /// The process's device ordinal.
    pub device: u32,
    /// The device's UUID, when the record names it.
    pub uuid: Option<String>,
    pub bytes: u64,
    pub blocks: u64,
    pub oldest_age_ms: Option<u64>,
}

/// The `leaks` document.
#[derive(Debug, Serialize)]
pub struct LeaksReport {
    pub pid: u32,
    pub start_time: u64,
    pub liveness: Liveness,
    pub record_state: State,
    pub command: String,
    pub updated_unix_ms: u64,
    /// `leak-summary` (blocks live at exit) or `live-by-tag` (a running record's tags).
    pub source: &'static str,
    pub groups: Vec<Group>,
    /// Σ groups.
    pub total_bytes: u64,
    pub total_blocks: u64,
    /// Σ live bytes over the record's devices.
    pub record_live_bytes: u64,
    /// Whether the record's leak list was cut to fit.
    pub leaks_truncated: bool,
    /// Live call sites per device, when stacks were sampled (running records).
    pub top_sites: Vec<Group>,
    /// Marks and what was allocated since each and is still live.
    pub marks: Vec<MarkRecord>,
    /// The process's last out-of-memory report, when it had one.
    pub last_oom: Option<OomRecord>,
}

/// Builds the document from one record.
pub fn build(r: &Record, liveness: Liveness) -> LeaksReport {
    let uuid_of = |dev: u32| {
        r.devices
            .iter()
            .find(|d| d.index == dev)
            .and_then(|d| d.uuid.clone())
    };
    let record_live: u64 = r
        .devices
        .iter()
        .map(|d| d.live)
        .fold(0, u64::saturating_add);
    let summary = r.state == State::Exited || !r.leaks.is_empty();
    let mut groups: Vec<Group> = Vec::new();
    if summary {
        groups.extend(r.leaks.iter().map(|l| Group {
            tag: l.tag.clone(),
            site: l.site.clone(),
            device: l.device,
            uuid: uuid_of(l.device),
            bytes: l.bytes,
            blocks: l.blocks,
            oldest_age_ms: l.oldest_age_ms,
        }));
        // A cut list: the rest of each device's live bytes as one group.
        if r.leaks_truncated {
            for d in &r.devices {
                let listed: u64 = r
                    .leaks
                    .iter()
                    .filter(|l| l.device == d.index)
                    .map(|l| l.bytes)
                    .fold(0, u64::saturating_add);
                if d.live > listed {
                    groups.push(other(d.index, d.uuid.clone(), d.live - listed, 0));
                }
            }
        }
    } else {
        for d in &r.devices {
            let mut listed = 0;
            for a in &d.top_tags {
                listed += a.bytes;
                groups.push(Group {
                    tag: a.name.clone(),
                    site: None,
                    device: d.index,
                    uuid: d.uuid.clone(),
                    bytes: a.bytes,
                    blocks: a.blocks,
                    oldest_age_ms: None,
                });
            }
            if d.live > listed {
                groups.push(other(d.index, d.uuid.clone(), d.live - listed, 0));
            }
        }
    }
    groups.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.tag.cmp(&b.tag)));
    let top_sites = if summary {
        Vec::new()
    } else {
        r.devices
            .iter()
            .flat_map(|d| {
                d.top_sites.iter().map(|a| Group {
                    tag: String::new(),
                    site: Some(a.name.clone()),
                    device: d.index,
                    uuid: d.uuid.clone(),
                    bytes: a.bytes,
                    blocks: a.blocks,
                    oldest_age_ms: None,
                })
            })
            .collect()
    };
    let mut marks = r.marks.clone();
    marks.sort_by_key(|m| m.id);
    LeaksReport {
        pid: r.pid,
        start_time: r.start_time,
        liveness,
        record_state: r.state,
        command: r.cmdline.join(" "),
        updated_unix_ms: r.updated_unix_ms,
        source: if summary {
            "leak-summary"
        } else {
            "live-by-tag"
        },
        total_bytes: groups.iter().map(|g| g.bytes).fold(0, u64::saturating_add),
        total_blocks: groups.iter().map(|g| g.blocks).fold(0, u64::saturating_add),
        groups,
        record_live_bytes: record_live,
        leaks_truncated: r.leaks_truncated,
        top_sites,
        marks,
        last_oom: r.last_oom.clone(),
    }
}

fn other(device: u32, uuid: Option<String>, bytes: u64, blocks: u64) -> Group {
    Group {
        tag: "(other)".into(),
        site: None,
        device,
        uuid,
        bytes,
        blocks,
        oldest_age_ms: None,
    }
}

fn age(ms: Option<u64>) -> String {
    match ms {
        None => "-".into(),
        Some(ms) if ms < 1000 => format!("{ms} ms"),
        Some(ms) if ms < 120_000 => format!("{:.1} s", ms as f64 / 1e3),
        Some(ms) if ms < 7_200_000 => format!("{:.1} min", ms as f64 / 6e4),
        Some(ms) => format!("{:.1} h", ms as f64 / 3.6e6),
    }
}

/// Renders the document as text.
pub fn render(r: &LeaksReport, colour: bool) -> String {
    let mut out = format!(
        "pid {} ({}; record {}, {}): {}\n",
        r.pid,
        serde_json::to_value(r.liveness)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        if r.record_state == State::Exited {
            "exited"
        } else {
            "running"
        },
        if r.source == "leak-summary" {
            "blocks live at exit"
        } else {
            "live bytes by tag"
        },
        printable(&r.command)
    );
    let mut t = Table::new(&[
        ("tag", Align::Left),
        ("site", Align::Left),
        ("device", Align::Right),
        ("bytes", Align::Right),
        ("blocks", Align::Right),
        ("oldest", Align::Right),
    ]);
    for g in &r.groups {
        t.row_coloured(vec![
            (
                if g.tag.is_empty() {
                    "(untagged)".into()
                } else {
                    g.tag.clone()
                },
                None,
            ),
            (g.site.clone().unwrap_or_else(|| "-".into()), None),
            (g.device.to_string(), None),
            (format_bytes(g.bytes), None),
            (g.blocks.to_string(), None),
            (age(g.oldest_age_ms), None),
        ]);
    }
    t.row_coloured(vec![
        ("total".into(), Some(table::BOLD)),
        (String::new(), None),
        (String::new(), None),
        (format_bytes(r.total_bytes), Some(table::BOLD)),
        (r.total_blocks.to_string(), Some(table::BOLD)),
        (String::new(), None),
    ]);
    out.push_str(&t.render(colour));
    if r.leaks_truncated {
        out.push_str("the record's leak list was cut to fit; (other) holds the rest\n");
    }
    if !r.top_sites.is_empty() {
        out.push_str("\ntop call sites:\n");
        for s in &r.top_sites {
            out.push_str(&format!(
                "  {:>10}  {:>6} blocks  device {}  {}\n",
                format_bytes(s.bytes),
                s.blocks,
                s.device,
                printable(s.site.as_deref().unwrap_or("-"))
            ));
        }
    }
    if let Some(o) = &r.last_oom {
        out.push_str(&format!(
            "\nlast out-of-memory report: {}\n",
            crate::ps::oom_line(o)
        ));
    }
    if !r.marks.is_empty() {
        out.push_str("\ngrowth since marks (allocated since, still live):\n");
        for m in &r.marks {
            out.push_str(&format!(
                "  mark {}{}: {} in {} blocks\n",
                m.id,
                m.label
                    .as_deref()
                    .map(|l| format!(" ({})", printable(l)))
                    .unwrap_or_default(),
                format_bytes(m.live_bytes_since),
                m.live_blocks_since
            ));
        }
    }
    out
}

pub fn run(args: &LeaksArgs) -> Result<(), String> {
    let dir = registry_dir(args.registry_dir.as_deref())?;
    // The GPUs play no part here.
    let snap = Snapshot::take(&crate::gpu::FakeView::default(), &dir)?;
    // The pid as the process saw it, or as this reader sees it (a process in a container).
    let newest = snap
        .records
        .iter()
        .filter(|(p, r, _)| r.pid == args.pid || snap.pid_of(p) == Some(args.pid))
        .max_by_key(|(_, r, l)| {
            // The process that has the pid now first, then the newest record.
            let current = matches!(l, Liveness::Alive | Liveness::Zombie);
            (current, r.updated_unix_ms, r.start_time)
        });
    let Some((_, record, liveness)) = newest else {
        let refused = snap
            .refused
            .iter()
            .filter(|(p, _)| {
                p.file_name()
                    .and_then(cistern::registry::parse_file_name)
                    .is_some_and(|(pid, _)| pid == args.pid)
            })
            .map(|(p, e)| format!("; {} {e}", p.display()))
            .collect::<String>();
        return Err(format!(
            "no record of pid {} in {}{refused}",
            args.pid,
            dir.display()
        ));
    };
    let report = build(record, *liveness);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", render(&report, table::use_colour()));
    }
    Ok(())
}
