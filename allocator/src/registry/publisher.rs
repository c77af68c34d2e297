//! Publishing: the [`RecordSource`] a process's allocator implements, the [`Registry`] that
//! writes this process's record, the background thread and its [`RegistryHandle`] that
//! republish it when it changed, and the `atexit` hook that writes the final record.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::dir::{ensure_dir, expire_records, sweep_temporaries, write_atomic};
use super::process::Identity;
use super::record::{
    encode_record, file_name, DeviceRecord, LeakEntry, MarkRecord, OomRecord, Record, State,
    MAX_LEAKS, MAX_TOP, RECORD_VERSION,
};
use super::{io_err, RegistryError};

/// The shortest republishing interval.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// The default republishing interval.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// What the source hands the registry: the changing part of a record. The registry adds the
/// process's identity and the time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessSnapshot {
    /// Each device the process's allocator has set up.
    pub devices: Vec<DeviceRecord>,
    /// The last out-of-memory report, if any.
    pub last_oom: Option<OomRecord>,
    /// Marks, when provenance is on.
    pub marks: Vec<MarkRecord>,
    /// The driver's short name (`cuda`, `sim`: [`crate::driver::Driver::name`]).
    pub driver: Option<String>,
}

/// Where the registry gets its snapshots: implemented by the allocator (and by fakes in tests).
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
        driver: snapshot.driver.clone(),
        cgroup: identity.placement.cgroup.clone(),
        container_id: identity.placement.container_id.clone(),
        pod_uid: identity.placement.pod_uid.clone(),
        runtime: identity.placement.runtime.clone(),
        systemd_unit: identity.placement.systemd_unit.clone(),
        ns_pids: identity.placement.ns_pids.clone(),
        pid_ns: identity.placement.pid_ns,
    }
}

/// A registry directory and the identity this process publishes under.
#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
    identity: Identity,
    fsync: bool,
    /// `registry_expire`, for the background thread's first pass ([`Registry::expire_from`]).
    expire_first: Option<Duration>,
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
            expire_first: None,
        })
    }

    /// fsync each record before renaming it into place (off by default: the default directory
    /// is in memory, and a record only has to survive the process, not the machine).
    pub fn set_fsync(&mut self, fsync: bool) {
        self.fsync = fsync;
    }

    /// Removes the expired records of processes that exited cleanly in the directory (see
    /// [`expire_records`]); `None` removes nothing. Returns how many were removed. A publisher
    /// has no NVML, so the record of a killed process, whose context the driver may still hold
    /// whatever its record says, is left for a reader that can ask NVML (`cistern ps`,
    /// `doctor`).
    pub fn expire(&self, max_age: Option<Duration>) -> usize {
        match max_age {
            Some(age) => {
                expire_records(&self.dir, age, now_unix_ms(), &|r| r.state != State::Exited).len()
            }
            None => 0,
        }
    }

    /// Makes the background thread ([`Registry::spawn`]) start with [`Registry::expire`]:
    /// reading every record of the directory is slow, and must not delay the allocation that
    /// starts the publisher.
    pub fn expire_from(mut self, max_age: Option<Duration>) -> Registry {
        self.expire_first = max_age;
        self
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
        if self.registry.expire_first.is_some() {
            self.registry.expire(self.registry.expire_first);
        }
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
        // A fork() child: the handles are the parent's, and their locks may be held forever.
        if crate::fork::is_fork_child() {
            return;
        }
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
        // `run_exit_hook` never unwinds across the C boundary: errors are printed, and its body
        // runs under catch_unwind.
        ok = crate::sys::atexit(run_exit_hook);
    });
    ok
}
