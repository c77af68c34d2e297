//! The exporter's scrape target: one scrape of a registry with 100 records of 10 tags each (and
//! an NVML listing all 100 processes) must take under 50 ms. Builds the records in a temporary
//! registry, starts the real `cistern export` on a free loopback port, and times scrapes of
//! `/metrics` end to end (read, classify, encode, serve), and the exporter's own
//! `cistern_exporter_scrape_duration_seconds` (reading the registry and NVML and building the
//! samples, encoding excluded).
//!
//! Run with `cargo bench -p cistern-cli --bench scrape` (seconds). Exits 1 when the median
//! scrape misses the target.

#[allow(dead_code)]
#[path = "../tests/suite/common/holders.rs"]
mod holders;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use cistern::registry::{
    self, AttributionRecord, DeviceRecord, Identity, Placement, ProcessSnapshot, Registry, State,
};

const RECORDS: u32 = 100;
const TAGS: usize = 10;
const SCRAPES: usize = 50;
const TARGET_MS: f64 = 50.0;
const MIB: u64 = 1 << 20;
const UUID: &str = "GPU-bench-0000-0000-0000-000000000000";

fn publish(dir: &Path, pid: u32) {
    let tags: Vec<AttributionRecord> = (0..TAGS)
        .map(|t| AttributionRecord {
            name: format!("layer{t}.weights"),
            bytes: (t as u64 + 1) * MIB,
            blocks: 4,
        })
        .collect();
    let live: u64 = tags.iter().map(|t| t.bytes).sum();
    let id = Identity {
        pid,
        start_time: 1000 + pid as u64,
        boot_id: registry::boot_id().unwrap(),
        uid: registry::euid(),
        cmdline: vec!["python".into(), "train.py".into(), format!("--rank={pid}")],
        cmdline_truncated: false,
        // In a pod, as on a Kubernetes node: the container and pod labels are part of the cost.
        placement: Placement {
            cgroup: Some(format!("/kubepods.slice/cri-containerd-{pid:064x}.scope")),
            container_id: Some(format!("{pid:064x}")),
            pod_uid: Some(format!("1c6b3f2a-0000-4000-8000-{pid:012x}")),
            runtime: Some("containerd".into()),
            ..Placement::default()
        },
    };
    let dev = DeviceRecord {
        allocations: 0,
        ooms: 0,
        index: 0,
        uuid: Some(UUID.into()),
        name: "Bench GPU".into(),
        total_memory: 80 << 30,
        limit: 80 << 30,
        reserved: live + 64 * MIB,
        live,
        cached: 64 * MIB,
        pending: 0,
        peak_reserved: live + 128 * MIB,
        peak_live: live,
        top_tags: tags,
        top_sites: Vec::new(),
        imported: Vec::new(),
        imported_other: 0,
    };
    Registry::with_identity(dir, id)
        .unwrap()
        .publish(
            &ProcessSnapshot {
                devices: vec![dev],
                driver: Some("cuda".into()),
                last_oom: None,
                marks: Vec::new(),
            },
            State::Running,
            Vec::new(),
        )
        .unwrap();
}

fn main() {
    let work = std::env::temp_dir().join(format!("cistern-bench-scrape-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let reg = work.join("registry");
    std::fs::create_dir_all(&reg).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&reg, std::fs::Permissions::from_mode(0o700)).unwrap();
    // Pids far above any pid_max: dead processes, so every record takes the full path (liveness,
    // NVML claim, state) without depending on what runs here.
    let pids: Vec<u32> = (0..RECORDS).map(|i| 1_000_000_000 + i).collect();
    for &p in &pids {
        publish(&reg, p);
    }
    let procs: Vec<serde_json::Value> = pids
        .iter()
        .map(|p| serde_json::json!({"pid": p, "used_bytes": 200 * MIB, "kind": "compute"}))
        .collect();
    let nvml = work.join("nvml.json");
    std::fs::write(
        &nvml,
        serde_json::to_vec(&serde_json::json!({"gpus": [{
            "index": 0, "uuid": UUID, "name": "Bench GPU", "total": 80u64 << 30,
            "used": 0, "free": 40u64 << 30, "reserved": 0, "processes": procs}]}))
        .unwrap(),
    )
    .unwrap();

    let mut child = Command::new(env!("CARGO_BIN_EXE_cistern"))
        // Every request a fresh scrape (the exporter's cache would answer most from memory).
        .args([
            "export",
            "--fresh-for",
            "0",
            "--listen",
            "127.0.0.1:0",
            "--registry-dir",
        ])
        .arg(&reg)
        .env("CISTERN_FAKE_NVML", &nvml)
        .env_remove("CISTERN_CONF")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let child_guard = holders::Killed(child);
    let mut line = String::new();
    BufReader::new(stderr).read_line(&mut line).unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or_else(|| panic!("the exporter did not start: {line:?}"))
        .to_string();

    let scrape = || {
        let t = Instant::now();
        let (status, _, body) = holders::http_get(&addr, "/metrics", None).expect("scrape");
        assert_eq!(status, 200);
        (t.elapsed().as_secs_f64() * 1000.0, body)
    };
    let (_, body) = scrape();
    let series = body.lines().filter(|l| !l.starts_with('#')).count();
    let tag_series = body
        .lines()
        .filter(|l| l.starts_with("cistern_process_tag_live_bytes{"))
        .count();
    assert_eq!(
        tag_series,
        RECORDS as usize * TAGS,
        "every tag of every record is exported"
    );
    for _ in 0..5 {
        scrape();
    }
    let mut wall = Vec::new();
    let mut collect = Vec::new();
    for _ in 0..SCRAPES {
        let (ms, body) = scrape();
        wall.push(ms);
        let own = body
            .lines()
            .find_map(|l| l.strip_prefix("cistern_exporter_scrape_duration_seconds "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .expect("the exporter reports its scrape duration");
        collect.push(own * 1000.0);
    }
    drop(child_guard);
    let _ = std::fs::remove_dir_all(&work);

    let stats = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        (v[v.len() / 2], mean, v[v.len() - 1])
    };
    let (w50, wmean, wmax) = stats(&mut wall);
    let (c50, cmean, cmax) = stats(&mut collect);
    println!(
        "scrape of {RECORDS} records x {TAGS} tags ({series} series, {} KiB), {SCRAPES} scrapes:",
        body.len() / 1024
    );
    println!("  end to end (HTTP GET /metrics): median {w50:.2} ms, mean {wmean:.2} ms, max {wmax:.2} ms");
    println!("  collection (exporter's own):    median {c50:.2} ms, mean {cmean:.2} ms, max {cmax:.2} ms");
    if w50 < TARGET_MS {
        println!("  target: under {TARGET_MS} ms: met");
    } else {
        println!("  target: under {TARGET_MS} ms: MISSED");
        std::process::exit(1);
    }
}
