//! Random programs of pool operations checked against a trivial reference model: the set of
//! live allocations. After every step: the pool's invariants, no overlap and 512 B alignment
//! among live blocks, and the allocation gauges equal to the model's sums. At the end: free
//! everything, let the work finish, empty the cache, and prove that nothing leaked and that no
//! range was ever handed out while another stream's unfinished work still touched it.

use crate::common::*;
use cistern::driver::DriverCall;
use cistern::StreamId;
use proptest::prelude::*;

/// Small, so that OOM paths and stitching happen often.
const CAP: u64 = 256 * MIB;
const STREAMS: u64 = 4;

/// Every fault kind the pool meets before it is dropped (a failed release is retried by
/// `empty_cache`, so none of them may leak here).
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

#[derive(Debug, Clone)]
enum Op {
    Alloc { size: u64, stream: u64 },
    Free(usize),
    RecordStream(usize, u64),
    CompleteWork(u64),
    LaunchOn(usize, u64),
    EmptyCache,
    Fault(usize, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..=MIB, 0..STREAMS).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        6 => (MIB..=64 * MIB, 0..STREAMS).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<usize>().prop_map(Op::Free),
        2 => (any::<usize>(), 0..STREAMS).prop_map(|(i, s)| Op::RecordStream(i, s)),
        2 => (0..STREAMS).prop_map(Op::CompleteWork),
        3 => (any::<usize>(), 0..STREAMS).prop_map(|(i, s)| Op::LaunchOn(i, s)),
        1 => Just(Op::EmptyCache),
        1 => (0..FAULTS.len(), 1u64..4).prop_map(|(k, n)| Op::Fault(k, n)),
    ]
}

struct Live {
    ptr: u64,
    size: u64,
    stream: u64,
}

fn run(vmm: bool, ops: &[Op]) -> Result<(), TestCaseError> {
    run_with(vmm, "", ops)
}

fn run_with(vmm: bool, conf: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(CAP), vmm, conf);
    let mut live: Vec<Live> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { size, stream } => match pool.alloc_raw(0, size, StreamId(stream)) {
                Ok(0) => prop_assert_eq!(size, 0),
                Ok(ptr) => {
                    prop_assert!(size > 0);
                    live.push(Live { ptr, size, stream });
                }
                Err(e) => {
                    // Either a lack of memory, or an injected driver fault.
                    prop_assert!(
                        e.is_oom() || matches!(e, cistern::Error::Driver(_)),
                        "step {}: {}",
                        step,
                        e
                    );
                }
            },
            Op::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                let r = pool.free_raw(l.ptr, StreamId(l.stream));
                prop_assert!(r.is_ok(), "step {}: {:?}", step, r);
            }
            Op::RecordStream(i, s) if !live.is_empty() => {
                let l = &live[i % live.len()];
                pool.record_stream(l.ptr + l.size / 2, StreamId(s)).unwrap();
            }
            Op::LaunchOn(i, s) if !live.is_empty() => {
                let l = &live[i % live.len()];
                // The user's side of the contract: a block used on another stream is recorded.
                pool.record_stream(l.ptr, StreamId(s)).unwrap();
                sim.launch(0, StreamId(s), &[(l.ptr, l.size)]).unwrap();
            }
            Op::CompleteWork(s) => {
                sim.complete_next(0, StreamId(s));
            }
            Op::EmptyCache => pool.empty_cache(),
            Op::Fault(k, n) => sim.fail_nth(FAULTS[k], n),
            _ => {}
        }
        if let Err(e) = pool.check_invariants() {
            return Err(TestCaseError::fail(format!("step {step} ({op:?}): {e}")));
        }
        // The model.
        let mut spans: Vec<(u64, u64)> = live.iter().map(|l| (l.ptr, l.size)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            prop_assert!(w[0].0 + w[0].1 <= w[1].0, "step {}: overlap {:?}", step, w);
        }
        prop_assert!(spans.iter().all(|(p, _)| p % 512 == 0));
        let st = pool.stats(0).unwrap();
        let rounded: u64 = live.iter().map(|l| l.size.div_ceil(512) * 512).sum();
        let requested: u64 = live.iter().map(|l| l.size).sum();
        prop_assert_eq!(
            st.get("allocated_bytes.all.current") as u64,
            rounded,
            "step {}",
            step
        );
        prop_assert_eq!(
            st.get("requested_bytes.all.current") as u64,
            requested,
            "step {}",
            step
        );
        prop_assert_eq!(
            st.get("allocation.all.current") as usize,
            live.len(),
            "step {}",
            step
        );
        prop_assert_eq!(
            st.get("reserved_bytes.all.current") as u64,
            sim.committed_bytes(0),
            "step {}",
            step
        );
        let hz = sim.hazards();
        prop_assert!(hz.is_empty(), "step {} ({:?}): {:?}", step, op, hz);
    }
    sim.clear_faults();
    for l in live {
        pool.free_raw(l.ptr, StreamId(l.stream)).unwrap();
        pool.check_invariants().map_err(TestCaseError::fail)?;
    }
    sim.complete_all(0);
    pool.empty_cache();
    pool.check_invariants().map_err(TestCaseError::fail)?;
    let st = pool.stats(0).unwrap();
    prop_assert_eq!(st.get("active_bytes.all.current"), 0);
    prop_assert_eq!(st.get("reserved_bytes.all.current"), 0);
    prop_assert_eq!(sim.committed_bytes(0), 0);
    prop_assert_eq!(sim.live_handles(0), 0);
    prop_assert_eq!(sim.mapped_bytes(0), 0);
    prop_assert_eq!(sim.live_linear_allocations(0), 0);
    drop(pool);
    prop_assert_eq!(sim.reserved_va_bytes(0), 0);
    prop_assert_eq!(sim.live_events(0), 0);
    prop_assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(96)
}

proptest! {
    // PROPTEST_CASES raises the count for a longer hunt (e.g. 2000 with --release).
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn vmm_pool_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(true, &ops)?;
    }

    #[test]
    fn segment_pool_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(false, &ops)?;
    }

    #[test]
    fn vmm_pool_with_whole_chunks_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run_with(true, "grow_whole_chunks:on,chunk_split:none", &ops)?;
    }
}
