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
const FAULTS: [DriverCall; 14] = [
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
    DriverCall::StreamWaitEvent,
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
            Op::Alloc { size, stream } => {
                let fired = sim.faults_fired();
                match pool.alloc_raw(0, size, StreamId(stream)) {
                    Ok(0) => prop_assert_eq!(size, 0),
                    Ok(ptr) => {
                        prop_assert!(size > 0);
                        live.push(Live { ptr, size, stream });
                    }
                    Err(e) => {
                        // Either a lack of memory, or a driver fault injected into this very
                        // allocation (not one left over from an earlier call).
                        prop_assert!(
                            e.is_oom()
                                || (matches!(e, cistern::Error::Driver(_))
                                    && sim.faults_fired() > fired),
                            "step {}: {}",
                            step,
                            e
                        );
                    }
                }
            }
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

    #[test]
    fn vmm_pool_memory_first_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run_with(true, "grow_whole_chunks:off", &ops)?;
    }
}

// ---- graph pools ------------------------------------------------------------------------------

/// The base operations plus graph-pool windows (each on one stream, with a capture of that
/// stream when none is under way there) and pool releases.
#[derive(Debug, Clone)]
enum GraphOp {
    Base(Op),
    Begin {
        pool: u64,
        stream: u64,
    },
    End(usize),
    Release(u64),
    /// `empty_pool_cache` of a pool (PyTorch's `emptyCache(mempool_id)`), live or released.
    EmptyPool(u64),
}

fn graph_op() -> impl Strategy<Value = GraphOp> {
    prop_oneof![
        12 => op().prop_map(GraphOp::Base),
        2 => (0u64..3, 0..STREAMS).prop_map(|(pool, stream)| GraphOp::Begin { pool, stream }),
        2 => any::<usize>().prop_map(GraphOp::End),
        1 => (0u64..3).prop_map(GraphOp::Release),
        1 => (0u64..3).prop_map(GraphOp::EmptyPool),
    ]
}

fn mempool(n: u64) -> cistern::MempoolId {
    cistern::MempoolId(n + 1, 0)
}

struct GraphLive {
    ptr: u64,
    size: u64,
    stream: u64,
}

struct OpenWindow {
    pool: u64,
    stream: u64,
    /// Whether this window began the capture of its stream (and so ends it).
    captures: bool,
}

/// The graph pool (`segment_pool_id`) of the segment holding `ptr`.
fn pool_of(pool: &SimPool, ptr: u64) -> Option<(u64, u64)> {
    pool.device(0)
        .unwrap()
        .segments_snapshot()
        .into_iter()
        .find(|s| s.address <= ptr && ptr < s.address + s.total_size)
        .map(|s| s.pool_id)
}

/// Random programs with graph pools, checked against a model of which pool serves each
/// allocation: a window's stream is served by its pool (the first window opened that accepts
/// it), every other allocation by ordinary memory that never overlaps anything a live pool
/// ever handed out; no call is ever made that a capture forbids; and at the end nothing leaked.
fn run_graphs(vmm: bool, ops: &[GraphOp]) -> Result<(), TestCaseError> {
    use std::collections::HashMap;
    let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(CAP), vmm, "");
    let mut live: Vec<GraphLive> = Vec::new();
    let mut windows: Vec<OpenWindow> = Vec::new();
    let mut uses: HashMap<u64, u64> = HashMap::new();
    // Every range a live pool handed out: never handed out outside it while it lives.
    let mut owned: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
    let end_window = |windows: &mut Vec<OpenWindow>, i: usize| -> Result<(), TestCaseError> {
        let w = windows.remove(i);
        if w.captures {
            sim.end_capture(0, StreamId(w.stream))
                .map_err(|e| TestCaseError::fail(format!("window of pool {}: {e}", w.pool)))?;
        }
        pool.end_allocate_to_pool(0, mempool(w.pool)).unwrap();
        Ok(())
    };
    for (step, op) in ops.iter().enumerate() {
        match op {
            GraphOp::Begin { pool: p, stream } => {
                let filter_stream = *stream;
                let filter: cistern::StreamFilter =
                    std::sync::Arc::new(move |s: StreamId| Ok(s.0 == filter_stream));
                pool.begin_allocate_to_pool(0, mempool(*p), Some(filter))
                    .unwrap();
                let captures = !windows.iter().any(|w| w.stream == *stream && w.captures);
                if captures {
                    sim.begin_capture(0, StreamId(*stream)).unwrap();
                }
                windows.push(OpenWindow {
                    pool: *p,
                    stream: *stream,
                    captures,
                });
                *uses.entry(*p).or_default() += 1;
            }
            GraphOp::End(i) if !windows.is_empty() => {
                // end_allocate_to_pool closes the latest window of its pool.
                let p = windows[i % windows.len()].pool;
                let last = windows.iter().rposition(|w| w.pool == p).unwrap();
                // A capture ends before a later window on the same stream could need it: keep
                // it simple and end only windows that no later window of the stream relies on.
                let stream = windows[last].stream;
                let later_same_stream = windows[last + 1..].iter().any(|w| w.stream == stream);
                if !(windows[last].captures && later_same_stream) {
                    end_window(&mut windows, last)?;
                }
            }
            GraphOp::Release(p) => {
                let open = windows.iter().any(|w| w.pool == *p);
                if let (false, Some(n)) = (open, uses.get_mut(p)) {
                    pool.release_pool(0, mempool(*p)).unwrap();
                    *n -= 1;
                    if *n == 0 {
                        uses.remove(p);
                        owned.remove(p);
                    }
                }
            }
            GraphOp::Base(Op::Alloc { size, stream }) => {
                let want = windows.iter().find(|w| w.stream == *stream).map(|w| w.pool);
                let fired = sim.faults_fired();
                match pool.alloc_raw(0, *size, StreamId(*stream)) {
                    Ok(0) => prop_assert_eq!(*size, 0),
                    Ok(ptr) => {
                        let got = pool_of(&pool, ptr);
                        let expect = want.map_or((0, 0), |p| (mempool(p).0, mempool(p).1));
                        prop_assert_eq!(got, Some(expect), "step {}: pool of {:#x}", step, ptr);
                        match want {
                            Some(p) => owned.entry(p).or_default().push((ptr, *size)),
                            None => {
                                for (p, ranges) in &owned {
                                    for &(q, n) in ranges {
                                        prop_assert!(
                                            ptr + size <= q || ptr >= q + n,
                                            "step {}: {:#x}+{} handed out over pool {}'s {:#x}+{}",
                                            step,
                                            ptr,
                                            size,
                                            p,
                                            q,
                                            n
                                        );
                                    }
                                }
                            }
                        }
                        live.push(GraphLive {
                            ptr,
                            size: *size,
                            stream: *stream,
                        });
                    }
                    Err(e) => prop_assert!(
                        e.is_oom()
                            || (matches!(e, cistern::Error::Driver(_))
                                && sim.faults_fired() > fired),
                        "step {}: {}",
                        step,
                        e
                    ),
                }
            }
            GraphOp::Base(Op::Free(i)) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                let r = pool.free_raw(l.ptr, StreamId(l.stream));
                prop_assert!(r.is_ok(), "step {}: {:?}", step, r);
            }
            GraphOp::Base(Op::RecordStream(i, s)) if !live.is_empty() => {
                let l = &live[i % live.len()];
                pool.record_stream(l.ptr, StreamId(*s)).unwrap();
            }
            GraphOp::Base(Op::LaunchOn(i, s)) if !live.is_empty() => {
                let l = &live[i % live.len()];
                pool.record_stream(l.ptr, StreamId(*s)).unwrap();
                sim.launch(0, StreamId(*s), &[(l.ptr, l.size)]).unwrap();
            }
            GraphOp::Base(Op::CompleteWork(s)) => {
                sim.complete_next(0, StreamId(*s));
            }
            GraphOp::Base(Op::EmptyCache) => pool.empty_cache(),
            // What a live pool holds stays (the invariants check its pages, the launches its
            // blocks); an earlier, released pool of the same id gives its cache back.
            GraphOp::EmptyPool(p) => {
                pool.empty_pool_cache(mempool(*p));
            }
            GraphOp::Base(Op::Fault(k, n)) => sim.fail_nth(FAULTS[*k], *n),
            _ => {}
        }
        if let Err(e) = pool.check_invariants() {
            return Err(TestCaseError::fail(format!("step {step} ({op:?}): {e}")));
        }
        let violations = sim.capture_violations();
        prop_assert!(
            violations.is_empty(),
            "step {} ({:?}): {:?}",
            step,
            op,
            violations
        );
        prop_assert!(
            sim.hazards().is_empty(),
            "step {}: {:?}",
            step,
            sim.hazards()
        );
    }
    sim.clear_faults();
    while !windows.is_empty() {
        let last = windows.len() - 1;
        end_window(&mut windows, last)?;
    }
    for (p, n) in uses {
        for _ in 0..n {
            pool.release_pool(0, mempool(p)).unwrap();
        }
    }
    for l in live {
        pool.free_raw(l.ptr, StreamId(l.stream)).unwrap();
    }
    sim.complete_all(0);
    pool.empty_cache();
    pool.check_invariants().map_err(TestCaseError::fail)?;
    prop_assert_eq!(pool.stats(0).unwrap().get("reserved_bytes.all.current"), 0);
    prop_assert_eq!(sim.committed_bytes(0), 0);
    prop_assert_eq!(sim.live_handles(0), 0);
    prop_assert_eq!(sim.live_linear_allocations(0), 0);
    drop(pool);
    prop_assert_eq!(sim.reserved_va_bytes(0), 0);
    prop_assert_eq!(sim.live_events(0), 0);
    prop_assert!(sim.capture_violations().is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn vmm_pool_with_graph_pools_matches_model(ops in proptest::collection::vec(graph_op(), 1..80)) {
        run_graphs(true, &ops)?;
    }

    #[test]
    fn segment_pool_with_graph_pools_matches_model(
        ops in proptest::collection::vec(graph_op(), 1..80)
    ) {
        run_graphs(false, &ops)?;
    }
}
