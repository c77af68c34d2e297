//! `scripts/install.sh`: the library installed for C programs outside the repository, stripped
//! with its debug info kept apart, found through `pkg-config`, and run without
//! `LD_LIBRARY_PATH`; `ffi/examples/hello.c` builds and runs against it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn sections(file: &Path) -> String {
    let out = Command::new("readelf")
        .arg("-S")
        .arg("-W")
        .arg(file)
        .output()
        .expect("run readelf");
    assert!(out.status.success(), "readelf -S {}", file.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn install_strips_keeps_debug_info_apart_and_pkg_config_builds_the_example() {
    for tool in ["objcopy", "readelf", "cc", "pkg-config"] {
        if !have(tool) {
            eprintln!(
                "SKIPPED install test: `{tool}` not found (install binutils, gcc, pkg-config)"
            );
            return;
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let prefix = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("install-prefix");
    let _ = std::fs::remove_dir_all(&prefix);
    let lib = common::library_path();
    let out = Command::new("bash")
        .arg(root.join("scripts/install.sh"))
        .arg("--lib")
        .arg(&lib)
        .arg(&prefix)
        .output()
        .expect("run install.sh");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "install.sh failed:\n{said}");
    assert!(said.contains("pkg-config"), "{said}");

    let installed = prefix.join("lib/libcistern.so");
    let debug = prefix.join("lib/.debug/libcistern.so.debug");
    let (s_lib, s_debug) = (sections(&installed), sections(&debug));
    assert!(
        !s_lib.contains(".debug_info"),
        "the installed library keeps its debug info"
    );
    assert!(
        s_lib.contains(".gnu_debuglink"),
        "no link to the debug file"
    );
    assert!(
        s_lib.contains(".symtab"),
        "function names must stay (call sites)"
    );
    assert!(
        s_debug.contains(".debug_info"),
        "the debug file lacks the debug info"
    );
    let (small, big) = (
        std::fs::metadata(&installed).unwrap().len(),
        std::fs::metadata(&lib).unwrap().len(),
    );
    assert!(small * 2 < big, "stripped {small} B against {big} B built");

    // Build the example through pkg-config and run it with no LD_LIBRARY_PATH.
    let pc_dir = prefix.join("lib/pkgconfig");
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "cistern"])
        .env("PKG_CONFIG_PATH", &pc_dir)
        .output()
        .unwrap();
    assert!(flags.status.success(), "pkg-config cistern: {flags:?}");
    let flags = String::from_utf8(flags.stdout).unwrap();
    assert!(
        flags.contains("-lcistern") && flags.contains("rpath"),
        "{flags}"
    );
    let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hello");
    let cc = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg(prefix.join("share/cistern/hello.c"))
        .args(flags.split_whitespace())
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        cc.status.success(),
        "cc hello.c failed:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let run = Command::new(&exe)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("CISTERN_LIB")
        .env("CISTERN_DRIVER", "sim")
        .env_remove("CISTERN_SIM")
        .env(
            "CISTERN_CONF",
            "registry:off,provenance:stacks,stack_sample_rate:1",
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("hello: done") && stdout.contains("refused"),
        "hello: {stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn install_without_a_prefix_says_how_to_call_it() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/install.sh"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("usage: scripts/install.sh"), "{err}");
}
