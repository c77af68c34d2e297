//! Which registry directories the readers (`ps`, `leaks`, `doctor`, and the exporter) read:
//! one (`--registry-dir`, else `CISTERN_CONF`'s `registry_dir`, else this user's default), or,
//! node-wide (`--all-users`), every user's directory in the places the library puts them:
//! `/dev/shm/cistern-<uid>`, `/tmp/cistern-<uid>` and `/run/user/<uid>/cistern`.
//!
//! Node-wide, each directory is checked as a writer checks its own ([`registry::check_dir_of`]):
//! not a symlink, a directory, owned by the uid its name gives, closed to group and others. One
//! that fails is refused by name, with the reason, and never read: its records could have been
//! planted by anyone. One the caller may not read (another user's, without root) is listed as
//! unreadable.
//!
//! # Test hook
//!
//! `CISTERN_FAKE_REGISTRY_ROOT=<dir>` looks for `dev/shm`, `tmp` and `run/user` under that
//! directory instead of `/`, so the node-wide scan can be tested without touching the host's.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use cistern::registry;
use serde::Serialize;

/// One directory to read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegistryDir {
    /// The directory.
    pub path: PathBuf,
    /// The uid its name gives (`cistern-<uid>`, `/run/user/<uid>/cistern`); `None` for a
    /// directory named on the command line or in `CISTERN_CONF`.
    pub uid: Option<u32>,
}

/// A directory found but not read, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedDir {
    /// The directory.
    pub path: PathBuf,
    /// The uid its name gives.
    pub uid: Option<u32>,
    /// Why it was not read, and what to do.
    pub reason: String,
}

/// The directories to read, and those found but refused or unreadable.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Dirs {
    /// To read, in this order.
    pub dirs: Vec<RegistryDir>,
    /// Failed the owner / mode / symlink check: refused by name, never read.
    pub refused: Vec<SkippedDir>,
    /// The caller may not read them (run as root to read every user's).
    pub unreadable: Vec<SkippedDir>,
}

impl Dirs {
    /// One directory (today's single-directory reading: checked when read, see
    /// [`crate::ps::Snapshot::take_dirs`]).
    pub fn one(path: PathBuf) -> Dirs {
        Dirs {
            dirs: vec![RegistryDir { path, uid: None }],
            ..Dirs::default()
        }
    }

    /// The paths to read.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.path.clone()).collect()
    }
}

/// The directories to read: `arg` (`--registry-dir`) or the configured one; with `all_users`,
/// every user's directory in the standard places as well (see the module docs), plus `arg` or
/// `CISTERN_CONF`'s `registry_dir` when given. Errors: an invalid `CISTERN_CONF`.
pub fn registry_dirs(arg: Option<&Path>, all_users: bool) -> Result<Dirs, String> {
    if !all_users {
        return crate::ps::registry_dir(arg).map(Dirs::one);
    }
    let mut out = Dirs::default();
    let explicit = match arg {
        Some(a) => Some(a.to_path_buf()),
        None => configured_dir()?,
    };
    if let Some(p) = explicit {
        out.dirs.push(RegistryDir { path: p, uid: None });
    }
    let root = std::env::var_os("CISTERN_FAKE_REGISTRY_ROOT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"));
    let mut found: Vec<(PathBuf, u32)> = Vec::new();
    for parent in ["dev/shm", "tmp"] {
        for (name, path) in list(&root.join(parent)) {
            if let Some(uid) = name.strip_prefix("cistern-").and_then(parse_uid) {
                found.push((path, uid));
            }
        }
    }
    for (name, path) in list(&root.join("run/user")) {
        if let Some(uid) = parse_uid(&name) {
            let dir = path.join("cistern");
            match fs::symlink_metadata(&dir) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                _ => found.push((dir, uid)),
            }
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    for (path, uid) in found {
        if out.dirs.iter().any(|d| same_dir(&d.path, &path)) {
            continue;
        }
        match registry::check_dir_of(&path, uid) {
            Err(registry::RegistryError::UnsafeDir { reason, .. }) => {
                out.refused.push(SkippedDir {
                    path,
                    uid: Some(uid),
                    reason,
                })
            }
            Err(e) if is_permission(&e) => out.unreadable.push(unreadable(path, uid)),
            Err(e) => out.refused.push(SkippedDir {
                path,
                uid: Some(uid),
                reason: e.to_string(),
            }),
            Ok(()) => match fs::read_dir(&path) {
                Ok(_) => out.dirs.push(RegistryDir {
                    path,
                    uid: Some(uid),
                }),
                Err(_) => out.unreadable.push(unreadable(path, uid)),
            },
        }
    }
    Ok(out)
}

/// `CISTERN_CONF`'s `registry_dir`, when set; an invalid `CISTERN_CONF` is an error.
fn configured_dir() -> Result<Option<PathBuf>, String> {
    cistern::Config::from_env()
        .map(|c| c.registry_dir)
        .map_err(|e| {
            format!(
                "{e}\n(the registry directory is read from CISTERN_CONF: fix it, or name the \
                 directory with --registry-dir)"
            )
        })
}

fn unreadable(path: PathBuf, uid: u32) -> SkippedDir {
    SkippedDir {
        path,
        uid: Some(uid),
        reason: format!(
            "not readable by uid {}: run as root (or as uid {uid}) to read it",
            registry::euid()
        ),
    }
}

fn is_permission(e: &registry::RegistryError) -> bool {
    matches!(e, registry::RegistryError::Io { source, .. }
        if source.kind() == io::ErrorKind::PermissionDenied)
}

fn parse_uid(s: &str) -> Option<u32> {
    (!s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// The entries of a directory as (name, path); none when it cannot be listed.
fn list(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.to_string(), e.path())))
        .collect()
}

fn same_dir(a: &Path, b: &Path) -> bool {
    let norm = |p: &Path| -> PathBuf { p.components().collect() };
    norm(a) == norm(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_in_names() {
        assert_eq!(parse_uid("1000"), Some(1000));
        for bad in ["", "x", "10a", "99999999999", "-1", "cli-ps-1"] {
            assert_eq!(parse_uid(bad), None, "{bad}");
        }
        assert!(same_dir(Path::new("/a/b/"), Path::new("/a/./b")));
    }
}
