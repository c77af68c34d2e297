//! Graph pools (CUDA graphs' private memory) on the simulator, whose captures record launches
//! into graphs that replay later and refuse every call a global-mode capture forbids: memory
//! of a graph is reused inside it and never outside, its pages are never moved, taken or
//! released while the pool lives, and nothing the pool does during a capture invalidates it.

use std::sync::Arc;

use cistern::driver::DriverCall;
use cistern::{Error, MempoolId, SimConfig, SimDriver, StreamFilter, StreamId};

use crate::common::*;

const S: u64 = 1;
const T: u64 = 2;
const U: u64 = 3;
const GRAPH: MempoolId = MempoolId(1, 0);

/// A window filter that accepts only `stream` (PyTorch's accepts the capturing streams).
fn only(stream: u64) -> Option<StreamFilter> {
    Some(Arc::new(move |s: StreamId| Ok(s.0 == stream)))
}

/// Opens a window into `id` for stream `stream` and begins capturing there.
fn begin(sim: &SimDriver, pool: &SimPool, id: MempoolId, stream: u64) {
    pool.begin_allocate_to_pool(0, id, only(stream)).unwrap();
    sim.begin_capture(0, StreamId(stream)).unwrap();
}

/// Ends the capture on `stream` (failing the test if it was invalidated) and the window.
#[track_caller]
fn end(sim: &SimDriver, pool: &SimPool, id: MempoolId, stream: u64) -> cistern::SimGraph {
    let graph = sim
        .end_capture(0, StreamId(stream))
        .unwrap_or_else(|e| panic!("{e}"));
    pool.end_allocate_to_pool(0, id).unwrap();
    assert!(sim.capture_violations().is_empty());
    graph
}

/// The address ranges of graph pool `id`'s segments.
fn pool_ranges(pool: &SimPool, id: MempoolId) -> Vec<(u64, u64)> {
    pool.device(0)
        .unwrap()
        .segments_snapshot()
        .into_iter()
        .filter(|s| s.pool_id == (id.0, id.1))
        .map(|s| (s.address, s.address + s.total_size))
        .collect()
}

#[track_caller]
fn assert_outside(ranges: &[(u64, u64)], p: u64, len: u64) {
    for &(lo, hi) in ranges {
        assert!(
            p + len <= lo || p >= hi,
            "{p:#x}+{len} lies in the graph pool's [{lo:#x}, {hi:#x})"
        );
    }
}

#[test]
fn a_graph_reuses_its_memory_inside_and_never_outside() {
    both(|vmm| {
        let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), vmm, "");
        // Memory cached on the capturing stream before the capture: not the graph's.
        let x = alloc(&pool, 8 * MIB, S);
        free(&pool, x, S);

        begin(&sim, &pool, GRAPH, S);
        let a = alloc(&pool, 4 * MIB, S);
        sim.launch(0, StreamId(S), &[(a, 4 * MIB)]).unwrap();
        let b = alloc(&pool, MIB, S);
        sim.launch(0, StreamId(S), &[(a, 4 * MIB), (b, MIB)])
            .unwrap();
        free(&pool, a, S);
        // Reused inside the capture: the graph orders it after the work on `a`.
        let c = alloc(&pool, 4 * MIB, S);
        assert_eq!(c, a, "the graph's own freed block is not reused inside it");
        sim.launch(0, StreamId(S), &[(c, 4 * MIB), (b, MIB)])
            .unwrap();
        let d = alloc(&pool, 4 * KIB, S);
        sim.launch(0, StreamId(S), &[(d, 4 * KIB), (c, 4 * MIB)])
            .unwrap();
        free(&pool, c, S);
        // Another stream, not captured, allocates meanwhile from its own arena.
        let t = alloc(&pool, 4 * MIB, T);
        let graph = end(&sim, &pool, GRAPH, S);
        assert_eq!(graph.launches.len(), 4);
        assert_eq!(
            sim.unfinished_work(0),
            0,
            "captured work ran instead of being recorded"
        );

        let ranges = pool_ranges(&pool, GRAPH);
        assert!(!ranges.is_empty());
        for &(p, len) in &[(a, 4 * MIB), (b, MIB), (d, 4 * KIB)] {
            assert!(ranges.iter().any(|&(lo, hi)| lo <= p && p + len <= hi));
        }
        assert_outside(&ranges, x, 8 * MIB);
        assert_outside(&ranges, t, 4 * MIB);
        let info = pool.device(0).unwrap().graph_pools();
        assert_eq!(info.len(), 1);
        assert_eq!((info[0].id, info[0].uses, info[0].open), (GRAPH, 1, false));

        // After the capture, on the capturing stream and on others: never the graph's memory,
        // though `c` is free in it.
        let mut outside = Vec::new();
        for stream in [S, T, U] {
            for size in [4 * MIB, MIB, 4 * KIB, 512] {
                let p = alloc(&pool, size, stream);
                assert_outside(&ranges, p, size);
                outside.push((p, stream));
            }
        }
        // A replay runs over the graph's memory while another stream allocates: no hazard.
        sim.launch_graph(&graph, StreamId(S)).unwrap();
        for size in [4 * MIB, 8 * MIB, 4 * KIB] {
            let p = alloc(&pool, size, T);
            outside.push((p, T));
        }
        assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
        // Releasing the cache does not touch the graph's pages: it replays again.
        sim.complete_all(0);
        pool.empty_cache();
        check(&pool);
        assert_eq!(pool_ranges(&pool, GRAPH), ranges);
        sim.launch_graph(&graph, StreamId(S))
            .expect("the graph's memory was unmapped while its pool lived");
        sim.complete_all(0);

        for (p, stream) in outside {
            free(&pool, p, stream);
        }
        free(&pool, t, T);
        // The pool is released while its outputs live: they stay valid and can be freed.
        pool.release_pool(0, GRAPH).unwrap();
        assert!(pool.device(0).unwrap().graph_pools().is_empty());
        free(&pool, b, S);
        free(&pool, d, S);
        assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
        assert_no_leak(&sim, pool);
    });
}

#[test]
fn a_graphs_pages_are_never_taken_under_pressure() {
    // VMM: another stream's growth stitches cached pages from anywhere but a live graph pool.
    let (sim, pool) = pool_with(SimConfig::default().capacity(128 * MIB), true, "");
    begin(&sim, &pool, GRAPH, S);
    let a = alloc(&pool, 40 * MIB, S);
    sim.launch(0, StreamId(S), &[(a, 40 * MIB)]).unwrap();
    free(&pool, a, S);
    let graph = end(&sim, &pool, GRAPH, S);
    let ranges = pool_ranges(&pool, GRAPH);
    // The rest of the device, and more: the graph's 40 MiB must not be taken.
    let mut held = Vec::new();
    loop {
        match pool.alloc_raw(0, 8 * MIB, StreamId(T)) {
            Ok(p) => {
                check(&pool);
                assert_outside(&ranges, p, 8 * MIB);
                held.push(p);
            }
            Err(Error::OutOfMemory(_)) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(held.len() < 64, "the device never ran out");
    }
    // A stream of a new pool may not take them either.
    pool.begin_allocate_to_pool(0, MempoolId(2, 0), only(U))
        .unwrap();
    assert!(pool.alloc_raw(0, 8 * MIB, StreamId(U)).is_err());
    pool.end_allocate_to_pool(0, MempoolId(2, 0)).unwrap();
    pool.release_pool(0, MempoolId(2, 0)).unwrap();
    sim.launch_graph(&graph, StreamId(S))
        .expect("the graph's pages were unmapped");
    sim.complete_all(0);
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
    // Released, its pages serve the others again.
    pool.release_pool(0, GRAPH).unwrap();
    let p = alloc(&pool, 8 * MIB, T);
    held.push(p);
    for p in held {
        free(&pool, p, T);
    }
    assert_no_leak(&sim, pool);
}

#[test]
fn nothing_the_pool_does_during_a_capture_invalidates_it() {
    both(|vmm| {
        let (sim, pool) = pool_with(SimConfig::default().capacity(512 * MIB), vmm, "");
        let (s, t, u, v) = (StreamId(S), StreamId(T), StreamId(U), StreamId(4));
        // Before the capture: a free of stream T waiting on stream U's work, and memory cached
        // on stream T (what growth would poll, wait for and steal).
        let p = alloc(&pool, 16 * MIB, T);
        sim.launch(0, u, &[(p, 16 * MIB)]).unwrap();
        pool.record_stream(p, u).unwrap();
        free(&pool, p, T);
        let q = alloc(&pool, 32 * MIB, T);
        sim.launch(0, t, &[(q, 16 * MIB)]).unwrap();
        free(&pool, q, T);

        // The capture begins on S; stream 4 joins it (a side stream of the graph).
        begin(&sim, &pool, GRAPH, S);
        sim.begin_capture(0, v).unwrap();
        let mut inside = Vec::new();
        for size in [64 * MIB, 3 * MIB, 700 * KIB, 4 * KIB, 20 * MIB] {
            let b = alloc(&pool, size, S);
            sim.launch(0, s, &[(b, size)]).unwrap();
            inside.push(b);
        }
        // A block of the graph used by the side stream, freed during the capture: an event
        // recorded on the side stream now would join the graph, so it waits for the capture's
        // end.
        let r = alloc(&pool, 2 * MIB, S);
        sim.launch(0, v, &[(r, 2 * MIB)]).unwrap();
        pool.record_stream(r, v).unwrap();
        free(&pool, r, S);
        free(&pool, inside.pop().unwrap(), S);
        // Streams outside the capture grow past their caches (stealing T's cached pages needs
        // a query; T's pending free too), free, and the cache is trimmed.
        let o = alloc(&pool, 100 * MIB, U);
        free(&pool, o, U);
        let o = alloc(&pool, 48 * MIB, T);
        free(&pool, o, T);
        pool.empty_cache();
        pool.device(0).unwrap().trim();
        // More than the device has: an error, not a wait.
        assert!(matches!(
            pool.alloc_raw(0, 600 * MIB, s),
            Err(Error::OutOfMemory(_))
        ));
        check(&pool);
        assert!(
            sim.capture_violations().is_empty(),
            "{:?}",
            sim.capture_violations()
        );
        let records = sim.calls(DriverCall::EventRecord);
        sim.end_capture(0, v).unwrap();
        let graph = end(&sim, &pool, GRAPH, S);
        assert_eq!(graph.launches.len(), 5);
        assert_eq!(
            sim.calls(DriverCall::EventRecord),
            records + 1,
            "the event deferred for the side stream was not recorded at the window's end"
        );

        // After the capture the deferred events are recorded, and everything frees.
        sim.complete_all(0);
        let queries = sim.calls(DriverCall::EventQuery);
        let x = alloc(&pool, 64 * MIB, T);
        assert!(sim.calls(DriverCall::EventQuery) > queries);
        free(&pool, x, T);
        for b in inside {
            free(&pool, b, S);
        }
        pool.release_pool(0, GRAPH).unwrap();
        assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
        assert_no_leak(&sim, pool);
    });
}

#[test]
fn a_block_freed_during_capture_waits_for_its_other_streams_after_it() {
    let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), true, "");
    begin(&sim, &pool, GRAPH, S);
    let r = alloc(&pool, 2 * MIB, S);
    // Stream U (not capturing) uses the graph's block: its work runs now.
    sim.launch(0, StreamId(U), &[(r, 4096)]).unwrap();
    pool.record_stream(r, StreamId(U)).unwrap();
    free(&pool, r, S);
    // Pending inside the capture (its event is not even recorded): not handed out again.
    let again = alloc(&pool, 2 * MIB, S);
    assert_ne!(again, r);
    // The window's end records the deferred event on U, after U's work.
    end(&sim, &pool, GRAPH, S);
    // A second window into the same pool (no capture is needed to route allocations). Its
    // opening polls the pool's pending frees: U's work is not done.
    pool.begin_allocate_to_pool(0, GRAPH, only(S)).unwrap();
    let busy = alloc(&pool, 2 * MIB, S);
    assert_ne!(busy, r, "reused while stream U's work may still touch it");
    pool.end_allocate_to_pool(0, GRAPH).unwrap();
    sim.complete_all(0);
    // Now it is, and the next window's opening finds it so.
    pool.begin_allocate_to_pool(0, GRAPH, only(S)).unwrap();
    let reused = alloc(&pool, 2 * MIB, S);
    assert_eq!(reused, r, "the deferred free never completed");
    pool.end_allocate_to_pool(0, GRAPH).unwrap();
    assert_eq!(pool.device(0).unwrap().graph_pools()[0].uses, 3);
    // Outside a window, the stream's allocations are not the graph's.
    let outside = alloc(&pool, 2 * MIB, S);
    assert_outside(&pool_ranges(&pool, GRAPH), outside, 2 * MIB);
    for p in [again, busy, reused, outside] {
        free(&pool, p, S);
    }
    pool.release_pool(0, GRAPH).unwrap();
    pool.release_pool(0, GRAPH).unwrap();
    assert_eq!(pool.device(0).unwrap().graph_pools()[0].uses, 1);
    pool.release_pool(0, GRAPH).unwrap();
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
    assert_no_leak(&sim, pool);
}

#[test]
fn pool_calls_out_of_order_are_clear_errors() {
    let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), true, "");
    let e = pool.end_allocate_to_pool(0, GRAPH).unwrap_err().to_string();
    assert!(e.contains("begin_allocate_to_pool"), "{e}");
    let e = pool.release_pool(0, GRAPH).unwrap_err().to_string();
    assert!(e.contains("no graph pool (1, 0)"), "{e}");
    assert!(pool.begin_allocate_to_pool(5, GRAPH, None).is_err());
    // PyTorch's MemPool: a use without a window, counted with the windows' uses.
    let dev = pool.device(0).unwrap();
    assert_eq!(dev.pool_use_count(MempoolId(0, 7)), 0);
    dev.create_or_incref_pool(MempoolId(0, 7));
    dev.begin_allocate_to_pool(MempoolId(0, 7), None);
    dev.end_allocate_to_pool(MempoolId(0, 7)).unwrap();
    assert_eq!(dev.pool_use_count(MempoolId(0, 7)), 2);
    dev.release_pool(MempoolId(0, 7)).unwrap();
    assert_eq!(dev.pool_use_count(MempoolId(0, 7)), 1);
    dev.release_pool(MempoolId(0, 7)).unwrap();
    assert_eq!(dev.pool_use_count(MempoolId(0, 7)), 0);
    assert!(dev.graph_pools().is_empty());
    // A window with no filter routes every stream; releasing the pool closes it.
    pool.begin_allocate_to_pool(0, GRAPH, None).unwrap();
    let a = alloc(&pool, MIB, S);
    let b = alloc(&pool, MIB, T);
    assert_eq!(pool.device(0).unwrap().graph_pools()[0].streams, 2);
    pool.release_pool(0, GRAPH).unwrap();
    assert!(pool.device(0).unwrap().graph_pools().is_empty());
    let c = alloc(&pool, MIB, S);
    assert_outside(&pool_ranges(&pool, GRAPH), c, MIB);
    for (p, s) in [(a, S), (b, T), (c, S)] {
        free(&pool, p, s);
    }
    assert_no_leak(&sim, pool);
}

#[test]
fn faults_during_a_capture_lose_nothing_and_invalidate_nothing() {
    for vmm in MODES {
        for call in DriverCall::ALL {
            let (sim, pool) = pool_with(SimConfig::default().capacity(256 * MIB), vmm, "");
            begin(&sim, &pool, GRAPH, S);
            sim.fail_nth(call, 1);
            let mut live = Vec::new();
            for size in [30 * MIB, 4 * KIB, 3 * MIB] {
                if let Ok(p) = pool.alloc_raw(0, size, StreamId(S)) {
                    check(&pool);
                    live.push(p);
                }
            }
            sim.clear_faults();
            end(&sim, &pool, GRAPH, S);
            for p in live {
                free(&pool, p, S);
            }
            pool.release_pool(0, GRAPH).unwrap();
            eprintln!("-- vmm:{vmm} {call}");
            assert_no_leak(&sim, pool);
        }
    }
}

#[test]
fn a_failing_filter_fails_the_allocation_rather_than_route_it_outside() {
    let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), true, "");
    let filter: StreamFilter = Arc::new(|s: StreamId| {
        if s.0 == T {
            Err("cudaStreamGetCaptureInfo failed".to_string())
        } else {
            Ok(s.0 == S)
        }
    });
    pool.begin_allocate_to_pool(0, GRAPH, Some(filter)).unwrap();
    let e = pool.alloc_raw(0, MIB, StreamId(T)).unwrap_err().to_string();
    assert!(
        e.contains("cudaStreamGetCaptureInfo failed") && e.contains("(1, 0)"),
        "{e}"
    );
    check(&pool);
    let a = alloc(&pool, MIB, S);
    pool.end_allocate_to_pool(0, GRAPH).unwrap();
    // Closed: the filter is never called again.
    let b = alloc(&pool, MIB, T);
    free(&pool, a, S);
    free(&pool, b, T);
    pool.release_pool(0, GRAPH).unwrap();
    assert_no_leak(&sim, pool);
}

/// A window opened while other threads grow, free and poll: once `begin_allocate_to_pool` has
/// returned, no call they make may query or wait (each iteration's capture must end valid).
#[test]
fn a_window_opened_while_other_threads_work_is_never_invalidated() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    // Room for what the workers' frees hold while windows are open (nothing is polled then).
    let (sim, pool) = pool_with(SimConfig::default().capacity(16 * GIB), true, "");
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    // Until the workers have made `n` more operations (or a second passed): the windows open
    // while they work, not before they start.
    let wait_for = |n: u64| {
        let target = done.load(Relaxed) + n;
        let start = std::time::Instant::now();
        while done.load(Relaxed) < target && start.elapsed().as_secs() < 1 {
            std::thread::yield_now();
        }
    };
    let outcome = std::thread::scope(|scope| {
        for w in 0..2u64 {
            let (sim, pool, stop, done) = (&sim, &pool, &stop, &done);
            scope.spawn(move || {
                let mut rng = Rng::new(7 + w);
                let (own, other) = (StreamId(10 + w), StreamId(20 + w));
                while !stop.load(Relaxed) {
                    let size = rng.range(1, 4) * MIB;
                    let Ok(p) = pool.alloc_raw(0, size, own) else {
                        std::thread::yield_now();
                        continue;
                    };
                    // Work on another stream that is never captured: its event is queried.
                    let _ = sim.launch(0, other, &[(p, 4096)]);
                    pool.record_stream(p, other).unwrap();
                    pool.free_raw(p, own).unwrap();
                    if rng.chance(0.3) {
                        sim.complete_stream(0, other);
                    }
                    if rng.chance(0.05) {
                        pool.empty_cache();
                    }
                    done.fetch_add(1, Relaxed);
                }
            });
        }
        // Whatever happens here, the workers stop (a panic would leave them running, and the
        // scope waiting for them).
        let outcome = (|| -> Result<(), String> {
            wait_for(50);
            for i in 0..200u64 {
                wait_for(2);
                pool.begin_allocate_to_pool(0, GRAPH, only(S))
                    .map_err(|e| e.to_string())?;
                sim.begin_capture(0, StreamId(S))
                    .map_err(|e| e.to_string())?;
                // The workers' frees wait on events, and nothing is polled while a window is
                // open: when this thread is descheduled inside one, they may take the whole
                // device. Running out is allowed here; invalidating the capture is not.
                match pool.alloc_raw(0, (i % 7 + 1) * MIB, StreamId(S)) {
                    Ok(p) => pool.free_raw(p, StreamId(S)).map_err(|e| e.to_string())?,
                    Err(e) if e.is_oom() => {}
                    Err(e) => return Err(format!("iteration {i}: {e}")),
                }
                sim.end_capture(0, StreamId(S))
                    .map_err(|e| format!("iteration {i}: {e}"))?;
                pool.end_allocate_to_pool(0, GRAPH)
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        })();
        stop.store(true, Relaxed);
        outcome
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
    assert!(sim.capture_violations().is_empty());
    sim.complete_all(0);
    // Each window was one use of the pool (one graph each, in PyTorch's terms).
    for _ in 0..200 {
        pool.release_pool(0, GRAPH).unwrap();
    }
    check(&pool);
    assert_no_leak(&sim, pool);
}

/// The statistics' cumulative counts ("allocated", "freed") never go down, also when arenas go
/// away for good: a released graph pool's arenas are reaped, a gone stream's too.
#[test]
fn cumulative_counts_survive_arenas_that_go_away() {
    let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), true, "");
    pool.begin_allocate_to_pool(0, GRAPH, only(S)).unwrap();
    let a = alloc(&pool, 3 * MIB, S);
    free(&pool, a, S);
    pool.end_allocate_to_pool(0, GRAPH).unwrap();
    let b = alloc(&pool, MIB, 5);
    free(&pool, b, 5);
    let before = pool.stats(0).unwrap();
    pool.release_pool(0, GRAPH).unwrap();
    pool.forget_stream(StreamId(5)).unwrap();
    pool.empty_cache(); // reaps both retired arenas
    check(&pool);
    let after = pool.stats(0).unwrap();
    for key in [
        "allocation.all.allocated",
        "allocation.all.freed",
        "allocated_bytes.all.allocated",
        "allocated_bytes.large_pool.freed",
        "requested_bytes.all.allocated",
    ] {
        assert_eq!(after.get(key), before.get(key), "{key}");
    }
    assert_eq!(after.get("allocation.all.allocated"), 2);
    assert_no_leak(&sim, pool);
}

/// Each graph pool's reserved bytes (PyTorch's `reserved_bytes_by_private_pools`): what its
/// arenas hold, by pool half, also once the pool is released until that memory goes back to
/// the driver; then 0, with its peak and cumulative counts kept until the peaks are reset.
#[test]
fn graph_pools_count_their_reserved_bytes() {
    both(|vmm| {
        let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), vmm, "");
        const OTHER: MempoolId = MempoolId(0, 7);
        let key = |id: MempoolId, half: &str, field: &str| {
            format!(
                "reserved_bytes_by_private_pools.{}_{}.{half}.{field}",
                id.0, id.1
            )
        };
        let outside = alloc(&pool, 8 * MIB, T);
        begin(&sim, &pool, GRAPH, S);
        let a = alloc(&pool, 6 * MIB, S);
        let b = alloc(&pool, 4 * KIB, S);
        free(&pool, a, S);
        end(&sim, &pool, GRAPH, S);
        pool.begin_allocate_to_pool(0, OTHER, only(U)).unwrap();
        let c = alloc(&pool, 3 * MIB, U);
        pool.end_allocate_to_pool(0, OTHER).unwrap();
        check(&pool);

        let st = pool.stats(0).unwrap();
        let held = |id| {
            pool_ranges(&pool, id)
                .iter()
                .map(|(lo, hi)| hi - lo)
                .sum::<u64>()
        };
        for id in [GRAPH, OTHER] {
            let all = st.get(&key(id, "all", "current"));
            assert_eq!(all as u64, held(id), "{id}");
            assert!(all > 0);
            assert_eq!(
                all,
                st.get(&key(id, "small_pool", "current"))
                    + st.get(&key(id, "large_pool", "current"))
            );
            assert_eq!(st.get(&key(id, "all", "peak")), all);
            assert_eq!(st.get(&key(id, "all", "allocated")), all);
        }
        assert!(
            st.get(&key(GRAPH, "small_pool", "current")) > 0,
            "the 4 KiB block's page"
        );
        let graph_peak = st.get(&key(GRAPH, "all", "current"));
        assert!(
            st.get("reserved_bytes.all.current")
                >= graph_peak + st.get(&key(OTHER, "all", "current")) + (8 * MIB) as i64
        );

        // Released: still the pool's until its memory goes; then 0, the peak and the counts
        // stay.
        free(&pool, b, S);
        pool.release_pool(0, GRAPH).unwrap();
        check(&pool);
        let st = pool.stats(0).unwrap();
        assert_eq!(st.get(&key(GRAPH, "all", "current")), graph_peak);
        pool.empty_pool_cache(GRAPH);
        check(&pool);
        let st = pool.stats(0).unwrap();
        assert_eq!(st.get(&key(GRAPH, "all", "current")), 0);
        assert_eq!(st.get(&key(GRAPH, "all", "peak")), graph_peak);
        assert_eq!(st.get(&key(GRAPH, "all", "freed")), graph_peak);
        assert!(st.get(&key(OTHER, "all", "current")) > 0);

        // Reset: the released pool is forgotten, the live one's peak is its current value.
        pool.reset_peak_stats(0).unwrap();
        let st = pool.stats(0).unwrap();
        let json = st.to_json();
        assert!(!json.contains("private_pools.1_0."), "{json}");
        assert_eq!(
            st.get(&key(OTHER, "all", "peak")),
            st.get(&key(OTHER, "all", "current"))
        );

        free(&pool, c, U);
        free(&pool, outside, T);
        pool.release_pool(0, OTHER).unwrap();
        pool.empty_cache();
        check(&pool);
        assert_no_leak(&sim, pool);
    });
}

/// PyTorch's `emptyCache(mempool_id)`: a released graph pool's cached memory goes back to the
/// driver, and nothing else's; a pool still in use keeps its memory (its graphs').
#[test]
fn a_released_pools_own_empty_cache_releases_only_its_memory() {
    both(|vmm| {
        let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), vmm, "");
        let t = alloc(&pool, 8 * MIB, T);
        free(&pool, t, T);
        begin(&sim, &pool, GRAPH, S);
        let a = alloc(&pool, 6 * MIB, S);
        let keep = alloc(&pool, 4 * KIB, S);
        free(&pool, a, S);
        end(&sim, &pool, GRAPH, S);
        let reserved = || pool.stats(0).unwrap().get("reserved_bytes.all.current") as u64;
        let before = reserved();

        // In use: the graph's memory stays.
        assert_eq!(pool.empty_pool_cache(GRAPH), 0);
        assert_eq!(reserved(), before);
        check(&pool);

        pool.release_pool(0, GRAPH).unwrap();
        let released = pool.empty_pool_cache(GRAPH);
        assert!(released >= 6 * MIB, "released {released}");
        assert_eq!(reserved(), before - released);
        assert!(reserved() >= 8 * MIB, "stream T's cache was released too");
        check(&pool);
        // The graph's output still lives, and can be freed.
        sim.launch(0, StreamId(S), &[(keep, 4 * KIB)]).unwrap();
        free(&pool, keep, S);
        assert_eq!(pool.empty_pool_cache(MempoolId(9, 9)), 0);
        pool.empty_cache();
        check(&pool);
        assert_no_leak(&sim, pool);
    });
}

/// A pool dropped while graph pools live (a process ending with its graphs) gives everything
/// back, as it does for streams' arenas.
#[test]
fn dropping_the_pool_with_live_graph_pools_leaks_nothing() {
    both(|vmm| {
        let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), vmm, "");
        begin(&sim, &pool, GRAPH, S);
        let a = alloc(&pool, 5 * MIB, S);
        let b = alloc(&pool, 4 * KIB, S);
        free(&pool, a, S);
        end(&sim, &pool, GRAPH, S);
        pool.create_or_incref_pool(0, MempoolId(0, 3)).unwrap();
        free(&pool, b, S);
        drop(pool);
        assert_eq!(sim.committed_bytes(0), 0, "committed bytes after drop");
        assert_eq!(sim.live_handles(0), 0);
        assert_eq!(sim.live_linear_allocations(0), 0);
        assert_eq!(sim.reserved_va_bytes(0), 0);
        assert_eq!(sim.live_events(0), 0);
    });
}

/// PyTorch's `MemPool(use_on_oom=True)`: an allocation outside the pool that runs out of memory
/// takes a free block of the pool on its stream (without growing it), and its free returns the
/// block there; without the setting it fails, and during a window nothing is taken.
#[test]
fn use_on_oom_pools_serve_an_allocation_that_ran_out() {
    for vmm in MODES {
        let (sim, pool) = pool_with(SimConfig::default().capacity(256 * MIB), vmm, "");
        let dev = pool.device(0).unwrap();
        let mp = MempoolId(0, 9);
        dev.create_or_incref_pool(mp);
        // 64 MiB allocated into the pool on stream S, then freed: cached, the pool's own.
        // (`torch.cuda.use_mem_pool`: a window, ended and released at the block's end.)
        dev.begin_allocate_to_pool(mp, only(S));
        let cached = alloc(&pool, 64 * MIB, S);
        dev.end_allocate_to_pool(mp).unwrap();
        dev.release_pool(mp).unwrap();
        free(&pool, cached, S);
        let ranges = pool_ranges(&pool, mp);
        // Fill the rest of the device outside the pool.
        let mut hog = Vec::new();
        while let Ok(p) = pool.alloc_raw(0, 16 * MIB, StreamId(S)) {
            hog.push(p);
        }
        assert!(pool
            .alloc_raw(0, 48 * MIB, StreamId(S))
            .unwrap_err()
            .is_oom());
        let e = dev
            .set_use_on_oom(MempoolId(0, 10), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no graph pool (0, 10)"), "{e}");
        dev.set_use_on_oom(mp, true).unwrap();
        // Another stream has no free block in the pool.
        assert!(
            pool.alloc_raw(0, 48 * MIB, StreamId(T))
                .unwrap_err()
                .is_oom(),
            "vmm:{vmm}"
        );
        let p = pool.alloc_raw(0, 48 * MIB, StreamId(S)).unwrap();
        check(&pool);
        assert!(
            ranges.iter().any(|&(lo, hi)| lo <= p && p + 48 * MIB <= hi),
            "vmm:{vmm}: {p:#x} is not the pool's"
        );
        free(&pool, p, S);
        // Back in the pool: served again from it, and not while a window is open.
        dev.begin_allocate_to_pool(MempoolId(0, 11), only(U));
        assert!(pool
            .alloc_raw(0, 48 * MIB, StreamId(S))
            .unwrap_err()
            .is_oom());
        dev.end_allocate_to_pool(MempoolId(0, 11)).unwrap();
        dev.release_pool(MempoolId(0, 11)).unwrap();
        let q = pool.alloc_raw(0, 48 * MIB, StreamId(S)).unwrap();
        assert!(ranges.iter().any(|&(lo, hi)| lo <= q && q < hi));
        free(&pool, q, S);
        // Turned off: out of memory again.
        dev.set_use_on_oom(mp, false).unwrap();
        assert!(pool
            .alloc_raw(0, 48 * MIB, StreamId(S))
            .unwrap_err()
            .is_oom());
        for h in hog {
            free(&pool, h, S);
        }
        dev.release_pool(mp).unwrap();
        check(&pool);
        assert_no_leak(&sim, pool);
    }
}

/// CUDA graph trees' checkpoints (Note [Checkpoints]): after a second recording freed `b` and
/// allocated `c` over its range, restoring the checkpoint taken after the first frees `a` and
/// `c` and makes `a` and `b` live again at their addresses, with the statistics of then, no
/// driver call, and the same answer twice; the restored blocks free as any other.
#[test]
fn a_checkpoint_puts_a_graph_pools_blocks_back() {
    both(|vmm| {
        let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), vmm, "");
        begin(&sim, &pool, GRAPH, S);
        let a = alloc(&pool, 4 * MIB, S);
        let b = alloc(&pool, 8 * MIB, S);
        end(&sim, &pool, GRAPH, S);
        let cp = pool.checkpoint_pool(0, GRAPH).unwrap();
        assert_eq!(
            cp.blocks.iter().map(|x| x.ptr).collect::<Vec<_>>(),
            vec![a, b]
        );
        let allocated = stat(&pool, "allocated_bytes.all.current");
        let requested = stat(&pool, "requested_bytes.all.current");

        free(&pool, b, S);
        begin(&sim, &pool, GRAPH, S);
        let c = alloc(&pool, 6 * MIB, S);
        end(&sim, &pool, GRAPH, S);
        assert_eq!(c, b, "the second recording did not reuse b's range");
        let mut live = vec![a, c];
        live.sort_unstable();
        assert_eq!(pool.pool_live_blocks(0, GRAPH).unwrap(), live);

        let calls = sim.total_calls();
        let d = pool.restore_pool(0, &cp).unwrap();
        check(&pool);
        assert_eq!(sim.total_calls(), calls, "a restore made driver calls");
        assert_eq!(d.freed, live);
        assert_eq!(d.allocated, cp.blocks);
        assert_eq!(pool.pool_live_blocks(0, GRAPH).unwrap(), vec![a, b]);
        assert_eq!(stat(&pool, "allocated_bytes.all.current"), allocated);
        assert_eq!(stat(&pool, "requested_bytes.all.current"), requested);
        // Again: the same blocks are freed and made live.
        let again = pool.restore_pool(0, &cp).unwrap();
        assert_eq!(again.freed, vec![a, b]);
        assert_eq!(pool.pool_live_blocks(0, GRAPH).unwrap(), vec![a, b]);
        check(&pool);

        free(&pool, a, S);
        free(&pool, b, S);
        pool.release_pool(0, GRAPH).unwrap();
        pool.release_pool(0, GRAPH).unwrap();
        assert_no_leak(&sim, pool);
    });
}

/// A checkpoint of an empty pool frees everything; blocks another stream still used
/// (`record_stream`) are waited for, so their ranges can be restored.
#[test]
fn restoring_waits_for_blocks_other_streams_used() {
    let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), true, "");
    pool.create_or_incref_pool(0, GRAPH).unwrap();
    let empty = pool.checkpoint_pool(0, GRAPH).unwrap();
    assert!(empty.blocks.is_empty());
    begin(&sim, &pool, GRAPH, S);
    let a = alloc(&pool, 4 * MIB, S);
    end(&sim, &pool, GRAPH, S);
    let cp = pool.checkpoint_pool(0, GRAPH).unwrap();
    pool.record_stream(a, StreamId(T)).unwrap();
    sim.launch(0, StreamId(T), &[(a, 4 * MIB)]).unwrap();
    let d = pool.restore_pool(0, &empty).unwrap();
    assert_eq!(d.freed, vec![a]);
    assert!(pool.pool_live_blocks(0, GRAPH).unwrap().is_empty());
    let d = pool.restore_pool(0, &cp).unwrap();
    assert!(d.freed.is_empty());
    assert_eq!(pool.pool_live_blocks(0, GRAPH).unwrap(), vec![a]);
    check(&pool);
    free(&pool, a, S);
    pool.release_pool(0, GRAPH).unwrap();
    pool.release_pool(0, GRAPH).unwrap();
    assert_no_leak(&sim, pool);
}

/// Checkpoints of pools that are gone, of other pools, and restores during a capture are
/// clear errors that change nothing.
#[test]
fn checkpoint_misuse_is_a_clear_error() {
    let (sim, pool) = pool_with(SimConfig::default().capacity(GIB), true, "");
    let other = MempoolId(2, 0);
    let e = pool.checkpoint_pool(0, GRAPH).unwrap_err().to_string();
    assert!(e.contains("no graph pool (1, 0)"), "{e}");
    begin(&sim, &pool, GRAPH, S);
    let a = alloc(&pool, 4 * MIB, S);
    end(&sim, &pool, GRAPH, S);
    begin(&sim, &pool, other, T);
    let b = alloc(&pool, 4 * MIB, T);
    let cp_other = pool.checkpoint_pool(0, other).unwrap();
    let cp = pool.checkpoint_pool(0, GRAPH).unwrap();
    let e = pool.restore_pool(0, &cp).unwrap_err().to_string();
    assert!(e.contains("after end_allocate_to_pool"), "{e}");
    end(&sim, &pool, other, T);
    // `other`'s checkpoint named as GRAPH's: its stream has no memory in GRAPH.
    let forged = cistern::PoolCheckpoint {
        id: GRAPH,
        blocks: cp_other.blocks.clone(),
    };
    let e = pool.restore_pool(0, &forged).unwrap_err().to_string();
    assert!(e.contains("not this pool's"), "{e}");
    // A block beyond the pool's memory: refused before anything is freed.
    let mut far = cp.clone();
    far.blocks[0].ptr += 512 * MIB;
    let e = pool.restore_pool(0, &far).unwrap_err().to_string();
    assert!(e.contains("has no memory of"), "{e}");
    assert_eq!(pool.pool_live_blocks(0, GRAPH).unwrap(), vec![a]);
    assert_eq!(pool.pool_live_blocks(0, other).unwrap(), vec![b]);
    check(&pool);
    free(&pool, a, S);
    free(&pool, b, T);
    pool.release_pool(0, GRAPH).unwrap();
    pool.release_pool(0, other).unwrap();
    let e = pool.restore_pool(0, &cp).unwrap_err().to_string();
    assert!(e.contains("no graph pool"), "{e}");
    assert_no_leak(&sim, pool);
}

/// A restored block keeps its provenance: the ledger counts it under its tag again, and the
/// block a restore freed leaves it.
#[test]
fn restored_blocks_keep_their_tags() {
    let (sim, pool) = pool_with(
        SimConfig::default().capacity(GIB),
        true,
        "provenance:stacks,stack_sample_rate:1",
    );
    let tagged = |name: &str| -> u64 {
        pool.device(0)
            .unwrap()
            .ledger()
            .iter()
            .filter(|e| e.tag == name)
            .map(|e| e.live_bytes)
            .sum()
    };
    begin(&sim, &pool, GRAPH, S);
    let a = cistern::with_tag("graph-a", || alloc(&pool, 4 * MIB, S));
    end(&sim, &pool, GRAPH, S);
    let cp = pool.checkpoint_pool(0, GRAPH).unwrap();
    free(&pool, a, S);
    begin(&sim, &pool, GRAPH, S);
    let b = cistern::with_tag("graph-b", || alloc(&pool, 4 * MIB, S));
    end(&sim, &pool, GRAPH, S);
    assert_eq!((tagged("graph-a"), tagged("graph-b")), (0, 4 * MIB));
    pool.restore_pool(0, &cp).unwrap();
    assert_eq!((tagged("graph-a"), tagged("graph-b")), (4 * MIB, 0));
    check(&pool);
    free(&pool, a, S);
    assert_eq!(tagged("graph-a"), 0);
    let _ = b;
    pool.release_pool(0, GRAPH).unwrap();
    pool.release_pool(0, GRAPH).unwrap();
    assert_no_leak(&sim, pool);
}
