//! Which file `CudaDriver` opens as the driver: `libcuda.so.1`, as PyTorch, NCCL and Triton do,
//! never a `libcuda.so` found earlier on the loader's path (the CUDA toolkit's `stubs/`
//! directory holds one, whose `cuInit` fails with `CUDA_ERROR_STUB_LIBRARY`; where the two names
//! are different files, opening both would put two drivers in one process).
//!
//! Each check runs in a child process (the loader reads `LD_LIBRARY_PATH` at start): the
//! parent lays out directories holding copies of the fake, and the child reads
//! `/proc/self/maps` to see which files were mapped.

mod common;

use std::path::Path;
use std::process::Command;

use cistern::driver::cuda::CudaDriver;
use cistern::driver::Driver;

const CHILD: &str = "FAKECUDA_LOADING_CHILD";

/// The files named `libcuda.so*` mapped into this process.
fn mapped_drivers() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let mut files: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libcuda.so"))
        })
        .map(str::to_owned)
        .collect();
    files.sort();
    files.dedup();
    files
}

/// Runs the child test `name` with `LD_LIBRARY_PATH=ld` and `CHILD=value`; returns the
/// `libcuda.so*` files it says were mapped.
fn run_child(name: &str, ld: &str, value: &str) -> Vec<String> {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--ignored", "--nocapture"]);
    common::child_env(&mut cmd, &[]);
    cmd.env("LD_LIBRARY_PATH", ld);
    cmd.env(CHILD, value);
    let out = cmd.output().expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child {name} failed\n{stdout}\n{stderr}"
    );
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("MAPPED "))
        .unwrap_or_else(|| panic!("no MAPPED line\n{stdout}"))
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

#[test]
#[ignore = "runs in a child process started by stub_libcuda_so_earlier_on_the_path_is_not_opened"]
fn child_opens_the_driver() {
    if std::env::var(CHILD).is_err() {
        eprintln!("skipping: runs in a child process");
        return;
    }
    let d = CudaDriver::new().unwrap_or_else(|e| panic!("CudaDriver::new: {e}"));
    assert_eq!(d.device_count().unwrap(), 1);
    // A call that needs the library's functions, not just cuInit.
    assert!(d.mem_info(0).unwrap().total > 0);
    println!("MAPPED {}", mapped_drivers().join(" "));
}

#[test]
fn stub_libcuda_so_earlier_on_the_path_is_not_opened() {
    let dir = common::fake_dir();
    let root = std::env::temp_dir().join(format!("cistern-loading-{}", std::process::id()));
    let stubs = root.join("stubs");
    let driver = root.join("driver");
    std::fs::create_dir_all(&stubs).unwrap();
    std::fs::create_dir_all(&driver).unwrap();
    // Different files under the two names: the "stub" first on the path, the driver after it.
    std::fs::copy(dir.join("libcuda.so"), stubs.join("libcuda.so")).unwrap();
    std::fs::copy(dir.join("libcuda.so.1"), driver.join("libcuda.so.1")).unwrap();
    let ld = format!("{}:{}", stubs.display(), driver.display());
    let files = run_child("child_opens_the_driver", &ld, "1");
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(
        files,
        [driver.join("libcuda.so.1").to_string_lossy().into_owned()],
        "exactly the driver's libcuda.so.1 must be loaded, never the libcuda.so before it"
    );
}

#[test]
#[ignore = "runs in a child process started by the_driver_already_in_the_process_is_the_one_used"]
fn child_uses_the_loaded_driver() {
    let Ok(path) = std::env::var(CHILD) else {
        eprintln!("skipping: runs in a child process");
        return;
    };
    // As the CUDA runtime (or PyTorch) would have: the driver loaded from a path the loader's
    // search does not reach.
    // SAFETY: the fake driver; its initialisers are sound.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some(&path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .expect("load the driver by its path");
    let d = CudaDriver::new().unwrap_or_else(|e| panic!("CudaDriver::new: {e}"));
    assert!(d.mem_info(0).unwrap().total > 0);
    println!("MAPPED {}", mapped_drivers().join(" "));
    drop(d);
    drop(lib);
}

#[test]
fn the_driver_already_in_the_process_is_the_one_used() {
    let dir = common::fake_dir();
    let root = std::env::temp_dir().join(format!("cistern-loaded-{}", std::process::id()));
    let private = root.join("private");
    let empty = root.join("empty");
    std::fs::create_dir_all(&private).unwrap();
    std::fs::create_dir_all(&empty).unwrap();
    let driver = private.join("libcuda.so.1");
    std::fs::copy(dir.join("libcuda.so.1"), &driver).unwrap();
    // Nothing on the search path: only the already loaded driver can serve.
    let files = run_child(
        "child_uses_the_loaded_driver",
        &empty.display().to_string(),
        &driver.display().to_string(),
    );
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(files, [driver.to_string_lossy().into_owned()]);
}
