//! Registry records are untrusted input: parsing arbitrary bytes never panics, and a record that
//! parses writes back and parses to the same record.
#![no_main]

use cistern::registry::{encode_record, parse_record};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = parse_record(data) {
        let mut copy = record.clone();
        let bytes = encode_record(&mut copy);
        let back = parse_record(&bytes).expect("what the writer emits parses");
        assert_eq!(back, record);
    }
});
