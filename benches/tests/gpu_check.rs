//! `scripts/gpu-check.sh`'s own logic, on a machine without a GPU: it refuses to run over
//! cistern's fake libcuda (found by content, wherever it could be picked up), its summary is
//! made from the step results it recorded, and every step degrades to "skipped: <why>" without
//! the kit. The script is sourced for its functions (nothing runs when it is sourced), so these
//! tests drive the step runner with stub commands. Shellcheck-clean when shellcheck is here;
//! the device helpers (`scripts/gpu/`) compile warning-free when gcc is here.

#[path = "../../tests/fakecuda/tests/common/mod.rs"]
mod fakecuda;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

fn script() -> PathBuf {
    repo().join("scripts/gpu-check.sh")
}

/// A fresh directory under the system's temporary directory, named without "fakecuda" (the
/// guard must find the fake by its content, not by its directory's name).
fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cistern-gpucheck-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `bash` with an environment free of the fake's switch and of cargo's library path (which
/// names target/<profile>, where the fake is built under its own name).
fn bash() -> Command {
    let mut cmd = Command::new("bash");
    cmd.env_remove("LD_LIBRARY_PATH")
        .env_remove("LD_PRELOAD")
        .current_dir(repo());
    for k in fakecuda::KNOBS {
        cmd.env_remove(k);
    }
    cmd
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The fake driver, copied as `libcuda.so.1` into `dir`.
fn fake_into(dir: &Path) -> PathBuf {
    let to = dir.join("libcuda.so.1");
    std::fs::copy(fakecuda::fake_dir().join("libcuda.so.1"), &to).unwrap();
    to
}

#[test]
fn refuses_to_run_over_the_fake_driver() {
    let dir = temp_dir("guard");
    let drivers = dir.join("drivers");
    std::fs::create_dir_all(&drivers).unwrap();
    let fake = fake_into(&drivers);
    let kit = dir.join("kit");
    std::fs::create_dir_all(&kit).unwrap();
    let out = dir.join("out");
    let run = |envs: &[(&str, &str)]| {
        let mut cmd = bash();
        cmd.arg(script()).env("KIT", &kit).env("OUT", &out);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    let refused = |o: &Output, why: &str, fix: &str| {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(3), "{}", text(o));
        assert!(
            err.contains("refusing to run") && err.contains(why),
            "{}",
            text(o)
        );
        assert!(err.contains(&format!("fix: {fix}")), "{}", text(o));
        assert!(!out.join("steps.tsv").exists(), "a step ran: {}", text(o));
    };

    // On the library path, under the driver's name, in a directory named like any other.
    let o = run(&[("LD_LIBRARY_PATH", drivers.to_str().unwrap())]);
    refused(
        &o,
        &format!(
            "{} (on LD_LIBRARY_PATH) is cistern's fake libcuda",
            fake.display()
        ),
        &format!("remove {} from LD_LIBRARY_PATH", drivers.display()),
    );
    // Preloaded.
    let o = run(&[("LD_PRELOAD", fake.to_str().unwrap())]);
    refused(
        &o,
        "(in LD_PRELOAD) is cistern's fake libcuda",
        "unset LD_PRELOAD",
    );
    // Its switch set, even with nothing else wrong.
    let o = run(&[("CISTERN_FAKECUDA", "1")]);
    refused(&o, "CISTERN_FAKECUDA is set", "unset CISTERN_FAKECUDA");
    // Any libcuda in the kit: no driver travels with it.
    let in_kit = fake_into(&kit);
    let o = run(&[]);
    refused(
        &o,
        &format!("the kit holds {}", in_kit.display()),
        "delete it and rebuild the kit: bash scripts/build-gpu-kit.sh",
    );
    std::fs::remove_file(&in_kit).unwrap();

    // A libcuda.so.1 that is not the fake is not refused: the guard reads content, not names.
    // (With no kit the script then stops for that, with its own message.)
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("libcuda.so.1"), b"not a driver").unwrap();
    std::fs::remove_dir_all(&kit).unwrap();
    let o = run(&[("LD_LIBRARY_PATH", other.to_str().unwrap())]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("refusing"), "{}", text(&o));
    assert!(
        err.contains("build it first: bash scripts/build-gpu-kit.sh"),
        "{}",
        text(&o)
    );

    // What the dynamic loader would pick (the last line of defence, for paths the scans above
    // do not see): the fake, when its directory is on the library path.
    if Command::new("python3").arg("--version").output().is_ok() {
        let o = bash()
            .arg("-c")
            .arg(r#"source "$1" && loader_libcuda"#)
            .arg("_")
            .arg(script())
            .env("LD_LIBRARY_PATH", &drivers)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            fake.to_str().unwrap(),
            "{}",
            text(&o)
        );
    } else {
        eprintln!("skipping the loader probe: no python3 here");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `body` (bash) after sourcing the script, with OUT set; returns the output.
fn with_runner(out: &Path, body: &str) -> Output {
    bash()
        .arg("-c")
        .arg(format!(
            "source \"$1\" || exit 99\nexport OUT=\"$2\" BUDGET_S=60\nMIN_STEP_S=3 SUMMARY_RESERVE_S=0\n{body}"
        ))
        .arg("_")
        .arg(script())
        .arg(out)
        .output()
        .unwrap()
}

/// The summary's row for `step`, split on whitespace.
fn row(summary: &str, step: &str) -> Vec<String> {
    summary
        .lines()
        .find(|l| l.split_whitespace().next() == Some(step))
        .unwrap_or_else(|| panic!("no row for {step} in\n{summary}"))
        .split_whitespace()
        .map(String::from)
        .collect()
}

#[test]
fn the_summary_reports_each_recorded_step() {
    let out = temp_dir("steps");
    let o = with_runner(
        &out,
        r#"
check_init
step good 10 bash -c 'echo "hit_4KiB_ns=42" >> "$STEP_KEYS"; echo "move_host_waits=0" >> "$STEP_KEYS"'
step broken 10 bash -c 'echo "boom: the device is on fire" >&2; exit 5'
step slow 1 sleep 30
step no_tool 10 skip "no gcc here"
DEADLINE_S=$(date +%s)   # the budget is spent
step late 10 true
write_summary
echo "summary rc=$?"
"#,
    );
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("summary rc=1"),
        "a failure must fail the run: {}",
        text(&o)
    );

    // The steps file: one line per step, tab-separated.
    let steps = std::fs::read_to_string(out.join("steps.tsv")).unwrap();
    let fields: Vec<Vec<&str>> = steps.lines().map(|l| l.split('\t').collect()).collect();
    let names: Vec<&str> = fields.iter().map(|f| f[0]).collect();
    assert_eq!(
        names,
        ["good", "broken", "slow", "no_tool", "late"],
        "{steps}"
    );
    assert!(fields.iter().all(|f| f.len() == 7), "{steps}");
    let results: Vec<&str> = fields.iter().map(|f| f[1]).collect();
    assert_eq!(
        results,
        ["pass", "FAIL", "timeout", "skipped", "skipped"],
        "{steps}"
    );
    assert_eq!(fields[1][2], "5");
    assert_eq!(fields[2][2], "124");
    let slow: f64 = fields[2][3].parse().unwrap();
    assert!(
        (0.9..10.0).contains(&slow),
        "the timed-out step took {slow} s"
    );
    assert_eq!(fields[4][2], "-", "a step skipped for budget never ran");
    // Each step's output went to its own files.
    let log = std::fs::read_to_string(out.join("broken.log")).unwrap();
    assert!(log.contains("the device is on fire"));

    // The table, last on stdout and in summary.txt, says the same.
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    let before_rc = stdout.trim_end().strip_suffix("summary rc=1").unwrap();
    assert!(
        before_rc.trim_end().ends_with(summary.trim_end()),
        "{}",
        text(&o)
    );
    let good = row(&summary, "good");
    assert_eq!(good[1], "pass");
    assert!(good.contains(&"hit_4KiB_ns=42".into()) && good.contains(&"move_host_waits=0".into()));
    let broken = row(&summary, "broken");
    assert_eq!(broken[1], "FAIL");
    assert!(
        broken.join(" ").ends_with("boom: the device is on fire"),
        "{summary}"
    );
    let slow = row(&summary, "slow");
    assert_eq!(slow[1], "timeout");
    assert!(
        slow.join(" ").contains("killed at its 1s limit"),
        "{summary}"
    );
    let no_tool = row(&summary, "no_tool");
    assert_eq!(no_tool[1], "skipped");
    assert!(no_tool.join(" ").ends_with("no gcc here"), "{summary}");
    let late = row(&summary, "late");
    assert_eq!(late[1], "skipped");
    assert!(late.join(" ").contains("budget:"), "{summary}");
    assert!(
        summary.contains("5 steps: 1 pass, 1 FAIL, 1 timeout, 2 skipped"),
        "{summary}"
    );

    // The table is made from the steps file alone: rewrite it and the summary follows.
    std::fs::write(
        out.join("steps.tsv"),
        "imagined\tpass\t0\t1.5\t30\tpairs=7\t\n",
    )
    .unwrap();
    let o = with_runner(
        &out,
        "STEPS=$OUT/steps.tsv START_S=$(date +%s)\nwrite_summary\n",
    );
    assert!(o.status.success(), "{}", text(&o));
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    assert_eq!(
        row(&summary, "imagined")[..5],
        ["imagined", "pass", "1.5", "30", "pairs=7"]
    );
    assert!(!summary.contains("good"), "{summary}");
    assert!(summary.contains("1 steps: 1 pass, 0 FAIL"), "{summary}");

    // ONLY= reruns a subset; the others are recorded, not run.
    let o = with_runner(
        &out,
        "check_init\nONLY=b step a 10 false\nONLY=b step b 10 true\nwrite_summary\n",
    );
    assert!(o.status.success(), "{}", text(&o));
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    assert!(
        row(&summary, "a")
            .join(" ")
            .contains("skipped 0 10 not in ONLY"),
        "{summary}"
    );
    assert_eq!(row(&summary, "b")[1], "pass");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn without_a_kit_every_step_is_skipped_and_the_summary_comes_last() {
    let dir = temp_dir("nokit");
    let (kit, out) = (dir.join("kit"), dir.join("out"));
    std::fs::create_dir_all(&kit).unwrap();
    let o = bash()
        .arg(script())
        .env("KIT", &kit)
        .env("OUT", &out)
        .env("BUDGET_S", "120")
        .output()
        .unwrap();
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap_or_default();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        !summary.is_empty() && stdout.trim_end().ends_with(summary.trim_end()),
        "{}",
        text(&o)
    );
    for step in [
        "driver_costs",
        "cuda_driver",
        "pool_vmm",
        "pool_novmm",
        "cudarc_kernel",
        "torch_oom",
        "torch_snapshot",
        "replay_measured",
    ] {
        let r = row(&summary, step);
        assert_eq!(r[1], "skipped", "{summary}");
        assert!(r.join(" ").contains("rebuild the kit"), "{summary}");
    }
    for step in [
        "torch_train_native",
        "torch_shim",
        "torch_ipc",
        "plugin_pytest",
    ] {
        // Skipped for want of torch, CUDA, pytest or the kit; on a machine with a GPU and torch
        // the native run could pass.
        let r = row(&summary, step);
        assert!(r[1] == "skipped" || r[1] == "pass", "{summary}");
    }
    assert_eq!(row(&summary, "env")[1], "pass", "{summary}");
    assert!(
        !summary.contains(" FAIL ") && !summary.contains(" timeout "),
        "{summary}"
    );
    assert!(o.status.success(), "{}", text(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_scripts_are_shellcheck_clean() {
    let Ok(v) = Command::new("shellcheck").arg("--version").output() else {
        eprintln!("skipping: shellcheck is not installed");
        return;
    };
    assert!(v.status.success());
    let o = Command::new("shellcheck")
        .arg(script())
        .arg(repo().join("scripts/build-gpu-kit.sh"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn the_device_helpers_compile() {
    // pairbench is compiled by build-gpu-kit.sh, or on the device: warning-free, no CUDA headers.
    match Command::new("gcc").arg("--version").output() {
        Ok(_) => {
            let dir = temp_dir("cc");
            let o = Command::new("gcc")
                .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
                .arg(dir.join("pairbench"))
                .arg(repo().join("scripts/gpu/pairbench.c"))
                .arg("-ldl")
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", text(&o));
            std::fs::remove_dir_all(&dir).unwrap();
        }
        Err(_) => eprintln!("skipping pairbench: no gcc here"),
    }
    // torch_checks.py: compiled only (without torch every check is skipped).
    match Command::new("python3").arg("--version").output() {
        Ok(_) => {
            let src = repo().join("scripts/gpu/torch_checks.py");
            let o = Command::new("python3")
                .args([
                    "-c",
                    "import sys; compile(open(sys.argv[1]).read(), sys.argv[1], 'exec')",
                ])
                .arg(&src)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", text(&o));
        }
        Err(_) => eprintln!("skipping torch_checks.py: no python3 here"),
    }
}
