//! The fake exports exactly the driver functions `CudaDriver` resolves (`CUDA_SYMBOLS`), those
//! its test clients call (`CLIENT_SYMBOLS`) and its test hooks (`HOOK_SYMBOLS`), so a new driver
//! call in cistern fails here, at build time of the tests, rather than aborting CI at run time.

mod common;

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_uint};
use std::process::Command;

use cistern::driver::cuda::CUDA_SYMBOLS;
use cistern_fakecuda::{exported_symbols, CLIENT_SYMBOLS, HOOK_SYMBOLS};

/// The fake, loaded into this process (it is never initialised here: `CISTERN_FAKECUDA` is not
/// set for the test process, and nothing calls `cuInit` with it set).
fn load() -> libloading::Library {
    let path = common::fake_dir().join("libcuda.so");
    // SAFETY: loading runs no initialiser of ours beyond Rust's std; the library is the fake
    // built from this workspace.
    unsafe { libloading::Library::new(&path) }
        .unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

#[test]
fn every_symbol_cuda_driver_resolves_is_exported() {
    let lib = load();
    let missing: Vec<&str> = CUDA_SYMBOLS
        .iter()
        .chain(CLIENT_SYMBOLS.iter())
        .chain(HOOK_SYMBOLS.iter())
        .copied()
        // SAFETY: a lookup only; the symbol is dropped unused.
        .filter(|s| unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err())
        .collect();
    assert!(
        missing.is_empty(),
        "the fake libcuda.so lacks {missing:?}: export them from tests/fakecuda/src/lib.rs"
    );
    // Both names cudarc (libcuda.so) and the CUDA runtime (libcuda.so.1) load are there.
    assert!(common::fake_dir().join("libcuda.so.1").is_file());
}

#[test]
fn the_dynamic_symbol_table_is_exactly_the_driver_calls() {
    let path = common::fake_dir().join("libcuda.so");
    let out = match Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&path)
        .output()
    {
        Ok(o) if o.status.success() => o,
        other => {
            eprintln!(
                "skipping: nm -D is not available here ({other:?}); the libloading check ran"
            );
            return;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let exported: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let (_addr, kind, name) = (parts.next()?, parts.next()?, parts.next()?);
            (kind == "T").then_some(name)
        })
        .collect();
    let wanted: BTreeSet<&str> = exported_symbols().into_iter().collect();
    assert_eq!(
        exported, wanted,
        "the fake's exported functions differ from CUDA_SYMBOLS ∪ CLIENT_SYMBOLS ∪ HOOK_SYMBOLS"
    );
}

#[test]
fn it_refuses_to_start_without_the_guard_variable() {
    if std::env::var_os("CISTERN_FAKECUDA").is_some() {
        eprintln!("skipping: CISTERN_FAKECUDA is set for the test process itself");
        return;
    }
    let lib = load();
    type Init = unsafe extern "C" fn(c_uint) -> c_uint;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_uint;
    type ErrStr = unsafe extern "C" fn(c_uint, *mut *const c_char) -> c_uint;
    // SAFETY: the signatures are the C API's (CUresult is a 32-bit enum).
    let (init, count, errstr) = unsafe {
        (
            lib.get::<Init>(b"cuInit").unwrap(),
            lib.get::<Count>(b"cuDeviceGetCount").unwrap(),
            lib.get::<ErrStr>(b"cuGetErrorString").unwrap(),
        )
    };
    let mut n: c_int = -1;
    // SAFETY: `n` is a live, writable c_int.
    assert_eq!(unsafe { count(&mut n) }, 3, "NOT_INITIALIZED before cuInit");
    // SAFETY: a plain flags value.
    assert_eq!(
        unsafe { init(0) },
        34,
        "CUDA_ERROR_STUB_LIBRARY without the guard"
    );
    // SAFETY: as above.
    assert_eq!(unsafe { count(&mut n) }, 3, "still not initialised");
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: `text` is a live, writable pointer; on success it points to a static C string.
    assert_eq!(unsafe { errstr(34, &mut text) }, 0);
    // SAFETY: as above.
    let text = unsafe { std::ffi::CStr::from_ptr(text) };
    assert_eq!(text.to_str().unwrap(), "CUDA driver is a stub library");
}

#[test]
fn the_exported_list_is_the_union_and_hooks_are_not_cuda_names() {
    let all = exported_symbols();
    for s in CUDA_SYMBOLS
        .iter()
        .chain(&CLIENT_SYMBOLS)
        .chain(&HOOK_SYMBOLS)
    {
        assert!(all.contains(s), "{s}");
    }
    assert!(HOOK_SYMBOLS.iter().all(|s| s.starts_with("cisternFake")));
    assert!(CLIENT_SYMBOLS.iter().all(|s| s.starts_with("cu")));
    // The helper that children inherit clears every knob.
    let mut knobs: Vec<&str> = common::KNOBS.to_vec();
    let mut all_knobs: Vec<&str> = cistern_fakecuda::knobs::ALL.to_vec();
    knobs.sort_unstable();
    all_knobs.sort_unstable();
    assert_eq!(
        knobs, all_knobs,
        "tests/common/mod.rs KNOBS is not knobs::ALL"
    );
}
