//! RMM logging_resource_adaptor CSVs.
#![no_main]

use cistern_trace::rmm;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(log) = rmm::parse(text) {
            assert!(log.sequence.replay().is_ok());
        }
    }
});
