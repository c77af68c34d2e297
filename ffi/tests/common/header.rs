//! Generating `include/cistern.h` with cbindgen (shared by the `gen-header` example and the
//! staleness test).

use std::path::PathBuf;

/// The crate's directory.
fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where the header is checked in.
pub fn checked_in_path() -> PathBuf {
    crate_dir().join("include").join("cistern.h")
}

/// The header as cbindgen writes it from `src/` and `cbindgen.toml`.
pub fn generate() -> Result<String, String> {
    let dir = crate_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))
        .map_err(|e| format!("cbindgen.toml: {e}"))?;
    let bindings = cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .map_err(|e| format!("cbindgen: {e}"))?;
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).map_err(|e| format!("cbindgen wrote invalid UTF-8: {e}"))
}
