//! The unit tests of the module beside this folder.
use super::*;
use crate::gpu::FakeView;

fn tag(name: &str, bytes: u64) -> AttributionRecord {
    AttributionRecord {
        name: name.into(),
        bytes,
        blocks: 1,
    }
}

#[test]
fn top_tags_and_the_rest_as_other() {
    let tags = [tag("a", 50), tag("b", 30), tag("c", 10), tag("d", 5)];
    // Live covers more than the published tags (tags beyond the record's top 32): "other"
    // holds everything not named, so the tags of a device sum to its live bytes.
    let f = fold_tags(&tags, 100, 2);
    assert_eq!(
        f,
        vec![("a".into(), 50), ("b".into(), 30), ("other".into(), 20)]
    );
    assert_eq!(f.iter().map(|t| t.1).sum::<u64>(), 100);
    // All fit: no "other" when nothing is left over.
    assert_eq!(fold_tags(&tags, 95, 10).len(), 4);
    // N = 0: everything is "other".
    assert_eq!(fold_tags(&tags, 95, 0), vec![("other".into(), 95)]);
    // No published tags: nothing is attributed.
    assert!(fold_tags(&[], 95, 10).is_empty());
}

#[test]
fn tags_merge_after_cutting_and_other_is_never_named_twice() {
    let long = "x".repeat(MAX_TAG_CHARS + 5);
    let long2 = format!("{}y", "x".repeat(MAX_TAG_CHARS + 1));
    let tags = [tag(&long, 10), tag(&long2, 5), tag("other", 7), tag("b", 1)];
    let f = fold_tags(&tags, 23, 10);
    assert_eq!(
        f,
        vec![
            ("x".repeat(MAX_TAG_CHARS), 15),
            ("b".into(), 1),
            ("other".into(), 7)
        ]
    );
    // Ties are broken by name, so the order does not depend on the hash map.
    let f = fold_tags(&[tag("z", 1), tag("y", 1)], 2, 1);
    assert_eq!(f[0].0, "y");
    // A record whose tags add up to more than its live bytes: no negative "other".
    assert_eq!(fold_tags(&[tag("a", 9)], 5, 1), vec![("a".into(), 9)]);
}

#[test]
fn only_processes_that_may_hold_memory_export_bytes() {
    assert!(may_hold_memory(PsState::Running));
    assert!(may_hold_memory(PsState::Zombie));
    assert!(may_hold_memory(PsState::DeadButMemoryHeld));
    assert!(!may_hold_memory(PsState::DeadRecordOnly));
    assert!(!may_hold_memory(PsState::PidReused));
    assert!(!may_hold_memory(PsState::NoRecord));
}

#[test]
fn state_names() {
    assert_eq!(
        state_name(PsState::Running, Some(State::Running)),
        "running"
    );
    assert_eq!(
        state_name(PsState::DeadRecordOnly, Some(State::Exited)),
        "exited"
    );
    assert_eq!(
        state_name(PsState::DeadRecordOnly, Some(State::Running)),
        "dead-record-only"
    );
    assert_eq!(
        state_name(PsState::DeadButMemoryHeld, Some(State::Running)),
        "dead-but-memory-held"
    );
    assert_eq!(state_name(PsState::Zombie, None), "zombie");
    assert_eq!(state_name(PsState::NoRecord, None), "no-record");
    assert_eq!(
        state_name(PsState::PidReused, Some(State::Exited)),
        "pid-reused"
    );
}

#[test]
fn a_warning_is_printed_once_until_it_changes() {
    let w = Warnings::default();
    let d = Path::new("/x");
    assert!(w.note(d, Some("a".into())));
    assert!(!w.note(d, Some("a".into())));
    assert!(w.note(d, Some("b".into())));
    assert!(!w.note(d, None));
    assert!(w.note(d, Some("b".into())), "cleared, then back");
}

#[test]
fn bounded_cuts_characters_not_bytes() {
    assert_eq!(bounded("héllo", 2), "hé");
    assert_eq!(bounded("ab", 10), "ab");
}

/// A registry with records of this test process (alive), and of dead pids, one exited and
/// one killed while NVML still lists its memory.
#[test]
fn the_command_label_is_the_program_and_its_script() {
    assert_eq!(
        program("/usr/bin/python3 /srv/train.py --hf-token=secret"),
        "python3 train.py"
    );
    assert_eq!(program("python -m torch.distributed.run x.py"), "python");
    assert_eq!(program("./serve --api-key abc"), "serve");
    assert_eq!(program("bash run.sh a b"), "bash run.sh");
    assert_eq!(program(""), "");
}

mod scrape {
    use super::*;
    use cistern::registry::{self, Identity, Placement, ProcessSnapshot, Registry};

    const MIB: u64 = 1 << 20;

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("cistern-export-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        d
    }

    fn dead_pid(n: usize) -> u32 {
        (1..4_000_000u32)
            .rev()
            .filter(|p| !Path::new(&format!("/proc/{p}")).exists())
            .nth(n)
            .unwrap()
    }

    fn publish(dir: &Path, pid: u32, start: u64, cmd: &str, tags: &[(&str, u64)], state: State) {
        publish_placed(dir, pid, start, cmd, tags, state, Placement::default());
    }

    fn publish_placed(
        dir: &Path,
        pid: u32,
        start: u64,
        cmd: &str,
        tags: &[(&str, u64)],
        state: State,
        placement: Placement,
    ) {
        let id = Identity {
            pid,
            start_time: start,
            boot_id: registry::boot_id().unwrap(),
            uid: registry::euid(),
            cmdline: vec![cmd.into()],
            cmdline_truncated: false,
            placement,
        };
        let live: u64 = tags.iter().map(|t| t.1).sum();
        let dev = DeviceRecord {
            allocations: 0,
            ooms: 0,
            index: 0,
            uuid: Some("GPU-fake-0".into()),
            name: "Fake".into(),
            total_memory: 80 << 30,
            limit: 80 << 30,
            reserved: live + 4 * MIB,
            live,
            cached: 4 * MIB,
            pending: 0,
            peak_reserved: live + 8 * MIB,
            peak_live: live,
            top_tags: tags.iter().map(|(n, b)| tag(n, *b)).collect(),
            top_sites: Vec::new(),
            // A dead sender and the later process given its pid: one series, their sum.
            imported: vec![
                registry::ImportRecord {
                    from_pid: 4242,
                    from_start_time: 10,
                    bytes: MIB,
                },
                registry::ImportRecord {
                    from_pid: 4242,
                    from_start_time: 20,
                    bytes: 2 * MIB,
                },
            ],
            imported_other: 3 * MIB,
        };
        let r = Registry::with_identity(dir, id).unwrap();
        r.publish(
            &ProcessSnapshot {
                devices: vec![dev],
                driver: Some("cuda".into()),
                last_oom: None,
                marks: Vec::new(),
            },
            state,
            Vec::new(),
        )
        .unwrap();
    }

    #[test]
    fn processes_gpus_and_health() {
        let d = dir("scrape");
        let me = std::process::id();
        let my_start = registry::process_start_time(me).unwrap();
        let (killed, exited) = (dead_pid(0), dead_pid(1));
        publish(
            &d,
            me,
            my_start,
            "train \"q\"",
            &[("weights", 40 * MIB), ("acts", 8 * MIB)],
            State::Running,
        );
        publish(&d, killed, 5, "killed", &[("kv", 16 * MIB)], State::Running);
        publish(&d, exited, 6, "loader", &[("io", MIB)], State::Exited);
        std::fs::write(d.join("9-9.json"), b"not json").unwrap();
        let view: FakeView = serde_json::from_value(serde_json::json!({"gpus": [{
        "index": 0, "uuid": "GPU-fake-0", "name": "Fake GPU", "total": 80u64 << 30,
        "used": 0, "free": (80u64 << 30) - (200 * MIB), "reserved": 0,
        "processes": [
            {"pid": me, "used_bytes": 100 * MIB, "kind": "compute"},
            {"pid": killed, "used_bytes": 30 * MIB, "kind": "compute"}
        ]}]}))
        .unwrap();
        let opts = Options {
            top_tags: 1,
            full_command: true,
            hostname: "node-a".into(),
            kube_logs: None,
        };
        let missing = d.join("missing-subdir-is-empty");
        let x = collect(
            &view,
            &dirs(&[d.clone(), missing]),
            &opts,
            &Warnings::default(),
        );
        let mine = me.to_string();
        let p = [("pid", mine.as_str())];
        assert_eq!(
            x.get(
                "cistern_process_state",
                &[("pid", &mine), ("state", "running")]
            ),
            Some(Value::Int(1))
        );
        assert_eq!(
            x.samples("cistern_process_state")
                .iter()
                .filter(|(l, _)| l.iter().any(|(k, v)| *k == "pid" && *v == mine))
                .count(),
            1
        );
        assert_eq!(
            x.get("cistern_process_live_bytes", &p),
            Some(Value::Int((48 * MIB) as i64))
        );
        assert_eq!(
            x.get("cistern_process_overhead_bytes", &p),
            Some(Value::Int((100 * MIB - 52 * MIB) as i64))
        );
        assert_eq!(
            x.get("cistern_process_peak_reserved_bytes", &p),
            Some(Value::Int((56 * MIB) as i64))
        );
        assert_eq!(
            x.get(
                "cistern_process_tag_live_bytes",
                &[
                    ("pid", &mine),
                    ("tag", "weights"),
                    ("UUID", "GPU-fake-0"),
                    ("gpu", "0")
                ]
            ),
            Some(Value::Int((40 * MIB) as i64))
        );
        assert_eq!(
            x.get(
                "cistern_process_tag_live_bytes",
                &[("pid", &mine), ("tag", "other")]
            ),
            Some(Value::Int((8 * MIB) as i64))
        );
        assert_eq!(
            x.get(
                "cistern_process_imported_bytes",
                &[("pid", &mine), ("from_pid", "4242"), ("gpu", "0")]
            ),
            Some(Value::Int((3 * MIB) as i64))
        );
        // Senders beyond those a record names, in one series.
        assert_eq!(
            x.get(
                "cistern_process_imported_bytes",
                &[("pid", &mine), ("from_pid", "other"), ("gpu", "0")]
            ),
            Some(Value::Int((3 * MIB) as i64))
        );
        assert_eq!(
            x.get(
                "cistern_process_tag_live_bytes",
                &[("pid", &mine), ("tag", "acts")]
            ),
            None,
            "beyond --top-tags 1"
        );
        let k = killed.to_string();
        assert_eq!(
            x.get(
                "cistern_process_state",
                &[("pid", &k), ("state", "dead-but-memory-held")]
            ),
            Some(Value::Int(1))
        );
        assert_eq!(
            x.get("cistern_process_gpu_used_bytes", &[("pid", &k)]),
            Some(Value::Int((30 * MIB) as i64))
        );
        let e = exited.to_string();
        assert_eq!(
            x.get("cistern_process_state", &[("pid", &e), ("state", "exited")]),
            Some(Value::Int(1))
        );
        let g = [
            ("UUID", "GPU-fake-0"),
            ("gpu", "0"),
            ("device", "nvidia0"),
            ("Hostname", "node-a"),
        ];
        assert_eq!(
            x.get(
                "cistern_gpu_info",
                &[("UUID", "GPU-fake-0"), ("model_name", "Fake GPU")]
            ),
            Some(Value::Int(1))
        );
        assert_eq!(
            x.get("cistern_gpu_memory_used_bytes", &g),
            Some(Value::Int((200 * MIB) as i64))
        );
        assert_eq!(
            x.get("cistern_gpu_memory_unattributed_bytes", &g),
            Some(Value::Int((70 * MIB) as i64))
        );
        assert_eq!(
            x.get("cistern_gpu_memory_dead_held_bytes", &g),
            Some(Value::Int((30 * MIB) as i64))
        );
        assert_eq!(x.get("cistern_exporter_records", &[]), Some(Value::Int(3)));
        assert_eq!(
            x.get("cistern_exporter_records_refused", &[]),
            Some(Value::Int(1))
        );
        assert_eq!(x.get("cistern_exporter_nvml_up", &[]), Some(Value::Int(1)));
        assert_eq!(x.samples("cistern_exporter_registry_dir_up").len(), 2);
        // Every label of every sample is one its family declares (what --list-metrics
        // says, and what scripts/check-deploy.sh checks the dashboard against).
        for f in x.families() {
            let declared: Vec<&str> = f
                .desc
                .labels
                .split(',')
                .map(|l| l.trim().trim_end_matches('?'))
                .collect();
            for (labels, _) in &f.samples {
                for (k, _) in labels {
                    assert!(
                        declared.contains(k),
                        "{}: label {k} not declared",
                        f.desc.name
                    );
                }
            }
        }
        assert!(
            x.families().len() >= 25,
            "most families are filled in this scrape"
        );
        let text = crate::export::metrics::encode(&x, crate::export::metrics::Format::Prometheus);
        assert!(text.contains(r#"command="train \"q\"""#), "{text}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn doubtful_and_unreadable_directories() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir("doubt");
        assert_eq!(ps::doubt(&d), None, "private and this user's");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(ps::doubt(&d).unwrap().contains("mode 0755"));
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        // Named for another uid than its owner's.
        let other = d.join(format!("cistern-{}", registry::euid() + 1));
        std::fs::create_dir(&other).unwrap();
        std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(
            ps::doubt(&other).unwrap().contains("not by uid"),
            "{:?}",
            ps::doubt(&other)
        );
        // A registry that is a symlink is refused: reported down, the scrape goes on.
        let link = d.join("link");
        std::os::unix::fs::symlink(&other, &link).unwrap();
        let view: FakeView = serde_json::from_value(serde_json::json!({"gpus": []})).unwrap();
        let opts = Options {
            top_tags: 10,
            full_command: true,
            hostname: String::new(),
            kube_logs: None,
        };
        let x = collect(
            &view,
            &dirs(&[link.clone(), d.clone()]),
            &opts,
            &Warnings::default(),
        );
        let up = |p: &Path| {
            x.get(
                "cistern_exporter_registry_dir_up",
                &[("dir", &p.display().to_string())],
            )
        };
        assert_eq!(up(&link), Some(Value::Int(0)));
        assert_eq!(up(&d), Some(Value::Int(1)));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Directories as `--registry-dir` names one (no uid from a node-wide scan).
    fn dirs(paths: &[PathBuf]) -> Dirs {
        Dirs {
            dirs: paths
                .iter()
                .map(|p| crate::registry_dirs::RegistryDir {
                    path: p.clone(),
                    uid: None,
                })
                .collect(),
            ..Dirs::default()
        }
    }

    #[test]
    fn pods_are_labelled_with_their_ids_and_the_kubelet_s_names() {
        let reg = dir("kube-registry");
        let logs = dir("kube-containers");
        let id = "ab".repeat(32);
        let uid = "1c6b3f2a-5d4e-4f00-8000-123456789abc";
        std::fs::write(logs.join(format!("trainer-0_ml_pytorch-{id}.log")), "").unwrap();
        let claims = Placement {
            container_id: Some(id.clone()),
            pod_uid: Some(uid.into()),
            ..Placement::default()
        };
        // A killed process: its record's ids are all there is.
        let killed = dead_pid(7);
        publish_placed(
            &reg,
            killed,
            7,
            "python",
            &[("w", MIB)],
            State::Running,
            claims.clone(),
        );
        // A live one whose record claims the same pod: the kernel's word is taken.
        let me = std::process::id();
        let start = registry::process_start_time(me).unwrap();
        publish_placed(
            &reg,
            me,
            start,
            "python",
            &[("w", MIB)],
            State::Running,
            claims,
        );
        let view: FakeView = serde_json::from_value(serde_json::json!({"gpus": []})).unwrap();
        let mut opts = Options {
            top_tags: 10,
            full_command: true,
            hostname: String::new(),
            kube_logs: Some(logs.clone()),
        };
        let scrape = |opts: &Options| {
            collect(
                &view,
                &dirs(std::slice::from_ref(&reg)),
                opts,
                &Warnings::default(),
            )
        };
        let labels_of = |x: &Exposition, pid: u32| -> Vec<(&'static str, String)> {
            x.samples("cistern_process_state")
                .into_iter()
                .find(|(l, _)| l.iter().any(|(k, v)| *k == "pid" && *v == pid.to_string()))
                .unwrap_or_else(|| panic!("no state of pid {pid}"))
                .0
                .clone()
        };
        let has = |l: &[(&'static str, String)], k: &str, v: &str| {
            l.iter().any(|(a, b)| *a == k && b == v)
        };
        let x = scrape(&opts);
        let dead = labels_of(&x, killed);
        for (k, v) in [
            ("pod", "trainer-0"),
            ("namespace", "ml"),
            ("container", "pytorch"),
            ("container_id", id.as_str()),
            ("pod_uid", uid),
        ] {
            assert!(has(&dead, k, v), "{k}={v} missing: {dead:?}");
        }
        let live = labels_of(&x, me);
        let kernel = std::fs::read_to_string("/proc/self/cgroup")
            .map(|t| registry::parse_cgroup(&t))
            .unwrap_or_default();
        assert_eq!(
            live.iter()
                .find(|(k, _)| *k == "container_id")
                .map(|(_, v)| v.clone()),
            kernel.container_id,
            "a live process is labelled with what the kernel says, not its record: {live:?}"
        );
        // Without the kubelet's folder, the ids alone.
        opts.kube_logs = None;
        let x = scrape(&opts);
        let dead = labels_of(&x, killed);
        assert!(has(&dead, "container_id", &id) && has(&dead, "pod_uid", uid));
        assert!(!dead.iter().any(|(k, _)| *k == "pod" || *k == "namespace"));
        let _ = std::fs::remove_dir_all(&reg);
        let _ = std::fs::remove_dir_all(&logs);
    }

    #[test]
    fn nvml_down_still_exports_the_registry() {
        let d = dir("nonvml");
        let me = std::process::id();
        let start = registry::process_start_time(me).unwrap();
        publish(&d, me, start, "x", &[("t", MIB)], State::Running);
        let view: FakeView =
            serde_json::from_value(serde_json::json!({"error": "NVML not available: test"}))
                .unwrap();
        let x = collect(
            &view,
            &dirs(std::slice::from_ref(&d)),
            &Options {
                top_tags: 10,
                full_command: true,
                hostname: String::new(),
                kube_logs: None,
            },
            &Warnings::default(),
        );
        assert_eq!(x.get("cistern_exporter_nvml_up", &[]), Some(Value::Int(0)));
        assert_eq!(x.get("cistern_exporter_records", &[]), Some(Value::Int(1)));
        assert_eq!(x.samples("cistern_process_live_bytes").len(), 1);
        assert!(x.samples("cistern_gpu_memory_used_bytes").is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }
}
