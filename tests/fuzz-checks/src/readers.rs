//! The trace readers and the format detection in front of them, the registry's record parser,
//! and the configuration strings: each function takes arbitrary bytes and panics only on a bug
//! (a reader that accepts its input must give a valid sequence; a record that parses must write
//! back and read back the same; whatever a configuration parser accepts must be in bounds).

use cistern::open::sim_config_from_str;
use cistern::registry::{encode_record, parse_record};
use cistern::{Config, SimDriver};
use cistern_trace::workloads::TrainingParams;
use cistern_trace::{LoadOptions, Snapshot};

/// PyTorch snapshot pickles: parse, reconstruct every device, compute the reserved curve and
/// the state at the window's start (sorted, disjoint, non-empty segments; every live block
/// inside its own), and start both PyTorch models from that state on a small device, then
/// replay the first operations: no panic, and the models' block structure stays sound.
pub fn snapshot(data: &[u8]) {
    if let Ok(snap) = Snapshot::from_bytes(data) {
        for d in 0..snap.device_traces.len().max(1) {
            let r = snap.reconstruct(d);
            assert!(r.sequence.replay().is_ok());
            let _ = snap.reserved_curve(d).peak();
            let w = snap.window_start(d, &r);
            for pair in w.segments.windows(2) {
                assert!(pair[0].address + pair[0].size <= pair[1].address);
            }
            assert!(w.segments.iter().all(|s| s.size > 0));
            for b in &w.live {
                let s = &w.segments[b.segment];
                assert!(b.address >= s.address && b.address - s.address < s.size);
            }
            for expandable in [false, true] {
                let config = cistern_replay::PytorchConfig {
                    expandable_segments: expandable,
                    ..Default::default()
                };
                let mut m = cistern_replay::PytorchModel::new("pytorch", config, 1 << 30);
                if m.seed(&w).is_err() {
                    continue;
                }
                m.check_invariants().unwrap();
                for op in r.sequence.ops.iter().take(256) {
                    use cistern_replay::AllocatorModel;
                    match *op {
                        cistern_trace::Op::Alloc { id, size, stream } => {
                            if m.alloc(id, size, stream).is_err() {
                                break;
                            }
                        }
                        cistern_trace::Op::Free { id } => m.free(id),
                    }
                }
                m.check_invariants().unwrap();
            }
        }
    }
}

/// PyTorch profiler traces (plain or gzipped JSON).
pub fn kineto(data: &[u8]) {
    if let Ok(devs) = cistern_trace::kineto::from_bytes(data) {
        for d in devs {
            assert!(d.sequence.replay().is_ok());
        }
    }
}

/// RMM `logging_resource_adaptor` CSVs.
pub fn rmm(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(log) = cistern_trace::rmm::parse(text) {
            assert!(log.sequence.replay().is_ok());
        }
    }
}

/// cistern's own trace format: a parsed trace writes and reads back identically.
pub fn own(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(t) = cistern_trace::own::parse(text) {
            let mut buf = Vec::new();
            cistern_trace::own::write(&t.sequence, &mut buf).expect("writing to a Vec cannot fail");
            let back = cistern_trace::own::parse(
                std::str::from_utf8(&buf).expect("the writer emits ASCII"),
            )
            .expect("what the writer emits parses");
            assert_eq!(back.sequence, t.sequence);
        }
    }
}

/// google/minimalloc CSVs.
pub fn minimalloc(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(seq) = cistern_trace::minimalloc::parse_csv(text, 64) {
            assert!(seq.replay().is_ok());
        }
    }
}

/// Format detection and every reader behind it.
pub fn load(data: &[u8]) {
    if let Ok(traces) = cistern_trace::load::load_bytes("fuzz", data, &LoadOptions::default()) {
        for t in traces {
            assert!(t.sequence.replay().is_ok());
        }
    }
}

/// Registry records are untrusted input: a record that parses writes back and parses to the
/// same record.
pub fn registry_record(data: &[u8]) {
    if let Ok(record) = parse_record(data) {
        let mut copy = record.clone();
        let bytes = encode_record(&mut copy);
        let back = parse_record(&bytes).expect("what the writer emits parses");
        assert_eq!(back, record);
    }
}

/// The configuration strings people type, chosen by the first byte: `CISTERN_CONF`,
/// `CISTERN_SIM`, allocator specs (`pytorch:max_split_size_mb:N`, `cistern:KEY:VALUE`), and the
/// training workload's parameters.
pub fn config(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    match which % 4 {
        0 => {
            if let Ok(c) = Config::parse(text) {
                // Validating whatever parsed must not panic either.
                let _ = c.validate();
            }
        }
        1 => {
            if let Ok(c) = sim_config_from_str(text) {
                c.check()
                    .expect("sim_config_from_str returned an unchecked configuration");
                // Bounded: at most 2^23 pages a device, at most 64 devices.
                if SimDriver::try_new(c).is_err() {
                    panic!("a checked simulator configuration failed to build: {text:?}");
                }
            }
        }
        2 => {
            let _ = cistern_replay::make(text, 1 << 30);
        }
        _ => {
            let _ = TrainingParams::parse(text);
        }
    }
}
