//! In-process tests of the exports, with a test-only hook that makes an export panic inside
//! its guard (the integration tests in `tests/` load the built library instead).

use std::ffi::{c_void, CStr};
use std::ptr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Once;

use super::*;
use crate::guard::test_hooks::panic_next;

/// Runs the pool on the simulator, unpublished (set before the first export call of this
/// process: the test process must leave no record in the user's registry).
fn sim() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("CISTERN_DRIVER", "sim");
        std::env::set_var("CISTERN_CONF", "registry:off");
    });
}

fn last_error() -> String {
    // SAFETY: never NULL, NUL-terminated; copied at once.
    unsafe { CStr::from_ptr(cistern_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn panics_never_escape() {
    sim();
    let s: cistern_stream_t = ptr::null_mut();
    let p = cistern_malloc(4096, 0, s);
    assert!(!p.is_null());
    let before = guard::ABI_PANICS.load(Relaxed);
    let expect_caught = |name: &str| {
        let e = last_error();
        assert!(e.contains(name) && e.contains("internal error"), "{e}");
    };

    panic_next("cistern_malloc");
    assert!(cistern_malloc(4096, 0, s).is_null());
    expect_caught("cistern_malloc");

    panic_next("cistern_free");
    cistern_free(p, 4096, 0, s);
    expect_caught("cistern_free");

    let mut size = 99usize;
    panic_next("cistern_base_alloc");
    // SAFETY: `size` is a live usize.
    assert!(unsafe { cistern_base_alloc(p, &mut size) }.is_null());
    assert_eq!(size, 0);
    expect_caught("cistern_base_alloc");

    let mut buf = [b'x'; 8];
    panic_next("cistern_stats_json");
    // SAFETY: `buf` has 8 bytes.
    let n = unsafe { cistern_stats_json(0, buf.as_mut_ptr().cast(), 8) };
    assert_eq!(n, 0);
    assert_eq!(buf[0], 0, "an empty string is written");
    expect_caught("cistern_stats_json");

    panic_next("cistern_snapshot_json");
    // SAFETY: as above.
    let n = unsafe { cistern_snapshot_json(buf.as_mut_ptr().cast(), 8) };
    assert_eq!(n, 0);
    expect_caught("cistern_snapshot_json");

    let calls: [(&str, &dyn Fn()); 8] = [
        ("cistern_init", &|| cistern_init(1)),
        ("cistern_empty_cache", &|| cistern_empty_cache()),
        ("cistern_set_memory_fraction", &|| {
            cistern_set_memory_fraction(0.5, 0)
        }),
        ("cistern_record_stream", &|| cistern_record_stream(p, s)),
        ("cistern_forget_stream", &|| cistern_forget_stream(s)),
        ("cistern_reset_peak_stats", &|| cistern_reset_peak_stats(0)),
        ("cistern_tag_pop", &|| cistern_tag_pop()),
        // SAFETY: a NUL-terminated string.
        ("cistern_tag_push", &|| unsafe {
            cistern_tag_push(c"t".as_ptr())
        }),
    ];
    for (name, call) in calls {
        panic_next(name);
        call();
        expect_caught(name);
    }
    panic_next("cistern_last_error");
    // SAFETY: never NULL, NUL-terminated.
    let e = unsafe { CStr::from_ptr(cistern_last_error()) };
    assert_eq!(e.to_bytes(), b"");

    assert_eq!(guard::ABI_PANICS.load(Relaxed) - before, 14);
    // The pool is unharmed: the block is still live and frees normally.
    cistern_free(p, 4096, 0, s);
    let q = cistern_malloc(4096, 0, s);
    assert!(!q.is_null());
    cistern_free(q, 4096, 0, s);
}

#[test]
fn write_c_string_follows_snprintf() {
    let text = "{\"a\":1}";
    let n = text.len();
    let mut buf = [b'x'; 16];
    // SAFETY: (all calls) `buf` has 16 writable bytes and every cap is at most 16.
    unsafe {
        assert_eq!(report::write_c_string(text, ptr::null_mut(), 0), n);
        assert_eq!(report::write_c_string(text, ptr::null_mut(), 8), n);
        assert_eq!(report::write_c_string(text, buf.as_mut_ptr(), 0), n);
        assert_eq!(buf, [b'x'; 16]);
        assert_eq!(report::write_c_string(text, buf.as_mut_ptr(), 1), n);
        assert_eq!(&buf[..2], b"\0x");
        assert_eq!(report::write_c_string(text, buf.as_mut_ptr(), 4), n);
        assert_eq!(&buf[..5], b"{\"a\0x");
        assert_eq!(report::write_c_string(text, buf.as_mut_ptr(), n), n);
        assert_eq!(&buf[..n + 1], b"{\"a\":1\0x");
        assert_eq!(report::write_c_string(text, buf.as_mut_ptr(), n + 1), n);
        assert_eq!(&buf[..n + 2], b"{\"a\":1}\0x");
        assert_eq!(report::write_c_string("", buf.as_mut_ptr(), 16), 0);
        assert_eq!(buf[0], 0);
    }
}

#[test]
fn tags_stack_per_thread() {
    // SAFETY: (all calls) NUL-terminated strings, or NULL, which is refused.
    unsafe {
        cistern_tag_push(c"outer".as_ptr());
        cistern_tag_push(c"in\xffner".as_ptr());
    }
    assert_eq!(tags::current().as_deref(), Some("in\u{fffd}ner"));
    std::thread::spawn(|| assert_eq!(tags::current(), None))
        .join()
        .unwrap();
    cistern_tag_pop();
    assert_eq!(tags::current().as_deref(), Some("outer"));
    cistern_tag_pop();
    assert_eq!(tags::current(), None);
    cistern_tag_pop();
    assert!(last_error().contains("no tag to pop"));
    // SAFETY: NULL is refused.
    unsafe { cistern_tag_push(ptr::null()) };
    assert!(last_error().contains("a tag is required"));
    for _ in 0..tags::MAX_DEPTH {
        // SAFETY: a NUL-terminated string.
        unsafe { cistern_tag_push(c"x".as_ptr()) };
    }
    // SAFETY: as above.
    unsafe { cistern_tag_push(c"one too many".as_ptr()) };
    assert!(last_error().contains("1024 deep"), "{}", last_error());
    for _ in 0..tags::MAX_DEPTH {
        cistern_tag_pop();
    }
    assert_eq!(tags::current(), None);
}

#[test]
fn tags_attach_to_allocations() {
    sim();
    let s = 0x7a6 as cistern_stream_t;
    // SAFETY: a NUL-terminated string.
    unsafe { cistern_tag_push(c"ffi-tagged".as_ptr()) };
    let p = cistern_malloc(3 << 20, 0, s);
    cistern_tag_pop();
    let q = cistern_malloc(4096, 0, s);
    assert!(!p.is_null() && !q.is_null());
    let pool = global::pool().expect("the simulated pool");
    global::with_pool!(pool, |pool| {
        let dev = pool.device(0).unwrap();
        let e = dev.ledger();
        let t = e
            .iter()
            .find(|e| e.tag == "ffi-tagged")
            .expect("ledger entry");
        assert!(t.live_bytes >= 3 << 20 && t.live_blocks >= 1, "{t:?}");
        let blocks = dev.live_blocks_detailed();
        let b = blocks.iter().find(|b| b.ptr == p as u64).unwrap();
        assert_eq!(b.tag.as_deref(), Some("ffi-tagged"));
        let b = blocks.iter().find(|b| b.ptr == q as u64).unwrap();
        assert_eq!(b.tag, None, "popped tags no longer attach");
    });
    cistern_free(p, 3 << 20, 0, s);
    cistern_free(q, 4096, 0, s);
}

#[test]
fn size_zero_and_null() {
    sim();
    let s = 0x42 as cistern_stream_t;
    assert!(cistern_malloc(0, 0, s).is_null());
    assert!(cistern_malloc(0, 12345, s).is_null(), "size 0 never fails");
    let errors = guard::ABI_ERRORS.load(Relaxed);
    cistern_free(ptr::null_mut::<c_void>(), 0, 0, s);
    cistern_free(ptr::null_mut::<c_void>(), 10, -1, s);
    assert_eq!(
        guard::ABI_ERRORS.load(Relaxed),
        errors,
        "freeing NULL is no error"
    );
}

#[test]
fn version_is_the_packages() {
    // SAFETY: a static NUL-terminated string.
    let v = unsafe { CStr::from_ptr(cistern_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

/// `cistern_log_errors` is per thread, returns the previous setting, and leaves the last
/// error set when logging is off (the caller reads it instead).
#[test]
fn error_logging_is_turned_off_per_thread() {
    sim();
    assert_eq!(cistern_log_errors(0), 1);
    assert_eq!(cistern_log_errors(0), 0);
    std::thread::spawn(|| assert_eq!(cistern_log_errors(1), 1))
        .join()
        .unwrap();
    // SAFETY: NULL is refused without being read.
    unsafe { cistern_tag_push(ptr::null()) };
    assert!(
        last_error().contains("a tag is required"),
        "{}",
        last_error()
    );
    assert_eq!(cistern_log_errors(1), 0);
}
