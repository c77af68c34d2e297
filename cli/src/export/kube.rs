//! Kubernetes names for processes in pods. A record carries what its process could see of
//! itself (the container id and pod UID parsed from its cgroup); the names an operator queries
//! by (pod, namespace, container) are known on the node only to the kubelet. The kubelet keeps
//! one log link per container in `/var/log/containers`, named
//! `<pod>_<namespace>_<container>-<container id>.log` (the layout `kubectl logs`, Fluent Bit and
//! the Datadog and Elastic agents read), so one directory listing per scrape maps every container
//! id on the node to its names, without the API server or credentials. The DaemonSet mounts
//! that folder read-only; elsewhere it is absent and only the ids are labelled.
//!
//! Names are read from file names, which anyone able to create files there could forge; the
//! folder is root's on a node, and names are only labels. Pod names (DNS subdomains),
//! namespaces and container names (DNS labels) never hold `_`, which is what makes the split
//! unambiguous; a name that breaks those rules is skipped, not guessed.

use std::collections::HashMap;
use std::path::Path;

/// Where the kubelet keeps its container log links.
pub const DEFAULT_DIR: &str = "/var/log/containers";
/// At most this many entries are read from the folder (a node runs a few hundred containers).
pub const MAX_ENTRIES: usize = 100_000;

/// A container's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    pub pod: String,
    pub namespace: String,
    pub container: String,
}

/// Container ids (64 hex digits) to names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeNames(HashMap<String, Names>);

fn dns_name(s: &str, dots: bool) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || (dots && b == b'.')
        })
}

/// Parses one file name of the folder: `(container id, names)`.
pub fn parse_log_name(name: &str) -> Option<(String, Names)> {
    let stem = name.strip_suffix(".log")?;
    let (rest, id) = stem.rsplit_once('-')?;
    if id.len() != 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut parts = rest.splitn(3, '_');
    let (pod, namespace, container) = (parts.next()?, parts.next()?, parts.next()?);
    if !dns_name(pod, true) || !dns_name(namespace, false) || !dns_name(container, false) {
        return None;
    }
    Some((
        id.to_ascii_lowercase(),
        Names {
            pod: pod.to_string(),
            namespace: namespace.to_string(),
            container: container.to_string(),
        },
    ))
}

impl KubeNames {
    /// The names in `dir`; nothing when it is missing or unreadable (not a node of a cluster,
    /// or not mounted).
    pub fn read(dir: &Path) -> KubeNames {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return KubeNames::default();
        };
        KubeNames(
            entries
                .take(MAX_ENTRIES)
                .filter_map(|e| e.ok())
                .filter_map(|e| parse_log_name(e.file_name().to_str()?))
                .collect(),
        )
    }

    /// The names of a container, by its id as a record gives it.
    pub fn get(&self, container_id: &str) -> Option<&Names> {
        self.0.get(&container_id.to_ascii_lowercase())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3a4bd5a1c7f4b3f6e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9";

    #[test]
    fn log_names() {
        // As the kubelet names them (pkg/kubelet/kuberuntime: BuildContainerLogsDirectory and
        // the /var/log/containers symlink `<pod>_<namespace>_<container>-<id>.log`).
        let (id, n) =
            parse_log_name(&format!("trainer-7d9f8c6b5-x2x4q_ml-team_pytorch-{ID}.log")).unwrap();
        assert_eq!(id, ID);
        assert_eq!(
            n,
            Names {
                pod: "trainer-7d9f8c6b5-x2x4q".into(),
                namespace: "ml-team".into(),
                container: "pytorch".into(),
            }
        );
        // Dots are allowed in pod names, dashes in every part.
        let (_, n) = parse_log_name(&format!("web.v2-0_kube-system_side-car-{ID}.log")).unwrap();
        assert_eq!(n.pod, "web.v2-0");
        assert_eq!(n.container, "side-car");
        for bad in [
            format!("pod_ns_c-{ID}"),              // no .log
            format!("pod_ns_c-{}.log", &ID[..63]), // short id
            format!("pod_ns-{ID}.log"),            // two parts
            format!("Pod_ns_c-{ID}.log"),          // upper case
            format!("pod_n.s_c-{ID}.log"),         // dot in a namespace
            format!("pod_ns_c_d-{ID}.log"),        // `_` in a container name
            "pod_ns_c-zz.log".to_string(),
        ] {
            assert_eq!(parse_log_name(&bad), None, "{bad}");
        }
    }

    #[test]
    fn reads_a_folder_and_ignores_what_is_not_a_link_name() {
        let d = std::env::temp_dir().join(format!("cistern-kube-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(format!("p_ns_c-{ID}.log")), "").unwrap();
        std::fs::write(d.join("README"), "").unwrap();
        let k = KubeNames::read(&d);
        assert_eq!(k.get(&ID.to_ascii_uppercase()).unwrap().namespace, "ns");
        assert_eq!(k.0.len(), 1);
        assert_eq!(KubeNames::read(&d.join("missing")), KubeNames::default());
        let _ = std::fs::remove_dir_all(&d);
    }
}
