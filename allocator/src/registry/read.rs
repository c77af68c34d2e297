//! Reading records back: one file or a whole directory, as untrusted input (no symlinks,
//! regular files only, bounded size), each refusal a value, never a panic.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::dir::dir_metadata;
use super::record::{
    parse_file_name, parse_record, Record, RecordError, MAX_DIR_BYTES, MAX_RECORDS_PER_DIR,
    MAX_RECORD_BYTES,
};
use super::{io_err, RegistryError};

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
/// it was refused, sorted by file name. Temporary files and other names are skipped. At most
/// [`MAX_RECORDS_PER_DIR`] files and [`MAX_DIR_BYTES`] are read, the most recently written
/// first (live processes rewrite theirs); the rest, left out unread, are one last entry
/// ([`RecordError::TooMany`]) under the directory's path. A missing
/// directory gives no records; a directory that is a symlink is refused, however it is spelled
/// (a trailing `/` or `/.` does not make it followed).
pub fn read_all(dir: &Path) -> Result<Vec<RecordFile>, RegistryError> {
    match dir_metadata(dir) {
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
    let paths: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err(format!("listing {}", dir.display())))?
        .filter_map(|e| e.ok())
        .filter(|e| parse_file_name(&e.file_name()).is_some())
        .map(|e| e.path())
        .collect();
    // Newest first, by modification time, for the cap; then by name, for the caller.
    let mut sized: Vec<(PathBuf, u64, std::time::SystemTime)> = paths
        .into_iter()
        .map(|p| {
            let md = fs::symlink_metadata(&p).ok();
            // What reading it costs: a file over the record limit is refused after its metadata.
            let size = md.as_ref().map_or(0, |m| m.len()).min(MAX_RECORD_BYTES + 1);
            let mtime = md
                .and_then(|m| m.modified().ok())
                .unwrap_or(std::time::UNIX_EPOCH);
            (p, size, mtime)
        })
        .collect();
    sized.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    let mut out = Vec::new();
    let mut bytes = 0u64;
    let mut left_out = 0;
    for (p, size, _) in sized {
        if out.len() >= MAX_RECORDS_PER_DIR || bytes.saturating_add(size) > MAX_DIR_BYTES {
            left_out += 1;
            continue;
        }
        bytes = bytes.saturating_add(size);
        let r = read_record(&p);
        out.push((p, r));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    if left_out > 0 {
        out.push((dir.to_path_buf(), Err(RecordError::TooMany { left_out })));
    }
    Ok(out)
}
