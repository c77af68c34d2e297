//! `libcistern.so` publishes its process in the registry: a process that exits normally leaves
//! an `exited` record whose leaks name the tag of what it never freed, and a SIGKILLed one
//! leaves its last `running` record.
//!
//! Each test runs a child (this binary again, running one `child_*` test) with
//! `CISTERN_DRIVER=sim` and `CISTERN_CONF=registry_dir:<a private directory>`.

mod common;

use std::ffi::{c_void, CString};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cistern_alloc::registry::{read_all, Liveness, Record, State};

const CHILD_ENV: &str = "CISTERN_REGISTRY_CHILD";
const MIB: usize = 1 << 20;

fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// A private directory (removed on drop); the registry is `reg` inside it.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!(
            "cistern-ffi-registry-{}-{name}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir(&d).unwrap();
        TempDir(d)
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

/// Kills (SIGKILL) and reaps the child on drop, so a failing test leaves no process behind.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The command that runs test `name` of this binary as a child publishing in `reg`.
fn child(name: &str, reg: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env("CISTERN_LIB", common::library_path())
        .env("CISTERN_DRIVER", "sim")
        .env_remove("CISTERN_SIM")
        .env("CISTERN_CONF", format!("registry_dir:{}", reg.display()));
    cmd
}

/// The one record in `reg`.
fn only_record(reg: &Path) -> Option<Record> {
    let all = read_all(reg).ok()?;
    assert!(all.len() <= 1, "{all:?}");
    all.into_iter().next()?.1.ok()
}

fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Allocates 3 MiB and 5000 bytes (5120 rounded) under tag `weights` and 4096 bytes untagged,
/// frees the untagged block, and prints what it holds.
fn allocate_weights() -> usize {
    let abi = common::load_with_env(&[]);
    let tag = CString::new("weights").unwrap();
    let s: common::Stream = std::ptr::null_mut();
    // SAFETY: the exports' documented types; `tag` is NUL-terminated.
    unsafe {
        (abi.tag_push)(tag.as_ptr());
        let a = (abi.malloc)(3 * MIB, 0, s);
        let b = (abi.malloc)(5000, 0, s);
        (abi.tag_pop)();
        let c = (abi.malloc)(4096, 0, s);
        assert!(
            !a.is_null() && !b.is_null() && !c.is_null(),
            "{}",
            abi.last_error()
        );
        (abi.free)(c, 4096, 0, s);
        let _: [*mut c_void; 2] = [a, b];
    }
    let held = abi.stat(0, "allocated_bytes.all.current") as usize;
    println!("HELD={held}");
    held
}

#[test]
fn a_clean_exit_leaves_the_leaks_by_tag() {
    if is_child() {
        return;
    }
    let t = TempDir::new("clean");
    let out = child("child_exits_holding_weights", &t.reg())
        .output()
        .expect("run the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
    let held: u64 = text
        .lines()
        .find_map(|l| l.split("HELD=").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("the child says what it held:\n{text}"));
    assert_eq!(held, (3 * MIB + 5120) as u64);

    let r = only_record(&t.reg()).expect("the child left a record");
    assert_eq!(r.state, State::Exited, "{r:?}");
    assert_eq!(r.pid, out_pid(&r));
    assert_eq!(r.leaks.len(), 1, "{:?}", r.leaks);
    let l = &r.leaks[0];
    assert_eq!((l.tag.as_str(), l.bytes, l.blocks), ("weights", held, 2));
    assert_eq!(r.devices[0].live, held);
    assert_eq!(r.devices[0].top_tags[0].name, "weights");
    assert_ne!(r.liveness(), Liveness::Alive);
}

/// The record names a process of its own (not this test's).
fn out_pid(r: &Record) -> u32 {
    assert_ne!(r.pid, std::process::id());
    r.pid
}

#[test]
fn child_exits_holding_weights() {
    if !is_child() {
        return;
    }
    allocate_weights();
    // Returning from the test lets the harness's main return: exit() runs the atexit hook.
}

#[test]
fn a_sigkilled_process_leaves_its_last_running_record() {
    if is_child() {
        return;
    }
    let t = TempDir::new("killed");
    let mut c = ChildGuard(
        child("child_holds_weights_until_killed", &t.reg())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the child"),
    );
    let want = (3 * MIB + 5120) as u64;
    // The record is republished within a second of the allocations.
    let r = wait_for("the child's record with its allocations", || {
        only_record(&t.reg()).filter(|r| r.devices.first().is_some_and(|d| d.live == want))
    });
    assert_eq!(r.pid, c.0.id());
    assert_eq!(r.liveness(), Liveness::Alive);
    c.0.kill().unwrap();
    c.0.wait().unwrap();

    let r = only_record(&t.reg()).expect("the record stays");
    assert_eq!(r.state, State::Running);
    assert_eq!(r.liveness(), Liveness::Dead);
    assert!(r.leaks.is_empty(), "no final record was written");
    let d = &r.devices[0];
    assert_eq!(d.live, want);
    assert_eq!(d.top_tags[0].name, "weights");
    assert_eq!(d.top_tags[0].bytes, want);
}

#[test]
fn child_holds_weights_until_killed() {
    if !is_child() {
        return;
    }
    allocate_weights();
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn an_unusable_registry_is_logged_and_the_pool_works() {
    if is_child() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let t = TempDir::new("unsafe");
    fs::create_dir(t.reg()).unwrap();
    fs::set_permissions(t.reg(), fs::Permissions::from_mode(0o777)).unwrap();
    let out = child("child_exits_holding_weights", &t.reg())
        .output()
        .expect("run the child");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("cistern:")).collect();
    assert_eq!(lines.len(), 1, "one line says why:\n{stderr}");
    assert!(lines[0].contains("not published"), "{}", lines[0]);
    assert!(read_all(&t.reg()).unwrap().is_empty());
}

#[test]
fn registry_off_publishes_nothing() {
    if is_child() {
        return;
    }
    let t = TempDir::new("off");
    let out = child("child_exits_holding_weights", &t.reg())
        .env(
            "CISTERN_CONF",
            format!("registry:off,registry_dir:{}", t.reg().display()),
        )
        .output()
        .expect("run the child");
    assert!(out.status.success());
    assert!(!t.reg().exists());
}
