//! `driver-costs` end to end on the simulator: it measures every call kind and writes a cost
//! table that the replay's loader accepts. (On a GPU the same binary measures the real driver;
//! that is what `scripts/gpu-check.sh` runs.)

use std::process::Command;

use cistern::driver::DriverCall;
use cistern::CostTable;

#[test]
fn writes_a_cost_table_the_replay_reads() {
    let dir = std::env::temp_dir().join(format!("cistern-driver-costs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("costs.json");
    let r = Command::new(env!("CARGO_BIN_EXE_driver_costs"))
        .args(["--reps", "3", "--jsonl", "--out"])
        .arg(&out)
        .env("CISTERN_DRIVER", "sim")
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    // One JSON line per measurement.
    let lines = String::from_utf8(r.stdout).unwrap();
    let n = lines
        .lines()
        .filter(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["median_us"].as_f64().is_some()
        })
        .count();
    assert!(n >= 20, "{n} measurements");
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(
        stderr.contains("set_access over 10 fresh mappings"),
        "{stderr}"
    );
    let table = CostTable::from_json_file(&out).unwrap();
    for call in DriverCall::ALL {
        let c = table.get(call);
        assert!(
            c.per_call_us > 0.0 || c.per_mib_us.is_some_and(|m| m > 0.0),
            "{call:?} was not measured"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn refuses_bad_arguments_and_a_missing_driver() {
    let r = Command::new(env!("CARGO_BIN_EXE_driver_costs"))
        .arg("--reps")
        .arg("0")
        .output()
        .unwrap();
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("positive"));
    // No libcuda on the library path here (or a fake that refuses without its switch): the
    // CUDA driver cannot open, and the tool says so instead of measuring the simulator.
    let r = Command::new(env!("CARGO_BIN_EXE_driver_costs"))
        .env("CISTERN_DRIVER", "cuda")
        .env_remove("CISTERN_FAKECUDA")
        .output()
        .unwrap();
    if !r.status.success() {
        assert!(
            String::from_utf8_lossy(&r.stderr).contains("CISTERN_DRIVER=sim"),
            "{}",
            String::from_utf8_lossy(&r.stderr)
        );
    }
}
