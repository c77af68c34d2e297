//! Loading the built `libcistern.so` for tests and benches, as a C program would use it.
#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

/// `cistern_stream_t`.
pub type Stream = *mut c_void;
/// `cistern_restore_fn_t`.
pub type RestoreFn =
    Option<unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, usize, *mut c_void)>;

/// Where the built library is: `CISTERN_LIB` if set, else next to the running test or bench
/// binary (`target/<profile>/deps/..`), which follows `CARGO_TARGET_DIR` and the profile.
///
/// Cargo does not build a cdylib-only library for the package's own integration tests or
/// benches, so the first call builds it (`cargo build -p cistern-ffi --lib` in the profile of
/// the running binary: a no-op when it is fresh). Cargo releases its build lock before it runs
/// tests, so this nested build does not wait on the outer one.
pub fn library_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(p) = std::env::var_os("CISTERN_LIB") {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().expect("current_exe");
        let deps = exe.parent().expect("the test binary has a directory");
        let profile_dir = deps.parent().expect("target/<profile>/deps");
        build_library(
            profile_dir
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("debug"),
        );
        for dir in [profile_dir, deps] {
            let p = dir.join("libcistern.so");
            if p.exists() {
                return p;
            }
        }
        panic!(
            "libcistern.so not found next to {} (build it with `cargo build -p cistern-ffi`)",
            exe.display()
        )
    })
    .clone()
}

/// Builds the cdylib in the profile whose output directory is `profile_dir`.
fn build_library(profile_dir: &str) {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(env!("CARGO_MANIFEST_DIR")).args([
        "build",
        "--quiet",
        "-p",
        "cistern-ffi",
        "--lib",
    ]);
    match profile_dir {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    match cmd.output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "building libcistern.so failed:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        // No cargo (the binary was run by hand): use whatever library was built before.
        Err(e) => eprintln!("cannot run cargo to build libcistern.so ({e}); using the last build"),
    }
}

/// The exports, resolved from the library.
/// `cistern_event_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: c_int,
    pub device: c_int,
    pub addr: u64,
    pub bytes: u64,
    pub pool_id_0: u64,
    pub pool_id_1: u64,
}

pub struct Abi {
    pub malloc: unsafe extern "C" fn(usize, c_int, Stream) -> *mut c_void,
    pub free: unsafe extern "C" fn(*mut c_void, usize, c_int, Stream),
    pub init: unsafe extern "C" fn(c_int),
    pub empty_cache: unsafe extern "C" fn(),
    pub set_memory_fraction: unsafe extern "C" fn(f64, c_int),
    pub enable_peer_access: unsafe extern "C" fn(c_int, c_int) -> c_int,
    pub begin_allocate_to_pool: unsafe extern "C" fn(
        c_int,
        u64,
        u64,
        Option<unsafe extern "C" fn(*mut c_void, Stream) -> c_int>,
        *mut c_void,
        Option<unsafe extern "C" fn(*mut c_void)>,
    ) -> c_int,
    pub end_allocate_to_pool: unsafe extern "C" fn(c_int, u64, u64) -> c_int,
    pub release_pool: unsafe extern "C" fn(c_int, u64, u64) -> c_int,
    pub empty_pool_cache: unsafe extern "C" fn(u64, u64) -> c_int,
    pub cache_info: unsafe extern "C" fn(c_int, *mut usize, *mut usize) -> c_int,
    pub uses_vmm: unsafe extern "C" fn(c_int) -> c_int,
    pub create_or_incref_pool: unsafe extern "C" fn(c_int, u64, u64) -> c_int,
    pub pool_use_count: unsafe extern "C" fn(c_int, u64, u64) -> i64,
    pub set_use_on_oom: unsafe extern "C" fn(c_int, u64, u64, c_int) -> c_int,
    pub pool_live_blocks: unsafe extern "C" fn(c_int, u64, u64, *mut *mut c_void, usize) -> i64,
    pub pool_checkpoint: unsafe extern "C" fn(c_int, u64, u64) -> *mut c_void,
    pub checkpoint_free: unsafe extern "C" fn(*mut c_void),
    pub pool_restore: unsafe extern "C" fn(*const c_void, RestoreFn, *mut c_void) -> c_int,
    pub free_and_release: unsafe extern "C" fn(*mut c_void, usize, c_int, Stream),
    pub abort_on_failure: unsafe extern "C" fn(c_int) -> c_int,
    pub set_observer: unsafe extern "C" fn(
        Option<unsafe extern "C" fn(*mut c_void, *const Event)>,
        *mut c_void,
        Option<unsafe extern "C" fn(*mut c_void)>,
    ) -> c_int,
    pub get_memory_fraction: unsafe extern "C" fn(c_int) -> f64,
    pub last_oom: unsafe extern "C" fn(c_int, *mut usize, *mut usize) -> c_int,
    pub record_stream: unsafe extern "C" fn(*mut c_void, Stream),
    pub base_alloc: unsafe extern "C" fn(*mut c_void, *mut usize) -> *mut c_void,
    pub stats_json: unsafe extern "C" fn(c_int, *mut c_char, usize) -> usize,
    pub snapshot_json: unsafe extern "C" fn(*mut c_char, usize) -> usize,
    pub reset_peak_stats: unsafe extern "C" fn(c_int),
    pub last_error: unsafe extern "C" fn() -> *const c_char,
    pub version: unsafe extern "C" fn() -> *const c_char,
    pub tag_push: unsafe extern "C" fn(*const c_char),
    pub tag_pop: unsafe extern "C" fn(),
    pub python_frames: unsafe extern "C" fn(c_int) -> c_int,
    _lib: libloading::Library,
}

// SAFETY (test code): the fields are plain function pointers into a library that stays loaded
// for as long as `Abi` lives, and every export is documented as thread-safe.
unsafe impl Sync for Abi {}
// SAFETY: as above.
unsafe impl Send for Abi {}

/// The library, loaded once per test binary with `env` set first (the library reads its
/// environment when its pool is created, on the first call).
pub fn load_with_env(env: &[(&str, &str)]) -> &'static Abi {
    static ABI: OnceLock<Abi> = OnceLock::new();
    ABI.get_or_init(|| {
        for (k, v) in env {
            // Before the library is loaded and before any test thread calls into it: nothing
            // reads the environment concurrently.
            std::env::set_var(k, v);
        }
        let path = library_path();
        // SAFETY: loading libcistern.so runs no initialisers beyond Rust's own.
        let lib = unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|e| panic!("cannot load {}: {e}", path.display()));
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is the one declared in include/cistern.h.
                *unsafe { lib.get($name) }
                    .unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy($name)))
            };
        }
        Abi {
            malloc: sym!(b"cistern_malloc"),
            free: sym!(b"cistern_free"),
            init: sym!(b"cistern_init"),
            empty_cache: sym!(b"cistern_empty_cache"),
            set_memory_fraction: sym!(b"cistern_set_memory_fraction"),
            enable_peer_access: sym!(b"cistern_enable_peer_access"),
            set_observer: sym!(b"cistern_set_observer"),
            begin_allocate_to_pool: sym!(b"cistern_begin_allocate_to_pool"),
            end_allocate_to_pool: sym!(b"cistern_end_allocate_to_pool"),
            release_pool: sym!(b"cistern_release_pool"),
            empty_pool_cache: sym!(b"cistern_empty_pool_cache"),
            cache_info: sym!(b"cistern_cache_info"),
            uses_vmm: sym!(b"cistern_uses_vmm"),
            create_or_incref_pool: sym!(b"cistern_create_or_incref_pool"),
            pool_use_count: sym!(b"cistern_pool_use_count"),
            set_use_on_oom: sym!(b"cistern_set_use_on_oom"),
            pool_live_blocks: sym!(b"cistern_pool_live_blocks"),
            pool_checkpoint: sym!(b"cistern_pool_checkpoint"),
            checkpoint_free: sym!(b"cistern_checkpoint_free"),
            pool_restore: sym!(b"cistern_pool_restore"),
            free_and_release: sym!(b"cistern_free_and_release"),
            abort_on_failure: sym!(b"cistern_abort_on_failure"),
            get_memory_fraction: sym!(b"cistern_get_memory_fraction"),
            last_oom: sym!(b"cistern_last_oom"),
            record_stream: sym!(b"cistern_record_stream"),
            base_alloc: sym!(b"cistern_base_alloc"),
            stats_json: sym!(b"cistern_stats_json"),
            snapshot_json: sym!(b"cistern_snapshot_json"),
            reset_peak_stats: sym!(b"cistern_reset_peak_stats"),
            last_error: sym!(b"cistern_last_error"),
            version: sym!(b"cistern_version"),
            tag_push: sym!(b"cistern_tag_push"),
            tag_pop: sym!(b"cistern_tag_pop"),
            python_frames: sym!(b"cistern_python_frames"),
            _lib: lib,
        }
    })
}

impl Abi {
    /// `cistern_last_error()` as a Rust string.
    pub fn last_error(&self) -> String {
        // SAFETY: the export returns a non-null, NUL-terminated string, valid until the next
        // failed call on this thread; it is copied at once.
        unsafe { CStr::from_ptr((self.last_error)()) }
            .to_string_lossy()
            .into_owned()
    }

    /// A whole JSON document from `f` (stats or snapshot), sized with a first call.
    pub fn json(&self, f: impl Fn(*mut c_char, usize) -> usize) -> String {
        loop {
            let need = f(std::ptr::null_mut(), 0);
            let mut buf = vec![0u8; need + 1];
            let got = f(buf.as_mut_ptr().cast(), buf.len());
            if got == need {
                assert_eq!(buf[need], 0, "NUL-terminated");
                buf.truncate(need);
                return String::from_utf8(buf).expect("UTF-8");
            }
        }
    }

    /// Device `dev`'s stats, parsed.
    pub fn stats(&self, dev: c_int) -> serde_json::Map<String, serde_json::Value> {
        // SAFETY: `json` passes a buffer of the capacity it names.
        let text = self.json(|b, c| unsafe { (self.stats_json)(dev, b, c) });
        match serde_json::from_str(&text) {
            Ok(serde_json::Value::Object(m)) => m,
            other => panic!("stats of device {dev} are not a JSON object: {other:?} ({text})"),
        }
    }

    /// One integer stat of device `dev`.
    pub fn stat(&self, dev: c_int, key: &str) -> i64 {
        self.stats(dev)
            .get(key)
            .and_then(|v| v.as_i64())
            .unwrap_or_else(|| panic!("no stat {key}"))
    }

    /// The snapshot, parsed.
    pub fn snapshot(&self) -> serde_json::Value {
        // SAFETY: `json` passes a buffer of the capacity it names.
        let text = self.json(|b, c| unsafe { (self.snapshot_json)(b, c) });
        serde_json::from_str(&text).expect("the snapshot is JSON")
    }
}
