//! The directory scan of `ps` / `leaks` / `doctor` over a registry another user may have written.
//! The check is `cistern_fuzz_checks::registry_scan::check`, which `cargo test` also runs over the
//! committed corpus and past crashes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cistern_fuzz_checks::registry_scan::check(data));
