//! Registry records are untrusted input: parsing never panics, and a record that parses
//! writes back and parses to the same record.
//! The check is `cistern_fuzz_checks::readers::registry_record`, which `cargo test` also runs over the
//! committed corpus and past crashes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cistern_fuzz_checks::readers::registry_record(data));
