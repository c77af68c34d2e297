//! `scripts/gpu/nvml_check.py`, the GPU check's `nvml_ps` step, over the fake libcuda and a
//! fake NVML (`--fake-nvml`): a holder process publishes its record, `ps` joins it with NVML's
//! entry for its pid and GPU, it is killed, and `ps`, `leaks` and `doctor` account for it. On a
//! GPU the same script runs against the real NVML; here its own logic, and the commands it
//! drives, are checked.

use std::path::PathBuf;
use std::process::Command;

use crate::common::holders::HolderKit;
use crate::common::TempDir;

#[test]
fn the_gpu_checks_nvml_script_passes_over_the_fakes() {
    let work = TempDir::new("nvml-check");
    let Some(kit) = HolderKit::new(work.path()) else {
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu/nvml_check.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("--holder")
        .arg(&kit.exe)
        .args(["--lib-dir", &kit.libs])
        .args(["--cistern", env!("CARGO_BIN_EXE_cistern")])
        .args(["--mib", "64", "--fake-nvml"])
        .env("CISTERN_FAKECUDA", "1")
        .env("CISTERN_FAKECUDA_CAPACITY", "4GiB")
        .env("CISTERN_DRIVER", "cuda")
        .env_remove("CISTERN_FAKE_NVML")
        .output()
        .expect("python3 runs the script: install python3, which the test command needs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the script failed ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    for key in [
        "nvml_joined=1",
        "oom_names_holder=1",
        "live_mib=64",
        "dead_state=dead-record-only",
        "leaked_mib=64",
        "doctor_killed_rc=1",
    ] {
        assert!(
            stdout.lines().any(|l| l == key),
            "{key} missing:\n{stdout}\n{stderr}"
        );
    }
}
