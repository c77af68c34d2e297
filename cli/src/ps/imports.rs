//! Who maps whose memory: the memory running processes map from other processes' pools (CUDA
//! tensors they received), from the receivers' records, each matched to its sender's record,
//! and whether the sender still runs.

use super::*;

/// Memory one process maps from another's pool (from the receiver's record).
#[derive(Debug, Serialize)]
pub struct ImportRow {
    /// The receiver (this reader's pid).
    pub pid: u32,
    /// The receiver's device ordinal and its GPU's UUID.
    pub device: u32,
    pub uuid: Option<String>,
    /// The sender's pid, as the receiver saw it.
    pub from_pid: u32,
    /// The sender's start time (clock ticks since boot), as the receiver read it when it
    /// opened the memory; `None` in records of older versions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_start_time: Option<u64>,
    /// The sender's pid in this reader's pid namespace (the one `kill` and `nvidia-smi` use
    /// here), when its record was found and it differs from `from_pid`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_reader_pid: Option<u32>,
    pub bytes: u64,
    /// The sender's state when its record is here; `None` when it published none (it does not
    /// use cistern, or its registry is elsewhere) or no record is surely its.
    pub from_state: Option<PsState>,
    /// Whether the sender still runs, from its record or, with none, from `/proc` when the
    /// receiver shares this reader's pid namespace and recorded the sender's start time;
    /// `None` when it cannot be told.
    pub from_liveness: Option<Liveness>,
    pub from_command: Option<String>,
    /// The sender's record.
    pub from_record: Option<PathBuf>,
}

impl ImportRow {
    /// Whether the sender is known to be gone: the memory then has no running owner but the
    /// receiver (a zombie sender has let go of its memory too).
    pub fn sender_dead(&self) -> bool {
        matches!(
            self.from_liveness,
            Some(Liveness::Dead | Liveness::PidReused | Liveness::OtherBoot | Liveness::Zombie)
        )
    }
}

/// Who maps whose memory: each running receiver's imports, with the sender's state.
///
/// A sender's record is one that names `from_pid` as its own pid (`from_pid` is as the receiver
/// saw it, and a receiver takes descriptors only from a process in its pid namespace), has the
/// receiver's uid (taking another process's descriptors needs ptrace rights over it), is in
/// the receiver's pid namespace when both records say (else, in its container), is of this
/// boot, and, when the receiver recorded the sender's start time, started then: a record of an
/// earlier process given the same pid is not the sender's. Without a start time (older
/// receivers), the newest such record, unless its pid now belongs to another process (which
/// may be the sender).
/// Records are untrusted: an import naming anyone else is shown with no sender.
pub(super) fn import_rows(rows: &[ProcRow]) -> Vec<ImportRow> {
    let mut by_pid: HashMap<u32, Vec<&ProcRow>> = HashMap::new();
    for q in rows.iter().filter(|q| q.record.is_some()) {
        by_pid
            .entry(q.container_pid.unwrap_or(q.pid))
            .or_default()
            .push(q);
    }
    let mut out = Vec::new();
    // This reader's pid namespace (read once: `None` when unreadable, as a record without one).
    let own_ns = registry::pid_ns_of("self");
    for p in rows.iter().filter(|p| p.state == PsState::Running) {
        for d in &p.gpus {
            for i in &d.imported {
                let start = (i.from_start_time != 0).then_some(i.from_start_time);
                let from = by_pid
                    .get(&i.from_pid)
                    .into_iter()
                    .flatten()
                    .filter(|q| q.uid == p.uid)
                    .filter(|q| match (q.pid_ns, p.pid_ns) {
                        (Some(a), Some(b)) => a == b,
                        _ => q.container_id == p.container_id,
                    })
                    .filter(|q| start.is_none() || q.start_time == start)
                    // The receiver runs, so its sender is of this boot.
                    .filter(|q| q.liveness != Some(Liveness::OtherBoot))
                    .max_by_key(|q| q.updated_unix_ms)
                    .filter(|q| start.is_some() || q.state != PsState::PidReused);
                let from_liveness = match (from, start) {
                    (Some(q), _) => q.liveness,
                    // No record: `/proc` answers when the receiver's pids are this reader's
                    // (it runs here under the pid it recorded, in this namespace when its
                    // record says).
                    (None, Some(st))
                        if p.container_pid.is_none()
                            && p.pid_ns.is_none_or(|ns| Some(ns) == own_ns) =>
                    {
                        Some(cistern::registry::is_alive(i.from_pid, st))
                    }
                    (None, _) => None,
                };
                out.push(ImportRow {
                    pid: p.pid,
                    device: d.device.unwrap_or(0),
                    uuid: d.uuid.clone(),
                    from_pid: i.from_pid,
                    from_start_time: start,
                    from_reader_pid: from.map(|q| q.pid).filter(|&r| r != i.from_pid),
                    bytes: i.bytes,
                    from_state: from.map(|q| q.state),
                    from_liveness,
                    from_command: from.map(|q| q.command.clone()),
                    from_record: from.and_then(|q| q.record.clone()),
                });
            }
        }
    }
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
    out
}
