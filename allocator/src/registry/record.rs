//! The record: the versioned on-disk schema (v1) of one process's state, its file name,
//! parsing untrusted bytes into it and encoding it within the size limit. The schema's types
//! are the registry's own ([`OomRecord`], [`AttributionRecord`], ...), never the allocator's
//! in-memory types, so that editing those cannot change a format other processes read.

use std::ffi::OsStr;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::container::{PidResolver, Placement};
use super::process::{boot_id, is_alive, Liveness};

/// The record format's version; readers refuse other versions with
/// [`RecordError::UnsupportedVersion`].
pub const RECORD_VERSION: u32 = 1;
/// Readers refuse record files larger than this.
pub const MAX_RECORD_BYTES: u64 = 1 << 20;
/// The command line is cut to this many bytes (the record says when it was).
pub const MAX_CMDLINE_BYTES: usize = 4096;
/// At most this many tags and sites per device are published.
pub const MAX_TOP: usize = 32;
/// A reader reads at most this many record files of one directory (one per process; a user
/// running more processes at once than this is not a case to plan for, a directory filled to
/// slow down root's readers is).
pub const MAX_RECORDS_PER_DIR: usize = 1024;
/// A reader reads at most this many bytes of records from one directory.
pub const MAX_DIR_BYTES: u64 = 32 << 20;
/// A record lists at most this many devices (a node has at most a few dozen GPUs); readers
/// refuse one with more, so that a record cannot make a reader's output (or an exporter's
/// series) grow without bound.
pub const MAX_DEVICES: usize = 64;
/// At most this many leak entries are published.
pub const MAX_LEAKS: usize = 1000;

/// Whether the process that wrote a record was still running when it wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Published by the background thread: the process was running. A record left in this state
    /// by a dead process is its last known state (it was killed, or exited without the hook).
    Running,
    /// The final record, written at a clean exit; `leaks` lists the blocks still live then.
    Exited,
}

/// One device of a process, as its allocator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    /// The device ordinal in this process (after `CUDA_VISIBLE_DEVICES`).
    pub index: u32,
    /// The physical identity (`GPU-...`), when the driver knows it. Join devices across processes
    /// by this, not by index: device 0 under `CUDA_VISIBLE_DEVICES=3` is physical GPU 3.
    pub uuid: Option<String>,
    /// The device name.
    #[serde(default)]
    pub name: String,
    /// Device memory in total.
    #[serde(default)]
    pub total_memory: u64,
    /// This process's limit on reserved bytes.
    #[serde(default)]
    pub limit: u64,
    /// Bytes the allocator holds from the driver.
    pub reserved: u64,
    /// Bytes in live blocks.
    pub live: u64,
    /// Reserved bytes in no live or pending block.
    pub cached: u64,
    /// Bytes freed but waiting on other streams' work.
    pub pending: u64,
    /// Highest reserved bytes.
    pub peak_reserved: u64,
    /// Highest live bytes.
    pub peak_live: u64,
    /// Live bytes by tag, largest first (at most [`MAX_TOP`]).
    #[serde(default)]
    pub top_tags: Vec<AttributionRecord>,
    /// Live bytes by call site, largest first (at most [`MAX_TOP`]).
    #[serde(default)]
    pub top_sites: Vec<AttributionRecord>,
    /// Allocations made since the process started (a counter; absent in older records).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub allocations: u64,
    /// Requests that ran out of memory since the process started (a counter).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ooms: u64,
    /// Memory this process maps from other processes (CUDA tensors received through
    /// `torch.multiprocessing` or `cistern_ipc_open`), by sender, most bytes first (at most
    /// [`MAX_TOP`]). Not in `reserved`: the sender created it, and the driver keeps it alive,
    /// even after the sender exits, until this process closes it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub imported: Vec<ImportRecord>,
    /// Bytes mapped from senders beyond the [`MAX_TOP`] that `imported` names (0 in older
    /// records).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub imported_other: u64,
}

/// Memory a process maps from another's pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportRecord {
    /// The sender's pid (as the sender saw itself: the receiver takes its descriptors by it,
    /// so both are in one pid namespace).
    pub from_pid: u32,
    /// The sender's start time (clock ticks since boot, as its identity says), read when the
    /// memory was opened; 0 when unknown (older records). Tells the sender from a later
    /// process given the same pid.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub from_start_time: u64,
    /// Bytes mapped.
    pub bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Bytes attributed to one tag or call site, as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttributionRecord {
    /// The tag or symbolised site.
    pub name: String,
    /// Live bytes.
    pub bytes: u64,
    /// Live blocks.
    pub blocks: u64,
}

/// Another process's use of the device, as published in an [`OomRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OtherProcessRecord {
    /// Process id.
    pub pid: u32,
    /// Bytes it holds on the device.
    pub bytes: u64,
    /// Its command line, when known.
    pub command: String,
    /// Known from NVML only ([`crate::error::OtherProcess::nvml_only`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nvml_only: bool,
}

/// A process's last out-of-memory report ([`crate::OomReport`]), as published: what the
/// allocator knew when a request failed. Every field is required (v1 has no defaults here).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomRecord {
    /// The device ordinal.
    pub device: usize,
    /// The stream of the request.
    pub stream: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Bytes after rounding.
    pub rounded: u64,
    /// The per-process limit on reserved bytes.
    pub limit: u64,
    /// Device memory free (all processes), from the driver.
    pub device_free: u64,
    /// Device memory in total.
    pub device_total: u64,
    /// Bytes the process held from the driver.
    pub reserved: u64,
    /// Bytes in live blocks.
    pub live: u64,
    /// Bytes freed but waiting on other streams' work.
    pub pending: u64,
    /// Reserved bytes in no live or pending block.
    pub cached: u64,
    /// The largest free range in any arena.
    pub largest_free: u64,
    /// Live bytes by tag, largest first (empty until provenance is on).
    pub top_tags: Vec<AttributionRecord>,
    /// Live bytes by call site, largest first (empty until sampling is on).
    pub top_sites: Vec<AttributionRecord>,
    /// Other processes on the device, when known.
    pub other_processes: Vec<OtherProcessRecord>,
    /// What NVML counted for the process on the device, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_nvml_bytes: Option<u64>,
    /// Why the request failed, in words.
    pub reason: String,
}

/// Blocks still live at exit (or now, for a `leaks` query), grouped by tag and site.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeakEntry {
    /// The tag the blocks were allocated under (empty when untagged).
    pub tag: String,
    /// The symbolised call site, when stacks were sampled.
    pub site: Option<String>,
    /// The device ordinal.
    #[serde(default)]
    pub device: u32,
    /// Live bytes.
    pub bytes: u64,
    /// Live blocks.
    pub blocks: u64,
    /// Age of the oldest of these blocks, in milliseconds, when known (provenance on).
    #[serde(default)]
    pub oldest_age_ms: Option<u64>,
}

/// A mark ([`crate::provenance::Mark`]) as published: its id and label, and what was allocated
/// since it and is still live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkRecord {
    /// The mark's id, as `mark()` returned it.
    pub id: u64,
    /// Its label, when given.
    #[serde(default)]
    pub label: Option<String>,
    /// When it was taken (Unix time, ms).
    pub unix_ms: u64,
    /// Bytes allocated since the mark and still live.
    pub live_bytes_since: u64,
    /// Blocks allocated since the mark and still live.
    pub live_blocks_since: u64,
}

/// The name under which untagged bytes are published (as in [`crate::OomReport::top_tags`]).
pub const NO_TAG: &str = "(no tag)";

/// One process's record, as written to `<pid>-<start_time>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Always [`RECORD_VERSION`] for records this code writes.
    pub version: u32,
    /// The cistern version that wrote it.
    #[serde(default)]
    pub writer: String,
    /// Process id.
    pub pid: u32,
    /// Process start time: field 22 of `/proc/<pid>/stat`, clock ticks since boot.
    pub start_time: u64,
    /// `/proc/sys/kernel/random/boot_id` when the record was written.
    pub boot_id: String,
    /// The effective user id of the process.
    pub uid: u32,
    /// The command line, argument by argument (invalid UTF-8 replaced), at most
    /// [`MAX_CMDLINE_BYTES`] in all.
    pub cmdline: Vec<String>,
    /// Whether `cmdline` was cut.
    #[serde(default)]
    pub cmdline_truncated: bool,
    /// Running or exited.
    pub state: State,
    /// When this record was written (Unix time, ms). The record is rewritten only when something
    /// changed, so this is the time of the last change; liveness comes from [`is_alive`].
    pub updated_unix_ms: u64,
    /// The devices.
    pub devices: Vec<DeviceRecord>,
    /// The last out-of-memory report, if any.
    #[serde(default)]
    pub last_oom: Option<OomRecord>,
    /// In an `exited` record, the blocks still live at exit (at most [`MAX_LEAKS`] entries,
    /// largest first).
    #[serde(default)]
    pub leaks: Vec<LeakEntry>,
    /// Whether `leaks` was cut to fit.
    #[serde(default)]
    pub leaks_truncated: bool,
    /// Marks, when provenance is on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub marks: Vec<MarkRecord>,
    /// The driver the process's allocator ran on: `cuda`, or `sim` for the simulated GPU (whose
    /// devices have GPU-like UUIDs but hold no device memory). `None` in records written before
    /// the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// The process's cgroup path (see [`Placement::cgroup`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The container id parsed from the cgroup path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The Kubernetes pod UID parsed from the cgroup path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The container runtime named by the cgroup path (`containerd`, `cri-o`, `docker`,
    /// `podman`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// The systemd unit of a process in no container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub systemd_unit: Option<String>,
    /// The process's pid in each pid namespace its `/proc` shows, outermost first (`NSpid:`);
    /// the last is [`Record::pid`]. One entry (or none) when the process cannot see an outer
    /// namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ns_pids: Vec<u32>,
    /// The inode of the process's pid namespace: a reader in another namespace finds the
    /// process by it ([`PidResolver`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_ns: Option<u64>,
}

impl Record {
    /// The file name of this record: `<pid>-<start_time>.json`.
    pub fn file_name(&self) -> String {
        file_name(self.pid, self.start_time)
    }

    /// Whether the process that wrote this record is alive, dead, a zombie, or its pid reused;
    /// records from another boot are [`Liveness::OtherBoot`].
    ///
    /// A record written in another pid namespace (a container) is looked up by its namespace
    /// and start time (see [`Record::liveness_with`]); this scans `/proc` each call: readers of
    /// many records share one [`PidResolver`].
    pub fn liveness(&self) -> Liveness {
        self.liveness_with(&mut PidResolver::new()).0
    }

    /// Whether the process is alive, and its pid in the reader's pid namespace (the host pid of
    /// a process in a container, when the reader is on the host): `None` when it is not
    /// visible there.
    pub fn liveness_with(&self, pids: &mut PidResolver) -> (Liveness, Option<u32>) {
        if matches!(boot_id(), Ok(b) if b != self.boot_id) {
            return (Liveness::OtherBoot, None);
        }
        let host_guess = (self.ns_pids.len() > 1).then(|| self.ns_pids[0]);
        match pids.resolve(self.pid, self.start_time, self.pid_ns, host_guess) {
            Some(pid) => (is_alive(pid, self.start_time), Some(pid)),
            // In another namespace and not found: dead when the reader sees every namespace
            // (the host's), else possibly running out of its sight.
            None if pids.sees_every_namespace() => (Liveness::Dead, None),
            None => (Liveness::Unseen, None),
        }
    }

    /// Whether the record was written on the simulated GPU.
    pub fn simulated(&self) -> bool {
        self.driver.as_deref() == Some("sim")
    }

    /// Where the process ran, as recorded.
    pub fn placement(&self) -> Placement {
        Placement {
            cgroup: self.cgroup.clone(),
            container_id: self.container_id.clone(),
            pod_uid: self.pod_uid.clone(),
            runtime: self.runtime.clone(),
            systemd_unit: self.systemd_unit.clone(),
            ns_pids: self.ns_pids.clone(),
            pid_ns: self.pid_ns,
        }
    }

    /// Bytes the record says the process still held from the driver (Σ reserved).
    pub fn reserved(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.reserved)
            .fold(0, u64::saturating_add)
    }
}

pub(super) fn file_name(pid: u32, start_time: u64) -> String {
    format!("{pid}-{start_time}.json")
}

/// Parses a record file's name, `<pid>-<start_time>.json`.
pub fn parse_file_name(name: &OsStr) -> Option<(u32, u64)> {
    let name = name.to_str()?;
    let stem = name.strip_suffix(".json")?;
    let (pid, start) = stem.split_once('-')?;
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(pid) || !all_digits(start) {
        return None;
    }
    Some((pid.parse().ok()?, start.parse().ok()?))
}

/// Why one record file could not be read (for readers: a value, never a panic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordError {
    /// The file is a symlink (not followed).
    Symlink,
    /// The file is not a regular file.
    NotRegular,
    /// The file is larger than [`MAX_RECORD_BYTES`].
    TooLarge(u64),
    /// Opening or reading failed.
    Io(String),
    /// The content is not a record (bad UTF-8, bad JSON, missing or mistyped fields).
    Parse(String),
    /// The record's `version` is not one this code reads.
    UnsupportedVersion(u64),
    /// The directory holds more records than a reader reads ([`MAX_RECORDS_PER_DIR`] files,
    /// [`MAX_DIR_BYTES`] in all): these were left out, unread (one entry, under the
    /// directory's path).
    TooMany {
        /// Record files left out.
        left_out: usize,
    },
    /// The record's pid and start time do not match its file name.
    NameMismatch {
        /// From the file name.
        file: (u32, u64),
        /// From the content.
        record: (u32, u64),
    },
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::Symlink => f.write_str("is a symlink (not followed)"),
            RecordError::NotRegular => f.write_str("is not a regular file"),
            RecordError::TooLarge(n) => write!(
                f,
                "is {n} bytes, over the {MAX_RECORD_BYTES}-byte limit for a record"
            ),
            RecordError::Io(m) => write!(f, "cannot be read: {m}"),
            RecordError::Parse(m) => write!(f, "is not a cistern record: {m}"),
            RecordError::TooMany { left_out } => write!(
                f,
                "holds more records than a reader reads ({MAX_RECORDS_PER_DIR} files or \
                 {} MiB): {left_out} left out unread; remove the stale ones \
                 (`cistern doctor --clean-stale`, by the directory's owner)",
                MAX_DIR_BYTES >> 20
            ),
            RecordError::UnsupportedVersion(v) => write!(
                f,
                "has record version {v}; this cistern reads version {RECORD_VERSION}"
            ),
            RecordError::NameMismatch { file, record } => write!(
                f,
                "names process {}-{} but holds the record of {}-{}",
                file.0, file.1, record.0, record.1
            ),
        }
    }
}

impl std::error::Error for RecordError {}

/// Serialises a record, dropping leak entries until it fits in [`MAX_RECORD_BYTES`] (readers
/// refuse larger files).
pub fn encode_record(record: &mut Record) -> Vec<u8> {
    loop {
        let bytes = serde_json::to_vec(record).expect("a record always serialises");
        if bytes.len() as u64 <= MAX_RECORD_BYTES || record.leaks.is_empty() {
            return bytes;
        }
        let keep = record.leaks.len() / 2;
        record.leaks.truncate(keep);
        record.leaks_truncated = true;
    }
}

/// Parses a record from untrusted bytes: size limit, UTF-8, JSON, version. Never panics.
pub fn parse_record(bytes: &[u8]) -> Result<Record, RecordError> {
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(RecordError::TooLarge(bytes.len() as u64));
    }
    #[derive(Deserialize)]
    struct Version {
        version: u64,
    }
    let v: Version = serde_json::from_slice(bytes)
        .map_err(|e| RecordError::Parse(format!("no record version: {e}")))?;
    if v.version != RECORD_VERSION as u64 {
        return Err(RecordError::UnsupportedVersion(v.version));
    }
    let r: Record = serde_json::from_slice(bytes).map_err(|e| RecordError::Parse(e.to_string()))?;
    if r.devices.len() > MAX_DEVICES {
        return Err(RecordError::Parse(format!(
            "lists {} devices, over the limit of {MAX_DEVICES}",
            r.devices.len()
        )));
    }
    if let Some(d) = r.devices.iter().find(|d| {
        d.top_tags.len() > MAX_TOP || d.top_sites.len() > MAX_TOP || d.imported.len() > MAX_TOP
    }) {
        return Err(RecordError::Parse(format!(
            "device {} lists more than {MAX_TOP} tags, sites or senders (the writer publishes \
             at most {MAX_TOP})",
            d.index
        )));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names() {
        assert_eq!(parse_file_name(OsStr::new("12-345.json")), Some((12, 345)));
        for bad in [
            ".12-345.json.1.2.tmp",
            "12-.json",
            "-1-2.json",
            "1-2.json~",
            "a-2.json",
        ] {
            assert_eq!(parse_file_name(OsStr::new(bad)), None, "{bad}");
        }
    }

    /// Records as the v1 writer wrote them (produced by the code before the registry had its own
    /// record types), byte for byte: each must parse and re-encode to the same bytes, so that no
    /// edit to a type elsewhere changes the format other processes read.
    const V1_FULL: &str = include_str!("testdata/v1_full.json");
    const V1_NO_MARKS: &str = include_str!("testdata/v1_no_marks.json");
    /// A v1 record that leaves out every field with a default, and what it encodes to.
    const V1_SPARSE: &str = include_str!("testdata/v1_sparse.json");
    const V1_SPARSE_ENCODED: &str = include_str!("testdata/v1_sparse_encoded.json");

    fn reencode(json: &str) -> String {
        let mut r = parse_record(json.trim_end().as_bytes()).expect("a v1 record parses");
        String::from_utf8(encode_record(&mut r)).unwrap()
    }

    #[test]
    fn v1_records_reencode_identically() {
        for json in [V1_FULL, V1_NO_MARKS] {
            assert_eq!(reencode(json), json.trim_end());
        }
        assert_eq!(reencode(V1_SPARSE), V1_SPARSE_ENCODED.trim_end());
        let r = parse_record(V1_FULL.trim_end().as_bytes()).unwrap();
        let oom = r.last_oom.expect("the fixture has an OOM");
        assert_eq!(oom.other_processes[0].pid, 77);
        assert_eq!(oom.top_sites[0].name, "model.py:7 build");
        assert_eq!(r.marks[1].label, None);
    }

    #[test]
    fn new_fields_are_optional_and_round_trip() {
        // A v1 record from before the fields: none of them, and none written back.
        let r = parse_record(V1_FULL.trim_end().as_bytes()).unwrap();
        assert_eq!(r.driver, None);
        assert_eq!(r.placement(), Placement::default());
        assert!(!r.simulated());
        let mut r2 = r.clone();
        r2.driver = Some("sim".into());
        r2.cgroup = Some("/kubepods.slice/x.scope".into());
        r2.container_id = Some("ab".repeat(32));
        r2.pod_uid = Some("6553a60b-2b97-442a-b6da-a5704d81dd98".into());
        r2.runtime = Some("containerd".into());
        r2.ns_pids = vec![4242, 1];
        r2.pid_ns = Some(4026532000);
        let bytes = encode_record(&mut r2.clone());
        let back = parse_record(&bytes).unwrap();
        assert_eq!(back, r2);
        assert!(back.simulated());
        assert_eq!(back.placement().host_pid(), Some(4242));
    }

    #[test]
    fn imports_are_optional_round_trip_and_bounded() {
        let r = parse_record(V1_FULL.trim_end().as_bytes()).unwrap();
        assert!(r.devices.iter().all(|d| d.imported.is_empty()));
        let mut r2 = r.clone();
        r2.devices[0].imported = vec![ImportRecord {
            from_pid: 4242,
            from_start_time: 99,
            bytes: 3 << 30,
        }];
        r2.devices[0].imported_other = 7 << 20;
        let bytes = encode_record(&mut r2.clone());
        assert!(String::from_utf8_lossy(&bytes).contains(r#""imported":[{"from_pid":4242"#));
        assert!(String::from_utf8_lossy(&bytes).contains(r#""imported_other":7340032"#));
        assert_eq!(parse_record(&bytes).unwrap(), r2);
        // More senders than a writer publishes: refused, as too many tags are.
        r2.devices[0].imported = (0..=MAX_TOP as u32)
            .map(|from_pid| ImportRecord {
                from_pid,
                from_start_time: 0,
                bytes: 1,
            })
            .collect();
        let bytes = encode_record(&mut r2);
        let e = parse_record(&bytes).unwrap_err();
        assert!(
            matches!(e, RecordError::Parse(ref m) if m.contains("senders")),
            "{e:?}"
        );
    }

    #[test]
    fn v1_oom_fields_are_all_required() {
        // The OOM part of a v1 record has no defaults: a record missing one of its fields is
        // refused, as it always was.
        let json = V1_SPARSE.trim_end().replace(r#","reason":"""#, "");
        assert_ne!(json, V1_SPARSE.trim_end());
        assert!(matches!(
            parse_record(json.as_bytes()),
            Err(RecordError::Parse(_))
        ));
    }
}
