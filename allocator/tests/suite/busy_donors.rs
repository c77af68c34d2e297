//! Cached pages of a stream whose work is still queued: left or waited for (`stream_sync:
//! pressure`, `always`), or moved with the order kept on the device (`device`, the default:
//! Note [Moves ordered on the device] in `pool/pages.rs`), and the old mappings such moves
//! leave until the donor's work is done. The setup is `stitching.rs`'s swiss cheese.

use crate::common::*;
use crate::stitching::{swiss_cheese, A, B};
use cistern::driver::DriverCall;
use cistern::StreamId;

/// Work on A over the former blocks of some of the swiss cheese's holes, queued before they
/// were freed: the holes are reusable by A at once, but by B only after this work.
fn busy_donor(sim: &cistern::SimDriver, pool: &SimPool) {
    let x = alloc(pool, 20 * MIB, A);
    sim.launch(0, StreamId(A), &[(x, 20 * MIB)]).unwrap();
    free(pool, x, A);
}

/// With `stream_sync:always`, pages freed on stream A go to stream B only after A's work on
/// them has completed: the pool waits for A (no hazard, no unmap under running work), and
/// takes the cached pages rather than creating new ones.
#[test]
fn cross_stream_stitching_waits_for_the_donor() {
    let (sim, pool, keep) = busy_cheese(GIB, "always");
    let syncs = stat(&pool, "num_stream_syncs");
    let created = sim.calls(DriverCall::CreatePhysical);
    let p = alloc(&pool, 300 * MIB, B);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    assert_eq!(
        sim.unfinished_work(0),
        0,
        "A's work must be complete before its pages move"
    );
    assert!(stat(&pool, "num_stream_syncs") > syncs);
    assert!(stat(&pool, "num_cross_stream_pages") >= 150);
    assert_eq!(
        sim.calls(DriverCall::CreatePhysical),
        created,
        "new pages were created"
    );
    sim.launch(0, StreamId(B), &[(p, 300 * MIB)]).unwrap();
    sim.complete_all(0);
    finish(&sim, pool, &[(p, B)], keep);
}

/// With `stream_sync:pressure` and room on the device, a busy donor's cached pages are left
/// where they are: growth maps new memory and never blocks the host.
#[test]
fn a_busy_donor_costs_no_host_wait_while_memory_lasts() {
    let (sim, pool, keep) = busy_cheese(2 * GIB, "pressure");
    let waits = sim.calls(DriverCall::EventSynchronize) + sim.calls(DriverCall::DeviceSynchronize);
    let committed = sim.committed_bytes(0);
    let p = alloc(&pool, 300 * MIB, B);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    assert_eq!(
        sim.calls(DriverCall::EventSynchronize) + sim.calls(DriverCall::DeviceSynchronize),
        waits,
        "growth blocked the host"
    );
    assert!(sim.unfinished_work(0) > 0, "A's work was waited for");
    assert_eq!(stat(&pool, "num_cross_stream_pages"), 0);
    assert_eq!(sim.committed_bytes(0), committed + 300 * MIB);
    // Once A's work is done, its pages are taken again without waiting.
    sim.complete_all(0);
    let q = alloc(&pool, 300 * MIB, B);
    assert!(stat(&pool, "num_cross_stream_pages") >= 150);
    assert_eq!(sim.committed_bytes(0), committed + 300 * MIB);
    assert_eq!(
        sim.calls(DriverCall::EventSynchronize) + sim.calls(DriverCall::DeviceSynchronize),
        waits
    );
    check(&pool);
    finish(&sim, pool, &[(p, B), (q, B)], keep);
}

/// With `stream_sync:pressure`, under memory pressure (the device cannot hold the request in
/// new memory) the pool does wait for the busy donor, and the request succeeds from new pages
/// plus the donor's. With the default (`device`) the same request succeeds without a wait.
#[test]
fn under_pressure_a_busy_donor_is_waited_for() {
    for mode in ["pressure", "device"] {
        let (sim, pool, keep) = busy_cheese(GIB, mode);
        let syncs = stat(&pool, "num_stream_syncs");
        let waits = host_waits(&sim);
        let p = alloc(&pool, 300 * MIB, B);
        assert!(sim.hazards().is_empty(), "{mode}: {:#?}", sim.hazards());
        assert!(stat(&pool, "num_cross_stream_pages") > 0, "{mode}");
        if mode == "pressure" {
            assert_eq!(sim.unfinished_work(0), 0, "A's pages moved under its work");
            assert!(stat(&pool, "num_stream_syncs") > syncs);
        } else {
            assert_eq!(host_waits(&sim), waits, "growth blocked the host");
            assert!(sim.unfinished_work(0) > 0, "A's work was waited for");
            assert!(stat(&pool, "num_ordered_moves") > 0);
        }
        check(&pool);
        sim.launch(0, StreamId(B), &[(p, 300 * MIB)]).unwrap();
        free_all(&pool, &[(p, B)], keep);
        assert!(sim.hazards().is_empty(), "{mode}: {:#?}", sim.hazards());
        assert_no_leak(&sim, pool);
    }
}

/// A pool over a `cap`-byte device with `stream_sync:{mode}`, the swiss cheese on stream A
/// and A still busy over one of its former holes: the setup of the busy-donor tests. Returns
/// the live blocks of the cheese too.
fn busy_cheese(cap: u64, mode: &str) -> (std::sync::Arc<cistern::SimDriver>, SimPool, Vec<u64>) {
    let (sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(cap),
        true,
        &format!("stream_sync:{mode}"),
    );
    let keep = swiss_cheese(&pool);
    busy_donor(&sim, &pool);
    (sim, pool, keep)
}

/// Frees `live` (each block on its stream) and the cheese's `keep` blocks (on A).
fn free_all(pool: &SimPool, live: &[(u64, u64)], keep: Vec<u64>) {
    for &(p, s) in live {
        free(pool, p, s);
    }
    for k in keep {
        free(pool, k, A);
    }
}

/// [`free_all`], then: no hazard was seen, and nothing is left once the pool is emptied.
fn finish(sim: &cistern::SimDriver, pool: SimPool, live: &[(u64, u64)], keep: Vec<u64>) {
    free_all(&pool, live, keep);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    assert_no_leak(sim, pool);
}

/// Calls that block the host on GPU work.
fn host_waits(sim: &cistern::SimDriver) -> u64 {
    sim.calls(DriverCall::EventSynchronize)
        + sim.calls(DriverCall::StreamSynchronize)
        + sim.calls(DriverCall::DeviceSynchronize)
}

/// With `stream_sync:device`, a busy donor's cached pages move without a host wait and
/// without new memory: mapped in B's window while still mapped at A's addresses, B's later
/// work ordered after A's on the device (the simulator's handout check would report B's block
/// otherwise), A's old addresses left out of every window until they are unmapped, which
/// happens at a growth once A's work is done.
#[test]
fn a_busy_donor_moves_ordered_on_the_device() {
    let (sim, pool, keep) = busy_cheese(2 * GIB, "device");
    let waits = host_waits(&sim);
    let created = sim.calls(DriverCall::CreatePhysical);
    let unmaps = sim.calls(DriverCall::Unmap);
    let ordered = sim.calls(DriverCall::StreamWaitEvent);
    let p = alloc(&pool, 300 * MIB, B);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    assert_eq!(host_waits(&sim), waits, "growth blocked the host");
    assert!(sim.unfinished_work(0) > 0, "A's work was waited for");
    assert!(stat(&pool, "num_cross_stream_pages") >= 150);
    assert_eq!(
        sim.calls(DriverCall::CreatePhysical),
        created,
        "new pages were created"
    );
    assert!(stat(&pool, "num_ordered_moves") > 0);
    assert_eq!(sim.calls(DriverCall::StreamWaitEvent), ordered + 1);
    assert_eq!(
        sim.calls(DriverCall::Unmap),
        unmaps,
        "A's pages were unmapped under its work"
    );
    sim.launch(0, StreamId(B), &[(p, 300 * MIB)]).unwrap();
    // A grows while its old addresses are still mapped: no window covers them.
    let q = alloc(&pool, 100 * MIB, A);
    sim.launch(0, StreamId(A), &[(q, 100 * MIB)]).unwrap();
    assert_eq!(stat(&pool, "num_deferred_unmaps"), 0);
    // B's work completes only after A's first (it waits for it on the device); A's work on
    // `q`, launched later, stays.
    sim.complete_stream(0, StreamId(B));
    assert_eq!(sim.unfinished_on(0, StreamId(A)), 1);
    sim.complete_all(0);
    // The next growth unmaps the old addresses, without a wait.
    let r = alloc(&pool, 100 * MIB, A);
    assert!(stat(&pool, "num_deferred_unmaps") > 0);
    assert!(sim.calls(DriverCall::Unmap) > unmaps);
    assert_eq!(host_waits(&sim), waits);
    check(&pool);
    finish(&sim, pool, &[(p, B), (q, A), (r, A)], keep);
}

/// A stream's own busy pages move within its arena with no wait at all (its own work is in
/// order already) and are unmapped from their old addresses once that work is done.
#[test]
fn a_busy_streams_own_pages_move_without_a_wait() {
    let (sim, pool, keep) = busy_cheese(2 * GIB, "device");
    let waits = host_waits(&sim);
    let created = sim.calls(DriverCall::CreatePhysical);
    let ordered = sim.calls(DriverCall::StreamWaitEvent);
    let p = alloc(&pool, 300 * MIB, A);
    assert_eq!(host_waits(&sim), waits, "growth blocked the host");
    assert_eq!(sim.calls(DriverCall::CreatePhysical), created);
    assert_eq!(sim.calls(DriverCall::StreamWaitEvent), ordered);
    assert!(stat(&pool, "num_ordered_moves") > 0);
    sim.launch(0, StreamId(A), &[(p, 300 * MIB)]).unwrap();
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    sim.complete_all(0);
    let q = alloc(&pool, 50 * MIB, A);
    assert!(stat(&pool, "num_deferred_unmaps") > 0);
    finish(&sim, pool, &[(p, A), (q, A)], keep);
}

/// A move ordered on the device whose new mapping fails parks the chunks (still mapped where
/// they were) with the lost ones; a third stream that reuses them while the donor's work is
/// still queued must wait for it on the device too, or the simulator's handout check reports
/// the race.
#[test]
fn parked_moved_chunks_are_reused_in_order() {
    let (sim, pool, keep) = busy_cheese(2 * GIB, "device");
    // All of A's cached chunks (400 MiB) move, and none maps.
    sim.fail_nth(DriverCall::Map, 1);
    let failed = pool.alloc_raw(0, 400 * MIB, StreamId(B));
    sim.clear_faults();
    assert!(failed.is_err(), "the failed mapping went unnoticed");
    check(&pool);
    assert!(stat(&pool, "num_ordered_moves") > 0);
    assert!(sim.unfinished_on(0, StreamId(A)) > 0);
    let ordered = sim.calls(DriverCall::StreamWaitEvent);
    // Stream 3 finds nothing cached but the parked chunks.
    let c = alloc(&pool, 400 * MIB, 3);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    assert!(sim.calls(DriverCall::StreamWaitEvent) > ordered);
    sim.launch(0, StreamId(3), &[(c, 400 * MIB)]).unwrap();
    sim.complete_all(0);
    finish(&sim, pool, &[(c, 3)], keep);
}

/// A limit lowered while old mappings wait for their donor: the cached memory above it is
/// released after a wait for the donor (this path may wait), never under its work.
#[test]
fn a_lowered_limit_waits_for_old_mappings() {
    let (sim, pool, keep) = busy_cheese(2 * GIB, "device");
    let p = alloc(&pool, 300 * MIB, B);
    free(&pool, p, B);
    assert!(sim.unfinished_on(0, StreamId(A)) > 0);
    pool.set_memory_fraction(0, 0.25).unwrap();
    check(&pool);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    assert!(stat(&pool, "num_deferred_unmaps") > 0);
    assert!(stat(&pool, "reserved_bytes.all.current") as u64 <= 2 * GIB / 4 + 100 * MIB);
    free_all(&pool, &[], keep);
    assert_no_leak(&sim, pool);
}

/// A's old addresses, still mapped while its work is queued, lie in the free range A's next
/// large request would take: the window goes around them (a map over them would fail).
#[test]
fn a_window_goes_around_old_mappings() {
    let (sim, pool, keep) = busy_cheese(4 * GIB, "device");
    let p = alloc(&pool, 300 * MIB, B);
    assert!(stat(&pool, "num_ordered_moves") > 0);
    free_all(&pool, &[], keep);
    assert!(sim.unfinished_on(0, StreamId(A)) > 0);
    let errors = stat(&pool, "num_driver_errors");
    let q = alloc(&pool, 300 * MIB, A);
    assert_eq!(
        stat(&pool, "num_driver_errors"),
        errors,
        "a map over an old mapping"
    );
    assert_eq!(stat(&pool, "num_deferred_unmaps"), 0);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    sim.complete_all(0);
    free(&pool, p, B);
    free(&pool, q, A);
    assert_no_leak(&sim, pool);
}

/// An old mapping whose unmap fails at the pool's end stays mapped (as the failing call leaves
/// it), but its event goes with the pool.
#[test]
fn a_failed_deferred_unmap_at_the_end_leaks_no_event() {
    let (sim, pool, keep) = busy_cheese(2 * GIB, "device");
    let p = alloc(&pool, 300 * MIB, B);
    assert!(stat(&pool, "num_ordered_moves") > 0);
    free_all(&pool, &[(p, B)], keep);
    sim.fail_nth(DriverCall::Unmap, 1);
    drop(pool);
    sim.clear_faults();
    assert_eq!(sim.live_events(0), 0, "events after drop");
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
}

/// Old mappings still waiting for their donor's work when the cache is emptied, or when the
/// pool goes: `empty_cache` waits for the donor and releases everything; dropping the pool
/// leaves no mapping, handle or address range behind either.
#[test]
fn deferred_unmaps_end_with_empty_cache_and_with_the_pool() {
    for empty in [true, false] {
        let (sim, pool, keep) = busy_cheese(2 * GIB, "device");
        let p = alloc(&pool, 300 * MIB, B);
        assert!(stat(&pool, "num_ordered_moves") > 0);
        free_all(&pool, &[(p, B)], keep);
        // Nothing can be released while A's work may use the old mappings.
        assert!(sim.unfinished_work(0) > 0);
        if empty {
            assert_no_leak(&sim, pool);
        } else {
            drop(pool);
            assert_eq!(sim.mapped_bytes(0), 0, "mapped bytes after drop");
            assert_eq!(sim.live_handles(0), 0, "handles after drop");
            assert_eq!(sim.reserved_va_bytes(0), 0, "VA reservations after drop");
        }
        assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    }
}
