//! google/minimalloc CSVs.
#![no_main]

use cistern_trace::minimalloc;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(seq) = minimalloc::parse_csv(text, 64) {
            assert!(seq.replay().is_ok());
        }
    }
});
