//! The commands facing what they must not trust or assume: a registry directory that is a
//! symlink (in every spelling) and records holding terminal control characters (`ps`, `leaks`,
//! `doctor`), and a reader that has gone before the output (every command).

use std::os::unix::fs::{symlink, PermissionsExt};

use crate::common::*;
use cistern::registry::{LeakEntry, MarkRecord, State};

#[test]
fn a_symlinked_registry_is_refused_in_every_spelling() {
    let tmp = TempDir::new("hostile-symlink");
    let real = tmp.path().join("real");
    let (me, start) = me();
    publish(
        &real,
        identity(me, start, "python train.py"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = tmp.path().join("link");
    symlink(&real, &link).unwrap();
    let base = tmp.path().display().to_string();
    for spelling in ["link", "link/", "link/.", "link//./"] {
        let dir = format!("{base}/{spelling}");
        let pid = me.to_string();
        for args in [
            vec!["ps", "--registry-dir", &dir],
            vec!["leaks", &pid, "--registry-dir", &dir],
            vec!["doctor", "--registry-dir", &dir],
        ] {
            let out = cistern(None).args(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains("symlink"), "{args:?}: {err}");
        }
        // The same through CISTERN_CONF.
        let out = cistern(None)
            .arg("ps")
            .env("CISTERN_CONF", format!("registry_dir:{dir}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "CISTERN_CONF {dir}: {err}");
        assert!(err.contains("symlink"), "CISTERN_CONF {dir}: {err}");
    }
    // The real directory is read in every spelling.
    for spelling in ["real", "real/", "real/."] {
        let out = cistern(None)
            .args(["ps", "--registry-dir", &format!("{base}/{spelling}")])
            .output()
            .unwrap();
        assert!(out.status.success(), "{spelling}: {out:?}");
    }
}

/// Terminal control: a title change, BEL, clear screen, CR over the line, a fake next line, a
/// C1 CSI, a bidi override.
const EVIL: &str = "evil\x1b]0;pwned\x07\x1b[2J\rfake\nline\u{9b}31m\u{202e}txt";

/// No control character but the line ends, and no invisible override.
fn assert_printable(what: &str, text: &str) {
    let bad: Vec<char> = text
        .chars()
        .filter(|&c| (c.is_control() && c != '\n') || c == '\u{202e}')
        .collect();
    assert!(bad.is_empty(), "{what} printed raw {bad:?}: {text}");
    assert!(
        text.contains("evil\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\rfake\\nline\\u{9b}31m\\u{202e}txt"),
        "{what} lacks the escaped string: {text}"
    );
}

#[test]
fn control_characters_from_records_are_escaped_in_tables_not_in_json() {
    let tmp = TempDir::new("hostile-escape");
    let dir = tmp.path().join("registry");
    let dead = dead_pid(0);
    publish(
        &dir,
        identity(dead, 4242, &format!("python {EVIL}")),
        vec![device(0, EVIL, GIB, 600 * MIB, &[(EVIL, 600 * MIB, 3)])],
        State::Exited,
        vec![LeakEntry {
            tag: EVIL.into(),
            site: Some(EVIL.into()),
            device: 0,
            bytes: 600 * MIB,
            blocks: 3,
            oldest_age_ms: None,
        }],
        vec![MarkRecord {
            id: 1,
            label: Some(EVIL.into()),
            unix_ms: 1,
            live_bytes_since: MIB,
            live_blocks_since: 1,
        }],
    );
    let pid = dead.to_string();
    for args in [
        vec!["ps"],
        vec!["leaks", &pid],
        vec!["doctor", "--grace", "0"],
    ] {
        let out = cistern(None)
            .args(&args)
            .arg("--registry-dir")
            .arg(&dir)
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.code().is_some_and(|c| c < 2), "{args:?}: {text}");
        assert_printable(&format!("{args:?}"), &text);
    }
    // JSON keeps the strings as they are (JSON escapes them itself).
    let out = cistern(None)
        .args(["leaks", &pid, "--json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let doc = json(&out);
    assert!(doc.to_string().contains("\\u001b]0;pwned"), "{doc}");
    assert_eq!(doc["command"], format!("python {EVIL}"));
}

/// The write end of a pipe whose read end is already closed: a reader that has gone.
fn reader_gone() -> std::process::Stdio {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0; 2];
    // Close-on-exec: a child that another test thread spawns between `pipe` and `close` must
    // not inherit the read end, or the pipe keeps a reader and the command never sees EPIPE
    // (seen: `replay --json` exiting 0 in a release run). The command's own stdout is a dup2
    // of the write end, which exec keeps.
    // SAFETY: `pipe2` writes two new descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors are new and owned here alone; the read end is closed at once.
    unsafe {
        libc::close(fds[0]);
        OwnedFd::from_raw_fd(fds[1]).into()
    }
}

#[test]
fn a_reader_that_has_gone_ends_every_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = TempDir::new("hostile-pipe");
    let dir = tmp.path().join("registry");
    let (me, start) = me();
    publish(
        &dir,
        identity(me, start, "python train.py"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[("model", MIB, 1)])],
        State::Running,
        vec![],
        vec![],
    );
    let trace = tmp.path().join("t.trace");
    std::fs::write(&trace, "# cistern-trace v1\na 1 3000000 0\nf 1\n").unwrap();
    let trace = trace.display().to_string();
    let dir = dir.display().to_string();
    let pid = me.to_string();
    for args in [
        vec![
            "replay",
            "-w",
            "rmm-random",
            "-a",
            "cistern",
            "--no-min-capacity",
        ],
        vec!["replay", "--json", &trace, "-a", "cistern"],
        vec!["convert", &trace],
        vec!["ps", "--registry-dir", &dir],
        vec!["ps", "--json", "--registry-dir", &dir],
        vec!["leaks", &pid, "--registry-dir", &dir],
        vec!["doctor", "--registry-dir", &dir],
    ] {
        let out = cistern(None)
            .args(&args)
            .stdout(reader_gone())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.signal() == Some(libc::SIGPIPE) && err.is_empty(),
            "{args:?}: {:?}: {err}",
            out.status
        );
    }
}

#[test]
fn an_invalid_cistern_conf_is_an_error_not_the_default_registry() {
    // The setting names a registry the commands cannot read: they used to show the default
    // registry's processes instead, without a word.
    let tmp = TempDir::new("hostile-conf");
    let conf = format!("registry_dir:{},bogus_key:1", tmp.path().display());
    for args in [vec!["ps"], vec!["leaks", "1"], vec!["doctor"]] {
        let out = cistern(None)
            .env("CISTERN_CONF", &conf)
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("bogus_key") && err.contains("--registry-dir"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn a_registry_open_to_others_is_read_with_a_warning() {
    // The library refuses to publish in a directory open to group or others; the readers
    // still show what is there, but say that it may have been planted.
    let tmp = TempDir::new("hostile-open");
    let dir = tmp.path().join("reg");
    let (me, start) = me();
    publish(
        &dir,
        identity(me, start, "python train.py"),
        vec![device(0, "GPU-aaaa", GIB, MIB, &[])],
        State::Running,
        vec![],
        vec![],
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let d = dir.display().to_string();
    let pid = me.to_string();
    for args in [
        vec!["ps", "--registry-dir", &d],
        vec!["leaks", &pid, "--registry-dir", &d],
        vec!["doctor", "--registry-dir", &d],
    ] {
        let out = cistern(None).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("warning") && err.contains("0777") && err.contains("another user"),
            "{args:?}: {err}"
        );
    }
}
