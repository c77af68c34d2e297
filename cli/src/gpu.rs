//! What the GPUs and the kernel say about who holds device memory: NVML's per-GPU and
//! per-process view behind a trait (so `ps`, `leaks` and `doctor` are tested with a fake), and
//! `/proc` scans for processes that hold `/dev/nvidia*` open and for MPS servers.
//!
//! # Test hook
//!
//! `CISTERN_FAKE_NVML=<path to JSON>` replaces NVML with [`FakeView`], read from that file:
//!
//! ```json
//! {"gpus": [{"index": 0, "uuid": "GPU-…", "name": "…", "total": 0, "used": 0, "free": 0,
//!            "reserved": 0, "compute_mode": "default", "mps": false, "mig": null,
//!            "pci_bus_id": "00000000:3B:00.0",
//!            "processes": [{"pid": 1, "used_bytes": 0, "kind": "compute"}]}]}
//! ```
//!
//! or `{"error": "…"}` for an NVML that cannot be used. It exists so the `cistern` binary can be
//! tested end to end on machines without a GPU; it is not meant for users.

use std::fs;
use std::path::Path;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// One physical GPU (or MIG-enabled parent), as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML's index (physical, not affected by `CUDA_VISIBLE_DEVICES`).
    pub index: u32,
    /// `GPU-…`: how records and NVML are joined.
    pub uuid: String,
    /// The product name.
    #[serde(default)]
    pub name: String,
    /// Memory in total.
    pub total: u64,
    /// Memory allocated, not counting `reserved` (NVML's v2 memory info).
    pub used: u64,
    /// Memory free.
    pub free: u64,
    /// Memory the driver sets aside (v2 memory info), when known.
    #[serde(default)]
    pub reserved: Option<u64>,
    /// The compute mode: `default`, `exclusive-process`, `prohibited`, or `unknown`.
    #[serde(default = "unknown")]
    pub compute_mode: String,
    /// Whether an MPS server serves this GPU.
    #[serde(default)]
    pub mps: bool,
    /// MIG instances when MIG is on (their names and UUIDs), `None` when off or unsupported.
    #[serde(default)]
    pub mig: Option<String>,
    /// The PCI bus id (`00000000:3B:00.0`), when known: how kernel-log Xid lines name the GPU.
    #[serde(default)]
    pub pci_bus_id: Option<String>,
}

fn unknown() -> String {
    "unknown".into()
}

/// Whether a process uses a GPU for compute or graphics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcKind {
    /// A CUDA (compute) context.
    Compute,
    /// A graphics context.
    Graphics,
}

/// A process NVML lists on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// The pid (in the host's pid namespace, which may not be this one's in a container).
    pub pid: u32,
    /// Device memory it uses, when NVML knows.
    pub used_bytes: Option<u64>,
    /// Compute or graphics.
    pub kind: ProcKind,
}

/// NVML, or a fake of it.
pub trait GpuView {
    /// Every GPU, or why NVML cannot be used.
    fn gpus(&self) -> Result<Vec<GpuInfo>, String>;
    /// The processes using `gpu` (compute and graphics; a process using both appears twice).
    fn processes(&self, gpu: &GpuInfo) -> Vec<GpuProcess>;
}

/// The view the commands use: the fake when `CISTERN_FAKE_NVML` is set, NVML otherwise.
pub fn from_env() -> Result<Box<dyn GpuView>, String> {
    match std::env::var_os("CISTERN_FAKE_NVML").filter(|v| !v.is_empty()) {
        Some(path) => Ok(Box::new(FakeView::load(Path::new(&path))?)),
        None => Ok(Box::new(NvmlView::default())),
    }
}

// ---------------------------------------------------------------------------------------------
// NVML

/// NVML through `nvml-wrapper`, loaded on first use.
#[derive(Default)]
pub struct NvmlView {
    nvml: OnceLock<Result<nvml_wrapper::Nvml, String>>,
}

impl NvmlView {
    fn nvml(&self) -> Result<&nvml_wrapper::Nvml, String> {
        self.nvml
            .get_or_init(|| {
                nvml_wrapper::Nvml::init().map_err(|e| format!("NVML not available: {e}"))
            })
            .as_ref()
            .map_err(|e| e.clone())
    }
}

impl GpuView for NvmlView {
    fn gpus(&self) -> Result<Vec<GpuInfo>, String> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode;
        let nvml = self.nvml()?;
        let count = nvml
            .device_count()
            .map_err(|e| format!("NVML: counting devices: {e}"))?;
        let mps_servers = mps_server_pids();
        let mut out = Vec::new();
        for index in 0..count {
            let d = nvml
                .device_by_index(index)
                .map_err(|e| format!("NVML: device {index}: {e}"))?;
            let uuid = d
                .uuid()
                .map_err(|e| format!("NVML: device {index}'s UUID: {e}"))?;
            let mem = d
                .memory_info()
                .map_err(|e| format!("NVML: device {index}'s memory: {e}"))?;
            let compute_mode = match d.compute_mode() {
                Ok(ComputeMode::Default) => "default",
                Ok(ComputeMode::ExclusiveThread) => "exclusive-thread",
                Ok(ComputeMode::ExclusiveProcess) => "exclusive-process",
                Ok(ComputeMode::Prohibited) => "prohibited",
                Err(_) => "unknown",
            }
            .to_string();
            let listed: Vec<u32> = d
                .running_compute_processes()
                .unwrap_or_default()
                .iter()
                .map(|p| p.pid)
                .collect();
            let mps = listed.iter().any(|p| mps_servers.contains(p));
            let mig = match d.mig_mode() {
                Ok(m) if m.current == 1 => {
                    let n = d.mig_device_count().unwrap_or(0);
                    let names: Vec<String> = (0..n)
                        .filter_map(|i| d.mig_device_by_index(i).ok())
                        .map(|m| {
                            format!(
                                "{} {}",
                                m.name().unwrap_or_default(),
                                m.uuid().unwrap_or_default()
                            )
                        })
                        .collect();
                    Some(if names.is_empty() {
                        "enabled".to_string()
                    } else {
                        names.join(", ")
                    })
                }
                _ => None,
            };
            out.push(GpuInfo {
                index,
                uuid,
                name: d.name().unwrap_or_default(),
                total: mem.total,
                used: mem.used,
                free: mem.free,
                reserved: Some(mem.reserved),
                compute_mode,
                mps,
                mig,
                pci_bus_id: d.pci_info().ok().map(|p| p.bus_id),
            });
        }
        Ok(out)
    }

    fn processes(&self, gpu: &GpuInfo) -> Vec<GpuProcess> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let Ok(nvml) = self.nvml() else {
            return Vec::new();
        };
        let Ok(d) = nvml.device_by_uuid(gpu.uuid.as_str()) else {
            return Vec::new();
        };
        let conv = |kind: ProcKind| {
            move |p: nvml_wrapper::struct_wrappers::device::ProcessInfo| GpuProcess {
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                },
                kind,
            }
        };
        let mut out: Vec<GpuProcess> = d
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .map(conv(ProcKind::Compute))
            .collect();
        out.extend(
            d.running_graphics_processes()
                .unwrap_or_default()
                .into_iter()
                .map(conv(ProcKind::Graphics)),
        );
        out
    }
}

// ---------------------------------------------------------------------------------------------
// The fake

/// A GPU view read from JSON (the `CISTERN_FAKE_NVML` test hook; see the module docs).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct FakeView {
    #[serde(default)]
    gpus: Vec<FakeGpu>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct FakeGpu {
    #[serde(flatten)]
    info: GpuInfo,
    #[serde(default)]
    processes: Vec<GpuProcess>,
}

impl FakeView {
    /// Reads a fake from a JSON file.
    pub fn load(path: &Path) -> Result<FakeView, String> {
        let text = fs::read_to_string(path)
            .map_err(|e| format!("CISTERN_FAKE_NVML: reading {}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("CISTERN_FAKE_NVML: {}: {e}", path.display()))
    }
}

impl GpuView for FakeView {
    fn gpus(&self) -> Result<Vec<GpuInfo>, String> {
        match &self.error {
            Some(e) => Err(e.clone()),
            None => Ok(self.gpus.iter().map(|g| g.info.clone()).collect()),
        }
    }

    fn processes(&self, gpu: &GpuInfo) -> Vec<GpuProcess> {
        self.gpus
            .iter()
            .find(|g| g.info.uuid == gpu.uuid)
            .map(|g| g.processes.clone())
            .unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------
// /proc

/// What `/proc/<pid>/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// The state character (`R`, `S`, `Z`, ...).
    pub state: char,
    /// The parent's pid.
    pub ppid: u32,
    /// The process group.
    pub pgid: u32,
    /// The start time (clock ticks since boot).
    pub start_time: u64,
}

/// Parses a `/proc/<pid>/stat` line (the command name may hold spaces and parentheses).
pub fn parse_stat(line: &str) -> Option<ProcStat> {
    let rest = &line[line.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_ascii_whitespace().collect();
    // f[0] is field 3 (state); field N is f[N - 3].
    Some(ProcStat {
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgid: f.get(2)?.parse().ok()?,
        start_time: f.get(19)?.parse().ok()?,
    })
}

/// `/proc/<pid>/stat`, when the process exists and it can be read.
pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether a process with this pid exists in this pid namespace (zombies included).
pub fn pid_exists(pid: u32) -> bool {
    pid != 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// A process's command line joined by spaces, or its `comm` in brackets, or empty.
pub fn command_of(pid: u32) -> String {
    if let Ok(raw) = fs::read(format!("/proc/{pid}/cmdline")) {
        let args: Vec<String> = raw
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.is_empty() {
            return args.join(" ");
        }
    }
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| format!("[{}]", c.trim()))
        .unwrap_or_default()
}

fn proc_pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// Pids of running `nvidia-cuda-mps-server` processes.
pub fn mps_server_pids() -> Vec<u32> {
    proc_pids()
        .into_iter()
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .ok()
                .and_then(|raw| {
                    let argv0 = raw.split(|&b| b == 0).next()?.to_vec();
                    let argv0 = String::from_utf8(argv0).ok()?;
                    Some(argv0.rsplit('/').next()? == "nvidia-cuda-mps-server")
                })
                .unwrap_or(false)
        })
        .collect()
}

/// A process that holds NVIDIA device files open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Holder {
    /// The pid.
    pub pid: u32,
    /// The device files it holds (`/dev/nvidia0`, `/dev/nvidiactl`, `/dev/nvidia-uvm`, ...).
    pub files: Vec<String>,
}

/// Every process whose `/proc/<pid>/fd` shows `/dev/nvidia*` open (what `fuser -v /dev/nvidia*`
/// shows), by pid. Processes whose fds cannot be read (other users', without privileges) are
/// skipped; the second value counts them.
pub fn dev_nvidia_holders() -> (Vec<Holder>, usize) {
    let mut out = Vec::new();
    let mut unreadable = 0;
    let mut pids = proc_pids();
    pids.sort_unstable();
    for pid in pids {
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            unreadable += 1;
            continue;
        };
        let mut files: Vec<String> = fds
            .flatten()
            .filter_map(|fd| fs::read_link(fd.path()).ok())
            .filter_map(|t| t.to_str().map(str::to_string))
            .filter(|t| t.starts_with("/dev/nvidia"))
            .collect();
        if !files.is_empty() {
            files.sort();
            files.dedup();
            out.push(Holder { pid, files });
        }
    }
    (out, unreadable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields() {
        let line = "1234 (a (weird) name) S 7 8 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20";
        let s = parse_stat(line).unwrap();
        assert_eq!((s.state, s.ppid, s.pgid, s.start_time), ('S', 7, 8, 987654));
        let me = proc_stat(std::process::id()).unwrap();
        assert_eq!(
            me.start_time,
            cistern::registry::process_start_time(std::process::id()).unwrap()
        );
        assert!(parse_stat("1 (x) S 1").is_none());
    }

    #[test]
    fn fake_view_from_json() {
        let v: FakeView = serde_json::from_str(
            r#"{"gpus":[{"index":0,"uuid":"GPU-a","total":10,"used":4,"free":5,"reserved":1,
                "processes":[{"pid":7,"used_bytes":3,"kind":"compute"}]}]}"#,
        )
        .unwrap();
        let g = v.gpus().unwrap();
        assert_eq!(g[0].compute_mode, "unknown");
        assert_eq!(v.processes(&g[0])[0].pid, 7);
        let e: FakeView = serde_json::from_str(r#"{"error":"NVML not available: x"}"#).unwrap();
        assert!(e.gpus().is_err());
    }

    #[test]
    fn holder_scan_does_not_fail() {
        // No NVIDIA device here (usually), but the scan must skip what it cannot read.
        let (holders, _unreadable) = dev_nvidia_holders();
        assert!(holders.iter().all(|h| !h.files.is_empty()));
    }
}
