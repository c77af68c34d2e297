//! The checked-in `include/cistern.h` is what cbindgen makes of `src/` now.

#[path = "common/header.rs"]
mod header;

#[test]
fn header_is_fresh() {
    let want = header::generate().expect("cbindgen runs");
    let path = header::checked_in_path();
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{} is stale: run `cargo run -p cistern-ffi --example gen-header` and commit it",
        path.display()
    );
}

#[test]
fn header_declares_every_export() {
    let have = std::fs::read_to_string(header::checked_in_path()).unwrap();
    for decl in [
        "void *cistern_malloc(size_t size, int device, cistern_stream_t stream);",
        "void cistern_free(void *ptr, size_t size, int device, cistern_stream_t stream);",
        "void cistern_init(int device_count);",
        "void cistern_empty_cache(void);",
        "void cistern_set_memory_fraction(double fraction, int device);",
        "void cistern_record_stream(void *ptr, cistern_stream_t stream);",
        "void cistern_forget_stream(cistern_stream_t stream);",
        "void *cistern_base_alloc(void *ptr, size_t *size);",
        "size_t cistern_stats_json(int device, char *buf, size_t cap);",
        "size_t cistern_snapshot_json(char *buf, size_t cap);",
        "void cistern_reset_peak_stats(int device);",
        "const char *cistern_last_error(void);",
        "int cistern_log_errors(int on);",
        "const char *cistern_version(void);",
        "void cistern_tag_push(const char *tag);",
        "void cistern_tag_pop(void);",
        "typedef void *cistern_stream_t;",
    ] {
        assert!(have.contains(decl), "cistern.h lacks `{decl}`");
    }
}
