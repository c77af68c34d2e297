//! The directory scan that `cistern ps`, `leaks` and `doctor` run over a registry another user
//! may have written: the input becomes a directory of files (names and contents from the input,
//! some of them symlinks or subdirectories), and `registry::read_all` must give each one a
//! record or a reason, never panic; a record it accepts writes back and reads back the same.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use arbitrary::{Result, Unstructured};
use cistern::registry::{encode_record, parse_record, read_all};

static RUN: AtomicU64 = AtomicU64::new(0);

fn scratch() -> PathBuf {
    let base = std::env::temp_dir().join(format!("cistern-fuzz-registry-{}", std::process::id()));
    // One folder per input (removed after it), so that concurrent callers never meet.
    let dir = base.join(RUN.fetch_add(1, Ordering::Relaxed).to_string());
    std::fs::create_dir_all(&dir).unwrap();
    // The readers refuse a directory open to others, as the library does.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

fn name(u: &mut Unstructured, k: usize) -> Result<String> {
    Ok(match u.int_in_range(0u8..=3)? {
        // The reader's own naming: <pid>-<start_time>.json.
        0 | 1 => format!(
            "{}-{}.json",
            u.int_in_range(1u32..=4_000_000)?,
            u.arbitrary::<u64>()?
        ),
        2 => format!(".{k}-1.json.tmp"),
        _ => {
            let raw: String = u.arbitrary()?;
            let clean: String = raw
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                .take(40)
                .collect();
            if clean.is_empty() || clean == "." || clean == ".." {
                format!("{k}.json")
            } else {
                clean
            }
        }
    })
}

/// Builds a registry directory from `data` and scans it.
pub fn check(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let dir = scratch();
    let r: Result<()> = (|| {
        for k in 0..u.int_in_range(1usize..=6)? {
            let n = name(&mut u, k)?;
            let path = dir.join(&n);
            match u.int_in_range(0u8..=7)? {
                0 => {
                    let _ = std::os::unix::fs::symlink("/etc/hostname", &path);
                }
                1 => {
                    let _ = std::fs::create_dir(&path);
                }
                _ => {
                    let len = u.int_in_range(0usize..=u.len())?;
                    let _ = std::fs::write(&path, u.bytes(len)?);
                }
            }
        }
        Ok(())
    })();
    let _ = r;
    if let Ok(files) = read_all(&dir) {
        for (_, rec) in files {
            if let Ok(record) = rec {
                let mut copy = record.clone();
                let bytes = encode_record(&mut copy);
                let back = parse_record(&bytes).expect("what the writer emits parses");
                assert_eq!(back, record);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
