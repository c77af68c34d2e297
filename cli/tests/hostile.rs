//! `ps`, `leaks` and `doctor` facing what they must not trust or assume: a registry directory
//! that is a symlink (in every spelling), records holding terminal control characters, and a
//! reader that goes away mid-output.

mod common;

use std::os::unix::fs::{symlink, PermissionsExt};

use cistern::registry::State;
use common::*;

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
