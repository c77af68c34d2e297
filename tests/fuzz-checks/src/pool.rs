//! The pool itself, structure-aware: the input decodes (with `arbitrary`) into a program of
//! allocations, frees, `record_stream`, simulated work and its completion, stream retirement,
//! `empty_cache`, memory-limit changes and injected driver faults over four streams on a small
//! simulated device, in VMM or segment mode. After every step: the pool's invariants, no overlap
//! among live blocks and no hazard; every eighth step and after the last, the allocation
//! gauges equal to the program's own count and reserved bytes equal to what the simulator has
//! committed (a hazard is a range handed out while another
//! stream's unfinished work still touches it). At the end everything is freed and the cache
//! emptied: nothing may leak. Any failure is a crash.

use std::sync::Arc;

use arbitrary::{Result, Unstructured};
use cistern::driver::DriverCall;
use cistern::{Config, Pool, SimConfig, SimDriver, StreamId};

const MIB: u64 = 1 << 20;
const CAP: u64 = 128 * MIB;
const STREAMS: u64 = 4;
const MAX_STEPS: usize = 200;

/// Every driver call kind a fault can be injected into.
const FAULTS: [DriverCall; 13] = [
    DriverCall::ReserveVa,
    DriverCall::Unmap,
    DriverCall::ReleasePhysical,
    DriverCall::MemFree,
    DriverCall::CreatePhysical,
    DriverCall::Map,
    DriverCall::SetAccess,
    DriverCall::MemAlloc,
    DriverCall::EventCreate,
    DriverCall::EventRecord,
    DriverCall::EventQuery,
    DriverCall::EventSynchronize,
    DriverCall::DeviceSynchronize,
];

#[derive(Debug)]
enum Op {
    Alloc { size: u64, stream: u64 },
    Free(usize),
    RecordStream(usize, u64),
    LaunchOn(usize, u64),
    Complete(u64),
    CompleteAll,
    Forget(u64),
    EmptyCache,
    Fraction(u8),
    Fault(usize, u64),
}

fn op(u: &mut Unstructured) -> Result<Op> {
    Ok(match u.int_in_range(0u8..=15)? {
        0..=2 => Op::Alloc {
            size: u.int_in_range(0..=MIB)?,
            stream: u.int_in_range(0..=STREAMS - 1)?,
        },
        3..=4 => Op::Alloc {
            size: u.int_in_range(MIB..=48 * MIB)?,
            stream: u.int_in_range(0..=STREAMS - 1)?,
        },
        5..=7 => Op::Free(u.arbitrary()?),
        8 => Op::RecordStream(u.arbitrary()?, u.int_in_range(0..=STREAMS - 1)?),
        9 => Op::LaunchOn(u.arbitrary()?, u.int_in_range(0..=STREAMS - 1)?),
        10 => Op::Complete(u.int_in_range(0..=STREAMS - 1)?),
        11 => Op::CompleteAll,
        12 => Op::Forget(u.int_in_range(1..=STREAMS - 1)?),
        13 => Op::EmptyCache,
        14 => Op::Fraction(u.arbitrary()?),
        _ => Op::Fault(u.choose_index(FAULTS.len())?, u.int_in_range(1..=4)?),
    })
}

struct Live {
    ptr: u64,
    size: u64,
    stream: u64,
}

/// Decodes `data` into a program and runs it; panics on any failure.
pub fn check(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(vmm) = u.arbitrary::<bool>() else {
        return;
    };
    let mut ops = Vec::new();
    while ops.len() < MAX_STEPS {
        match op(&mut u) {
            Ok(o) => ops.push(o),
            Err(_) => break,
        }
    }
    run(vmm, &ops);
}

fn run(vmm: bool, ops: &[Op]) {
    let sim = Arc::new(SimDriver::new(SimConfig::default().capacity(CAP)));
    let config = Config::parse(&format!("vmm:{vmm},registry:off")).unwrap();
    let pool = Pool::new(sim.clone(), config).unwrap();
    let dev = pool.device(0).unwrap().clone();
    let mut live: Vec<Live> = Vec::new();
    // Stream ids: a forgotten stream comes back as a new one (the driver reuses handles).
    let mut gen = [0u64; STREAMS as usize];
    let sid = |gen: &[u64; STREAMS as usize], s: u64| {
        if s == 0 {
            StreamId(0)
        } else {
            StreamId(0x1000 * (gen[s as usize] + 1) + s)
        }
    };
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { size, stream } => match pool.alloc_raw(0, size, sid(&gen, stream)) {
                Ok(0) => assert_eq!(size, 0, "step {step}: null for {size} bytes"),
                Ok(ptr) => live.push(Live { ptr, size, stream }),
                Err(e) => assert!(
                    e.is_oom() || matches!(e, cistern::Error::Driver(_)),
                    "step {step}: {e}"
                ),
            },
            Op::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                pool.free_raw(l.ptr, sid(&gen, l.stream))
                    .unwrap_or_else(|e| panic!("step {step}: free: {e}"));
            }
            Op::RecordStream(i, s) if !live.is_empty() => {
                let l = &live[i % live.len()];
                let _ = pool.record_stream(l.ptr + l.size / 2, sid(&gen, s));
            }
            Op::LaunchOn(i, s) if !live.is_empty() => {
                let l = &live[i % live.len()];
                // The user's side of the contract: a block used on another stream is recorded.
                if pool.record_stream(l.ptr, sid(&gen, s)).is_ok() {
                    sim.launch(0, sid(&gen, s), &[(l.ptr, l.size.max(1))])
                        .unwrap();
                }
            }
            Op::Complete(s) => {
                sim.complete_next(0, sid(&gen, s));
            }
            Op::CompleteAll => sim.complete_all(0),
            // Only a stream with nothing live on it and no work queued is destroyed.
            Op::Forget(s) if live.iter().all(|l| l.stream != s) => {
                sim.complete_all(0);
                let _ = pool.forget_stream(sid(&gen, s));
                gen[s as usize] += 1;
            }
            Op::EmptyCache => pool.empty_cache(),
            Op::Fraction(f) => {
                let _ = dev.set_memory_fraction(f as f64 / 255.0);
            }
            Op::Fault(k, n) => sim.fail_nth(FAULTS[k], n),
            _ => {}
        }
        if let Err(e) = pool.check_invariants() {
            panic!("step {step} ({op:?}): invariants: {e}");
        }
        let hz = sim.hazards();
        assert!(hz.is_empty(), "step {step} ({op:?}): {hz:?}");
        let mut spans: Vec<(u64, u64)> = live.iter().map(|l| (l.ptr, l.size)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "step {step}: overlap {w:?}");
        }
        // The statistics are a map of named gauges, slow to build under instrumentation:
        // checked every eighth step and after the last.
        if step % 8 != 7 && step + 1 != ops.len() {
            continue;
        }
        let st = pool.stats(0).unwrap();
        assert_eq!(
            st.get("allocation.all.current") as usize,
            live.len(),
            "step {step}: live count"
        );
        let requested: u64 = live.iter().map(|l| l.size).sum();
        assert_eq!(
            st.get("requested_bytes.all.current") as u64,
            requested,
            "step {step}: requested bytes"
        );
        assert_eq!(
            st.get("reserved_bytes.all.current") as u64,
            sim.committed_bytes(0),
            "step {step}: reserved against committed"
        );
    }
    sim.clear_faults();
    for l in live {
        pool.free_raw(l.ptr, sid(&gen, l.stream)).unwrap();
    }
    sim.complete_all(0);
    pool.empty_cache();
    pool.check_invariants().unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!(
        st.get("reserved_bytes.all.current"),
        0,
        "leaked reserved bytes"
    );
    assert_eq!(sim.committed_bytes(0), 0, "leaked physical memory");
    assert_eq!(sim.live_handles(0), 0, "leaked handles");
    drop(dev);
    drop(pool);
    assert_eq!(sim.reserved_va_bytes(0), 0, "leaked address space");
    assert_eq!(sim.live_events(0), 0, "leaked events");
}
