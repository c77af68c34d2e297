//! cistern's own trace format: parse, and a parsed trace writes and reads back identically.
#![no_main]

use cistern_trace::own;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(t) = own::parse(text) {
            let mut buf = Vec::new();
            own::write(&t.sequence, &mut buf).expect("writing to a Vec cannot fail");
            let back = own::parse(std::str::from_utf8(&buf).expect("the writer emits ASCII"))
                .expect("what the writer emits parses");
            assert_eq!(back.sequence, t.sequence);
        }
    }
});
