//! The pickle and snapshot readers return errors, never panic, on arbitrary input.

use cistern_trace::pickle;
use cistern_trace::Snapshot;
use proptest::prelude::*;

/// A valid snapshot-like pickle: `{'segments': [{'device': 0, 'address': 4096, 'total_size':
/// 8192, 'blocks': [d, d]}], 'device_traces': [[{'action': 'alloc', 'addr': 4096, 'size': 7}]]}`
/// with `d = {'size': 4096, 'state': 'inactive'}` shared.
fn sample() -> Vec<u8> {
    let mut p = vec![0x80, 4, b'}', 0x94, b'('];
    let s = |p: &mut Vec<u8>, x: &str| {
        p.push(0x8c);
        p.push(x.len() as u8);
        p.extend_from_slice(x.as_bytes());
        p.push(0x94);
    };
    s(&mut p, "segments");
    p.extend([b']', 0x94, b'}', 0x94, b'(']);
    s(&mut p, "device");
    p.extend([b'K', 0]);
    s(&mut p, "address");
    p.extend([b'M', 0x00, 0x10]);
    s(&mut p, "total_size");
    p.extend([b'M', 0x00, 0x20]);
    s(&mut p, "blocks");
    p.extend([b']', 0x94, b'(', b'}', 0x94, b'(']);
    s(&mut p, "size");
    p.extend([b'M', 0x00, 0x10]);
    s(&mut p, "state");
    s(&mut p, "inactive");
    p.extend([b'u', b'h', 9, b'e', b'u', b'a']);
    s(&mut p, "device_traces");
    p.extend([b']', 0x94, b']', 0x94, b'}', 0x94, b'(']);
    s(&mut p, "action");
    s(&mut p, "alloc");
    s(&mut p, "addr");
    p.extend([b'M', 0x00, 0x10]);
    s(&mut p, "size");
    p.extend([b'K', 7, b'u', b'a', b'a', b'u', b'.']);
    p
}

#[test]
fn sample_is_valid() {
    let snap = Snapshot::from_bytes(&sample()).unwrap();
    assert_eq!(snap.segments[0].blocks.len(), 2);
    assert_eq!(snap.segments[0].blocks[1].address, 8192);
    assert_eq!(snap.events(0).len(), 1);
}

#[test]
fn every_truncation_of_the_sample_is_an_error() {
    let p = sample();
    for n in 0..p.len() {
        let e = pickle::from_slice(&p[..n]).unwrap_err();
        assert!(e.offset <= n, "offset {} beyond input {n}", e.offset);
        assert!(Snapshot::from_bytes(&p[..n]).is_err());
    }
}

#[test]
fn truncations_of_a_real_snapshot_are_errors() {
    let Some(dir) = crate::common::traces_dir("truncated real snapshot") else {
        return;
    };
    let path = dir.join("pytorch_snapshots/cs336-silmont2000__small_mem_snapshot.pickle");
    let Ok(bytes) = std::fs::read(&path) else {
        eprintln!("skipping: {} not found", path.display());
        return;
    };
    for n in (0..bytes.len()).step_by(997) {
        assert!(pickle::from_slice(&bytes[..n]).is_err(), "prefix {n}");
    }
}

/// Opcodes the reader knows, so random programs get past the first byte often.
const OPCODES: &[u8] = &[
    0x80, 0x95, b'.', b'(', b'0', b'1', b'2', b'N', 0x88, 0x89, b'J', b'K', b'M', 0x8a, 0x8b, b'G',
    0x8c, b'X', 0x8d, b'C', b'B', 0x8e, b']', b'}', b')', 0x8f, b'l', b'd', b't', 0x91, 0x85, 0x86,
    0x87, b'a', b'e', 0x90, b's', b'u', 0x94, b'q', b'r', b'h', b'j', b'c', 0xff, 0, 1, 2,
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = pickle::from_slice(&data);
        let _ = Snapshot::from_bytes(&data);
    }

    #[test]
    fn random_opcode_programs_never_panic(
        ops in proptest::collection::vec(proptest::sample::select(OPCODES), 0..200)
    ) {
        let mut data = vec![0x80, 4];
        data.extend(ops);
        if let Ok(v) = pickle::from_slice(&data) {
            let _ = Snapshot::from_value(&v);
        }
    }

    #[test]
    fn mutated_sample_never_panics(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut data = sample();
        for (at, byte) in edits {
            let i = at.index(data.len());
            data[i] = byte;
        }
        let n = cut.index(data.len() + 1);
        if let Ok(snap) = Snapshot::from_bytes(&data[..n]) {
            for d in 0..snap.device_traces.len().max(1) {
                let r = snap.reconstruct(d);
                prop_assert!(r.sequence.replay().is_ok());
                let _ = snap.reserved_curve(d).peak();
            }
        }
    }
}
