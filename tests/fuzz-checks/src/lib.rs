//! What each fuzz target checks, as plain functions over bytes, so that the same check runs in
//! two places: under libFuzzer (`fuzz/fuzz_targets/*.rs` are one-line wrappers; see
//! `fuzz/README.md` and `scripts/fuzz.sh`), and under `cargo test`, over the committed seed
//! corpus (`fuzz/corpus/TARGET/`) and every input a fuzzer ever crashed on
//! (`fuzz/regressions/TARGET/`), so that a fixed crash stays fixed on the stable toolchain.
//!
//! Each function panics only on a bug. The C ABI target (`capi`) is the exception: it calls
//! `libcistern.so`'s exports in-process, so it lives in the fuzz crate with the ABI's source;
//! its regressions become tests in `ffi/src/tests.rs`.

pub mod pool;
pub mod readers;
pub mod registry_scan;

/// A target's check: panics on a bug.
pub type Check = fn(&[u8]);

/// The targets this crate checks, by the fuzz target's name.
pub const TARGETS: &[(&str, Check)] = &[
    ("snapshot", readers::snapshot),
    ("kineto", readers::kineto),
    ("rmm", readers::rmm),
    ("own", readers::own),
    ("minimalloc", readers::minimalloc),
    ("load", readers::load),
    ("registry_record", readers::registry_record),
    ("config", readers::config),
    ("registry_scan", registry_scan::check),
    ("pool", pool::check),
];

/// The check of target `name`.
pub fn check_for(name: &str) -> Option<Check> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|&(_, f)| f)
}
