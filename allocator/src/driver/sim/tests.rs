//! The simulator's unit tests: the driver contracts (reservations, mappings, linear memory,
//! events), the work model and its hazards, host backing, fault injection, latencies, and the
//! address-range set underneath.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::driver::{Driver, EventId, PhysHandle, StreamId};

const G: u64 = 2 * MIB;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

fn small() -> SimDriver {
    SimDriver::new(SimConfig::default().capacity(64 * G))
}

fn backed() -> SimDriver {
    SimDriver::new(SimConfig::default().capacity(64 * G).backing(true))
}

/// Reserves `pages` granules, maps one handle per granule with access; returns
/// (base, handles).
fn mapped(sim: &SimDriver, pages: u64) -> (u64, Vec<PhysHandle>) {
    let base = sim.reserve_va(0, pages * G, 0).unwrap();
    let hs: Vec<_> = (0..pages)
        .map(|i| {
            let h = sim.create_physical(0, G).unwrap();
            sim.map(0, base + i * G, G, h).unwrap();
            h
        })
        .collect();
    sim.set_access(0, base, pages * G, &[]).unwrap();
    (base, hs)
}

fn assert_code(r: DriverResult<impl fmt::Debug>, kind: DriverErrorKind, code: i32) {
    let e = r.expect_err("call should fail");
    assert_eq!((e.kind, e.code), (kind, code), "{e}");
}

#[test]
fn is_send_sync_and_usable_behind_arc() {
    fn check<T: Send + Sync>() {}
    check::<SimDriver>();
    let sim: Arc<dyn Driver> = Arc::new(SimDriver::default());
    assert_eq!(sim.name(), "sim");
    assert_eq!(sim.device_count().unwrap(), 1);
}

#[test]
fn capabilities_and_invalid_device() {
    let sim = SimDriver::new(SimConfig::default().devices(2));
    let c = sim.capabilities(1).unwrap();
    assert_eq!(c.total_memory, 80 * GIB);
    assert!(c.vmm);
    assert_eq!(c.granularity, 2 * MIB);
    assert_eq!(c.name, "cistern-sim");
    assert_eq!(
        c.uuid.as_deref(),
        Some("GPU-5157a1d0-0000-4000-8000-000000000001")
    );
    assert_ne!(sim.capabilities(0).unwrap().uuid, c.uuid);
    assert_code(sim.capabilities(2), DriverErrorKind::InvalidDevice, 101);
    assert_code(sim.mem_alloc(2, 512), DriverErrorKind::InvalidDevice, 101);
    assert_code(sim.reserve_va(7, G, G), DriverErrorKind::InvalidDevice, 101);
}

#[test]
fn reservations_do_not_overlap_and_are_reused() {
    let sim = SimDriver::new(SimConfig::default().devices(2));
    let mut ranges = Vec::new();
    for (i, &align) in [0, G, 8 * G, G, 4 * G].iter().enumerate() {
        let size = (i as u64 + 1) * G;
        let a = sim.reserve_va(0, size, align).unwrap();
        assert_ne!(a, 0);
        assert_eq!(a % align.max(G), 0);
        ranges.push((a, size));
    }
    ranges.push((sim.reserve_va(1, 4 * G, 0).unwrap(), 4 * G));
    for (i, &(a, sa)) in ranges.iter().enumerate() {
        for &(b, sb) in &ranges[i + 1..] {
            assert!(a + sa <= b || b + sb <= a, "{a:#x} and {b:#x} overlap");
        }
    }
    assert_eq!(sim.reserved_va_bytes(0), 15 * G);
    let (a, s) = ranges[1];
    sim.free_va(0, a, s).unwrap();
    assert_eq!(sim.reserve_va(0, s, 0).unwrap(), a, "freed range is reused");
    // Size and alignment must be granularity multiples; size nonzero.
    assert_code(
        sim.reserve_va(0, G + 1, 0),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_code(sim.reserve_va(0, G, 4096), DriverErrorKind::InvalidValue, 1);
    assert_code(sim.reserve_va(0, 0, 0), DriverErrorKind::InvalidValue, 1);
}

#[test]
fn free_va_must_match_a_whole_unmapped_reservation() {
    let sim = small();
    let (base, hs) = mapped(&sim, 2);
    assert_code(sim.free_va(0, base, G), DriverErrorKind::InvalidValue, 1);
    assert_code(
        sim.free_va(0, base + G, G),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_code(
        sim.free_va(0, base, 2 * G),
        DriverErrorKind::InvalidValue,
        1,
    );
    sim.unmap(0, base, G).unwrap();
    sim.unmap(0, base + G, G).unwrap();
    sim.free_va(0, base, 2 * G).unwrap();
    assert_eq!(sim.reserved_va_bytes(0), 0);
    for h in hs {
        sim.release_physical(0, h).unwrap();
    }
    assert_eq!(sim.committed_bytes(0), 0);
}

#[test]
fn map_contracts() {
    let sim = small();
    let base = sim.reserve_va(0, 4 * G, 0).unwrap();
    let h = sim.create_physical(0, 2 * G).unwrap();
    let h1 = sim.create_physical(0, G).unwrap();
    // Wrong size, misaligned, outside a reservation, straddling its end, unknown handle.
    assert_code(sim.map(0, base, G, h), DriverErrorKind::InvalidValue, 1);
    assert_code(
        sim.map(0, base + 4096, 2 * G, h),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_code(
        sim.map(0, base + 8 * G, 2 * G, h),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_code(
        sim.map(0, base + 3 * G, 2 * G, h),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_code(
        sim.map(0, base, G, PhysHandle(9999)),
        DriverErrorKind::InvalidValue,
        400,
    );
    sim.map(0, base + G, 2 * G, h).unwrap();
    assert_eq!(sim.mapped_bytes(0), 2 * G);
    // Overlap from below and from inside.
    let h2 = sim.create_physical(0, 2 * G).unwrap();
    assert_code(
        sim.map(0, base, 2 * G, h2),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_code(
        sim.map(0, base + 2 * G, G, h1),
        DriverErrorKind::InvalidValue,
        1,
    );
    sim.release_physical(0, h2).unwrap();
    sim.map(0, base + 3 * G, G, h1).unwrap();
    // Releasing a mapped handle fails; an unknown one is an invalid handle.
    assert_code(sim.release_physical(0, h), DriverErrorKind::InvalidValue, 1);
    assert_code(
        sim.release_physical(0, PhysHandle(9999)),
        DriverErrorKind::InvalidValue,
        400,
    );
    // set_access may span mappings but not holes.
    assert_code(
        sim.set_access(0, base, 4 * G, &[]),
        DriverErrorKind::InvalidValue,
        1,
    );
    sim.set_access(0, base + G, 3 * G, &[]).unwrap();
    // unmap must match exactly one mapping.
    assert_code(sim.unmap(0, base + G, G), DriverErrorKind::InvalidValue, 1);
    assert_code(
        sim.unmap(0, base + 2 * G, G),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_code(
        sim.unmap(0, base + G, 3 * G),
        DriverErrorKind::InvalidValue,
        1,
    );
    sim.unmap(0, base + G, 2 * G).unwrap();
    sim.unmap(0, base + 3 * G, G).unwrap();
    assert_code(
        sim.unmap(0, base + 3 * G, G),
        DriverErrorKind::InvalidValue,
        1,
    );
    assert_eq!(sim.mapped_bytes(0), 0);
    sim.release_physical(0, h).unwrap();
    sim.release_physical(0, h1).unwrap();
    assert_code(
        sim.release_physical(0, h1),
        DriverErrorKind::InvalidValue,
        400,
    );
    sim.free_va(0, base, 4 * G).unwrap();
    assert_eq!(sim.live_handles(0), 0);
    assert!(sim.take_hazards().is_empty());
}

#[test]
fn capacity_oom_and_other_processes() {
    let sim = SimDriver::new(
        SimConfig::default()
            .capacity(10 * G)
            .other_process_bytes(3 * G),
    );
    let info = sim.mem_info(0).unwrap();
    assert_eq!((info.free, info.total), (7 * G, 10 * G));
    let h = sim.create_physical(0, 6 * G).unwrap();
    assert_code(
        sim.create_physical(0, 2 * G),
        DriverErrorKind::OutOfMemory,
        2,
    );
    assert_code(sim.mem_alloc(0, G + 1), DriverErrorKind::OutOfMemory, 2);
    let p = sim.mem_alloc(0, 1000).unwrap();
    assert_eq!(p % 512, 0);
    assert_eq!(sim.committed_bytes(0), 6 * G + 1000);
    assert_eq!(sim.mem_info(0).unwrap().free, G - 1000);
    assert_eq!(sim.live_handles(0), 1);
    assert_eq!(sim.live_linear_allocations(0), 1);
    sim.set_other_process_bytes(0);
    sim.create_physical(0, 2 * G).unwrap();
    assert_eq!(sim.peak_committed_bytes(0), 8 * G + 1000);
    sim.mem_free(0, p).unwrap();
    sim.release_physical(0, h).unwrap();
    assert_eq!(sim.committed_bytes(0), 2 * G);
    assert_eq!(sim.peak_committed_bytes(0), 8 * G + 1000);
    sim.reset_peak(0);
    assert_eq!(sim.peak_committed_bytes(0), 2 * G);
}

#[test]
fn linear_allocations() {
    let sim = small();
    let a = sim.mem_alloc(0, 1).unwrap();
    let b = sim.mem_alloc(0, 513).unwrap();
    let c = sim.mem_alloc(0, 4096).unwrap();
    assert_ne!(a, 0);
    assert_eq!((a | b | c) & 511, 0, "512-byte aligned");
    assert!(a < b && b + 513 <= c);
    // Linear memory does not collide with VMM reservations.
    let r = sim.reserve_va(0, G, 0).unwrap();
    assert!(r + G <= a || c + 4096 <= r);
    assert_code(sim.mem_alloc(0, 0), DriverErrorKind::InvalidValue, 1);
    assert_code(sim.mem_free(0, b + 512), DriverErrorKind::InvalidValue, 1);
    sim.mem_free(0, b).unwrap();
    assert_code(sim.mem_free(0, b), DriverErrorKind::InvalidValue, 1);
    assert_eq!(sim.mem_alloc(0, 100).unwrap(), b, "freed range is reused");
}

#[test]
fn vmm_disabled_reports_not_supported() {
    let sim = SimDriver::new(SimConfig::default().vmm(false));
    assert!(!sim.capabilities(0).unwrap().vmm);
    assert_code(sim.reserve_va(0, G, 0), DriverErrorKind::NotSupported, 801);
    assert_code(sim.free_va(0, G, G), DriverErrorKind::NotSupported, 801);
    assert_code(
        sim.create_physical(0, G),
        DriverErrorKind::NotSupported,
        801,
    );
    assert_code(
        sim.release_physical(0, PhysHandle(1)),
        DriverErrorKind::NotSupported,
        801,
    );
    assert_code(
        sim.map(0, G, G, PhysHandle(1)),
        DriverErrorKind::NotSupported,
        801,
    );
    assert_code(sim.unmap(0, G, G), DriverErrorKind::NotSupported, 801);
    assert_code(
        sim.set_access(0, G, G, &[]),
        DriverErrorKind::NotSupported,
        801,
    );
    let p = sim.mem_alloc(0, 4096).unwrap();
    sim.mem_free(0, p).unwrap();
}

#[test]
fn events_complete_when_their_work_completes() {
    let sim = small();
    let (base, _) = mapped(&sim, 1);
    let ev = sim.event_create(0).unwrap();
    assert!(sim.event_query(0, ev).unwrap(), "never recorded: complete");
    sim.event_record(0, ev, S1).unwrap();
    assert!(sim.event_query(0, ev).unwrap(), "idle stream: complete");
    sim.launch(0, S1, &[(base, 4096)]).unwrap();
    sim.launch(0, S1, &[(base, 4096)]).unwrap();
    sim.event_record(0, ev, S1).unwrap();
    let w3 = sim.launch(0, S1, &[(base, 4096)]).unwrap();
    assert_eq!(sim.unfinished_work(0), 3);
    assert_eq!((sim.unfinished_on(0, S1), sim.unfinished_on(0, S2)), (3, 0));
    assert!(!sim.event_query(0, ev).unwrap());
    assert!(sim.complete_next(0, S1));
    assert!(!sim.event_query(0, ev).unwrap());
    assert!(sim.complete_next(0, S1));
    assert!(sim.event_query(0, ev).unwrap());
    assert_eq!(sim.unfinished_work(0), 1);
    // event_synchronize completes exactly the captured work.
    let ev2 = sim.event_create(0).unwrap();
    sim.event_record(0, ev2, S1).unwrap();
    sim.launch(0, S1, &[]).unwrap();
    sim.event_synchronize(0, ev2).unwrap();
    assert_eq!(
        sim.unfinished_work(0),
        1,
        "work {w3:?} done, the later one not"
    );
    assert!(!sim.complete_next(0, S2));
    assert_eq!(sim.unfinished_on(0, S1), 1);
    sim.device_synchronize(0).unwrap();
    assert_eq!(sim.unfinished_work(0), 0);
    assert_eq!(
        sim.unfinished_on(0, S1),
        0,
        "a host wait finishes a stream's work"
    );
    // Destroyed or unknown events are invalid handles.
    assert_eq!(sim.live_events(0), 2);
    sim.event_destroy(0, ev).unwrap();
    assert_eq!(sim.live_events(0), 1);
    assert_code(sim.event_query(0, ev), DriverErrorKind::InvalidValue, 400);
    assert_code(
        sim.event_record(0, ev, S1),
        DriverErrorKind::InvalidValue,
        400,
    );
    assert_code(sim.event_destroy(0, ev), DriverErrorKind::InvalidValue, 400);
    assert_code(
        sim.stream_wait_event(0, S2, EventId(12345)),
        DriverErrorKind::InvalidValue,
        400,
    );
}

#[test]
fn launch_over_unmapped_or_inaccessible_memory_fails() {
    let sim = small();
    let base = sim.reserve_va(0, 2 * G, 0).unwrap();
    let h = sim.create_physical(0, G).unwrap();
    assert!(sim.launch(0, S1, &[(base, 1)]).is_err(), "unmapped");
    sim.map(0, base, G, h).unwrap();
    assert!(sim.launch(0, S1, &[(base, 1)]).is_err(), "no access");
    sim.set_access(0, base, G, &[]).unwrap();
    sim.launch(0, S1, &[(base, G)]).unwrap();
    assert!(sim.launch(0, S1, &[(base, G + 1)]).is_err(), "runs past");
    let p = sim.mem_alloc(0, 1000).unwrap();
    sim.launch(0, S1, &[(p, 1000)]).unwrap();
    assert!(sim.launch(0, S1, &[(p, 1001)]).is_err());
    assert!(sim.launch(0, S1, &[(0x10, 1)]).is_err());
    assert_eq!(sim.unfinished_work(0), 2);
}

#[test]
fn stream_wait_event_orders_completion() {
    let sim = small();
    let (base, _) = mapped(&sim, 2);
    sim.launch(0, S1, &[(base, 64)]).unwrap();
    let ev = sim.event_create(0).unwrap();
    sim.event_record(0, ev, S1).unwrap();
    sim.launch(0, S1, &[(base, 64)]).unwrap(); // after the record: not a dependency
    sim.stream_wait_event(0, S2, ev).unwrap();
    sim.launch(0, S2, &[(base + G, 64)]).unwrap();
    assert!(!sim.event_query(0, ev).unwrap());
    // Completing S2's work completes the work it waits for first, and only that.
    assert!(sim.complete_next(0, S2));
    assert!(sim.event_query(0, ev).unwrap());
    assert_eq!(sim.unfinished_work(0), 1);
    // An event recorded after a wait (with no work in between) covers the waited work.
    sim.event_record(0, ev, S1).unwrap();
    let ev2 = sim.event_create(0).unwrap();
    sim.stream_wait_event(0, S2, ev).unwrap();
    sim.event_record(0, ev2, S2).unwrap();
    assert!(!sim.event_query(0, ev2).unwrap());
    sim.complete_stream(0, S1);
    assert!(sim.event_query(0, ev2).unwrap());
    assert_eq!(sim.unfinished_work(0), 0);
}

#[test]
fn long_wait_chains_complete_without_recursion() {
    let sim = small();
    let ev = sim.event_create(0).unwrap();
    let n = 50_000u64;
    // Ping-pong: each launch waits on the previous stream's last work.
    for i in 0..n {
        let (from, to) = if i % 2 == 0 { (S1, S2) } else { (S2, S1) };
        sim.launch(0, from, &[]).unwrap();
        sim.event_record(0, ev, from).unwrap();
        sim.stream_wait_event(0, to, ev).unwrap();
    }
    let last = sim.launch(0, S1, &[]).unwrap();
    assert_eq!(sim.unfinished_work(0), n as usize + 1);
    sim.event_record(0, ev, S1).unwrap();
    sim.event_synchronize(0, ev).unwrap();
    assert_eq!(
        sim.unfinished_work(0),
        0,
        "{last:?} pulled in the whole chain"
    );
}

#[test]
fn handout_hazards() {
    let sim = small();
    let (base, _) = mapped(&sim, 2);
    // No unfinished work: nothing.
    sim.note_handout(0, base, G, S2);
    let w = sim.launch(0, S1, &[(base, 4096)]).unwrap();
    // Same stream: never a hazard. Disjoint memory: none.
    sim.note_handout(0, base, G, S1);
    sim.note_handout(0, base + 4096, G - 4096, S2);
    sim.note_handout(0, base + G, G, S2);
    assert!(sim.hazards().is_empty());
    // Cross-stream handout of in-use memory.
    sim.note_handout(0, base + 1024, 512, S2);
    let hz = sim.take_hazards();
    assert_eq!(
        hz,
        vec![Hazard {
            dev: 0,
            kind: HazardKind::ReuseWhileInUse,
            ptr: base + 1024,
            size: 512,
            stream: Some(S2),
            handle: None,
            other_stream: S1,
            work: w,
        }]
    );
    assert!(sim.hazards().is_empty(), "taken");
    // After completion: none.
    sim.complete_stream(0, S1);
    sim.note_handout(0, base, G, S2);
    assert!(sim.hazards().is_empty());
}

#[test]
fn no_handout_hazard_after_stream_wait_event() {
    let sim = small();
    let (base, _) = mapped(&sim, 1);
    sim.launch(0, S1, &[(base, 4096)]).unwrap();
    let ev = sim.event_create(0).unwrap();
    sim.event_record(0, ev, S1).unwrap();
    sim.stream_wait_event(0, S2, ev).unwrap();
    sim.note_handout(0, base, 4096, S2);
    assert!(sim.hazards().is_empty());
    // Work launched after the record is not covered.
    sim.launch(0, S1, &[(base, 4096)]).unwrap();
    sim.note_handout(0, base, 4096, S2);
    assert_eq!(sim.take_hazards().len(), 1);
    // Transitively: S3 waits on S2 whose pending work waits on S1.
    let s3 = StreamId(3);
    let ev1 = sim.event_create(0).unwrap();
    sim.event_record(0, ev1, S1).unwrap();
    sim.stream_wait_event(0, S2, ev1).unwrap();
    sim.launch(0, S2, &[]).unwrap();
    let ev2 = sim.event_create(0).unwrap();
    sim.event_record(0, ev2, S2).unwrap();
    sim.stream_wait_event(0, s3, ev2).unwrap();
    sim.note_handout(0, base, 4096, s3);
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
}

#[test]
fn handout_hazard_follows_a_remapped_page() {
    let sim = small();
    let (base, hs) = mapped(&sim, 1);
    let w = sim.launch(0, S1, &[(base, G)]).unwrap();
    sim.unmap(0, base, G).unwrap();
    let unmap_hz = sim.take_hazards();
    assert_eq!(unmap_hz.len(), 1);
    assert_eq!(unmap_hz[0].kind, HazardKind::UnmapWhileInUse);
    assert_eq!((unmap_hz[0].ptr, unmap_hz[0].work), (base, w));
    // The same physical page at a new address is still in use by S1's work.
    let other = sim.reserve_va(0, G, 0).unwrap();
    sim.map(0, other, G, hs[0]).unwrap();
    sim.set_access(0, other, G, &[]).unwrap();
    sim.note_handout(0, other + 4096, 4096, S2);
    let hz = sim.take_hazards();
    assert_eq!(hz.len(), 1);
    assert_eq!(
        (hz[0].kind, hz[0].ptr, hz[0].work),
        (HazardKind::ReuseWhileInUse, other + 4096, w)
    );
    // A different page at the old address is not.
    let h2 = sim.create_physical(0, G).unwrap();
    sim.map(0, base, G, h2).unwrap();
    sim.note_handout(0, base, G, S2);
    assert!(sim.hazards().is_empty());
    // Releasing a handle that work still touches.
    sim.unmap(0, other, G).unwrap();
    sim.take_hazards();
    sim.release_physical(0, hs[0]).unwrap();
    let hz = sim.take_hazards();
    assert_eq!(hz.len(), 1);
    assert_eq!(
        (hz[0].kind, hz[0].handle),
        (HazardKind::ReleaseWhileInUse, Some(hs[0]))
    );
}

/// One handle mapped at two addresses: unmapping the alias that no work was launched over is
/// not a hazard (a move maps at the new address first and unmaps the old one later), while
/// unmapping the one the work uses is.
#[test]
fn unmap_hazards_follow_the_address_the_work_used() {
    let sim = small();
    let (base, hs) = mapped(&sim, 1);
    let other = sim.reserve_va(0, G, 0).unwrap();
    sim.map(0, other, G, hs[0]).unwrap();
    sim.set_access(0, other, G, &[]).unwrap();
    let w = sim.launch(0, S2, &[(other, G)]).unwrap();
    sim.unmap(0, base, G).unwrap();
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
    sim.unmap(0, other, G).unwrap();
    let hz = sim.take_hazards();
    assert_eq!(hz.len(), 1);
    assert_eq!(
        (hz[0].kind, hz[0].ptr, hz[0].work),
        (HazardKind::UnmapWhileInUse, other, w)
    );
    // Work over an address now mapped to other memory is not disturbed either.
    let h2 = sim.create_physical(0, G).unwrap();
    sim.map(0, base, G, h2).unwrap();
    sim.unmap(0, base, G).unwrap();
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
}

#[test]
fn linear_memory_hazards_and_mem_free_synchronises() {
    let sim = small();
    let p = sim.mem_alloc(0, 8192).unwrap();
    let q = sim.mem_alloc(0, 8192).unwrap();
    sim.launch(0, S1, &[(p + 100, 10)]).unwrap();
    sim.launch(0, S2, &[(q, 10)]).unwrap();
    sim.note_handout(0, p, 8192, S2);
    assert_eq!(sim.take_hazards().len(), 1);
    sim.mem_free(0, q).unwrap();
    assert_eq!(
        sim.unfinished_work(0),
        0,
        "mem_free synchronised the device"
    );
    assert!(sim.hazards().is_empty());
}

#[test]
fn backing_follows_a_remapped_page() {
    let sim = backed();
    let (base, hs) = mapped(&sim, 2);
    assert_eq!(sim.read(0, base + G - 2, 4).unwrap(), vec![0; 4]);
    // A write that spans two mappings and a chunk boundary.
    let data: Vec<u8> = (0..200u8).collect();
    sim.write(0, base + G - 100, &data).unwrap();
    assert_eq!(sim.read(0, base + G - 100, 200).unwrap(), data);
    // Move the second page elsewhere: its data goes with it.
    sim.unmap(0, base + G, G).unwrap();
    assert!(sim.read(0, base + G, 1).is_err(), "unmapped");
    let other = sim.reserve_va(0, G, 0).unwrap();
    sim.map(0, other, G, hs[1]).unwrap();
    assert!(sim.read(0, other, 1).is_err(), "no access yet");
    assert!(sim.write(0, other, &[1]).is_err(), "no access yet");
    sim.set_access(0, other, G, &[]).unwrap();
    assert_eq!(sim.read(0, other, 100).unwrap(), data[100..]);
    assert_eq!(sim.read(0, base + G - 100, 100).unwrap(), data[..100]);
    // Linear memory is backed too.
    let p = sim.mem_alloc(0, 10).unwrap();
    sim.write(0, p, b"hello").unwrap();
    assert_eq!(sim.read(0, p, 10).unwrap(), b"hello\0\0\0\0\0");
    assert!(sim.read(0, p, 11).is_err());
    // Without backing: not supported.
    let plain = small();
    let (b2, _) = mapped(&plain, 1);
    assert_code(plain.read(0, b2, 1), DriverErrorKind::NotSupported, 801);
    assert_code(plain.write(0, b2, &[0]), DriverErrorKind::NotSupported, 801);
}

#[test]
fn fail_nth_fails_once_without_side_effects() {
    let sim = small();
    sim.fail_nth(DriverCall::CreatePhysical, 2);
    let h = sim.create_physical(0, G).unwrap();
    let e = sim.create_physical(0, G).unwrap_err();
    assert_eq!((e.kind, e.code), (DriverErrorKind::OutOfMemory, 2));
    assert!(e.message.contains("injected fault"));
    assert_eq!((sim.live_handles(0), sim.committed_bytes(0)), (1, G));
    sim.create_physical(0, G).unwrap();
    // Other calls fail with CUDA_ERROR_UNKNOWN, and nothing changes.
    let base = sim.reserve_va(0, G, 0).unwrap();
    sim.fail_nth(DriverCall::Map, 1);
    let e = sim.map(0, base, G, h).unwrap_err();
    assert_eq!((e.kind, e.code), (DriverErrorKind::Other, 999));
    assert!(e.message.contains("injected fault"));
    assert_eq!(sim.mapped_bytes(0), 0);
    sim.map(0, base, G, h).unwrap();
    sim.fail_nth(DriverCall::Unmap, 1);
    assert!(sim.unmap(0, base, G).is_err());
    assert_eq!(sim.mapped_bytes(0), G);
    sim.unmap(0, base, G).unwrap();
    sim.fail_nth(DriverCall::MemFree, 1);
    let p = sim.mem_alloc(0, 512).unwrap();
    sim.launch(0, S1, &[(p, 1)]).unwrap();
    assert!(sim.mem_free(0, p).is_err());
    assert_eq!(sim.live_linear_allocations(0), 1);
    assert_eq!(
        sim.unfinished_work(0),
        1,
        "failed mem_free did not synchronise"
    );
    // Counters count failed calls too.
    assert_eq!(sim.calls(DriverCall::CreatePhysical), 3);
    assert_eq!(sim.calls(DriverCall::Map), 2);
    assert_eq!(sim.calls(DriverCall::Unmap), 2);
    assert_eq!(sim.calls(DriverCall::MemFree), 1);
    let counts = sim.call_counts();
    assert_eq!(counts.get(&DriverCall::ReserveVa), Some(&1));
    assert!(!counts.contains_key(&DriverCall::EventCreate));
    sim.reset_counters();
    assert!(sim.call_counts().is_empty());
}

#[test]
fn fail_from_fails_until_cleared() {
    let sim = small();
    sim.fail_from(DriverCall::EventCreate, 2);
    sim.event_create(0).unwrap();
    for _ in 0..3 {
        let e = sim.event_create(0).unwrap_err();
        assert_eq!((e.kind, e.code), (DriverErrorKind::Other, 999));
    }
    assert_eq!(sim.live_events(0), 1);
    sim.fail_from(DriverCall::MemAlloc, 1);
    assert_code(sim.mem_alloc(0, 1), DriverErrorKind::OutOfMemory, 2);
    assert_eq!(sim.live_linear_allocations(0), 0);
    sim.clear_faults();
    sim.event_create(0).unwrap();
    sim.mem_alloc(0, 1).unwrap();
    assert_eq!(sim.calls(DriverCall::EventCreate), 5);
}

#[test]
fn byte_budget_fails_commits_above_it() {
    let sim = small();
    sim.fail_after_bytes(3 * G);
    sim.create_physical(0, 2 * G).unwrap();
    let e = sim.create_physical(0, 2 * G).unwrap_err();
    assert!(e.is_oom() && e.message.contains("injected fault"), "{e}");
    assert_code(sim.mem_alloc(0, G + 1), DriverErrorKind::OutOfMemory, 2);
    assert_eq!(sim.committed_bytes(0), 2 * G);
    sim.create_physical(0, G).unwrap();
    sim.clear_faults();
    sim.create_physical(0, 2 * G).unwrap();
    assert_eq!(sim.committed_bytes(0), 5 * G);
}

#[test]
fn latencies_are_spent() {
    let lat = SimLatencies::none().with(DriverCall::MemInfo, Duration::from_millis(2));
    let sim = SimDriver::new(SimConfig::default().latencies(lat));
    let t = Instant::now();
    sim.mem_info(0).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(2));
    let r = SimLatencies::realistic();
    assert!(DriverCall::ALL.iter().all(|&c| r.get(c).is_some()));
    // The default cost table's figures.
    assert_eq!(
        r.get(DriverCall::CreatePhysical),
        Some(Duration::from_micros(195))
    );
    assert_eq!(
        r.get(DriverCall::SetAccess),
        Some(Duration::from_micros(36))
    );
    assert_eq!(r.get(DriverCall::Map), Some(Duration::from_nanos(1500)));
}

// --- modelled host time and host waits ---------------------------------------------------------

#[test]
fn modelled_time_is_the_sum_of_counts_times_cost() {
    // A small program: reserve 4 pages, create + map 4 handles, one set_access over all four
    // mappings, a linear allocation of 64 MiB, events, unmap + release, free the reservation.
    let costs = CostTable::default().with(
        DriverCall::Map,
        CallCost {
            per_call_us: 2.0,
            per_mib_us: Some(0.25),
        },
    );
    let sim = SimDriver::new(SimConfig::default().capacity(64 * G).costs(costs));
    let (base, hs) = mapped(&sim, 4);
    let lin = sim.mem_alloc(0, 64 * MIB).unwrap();
    let ev = sim.event_create(0).unwrap();
    sim.event_record(0, ev, S1).unwrap();
    sim.event_query(0, ev).unwrap();
    sim.event_synchronize(0, ev).unwrap();
    sim.event_destroy(0, ev).unwrap();
    for (i, h) in hs.into_iter().enumerate() {
        sim.unmap(0, base + i as u64 * G, G).unwrap();
        sim.release_physical(0, h).unwrap();
    }
    sim.free_va(0, base, 4 * G).unwrap();
    sim.mem_free(0, lin).unwrap();
    sim.device_synchronize(0).unwrap();

    let c = |k| costs.get(k).per_call_us;
    let map_mib = 4.0 * 0.25 * 2.0; // four 2 MiB maps at 0.25 us/MiB
    let mem_alloc_mib = 64.0 * costs.get(DriverCall::MemAlloc).per_mib_us.unwrap();
    let expected = c(DriverCall::ReserveVa)
        + 4.0 * c(DriverCall::CreatePhysical)
        + 4.0 * c(DriverCall::Map)
        + map_mib
        + 4.0 * c(DriverCall::SetAccess) // one call spanning four mappings
        + c(DriverCall::MemAlloc)
        + mem_alloc_mib
        + c(DriverCall::EventCreate)
        + c(DriverCall::EventRecord)
        + c(DriverCall::EventQuery)
        + c(DriverCall::EventSynchronize)
        + c(DriverCall::EventDestroy)
        + 4.0 * c(DriverCall::Unmap)
        + 4.0 * c(DriverCall::ReleasePhysical)
        + c(DriverCall::FreeVa)
        + c(DriverCall::MemFree)
        + c(DriverCall::DeviceSynchronize);
    let got = sim.modelled_time_us();
    assert!((got - expected).abs() < 1e-6, "{got} != {expected}");
    assert_eq!(sim.calls(DriverCall::SetAccess), 1);
    let by_kind: f64 = sim.modelled_time_by_kind().values().sum();
    assert!((by_kind - expected).abs() < 1e-6);
    assert!((sim.modelled_time_us_of(DriverCall::SetAccess) - 4.0 * 36.0).abs() < 1e-9);
    // Host waits: event_synchronize, mem_free and device_synchronize, one each.
    assert_eq!(sim.host_waits(), 3);
    sim.reset_counters();
    assert_eq!((sim.modelled_time_us(), sim.host_waits()), (0.0, 0));
}

#[test]
fn host_waits_are_counted_and_priced_only_when_asked() {
    let sim = SimDriver::new(SimConfig::default().capacity(64 * G));
    let ev = sim.event_create(0).unwrap();
    sim.event_synchronize(0, ev).unwrap();
    assert_eq!(sim.host_waits(), 1);
    sim.device_synchronize(0).unwrap();
    assert_eq!(sim.host_waits(), 2);
    let p = sim.mem_alloc(0, G).unwrap();
    sim.mem_free(0, p).unwrap();
    assert_eq!(sim.host_waits(), 3);
    // Non-waiting calls do not count.
    sim.event_record(0, ev, S1).unwrap();
    sim.event_query(0, ev).unwrap();
    assert_eq!(sim.host_waits(), 3);
    // By default a wait adds no duration; with host_wait_us it adds that much per wait.
    let base = CostTable::default();
    let t0 = sim.modelled_time_us();
    let sim = SimDriver::new(SimConfig::default().costs(base.with_host_wait_us(100.0)));
    sim.device_synchronize(0).unwrap();
    let t1 = sim.modelled_time_us();
    assert!((t1 - (100.0 + base.get(DriverCall::DeviceSynchronize).per_call_us)).abs() < 1e-9);
    assert!(t0 > 0.0);
}

#[test]
fn cost_table_json_round_trip() {
    let t = CostTable::default()
        .with(
            DriverCall::Unmap,
            CallCost {
                per_call_us: 7.25,
                per_mib_us: Some(0.5),
            },
        )
        .with_host_wait_us(3.0);
    let text = serde_json::to_string(&t).unwrap();
    let back: CostTable = serde_json::from_str(&text).unwrap();
    assert_eq!(back, t);
    assert_eq!(CostTable::from_json_str(&text, "t.json").unwrap(), t);
    // Every kind is written under its key.
    let v = t.to_json_value();
    for c in DriverCall::ALL {
        assert!(v[c.key()]["per_call_us"].is_number(), "{}", c.key());
    }
    // Plain numbers, comments, sources and missing kinds (which keep the default).
    let t = CostTable::from_json_str(
        r#"{"_comment": "measured", "map": 3, "unmap": {"per_call_us": 4, "source": "me"}}"#,
        "m.json",
    )
    .unwrap();
    assert_eq!(t.get(DriverCall::Map), CallCost::flat(3.0));
    assert_eq!(t.get(DriverCall::Unmap), CallCost::flat(4.0));
    assert_eq!(
        t.get(DriverCall::CreatePhysical),
        CostTable::default().get(DriverCall::CreatePhysical)
    );
}

#[test]
fn cost_table_errors_name_the_file_the_key_and_the_fix() {
    let e = |text: &str| CostTable::from_json_str(text, "bad.json").unwrap_err();
    let m = e(r#"{"mapp": 1}"#);
    assert!(m.starts_with("bad.json: unknown key `mapp`"), "{m}");
    assert!(m.contains("rename it") && m.contains("set_access") && m.contains("host_wait_us"));
    let m = e(r#"{"map": -1}"#);
    assert!(m.contains("`map`") && m.contains(">= 0"), "{m}");
    let m = e(r#"{"map": 1e12}"#);
    assert!(m.contains("`map`") && m.contains("1e9"), "{m}");
    let m = e(r#"{"mem_free": {"per_call_us": 30, "per_mib_us": 1}}"#);
    assert!(
        m.contains("mem_free names no size") && m.contains("fold it"),
        "{m}"
    );
    let m = e(r#"{"map": "fast"}"#);
    assert!(m.contains("`map`") && m.contains("string"), "{m}");
    let m = e(r#"{"map": {"per_call": 1}}"#);
    assert!(
        m.contains("`map.per_call`") && m.contains("per_call_us"),
        "{m}"
    );
    let m = e(r#"{"map": {"per_mib_us": 1}}"#);
    assert!(m.contains("no `per_call_us`"), "{m}");
    let m = e("[1, 2]");
    assert!(m.contains("bad.json") && m.contains("object"), "{m}");
    let m = e("{not json");
    assert!(m.starts_with("bad.json: not valid JSON"), "{m}");
    let m = CostTable::from_json_file("/nonexistent/costs.json").unwrap_err();
    assert!(m.starts_with("/nonexistent/costs.json: cannot read"), "{m}");
}

#[test]
fn granularity_is_normalised() {
    let sim = SimDriver::new(SimConfig::default().granularity(3 * MIB));
    assert_eq!(sim.capabilities(0).unwrap().granularity, 4 * MIB);
    let sim = SimDriver::new(SimConfig::default().granularity(0));
    assert_eq!(sim.config().granularity, 2 * MIB);
}

/// A configuration from code that would allocate without bound (a vector of 4 billion devices
/// aborted the process; a 512 B granularity made page tables of gigabytes) panics with the
/// reason in `new`, and is an error naming the fix in `try_new`.
#[test]
fn unbounded_configurations_are_refused_from_code() {
    for (config, says) in [
        (SimConfig::default().devices(4_294_967_295), "devices"),
        (SimConfig::default().devices(0), "devices"),
        (SimConfig::default().granularity(512), "granularity"),
    ] {
        let Err(e) = SimDriver::try_new(config.clone()) else {
            panic!("{config:?} was accepted");
        };
        assert!(e.contains(says), "{e}");
        let panic = std::panic::catch_unwind(|| SimDriver::new(config)).unwrap_err();
        let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains(says) && msg.contains("try_new"), "{msg}");
    }
    // try_new checks the capacity as well; new leaves it to the caller (replays size devices
    // from traces).
    assert!(SimDriver::try_new(SimConfig::default().capacity(1 << 20)).is_err());
    assert!(SimDriver::try_new(SimConfig::default()).is_ok());
}

#[test]
fn threads_create_map_unmap_release_concurrently() {
    let sim = Arc::new(SimDriver::new(SimConfig::default().capacity(256 * G)));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let sim = Arc::clone(&sim);
            std::thread::spawn(move || {
                let stream = StreamId(t + 1);
                let base = sim.reserve_va(0, 8 * G, 0).unwrap();
                for i in 0..200u64 {
                    let n = i % 4 + 1;
                    let h = sim.create_physical(0, n * G).unwrap();
                    let addr = base + (i % 2) * 4 * G;
                    sim.map(0, addr, n * G, h).unwrap();
                    sim.set_access(0, addr, n * G, &[]).unwrap();
                    sim.launch(0, stream, &[(addr, 4096)]).unwrap();
                    sim.note_handout(0, addr, 4096, stream);
                    sim.complete_stream(0, stream);
                    sim.unmap(0, addr, n * G).unwrap();
                    sim.release_physical(0, h).unwrap();
                }
                sim.free_va(0, base, 8 * G).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(sim.committed_bytes(0), 0);
    assert_eq!(sim.live_handles(0), 0);
    assert_eq!(sim.mapped_bytes(0), 0);
    assert_eq!(sim.reserved_va_bytes(0), 0);
    assert_eq!(sim.unfinished_work(0), 0);
    assert!(sim.hazards().is_empty(), "{:?}", sim.hazards());
    assert_eq!(sim.calls(DriverCall::CreatePhysical), 800);
}

#[test]
fn interval_set() {
    let mut s = IntervalSet::default();
    s.insert(10, 20);
    s.insert(30, 40);
    s.insert(20, 30);
    assert_eq!(s.map.len(), 1);
    assert!(s.contains(10, 40) && !s.contains(9, 11));
    s.remove(15, 35);
    assert_eq!(
        s.map.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        vec![(10, 15), (35, 40)]
    );
    assert_eq!(s.alloc(4, 4), Some(36), "12 + 4 would pass 15");
    assert_eq!(s.alloc(5, 1), Some(10));
    assert_eq!(s.alloc(1, 1), Some(35));
    assert_eq!(s.alloc(10, 1), None);
}

#[test]
fn a_capture_records_launches_and_refuses_what_it_forbids() {
    let sim = small();
    let (base, hs) = mapped(&sim, 2);
    let ev = sim.event_create(0).unwrap();
    sim.begin_capture(0, S1).unwrap();
    assert!(sim.begin_capture(0, S1).is_err(), "captured twice");
    assert!(sim.capturing());
    // Launches on the capturing stream are recorded, not queued; others run.
    assert_eq!(sim.launch(0, S1, &[(base, G)]).unwrap(), WorkId(0));
    sim.launch(0, S2, &[(base + G, G)]).unwrap();
    assert_eq!(sim.unfinished_work(0), 1);
    // Allowed: VMM calls, cuMemAlloc (the backend relaxes it), events on other streams.
    let h = sim.create_physical(0, G).unwrap();
    sim.release_physical(0, h).unwrap();
    let lin = sim.mem_alloc(0, 4096).unwrap();
    sim.event_record(0, ev, S2).unwrap();
    sim.stream_wait_event(0, S2, ev).unwrap();
    assert!(sim.capture_violations().is_empty());
    // Graph-joining calls on the capturing stream, and every query or wait, are refused.
    let code = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    assert_code(sim.event_record(0, ev, S1), DriverErrorKind::Other, code);
    assert_code(
        sim.stream_wait_event(0, S1, ev),
        DriverErrorKind::Other,
        code,
    );
    assert_code(sim.event_query(0, ev), DriverErrorKind::Other, code);
    assert_code(sim.event_synchronize(0, ev), DriverErrorKind::Other, code);
    assert_code(sim.stream_synchronize(0, S2), DriverErrorKind::Other, code);
    assert_code(sim.device_synchronize(0), DriverErrorKind::Other, code);
    assert_code(sim.mem_free(0, lin), DriverErrorKind::Other, code);
    let calls: Vec<DriverCall> = sim.capture_violations().iter().map(|v| v.call).collect();
    assert_eq!(
        calls,
        [
            DriverCall::EventRecord,
            DriverCall::StreamWaitEvent,
            DriverCall::EventQuery,
            DriverCall::EventSynchronize,
            DriverCall::StreamSynchronize,
            DriverCall::DeviceSynchronize,
            DriverCall::MemFree,
        ]
    );
    let e = sim.end_capture(0, S1).unwrap_err();
    assert!(e.contains("cuEventQuery"), "{e}");
    assert!(!sim.capturing());
    assert!(sim.end_capture(0, S1).is_err(), "not capturing any more");
    sim.mem_free(0, lin).unwrap();
    sim.device_synchronize(0).unwrap();

    // A valid capture's graph replays over the memory it captured, translated at launch: once
    // that memory is unmapped, the replay fails.
    sim.begin_capture(0, S1).unwrap();
    sim.launch(0, S1, &[(base, 2 * G)]).unwrap();
    sim.launch(0, S1, &[(base, 4096)]).unwrap();
    let graph = sim.end_capture(0, S1).unwrap();
    assert_eq!(
        graph.launches,
        vec![vec![(base, 2 * G)], vec![(base, 4096)]]
    );
    assert_eq!(sim.launch_graph(&graph, S2).unwrap().len(), 2);
    assert_eq!(sim.unfinished_work(0), 2);
    sim.complete_all(0);
    sim.unmap(0, base + G, G).unwrap();
    assert!(sim.launch_graph(&graph, S2).is_err());
    sim.unmap(0, base, G).unwrap();
    for h in hs {
        sim.release_physical(0, h).unwrap();
    }
    sim.event_destroy(0, ev).unwrap();
}
