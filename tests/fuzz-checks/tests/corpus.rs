//! Every committed seed (`fuzz/corpus/TARGET/`) and every input that once crashed a fuzz target
//! (`fuzz/regressions/TARGET/`, the reproducer libFuzzer wrote, kept under the name of the bug)
//! runs through the target's check: a target that crashes on its own corpus, or a fixed crash
//! that comes back, fails here on the stable toolchain, without libFuzzer.

use std::path::{Path, PathBuf};

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

fn run_all(kind: &str) -> usize {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz")
        .join(kind);
    let mut n = 0;
    for &(target, check) in cistern_fuzz_checks::TARGETS {
        for path in inputs(&root.join(target)) {
            let data = std::fs::read(&path).unwrap();
            let r = std::panic::catch_unwind(|| check(&data));
            assert!(r.is_ok(), "{target}: {} fails its check", path.display());
            n += 1;
        }
    }
    n
}

#[test]
fn every_seed_passes_its_target() {
    let n = run_all("corpus");
    // Each target has seeds (fuzz/make-corpus.sh writes them).
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    for &(target, _) in cistern_fuzz_checks::TARGETS {
        assert!(
            !inputs(&root.join(target)).is_empty(),
            "{target} has no seeds in {}",
            root.display()
        );
    }
    eprintln!("{n} seeds checked");
}

#[test]
fn every_past_crash_stays_fixed() {
    let n = run_all("regressions");
    eprintln!("{n} past crashes checked");
}
