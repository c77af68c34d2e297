//! What NVML says about the processes using a GPU, for out-of-memory reports: every process
//! with a context on the device and the memory NVML counts for it, cistern's or not, as
//! PyTorch's own OOM message lists them ("Process 1234 has 2.00 GiB memory in use"). The pool
//! joins it with the registry (`pool/publish.rs`, [`crate::error::OomReport`]); `cistern ps`
//! has its own, fuller view (`cli/src/gpu.rs`).
//!
//! NVML is loaded on first use (`libnvidia-ml.so.1`, through `nvml-wrapper`, which opens it
//! with `libloading`: no link-time dependency, nothing loaded in a process that never runs
//! out of memory) and kept for the life of the process. Every failure (no NVML, a GPU it
//! does not know, a query it refuses) is an answer of "nothing known": an OOM report never
//! fails for want of NVML. Where NVML's list does not show this process (its pids are the
//! host's, seen from a container; under MPS it lists the server, not its clients) nothing of
//! it is used: `with_nvml` in `pool/publish.rs`.
//!
//! # Test hook
//!
//! `CISTERN_FAKE_NVML=<path to JSON>` answers from that file instead, in the format of the
//! CLI's hook of the same name: `{"gpus": [{"uuid": "GPU-…", "processes": [{"pid": 1,
//! "used_bytes": 0}]}]}`. It exists so the reports are tested on machines without a GPU; it is
//! not meant for users.

use std::sync::OnceLock;

/// A process NVML lists on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GpuProcess {
    /// The pid, in the pid namespace NVML sees (the host's, from inside most containers).
    pub pid: u32,
    /// Device memory NVML counts for it (its CUDA context included), when it can say.
    pub used: Option<u64>,
}

/// The compute processes on the GPU `uuid`, as NVML lists them; `None` when NVML cannot be
/// used or cannot answer for that GPU.
pub(crate) fn processes_on(uuid: &str) -> Option<Vec<GpuProcess>> {
    if let Some(path) = std::env::var_os("CISTERN_FAKE_NVML") {
        return fake(std::path::Path::new(&path), uuid);
    }
    static NVML: OnceLock<Option<nvml_wrapper::Nvml>> = OnceLock::new();
    let nvml = NVML
        .get_or_init(|| nvml_wrapper::Nvml::init().ok())
        .as_ref()?;
    let device = nvml.device_by_uuid(uuid).ok()?;
    let processes = device.running_compute_processes().ok()?;
    Some(
        processes
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                used: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                },
            })
            .collect(),
    )
}

/// The test hook's answer for `uuid` (see the module docs); `None` when the file cannot be
/// read, says `error`, or lists no such GPU.
fn fake(path: &std::path::Path, uuid: &str) -> Option<Vec<GpuProcess>> {
    let text = std::fs::read_to_string(path).ok()?;
    let doc: serde_json::Value = serde_json::from_str(&text).ok()?;
    let gpu = doc
        .get("gpus")?
        .as_array()?
        .iter()
        .find(|g| g.get("uuid").and_then(|u| u.as_str()) == Some(uuid))?;
    let list = match gpu.get("processes") {
        Some(p) => p.as_array()?.as_slice(),
        None => &[],
    };
    list.iter()
        .map(|p| {
            Some(GpuProcess {
                pid: u32::try_from(p.get("pid")?.as_u64()?).ok()?,
                used: p.get("used_bytes").and_then(|b| b.as_u64()),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fake_answers_for_its_gpus_only() {
        let dir = std::env::temp_dir().join(format!("cistern-nvml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("nvml.json");
        std::fs::write(
            &path,
            r#"{"gpus": [{"uuid": "GPU-a", "processes": [{"pid": 7, "used_bytes": 1024},
                {"pid": 8, "used_bytes": null, "kind": "compute"}]}, {"uuid": "GPU-b"}]}"#,
        )
        .unwrap();
        assert_eq!(
            fake(&path, "GPU-a"),
            Some(vec![
                GpuProcess {
                    pid: 7,
                    used: Some(1024)
                },
                GpuProcess { pid: 8, used: None },
            ])
        );
        assert_eq!(fake(&path, "GPU-b"), Some(vec![]));
        assert_eq!(fake(&path, "GPU-c"), None);
        std::fs::write(&path, r#"{"error": "NVML not available"}"#).unwrap();
        assert_eq!(fake(&path, "GPU-a"), None);
        assert_eq!(fake(&dir.join("missing.json"), "GPU-a"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
