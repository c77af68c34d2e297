//! The profiler, RMM, own-format and auto-detecting readers return errors, never panic, on
//! arbitrary and mutated input (the cargo-fuzz targets in `fuzz/` do the same at scale).

use cistern_trace::{kineto, load, own, rmm, LoadOptions};
use proptest::prelude::*;

const KINETO: &str = r#"{"traceEvents":[{"ph":"i","name":"[memory]","ts":2,"args":{"Addr":16,"Bytes":-8,"Total Allocated":0,"Total Reserved":64,"Device Id":0,"Device Type":1}},{"ph":"i","name":"[memory]","ts":1,"args":{"Addr":16,"Bytes":8,"Total Allocated":8,"Total Reserved":64,"Device Id":0,"Device Type":1}}]}"#;
const RMM: &str = "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x7f00,256,0\n1,10:00:00.000002,free,0x7f00,256,0\n1,10:00:00.000003,free,0x7e00,16,0x5\n";
const OWN: &str = "# cistern-trace v1\nname x\ni 0 8 0\nt 5\nr 64\na 1 16 0\nf 0\nf 1\n";

fn mutate(base: &[u8], edits: Vec<(prop::sample::Index, u8)>, cut: prop::sample::Index) -> Vec<u8> {
    let mut d = base.to_vec();
    for (at, byte) in edits {
        let i = at.index(d.len());
        d[i] = byte;
    }
    let n = cut.index(d.len() + 1);
    d.truncate(n);
    d
}

fn all_readers(data: &[u8]) {
    let _ = kineto::from_bytes(data);
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(log) = rmm::parse(s) {
            assert!(log.sequence.replay().is_ok());
        }
        if let Ok(t) = own::parse(s) {
            assert!(t.sequence.replay().is_ok());
        }
    }
    if let Ok(ts) = load::load_bytes("fuzz", data, &LoadOptions::default()) {
        for t in ts {
            assert!(t.sequence.replay().is_ok());
        }
    }
}

#[test]
fn samples_are_valid() {
    assert_eq!(
        kineto::from_bytes(KINETO.as_bytes()).unwrap()[0]
            .sequence
            .ops
            .len(),
        2
    );
    assert_eq!(rmm::parse(RMM).unwrap().sequence.ops.len(), 4);
    assert_eq!(own::parse(OWN).unwrap().sequence.ops.len(), 4);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        all_readers(&data);
    }

    #[test]
    fn mutated_kineto_never_panics(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        all_readers(&mutate(KINETO.as_bytes(), edits, cut));
    }

    #[test]
    fn mutated_rmm_never_panics(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        all_readers(&mutate(RMM.as_bytes(), edits, cut));
    }

    #[test]
    fn mutated_own_never_panics(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        all_readers(&mutate(OWN.as_bytes(), edits, cut));
    }

    #[test]
    fn rmm_lines_from_fields_never_panic(
        rows in proptest::collection::vec(
            (any::<u16>(), "[0-9:.]{0,16}", prop::sample::select(vec!["allocate", "free", "allocate failure", "deallocate", "x"]),
             prop::sample::select(vec!["0x10", "0x20", "(nil)", "10", "0x", "zz"]), any::<u64>(), "(0|0x[0-9a-f]{1,4}|[0-9]{1,3})"),
            0..20),
    ) {
        let mut s = String::from(rmm::HEADER);
        for (t, time, act, ptr, size, stream) in rows {
            s.push_str(&format!("\n{t},{time},{act},{ptr},{size},{stream}"));
        }
        if let Ok(log) = rmm::parse(&s) {
            prop_assert!(log.sequence.replay().is_ok());
        }
    }

    #[test]
    fn own_ops_from_fields_never_panic(
        ops in proptest::collection::vec((prop::sample::select(vec!["a", "f", "i", "t", "r", "name", "device", "q"]), 0u64..8, any::<u64>(), 0u64..3), 0..30),
    ) {
        let mut s = String::from(own::HEADER);
        for (k, id, size, stream) in ops {
            s.push_str(&match k {
                "a" | "i" => format!("\n{k} {id} {size} {stream}"),
                _ => format!("\n{k} {id}"),
            });
        }
        if let Ok(t) = own::parse(&s) {
            prop_assert!(t.sequence.replay().is_ok());
            let mut buf = Vec::new();
            own::write(&t.sequence, &mut buf).unwrap();
            prop_assert_eq!(own::parse(std::str::from_utf8(&buf).unwrap()).unwrap().sequence, t.sequence);
        }
    }
}
