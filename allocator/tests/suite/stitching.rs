//! Page stitching: a large request is served from free pages scattered through the pool
//! (holes between live blocks, other streams' caches) instead of new driver memory, and pages
//! leave another stream only after that stream's work on them has finished.

use crate::common::*;
use cistern::driver::DriverCall;
use cistern::StreamId;

pub(crate) const A: u64 = 1;
pub(crate) const B: u64 = 2;

/// 40 × (20 MiB + 2 MiB) on stream A, then every other 20 MiB block freed: 400 MiB of free
/// pages in 20 MiB holes, none of them contiguous with another. Returns the live blocks.
pub(crate) fn swiss_cheese(pool: &SimPool) -> Vec<u64> {
    let mut big = Vec::new();
    let mut keep = Vec::new();
    for _ in 0..40 {
        big.push(alloc(pool, 20 * MIB, A));
        keep.push(alloc(pool, 2 * MIB, A));
    }
    for (i, p) in big.into_iter().enumerate() {
        if i % 2 == 0 {
            free(pool, p, A);
        } else {
            keep.push(p);
        }
    }
    assert_disjoint(pool);
    keep
}

#[test]
fn stitching_avoids_new_driver_memory() {
    let (sim, pool) = pool(GIB, true);
    let keep = swiss_cheese(&pool);
    let largest = pool.report().devices[0].largest_free;
    assert!(
        largest < 300 * MIB,
        "a 300 MiB range was free already ({largest} B)"
    );
    let created = sim.calls(DriverCall::CreatePhysical);
    let committed = sim.committed_bytes(0);
    assert_eq!(committed, 880 * MIB);
    let p = alloc(&pool, 300 * MIB, A);
    assert_eq!(
        sim.calls(DriverCall::CreatePhysical),
        created,
        "new pages were created"
    );
    assert_eq!(sim.committed_bytes(0), committed);
    assert!(
        stat(&pool, "num_stitched_pages") >= 150,
        "{}",
        stat(&pool, "num_stitched_pages")
    );
    assert!(stat(&pool, "num_stitches") >= 1);
    // The stitched range is one usable block.
    sim.launch(0, StreamId(A), &[(p, 300 * MIB)]).unwrap();
    sim.complete_all(0);
    assert_disjoint(&pool);
    free(&pool, p, A);
    for k in keep {
        free(&pool, k, A);
    }
    assert!(sim.hazards().is_empty());
    assert_no_leak(&sim, pool);
}

/// Without VMM the same workload must go back to the driver (free segments, allocate a new
/// one) or fail.
#[test]
fn segments_need_the_driver_for_the_same_workload() {
    let (sim, pool) = pool(GIB, false);
    let keep = swiss_cheese(&pool);
    let allocs = sim.calls(DriverCall::MemAlloc);
    match pool.alloc_raw(0, 300 * MIB, StreamId(A)) {
        Ok(p) => {
            check(&pool);
            assert!(sim.calls(DriverCall::MemAlloc) > allocs, "no new segment");
            assert!(
                sim.calls(DriverCall::MemFree) > 0,
                "no segment was given back first"
            );
            free(&pool, p, A);
        }
        Err(e) => assert!(e.is_oom(), "{e}"),
    }
    assert_eq!(stat(&pool, "num_stitched_pages"), 0);
    for k in keep {
        free(&pool, k, A);
    }
    assert_no_leak(&sim, pool);
}

/// Stitched pages keep their data with them: a page cached on A and mapped into B's range
/// holds what was written through A's address (the simulator's host backing follows the
/// physical page).
#[test]
fn stitched_pages_carry_their_contents() {
    let (sim, pool) = pool_with(
        cistern::SimConfig::default()
            .capacity(256 * MIB)
            .backing(true),
        true,
        "",
    );
    let x = alloc(&pool, 200 * MIB, A);
    for off in (0..200 * MIB).step_by(PAGE as usize) {
        sim.write(0, x + off, &[0x5A]).unwrap();
    }
    free(&pool, x, A);
    let y = alloc(&pool, 200 * MIB, B);
    assert!(stat(&pool, "num_cross_stream_pages") >= 100);
    let marked = (0..200 * MIB)
        .step_by(PAGE as usize)
        .filter(|off| sim.read(0, y + off, 1).unwrap() == [0x5A])
        .count();
    assert!(marked == 100, "only {marked} of B's pages came from A");
    free(&pool, y, B);
    assert_no_leak(&sim, pool);
}

/// Large growth buys chunks of up to `chunk_size` (20 MiB), at most a quarter of the request,
/// and grants access once per mapped run: a fresh 200 MiB block costs 10 creations instead of
/// 100, and one `cuMemSetAccess`. (Memory first: `grow_whole_chunks:off`, which the default
/// `auto` becomes as memory runs short; see the `auto_*` tests.)
#[test]
fn large_growth_buys_chunks() {
    let (sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "grow_whole_chunks:off",
    );
    let p = alloc(&pool, 200 * MIB, A);
    check(&pool);
    assert_eq!(sim.calls(DriverCall::CreatePhysical), 10);
    assert_eq!(sim.calls(DriverCall::Map), 10);
    assert_eq!(sim.calls(DriverCall::SetAccess), 1);
    assert_eq!(sim.committed_bytes(0), 200 * MIB);
    // A small request of the large heap is still backed exactly: 6 MiB is 3 pages, and a
    // quarter of that rounds down to single granules: 3 handles.
    let q = alloc(&pool, 6 * MIB, A);
    assert_eq!(sim.committed_bytes(0), 206 * MIB);
    assert_eq!(sim.calls(DriverCall::CreatePhysical), 13);
    free(&pool, p, A);
    free(&pool, q, A);
    assert_no_leak(&sim, pool);
}

/// `chunk_split:none` backs each run with handles of `chunk_size` whatever the request: the
/// 5 MiB request (three pages) that takes three single-granule handles by default takes one
/// 6 MiB handle, and a 200 MiB block still takes ten of 20 MiB; `chunk_split:1` bounds a
/// handle by the request's whole pages (two), so 5 MiB takes two. (All with memory first,
/// `grow_whole_chunks:off`: `auto` would back the 5 MiB request with one whole 6 MiB chunk on
/// this roomy device.)
#[test]
fn chunk_split_sets_the_fewest_handles_a_request_is_backed_with() {
    for (conf, small, large) in [
        ("grow_whole_chunks:off,chunk_split:none", 1, 10),
        ("grow_whole_chunks:off,chunk_split:1", 2, 10),
        ("grow_whole_chunks:off,chunk_split:4", 3, 10),
    ] {
        let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(GIB), true, conf);
        let q = alloc(&pool, 5 * MIB, A);
        assert_eq!(sim.calls(DriverCall::CreatePhysical), small, "{conf}");
        assert_eq!(sim.committed_bytes(0), 6 * MIB, "{conf}");
        let p = alloc(&pool, 200 * MIB, A);
        check(&pool);
        assert_eq!(
            sim.calls(DriverCall::CreatePhysical),
            small + large,
            "{conf}"
        );
        free(&pool, p, A);
        free(&pool, q, A);
        assert_no_leak(&sim, pool);
    }
}

/// `grow_whole_chunks:auto` (the default) while memory is plentiful: a process holding
/// 204 MiB of a 4 GiB device (a multiple of the 6 MiB whole chunks its first growth rounds
/// to) backs a 3 MiB request with one whole 20 MiB chunk (a chunk is at most an eighth of
/// what it holds: 24 MiB), and the next requests are served from its rest with no driver
/// call.
#[test]
fn auto_buys_whole_chunks_while_memory_is_plentiful() {
    let (sim, pool) = pool(4 * GIB, true);
    let held = alloc(&pool, 204 * MIB, A);
    assert_eq!(sim.committed_bytes(0), 204 * MIB);
    let creates = sim.calls(DriverCall::CreatePhysical);
    let first = alloc(&pool, 3 * MIB, A);
    check(&pool);
    assert_eq!(sim.calls(DriverCall::CreatePhysical), creates + 1);
    assert_eq!(sim.committed_bytes(0), 224 * MIB);
    let calls = sim.total_calls();
    let rest: Vec<u64> = (0..5).map(|_| alloc(&pool, 3 * MIB, A)).collect();
    check(&pool);
    assert_eq!(sim.total_calls(), calls, "served from the chunk's rest");
    for p in rest.into_iter().chain([first, held]) {
        free(&pool, p, A);
    }
    assert_no_leak(&sim, pool);
}

/// `auto` is memory first once the process would hold more than a quarter of what the device
/// (or the limit) allows it: holding 300 MiB of a 1 GiB device, a 6 MiB request is backed
/// exactly, with handles of a quarter of it (three granules), as with `off`; under a 1 GiB
/// limit on a larger device, the same.
#[test]
fn auto_is_memory_first_past_a_quarter() {
    for (cap, conf) in [(GIB, ""), (8 * GIB, "memory_limit:1GiB")] {
        let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(cap), true, conf);
        let held = alloc(&pool, 300 * MIB, A);
        let creates = sim.calls(DriverCall::CreatePhysical);
        let q = alloc(&pool, 6 * MIB, A);
        check(&pool);
        assert_eq!(sim.committed_bytes(0), 306 * MIB, "{conf}");
        assert_eq!(sim.calls(DriverCall::CreatePhysical), creates + 3, "{conf}");
        free(&pool, q, A);
        free(&pool, held, A);
        assert_no_leak(&sim, pool);
    }
}

/// `auto` sizes whole chunks to the process: holding 96 MiB, chunks are at most an eighth of
/// that (12 MiB: six granules), so a 3 MiB request maps 12 MiB, not a 20 MiB handle that
/// would be a fifth of everything it holds.
#[test]
fn auto_chunks_scale_with_what_the_process_holds() {
    let (sim, pool) = pool(4 * GIB, true);
    let held = alloc(&pool, 96 * MIB, A);
    assert_eq!(
        sim.committed_bytes(0),
        96 * MIB,
        "a multiple of 6 MiB: no rounding"
    );
    let creates = sim.calls(DriverCall::CreatePhysical);
    let q = alloc(&pool, 3 * MIB, A);
    check(&pool);
    assert_eq!(sim.committed_bytes(0), 108 * MIB);
    assert_eq!(sim.calls(DriverCall::CreatePhysical), creates + 1);
    free(&pool, q, A);
    free(&pool, held, A);
    assert_no_leak(&sim, pool);
}

/// ... but not below 6 MiB or a 64th of what the device allows, whichever is less: a process
/// holding nothing backs a 3 MiB request with one 6 MiB chunk on a 4 GiB device (not two
/// granules, then more one at a time), 4 MiB in one handle on a 256 MiB device (a 64th of
/// it) and the request's two granules one at a time on a 64 MiB one, as before; a 64 MiB
/// `memory_limit` on the 4 GiB device counts as the 64 MiB device does.
#[test]
fn auto_chunks_start_at_six_mib_on_a_roomy_device() {
    for (cap, conf, committed, creates) in [
        (4 * GIB, "", 6 * MIB, 1),
        (256 * MIB, "", 4 * MIB, 1),
        (64 * MIB, "", 4 * MIB, 2),
        (4 * GIB, "memory_limit:64MiB", 4 * MIB, 2),
    ] {
        let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(cap), true, conf);
        let q = alloc(&pool, 3 * MIB, A);
        check(&pool);
        assert_eq!(sim.committed_bytes(0), committed, "{cap} {conf}");
        assert_eq!(
            sim.calls(DriverCall::CreatePhysical),
            creates,
            "{cap} {conf}"
        );
        let calls = sim.total_calls();
        if committed == 6 * MIB {
            let r = alloc(&pool, 3 * MIB, A);
            assert_eq!(sim.total_calls(), calls, "served from the chunk's rest");
            free(&pool, r, A);
        }
        free(&pool, q, A);
        assert_no_leak(&sim, pool);
    }
}

/// `auto` while memory is plentiful backs a large request with handles of up to 1/32 of what
/// the process holds: holding 3 GiB of a 16 GiB device, a 400 MiB block takes handles of
/// 96 MiB (48 granules; a quarter of the request would allow 100 MiB): 5 creations, where
/// memory first (`off`) takes twenty of 20 MiB.
#[test]
fn auto_backs_large_requests_with_larger_handles_while_memory_is_plentiful() {
    for (conf, handles) in [("", 5), ("grow_whole_chunks:off", 20)] {
        let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(16 * GIB), true, conf);
        let held = alloc(&pool, 3 * GIB, A);
        let creates = sim.calls(DriverCall::CreatePhysical);
        let p = alloc(&pool, 400 * MIB, A);
        check(&pool);
        assert_eq!(
            sim.calls(DriverCall::CreatePhysical),
            creates + handles,
            "{conf}"
        );
        assert_eq!(sim.committed_bytes(0), 3 * GIB + 400 * MIB, "{conf}");
        free(&pool, p, A);
        free(&pool, held, A);
        assert_no_leak(&sim, pool);
    }
}

/// While memory is plentiful, `chunk_split` yields to the whole chunks' cap of an eighth of
/// what the process holds: holding 3 GiB of a 16 GiB device, a 60 MiB request over a released
/// 20 MiB hole and the 40 MiB of cached pages after it (so not grown as whole chunks) backs
/// the hole with one handle, where memory first (`off`) takes two (a quarter of the request,
/// 7 granules, and the rest). (A small process still splits: `sizing::tests`.)
#[test]
fn auto_lets_a_request_handle_reach_an_eighth_of_what_the_process_holds() {
    for (conf, handles) in [("", 1), ("grow_whole_chunks:off", 2)] {
        let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(16 * GIB), true, conf);
        let held = alloc(&pool, 3 * GIB, A);
        let hole = alloc(&pool, 20 * MIB, A);
        let cached = alloc(&pool, 40 * MIB, A);
        let after = alloc(&pool, 20 * MIB, A);
        free(&pool, hole, A);
        pool.empty_cache();
        free(&pool, cached, A);
        let creates = sim.calls(DriverCall::CreatePhysical);
        let p = alloc(&pool, 60 * MIB, A);
        check(&pool);
        assert_eq!(p, hole, "{conf}: the request did not go into the hole");
        assert_eq!(
            sim.calls(DriverCall::CreatePhysical),
            creates + handles,
            "{conf}"
        );
        for q in [p, after, held] {
            free(&pool, q, A);
        }
        assert_no_leak(&sim, pool);
    }
}

/// `grow_whole_chunks:on`: a 3 MiB request that ends in unmapped space maps one whole 20 MiB
/// chunk, and the next requests are served from its cached rest with no driver call.
#[test]
fn whole_chunks_serve_the_requests_that_follow() {
    let (sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "grow_whole_chunks:on",
    );
    let first = alloc(&pool, 3 * MIB, A);
    check(&pool);
    assert_eq!(sim.calls(DriverCall::CreatePhysical), 1);
    assert_eq!(sim.committed_bytes(0), 20 * MIB);
    let calls = sim.total_calls();
    let rest: Vec<u64> = (0..5).map(|_| alloc(&pool, 3 * MIB, A)).collect();
    check(&pool);
    assert_eq!(
        sim.total_calls(),
        calls,
        "served from the chunk's cached rest"
    );
    for p in rest.into_iter().chain([first]) {
        free(&pool, p, A);
    }
    assert_no_leak(&sim, pool);
}

/// The pages beyond a request are taken only while there is room for them and one chunk
/// more, and never fail it: under a 64 MiB limit a 3 MiB request maps a whole 20 MiB chunk;
/// under 24 MiB it maps its own 4 MiB only; when the device has less free memory than it
/// seemed, the request's own pages are mapped without them.
#[test]
fn whole_chunks_give_way_to_the_limit_and_the_device() {
    for (limit, committed) in [(64, 20 * MIB), (24, 4 * MIB)] {
        let (sim, pool) = pool_with(
            cistern::SimConfig::default().capacity(GIB),
            true,
            &format!("grow_whole_chunks:on,memory_limit:{limit}MiB"),
        );
        let p = alloc(&pool, 3 * MIB, A);
        check(&pool);
        assert_eq!(sim.committed_bytes(0), committed, "limit {limit} MiB");
        free(&pool, p, A);
        assert_no_leak(&sim, pool);
    }

    let (sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "grow_whole_chunks:on",
    );
    // The device refuses anything past 4 MiB: the 20 MiB chunk fails, the 2 pages of the
    // request do not.
    sim.fail_after_bytes(4 * MIB);
    let p = alloc(&pool, 3 * MIB, A);
    check(&pool);
    assert_eq!(sim.committed_bytes(0), 4 * MIB);
    sim.clear_faults();
    free(&pool, p, A);
    assert_no_leak(&sim, pool);
}

/// Found in review: pages beyond a request must never take the last of the room. Under a
/// 20 MiB limit a 3 MiB request maps no 20 MiB chunk, so a small request of its stream and a
/// large one of another stream still fit, as they do with the setting off.
#[test]
fn whole_chunks_leave_room_under_a_limit() {
    for on in ["off", "on"] {
        let conf = format!("grow_whole_chunks:{on},memory_limit:20MiB");
        let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(GIB), true, &conf);
        let p = alloc(&pool, 3 * MIB, A);
        let q = alloc(&pool, 512 * KIB, A);
        let r = alloc(&pool, 3 * MIB, B);
        check(&pool);
        free(&pool, q, A);
        free(&pool, r, B);
        free(&pool, p, A);
        assert_no_leak(&sim, pool);
    }
}

/// Found in review: the extension makes the last run's *open* pages whole chunks, so no chunk
/// lies wholly beyond the request, to be created and, with `release_threshold:0`, released
/// again on every allocation.
#[test]
fn whole_chunks_cause_no_churn() {
    let (sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "grow_whole_chunks:on,release_threshold:0",
    );
    for i in 0..4 {
        // A freed small-heap page, stitched into the next window as its first page.
        let s = alloc(&pool, 512 * KIB, A);
        free(&pool, s, A);
        let (c0, r0) = (
            sim.calls(DriverCall::CreatePhysical),
            sim.calls(DriverCall::ReleasePhysical),
        );
        let p = alloc(&pool, 22 * MIB, A);
        check(&pool);
        // One 20 MiB chunk for the ten open pages, none beyond the request.
        assert_eq!(
            sim.calls(DriverCall::CreatePhysical) - c0,
            1,
            "iteration {i}"
        );
        assert_eq!(sim.committed_bytes(0), 22 * MIB, "iteration {i}");
        assert_eq!(sim.calls(DriverCall::ReleasePhysical), r0, "iteration {i}");
        free(&pool, p, A);
    }
    assert_no_leak(&sim, pool);
}

/// Found in review: a request whose size is a whole number of chunks is backed with whole
/// chunks too (the last run is in whole-chunk mode whether or not it grows).
#[test]
fn whole_chunks_back_exact_multiples_with_whole_chunks() {
    for (mib, handles) in [(18u64, 1u64), (20, 1), (22, 2), (40, 2), (42, 3)] {
        let (sim, pool) = pool_with(
            cistern::SimConfig::default().capacity(GIB),
            true,
            "grow_whole_chunks:on",
        );
        let p = alloc(&pool, mib * MIB, A);
        assert_eq!(sim.calls(DriverCall::CreatePhysical), handles, "{mib} MiB");
        free(&pool, p, A);
        assert_no_leak(&sim, pool);
    }
}

/// Found in review: when creation stops in an earlier run of the window (the device refuses a
/// page) and stitching a busy stream's cached chunks then covers the request, the pages beyond
/// it must not make the request fail: it succeeds as it does with the setting off.
#[test]
fn whole_chunks_never_make_a_stitched_request_fail() {
    for on in ["off", "on"] {
        let (sim, pool) = pool_with(
            cistern::SimConfig::default().capacity(GIB),
            true,
            &format!("grow_whole_chunks:{on},chunk_size:8MiB"),
        );
        let d = pool.device(0).unwrap();
        let frac = |mib: u64| d.set_memory_fraction(mib as f64 / 1024.0).unwrap();
        frac(2);
        let p1 = alloc(&pool, 2 * MIB, A);
        frac(4);
        let p2 = alloc(&pool, 2 * MIB, A);
        let mut bs = Vec::new();
        for i in 0..5 {
            frac(6 + 2 * i);
            bs.push(alloc(&pool, 2 * MIB, B));
        }
        for i in [0, 2, 4] {
            free(&pool, bs[i], B);
        }
        pool.empty_cache();
        sim.launch(0, StreamId(A), &[(p1, 2 * MIB), (p2, 2 * MIB)])
            .unwrap();
        free(&pool, p1, A);
        free(&pool, p2, A);
        for i in [1, 3] {
            free(&pool, bs[i], B);
        }
        frac(1024);
        sim.fail_after_bytes(sim.committed_bytes(0) + 2 * MIB);
        let r = pool.alloc_raw(0, 10 * MIB, StreamId(B));
        check(&pool);
        assert!(r.is_ok(), "grow_whole_chunks:{on}: {:?}", r.err());
        sim.clear_faults();
        sim.complete_all(0);
        free(&pool, r.unwrap(), B);
        assert_no_leak(&sim, pool);
    }
}

/// With `chunk_size:2MiB` (and `grow_whole_chunks:off`, whose `auto` may buy larger handles
/// for large requests while memory is plentiful) every granule is its own handle, as before
/// chunks.
#[test]
fn chunk_size_of_one_granule_gives_page_handles() {
    let (sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "chunk_size:2MiB,grow_whole_chunks:off",
    );
    let p = alloc(&pool, 200 * MIB, A);
    assert_eq!(sim.calls(DriverCall::CreatePhysical), 100);
    assert_eq!(sim.calls(DriverCall::SetAccess), 1);
    free(&pool, p, A);
    assert_no_leak(&sim, pool);
}

/// A chunk moves between streams whole: B's 120 MiB block takes A's six cached 20 MiB chunks
/// (six unmaps, no creation), and `empty_cache` gives whole chunks back.
#[test]
fn chunks_move_and_are_released_whole() {
    let (sim, pool) = pool(GIB, true);
    let a = alloc(&pool, 120 * MIB, A);
    free(&pool, a, A);
    let created = sim.calls(DriverCall::CreatePhysical);
    assert_eq!(created, 6);
    let b = alloc(&pool, 120 * MIB, B);
    check(&pool);
    assert_eq!(sim.calls(DriverCall::CreatePhysical), created);
    assert_eq!(sim.calls(DriverCall::Unmap), 6);
    assert_eq!(stat(&pool, "num_cross_stream_pages"), 60);
    free(&pool, b, B);
    pool.empty_cache();
    check(&pool);
    assert_eq!(sim.committed_bytes(0), 0);
    assert_eq!(sim.calls(DriverCall::ReleasePhysical), 6);
    assert_no_leak(&sim, pool);
}

/// Many small cached chunks: eighty 1 MiB blocks on stream A, in the small heap's
/// single-granule chunks, freed. Returns the pool and simulator.
fn small_chunks_cached(cap: u64) -> (std::sync::Arc<cistern::SimDriver>, SimPool) {
    small_chunks_cached_with(cap, "")
}

fn small_chunks_cached_with(cap: u64, conf: &str) -> (std::sync::Arc<cistern::SimDriver>, SimPool) {
    let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(cap), true, conf);
    let blocks: Vec<u64> = (0..80).map(|_| alloc(&pool, MIB, A)).collect();
    for p in blocks {
        free(&pool, p, A);
    }
    check(&pool);
    (sim, pool)
}

/// While memory is plentiful, a large request on another stream is backed by a few new
/// handles rather than by moving dozens of single-granule chunks (each move costs a quarter
/// of a creation: Note [Cheaper than moving]); the cached chunks stay, and serve stream A
/// again without a driver call.
#[test]
fn plentiful_memory_creates_rather_than_moving_many_small_chunks() {
    let (sim, pool) = small_chunks_cached(16 * GIB);
    let (unmaps, creates) = (
        sim.calls(DriverCall::Unmap),
        sim.calls(DriverCall::CreatePhysical),
    );
    let big = alloc(&pool, 60 * MIB, B);
    check(&pool);
    assert_eq!(
        sim.calls(DriverCall::Unmap),
        unmaps,
        "cached chunks were moved"
    );
    let made = sim.calls(DriverCall::CreatePhysical) - creates;
    assert!((1..=10).contains(&made), "{made} handles for 60 MiB");
    assert_eq!(stat(&pool, "num_stitches"), 0);
    let calls = sim.total_calls();
    let again = alloc(&pool, MIB, A);
    assert_eq!(sim.total_calls(), calls, "stream A's cache was kept");
    free(&pool, again, A);
    free(&pool, big, B);
    assert_no_leak(&sim, pool);
}

/// New handles replace moves while the process holds up to a third of what it may, not only a
/// quarter: on a 480 MiB device, holding 80 MiB of cached chunks, a 60 MiB request (then 140
/// MiB of 480) still creates rather than moving them.
#[test]
fn up_to_a_third_of_the_device_creates_rather_than_moving() {
    let (sim, pool) = small_chunks_cached(480 * MIB);
    let unmaps = sim.calls(DriverCall::Unmap);
    let big = alloc(&pool, 60 * MIB, B);
    check(&pool);
    assert_eq!(
        sim.calls(DriverCall::Unmap),
        unmaps,
        "cached chunks were moved"
    );
    assert_eq!(stat(&pool, "num_stitches"), 0);
    free(&pool, big, B);
    assert_no_leak(&sim, pool);
}

/// Without room to spare the same request stitches the cached chunks: memory first. On a 400
/// MiB device the process would then hold 140 MiB, past a third of it.
#[test]
fn tight_memory_still_stitches_small_chunks() {
    for device in [256 * MIB, 400 * MIB] {
        let (sim, pool) = small_chunks_cached(device);
        stitches_60_mib(sim, pool);
    }
}

/// A 60 MiB request on stream B moves cached chunks (from `small_chunks_cached`).
fn stitches_60_mib(sim: std::sync::Arc<cistern::SimDriver>, pool: SimPool) {
    let unmaps = sim.calls(DriverCall::Unmap);
    let big = alloc(&pool, 60 * MIB, B);
    check(&pool);
    assert!(
        sim.calls(DriverCall::Unmap) > unmaps,
        "nothing was stitched"
    );
    assert!(stat(&pool, "num_stitches") >= 1);
    free(&pool, big, B);
    assert_no_leak(&sim, pool);
}

/// The choice reads the device's free memory afresh: after another process took all but
/// 30 MiB since the pool last looked, the same request stitches the cached chunks instead of
/// creating, and leaves the device's last 30 MiB to others.
#[test]
fn another_processs_memory_makes_growth_stitch_again() {
    let (sim, pool) = small_chunks_cached(16 * GIB);
    let held = sim.committed_bytes(0);
    sim.set_other_process_bytes(16 * GIB - held - 30 * MIB);
    let creates = sim.calls(DriverCall::CreatePhysical);
    let big = alloc(&pool, 60 * MIB, B);
    check(&pool);
    assert_eq!(
        sim.calls(DriverCall::CreatePhysical),
        creates,
        "it created handles"
    );
    assert_eq!(sim.committed_bytes(0), held, "the device's room was used");
    free(&pool, big, B);
    sim.set_other_process_bytes(0);
    assert_no_leak(&sim, pool);
}

/// `stream_sync:always` takes cached pages first, even where new handles would cost less.
#[test]
fn stream_sync_always_still_stitches_first() {
    let (sim, pool) = small_chunks_cached_with(16 * GIB, "stream_sync:always");
    stitches_60_mib(sim, pool);
}

/// One round of small and large requests taking turns over the same pages: four 1 MiB
/// blocks (two small-heap granules) freed, then an 8 MiB block freed. Returns the driver
/// calls and the chunks moved (unmaps) in the round.
fn small_then_large(sim: &cistern::SimDriver, pool: &SimPool) -> (u64, u64) {
    let (calls, unmaps) = (sim.total_calls(), sim.calls(DriverCall::Unmap));
    let smalls: Vec<u64> = (0..4).map(|_| alloc(pool, MIB, A)).collect();
    for s in smalls {
        free(pool, s, A);
    }
    let l = alloc(pool, 8 * MIB, A);
    free(pool, l, A);
    check(pool);
    (
        sim.total_calls() - calls,
        sim.calls(DriverCall::Unmap) - unmaps,
    )
}

/// While memory is plentiful, granules do not go back and forth between the heaps: the first
/// large block stitches the small heap's cached granules and the small heap buys pages again;
/// from then on large blocks leave the small heap's granules where they are (Note [Small pages
/// stay small] in `sizing.rs`) and create pages of their own rather than taking them straight
/// back (Note [No bounce] in `pages.rs`); from the third round on the program makes no driver
/// call at all. Without the rules every round moved four chunks (18 calls).
#[test]
fn chunks_do_not_bounce_between_heaps_while_memory_is_plentiful() {
    let (sim, pool) = pool(16 * GIB, true);
    let first = small_then_large(&sim, &pool);
    assert!(first.1 > 0, "the first round stitched nothing: {first:?}");
    small_then_large(&sim, &pool);
    for round in 2..8 {
        assert_eq!(
            small_then_large(&sim, &pool),
            (0, 0),
            "round {round}: driver calls in a steady state"
        );
    }
    assert!(sim.hazards().is_empty());
    assert_no_leak(&sim, pool);
}

/// A growing program (a new large block kept each round, as a training step's activations)
/// whose small blocks come and go: the first large growth takes the small heap's free
/// granules and the small heap buys pages again; from then on, memory being plentiful, large
/// growth leaves them (Note [Small pages stay small] in `sizing.rs`): no chunk moves, and the
/// small heap buys nothing more. Without the rule every round moved two granules to the large
/// heap and bought two small ones again.
#[test]
fn a_growing_program_leaves_the_small_heaps_pages_once_it_wanted_them_back() {
    let (sim, pool) = pool(16 * GIB, true);
    let mut kept = Vec::new();
    let mut round = |pool: &SimPool| {
        let (unmaps, creates) = (
            sim.calls(DriverCall::Unmap),
            sim.calls(DriverCall::CreatePhysical),
        );
        let smalls: Vec<u64> = (0..4).map(|_| alloc(pool, MIB, A)).collect();
        let small_creates = sim.calls(DriverCall::CreatePhysical) - creates;
        for s in smalls {
            free(pool, s, A);
        }
        kept.push(alloc(pool, 3 * MIB, A));
        check(pool);
        (sim.calls(DriverCall::Unmap) - unmaps, small_creates)
    };
    let first = round(&pool);
    let second = round(&pool);
    assert!(
        first.0 + second.0 > 0,
        "no large growth took the small heap's granules: {first:?} {second:?}"
    );
    for r in 2..10 {
        assert_eq!(
            round(&pool),
            (0, 0),
            "round {r}: moved or bought small pages"
        );
    }
    for k in kept {
        free(&pool, k, A);
    }
    assert!(sim.hazards().is_empty());
    assert_no_leak(&sim, pool);
}

/// Under memory pressure the same program moves the granules back and forth rather than
/// buying more: memory first.
#[test]
fn chunks_bounce_between_heaps_under_pressure() {
    let (sim, pool) = pool(12 * MIB, true);
    small_then_large(&sim, &pool);
    let reserved = sim.committed_bytes(0);
    for _ in 0..4 {
        let (_, moved) = small_then_large(&sim, &pool);
        assert!(moved > 0, "nothing moved under pressure");
        assert_eq!(sim.committed_bytes(0), reserved, "memory was bought");
    }
    assert!(sim.hazards().is_empty());
    assert_no_leak(&sim, pool);
}

/// A chunk left where it is while memory is plentiful (a small heap's granule, or a bounce)
/// never costs a host wait: when the device then turns out to have less room than it seemed
/// (another process took it) and creation runs short, growth takes the left chunks (stream
/// B's, idle) without waiting, before it would wait for its own busy stream's cached
/// granule. The request succeeds from them.
#[test]
fn a_chunk_left_in_place_is_taken_without_a_wait_when_creation_runs_short() {
    let (sim, pool) = pool(16 * GIB, true);
    // Stream A: three small blocks (two granules); stream B: two granules of small blocks,
    // freed, which A's large block takes, and B's next round gets back; from then on they
    // stay B's while memory is plentiful.
    let (x1, x2, a_live) = (
        alloc(&pool, MIB, A),
        alloc(&pool, MIB, A),
        alloc(&pool, MIB, A),
    );
    let b_round = |pool: &SimPool| {
        let smalls: Vec<u64> = (0..4).map(|_| alloc(pool, MIB, B)).collect();
        for s in smalls {
            free(pool, s, B);
        }
    };
    b_round(&pool);
    let l = alloc(&pool, 8 * MIB, A);
    free(&pool, l, A);
    b_round(&pool);
    // A's stream is busy with work on its last small block, and one of A's small granules is
    // cached; then the device has no room left beyond what the pool holds.
    free(&pool, x1, A);
    free(&pool, x2, A);
    sim.launch(0, StreamId(A), &[(a_live, MIB)]).unwrap();
    let waits = sim.host_waits();
    sim.fail_after_bytes(sim.committed_bytes(0));
    let l = alloc(&pool, 8 * MIB, A);
    check(&pool);
    assert_eq!(sim.host_waits(), waits, "growth waited for a busy stream");
    sim.clear_faults();
    sim.complete_all(0);
    free(&pool, l, A);
    free(&pool, a_live, A);
    assert!(sim.hazards().is_empty());
    assert_no_leak(&sim, pool);
}

/// Stream A allocates blocks of `sizes` MiB in turn (`handles` handles in all, one per 20 MiB
/// or less: `chunk_split:none`, no whole chunks) and frees them, on a device they fill but for
/// `room` MiB; then stream B's `request` MiB comes from those cached chunks alone, moving
/// `moved` of them (Note [Stitching to a plan]). Panics with the OOM error when stitching
/// runs short.
fn stitches_to_plan(sizes: &[u64], handles: u64, room: u64, request: u64, moved: u64) {
    let device = (sizes.iter().sum::<u64>() + room) * MIB;
    let conf = "chunk_split:none,grow_whole_chunks:off";
    let (sim, pool) = pool_with(cistern::SimConfig::default().capacity(device), true, conf);
    let blocks: Vec<u64> = sizes.iter().map(|&s| alloc(&pool, s * MIB, A)).collect();
    assert!(blocks.windows(2).all(|w| w[0] < w[1]), "in address order");
    assert_eq!(sim.calls(DriverCall::CreatePhysical), handles);
    for p in blocks {
        free(&pool, p, A);
    }
    let unmaps = sim.calls(DriverCall::Unmap);
    let p = alloc(&pool, request * MIB, B);
    assert_eq!(
        sim.calls(DriverCall::CreatePhysical),
        handles,
        "no new handle"
    );
    assert_eq!(sim.calls(DriverCall::Unmap) - unmaps, moved, "chunks moved");
    sim.launch(0, StreamId(B), &[(p, request * MIB)]).unwrap();
    sim.complete_all(0);
    free(&pool, p, B);
    assert_no_leak(&sim, pool);
}

/// Under memory pressure stitching packs the cached chunks at least as well as largest first:
/// free chunks of 2, 10 and 10 granules, in that address order, back a 40 MiB window on a
/// device with no room left. First fit would take the 2 and one 10, and run 8 granules short.
#[test]
fn pressure_packs_cached_chunks_largest_first() {
    stitches_to_plan(&[4, 40], 3, 0, 40, 2);
}

/// ... and fully where largest first does not: free chunks of 10, 8 and 5 granules and 66 of
/// 2 back a 300 MiB window (150 granules). Largest first (10, 8, 5, then 63 of 2) leaves a
/// granule open; leaving out the 5 fills it.
#[test]
fn pressure_packs_cached_chunks_fully() {
    let mut sizes = vec![20, 16, 10];
    sizes.extend([4; 66]);
    stitches_to_plan(&sizes, 69, 0, 300, 68);
}

/// With room to spare, stitching still moves the fewest chunks: five free chunks of 2
/// granules lie before one of 10, and a 20 MiB window takes the 10 (one move), not the five
/// 2s first (five moves).
#[test]
fn stitching_moves_the_largest_chunks_first() {
    stitches_to_plan(&[4, 4, 4, 4, 4, 20], 6, 1024, 20, 1);
}
