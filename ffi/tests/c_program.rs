//! Builds `tests/c/abi_test.c` with the system C compiler against `include/cistern.h`, links it
//! to the built `libcistern.so` and runs it on the simulated GPU.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn cc() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(o) if o.status.success() => Some(cc),
        _ => None,
    }
}

#[test]
fn c_program_uses_the_abi() {
    let Some(cc) = cc() else {
        eprintln!("SKIPPED c_program_uses_the_abi: no C compiler (`cc`, or $CC) on this machine");
        return;
    };
    let lib = common::library_path();
    let lib_dir = lib.parent().unwrap();
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("abi_test");
    let out = Command::new(&cc)
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-O1",
            "-pthread",
        ])
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/c/abi_test.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib_dir.display()))
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lcistern")
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe)
        .env("CISTERN_DRIVER", "sim")
        .env_remove("CISTERN_SIM")
        .env("CISTERN_CONF", "registry:off")
        .output()
        .expect("run abi_test");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "abi_test failed ({}):\n{stdout}{stderr}",
        run.status
    );
    assert!(stdout.contains("checks passed"), "{stdout}");
    println!("{stdout}");
}

#[test]
fn c_header_compiles_as_cpp() {
    let Some(_) = cc() else {
        eprintln!("SKIPPED c_header_compiles_as_cpp: no C compiler");
        return;
    };
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("header_check.cpp");
    std::fs::write(
        &src,
        "#include \"cistern.h\"\nint main() { return cistern_version() == nullptr; }\n",
    )
    .unwrap();
    let include = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include");
    match Command::new(&cxx)
        .args(["-std=c++17", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(&include)
        .arg(&src)
        .output()
    {
        Ok(o) => assert!(
            o.status.success(),
            "cistern.h does not compile as C++:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(_) => eprintln!("SKIPPED c_header_compiles_as_cpp: no C++ compiler ({cxx})"),
    }
}
