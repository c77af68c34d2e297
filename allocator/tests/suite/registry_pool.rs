//! The pool as the registry's record source: `Pool::start_registry` publishes the devices' live
//! bytes by tag and by call site, the last OOM report, and at the end the blocks never freed,
//! grouped by tag and site.

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cistern::registry::{read_all, read_record, OomRecord, Record, State, NO_TAG};
use cistern::{with_tag, Config, Pool, SimConfig, SimDriver, StreamId};

const MIB: u64 = 1 << 20;

/// A fresh directory under the temp dir (removed on drop); the registry goes in `reg` inside,
/// which the registry creates with mode 0700.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir().join(format!(
            "cistern-registry-pool-{}-{name}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir(&base).unwrap();
        TempDir(base)
    }
    fn reg(&self) -> PathBuf {
        self.0.join("reg")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn pool(conf: &str) -> Arc<Pool<SimDriver>> {
    let config = Config::parse(conf).unwrap();
    let sim = SimDriver::new(SimConfig::default().capacity(1 << 30));
    Arc::new(Pool::new(sim, config).unwrap())
}

fn only_record(dir: &std::path::Path) -> Record {
    let all = read_all(dir).unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    all.into_iter().next().unwrap().1.unwrap()
}

#[test]
fn publishes_tags_last_oom_and_leaks() {
    let t = TempDir::new("tags");
    let p = pool(&format!("registry_dir:{}", t.reg().display()));
    let s = StreamId(0);
    let weights: Vec<u64> = with_tag("regpool-weights", || {
        (0..2)
            .map(|_| p.alloc_raw(0, 3 * MIB, s).unwrap())
            .collect()
    });
    let acts: Vec<u64> = with_tag("regpool-acts", || {
        (0..3).map(|_| p.alloc_raw(0, 4096, s).unwrap()).collect()
    });
    let untagged = p.alloc_raw(0, 1000, s).unwrap();

    let h = p.start_registry().unwrap().expect("registry is on");
    h.refresh();
    let r = only_record(&t.reg());
    assert_eq!(r.pid, std::process::id());
    assert_eq!(r.state, State::Running);
    // Written on the simulated GPU, and saying so; placed where this process runs.
    assert_eq!(r.driver.as_deref(), Some("sim"));
    assert!(r.simulated());
    assert_eq!(r.ns_pids.last(), Some(&std::process::id()));
    // What the kernel shows of this process is recorded (where it shows it).
    let shown = |p: &str| std::fs::metadata(p).is_ok();
    assert_eq!(r.pid_ns.is_some(), shown("/proc/self/ns/pid"));
    assert_eq!(r.cgroup.is_some(), shown("/proc/self/cgroup"));
    let d = &r.devices[0];
    let tag = |name: &str| {
        d.top_tags
            .iter()
            .find(|a| a.name == name)
            .map(|a| (a.bytes, a.blocks))
    };
    assert_eq!(
        tag("regpool-weights"),
        Some((6 * MIB, 2)),
        "{:?}",
        d.top_tags
    );
    assert_eq!(tag("regpool-acts"), Some((3 * 4096, 3)), "{:?}", d.top_tags);
    assert_eq!(tag(NO_TAG), Some((1024, 1)), "{:?}", d.top_tags);
    assert_eq!(d.top_tags[0].name, "regpool-weights", "largest first");
    assert_eq!(
        d.top_tags.iter().map(|a| a.bytes).sum::<u64>(),
        d.live,
        "the tags cover the live bytes"
    );
    assert!(
        d.top_sites.is_empty(),
        "no stacks sampled with provenance:tags"
    );
    assert_eq!(r.last_oom, None);

    // A failed request shows up as the last OOM report.
    assert!(p.alloc_raw(0, 4 << 30, s).unwrap_err().is_oom());
    assert!(h.refresh());
    let r = read_record(&h.record_path()).unwrap();
    let oom = r.last_oom.expect("the OOM is published");
    assert_eq!(oom.requested, 4 << 30);
    assert_eq!(
        Some(oom),
        p.device(0)
            .unwrap()
            .last_oom()
            .as_ref()
            .map(OomRecord::from)
    );

    // Free all but one activation block; the final record names its tag.
    for w in weights {
        p.free_raw(w, s).unwrap();
    }
    for &a in &acts[1..] {
        p.free_raw(a, s).unwrap();
    }
    p.free_raw(untagged, s).unwrap();
    h.finish_from_source().unwrap();
    let r = only_record(&t.reg());
    assert_eq!(r.state, State::Exited);
    assert_eq!(r.leaks.len(), 1, "{:?}", r.leaks);
    let l = &r.leaks[0];
    assert_eq!(
        (l.tag.as_str(), l.device, l.bytes, l.blocks),
        ("regpool-acts", 0, 4096, 1)
    );
    assert!(
        l.oldest_age_ms.is_some(),
        "ages are known with provenance on"
    );
    assert_eq!(l.site, None);
    assert_eq!(r.devices[0].top_tags.len(), 1);
    assert!(!h.refresh(), "nothing is published after the final record");
    p.free_raw(acts[0], s).unwrap();
}

#[test]
fn publishes_sampled_sites() {
    let t = TempDir::new("sites");
    let p = pool(&format!(
        "registry_dir:{},provenance:stacks,stack_sample_rate:1",
        t.reg().display()
    ));
    let s = StreamId(0);
    let a = with_tag("regpool-sites", || p.alloc_raw(0, 2 * MIB, s).unwrap());
    let h = p.start_registry().unwrap().unwrap();
    let r = read_record(&h.record_path()).unwrap();
    let d = &r.devices[0];
    assert_eq!(d.top_sites.len(), 1, "{:?}", d.top_sites);
    assert_eq!(d.top_sites[0].bytes, 2 * MIB);
    // The label starts at this file's closure (not at cistern's or std's frames), with its
    // place.
    assert!(
        d.top_sites[0].name.starts_with("site ")
            && d.top_sites[0].name.contains("registry_pool.rs:"),
        "{}",
        d.top_sites[0].name
    );
    h.finish_from_source().unwrap();
    let r = read_record(&h.record_path()).unwrap();
    assert_eq!(r.leaks.len(), 1);
    assert_eq!(r.leaks[0].tag, "regpool-sites");
    assert_eq!(
        r.leaks[0].site.as_deref(),
        Some(d.top_sites[0].name.as_str())
    );
    p.free_raw(a, s).unwrap();
}

#[test]
fn registry_off_starts_nothing() {
    let t = TempDir::new("off");
    let p = pool(&format!("registry:off,registry_dir:{}", t.reg().display()));
    assert!(p.start_registry().unwrap().is_none());
    assert!(!t.reg().exists());
}

#[test]
fn an_unsafe_directory_is_an_error_not_a_panic() {
    let t = TempDir::new("unsafe");
    fs::create_dir(t.reg()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(t.reg(), fs::Permissions::from_mode(0o777)).unwrap();
    let p = pool(&format!("registry_dir:{}", t.reg().display()));
    let e = p.start_registry().unwrap_err();
    assert!(e.to_string().contains("registry directory"), "{e}");
    // The pool still works.
    let a = p.alloc_raw(0, 4096, StreamId(0)).unwrap();
    p.free_raw(a, StreamId(0)).unwrap();
}

/// The publisher removes expired records of exited processes when it starts (`registry_expire`),
/// on its own thread, and keeps younger ones.
#[test]
fn starting_removes_expired_records_of_exited_processes() {
    use cistern::registry::{build_record, encode_record, write_atomic, Identity, ProcessSnapshot};
    let t = TempDir::new("expire");
    let dir = t.reg();
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let write = |pid: u32, age_ms: u64| {
        let id = Identity {
            pid,
            start_time: 3,
            boot_id: cistern::registry::boot_id().unwrap(),
            uid: cistern::registry::euid(),
            cmdline: vec!["old".into()],
            cmdline_truncated: false,
            placement: Default::default(),
        };
        let mut r = build_record(&id, &ProcessSnapshot::default(), State::Exited, vec![]);
        r.updated_unix_ms -= age_ms;
        write_atomic(&dir, &r.file_name(), &encode_record(&mut r), false).unwrap();
        dir.join(r.file_name())
    };
    let old = write(0x3fff_ff10, 3 * 3600 * 1000);
    let young = write(0x3fff_ff11, 60 * 1000);
    let p = pool(&format!(
        "registry_dir:{},registry_expire:2h",
        dir.display()
    ));
    let h = p.start_registry().unwrap().expect("registry is on");
    // On the registry's thread, not in the call that started it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while old.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(!old.exists(), "the expired record stayed");
    assert!(young.exists());
    h.finish(vec![]).unwrap();
}
