//! The main command on a fresh clone: `cistern replay` with no argument reads no file, so its
//! rows are the same whether or not a traces folder is around, and nothing it prints names a
//! path of the machine it was built on.

use std::path::PathBuf;
use std::process::Command;

/// `cistern replay --json --no-min-capacity` in an empty folder, with `CISTERN_TRACES_DIR` as
/// given; the JSON with the timing fields (`ops_per_sec`) removed, and the raw stdout+stderr.
fn main_command(traces_dir: Option<&std::path::Path>) -> (serde_json::Value, String) {
    let cwd = std::env::temp_dir().join(format!("cistern-fresh-{}", std::process::id()));
    std::fs::create_dir_all(&cwd).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_cistern"));
    c.current_dir(&cwd)
        .env("NO_COLOR", "1")
        .env_remove("CISTERN_TRACES_DIR")
        .args(["replay", "--json", "--no-min-capacity"]);
    if let Some(d) = traces_dir {
        c.env("CISTERN_TRACES_DIR", d);
    }
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    let mut doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                m.remove("ops_per_sec");
                m.values_mut().for_each(strip);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut doc);
    (doc, text)
}

#[test]
fn the_main_command_is_the_same_with_or_without_the_traces_folder() {
    let (bare, text) = main_command(None);
    // A traces folder that holds MiniMalloc's instances (the dev folder when it is here, else
    // a made-up one): the default run must not pick them up.
    let dev = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let made = std::env::temp_dir().join(format!("cistern-fresh-traces-{}", std::process::id()));
    let dir = if dev.join("static_lifetimes").is_dir() {
        dev
    } else {
        let d = made.join("static_lifetimes/minimalloc_challenging");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("A.1048576.csv"),
            "id,lower,upper,size\n0,0,10,1024\n",
        )
        .unwrap();
        made.clone()
    };
    let (full, _) = main_command(Some(&dir));
    assert_eq!(
        bare, full,
        "the main command's rows depend on a traces folder"
    );

    let traces = bare.as_array().expect("one entry per trace");
    let names: Vec<&str> = traces
        .iter()
        .map(|t| t["trace"].as_str().unwrap_or(""))
        .collect();
    for want in [
        "training",
        "llm-serving",
        "llm-serving-mooncake",
        "rmm-random",
        "packed-A",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "{want} missing from {names:?}"
        );
    }
    assert!(names.len() >= 15, "{names:?}");
    for bad in ["not found", "built-in lengths", "shared/traces"] {
        assert!(!text.contains(bad), "the output says {bad:?}:\n{text}");
    }
    let built_in = env!("CARGO_MANIFEST_DIR");
    assert!(
        !text.contains(built_in),
        "the output names the build machine's path {built_in}"
    );
    let _ = std::fs::remove_dir_all(made);
}

#[test]
fn a_minimalloc_workload_without_its_folder_names_the_fix() {
    let out = Command::new(env!("CARGO_BIN_EXE_cistern"))
        .env_remove("CISTERN_TRACES_DIR")
        .args(["replay", "-w", "minimalloc-C"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("CISTERN_TRACES_DIR") && err.contains("packed-C"),
        "{err}"
    );
    assert!(!err.contains(env!("CARGO_MANIFEST_DIR")), "{err}");
}
