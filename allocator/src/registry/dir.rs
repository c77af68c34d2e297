//! The registry directory: where it is, creating and checking it (owner, mode, no symlinks),
//! atomic record writes, sweeping temporary files left by writers that died mid-write, and
//! removing expired records of exited processes.

use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::container::PidResolver;
use super::process::{euid, pid_exists, Liveness};
use super::read::read_record;
use super::record::{parse_file_name, Record, State};
use super::{io_err, RegistryError};

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

/// `dir` as the registry checks it: trailing slashes and `.` components dropped, so that
/// `link/` and `link/.` name the link itself (the kernel resolves a trailing slash or `.`
/// through a symlink, which would let every spelling but the plain one slip past the check).
pub(crate) fn normalised(dir: &Path) -> PathBuf {
    dir.components().collect()
}

/// `lstat` of the registry directory, whatever the spelling (see [`normalised`]).
pub(crate) fn dir_metadata(dir: &Path) -> io::Result<fs::Metadata> {
    fs::symlink_metadata(normalised(dir))
}

/// Creates `dir` (mode 0700, with its missing parents) or checks the existing one: refused when
/// it is a symlink, not a directory, not owned by the effective user, or accessible to group or
/// others. The error says how to fix it.
pub fn ensure_dir(dir: &Path) -> Result<(), RegistryError> {
    match dir_metadata(dir) {
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
    let me = euid();
    check_owned(dir, me, &format!("this user (uid {me})"))
}

/// Checks another user's registry directory as [`check_dir`] checks one's own: not a symlink,
/// a directory, owned by `uid` (the uid its name says it belongs to: `cistern-<uid>`), and
/// closed to group and others. A reader refuses a directory that fails, by name, rather than
/// trust records anyone could have planted.
pub fn check_dir_of(dir: &Path, uid: u32) -> Result<(), RegistryError> {
    check_owned(
        dir,
        uid,
        &format!("uid {uid}, whose directory its name says it is"),
    )
}

fn check_owned(dir: &Path, want: u32, whom: &str) -> Result<(), RegistryError> {
    let unsafe_dir = |reason: String| RegistryError::UnsafeDir {
        path: dir.to_path_buf(),
        reason,
    };
    let fix = "remove it, or point CISTERN_CONF=registry_dir:PATH at a directory of your own \
               with mode 0700 (or set registry:off)";
    let md = dir_metadata(dir).map_err(io_err(format!("inspecting {}", dir.display())))?;
    if md.file_type().is_symlink() {
        return Err(unsafe_dir(format!(
            "is a symlink, which the registry never follows: {fix}"
        )));
    }
    if !md.is_dir() {
        return Err(unsafe_dir(format!("is not a directory: {fix}")));
    }
    if md.uid() != want {
        return Err(unsafe_dir(format!(
            "is owned by uid {}, not by {whom}: {fix}",
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

/// Whether a dead process's record may be removed once expired: it is an `exited` record with
/// no leaks, or a `running` one (its process was killed) that held no memory. Records holding
/// memory or with leaks stay until `cistern doctor --clean-stale`.
pub fn expirable(r: &Record) -> bool {
    r.leaks.is_empty() && !r.leaks_truncated && (r.state == State::Exited || r.reserved() == 0)
}

/// Removes the records in `dir` of dead processes last written `max_age` or longer before
/// `now_unix_ms` that are [`expirable`] and for which `holds_memory` (a reader's NVML) says
/// no; returns the paths removed. Only in a directory of this user's ([`check_dir`]), only
/// files this user owns, and only records that parse: anything else is left for a person to
/// look at. Best effort: errors remove nothing.
pub fn expire_records(
    dir: &Path,
    max_age: Duration,
    now_unix_ms: u64,
    holds_memory: &dyn Fn(&Record) -> bool,
) -> Vec<PathBuf> {
    if check_dir(dir).is_err() {
        return Vec::new();
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let me = euid();
    let max_ms = max_age.as_millis().min(u64::MAX as u128) as u64;
    let mut pids = PidResolver::new();
    let mut removed = Vec::new();
    for e in entries.flatten() {
        if parse_file_name(&e.file_name()).is_none() {
            continue;
        }
        let path = e.path();
        let Ok(md) = fs::symlink_metadata(&path) else {
            continue;
        };
        if !md.is_file() || md.uid() != me {
            continue;
        }
        let Ok(r) = read_record(&path) else {
            continue;
        };
        if now_unix_ms.saturating_sub(r.updated_unix_ms) < max_ms || !expirable(&r) {
            continue;
        }
        // A `running` record's process must be seen dead. An `exited` one was written at exit,
        // so a process out of this reader's sight is taken at its word (pods sharing a host
        // directory each see the others' records as unseen); one still seen running is kept.
        let dead = match r.liveness_with(&mut pids).0 {
            Liveness::Dead | Liveness::PidReused | Liveness::OtherBoot => true,
            Liveness::Unseen => r.state == State::Exited,
            Liveness::Alive | Liveness::Zombie => false,
        };
        if dead && !holds_memory(&r) && fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalising_drops_trailing_slashes_and_dots() {
        for (given, want) in [
            ("/a/link/", "/a/link"),
            ("/a/link/.", "/a/link"),
            ("/a/./link//./", "/a/link"),
            ("link/", "link"),
            ("./link/.", "./link"),
            (".", "."),
            ("/", "/"),
        ] {
            assert_eq!(normalised(Path::new(given)), Path::new(want), "{given}");
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
}
