//! Format detection and every reader behind it.
#![no_main]

use cistern_trace::{load, LoadOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(traces) = load::load_bytes("fuzz", data, &LoadOptions::default()) {
        for t in traces {
            assert!(t.sequence.replay().is_ok());
        }
    }
});
