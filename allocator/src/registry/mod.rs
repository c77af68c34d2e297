//! The cross-process registry: each process publishes a small JSON record of its state, so that
//! `cistern ps / leaks / doctor` can tell who holds device memory, including processes that died.
//!
//! # Layout
//!
//! One file per process, `<pid>-<start_time>.json`, in a per-user directory ([`default_dir`]:
//! `/dev/shm/cistern-<uid>`, else `$XDG_RUNTIME_DIR/cistern`, else `/tmp/cistern-<uid>`;
//! `CISTERN_CONF=registry_dir:PATH` overrides it). The directory is created with mode 0700 and
//! refused when it is a symlink, not owned by the effective user, or group/other-accessible
//! ([`ensure_dir`]). Record files are mode 0600 and replaced atomically: a temporary file in the
//! same directory, opened with `O_CREAT|O_EXCL|O_NOFOLLOW`, then renamed over the record, so a
//! reader sees either the old or the new record, never a torn one. No path is opened through a
//! symlink.
//!
//! A process is identified by `(pid, start_time)`, where `start_time` is field 22 of
//! `/proc/<pid>/stat` (clock ticks since boot), so a reused pid is not taken for the dead process
//! ([`is_alive`]). The boot id (`/proc/sys/kernel/random/boot_id`) marks records left from an
//! earlier boot.
//!
//! # Publishing
//!
//! [`Registry::start`] writes a first record, then a background thread asks a [`RecordSource`]
//! (the pool) for a [`ProcessSnapshot`] every `interval` (1 s by default) and rewrites the record
//! when the snapshot changed. Nothing runs on the allocation path. [`RegistryHandle::finish`]
//! writes the final record (state `exited`, with the blocks still live as [`LeakEntry`]s); a Rust
//! library has no destructor that runs at process exit (statics are never dropped), so
//! [`install_exit_hook`] registers a C `atexit` callback that calls it. A process killed with
//! SIGKILL leaves its last `running` record: its last known state.
//!
//! # Reading
//!
//! Records are untrusted input: [`read_all`] and [`read_record`] refuse symlinks and non-regular
//! files, read at most [`MAX_RECORD_BYTES`], and return parse errors and unknown versions as
//! values ([`RecordError`]); they never panic.

use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Attribution, OomReport};

/// The record format's version; readers refuse other versions with
/// [`RecordError::UnsupportedVersion`].
pub const RECORD_VERSION: u32 = 1;
/// Readers refuse record files larger than this.
pub const MAX_RECORD_BYTES: u64 = 1 << 20;
/// The command line is cut to this many bytes (the record says when it was).
pub const MAX_CMDLINE_BYTES: usize = 4096;
/// At most this many tags and sites per device are published.
pub const MAX_TOP: usize = 32;
/// At most this many leak entries are published.
pub const MAX_LEAKS: usize = 1000;
/// The shortest republishing interval.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// The default republishing interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

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

/// One device of a process, as the pool sees it.
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
    /// Bytes the pool holds from the driver.
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
    pub top_tags: Vec<Attribution>,
    /// Live bytes by call site, largest first (at most [`MAX_TOP`]).
    #[serde(default)]
    pub top_sites: Vec<Attribution>,
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

/// A `mark()` and what was allocated since it and is still live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
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

/// What the pool hands the registry: the changing part of a record. The registry adds the
/// process's identity and the time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessSnapshot {
    /// Each device the process has a pool on.
    pub devices: Vec<DeviceRecord>,
    /// The last out-of-memory report, if any.
    pub last_oom: Option<OomReport>,
    /// Marks, when provenance is on.
    pub marks: Vec<Mark>,
}

/// Where the registry gets its snapshots: implemented by the pool (and by fakes in tests).
///
/// `snapshot` is called from the registry's background thread, at most once per interval.
pub trait RecordSource {
    /// The process's current state.
    fn snapshot(&self) -> ProcessSnapshot;
    /// The blocks live now, grouped by tag and site, for the final record. The default is none
    /// known.
    fn leaks(&self) -> Vec<LeakEntry> {
        Vec::new()
    }
}

/// The name under which untagged bytes are published (as in [`OomReport::top_tags`]).
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
    pub last_oom: Option<OomReport>,
    /// In an `exited` record, the blocks still live at exit (at most [`MAX_LEAKS`] entries,
    /// largest first).
    #[serde(default)]
    pub leaks: Vec<LeakEntry>,
    /// Whether `leaks` was cut to fit.
    #[serde(default)]
    pub leaks_truncated: bool,
    /// Marks, when provenance is on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub marks: Vec<Mark>,
}

impl Record {
    /// The file name of this record: `<pid>-<start_time>.json`.
    pub fn file_name(&self) -> String {
        file_name(self.pid, self.start_time)
    }

    /// Whether the process that wrote this record is alive, dead, a zombie, or its pid reused;
    /// records from another boot are [`Liveness::OtherBoot`].
    pub fn liveness(&self) -> Liveness {
        match boot_id() {
            Ok(b) if b != self.boot_id => Liveness::OtherBoot,
            _ => is_alive(self.pid, self.start_time),
        }
    }
}

fn file_name(pid: u32, start_time: u64) -> String {
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

// ---------------------------------------------------------------------------------------------
// Errors

/// Why the registry could not be used (for writers).
#[derive(Debug)]
pub enum RegistryError {
    /// The directory is unsafe to use; the message says why and what to do.
    UnsafeDir {
        /// The directory.
        path: PathBuf,
        /// Why, and the fix.
        reason: String,
    },
    /// A file operation failed.
    Io {
        /// What was being done, to which path.
        what: String,
        /// The error.
        source: io::Error,
    },
    /// Reading this process's identity from `/proc` failed.
    Identity(String),
}

impl fmt::Display for RegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryError::UnsafeDir { path, reason } => {
                write!(f, "registry directory {}: {reason}", path.display())
            }
            RegistryError::Io { what, source } => write!(f, "registry: {what}: {source}"),
            RegistryError::Identity(m) => write!(f, "registry: {m}"),
        }
    }
}

impl std::error::Error for RegistryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RegistryError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RegistryError {
    let what = what.into();
    move |source| RegistryError::Io { what, source }
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

// ---------------------------------------------------------------------------------------------
// Process identity from /proc

/// The effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// This boot's id, from `/proc/sys/kernel/random/boot_id`.
pub fn boot_id() -> io::Result<String> {
    Ok(fs::read_to_string("/proc/sys/kernel/random/boot_id")?
        .trim()
        .to_string())
}

/// Parses the fields after the command name of a `/proc/<pid>/stat` line: the state character
/// (field 3) and the start time (field 22). The command name may hold spaces and parentheses, so
/// the fields start after the last `)`.
pub fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was consumed; field 22 is 18 further.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

fn read_stat(pid: u32) -> io::Result<(char, u64)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected /proc/{pid}/stat"),
        )
    })
}

/// The start time (field 22 of `/proc/<pid>/stat`, clock ticks since boot) of a process.
pub fn process_start_time(pid: u32) -> io::Result<u64> {
    read_stat(pid).map(|s| s.1)
}

/// Whether the process that published a record still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Liveness {
    /// The pid runs and started when the record says: the same process.
    Alive,
    /// The process has exited but its parent has not reaped it (its GPU context may still be
    /// held while the driver cleans up).
    Zombie,
    /// No process has the pid.
    Dead,
    /// A process has the pid but started at another time: the recorded one is dead.
    PidReused,
    /// The record is from an earlier boot: the process is long gone.
    OtherBoot,
}

/// Whether process `(pid, start_time)` is alive, from `/proc/<pid>/stat`.
pub fn is_alive(pid: u32, start_time: u64) -> Liveness {
    if pid == 0 || pid > i32::MAX as u32 {
        return Liveness::Dead;
    }
    match read_stat(pid) {
        Ok((_, st)) if st != start_time => Liveness::PidReused,
        Ok(('Z' | 'X' | 'x', _)) => Liveness::Zombie,
        Ok(_) => Liveness::Alive,
        // Unreadable stat: ask the kernel whether the pid exists at all.
        Err(_) if pid_exists(pid) => Liveness::Alive,
        Err(_) => Liveness::Dead,
    }
}

/// Who a process is: what identifies its record, and what does not change while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Process id.
    pub pid: u32,
    /// Start time (clock ticks since boot).
    pub start_time: u64,
    /// Boot id.
    pub boot_id: String,
    /// Effective user id.
    pub uid: u32,
    /// Command line, cut to [`MAX_CMDLINE_BYTES`].
    pub cmdline: Vec<String>,
    /// Whether it was cut.
    pub cmdline_truncated: bool,
}

/// Splits a `/proc/<pid>/cmdline` blob into arguments, at most `limit` bytes in all; returns
/// whether it cut anything.
pub fn split_cmdline(raw: &[u8], limit: usize) -> (Vec<String>, bool) {
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    let mut out = Vec::new();
    let mut used = 0;
    if raw.is_empty() {
        return (out, false);
    }
    for arg in raw.split(|&b| b == 0) {
        let s = String::from_utf8_lossy(arg);
        if used + s.len() > limit {
            let mut cut = limit - used;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            out.push(s[..cut].to_string());
            return (out, true);
        }
        used += s.len();
        out.push(s.into_owned());
    }
    (out, false)
}

impl Identity {
    /// This process's identity, from `/proc/self`.
    pub fn current() -> Result<Identity, RegistryError> {
        let pid = std::process::id();
        let start_time = process_start_time(pid)
            .map_err(|e| RegistryError::Identity(format!("reading /proc/{pid}/stat: {e}")))?;
        let boot_id =
            boot_id().map_err(|e| RegistryError::Identity(format!("reading boot_id: {e}")))?;
        let raw = fs::read("/proc/self/cmdline").unwrap_or_default();
        let (cmdline, cmdline_truncated) = split_cmdline(&raw, MAX_CMDLINE_BYTES);
        Ok(Identity {
            pid,
            start_time,
            boot_id,
            uid: euid(),
            cmdline,
            cmdline_truncated,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The directory

/// The default registry directory for this user: `/dev/shm/cistern-<uid>` when `/dev/shm` is a
/// directory, else `$XDG_RUNTIME_DIR/cistern` when set, else `/tmp/cistern-<uid>`.
pub fn default_dir() -> PathBuf {
    let uid = euid();
    if Path::new("/dev/shm").is_dir() {
        return PathBuf::from(format!("/dev/shm/cistern-{uid}"));
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|x| !x.is_empty()) {
        return Path::new(&x).join("cistern");
    }
    PathBuf::from(format!("/tmp/cistern-{uid}"))
}

/// The registry directory a configuration asks for: `None` when `registry:off`.
pub fn dir_for(config: &crate::Config) -> Option<PathBuf> {
    if !config.registry {
        return None;
    }
    Some(config.registry_dir.clone().unwrap_or_else(default_dir))
}

/// Creates `dir` (mode 0700, with its missing parents) or checks the existing one: refused when
/// it is a symlink, not a directory, not owned by the effective user, or accessible to group or
/// others. The error says how to fix it.
pub fn ensure_dir(dir: &Path) -> Result<(), RegistryError> {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io_err(format!("creating {}", dir.display())))?;
        }
        Err(e) => return Err(io_err(format!("inspecting {}", dir.display()))(e)),
        Ok(_) => {}
    }
    check_dir(dir)
}

/// Checks an existing registry directory (see [`ensure_dir`]).
pub fn check_dir(dir: &Path) -> Result<(), RegistryError> {
    let unsafe_dir = |reason: String| RegistryError::UnsafeDir {
        path: dir.to_path_buf(),
        reason,
    };
    let fix = "remove it, or point CISTERN_CONF=registry_dir:PATH at a directory of your own \
               with mode 0700 (or set registry:off)";
    let md = fs::symlink_metadata(dir).map_err(io_err(format!("inspecting {}", dir.display())))?;
    if md.file_type().is_symlink() {
        return Err(unsafe_dir(format!(
            "is a symlink, which the registry never follows: {fix}"
        )));
    }
    if !md.is_dir() {
        return Err(unsafe_dir(format!("is not a directory: {fix}")));
    }
    let me = euid();
    if md.uid() != me {
        return Err(unsafe_dir(format!(
            "is owned by uid {}, not by this user (uid {me}): {fix}",
            md.uid()
        )));
    }
    let mode = md.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(unsafe_dir(format!(
            "has mode {mode:04o}, open to group or others: run `chmod 700 {}`, or {fix}",
            dir.display()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Writing

/// Writes `bytes` as `dir/name` atomically: a new temporary file in `dir` (mode 0600,
/// `O_EXCL|O_NOFOLLOW`), optionally fsynced, renamed over `name`. A symlink at `name` is
/// replaced, not followed.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8], fsync: bool) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(".{name}.{}.{n}.{nanos}.tmp", std::process::id()));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if fsync {
            f.sync_all()?;
        }
        drop(f);
        fs::rename(&tmp, dir.join(name))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The pid in a temporary file's name (`.<record>.<pid>.<n>.<nanos>.tmp`), if it is one.
fn temporary_writer(name: &OsStr) -> Option<u32> {
    let name = name.to_str()?.strip_prefix('.')?.strip_suffix(".tmp")?;
    let mut parts = name.rsplitn(4, '.');
    let (_nanos, _n, pid, record) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    parse_file_name(OsStr::new(record))?;
    pid.parse().ok()
}

/// Removes temporary files left by writers that died mid-write (best effort; returns how many).
pub fn sweep_temporaries(dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Some(pid) = temporary_writer(&e.file_name()) else {
            continue;
        };
        if pid_exists(pid) {
            continue;
        }
        if fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

fn pid_exists(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Builds the record for `identity` from a snapshot, cutting lists to their limits.
pub fn build_record(
    identity: &Identity,
    snapshot: &ProcessSnapshot,
    state: State,
    mut leaks: Vec<LeakEntry>,
) -> Record {
    let mut devices = snapshot.devices.clone();
    for d in &mut devices {
        d.top_tags.truncate(MAX_TOP);
        d.top_sites.truncate(MAX_TOP);
    }
    leaks.sort_by_key(|l| std::cmp::Reverse(l.bytes));
    let leaks_truncated = leaks.len() > MAX_LEAKS;
    leaks.truncate(MAX_LEAKS);
    Record {
        version: RECORD_VERSION,
        writer: env!("CARGO_PKG_VERSION").to_string(),
        pid: identity.pid,
        start_time: identity.start_time,
        boot_id: identity.boot_id.clone(),
        uid: identity.uid,
        cmdline: identity.cmdline.clone(),
        cmdline_truncated: identity.cmdline_truncated,
        state,
        updated_unix_ms: now_unix_ms(),
        devices,
        last_oom: snapshot.last_oom.clone(),
        leaks,
        leaks_truncated,
        marks: snapshot.marks.clone(),
    }
}

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

/// A registry directory and the identity this process publishes under.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
    identity: Identity,
    fsync: bool,
}

impl Registry {
    /// Opens (creating or checking, see [`ensure_dir`]) `dir` for this process.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Registry, RegistryError> {
        Registry::with_identity(dir, Identity::current()?)
    }

    /// Opens `dir` to publish under a given identity (tests; a supervisor writing for a child).
    pub fn with_identity(
        dir: impl Into<PathBuf>,
        identity: Identity,
    ) -> Result<Registry, RegistryError> {
        let dir = dir.into();
        ensure_dir(&dir)?;
        sweep_temporaries(&dir);
        Ok(Registry {
            dir,
            identity,
            fsync: false,
        })
    }

    /// fsync each record before renaming it into place (off by default: the default directory
    /// is in memory, and a record only has to survive the process, not the machine).
    pub fn set_fsync(&mut self, fsync: bool) {
        self.fsync = fsync;
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The identity records are published under.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The path of this process's record.
    pub fn record_path(&self) -> PathBuf {
        self.dir
            .join(file_name(self.identity.pid, self.identity.start_time))
    }

    /// Writes this process's record once, atomically.
    pub fn publish(
        &self,
        snapshot: &ProcessSnapshot,
        state: State,
        leaks: Vec<LeakEntry>,
    ) -> Result<(), RegistryError> {
        let mut record = build_record(&self.identity, snapshot, state, leaks);
        let bytes = encode_record(&mut record);
        let name = record.file_name();
        write_atomic(&self.dir, &name, &bytes, self.fsync).map_err(io_err(format!(
            "writing {}",
            self.dir.join(&name).display()
        )))
    }

    /// Removes this process's record (for a process that wants to leave no trace).
    pub fn remove(&self) -> Result<(), RegistryError> {
        match fs::remove_file(self.record_path()) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(io_err(format!("removing {}", self.record_path().display()))(e))
            }
            _ => Ok(()),
        }
    }

    /// Opens `dir`, publishes a first record, and starts the background thread that republishes
    /// it from `source` at most every `interval` when it changed. See [`RegistryHandle`].
    pub fn start(
        dir: impl Into<PathBuf>,
        source: Arc<dyn RecordSource + Send + Sync>,
        interval: Duration,
    ) -> Result<RegistryHandle, RegistryError> {
        Registry::open(dir)?.spawn(source, interval)
    }

    /// Publishes a first record and starts the background thread (see [`Registry::start`]).
    /// Intervals under [`MIN_INTERVAL`] are raised to it.
    pub fn spawn(
        self,
        source: Arc<dyn RecordSource + Send + Sync>,
        interval: Duration,
    ) -> Result<RegistryHandle, RegistryError> {
        let first = source.snapshot();
        self.publish(&first, State::Running, Vec::new())?;
        let shared = Arc::new(Shared {
            registry: self,
            source,
            stop: Mutex::new(false),
            wake: Condvar::new(),
            last: Mutex::new(Some(first)),
            finished: AtomicBool::new(false),
            write_errors: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let interval = interval.max(MIN_INTERVAL);
        let thread = std::thread::Builder::new()
            .name("cistern-registry".into())
            .spawn(move || s.run(interval))
            .map_err(io_err("starting the registry thread"))?;
        Ok(RegistryHandle(Arc::new(HandleInner {
            shared,
            thread: Mutex::new(Some(thread)),
        })))
    }
}

struct Shared {
    registry: Registry,
    source: Arc<dyn RecordSource + Send + Sync>,
    stop: Mutex<bool>,
    wake: Condvar,
    last: Mutex<Option<ProcessSnapshot>>,
    finished: AtomicBool,
    write_errors: AtomicU64,
}

impl Shared {
    fn run(&self, interval: Duration) {
        loop {
            {
                let stop = self.stop.lock().unwrap_or_else(|e| e.into_inner());
                let (stop, _) = self
                    .wake
                    .wait_timeout_while(stop, interval, |s| !*s)
                    .unwrap_or_else(|e| e.into_inner());
                if *stop {
                    return;
                }
            }
            self.refresh();
        }
    }

    /// Republishes when the snapshot changed; returns whether it wrote.
    fn refresh(&self) -> bool {
        let snap = self.source.snapshot();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_ref() == Some(&snap) {
            return false;
        }
        match self.registry.publish(&snap, State::Running, Vec::new()) {
            Ok(()) => {
                *last = Some(snap);
                true
            }
            Err(e) => {
                self.write_errors.fetch_add(1, Ordering::Relaxed);
                crate::log_rate_limited(&format!("cistern: {e}"));
                false
            }
        }
    }
}

struct HandleInner {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl HandleInner {
    fn stop_thread(&self) {
        *self.shared.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.shared.wake.notify_all();
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// Whether this is the process the handle publishes for. After a fork the child inherits the
    /// handle (and an installed exit hook) but is another process: it must neither overwrite its
    /// parent's record nor call into the source (whose locks may have been held at the fork).
    fn in_owner(&self) -> bool {
        std::process::id() == self.shared.registry.identity.pid
    }

    fn finish_with(&self, leaks: impl FnOnce() -> Vec<LeakEntry>) -> Result<(), RegistryError> {
        if !self.in_owner() || self.shared.finished.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let leaks = leaks();
        self.stop_thread();
        let snap = self.shared.source.snapshot();
        self.shared.registry.publish(&snap, State::Exited, leaks)
    }
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        let source = Arc::clone(&self.shared.source);
        if let Err(e) = self.finish_with(|| source.leaks()) {
            crate::log_rate_limited(&format!("cistern: {e}"));
        }
    }
}

/// The running publisher. Cloning shares it; when the last clone is dropped without
/// [`finish`](RegistryHandle::finish), the final record is written with the source's
/// [`leaks`](RecordSource::leaks).
#[derive(Clone)]
pub struct RegistryHandle(Arc<HandleInner>);

impl fmt::Debug for RegistryHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryHandle")
            .field("record", &self.record_path())
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl RegistryHandle {
    /// Stops the background thread and writes the final record: state `exited`, with `leaks`
    /// (the blocks still live). Later calls, and calls from a forked child, do nothing.
    pub fn finish(&self, leaks: Vec<LeakEntry>) -> Result<(), RegistryError> {
        self.0.finish_with(|| leaks)
    }

    /// [`finish`](RegistryHandle::finish) with the source's own [`leaks`](RecordSource::leaks).
    pub fn finish_from_source(&self) -> Result<(), RegistryError> {
        let source = Arc::clone(&self.0.shared.source);
        self.0.finish_with(|| source.leaks())
    }

    /// Republishes now if the snapshot changed (without waiting for the interval); returns
    /// whether it wrote. Does nothing once finished.
    pub fn refresh(&self) -> bool {
        if self.is_finished() || !self.0.in_owner() {
            return false;
        }
        self.0.shared.refresh()
    }

    /// Whether the final record was written.
    pub fn is_finished(&self) -> bool {
        self.0.shared.finished.load(Ordering::Acquire)
    }

    /// The path of the record.
    pub fn record_path(&self) -> PathBuf {
        self.0.shared.registry.record_path()
    }

    /// Background writes that failed (each is also logged, rate-limited).
    pub fn write_errors(&self) -> u64 {
        self.0.shared.write_errors.load(Ordering::Relaxed)
    }
}

static EXIT_HANDLES: Mutex<Vec<RegistryHandle>> = Mutex::new(Vec::new());
static EXIT_HOOK: std::sync::Once = std::sync::Once::new();

extern "C" fn run_exit_hook() {
    // Nothing may unwind out of an `extern "C"` function: a panic here would abort the
    // process at exit and replace its exit status.
    let _ = std::panic::catch_unwind(|| {
        let handles = match EXIT_HANDLES.try_lock() {
            Ok(mut v) => std::mem::take(&mut *v),
            Err(_) => return,
        };
        for h in handles {
            if let Err(e) = h.finish_from_source() {
                stderr_line!("cistern: {e}");
            }
        }
    });
}

/// Arranges for `handle`'s final record to be written when the process exits normally.
///
/// Rust runs no destructor at process exit (statics are never dropped), so this registers a C
/// `atexit` callback (once per process) that calls
/// [`finish_from_source`](RegistryHandle::finish_from_source) on every handle given here. It runs
/// when `main` returns or `exit()` is called (Python's interpreter exit included), not on
/// `_exit()`, `abort()`, a fatal signal or SIGKILL: those leave the last `running` record, which
/// readers show as the process's last known state. A forked child that inherits the hook does
/// not touch its parent's record. Returns false when the callback could not be registered.
pub fn install_exit_hook(handle: RegistryHandle) -> bool {
    EXIT_HANDLES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(handle);
    let mut ok = true;
    EXIT_HOOK.call_once(|| {
        // SAFETY: registering a function with no captured state, which never unwinds across the
        // C boundary (errors are printed, panics in it abort as any extern "C" fn does).
        ok = unsafe { libc::atexit(run_exit_hook) } == 0;
    });
    ok
}

// ---------------------------------------------------------------------------------------------
// Reading

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
    serde_json::from_slice(bytes).map_err(|e| RecordError::Parse(e.to_string()))
}

/// Reads one record file: no symlinks, regular files only, at most [`MAX_RECORD_BYTES`]. When
/// the file name is `<pid>-<start_time>.json`, the content must name the same process.
pub fn read_record(path: &Path) -> Result<Record, RecordError> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path);
    let f: File = match f {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(RecordError::Symlink),
        Err(e) => return Err(RecordError::Io(e.to_string())),
    };
    let md = f.metadata().map_err(|e| RecordError::Io(e.to_string()))?;
    if !md.is_file() {
        return Err(RecordError::NotRegular);
    }
    if md.len() > MAX_RECORD_BYTES {
        return Err(RecordError::TooLarge(md.len()));
    }
    let mut bytes = Vec::with_capacity(md.len() as usize);
    f.take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| RecordError::Io(e.to_string()))?;
    let record = parse_record(&bytes)?;
    if let Some(file) = path.file_name().and_then(parse_file_name) {
        let rec = (record.pid, record.start_time);
        if file != rec {
            return Err(RecordError::NameMismatch { file, record: rec });
        }
    }
    Ok(record)
}

/// A record file's path, and its record or why it was refused.
pub type RecordFile = (PathBuf, Result<Record, RecordError>);

/// Reads every record file (`<pid>-<start_time>.json`) in `dir`, each as a record or the reason
/// it was refused, sorted by file name. Temporary files and other names are skipped. A missing
/// directory gives no records; a directory that is a symlink is refused.
pub fn read_all(dir: &Path) -> Result<Vec<RecordFile>, RegistryError> {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(format!("inspecting {}", dir.display()))(e)),
        Ok(md) if md.file_type().is_symlink() => {
            return Err(RegistryError::UnsafeDir {
                path: dir.to_path_buf(),
                reason: "is a symlink, which the registry never follows".into(),
            })
        }
        Ok(_) => {}
    }
    let mut paths: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err(format!("listing {}", dir.display())))?
        .filter_map(|e| e.ok())
        .filter(|e| parse_file_name(&e.file_name()).is_some())
        .map(|e| e.path())
        .collect();
    paths.sort();
    Ok(paths
        .into_iter()
        .map(|p| {
            let r = read_record(&p);
            (p, r)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields() {
        let line = "1234 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20";
        assert_eq!(parse_stat(line), Some(('S', 987654)));
        assert_eq!(parse_stat("1 (x) S 1 2"), None);
        let me = std::process::id();
        // The test binary's name has no spaces, so a naive split finds field 22 too.
        let stat = fs::read_to_string("/proc/self/stat").unwrap();
        let naive: u64 = stat.split_whitespace().nth(21).unwrap().parse().unwrap();
        assert_eq!(process_start_time(me).unwrap(), naive);
        assert_eq!(
            is_alive(me, process_start_time(me).unwrap()),
            Liveness::Alive
        );
    }

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

    #[test]
    fn temporary_names() {
        let t = OsStr::new(".12-345.json.678.9.123456.tmp");
        assert_eq!(temporary_writer(t), Some(678));
        for bad in [
            "12-345.json",
            ".12-345.json.tmp",
            ".x.678.9.1.tmp",
            ".1-2.json.a.9.1.tmp",
        ] {
            assert_eq!(temporary_writer(OsStr::new(bad)), None, "{bad}");
        }
    }

    #[test]
    fn cmdline_is_cut() {
        assert_eq!(
            split_cmdline(b"python\0train.py\0", 100),
            (vec!["python".to_string(), "train.py".to_string()], false)
        );
        let (args, cut) = split_cmdline("ab\0cdé\0".as_bytes(), 4);
        assert!(cut);
        assert_eq!(args, vec!["ab".to_string(), "cd".to_string()]);
        assert_eq!(split_cmdline(b"", 10), (vec![], false));
    }
}
