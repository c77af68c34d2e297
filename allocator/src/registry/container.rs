//! Where a process runs, as operators name it: its cgroup path (`/proc/<pid>/cgroup`), the
//! container, pod and systemd unit parsed from it, and its pids in each pid namespace
//! (`NSpid:` in `/proc/<pid>/status`), so that a record joins with what the node's other tools
//! show and a process in a container is neither dead nor anonymous to a reader on the host.
//!
//! Everything here is best effort and bounded: a line that names nothing known gives nothing,
//! never an error, and the cgroup path is cut to [`MAX_CGROUP_BYTES`].

use std::collections::HashMap;
use std::fs;

use serde::{Deserialize, Serialize};

use super::process::parse_stat;

/// The cgroup path is cut to this many bytes.
pub const MAX_CGROUP_BYTES: usize = 1024;

/// Where a process runs (all optional: what the kernel said and could be parsed).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The cgroup path: the v2 (`0::`) path when it names more than the root, else the v1 path
    /// that names a container, else the first v1 path below the root.
    pub cgroup: Option<String>,
    /// The container id (hex, as the runtime prints it).
    pub container_id: Option<String>,
    /// The Kubernetes pod UID (dashed form: the systemd driver's `_` become `-`).
    pub pod_uid: Option<String>,
    /// The container runtime: `containerd`, `cri-o`, `docker`, `podman`; `None` when the path
    /// does not say (the kubelet's cgroupfs driver names no runtime).
    pub runtime: Option<String>,
    /// The systemd unit (`*.service`, `*.scope`) of a process in no container.
    pub systemd_unit: Option<String>,
    /// The process's pid in each pid namespace, outermost visible first (`NSpid:`); the last is
    /// the pid the process sees itself.
    pub ns_pids: Vec<u32>,
    /// The inode of the process's pid namespace (`/proc/<pid>/ns/pid`).
    pub pid_ns: Option<u64>,
}

impl Placement {
    /// This process's placement, from `/proc/self`.
    pub fn current() -> Placement {
        let mut p = fs::read_to_string("/proc/self/cgroup")
            .map(|t| parse_cgroup(&t))
            .unwrap_or_default();
        p.ns_pids = fs::read_to_string("/proc/self/status")
            .map(|t| parse_nspid(&t))
            .unwrap_or_default();
        p.pid_ns = pid_ns_of("self");
        p
    }

    /// The pid in the outermost pid namespace this process can see, when that is not its own
    /// (`NSpid:` lists more than one): the pid a reader in that namespace (the host's, when the
    /// host's `/proc` is mounted) uses.
    pub fn host_pid(&self) -> Option<u32> {
        (self.ns_pids.len() > 1).then(|| self.ns_pids[0])
    }
}

/// The inode of `/proc/<pid>/ns/pid` (`pid:[4026531836]`), when it can be read.
pub fn pid_ns_of(pid: &str) -> Option<u64> {
    let link = fs::read_link(format!("/proc/{pid}/ns/pid")).ok()?;
    let s = link.to_str()?;
    s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// Parses the `NSpid:` line of a `/proc/<pid>/status` (pids, outermost first). Kernels before
/// 4.1 have none: empty.
pub fn parse_nspid(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|rest| {
            rest.split_ascii_whitespace()
                .map_while(|f| f.parse().ok())
                .take(32)
                .collect()
        })
        .unwrap_or_default()
}

/// Parses a `/proc/<pid>/cgroup` file (`hierarchy:controllers:path` lines, v1 and v2): the
/// cgroup path, and the container, pod and unit it names. `ns_pids` and `pid_ns` are left
/// empty.
pub fn parse_cgroup(text: &str) -> Placement {
    let mut v2: Option<&str> = None;
    let mut v1: Vec<&str> = Vec::new();
    for line in text.lines().take(64) {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path);
        } else {
            v1.push(path);
        }
    }
    let below_root = |p: &&str| !p.is_empty() && *p != "/";
    // The path that names a container wins; then one below the root; then the v2 root.
    let candidates: Vec<&str> = v2.iter().copied().chain(v1.iter().copied()).collect();
    let chosen = candidates
        .iter()
        .copied()
        .filter(below_root)
        .find(|p| parse_path(p).container_id.is_some())
        .or_else(|| candidates.iter().copied().find(below_root))
        .or(v2);
    let Some(path) = chosen else {
        return Placement::default();
    };
    let mut p = parse_path(path);
    let mut cut = path.len().min(MAX_CGROUP_BYTES);
    while !path.is_char_boundary(cut) {
        cut -= 1;
    }
    p.cgroup = Some(path[..cut].to_string());
    p
}

fn is_hex_id(s: &str) -> bool {
    (12..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_uid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, b)| {
            matches!(i, 8 | 13 | 18 | 23) == (b == b'-') && (b == b'-' || b.is_ascii_hexdigit())
        })
}

/// The container, pod and unit one cgroup path names.
fn parse_path(path: &str) -> Placement {
    let mut p = Placement::default();
    let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    for (i, c) in parts.iter().enumerate() {
        // Pods: `pod<uid>` (cgroupfs driver) or `...-pod<uid_with_underscores>.slice` (systemd).
        let pod = c
            .strip_suffix(".slice")
            .and_then(|s| s.rsplit_once("-pod").map(|x| x.1))
            .or_else(|| c.strip_prefix("pod"))
            .map(|u| u.replace('_', "-"));
        if let Some(u) = pod.filter(|u| is_uid(u)) {
            p.pod_uid = Some(u.to_ascii_lowercase());
            continue;
        }
        // Runtimes' systemd scopes.
        if let Some(scope) = c.strip_suffix(".scope") {
            for (prefix, runtime) in [
                ("cri-containerd-", "containerd"),
                ("crio-", "cri-o"),
                ("docker-", "docker"),
                ("libpod-", "podman"),
            ] {
                if let Some(id) = scope.strip_prefix(prefix).filter(|id| is_hex_id(id)) {
                    p.container_id = Some(id.to_string());
                    p.runtime = Some(runtime.to_string());
                }
            }
            if p.container_id.is_some() {
                continue;
            }
        }
        // Docker's cgroupfs driver: `/docker/<id>`; the kubelet's: `.../pod<uid>/<id>`, which
        // CRI-O spells `.../pod<uid>/crio-<id>` (its `crio-conmon-<id>` is the monitor, not
        // the container).
        if i > 0 {
            let parent = parts[i - 1];
            if is_hex_id(c) && parent == "docker" {
                p.container_id = Some(c.to_string());
                p.runtime = Some("docker".into());
            } else if p.pod_uid.is_some() && parent.starts_with("pod") {
                if is_hex_id(c) {
                    p.container_id = Some(c.to_string());
                } else if let Some(id) = c.strip_prefix("crio-").filter(|id| is_hex_id(id)) {
                    p.container_id = Some(id.to_string());
                    p.runtime = Some("cri-o".into());
                }
            }
        }
    }
    if p.container_id.is_none() {
        p.systemd_unit = parts
            .iter()
            .rev()
            .find(|c| c.ends_with(".service") || c.ends_with(".scope"))
            .map(|c| c.to_string());
    }
    p
}

/// Finds, from the reader's pid namespace, the processes of other pid namespaces: each
/// process whose `NSpid:` lists more than one pid, by its innermost pid. Scanned once, on first
/// use.
#[derive(Debug, Default)]
pub struct PidResolver {
    own_ns: Option<u64>,
    scanned: Option<HashMap<u32, Vec<u32>>>,
}

/// The inode of the initial (the host's) pid namespace, fixed by the kernel
/// (`PROC_PID_INIT_INO`): a reader in it sees every process of every namespace.
pub const INITIAL_PID_NS: u64 = 0xEFFF_FFFC;

impl PidResolver {
    /// Whether every process of every pid namespace is visible to this reader (it runs in the
    /// host's pid namespace), so that a process it cannot find is dead.
    pub fn sees_every_namespace(&self) -> bool {
        self.own_ns == Some(INITIAL_PID_NS)
    }

    /// A resolver for this process's pid namespace (scans `/proc` only when asked about a
    /// record from another namespace).
    pub fn new() -> PidResolver {
        PidResolver {
            own_ns: pid_ns_of("self"),
            scanned: None,
        }
    }

    fn index(&mut self) -> &HashMap<u32, Vec<u32>> {
        self.scanned.get_or_insert_with(|| {
            let mut map: HashMap<u32, Vec<u32>> = HashMap::new();
            let Ok(entries) = fs::read_dir("/proc") else {
                return map;
            };
            for e in entries.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
                    continue;
                };
                let ns = parse_nspid(&status);
                if ns.len() > 1 {
                    map.entry(*ns.last().unwrap_or(&pid)).or_default().push(pid);
                }
            }
            map
        })
    }

    /// The pid, in the reader's namespace, of the process `(pid, start_time)` of pid namespace
    /// `pid_ns` (as its record names them), with `host_pid` the writer's own guess: `pid` itself
    /// when the namespace is the reader's (or unknown); else the process whose innermost pid is
    /// `pid`, whose start time matches, and (when readable) whose namespace is `pid_ns`. `None`
    /// when no such process is visible (it is dead, or in a namespace the reader cannot see).
    pub fn resolve(
        &mut self,
        pid: u32,
        start_time: u64,
        pid_ns: Option<u64>,
        host_pid: Option<u32>,
    ) -> Option<u32> {
        let Some(ns) = pid_ns else {
            return Some(pid);
        };
        if Some(ns) == self.own_ns || self.own_ns.is_none() {
            return Some(pid);
        }
        let matches = |cand: u32| {
            let status = fs::read_to_string(format!("/proc/{cand}/status")).ok();
            let inner = status.as_deref().map(parse_nspid).unwrap_or_default();
            let started = fs::read_to_string(format!("/proc/{cand}/stat"))
                .ok()
                .and_then(|s| parse_stat(&s))
                .map(|s| s.1);
            let same_ns = pid_ns_of(&cand.to_string()).is_none_or(|n| n == ns);
            inner.last() == Some(&pid) && started == Some(start_time) && same_ns
        };
        if let Some(h) = host_pid.filter(|&h| h != 0 && matches(h)) {
            return Some(h);
        }
        let cands = self.index().get(&pid).cloned().unwrap_or_default();
        cands.into_iter().find(|&c| matches(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(
        text: &str,
    ) -> (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    ) {
        let p = parse_cgroup(text);
        (p.container_id, p.pod_uid, p.runtime, p.systemd_unit)
    }

    fn s(x: &str) -> Option<String> {
        Some(x.to_string())
    }

    /// Kubernetes with containerd and the systemd cgroup driver on cgroup v2: the path from a
    /// kubelet test (`kubepods-besteffort-pod<uid with _>.slice/cri-containerd-<id>.scope`).
    #[test]
    fn containerd_systemd_v2() {
        let text = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod6553a60b_2b97_442a_b6da_a5704d81dd98.slice/cri-containerd-413715dc061efe71c16ef989f2f2ff5cf999a7dc905bb7078eda82cbb38210ec.scope\n";
        assert_eq!(
            parsed(text),
            (
                s("413715dc061efe71c16ef989f2f2ff5cf999a7dc905bb7078eda82cbb38210ec"),
                s("6553a60b-2b97-442a-b6da-a5704d81dd98"),
                s("containerd"),
                None
            )
        );
        assert_eq!(
            parse_cgroup(text).cgroup.as_deref(),
            Some(text.trim_end().strip_prefix("0::").unwrap())
        );
    }

    /// kind / minikube nest the kubelet's slices under `kubelet.slice` (a path quoted in a
    /// cilium bug report's runc error).
    #[test]
    fn containerd_nested_kubelet_slice() {
        let text = "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-poda45947e4_314c_4694_8f05_5e1425a02de4.slice/cri-containerd-abb37780fc913b3720641a4039186adb06f5d1de0229de0e8707f12e2fde5a21.scope";
        assert_eq!(
            parsed(text),
            (
                s("abb37780fc913b3720641a4039186adb06f5d1de0229de0e8707f12e2fde5a21"),
                s("a45947e4-314c-4694-8f05-5e1425a02de4"),
                s("containerd"),
                None
            )
        );
    }

    /// CRI-O with the systemd driver, cgroup v1: an OpenShift 4.6 node's lines (CRI-O
    /// 1.19), as quoted in a container tool's cgroup tests.
    #[test]
    fn crio_systemd_v1() {
        let id = "d6d725b909f37c3e232aadfbafa950a58bfe7baa579ba8c47a12be88bb921607";
        let path = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod8ca306fa_3c03_47fa_97dd_19979c345572.slice/crio-{id}.scope"
        );
        let text = format!("12:devices:{path}\n11:pids:{path}\n1:name=systemd:{path}\n");
        assert_eq!(
            parsed(&text),
            (
                s(id),
                s("8ca306fa-3c03-47fa-97dd-19979c345572"),
                s("cri-o"),
                None
            )
        );
        assert_eq!(parse_cgroup(&text).cgroup, Some(path));
        // CRI-O's conmon monitor has a scope of its own: no container.
        let conmon = format!("0::/kubepods.slice/crio-conmon-{id}.scope");
        assert_eq!(parsed(&conmon).0, None);
    }

    /// CRI-O with the cgroupfs driver: the kubelet's `kubepods/<qos>/pod<uid>/crio-<id>` (no
    /// `.scope`), with the conmon monitor beside it.
    #[test]
    fn crio_cgroupfs() {
        let id = "d6d725b909f37c3e232aadfbafa950a58bfe7baa579ba8c47a12be88bb921607";
        let text =
            format!("0::/kubepods/burstable/pod8ca306fa-3c03-47fa-97dd-19979c345572/crio-{id}\n");
        assert_eq!(
            parsed(&text),
            (
                s(id),
                s("8ca306fa-3c03-47fa-97dd-19979c345572"),
                s("cri-o"),
                None
            )
        );
        let conmon = format!(
            "0::/kubepods/burstable/pod8ca306fa-3c03-47fa-97dd-19979c345572/crio-conmon-{id}\n"
        );
        assert_eq!(parsed(&conmon).0, None);
    }

    /// Docker with the systemd driver, cgroup v1 (CentOS 7), as in neuvector's cgroup tests.
    #[test]
    fn docker_systemd_v1() {
        let text = "10:devices:/system.slice/docker-9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d.scope\n\
                    8:memory:/system.slice/docker-9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d.scope\n\
                    1:name=systemd:/system.slice/docker-9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d.scope\n";
        assert_eq!(
            parsed(text),
            (
                s("9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d"),
                None,
                s("docker"),
                None
            )
        );
    }

    /// Kubernetes with dockershim and the systemd driver, and rootless Podman on cgroup v2 (its
    /// `libpod-<id>.scope`, with the `container` subgroup newer Podman adds; `libpod-conmon-`
    /// is its monitor, not the container): paths from OpenTelemetry's container-id tests.
    #[test]
    fn docker_under_kubernetes_and_podman() {
        let text = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod69349abe_d645_11ea_9c4c_08002709c05c.slice/docker-80d85a3a585f1575028ebe468d83093c301eda20d37d1671ff2a0be50fc0e460.scope\n";
        assert_eq!(
            parsed(text),
            (
                s("80d85a3a585f1575028ebe468d83093c301eda20d37d1671ff2a0be50fc0e460"),
                s("69349abe-d645-11ea-9c4c-08002709c05c"),
                s("docker"),
                None
            )
        );
        let id = "ee059a097566fdc5ac9141bfcdfbed0c972163da891de076e0849d7b53597aac";
        let text = format!(
            "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{id}.scope/container\n"
        );
        assert_eq!(parsed(&text), (s(id), None, s("podman"), None));
        let conmon = format!(
            "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-conmon-{id}.scope\n"
        );
        assert_eq!(
            parsed(&conmon),
            (None, None, None, s(&format!("libpod-conmon-{id}.scope")))
        );
    }

    /// Docker's cgroupfs driver (`/docker/<id>` in every v1 hierarchy; Debian, Ubuntu 18.04).
    #[test]
    fn docker_cgroupfs_v1() {
        let text = "12:cpuset:/docker/4f797c539e6c745de61a93ca3ff892358ecbcaccd8414d5db545c38428142970\n\
                    4:memory:/docker/4f797c539e6c745de61a93ca3ff892358ecbcaccd8414d5db545c38428142970\n\
                    1:name=systemd:/docker/4f797c539e6c745de61a93ca3ff892358ecbcaccd8414d5db545c38428142970\n\
                    0::/system.slice/containerd.service\n";
        assert_eq!(
            parsed(text),
            (
                s("4f797c539e6c745de61a93ca3ff892358ecbcaccd8414d5db545c38428142970"),
                None,
                s("docker"),
                None
            )
        );
    }

    /// The kubelet's cgroupfs driver, cgroup v1 (`/kubepods/<qos>/pod<uid>/<id>`): from a
    /// GKE node's `/proc/PID/cgroup` (best-effort), and a burstable pod's memory line.
    #[test]
    fn kubepods_cgroupfs_v1() {
        let text = "11:devices:/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d/34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376\n\
                    9:memory:/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d/34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376\n";
        assert_eq!(
            parsed(text),
            (
                s("34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376"),
                s("74c13223-5a00-11e9-b385-42010a80018d"),
                None,
                None
            )
        );
        let text = "6:memory:/kubepods/burstable/podfbc202d3-da21-11e8-ab5e-42010a80014b/0a1b22ec1361a97c3511db37a4bae932d41b22264e5b97611748f8b662312574\n";
        assert_eq!(
            parsed(text).1.as_deref(),
            Some("fbc202d3-da21-11e8-ab5e-42010a80014b")
        );
    }

    /// Processes in no container: a login session, a service, and a private cgroup namespace
    /// (a container on cgroup v2 sees only `0::/`).
    #[test]
    fn systemd_units_and_the_root() {
        assert_eq!(
            parsed("0::/user.slice/user-1000.slice/session-3.scope\n"),
            (None, None, None, s("session-3.scope"))
        );
        assert_eq!(
            parsed("0::/system.slice/slurmd.service\n").3,
            s("slurmd.service")
        );
        let root = parse_cgroup("0::/\n");
        assert_eq!(root.cgroup.as_deref(), Some("/"));
        assert_eq!(root.container_id, None);
        // This machine's v1 layout: only the memory hierarchy below the root.
        let text =
            "9:name=systemd:/\n4:memory:/process_api/072677e97b14eb47921911d2314babab\n0::/\n";
        let p = parse_cgroup(text);
        assert_eq!(
            p.cgroup.as_deref(),
            Some("/process_api/072677e97b14eb47921911d2314babab")
        );
        assert_eq!(p.container_id, None);
        // Garbage gives nothing, and never panics.
        for junk in ["", "\n\n", "x", "1:2", "0::", ":::::", "0::/pod/../\u{7f}"] {
            let _ = parse_cgroup(junk);
        }
        assert!(parse_cgroup(&format!("0::/{}", "é".repeat(2000)))
            .cgroup
            .is_some_and(|c| c.len() <= MAX_CGROUP_BYTES));
    }

    #[test]
    fn nspid_lines() {
        // A process two namespaces deep, seen from the host's /proc.
        let status =
            "Name:\tpython\nTgid:\t4242\nNgid:\t0\nPid:\t4242\nPPid:\t4200\nNSpid:\t4242\t17\t1\n";
        assert_eq!(parse_nspid(status), vec![4242, 17, 1]);
        let p = Placement {
            ns_pids: parse_nspid(status),
            ..Placement::default()
        };
        assert_eq!(p.host_pid(), Some(4242));
        assert_eq!(parse_nspid("NSpid:\t99\n"), vec![99]);
        assert_eq!(parse_nspid("Pid:\t1\n"), Vec::<u32>::new());
        // This process: its own pid last.
        let me = Placement::current();
        assert_eq!(me.ns_pids.last(), Some(&std::process::id()));
        assert!(me.pid_ns.is_some());
        assert_eq!(
            PidResolver::new().resolve(7, 1, me.pid_ns, None),
            Some(7),
            "a record of the reader's own namespace keeps its pid"
        );
    }
}
