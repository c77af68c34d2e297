//! Tests of the configuration: parsing every key, errors that name the fix, the README table.

use super::*;

#[test]
fn empty_is_default() {
    assert_eq!(Config::parse("").unwrap(), Config::default());
    assert_eq!(Config::parse(" , ").unwrap(), Config::default());
}

#[test]
fn parses_every_key() {
    let c = Config::parse(
        "vmm:false, memory_limit:8GiB,memory_fraction:0.5,release_threshold:1.5GiB,\
         small_size:2MiB,strict:true,provenance:stacks,stack_sample_rate:64",
    )
    .unwrap();
    assert_eq!(c.provenance, crate::provenance::Mode::Stacks);
    assert_eq!(c.stack_sample_rate, 64);
    assert!(!c.vmm);
    assert_eq!(c.memory_limit, Some(8 << 30));
    assert_eq!(c.memory_fraction, 0.5);
    assert_eq!(c.release_threshold, Some(3 << 29));
    assert_eq!(c.small_size, 2 << 20);
    assert!(c.strict);
    let c = Config::parse("registry:off,registry_dir:/run/user/1000/cistern").unwrap();
    assert!(!c.registry);
    assert_eq!(c.registry_dir, Some("/run/user/1000/cistern".into()));
    assert!(Config::default().registry);
}

#[test]
fn sizes_and_units() {
    assert_eq!(parse_size("4096").unwrap(), 4096);
    assert_eq!(parse_size("1KiB").unwrap(), 1024);
    assert_eq!(parse_size("1kb").unwrap(), 1000);
    assert_eq!(parse_size("2 MiB").unwrap(), 2 << 20);
    assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
    assert!(parse_size("12XB").unwrap_err().contains("unknown unit"));
    assert!(parse_size("MiB").is_err());
    assert!(parse_size("-5").is_err());
    // A plain byte count is exact, all 64 bits of it.
    assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
    assert_eq!(parse_size("9007199254740993").unwrap(), (1 << 53) + 1);
}

/// Negative, scientific, NaN and infinite sizes used to be blamed on an "unknown unit"
/// (`-5MiB`: unit `-5mib`); each error now says what is wrong.
#[test]
fn bad_sizes_say_what_is_wrong() {
    for (text, says) in [
        ("-5", "is negative"),
        ("-1GiB", "is negative"),
        ("-0.5MiB", "is negative"),
        ("1e9", "scientific notation"),
        ("1.5E+3MiB", "scientific notation"),
        ("2e-3GiB", "scientific notation"),
        ("nan", "is not a number"),
        ("NaN", "is not a number"),
        ("inf", "is not a number"),
        ("+inf", "is not a number"),
        ("MiB", "is not a size"),
        ("", "is not a size"),
        ("18446744073709551616", "too large"),
        ("16777216TiB", "too large"),
        ("12XB", "unknown unit"),
    ] {
        let e = parse_size(text).unwrap_err();
        assert!(e.contains(says), "{text:?}: {e}");
        assert!(
            !e.contains("unknown unit") || says == "unknown unit",
            "{text:?}: {e}"
        );
    }
    let e = Config::parse("release_threshold:-1GiB").unwrap_err();
    assert_eq!(e.key, "release_threshold");
    assert!(e.message.contains("negative"), "{e}");
    let e = Config::parse("memory_fraction:NaN").unwrap_err();
    assert!(e.message.contains("not a number"), "{e}");
    // A count too large for its type used to be "not a count", as if it were not a number.
    let e = Config::parse("stack_sample_rate:4294967296").unwrap_err();
    assert!(e.message.contains("too large (at most 4294967295)"), "{e}");
    let e = Config::parse("stack_sample_rate:-1").unwrap_err();
    assert!(e.message.contains("negative"), "{e}");
    let e = Config::parse("stack_sample_rate:1e3").unwrap_err();
    assert!(e.message.contains("not a count"), "{e}");
}

/// A key given twice used to be accepted, the last value winning; it is refused, naming it.
#[test]
fn duplicated_keys_are_refused() {
    let e = Config::parse("memory_limit:8GiB,vmm:false,memory_limit:4GiB").unwrap_err();
    assert_eq!(e.key, "memory_limit");
    assert!(e.message.contains("more than once"), "{e}");
    let e = Config::parse("vmm:true, vmm :true").unwrap_err();
    assert_eq!(e.key, "vmm");
    assert!(Config::parse("vmm:false,memory_limit:8GiB").is_ok());
}

#[test]
fn errors_name_the_key() {
    let e = Config::parse("memory_fractoin:0.5").unwrap_err();
    assert_eq!(e.key, "memory_fractoin");
    assert!(e.to_string().contains("valid keys are"), "{e}");
    let e = Config::parse("memory_fraction:1.5").unwrap_err();
    assert_eq!(e.key, "memory_fraction");
    let e = Config::parse("memory_fraction:-0.1").unwrap_err();
    assert_eq!(e.key, "memory_fraction");
    let e = Config::parse("memory_fraction:half").unwrap_err();
    assert_eq!(e.key, "memory_fraction");
    let e = Config::parse("small_size:1000").unwrap_err();
    assert_eq!(e.key, "small_size");
    let e = Config::parse("memory_limit:0").unwrap_err();
    assert_eq!(e.key, "memory_limit");
    let e = Config::parse("memory_limit:12 parsecs").unwrap_err();
    assert_eq!(e.key, "memory_limit");
    let e = Config::parse("vmm").unwrap_err();
    assert!(e.message.contains("key:value"));
    let e = Config::parse("strict:maybe").unwrap_err();
    assert_eq!(e.key, "strict");
    let e = Config::parse("registry:sometimes").unwrap_err();
    assert_eq!(e.key, "registry");
    let e = Config::parse("registry_dir: ").unwrap_err();
    assert_eq!(e.key, "registry_dir");
    let e = Config::parse("provenance:full").unwrap_err();
    assert_eq!(e.key, "provenance");
    let e = Config::parse("stack_sample_rate:-1").unwrap_err();
    assert_eq!(e.key, "stack_sample_rate");
}

#[test]
fn registry_expire_takes_durations_and_never() {
    use std::time::Duration;
    assert_eq!(
        Config::default().registry_expire,
        Some(Duration::from_secs(3600))
    );
    for (text, secs) in [
        ("1h", 3600.0),
        ("30m", 1800.0),
        ("90s", 90.0),
        ("90", 90.0),
        ("1.5h", 5400.0),
        ("7d", 7.0 * 86400.0),
        ("500ms", 0.5),
        ("0", 0.0),
    ] {
        let c = Config::parse(&format!("registry_expire:{text}")).unwrap();
        assert_eq!(
            c.registry_expire,
            Some(Duration::from_secs_f64(secs)),
            "{text}"
        );
    }
    assert_eq!(
        Config::parse("registry_expire:never")
            .unwrap()
            .registry_expire,
        None
    );
    for (text, says) in [
        ("-1h", "negative"),
        ("1y", "unknown unit"),
        ("soon", "unknown unit"),
        ("h", "not a duration"),
        ("1e400s", "unknown unit"),
        ("99999999999d", "too long"),
    ] {
        let e = Config::parse(&format!("registry_expire:{text}")).unwrap_err();
        assert_eq!(e.key, "registry_expire");
        assert!(e.message.contains(says), "{text}: {e}");
        assert!(e.message.contains("never"), "{text}: {e}");
    }
}

#[test]
fn readme_documents_every_key() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md at the workspace root");
    for (key, default, _) in KEYS {
        let row = format!("| `{key}` | `{default}` |");
        assert!(
            readme.contains(&row),
            "README lacks the row for {key}: {row}"
        );
    }
}

#[test]
fn limit_takes_the_lower() {
    let c = Config::parse("memory_limit:10GiB,memory_fraction:0.5").unwrap();
    assert_eq!(c.limit_for(80 << 30), 10 << 30);
    assert_eq!(c.limit_for(16 << 30), 8 << 30);
    assert_eq!(Config::default().limit_for(1 << 30), 1 << 30);
}

#[test]
fn grow_whole_chunks_takes_auto_on_and_off() {
    assert_eq!(Config::default().grow_whole_chunks, WholeChunks::Auto);
    for (v, want) in [
        ("auto", WholeChunks::Auto),
        ("AUTO", WholeChunks::Auto),
        ("on", WholeChunks::On),
        ("true", WholeChunks::On),
        ("off", WholeChunks::Off),
        ("0", WholeChunks::Off),
    ] {
        let c = Config::parse(&format!("grow_whole_chunks:{v}")).unwrap();
        assert_eq!(c.grow_whole_chunks, want, "{v}");
    }
    let e = Config::parse("grow_whole_chunks:sometimes").unwrap_err();
    assert_eq!(e.key, "grow_whole_chunks");
    assert!(e.message.contains("auto, on or off"), "{e}");
}
