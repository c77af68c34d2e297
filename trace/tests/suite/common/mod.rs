//! Shared helpers for the tests that read the development traces.
// Each test binary uses only some of these helpers.
#![allow(dead_code)]

use std::path::PathBuf;

/// The development traces folder: `$CISTERN_TRACES_DIR`, else `<workspace>/../shared/traces`.
/// `None` (after printing a visible skip message) when it is absent.
pub fn traces_dir(test: &str) -> Option<PathBuf> {
    let dir = match std::env::var_os("CISTERN_TRACES_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"),
    };
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!(
            "skipping {test}: traces folder {} not found (set CISTERN_TRACES_DIR)",
            dir.display()
        );
        None
    }
}

/// Files in `dir/sub` whose name ends with `ext`, sorted; empty (with a message) if absent.
pub fn files(dir: &std::path::Path, sub: &str, ext: &str) -> Vec<PathBuf> {
    let d = dir.join(sub);
    let Ok(rd) = std::fs::read_dir(&d) else {
        eprintln!("skipping: {} not found", d.display());
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(ext))
        .collect();
    out.sort();
    out
}

/// The file name, for messages.
pub fn name(p: &std::path::Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
