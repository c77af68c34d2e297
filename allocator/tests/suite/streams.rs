//! Streams as the driver names them: a handle is not an identity. A destroyed stream's handle
//! can come back as a new stream (the pool must not hand the new stream blocks the old one may
//! still be using, nor ever name the old one again), and the address space that arenas reserve
//! from is finite (running out is an OOM with its report, never a bare driver error).
//!
//! The simulator takes any handle as a stream; `SimDriver::recreate_stream` says a handle now
//! names a new stream, as `cuStreamDestroy` + `cuStreamCreate` may on the real driver. The rules
//! that need a driver which creates streams (per-thread streams, streams of other devices) are
//! tested over the fake libcuda (`tests/fakecuda/tests/`).

use crate::common::*;
use cistern::{Error, SimConfig, StreamId};

const H: u64 = 0x7000;

/// The extent (segment) of the pool's report that holds `ptr`.
fn extent_of(pool: &SimPool, ptr: u64) -> u64 {
    pool.device(0)
        .unwrap()
        .segments_snapshot()
        .iter()
        .find(|s| s.address <= ptr && ptr < s.address + s.total_size)
        .map(|s| s.address)
        .unwrap_or_else(|| panic!("{ptr:#x} is in no segment"))
}

#[test]
fn a_recreated_handle_is_a_new_stream_and_the_old_arena_retires() {
    both(|vmm| {
        let (sim, pool) = pool(GIB, vmm);
        let pool = std::sync::Arc::new(pool);
        // The first stream on H: one block kept live, one freed into H's cache.
        let live = alloc(&pool, 8 * MIB, H);
        let cached = alloc(&pool, 8 * MIB, H);
        free(&pool, cached, H);
        let old_extent = extent_of(&pool, live);
        sim.recreate_stream(StreamId(H));
        // Another thread meets the new stream first: it gets a new arena, never the cached
        // block of the gone stream (whose last work may still be running).
        let p2 = {
            let pool = pool.clone();
            std::thread::spawn(move || alloc(&pool, 8 * MIB, H))
                .join()
                .unwrap()
        };
        assert_ne!(
            p2, cached,
            "the new stream got the gone stream's cached block"
        );
        if vmm {
            assert_ne!(extent_of(&pool, p2), old_extent);
        }
        // This thread had H cached: the retirement invalidated it, so it lands in the new
        // arena too.
        let p3 = alloc(&pool, 8 * MIB, H);
        assert_ne!(p3, cached);
        if vmm {
            assert_eq!(extent_of(&pool, p3), extent_of(&pool, p2));
        }
        // The retired arena's live block can still be freed; its memory is still accounted.
        free(&pool, live, H);
        free(&pool, p2, H);
        free(&pool, p3, H);
        check(&pool);
        let pool = std::sync::Arc::try_unwrap(pool).ok().unwrap();
        assert_no_leak(&sim, pool);
    });
}

#[test]
fn the_retired_arenas_pages_go_to_other_streams_only_after_a_device_sync() {
    // Two streams' worth of the device: the new stream on H must take the retired arena's
    // free pages, and may only do so once the device is idle (the gone stream cannot be
    // waited for by name).
    let (sim, pool) = pool(64 * MIB, true);
    let p = alloc(&pool, 48 * MIB, H);
    free(&pool, p, H);
    sim.recreate_stream(StreamId(H));
    let syncs = sim.calls(cistern::driver::DriverCall::DeviceSynchronize);
    // Met first on another thread (see `DevicePool::arena` on what a thread that had the
    // handle cached sees).
    let q = std::thread::scope(|t| t.spawn(|| alloc(&pool, 48 * MIB, H)).join().unwrap());
    assert!(
        sim.calls(cistern::driver::DriverCall::DeviceSynchronize) > syncs,
        "pages of a gone stream were moved without synchronising the device"
    );
    free(&pool, q, H);
    check(&pool);
    assert_no_leak(&sim, pool);
}

#[test]
fn running_out_of_address_space_is_an_oom_with_a_report() {
    // A 1.5 TiB device: a stream that asks for 1 TiB reserves a 3 TiB extent (four times the
    // request, capped at twice the device) of the simulator's 16 TiB address range, so five
    // streams leave 1 TiB, a sixth gets a smaller reservation, and then not even the request
    // fits: the allocation is an OOM that says why. Each stream frees its block before the
    // next allocates, so physical memory never runs short.
    let (_sim, pool) = pool_with(SimConfig::default().capacity(3 << 39), true, "");
    let mut served = 0;
    let mut failure = None;
    for s in 0..64u64 {
        match pool.alloc_raw(0, 1 << 40, StreamId(0x100 + s)) {
            Ok(p) => {
                served += 1;
                free(&pool, p, 0x100 + s);
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
        check(&pool);
    }
    let e = failure.expect("64 streams of 3 TiB reservations fit in 16 TiB");
    match &e {
        Error::OutOfMemory(r) => {
            let text = e.to_string();
            assert!(text.contains("virtual address space"), "{text}");
            assert!(r.requested > 0);
        }
        other => panic!("expected an OOM with a report, got {other:?}"),
    }
    assert!(
        served > 5,
        "a smaller reservation should let a sixth stream in: {served}"
    );
    check(&pool);
}

#[test]
fn teardown_leaves_memory_mapped_when_the_streams_work_cannot_be_waited_for() {
    // The stream's work on a freed block is unfinished and every way of waiting for it fails:
    // unmapping would pull the pages from under that work. The pool must leave them mapped.
    let (sim, pool) = pool(GIB, true);
    let p = alloc(&pool, 8 * MIB, H);
    sim.launch(0, StreamId(H), &[(p, 8 * MIB)]).unwrap();
    free(&pool, p, H);
    for call in [
        cistern::driver::DriverCall::EventSynchronize,
        cistern::driver::DriverCall::EventRecord,
        cistern::driver::DriverCall::StreamSynchronize,
        cistern::driver::DriverCall::DeviceSynchronize,
    ] {
        sim.fail_from(call, 1);
    }
    let unmaps = sim.calls(cistern::driver::DriverCall::Unmap);
    drop(pool);
    assert_eq!(
        sim.calls(cistern::driver::DriverCall::Unmap),
        unmaps,
        "teardown unmapped memory whose stream could not be waited for"
    );
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
    sim.clear_faults();
}

#[test]
fn streams_destroyed_and_replaced_in_a_loop_do_not_keep_their_reservations() {
    // A program that makes a stream per task and destroys it after, the driver handing the
    // handle back each time: a gone stream's arena gives its pages and address ranges back
    // once nothing of it is live, so the reservations stay bounded.
    both(|vmm| {
        let (sim, pool) = pool(GIB, vmm);
        let mut most = 0;
        for _ in 0..40 {
            // Each task runs on a fresh thread, which meets the handle's new stream.
            std::thread::scope(|t| {
                t.spawn(|| {
                    let p = alloc(&pool, 24 * MIB, H);
                    let q = alloc(&pool, 100 * KIB, H);
                    free(&pool, q, H);
                    free(&pool, p, H);
                })
                .join()
                .unwrap()
            });
            sim.recreate_stream(StreamId(H));
            most = most.max(sim.reserved_va_bytes(0));
        }
        pool.empty_cache();
        check(&pool);
        if vmm {
            // One stream's extents (3 GiB on a 1 GiB device), and the one being replaced.
            assert!(most <= 6 * GIB, "{} GiB reserved", most / GIB);
        }
        let streams = pool.report().devices[0].streams;
        assert!(streams <= 2, "{streams} arenas kept for one live stream");
        assert_no_leak(&sim, pool);
    });
}

#[test]
fn a_forgotten_stream_is_never_named_again_and_its_handle_starts_afresh() {
    both(|vmm| {
        let (sim, pool) = pool(GIB, vmm);
        let live = alloc(&pool, 4 * MIB, H);
        let cached = alloc(&pool, 8 * MIB, H);
        free(&pool, cached, H);
        // The program destroys the stream (telling the pool) and the driver hands the handle to
        // its next stream: even on this thread, which had the handle cached, the new stream is
        // not served the gone stream's cached block.
        pool.forget_stream(StreamId(H)).unwrap();
        sim.recreate_stream(StreamId(H));
        let p = alloc(&pool, 8 * MIB, H);
        assert_ne!(p, cached);
        free(&pool, p, H);
        free(&pool, live, H);
        check(&pool);
        // A stream destroyed for good: giving its cache back never names its handle (a device
        // synchronisation instead of an event on it).
        let gone = 0x9000;
        let q = alloc(&pool, 8 * MIB, gone);
        free(&pool, q, gone);
        pool.forget_stream(StreamId(gone)).unwrap();
        let (records, syncs) = (
            sim.calls(cistern::driver::DriverCall::EventRecord),
            sim.calls(cistern::driver::DriverCall::DeviceSynchronize),
        );
        pool.forget_stream(StreamId(H)).unwrap();
        pool.empty_cache();
        let named = sim.calls(cistern::driver::DriverCall::EventRecord) - records;
        assert_eq!(named, 0, "a gone stream's handle was used {named} time(s)");
        if vmm {
            assert!(sim.calls(cistern::driver::DriverCall::DeviceSynchronize) > syncs);
        }
        check(&pool);
        // The default streams cannot be destroyed.
        for s in [0, 1, 2] {
            assert!(pool.forget_stream(StreamId(s)).is_err());
        }
        assert_no_leak(&sim, pool);
    });
}

#[test]
fn many_short_lived_streams_keep_address_space_and_arenas_bounded() {
    // A server that runs each request on a stream of its own, with a little memory each:
    // 100,000 streams that never come back (10,000 in debug builds), on a device of 128 pages.
    // Each reserves only what it uses, and once another stream has taken its pages its arena
    // is swept, so the arenas (host memory) and the reservations follow the streams holding
    // memory, not every stream ever seen.
    let n: u64 = if cfg!(debug_assertions) {
        10_000
    } else {
        100_000
    };
    let (sim, pool) = pool(256 * MIB, true);
    let pages = 256 * MIB / PAGE;
    let mut most_arenas = 0;
    let mut most_va = 0;
    for s in 0..n {
        let stream = 0x10_0000 + s;
        let p = pool
            .alloc_raw(0, 4 * KIB, StreamId(stream))
            .unwrap_or_else(|e| panic!("stream {s}: {e}"));
        pool.free_raw(p, StreamId(stream)).unwrap();
        if s % 1000 == 999 {
            check(&pool);
            most_arenas = most_arenas.max(pool.report().devices[0].streams);
            most_va = most_va.max(sim.reserved_va_bytes(0));
        }
    }
    // At most one arena per page of the device holds memory; the sweep runs when the count
    // doubles, so it never passes four times that.
    assert!(
        most_arenas <= 4 * pages,
        "{most_arenas} arenas for a device of {pages} pages"
    );
    // A small heap's first extent is 64 MiB.
    assert!(
        most_va <= 4 * pages * 64 * MIB,
        "{} GiB of address space reserved",
        most_va / GIB
    );
    pool.empty_cache();
    check(&pool);
    assert_no_leak(&sim, pool);
}

/// The same server on a GPU that runs behind: each stream's work on its block is still queued
/// when the next stream takes the page (a move ordered on the device), so the swept arenas
/// still hold old mappings now and then. An arena's address range goes only once they are
/// unmapped; nothing races (the simulator's hazard check), and the arenas, the reservations
/// and the old mappings stay bounded.
#[test]
fn short_lived_busy_streams_hand_pages_on_in_order() {
    let n: u64 = if cfg!(debug_assertions) {
        3_000
    } else {
        20_000
    };
    let (sim, pool) = pool(256 * MIB, true);
    let pages = 256 * MIB / PAGE;
    let mut most_arenas = 0;
    let mut most_va = 0;
    for s in 0..n {
        let stream = StreamId(0x20_0000 + s);
        let p = pool
            .alloc_raw(0, 4 * KIB, stream)
            .unwrap_or_else(|e| panic!("stream {s}: {e}"));
        sim.launch(0, stream, &[(p, 4 * KIB)]).unwrap();
        pool.free_raw(p, stream).unwrap();
        if s % 64 == 63 {
            sim.complete_all(0);
        }
        if s % 500 == 499 {
            check(&pool);
            assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
            most_arenas = most_arenas.max(pool.report().devices[0].streams);
            most_va = most_va.max(sim.reserved_va_bytes(0));
        }
    }
    assert!(
        stat(&pool, "num_ordered_moves") > 0,
        "no page moved while busy"
    );
    assert!(stat(&pool, "num_deferred_unmaps") > 0);
    // No address range freed under an old mapping, no map over one.
    assert_eq!(stat(&pool, "num_driver_errors"), 0);
    assert!(
        most_arenas <= 4 * pages,
        "{most_arenas} arenas for a device of {pages} pages"
    );
    assert!(
        most_va <= 4 * pages * 64 * MIB,
        "{} GiB of address space reserved",
        most_va / GIB
    );
    sim.complete_all(0);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    assert_no_leak(&sim, pool);
}

#[test]
fn a_fork_child_is_refused_by_the_pool_and_never_hangs() {
    // fork() copies one thread: an arena lock another thread held stays held in the child.
    // The child's calls fail with an error naming fork() before taking any lock.
    let (_sim, pool) = pool(GIB, true);
    let pool = std::sync::Arc::new(pool);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..3u64)
        .map(|t| {
            let (pool, stop) = (pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let p = pool
                        .alloc_raw(0, 4096 << (i % 8), StreamId(0x40 + t))
                        .unwrap();
                    pool.free_raw(p, StreamId(0x40 + t)).unwrap();
                    i += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(20));
    for _ in 0..10 {
        // SAFETY: the child only calls the pool (which refuses at once) and `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let refused = match pool.alloc_raw(0, 4096, StreamId(0x40)) {
                Err(e) => e.to_string().contains("fork()"),
                Ok(_) => false,
            };
            let freed = pool.free_raw(0x1000, StreamId(0x40)).is_err();
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if refused && freed { 0 } else { 3 }) };
        }
        let mut status = 0;
        let mut waited = 0;
        // SAFETY: our own child; `status` is a live int.
        while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } != pid {
            waited += 1;
            if waited > 1000 {
                // SAFETY: our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("the fork child hung in the pool");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the fork child was not refused: status {status}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    check(&pool);
}
