//! The pool itself: a structure-aware program of operations on the simulator, checked after
//! every step (see `cistern_fuzz_checks::pool`).
//! The check is `cistern_fuzz_checks::pool::check`, which `cargo test` also runs over the
//! committed corpus and past crashes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cistern_fuzz_checks::pool::check(data));
