//! Whose records a registry directory holds: a directory named by the caller that is not as
//! the library makes it ([`doubt`]), and a record that cannot be its directory's user's
//! ([`impostor`]), so that `ps --all-users` never credits one user's memory to another.

use super::*;

/// Why a record found node-wide in user `dir_uid`'s directory cannot be that user's: the
/// file is another user's, the record claims another uid, or the live process it names runs
/// as another user (anyone can read a process's pid and start time in `/proc`, and a record
/// naming someone else's process would take its NVML memory and hide its real record).
/// `None` when it is consistent.
pub(super) fn impostor(
    path: &Path,
    r: &Record,
    l: Liveness,
    pid: Option<u32>,
    dir_uid: u32,
) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let file_uid = std::fs::symlink_metadata(path).ok()?.uid();
    if file_uid != dir_uid {
        return Some(format!(
            "written by uid {file_uid} into the directory of uid {dir_uid}: refused"
        ));
    }
    if r.uid != dir_uid {
        return Some(format!(
            "claims uid {} in the directory of uid {dir_uid}: refused",
            r.uid
        ));
    }
    if matches!(l, Liveness::Alive | Liveness::Zombie) {
        if let Some((p, euid)) = pid.and_then(|p| Some((p, proc_euid(p)?))) {
            if euid != dir_uid {
                return Some(format!(
                    "names pid {p}, which runs as uid {euid}, not as uid {dir_uid}: refused"
                ));
            }
        }
    }
    None
}

/// The effective uid of a process, from the `Uid:` line of `/proc/<pid>/status` (not the
/// owner of `/proc/<pid>`, which is root for every process that is not dumpable).
fn proc_euid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The uid a `cistern-<uid>` directory name gives.
pub(super) fn named_uid(dir: &Path) -> Option<u32> {
    dir.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("cistern-"))
        .and_then(|u| u.parse::<u32>().ok())
}

/// Why the records of a directory named by the caller may not be their owner's: it is not
/// owned by the user its name gives (`cistern-<uid>`: root reading another user's directory
/// checks it against that user, [`registry::check_dir_of`]) or, for any other name, by the
/// caller ([`registry::check_dir`]); or it is open to group or others. `None` when it looks as
/// the library makes it.
pub fn doubt(dir: &Path) -> Option<String> {
    let checked = match named_uid(dir) {
        Some(uid) => registry::check_dir_of(dir, uid),
        None => registry::check_dir(dir),
    };
    checked.err().map(|e| {
        let e = e.to_string();
        // The error names the directory first; the caller names it too.
        let why = e
            .strip_prefix(&format!("registry directory {}: ", dir.display()))
            .unwrap_or(&e);
        format!("{why}; its records may have been written by another user")
    })
}
