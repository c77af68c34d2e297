//! google/minimalloc CSVs.
//! The check is `cistern_fuzz_checks::readers::minimalloc`, which `cargo test` also runs over the
//! committed corpus and past crashes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cistern_fuzz_checks::readers::minimalloc(data));
