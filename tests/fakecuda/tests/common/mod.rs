//! Puts the fake driver where a child process can load it as `libcuda.so`.
//!
//! Any test in the workspace may include this file (`#[path = ".../tests/fakecuda/tests/common/
//! mod.rs"] mod fakecuda;`) and start its child processes with [`child_env`]: the fake is then
//! on `LD_LIBRARY_PATH` for those children only, never for the test process itself nor for
//! anything cargo runs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The fake's knobs, cleared from a child's environment unless a test sets them.
pub const KNOBS: [&str; 13] = [
    "CISTERN_FAKECUDA",
    "CISTERN_FAKECUDA_CAPACITY",
    "CISTERN_FAKECUDA_DEVICES",
    "CISTERN_FAKECUDA_VMM",
    "CISTERN_FAKECUDA_FAIL",
    "CISTERN_FAKECUDA_GRANULARITY",
    "CISTERN_FAKECUDA_RECOMMENDED_GRANULARITY",
    "CISTERN_FAKECUDA_RESERVE",
    "CISTERN_FAKECUDA_VA_LIMIT",
    "CISTERN_FAKECUDA_PEERS",
    "CISTERN_FAKECUDA_FABRIC",
    "CISTERN_FAKECUDA_RDMA",
    "CISTERN_FAKECUDA_FD_REFUSED",
];

/// The file cargo builds (`cdylib` of `cistern-fakecuda`).
const BUILT: &str = "libcistern_fakecuda.so";

/// `target/<profile>`, from the running test binary (`target/<profile>/deps/<test>-<hash>`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary is in a directory");
    let dir = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps has a parent")
    } else {
        deps
    };
    dir.to_path_buf()
}

/// The built library, building it when this test's crate did not (in a separate target
/// directory: the running `cargo test` holds the lock of the main one).
fn built_library() -> PathBuf {
    let profile = profile_dir();
    // `cargo test` builds the library into deps/ and does not always copy it up to
    // target/<profile>, where an older `cargo build` may have left a stale one: the newest wins.
    let newest = [profile.join(BUILT), profile.join("deps").join(BUILT)]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t);
    if let Some((_, p)) = newest {
        return p;
    }
    let target = profile.parent().expect("target/<profile> has a parent");
    let own = target.join("fakecuda").join("build");
    let release = profile.file_name().is_some_and(|n| n == "release");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", "cistern-fakecuda", "--lib"])
        .arg("--target-dir")
        .arg(&own)
        .current_dir(manifest);
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("cargo runs");
    assert!(status.success(), "building the fake driver failed: {cmd:?}");
    let built = own
        .join(if release { "release" } else { "debug" })
        .join(BUILT);
    assert!(built.is_file(), "{} was not built", built.display());
    built
}

/// A directory holding the fake driver as `libcuda.so.1` and `libcuda.so` (the names cistern,
/// the CUDA runtime and cudarc load): `target/fakecuda/<profile>/`. Made once per process; the copies
/// are written under temporary names and renamed, so concurrent test processes never see a
/// partial file.
pub fn fake_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile = profile_dir();
        let built = built_library();
        let name = profile.file_name().expect("a profile directory name");
        let dir = profile
            .parent()
            .expect("target/<profile> has a parent")
            .join("fakecuda")
            .join(name);
        std::fs::create_dir_all(&dir).expect("create the fake driver's directory");
        // One file under both names (libcuda.so a link to libcuda.so.1, as the driver installs
        // it): code that opens either name (cudarc opens libcuda.so, cistern libcuda.so.1) gets
        // the same library, hence the same fake, as with the real driver.
        let file = "libcuda.so.1";
        let tmp = dir.join(format!(".{file}.{}", std::process::id()));
        std::fs::copy(&built, &tmp).expect("copy the fake driver");
        std::fs::rename(&tmp, dir.join(file)).expect("rename the fake driver into place");
        let link = dir.join(format!(".libcuda.so.{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(file, &link).expect("link libcuda.so to libcuda.so.1");
        std::fs::rename(&link, dir.join("libcuda.so")).expect("rename the link into place");
        dir
    })
}

/// Sets up `cmd` to run on the fake driver: `LD_LIBRARY_PATH` starts with [`fake_dir`],
/// `CISTERN_FAKECUDA=1`, every other knob cleared, then `knobs` applied.
pub fn child_env(cmd: &mut Command, knobs: &[(&str, &str)]) {
    let dir = fake_dir();
    let mut path = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    cmd.env("LD_LIBRARY_PATH", path);
    for k in KNOBS {
        cmd.env_remove(k);
    }
    cmd.env("CISTERN_FAKECUDA", "1");
    for (k, v) in knobs {
        cmd.env(k, v);
    }
}
