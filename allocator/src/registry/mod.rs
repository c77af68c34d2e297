//! The cross-process registry: each process publishes a small JSON record of its state, so that
//! `cistern ps / leaks / doctor` can tell who holds device memory, including processes that died.
//!
//! # Layout
//!
//! One file per process, `<pid>-<start_time>.json`, in a per-user directory ([`default_dir`]:
//! `/dev/shm/cistern-<uid>`, else `$XDG_RUNTIME_DIR/cistern`, else `/tmp/cistern-<uid>`;
//! `CISTERN_CONF=registry_dir:PATH` overrides it). The directory is created with mode 0700 and
//! refused when it is a symlink (in every spelling: `link/` and `link/.` name the link too),
//! not owned by the effective user, or group/other-accessible ([`ensure_dir`]). Record files are mode 0600 and replaced atomically: a temporary file in the
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
//! (the allocator) for a [`ProcessSnapshot`] every `interval` (1 s by default) and rewrites the
//! record when the snapshot changed. Nothing runs on the allocation path.
//! [`RegistryHandle::finish`] writes the final record (state `exited`, with the blocks still live
//! as [`LeakEntry`]s); a Rust library has no destructor that runs at process exit (statics are
//! never dropped), so [`install_exit_hook`] registers a C `atexit` callback that calls it. A
//! process killed with SIGKILL leaves its last `running` record: its last known state.
//!
//! # Reading
//!
//! Records are untrusted input: [`read_all`] and [`read_record`] refuse symlinks and non-regular
//! files, read at most [`MAX_RECORD_BYTES`], and return parse errors and unknown versions as
//! values ([`RecordError`]); they never panic.
//!
//! # Files
//!
//! `record.rs` owns the v1 schema (its own types, never the allocator's in-memory ones), parsing
//! and encoding; `process.rs` identity and liveness from `/proc`; `container.rs` where a
//! process runs (cgroup, container, pod, pid namespaces) and finding it from another
//! namespace; `dir.rs` the directory, atomic
//! writes and sweeping; `publisher.rs` the thread, its handle and the exit hook; `read.rs`
//! reading records back. Nothing here names the allocator's types: the allocator implements
//! [`RecordSource`] for itself.

use std::fmt;
use std::io;
use std::path::PathBuf;

mod container;
mod dir;
mod process;
mod publisher;
mod read;
mod record;

pub use container::{
    parse_cgroup, parse_nspid, pid_ns_of, PidResolver, Placement, MAX_CGROUP_BYTES,
};
pub use dir::{
    check_dir, check_dir_of, default_dir, dir_for, ensure_dir, expirable, expire_records,
    sweep_temporaries, write_atomic,
};
pub use process::{
    boot_id, euid, is_alive, parse_stat, process_start_time, split_cmdline, Identity, Liveness,
};
pub use publisher::{
    build_record, install_exit_hook, ProcessSnapshot, RecordSource, Registry, RegistryHandle,
    DEFAULT_INTERVAL, MIN_INTERVAL,
};
pub use read::{read_all, read_record, RecordFile};
pub use record::{
    encode_record, parse_file_name, parse_record, AttributionRecord, DeviceRecord, ImportRecord,
    LeakEntry, MarkRecord, OomRecord, OtherProcessRecord, Record, RecordError, State,
    MAX_CMDLINE_BYTES, MAX_DEVICES, MAX_DIR_BYTES, MAX_LEAKS, MAX_RECORDS_PER_DIR,
    MAX_RECORD_BYTES, MAX_TOP, NO_TAG, RECORD_VERSION,
};

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
