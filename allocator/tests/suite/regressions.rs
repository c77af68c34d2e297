//! Regression tests for bugs found in review: each names the bug it guards against.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cistern::driver::DriverCall;
use cistern::{Config, Pool, SimConfig, SimDriver, StreamId};

const MIB: u64 = 1 << 20;

/// `ledger()` used to hold every arena's lock without the device lock, while growth holds its
/// own arena's lock and then locks the others: the two could deadlock. Growth on two streams
/// races with ledger readers here; a watchdog fails the test instead of hanging CI.
#[test]
fn ledger_and_growth_on_several_streams_do_not_deadlock() {
    let sim = Arc::new(SimDriver::new(SimConfig::default().capacity(512 * MIB)));
    let pool = Arc::new(Pool::new(sim, Config::default()).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for s in 0..3u64 {
        let pool = pool.clone();
        threads.push(std::thread::spawn(move || {
            // Growth and stitching: big blocks freed and reallocated in other sizes, so pages
            // keep moving between the streams' arenas.
            for i in 0..3000u64 {
                let size = (2 + (i * 7 + s) % 60) * MIB;
                if let Ok(p) = pool.alloc_raw(0, size, StreamId(s)) {
                    pool.free_raw(p, StreamId(s)).unwrap();
                }
                if i % 50 == 0 {
                    pool.empty_cache();
                }
            }
        }));
    }
    {
        let pool = pool.clone();
        let done = done.clone();
        threads.push(std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let dev = pool.device(0).unwrap();
                let _ = dev.ledger();
                let _ = dev.stats();
            }
        }));
    }
    let start = Instant::now();
    while threads[..3].iter().any(|t| !t.is_finished()) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "allocation threads stuck: a lock-order deadlock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    done.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    pool.check_invariants().unwrap();
}

/// A request near 2^64 bytes without VMM used to overflow the segment-size arithmetic (a panic
/// in debug builds, a zero-sized cuMemAlloc in release).
#[test]
fn absurd_sizes_are_typed_errors_in_segment_mode() {
    let sim = Arc::new(SimDriver::new(SimConfig::default().capacity(1 << 30)));
    let pool = Pool::new(sim.clone(), Config::parse("vmm:false").unwrap()).unwrap();
    let keep = pool.alloc_raw(0, 4 * MIB, StreamId(0)).unwrap();
    for size in [u64::MAX - 1000, u64::MAX / 2, 1 << 50] {
        let e = pool.alloc_raw(0, size, StreamId(0)).unwrap_err();
        assert!(e.is_oom(), "{size}: {e}");
    }
    pool.check_invariants().unwrap();
    pool.free_raw(keep, StreamId(0)).unwrap();
    assert_eq!(
        sim.calls(DriverCall::MemAlloc),
        1,
        "no driver call for absurd sizes"
    );
}

/// Dropping a pool used to unmap pages under a block still pending on another stream when
/// the pending block's events could not be waited for.
#[test]
fn teardown_keeps_pages_of_blocks_still_pending() {
    let sim = Arc::new(SimDriver::new(SimConfig::default().capacity(1 << 30)));
    let pool = Pool::new(sim.clone(), Config::default()).unwrap();
    let (a, b) = (StreamId(1), StreamId(2));
    let p = pool.alloc_raw(0, 8 * MIB, a).unwrap();
    sim.launch(0, b, &[(p, 8 * MIB)]).unwrap();
    pool.record_stream(p, b).unwrap();
    pool.free_raw(p, a).unwrap();
    // The pending block's event can no longer be waited for, nor the device synchronised.
    sim.fail_from(DriverCall::EventSynchronize, 1);
    sim.fail_from(DriverCall::DeviceSynchronize, 1);
    drop(pool);
    assert!(
        sim.hazards().is_empty(),
        "pages unmapped under work still running: {:?}",
        sim.hazards()
    );
    assert!(
        sim.mapped_bytes(0) >= 8 * MIB,
        "the pending block's pages stay mapped"
    );
}

/// A pending block whose event the driver can no longer answer for (driver 580 answers
/// `CUDA_ERROR_INVALID_VALUE` for an event recorded in a capture that has ended, for as long as
/// it is not recorded again) used to stay pending for good: polls took the error for "not
/// yet", held back every later free on that stream, and the OOM protocol gave up on it. Such a
/// block now waits for a device synchronisation, which the OOM protocol makes; later frees on
/// the stream are still polled.
#[test]
fn a_pending_block_whose_event_cannot_be_asked_is_recovered() {
    let sim = Arc::new(SimDriver::new(SimConfig::default().capacity(64 * MIB)));
    let pool = Pool::new(sim.clone(), Config::default()).unwrap();
    let (a, b) = (StreamId(1), StreamId(2));
    let p = pool.alloc_raw(0, 40 * MIB, a).unwrap();
    sim.launch(0, b, &[(p, 40 * MIB)]).unwrap();
    pool.record_stream(p, b).unwrap();
    pool.free_raw(p, a).unwrap();
    // Every later question about an event fails; the work itself finishes.
    sim.fail_from(DriverCall::EventQuery, 1);
    sim.fail_from(DriverCall::EventSynchronize, 1);
    sim.complete_stream(0, b);
    // The block's 40 MiB are needed: the OOM protocol synchronises the device for it.
    let q = pool
        .alloc_raw(0, 40 * MIB, a)
        .expect("the pending block was not recovered");
    pool.check_invariants().unwrap();
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
    pool.free_raw(q, a).unwrap();
}
