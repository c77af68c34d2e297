//! PyTorch snapshot pickles: parse, reconstruct every device, compute the reserved curve.
#![no_main]

use cistern_trace::Snapshot;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(snap) = Snapshot::from_bytes(data) {
        for d in 0..snap.device_traces.len().max(1) {
            let r = snap.reconstruct(d);
            assert!(r.sequence.replay().is_ok());
            let _ = snap.reserved_curve(d).peak();
        }
    }
});
