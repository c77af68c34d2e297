//! `cistern export` end to end: three processes use `libcistern.so` over the fake libcuda, each
//! with its own tag (one killed, one exited cleanly, one running); the exporter serves their
//! records on a free loopback port, with a fake NVML that still lists the killed pid with
//! memory; a real Prometheus server scrapes it every second, and PromQL through its HTTP API
//! must find the running process's tag and the dead process holding memory. The exposition must
//! pass `promtool check metrics`, and every query of the Grafana dashboard must run.
//!
//! Without Prometheus installed the test says why and passes, unless
//! `CISTERN_REQUIRE_PROMETHEUS=1` (CI), where it fails; `scripts/ensure-prometheus.sh`
//! installs it.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::holders::{free_port, http_get, on_path, url_encode, HolderKit, Killed};
use crate::common::{cistern, fake_nvml, ps_json, TempDir, MIB};

/// `prometheus` and `promtool`, or `None` (with the reason printed) when they are missing and
/// not required.
fn prometheus_tools() -> Option<(PathBuf, PathBuf)> {
    match (on_path("prometheus"), on_path("promtool")) {
        (Some(p), Some(t)) => Some((p, t)),
        _ => {
            let why = "prometheus or promtool is not installed (Debian's `prometheus` package; \
                       scripts/ensure-prometheus.sh installs it)";
            assert!(
                std::env::var("CISTERN_REQUIRE_PROMETHEUS").as_deref() != Ok("1"),
                "CISTERN_REQUIRE_PROMETHEUS=1 but {why}"
            );
            eprintln!("skipping the Prometheus end-to-end test: {why}");
            None
        }
    }
}

fn private_dir(t: &TempDir) -> &Path {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(t.path()).unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    t.path()
}

fn ps(registry: &Path) -> serde_json::Value {
    ps_json(None, registry)
}

fn process(ps: &serde_json::Value, pid: u32) -> Option<&serde_json::Value> {
    ps["processes"]
        .as_array()?
        .iter()
        .find(|p| p["pid"].as_u64() == Some(pid as u64))
}

/// Polls until `ok` gives a value, for at most `secs`.
fn wait_for<T>(secs: u64, what: &str, mut ok: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    loop {
        match ok() {
            Ok(v) => return v,
            Err(last) => {
                assert!(
                    start.elapsed() < Duration::from_secs(secs),
                    "timed out waiting for {what}; last: {last}"
                );
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Starts `cistern export` on a free loopback port; returns the child and its address.
fn start_exporter(registry: &Path, nvml: &Path, extra: &[&str]) -> (Killed, String) {
    let mut child = cistern(Some(nvml))
        .args(["export", "--listen", "127.0.0.1:0", "--registry-dir"])
        .arg(registry)
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    err.read_line(&mut line).unwrap();
    // Keep reading its log, so that it never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while err.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            eprint!("exporter: {sink}");
            sink.clear();
        }
    });
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or_else(|| panic!("the exporter did not say where it serves: {line:?}"))
        .to_string();
    (Killed(child), addr)
}

fn query(prom: &str, q: &str) -> Result<Vec<serde_json::Value>, String> {
    let (status, _, body) = http_get(
        prom,
        &format!("/api/v1/query?query={}", url_encode(q)),
        None,
    )
    .ok_or("Prometheus does not answer yet")?;
    if status != 200 {
        return Err(format!("{status}: {body}"));
    }
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

fn value(sample: &serde_json::Value) -> f64 {
    sample["value"][1].as_str().unwrap().parse().unwrap()
}

#[test]
fn prometheus_scrapes_three_processes() {
    let Some((prometheus, promtool)) = prometheus_tools() else {
        return;
    };
    let work = TempDir::new("export-work");
    std::fs::create_dir_all(work.path()).unwrap();
    let reg = TempDir::new("export-registry");
    let registry = private_dir(&reg);
    let Some(kit) = HolderKit::new(work.path()) else {
        return;
    };

    let mut killed = kit.spawn(registry, "weights", 40, "wait");
    let running = kit.spawn(registry, "activations", 24, "wait");
    let mut exited = kit.spawn(registry, "loader", 8, "exit");
    assert!(exited.0.wait().unwrap().success());
    let (killed_pid, running_pid, exited_pid) = (killed.pid(), running.pid(), exited.pid());

    // All three have published (records refresh at most once a second).
    let snap = wait_for(20, "three records with live bytes", || {
        let ps = ps(registry);
        let ok = [killed_pid, running_pid, exited_pid]
            .iter()
            .all(|&p| process(&ps, p).is_some_and(|p| p["live"].as_u64().unwrap_or(0) > 0));
        if ok {
            Ok(ps)
        } else {
            Err(ps.to_string())
        }
    });
    let uuid = process(&snap, killed_pid).unwrap()["gpus"][0]["uuid"]
        .as_str()
        .expect("the fake driver gives its device a UUID")
        .to_string();
    killed.0.kill().unwrap();
    killed.0.wait().unwrap();

    // NVML, as the driver would leave it after a SIGKILL: the dead pid still holds memory.
    let nvml = fake_nvml(
        work.path(),
        serde_json::json!({"gpus": [{
        "index": 0, "uuid": uuid, "name": "Fake GPU", "total": 4u64 << 30,
        "used": 0, "free": (4u64 << 30) - 200 * MIB, "reserved": 0,
        "processes": [
            {"pid": running_pid, "used_bytes": 64 * MIB, "kind": "compute"},
            {"pid": killed_pid, "used_bytes": 48 * MIB, "kind": "compute"}
        ]}]}),
    );
    let (_exporter, addr) = start_exporter(registry, &nvml, &["--top-tags", "5"]);

    // The text format (no Accept header) passes promtool; OpenMetrics comes on negotiation.
    let (status, headers, text) = http_get(&addr, "/metrics", None).expect("exporter answers");
    assert_eq!(status, 200, "{text}");
    assert!(
        headers.contains(&(
            "content-type".into(),
            "text/plain; version=0.0.4; charset=utf-8".into()
        )),
        "{headers:?}"
    );
    let mut check = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, headers, om) = http_get(
        &addr,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
    )
    .unwrap();
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(
        headers.iter().any(|(k, v)| k == "content-type"
            && v.starts_with("application/openmetrics-text; version=1.0.0")),
        "{headers:?}"
    );
    let (status, _, _) = http_get(&addr, "/nothing", None).unwrap();
    assert_eq!(status, 404);

    // A real Prometheus scraping the exporter every second.
    let prom_dir = TempDir::new("export-prometheus");
    std::fs::create_dir_all(prom_dir.path()).unwrap();
    let config = prom_dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: cistern\n    static_configs:\n      \
             - targets: ['{addr}']\n"
        ),
    )
    .unwrap();
    let prom_addr = format!("127.0.0.1:{}", free_port());
    let _prometheus = Killed(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                prom_dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prom_addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );

    // The live bytes of the running process's tag.
    let q = format!(r#"cistern_process_tag_live_bytes{{pid="{running_pid}",tag="activations"}}"#);
    let r = wait_for(60, &q, || {
        let r = query(&prom_addr, &q)?;
        if r.is_empty() {
            Err(format!("no result yet; up: {:?}", query(&prom_addr, "up")))
        } else {
            Ok(r)
        }
    });
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(value(&r[0]) >= (24 * MIB) as f64, "{r:?}");
    assert_eq!(r[0]["metric"]["UUID"], uuid.as_str(), "{r:?}");
    assert_eq!(r[0]["metric"]["gpu"], "0", "{r:?}");

    // The dead process holding memory, and how much.
    let q = r#"cistern_process_gpu_used_bytes and on(pid) cistern_process_state{state="dead-but-memory-held"} == 1"#;
    let r = wait_for(30, q, || {
        query(&prom_addr, q).and_then(|r| {
            if r.is_empty() {
                Err("empty".into())
            } else {
                Ok(r)
            }
        })
    });
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["metric"]["pid"], killed_pid.to_string(), "{r:?}");
    assert_eq!(value(&r[0]), (48 * MIB) as f64, "{r:?}");

    // The other two, as their states say.
    let r = query(&prom_addr, r#"cistern_process_state == 1"#).unwrap();
    let state = |pid: u32| {
        r.iter()
            .find(|s| s["metric"]["pid"].as_str() == Some(pid.to_string().as_str()))
            .map(|s| s["metric"]["state"].as_str().unwrap().to_string())
    };
    assert_eq!(state(running_pid).as_deref(), Some("running"), "{r:?}");
    assert_eq!(state(exited_pid).as_deref(), Some("exited"), "{r:?}");
    // The exited process's memory went with it: its record's bytes are not summed as held.
    let q = format!(r#"cistern_process_live_bytes{{pid="{exited_pid}"}}"#);
    assert_eq!(
        query(&prom_addr, &q).unwrap(),
        Vec::<serde_json::Value>::new()
    );
    let r = query(&prom_addr, "cistern_gpu_memory_dead_held_bytes").unwrap();
    assert_eq!(value(&r[0]), (48 * MIB) as f64, "{r:?}");

    // Every query of the Grafana dashboard is valid PromQL that Prometheus runs on these
    // metrics, and the panel of dead processes finds the killed one.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dash: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("deploy/grafana/cistern.json")).unwrap())
            .unwrap();
    let mut exprs = Vec::new();
    panel_exprs(&dash, "", &mut exprs);
    assert!(exprs.len() >= 10, "{exprs:?}");
    for (title, expr) in &exprs {
        let q = expr.replace("$node", ".*");
        let r = query(&prom_addr, &q).unwrap_or_else(|e| panic!("panel {title:?}: {q}: {e}"));
        if title == "Dead processes holding memory" {
            assert_eq!(r.len(), 1, "{q}: {r:?}");
            assert_eq!(r[0]["metric"]["pid"], killed_pid.to_string(), "{r:?}");
        }
    }
    drop(running);
}

/// The `expr` of every panel target, with the panel's title.
fn panel_exprs(v: &serde_json::Value, title: &str, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            let title = m.get("title").and_then(|t| t.as_str()).unwrap_or(title);
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push((title.into(), e.clone())),
                    _ => panel_exprs(v, title, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| panel_exprs(v, title, out)),
        _ => {}
    }
}

#[test]
fn a_port_in_use_names_the_fix() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let reg = TempDir::new("export-port");
    let out = cistern(None)
        .args(["export", "--listen", &addr, "--registry-dir"])
        .arg(private_dir(&reg))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the port is in use"), "{err}");
    let out = cistern(None)
        .args(["export", "--listen", "nonsense"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected HOST:PORT"), "{err}");
}

#[test]
fn sigterm_stops_the_exporter_cleanly() {
    let reg = TempDir::new("export-sigterm");
    let work = TempDir::new("export-sigterm-nvml");
    let nvml = fake_nvml(
        work.path(),
        serde_json::json!({"error": "NVML not available: test"}),
    );
    let (mut exporter, addr) = start_exporter(private_dir(&reg), &nvml, &[]);
    let (status, _, body) = http_get(&addr, "/", None).unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("/metrics"), "{body}");
    let (_, _, text) = http_get(&addr, "/metrics", None).unwrap();
    assert!(text.contains("cistern_exporter_nvml_up 0\n"), "{text}");
    let kill = Command::new("kill")
        .args(["-TERM", &exporter.pid().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = exporter.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

/// The driver's Xid errors in the kernel log (recorded lines here) are counted per GPU (by bus
/// id), code and severity; a kernel log that cannot be read is reported down.
#[test]
fn xid_errors_are_exported_per_gpu_and_code() {
    let t = TempDir::new("export-xid");
    let reg = private_dir(&t).join("registry");
    let kmsg = t.path().join("kmsg");
    std::fs::write(
        &kmsg,
        "[ 5.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n\
         [ 6.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, Graphics Exception\n\
         [ 7.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1235, name=python, Graphics Exception\n",
    )
    .unwrap();
    let nvml = fake_nvml(
        t.path(),
        serde_json::json!({"gpus": [{"index": 0, "uuid": "GPU-x", "total": 1u64 << 30,
            "used": 0, "free": 1u64 << 30, "pci_bus_id": "00000000:3B:00.0", "processes": []}]}),
    );
    let scrape = |kmsg: &Path| {
        let out = cistern(Some(&nvml))
            .env("CISTERN_FAKE_KMSG", kmsg)
            .args(["export", "--once", "--kube-logs", "none", "--registry-dir"])
            .arg(&reg)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let text = scrape(&kmsg);
    let line = |xid: &str, sev: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("cistern_gpu_xid_errors{")
                    && l.contains(&format!("xid=\"{xid}\""))
                    && l.contains(&format!("severity=\"{sev}\""))
            })
            .unwrap_or_else(|| panic!("no Xid {xid} series in:\n{text}"))
            .to_string()
    };
    let fatal = line("79", "fatal");
    assert!(
        fatal.contains(r#"gpu="0""#) && fatal.contains(r#"UUID="GPU-x""#),
        "{fatal}"
    );
    assert!(fatal.ends_with(" 1"), "{fatal}");
    assert!(line("13", "application").ends_with(" 2"), "{text}");
    assert!(text.contains("cistern_exporter_kernel_log_up 1"), "{text}");
    let down = scrape(&t.path().join("no-such-log"));
    assert!(down.contains("cistern_exporter_kernel_log_up 0"), "{down}");
    assert!(!down.contains("cistern_gpu_xid_errors{"), "{down}");
}

/// `--fresh-for` takes 0 to 60 seconds and names the range otherwise.
#[test]
fn a_bad_fresh_for_names_the_range() {
    let out = cistern(None)
        .args(["export", "--once", "--fresh-for", "99"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("from 0 to 60"), "{err}");
}
