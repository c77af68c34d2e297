//! PyTorch profiler traces (plain or gzipped JSON).
#![no_main]

use cistern_trace::kineto;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(devs) = kineto::from_bytes(data) {
        for d in devs {
            assert!(d.sequence.replay().is_ok());
        }
    }
});
