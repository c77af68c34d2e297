//! The cross-process registry: permissions, symlink refusal, atomic replacement under concurrent
//! writers (threads and processes), untrusted records (garbage, oversized, mutated), a SIGKILLed
//! child's last record, a clean exit's final record through the `atexit` hook, and pid reuse.
//!
//! Child processes re-execute this test binary running the ignored test `registry_child`, with
//! `CISTERN_REGISTRY_CHILD=<mode>:<dir>` choosing what it does.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cistern::registry::*;
use proptest::prelude::*;

const CHILD_ENV: &str = "CISTERN_REGISTRY_CHILD";

/// A fresh, not yet created directory under the temp dir; removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let base = std::env::temp_dir().join(format!(
            "cistern-registry-test-{}-{name}-{n}-{nanos}",
            std::process::id()
        ));
        fs::create_dir(&base).unwrap();
        TempDir(base)
    }
    /// The registry directory inside (not created).
    fn reg(&self) -> PathBuf {
        self.0.join("reg")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Kills (SIGKILL) and reaps a child on drop, so a failing test leaves no process behind.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_child(mode: &str, dir: &Path) -> ChildGuard {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "registry::registry_child",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_ENV, format!("{mode}:{}", dir.display()))
        .spawn()
        .expect("re-executing the test binary");
    ChildGuard(Some(child))
}

fn attribution(name: &str, bytes: u64) -> AttributionRecord {
    AttributionRecord {
        name: name.into(),
        bytes,
        blocks: bytes / 4096 + 1,
    }
}

fn device(index: u32, live: u64, tags: usize) -> DeviceRecord {
    DeviceRecord {
        allocations: 0,
        ooms: 0,
        index,
        uuid: Some(format!("GPU-{index:08x}-0000-0000-0000-000000000000")),
        name: "Fake GPU".into(),
        total_memory: 80 << 30,
        limit: 80 << 30,
        reserved: live + (2 << 20),
        live,
        cached: 2 << 20,
        pending: 0,
        peak_reserved: live + (4 << 20),
        peak_live: live,
        top_tags: (0..tags)
            .map(|i| attribution(&format!("model.layer{i}.weights"), live / (i as u64 + 1)))
            .collect(),
        top_sites: vec![attribution("train.py:42 forward", live)],
        imported: vec![],
        imported_other: 0,
    }
}

fn oom() -> OomRecord {
    OomRecord {
        device: 0,
        stream: 7,
        requested: 1 << 30,
        rounded: 1 << 30,
        limit: 80 << 30,
        device_free: 1 << 20,
        device_total: 80 << 30,
        reserved: 79 << 30,
        live: 78 << 30,
        pending: 0,
        cached: 1 << 30,
        largest_free: 1 << 29,
        top_tags: vec![attribution("kv_cache", 70 << 30)],
        top_sites: vec![],
        other_processes: vec![],
        process_nvml_bytes: None,
        reason: "the device is full".into(),
    }
}

fn leak(tag: &str, bytes: u64) -> LeakEntry {
    LeakEntry {
        tag: tag.into(),
        site: Some("model.py:7 build".into()),
        device: 0,
        bytes,
        blocks: 2,
        oldest_age_ms: Some(1234),
    }
}

/// A record source the tests change at will.
#[derive(Default)]
struct FakeSource {
    snap: Mutex<ProcessSnapshot>,
    leaks: Mutex<Vec<LeakEntry>>,
    calls: AtomicU64,
}

impl FakeSource {
    fn with(snap: ProcessSnapshot) -> Arc<FakeSource> {
        Arc::new(FakeSource {
            snap: Mutex::new(snap),
            ..FakeSource::default()
        })
    }
    fn set(&self, snap: ProcessSnapshot) {
        *self.snap.lock().unwrap() = snap;
    }
}

impl RecordSource for FakeSource {
    fn snapshot(&self) -> ProcessSnapshot {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.snap.lock().unwrap().clone()
    }
    fn leaks(&self) -> Vec<LeakEntry> {
        self.leaks.lock().unwrap().clone()
    }
}

fn snapshot(live: u64) -> ProcessSnapshot {
    ProcessSnapshot {
        devices: vec![device(0, live, 3)],
        last_oom: None,
        marks: vec![],
        driver: None,
    }
}

fn fake_identity(pid: u32, start_time: u64) -> Identity {
    Identity {
        pid,
        start_time,
        boot_id: boot_id().unwrap(),
        uid: euid(),
        cmdline: vec!["fake".into(), "--arg".into()],
        cmdline_truncated: false,
        placement: Default::default(),
    }
}

fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// The records in `dir` of process `pid`, parsed.
fn records_of(dir: &Path, pid: u32) -> Vec<Record> {
    read_all(dir)
        .unwrap()
        .into_iter()
        .filter_map(|(_, r)| r.ok())
        .filter(|r| r.pid == pid)
        .collect()
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(t) = f() {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------------
// Child processes

/// Not a test: what a child process runs (see the module comment). Ignored, and a no-op without
/// the environment variable.
#[test]
#[ignore]
fn registry_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (mode, dir) = spec.split_once(':').unwrap();
    let dir = PathBuf::from(dir);
    match mode {
        // Publish, then wait to be killed.
        "publish" => {
            let src = FakeSource::with(ProcessSnapshot {
                devices: vec![device(0, 300 << 20, 4), device(1, 5 << 20, 1)],
                last_oom: Some(oom()),
                marks: vec![],
                driver: None,
            });
            let _h = Registry::start(&dir, src, Duration::from_millis(20)).unwrap();
            std::thread::sleep(Duration::from_secs(120));
            panic!("the parent should have killed this child");
        }
        // Publish, leak, and exit cleanly through the atexit hook.
        "exit" => {
            let src = FakeSource::with(snapshot(64 << 20));
            *src.leaks.lock().unwrap() = vec![leak("optimizer.state", 48 << 20), leak("", 16)];
            let h = Registry::start(&dir, src, Duration::from_millis(20)).unwrap();
            assert!(install_exit_hook(h));
        }
        // Install the exit hook, fork, and exit the forked child through `exit()`: the inherited
        // hook must leave this process's record alone.
        "fork" => {
            let src = FakeSource::with(snapshot(1 << 20));
            let h = Registry::start(&dir, src, Duration::from_millis(20)).unwrap();
            let path = h.record_path();
            assert!(install_exit_hook(h));
            // SAFETY: the forked child only calls exit(), whose hooks check the pid first.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                unsafe { libc::exit(0) };
            }
            let mut status = 0;
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
            let r = read_record(&path).unwrap();
            assert_eq!(
                r.state,
                State::Running,
                "the forked child overwrote the record"
            );
            assert_eq!(r.pid, std::process::id());
        }
        // Rewrite a shared fake record as fast as possible for a while.
        "writer" => {
            let reg = Registry::with_identity(&dir, fake_identity(1, 1)).unwrap();
            let deadline = Instant::now() + Duration::from_millis(1500);
            let mut i = 0u64;
            while Instant::now() < deadline {
                reg.publish(&varied(i + 1000), State::Running, vec![])
                    .unwrap();
                i += 1;
            }
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// Snapshots of very different sizes, so a torn write would show.
fn varied(i: u64) -> ProcessSnapshot {
    let n = (i % 7) as u32 + 1;
    ProcessSnapshot {
        devices: (0..n)
            .map(|d| device(d, i << 20, (i % 29) as usize))
            .collect(),
        last_oom: i.is_multiple_of(3).then(oom),
        marks: vec![],
        driver: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn publishes_with_private_permissions() {
    let t = TempDir::new("perms");
    let dir = t.reg();
    let src = FakeSource::with(snapshot(10 << 20));
    let h = Registry::start(&dir, src.clone(), Duration::from_millis(20)).unwrap();
    assert_eq!(mode_of(&dir), 0o700);
    let path = h.record_path();
    assert_eq!(mode_of(&path), 0o600);
    let me = std::process::id();
    let start = process_start_time(me).unwrap();
    assert_eq!(
        path.file_name().unwrap().to_str().unwrap(),
        format!("{me}-{start}.json")
    );
    let all = read_all(&dir).unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    let r = all[0].1.as_ref().unwrap();
    assert_eq!(r.version, RECORD_VERSION);
    assert_eq!((r.pid, r.start_time, r.uid), (me, start, euid()));
    assert_eq!(r.boot_id, boot_id().unwrap());
    assert_eq!(r.state, State::Running);
    assert!(!r.cmdline.is_empty());
    assert_eq!(r.devices, snapshot(10 << 20).devices);
    assert_eq!(r.liveness(), Liveness::Alive);
    // No temporary files are left behind.
    let names: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap()).collect();
    assert_eq!(names.len(), 1);
    h.finish(vec![]).unwrap();
    assert_eq!(mode_of(&path), 0o600);
}

#[test]
fn refreshes_when_changed_and_only_then() {
    let t = TempDir::new("refresh");
    let dir = t.reg();
    let src = FakeSource::with(snapshot(1 << 20));
    let h = Registry::start(&dir, src.clone(), Duration::from_millis(20)).unwrap();
    let first = read_record(&h.record_path()).unwrap();
    // Unchanged: the source is asked, the file is not rewritten.
    let calls = src.calls.load(Ordering::Relaxed);
    wait_for("a few refreshes", || {
        (src.calls.load(Ordering::Relaxed) >= calls + 3).then_some(())
    });
    assert_eq!(read_record(&h.record_path()).unwrap(), first);
    assert!(!h.refresh());
    // Changed: republished by the background thread within a few intervals.
    src.set(ProcessSnapshot {
        last_oom: Some(oom()),
        ..snapshot(7 << 20)
    });
    let r = wait_for("the new record", || {
        let r = read_record(&h.record_path()).unwrap();
        (r.devices[0].live == 7 << 20).then_some(r)
    });
    assert_eq!(r.last_oom, Some(oom()));
    assert_eq!(h.write_errors(), 0);
    h.finish(vec![]).unwrap();
}

#[test]
fn finish_writes_exited_with_leaks_once() {
    let t = TempDir::new("finish");
    let dir = t.reg();
    let src = FakeSource::with(snapshot(3 << 20));
    let h = Registry::start(&dir, src.clone(), Duration::from_millis(10)).unwrap();
    h.finish(vec![leak("small", 10), leak("big", 3 << 20)])
        .unwrap();
    assert!(h.is_finished());
    let r = read_record(&h.record_path()).unwrap();
    assert_eq!(r.state, State::Exited);
    // Largest first.
    assert_eq!(r.leaks, vec![leak("big", 3 << 20), leak("small", 10)]);
    assert!(!r.leaks_truncated);
    // The thread is stopped: nothing overwrites the final record.
    src.set(snapshot(9 << 20));
    assert!(!h.refresh());
    h.finish(vec![]).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(read_record(&h.record_path()).unwrap(), r);
}

#[test]
fn dropping_the_handle_writes_exited_from_the_source() {
    let t = TempDir::new("drop");
    let dir = t.reg();
    let src = FakeSource::with(snapshot(3 << 20));
    *src.leaks.lock().unwrap() = vec![leak("forgotten", 4096)];
    let h = Registry::start(&dir, src, Duration::from_millis(10)).unwrap();
    let path = h.record_path();
    let h2 = h.clone();
    drop(h);
    assert_eq!(read_record(&path).unwrap().state, State::Running);
    drop(h2);
    let r = read_record(&path).unwrap();
    assert_eq!(r.state, State::Exited);
    assert_eq!(r.leaks, vec![leak("forgotten", 4096)]);
}

#[test]
fn too_many_leaks_are_cut_to_fit() {
    let t = TempDir::new("manyleaks");
    let reg = Registry::with_identity(t.reg(), fake_identity(5, 5)).unwrap();
    let long = "x".repeat(4000);
    let leaks: Vec<_> = (0..5000).map(|i| leak(&long, i)).collect();
    reg.publish(&snapshot(1), State::Exited, leaks).unwrap();
    let r = read_record(&reg.record_path()).unwrap();
    assert!(r.leaks_truncated);
    assert!(!r.leaks.is_empty() && r.leaks.len() <= MAX_LEAKS);
    assert_eq!(r.leaks[0].bytes, 4999, "the largest are kept");
    assert!(fs::metadata(reg.record_path()).unwrap().len() <= MAX_RECORD_BYTES);
}

#[test]
fn refuses_a_symlinked_directory() {
    let t = TempDir::new("symdir");
    let real = t.0.join("real");
    fs::create_dir(&real).unwrap();
    fs::set_permissions(&real, fs::Permissions::from_mode(0o700)).unwrap();
    let link = t.0.join("link");
    symlink(&real, &link).unwrap();
    let e = Registry::open(&link).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, RegistryError::UnsafeDir { .. }), "{msg}");
    assert!(
        msg.contains("symlink") && msg.contains("registry_dir"),
        "{msg}"
    );
    assert!(read_all(&link).is_err());
    // Nothing was written through the link.
    assert_eq!(fs::read_dir(&real).unwrap().count(), 0);
}

#[test]
fn refuses_a_symlinked_directory_in_every_spelling() {
    let t = TempDir::new("symdir-spellings");
    let real = t.0.join("real");
    fs::create_dir(&real).unwrap();
    fs::set_permissions(&real, fs::Permissions::from_mode(0o700)).unwrap();
    symlink(&real, t.0.join("link")).unwrap();
    let base = t.0.display().to_string();
    for spelling in ["link/", "link/.", "link//", "link/./", "./link/."] {
        let link = PathBuf::from(format!("{base}/{spelling}"));
        let e = Registry::open(&link).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, RegistryError::UnsafeDir { .. }) && msg.contains("symlink"),
            "{spelling}: {msg}"
        );
        assert!(check_dir(&link).is_err(), "{spelling}");
        assert!(ensure_dir(&link).is_err(), "{spelling}");
        assert!(read_all(&link).is_err(), "{spelling}");
    }
    // Nothing was written through the link.
    assert_eq!(fs::read_dir(&real).unwrap().count(), 0);
    // The real directory is accepted in every spelling.
    for spelling in ["real", "real/", "real/."] {
        check_dir(&PathBuf::from(format!("{base}/{spelling}"))).unwrap();
    }
}

#[test]
fn refuses_an_open_or_foreign_directory() {
    let t = TempDir::new("opendir");
    let dir = t.reg();
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let msg = Registry::open(&dir).unwrap_err().to_string();
    assert!(msg.contains("0755") && msg.contains("chmod 700"), "{msg}");
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    Registry::open(&dir).unwrap();
    // A file where the directory should be.
    let file = t.0.join("file");
    fs::write(&file, b"").unwrap();
    let msg = Registry::open(&file).unwrap_err().to_string();
    assert!(msg.contains("not a directory"), "{msg}");
    // Someone else's directory (only testable when not root: root owns `/`).
    if euid() != 0 {
        let msg = check_dir(Path::new("/")).unwrap_err().to_string();
        assert!(msg.contains("owned by"), "{msg}");
    }
}

#[test]
fn a_symlinked_record_is_never_followed() {
    let t = TempDir::new("symfile");
    let reg = Registry::with_identity(t.reg(), fake_identity(77, 88)).unwrap();
    // A symlink planted where our record goes: replaced, its target untouched.
    let victim = t.0.join("victim");
    fs::write(&victim, b"precious").unwrap();
    symlink(&victim, reg.record_path()).unwrap();
    reg.publish(&snapshot(1), State::Running, vec![]).unwrap();
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
    assert!(fs::symlink_metadata(reg.record_path())
        .unwrap()
        .file_type()
        .is_file());
    // A reader does not follow a symlink to a valid record.
    let good = t.0.join("good.json");
    fs::copy(reg.record_path(), &good).unwrap();
    let link = t.reg().join("77-88.json");
    fs::remove_file(&link).unwrap();
    symlink(&good, &link).unwrap();
    assert_eq!(read_record(&link), Err(RecordError::Symlink));
    let all = read_all(&t.reg()).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].1, Err(RecordError::Symlink));
}

#[test]
fn the_reader_refuses_odd_files() {
    let t = TempDir::new("odd");
    let reg = Registry::with_identity(t.reg(), fake_identity(10, 20)).unwrap();
    reg.publish(&snapshot(1), State::Running, vec![]).unwrap();
    let d = t.reg();
    let valid = fs::read(reg.record_path()).unwrap();
    // Oversized: garbage, and a valid record padded with whitespace.
    fs::write(
        d.join("1-1.json"),
        vec![b'x'; MAX_RECORD_BYTES as usize + 1],
    )
    .unwrap();
    let mut padded = valid.clone();
    padded.resize(MAX_RECORD_BYTES as usize + 10, b' ');
    fs::write(d.join("10-20.json"), &padded).unwrap();
    // Garbage, invalid UTF-8, empty, another version, a record under the wrong name.
    fs::write(d.join("2-2.json"), b"{\"version\":1,").unwrap();
    fs::write(d.join("3-3.json"), b"\xff\xfe\x00").unwrap();
    fs::write(d.join("4-4.json"), b"").unwrap();
    let v2 =
        String::from_utf8(valid.clone())
            .unwrap()
            .replacen("\"version\":1", "\"version\":2", 1);
    fs::write(d.join("5-5.json"), v2).unwrap();
    fs::write(d.join("6-6.json"), &valid).unwrap();
    // Not regular files: a directory and a FIFO (which must not block the reader).
    fs::create_dir(d.join("7-7.json")).unwrap();
    let fifo = std::ffi::CString::new(d.join("8-8.json").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    // Ignored names: temporaries and strangers.
    fs::write(d.join(".10-20.json.1.2.3.tmp"), b"partial").unwrap();
    fs::write(d.join("notes.txt"), b"hi").unwrap();

    let all = read_all(&d).unwrap();
    let by_name = |n: &str| {
        all.iter()
            .find(|(p, _)| p.file_name().unwrap() == n)
            .unwrap_or_else(|| panic!("{n} not listed"))
            .1
            .clone()
    };
    assert_eq!(all.len(), 9, "{all:#?}");
    assert!(matches!(by_name("1-1.json"), Err(RecordError::TooLarge(_))));
    assert!(matches!(
        by_name("10-20.json"),
        Err(RecordError::TooLarge(_))
    ));
    assert!(matches!(by_name("2-2.json"), Err(RecordError::Parse(_))));
    assert!(matches!(by_name("3-3.json"), Err(RecordError::Parse(_))));
    assert!(matches!(by_name("4-4.json"), Err(RecordError::Parse(_))));
    assert_eq!(by_name("5-5.json"), Err(RecordError::UnsupportedVersion(2)));
    assert_eq!(
        by_name("6-6.json"),
        Err(RecordError::NameMismatch {
            file: (6, 6),
            record: (10, 20)
        })
    );
    assert_eq!(by_name("7-7.json"), Err(RecordError::NotRegular));
    assert_eq!(by_name("8-8.json"), Err(RecordError::NotRegular));
    for (_, r) in &all {
        if let Err(e) = r {
            assert!(!e.to_string().is_empty());
        }
    }
    // A missing directory is no records, not an error.
    assert!(read_all(&t.0.join("absent")).unwrap().is_empty());
}

#[test]
fn concurrent_writers_never_leave_a_torn_record() {
    let t = TempDir::new("torn");
    let dir = t.reg();
    let reg = Registry::with_identity(&dir, fake_identity(1, 1)).unwrap();
    reg.publish(&varied(0), State::Running, vec![]).unwrap();
    let path = reg.record_path();
    // Two other processes and three threads rewrite the same record.
    let children: Vec<_> = (0..2).map(|_| spawn_child("writer", &dir)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3u64)
        .map(|w| {
            let reg = reg.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    reg.publish(&varied(i), State::Running, vec![]).unwrap();
                    i += 3;
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_millis(1500);
    let mut reads = 0u64;
    let mut sizes = std::collections::BTreeSet::new();
    while Instant::now() < deadline {
        let r = read_record(&path).unwrap_or_else(|e| panic!("read {reads}: {e}"));
        sizes.insert(r.devices.len());
        reads += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    for mut c in children {
        let status = c.0.take().unwrap().wait().unwrap();
        assert!(status.success(), "writer child: {status}");
    }
    assert!(reads > 50, "only {reads} reads");
    assert!(sizes.len() > 1, "the record never changed size: {sizes:?}");
    // No temporaries are left over.
    let left: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

#[test]
fn a_sigkilled_process_leaves_its_last_running_record() {
    let t = TempDir::new("sigkill");
    let dir = t.reg();
    let mut child = spawn_child("publish", &dir);
    let pid = child.0.as_ref().unwrap().id();
    let before = wait_for("the child's record", || {
        let dir_exists = dir.exists();
        dir_exists
            .then(|| records_of(&dir, pid).into_iter().next())
            .flatten()
    });
    assert_eq!(before.liveness(), Liveness::Alive);
    let mut c = child.0.take().unwrap();
    c.kill().unwrap(); // SIGKILL
    let status = c.wait().unwrap();
    assert!(!status.success());
    let records = records_of(&dir, pid);
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r.state, State::Running);
    assert_eq!(r.devices.len(), 2);
    assert_eq!(r.devices[0].live, 300 << 20);
    assert_eq!(r.devices[0].top_tags.len(), 4);
    assert_eq!(r.last_oom, Some(oom()));
    assert!(r.leaks.is_empty());
    assert_eq!(is_alive(r.pid, r.start_time), Liveness::Dead);
    assert_eq!(r.liveness(), Liveness::Dead);
}

#[test]
fn a_clean_exit_writes_the_final_record_through_the_exit_hook() {
    let t = TempDir::new("exit");
    let dir = t.reg();
    let mut child = spawn_child("exit", &dir);
    let status = child.0.take().unwrap().wait().unwrap();
    assert!(status.success(), "{status}");
    let pid = child_pid_from_dir(&dir);
    let records = records_of(&dir, pid);
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r.state, State::Exited);
    assert_eq!(
        r.leaks,
        vec![leak("optimizer.state", 48 << 20), leak("", 16)]
    );
    assert_eq!(r.devices[0].live, 64 << 20);
    assert_eq!(r.liveness(), Liveness::Dead);
}

#[test]
fn a_forked_child_leaves_its_parents_record_alone() {
    let t = TempDir::new("fork");
    let dir = t.reg();
    let mut child = spawn_child("fork", &dir);
    let status = child.0.take().unwrap().wait().unwrap();
    assert!(status.success(), "{status}");
    // The parent itself then exited cleanly.
    let pid = child_pid_from_dir(&dir);
    assert_eq!(records_of(&dir, pid)[0].state, State::Exited);
}

#[test]
fn the_pool_is_a_record_source() {
    use cistern::{Config, Pool, SimConfig, SimDriver, StreamId};
    let t = TempDir::new("pool");
    let sim = Arc::new(SimDriver::new(SimConfig::default().capacity(1 << 30)));
    let pool = Arc::new(Pool::new(sim, Config::default()).unwrap());
    let a = pool.alloc_raw(0, 3 << 20, StreamId(0)).unwrap();
    let b = pool.alloc_raw(0, 1000, StreamId(0)).unwrap();
    pool.free_raw(b, StreamId(0)).unwrap();
    let h = Registry::start(t.reg(), pool.clone(), Duration::from_millis(10)).unwrap();
    let r = read_record(&h.record_path()).unwrap();
    let s = pool.stats(0).unwrap();
    let d = &r.devices[0];
    assert_eq!(d.index, 0);
    assert_eq!(d.uuid, pool.device(0).unwrap().caps().uuid);
    assert_eq!(d.live as i64, s.get("allocated_bytes.all.current"));
    assert_eq!(d.reserved as i64, s.get("reserved_bytes.all.current"));
    assert_eq!(d.peak_live as i64, s.get("allocated_bytes.all.peak"));
    assert_eq!(d.reserved, d.live + d.cached + d.pending);
    h.finish_from_source().unwrap();
    let r = read_record(&h.record_path()).unwrap();
    assert_eq!(r.state, State::Exited);
    assert_eq!(r.leaks.len(), 1);
    assert_eq!((r.leaks[0].bytes, r.leaks[0].blocks), (3 << 20, 1));
    pool.free_raw(a, StreamId(0)).unwrap();
}

fn child_pid_from_dir(dir: &Path) -> u32 {
    let all = read_all(dir).unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    all[0].1.as_ref().unwrap().pid
}

#[test]
fn a_reused_pid_is_not_the_recorded_process() {
    let t = TempDir::new("reuse");
    let me = std::process::id();
    let start = process_start_time(me).unwrap();
    assert_eq!(is_alive(me, start), Liveness::Alive);
    // A record with our pid but another start time: the recorded process is gone.
    let reg = Registry::with_identity(t.reg(), fake_identity(me, start + 1)).unwrap();
    reg.publish(&snapshot(1), State::Running, vec![]).unwrap();
    let r = read_record(&reg.record_path()).unwrap();
    assert_eq!(is_alive(me, start + 1), Liveness::PidReused);
    assert_eq!(r.liveness(), Liveness::PidReused);
    // From another boot: stale whatever the pid.
    let mut old = r.clone();
    old.boot_id = "00000000-0000-0000-0000-000000000000".into();
    assert_eq!(old.liveness(), Liveness::OtherBoot);
    // Pids beyond any pid_max, and 0.
    assert_eq!(is_alive(0x3fff_fff0, 1), Liveness::Dead);
    assert_eq!(is_alive(u32::MAX, 1), Liveness::Dead);
    assert_eq!(is_alive(0, 1), Liveness::Dead);
}

#[test]
fn opening_sweeps_temporaries_of_dead_writers() {
    let t = TempDir::new("sweep");
    let dir = t.reg();
    Registry::with_identity(&dir, fake_identity(3, 3)).unwrap();
    let dead = dir.join(format!(".3-3.json.{}.0.1.tmp", 0x3fff_fff0u32));
    let live = dir.join(format!(".3-3.json.{}.0.1.tmp", std::process::id()));
    fs::write(&dead, b"{\"vers").unwrap();
    fs::write(&live, b"{\"vers").unwrap();
    Registry::with_identity(&dir, fake_identity(3, 3)).unwrap();
    assert!(!dead.exists());
    assert!(live.exists());
}

#[test]
fn a_hundred_records_read_quickly() {
    let t = TempDir::new("hundred");
    let dir = t.reg();
    for pid in 0..100u32 {
        let reg = Registry::with_identity(&dir, fake_identity(pid + 100, 7)).unwrap();
        let snap = ProcessSnapshot {
            devices: (0..8).map(|d| device(d, 1 << 30, MAX_TOP)).collect(),
            last_oom: Some(oom()),
            marks: vec![],
            driver: None,
        };
        reg.publish(&snap, State::Running, vec![leak("x", 1); 50])
            .unwrap();
    }
    let t0 = Instant::now();
    let all = read_all(&dir).unwrap();
    let took = t0.elapsed();
    assert_eq!(all.len(), 100);
    assert!(all.iter().all(|(_, r)| r.is_ok()));
    eprintln!("read_all of 100 records: {took:?}");
    // `cistern ps` has 200 ms in all; this is the unoptimised build on a shared machine.
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[test]
fn config_selects_the_directory() {
    let c = cistern::Config::parse("registry_dir:/somewhere/else").unwrap();
    assert_eq!(dir_for(&c), Some(PathBuf::from("/somewhere/else")));
    let c = cistern::Config::parse("registry:off").unwrap();
    assert_eq!(dir_for(&c), None);
    let d = dir_for(&cistern::Config::default()).unwrap();
    assert_eq!(d, default_dir());
    assert!(d.to_str().unwrap().contains("cistern"));
}

// ---------------------------------------------------------------------------------------------
// Untrusted input

fn full_record() -> Vec<u8> {
    let mut r = build_record(
        &fake_identity(42, 4242),
        &ProcessSnapshot {
            devices: vec![device(0, 1 << 30, 5), device(1, 3, 0)],
            last_oom: Some(oom()),
            marks: vec![MarkRecord {
                id: 1,
                label: Some("epoch 3".into()),
                unix_ms: 1,
                live_bytes_since: 5,
                live_blocks_since: 1,
            }],
            driver: None,
        },
        State::Exited,
        vec![leak("a", 1), leak("b", 2)],
    );
    encode_record(&mut r)
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (
            any::<usize>(),
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..16),
                Just(b"[[[[[[[[[[".to_vec()),
                Just(b"99999999999999999999999".to_vec()),
                Just(b"null,".to_vec()),
                Just(b"\"\\ud800\"".to_vec()),
            ]
        )
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 0usize..64).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let len = bytes.len().max(1);
    match m {
        Mutation::Flip(i, b) if !bytes.is_empty() => bytes[i % len] = *b,
        Mutation::Truncate(i) => bytes.truncate(i % len),
        Mutation::Insert(i, v) => {
            let at = i % (bytes.len() + 1);
            bytes.splice(at..at, v.iter().copied());
        }
        Mutation::Remove(i, n) if !bytes.is_empty() => {
            let at = i % len;
            let end = (at + n).min(bytes.len());
            bytes.drain(at..end);
        }
        _ => {}
    }
}

/// Whatever parses writes back and parses to the same record.
fn check_round_trip(bytes: &[u8]) {
    if let Ok(r) = parse_record(bytes) {
        let mut r2 = r.clone();
        let again = encode_record(&mut r2);
        assert_eq!(parse_record(&again).unwrap(), r);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        check_round_trip(&bytes);
    }

    #[test]
    fn mutated_records_never_panic(muts in prop::collection::vec(mutation(), 1..6)) {
        let mut bytes = full_record();
        for m in &muts {
            apply(&mut bytes, m);
        }
        check_round_trip(&bytes);
    }
}

#[test]
fn a_valid_record_round_trips() {
    let bytes = full_record();
    let r = parse_record(&bytes).unwrap();
    assert_eq!(r.state, State::Exited);
    assert_eq!(r.marks.len(), 1);
    assert_eq!(r.last_oom, Some(oom()));
    check_round_trip(&bytes);
    // Unknown fields (a later minor addition) are ignored, not refused.
    let text = String::from_utf8(bytes).unwrap();
    let extended = text.replacen('{', "{\"future_field\":[1,2,3],", 1);
    assert_eq!(parse_record(extended.as_bytes()).unwrap(), r);
}

/// Writes the record of `id` as if last written `age` ago.
fn publish_aged(
    dir: &Path,
    id: Identity,
    snap: &ProcessSnapshot,
    state: State,
    leaks: Vec<LeakEntry>,
    age: Duration,
) -> PathBuf {
    let mut r = build_record(&id, snap, state, leaks);
    r.updated_unix_ms -= age.as_millis() as u64;
    let bytes = encode_record(&mut r);
    write_atomic(dir, &r.file_name(), &bytes, false).unwrap();
    dir.join(r.file_name())
}

#[test]
fn expired_records_of_exited_processes_are_removed_and_no_others() {
    let t = TempDir::new("expire");
    let dir = t.reg();
    let reg = Registry::with_identity(&dir, fake_identity(1, 1)).unwrap();
    let hour = Duration::from_secs(3600);
    let old = 2 * hour;
    let dead = |n: u32| fake_identity(0x3fff_ff00 + n, 9);
    let none = ProcessSnapshot::default();
    let exited_old = publish_aged(&dir, dead(0), &none, State::Exited, vec![], old);
    let exited_recent = publish_aged(&dir, dead(1), &none, State::Exited, vec![], hour / 6);
    let with_leaks = publish_aged(&dir, dead(2), &none, State::Exited, vec![leak("x", 1)], old);
    let killed_holding = publish_aged(&dir, dead(3), &snapshot(5), State::Running, vec![], old);
    let killed_empty = publish_aged(&dir, dead(4), &none, State::Running, vec![], old);
    let nvml_lists = publish_aged(&dir, dead(5), &none, State::Exited, vec![], old);
    let me = std::process::id();
    let alive = publish_aged(
        &dir,
        fake_identity(me, process_start_time(me).unwrap()),
        &none,
        State::Exited,
        vec![],
        old,
    );
    let junk = dir.join("77-77.json");
    fs::write(&junk, b"not a record").unwrap();

    // An open directory is another user's to clean (or nobody's): nothing is removed there.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    assert!(expire_records(&dir, hour, now_ms(), &|_| false).is_empty());
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    // `never` removes nothing.
    assert_eq!(reg.expire(None), 0);

    let nvml_pid = 0x3fff_ff05;
    let removed = expire_records(&dir, hour, now_ms(), &|r| r.pid == nvml_pid);
    assert_eq!(removed, {
        let mut v = vec![exited_old.clone(), killed_empty.clone()];
        v.sort();
        v
    });
    for kept in [
        &exited_recent,
        &with_leaks,
        &killed_holding,
        &nvml_lists,
        &alive,
        &junk,
    ] {
        assert!(kept.exists(), "{} was removed", kept.display());
    }
    // The publisher's pass (no NVML) takes the clean exit NVML listed, once expired, but no
    // killed process's record: the driver may still hold its context whatever it says.
    let killed_empty_again = publish_aged(&dir, dead(4), &none, State::Running, vec![], old);
    assert_eq!(reg.expire(Some(hour)), 1);
    assert!(!nvml_lists.exists());
    assert!(killed_empty_again.exists());
    assert!(exited_recent.exists());
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[test]
fn another_users_directory_is_checked_against_the_uid_in_its_name() {
    let t = TempDir::new("dir-of");
    let dir = t.reg();
    Registry::with_identity(&dir, fake_identity(1, 1)).unwrap();
    let me = euid();
    assert!(check_dir_of(&dir, me).is_ok());
    let e = check_dir_of(&dir, me + 1).unwrap_err().to_string();
    assert!(
        e.contains(&format!("owned by uid {me}")) && e.contains(&format!("uid {}", me + 1)),
        "{e}"
    );
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let e = check_dir_of(&dir, me).unwrap_err().to_string();
    assert!(e.contains("0755"), "{e}");
    let link = t.0.join("link");
    symlink(&dir, &link).unwrap();
    assert!(check_dir_of(&link, me)
        .unwrap_err()
        .to_string()
        .contains("symlink"));
}

/// A directory filled with more records than a reader reads (a user slowing down root's `ps`):
/// the first ones are read, the rest left out unread in one entry that says how many.
#[test]
fn a_reader_reads_a_bounded_number_of_records() {
    use cistern::registry::{read_all, RecordError, MAX_RECORDS_PER_DIR};
    let t = TempDir::new("many");
    let dir = t.reg();
    fs::create_dir(&dir).unwrap();
    let extra = 7;
    for i in 0..MAX_RECORDS_PER_DIR + extra {
        fs::write(dir.join(format!("{}-1.json", 100_000 + i)), b"{}").unwrap();
    }
    let all = read_all(&dir).unwrap();
    assert_eq!(all.len(), MAX_RECORDS_PER_DIR + 1);
    let (path, last) = all.last().unwrap();
    assert_eq!(path, &dir);
    match last {
        Err(e @ RecordError::TooMany { left_out }) => {
            assert_eq!(*left_out, extra);
            assert!(e.to_string().contains("left out unread"), "{e}");
        }
        other => panic!("expected TooMany, got {other:?}"),
    }
}
