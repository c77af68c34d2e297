//! Who maps whose memory: the memory running processes map from other processes' pools (CUDA
//! tensors they received), from the receivers' records, each matched to its sender's record.

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
    pub bytes: u64,
    /// The sender's state when its record (the newest of that pid) is here; `None` when it
    /// published none (it does not use cistern, or its registry is elsewhere).
    pub from_state: Option<PsState>,
    pub from_command: Option<String>,
    /// The sender's record.
    pub from_record: Option<PathBuf>,
}

/// Who maps whose memory: each running receiver's imports, with the sender's state. A sender
/// is the newest record that names `from_pid` as its own pid (`from_pid` is as the receiver
/// saw it, and a receiver takes descriptors only from a process in its pid namespace) and has
/// the receiver's uid (taking another process's descriptors needs ptrace rights over it) and,
/// when both records say, its pid namespace. Records are untrusted: an import naming anyone
/// else is shown with no sender.
pub(super) fn import_rows(rows: &[ProcRow]) -> Vec<ImportRow> {
    let mut by_pid: HashMap<u32, Vec<&ProcRow>> = HashMap::new();
    for q in rows.iter().filter(|q| q.record.is_some()) {
        by_pid
            .entry(q.container_pid.unwrap_or(q.pid))
            .or_default()
            .push(q);
    }
    let mut out = Vec::new();
    for p in rows.iter().filter(|p| p.state == PsState::Running) {
        for d in &p.gpus {
            for i in &d.imported {
                let from = by_pid
                    .get(&i.from_pid)
                    .into_iter()
                    .flatten()
                    .filter(|q| q.uid == p.uid)
                    .filter(|q| match (q.pid_ns, p.pid_ns) {
                        (Some(a), Some(b)) => a == b,
                        _ => true,
                    })
                    .max_by_key(|q| q.updated_unix_ms);
                out.push(ImportRow {
                    pid: p.pid,
                    device: d.device.unwrap_or(0),
                    uuid: d.uuid.clone(),
                    from_pid: i.from_pid,
                    bytes: i.bytes,
                    from_state: from.map(|q| q.state),
                    from_command: from.map(|q| q.command.clone()),
                    from_record: from.and_then(|q| q.record.clone()),
                });
            }
        }
    }
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
    out
}
