//! Peer access on the simulator: which devices may touch a device's pool memory, on every
//! mapping present and future, and what a failure leaves behind.

use cistern::driver::DriverCall;
use cistern::{Error, SimConfig, StreamId};

use crate::common::*;

fn two_devices() -> SimConfig {
    SimConfig::default().devices(2).capacity(4 * GIB)
}

/// Whether device 1 may touch `[p, p + len)` of device 0.
fn peer_sees(sim: &cistern::SimDriver, p: u64, len: u64) -> bool {
    sim.accessible(0, p, len, 1)
}

#[test]
fn peer_access_all_grants_every_mapping_from_the_start() {
    let (sim, pool) = pool_with(two_devices(), true, "peer_access:all");
    assert_eq!(pool.device(0).unwrap().peers(), vec![1]);
    assert_eq!(pool.device(1).unwrap().peers(), vec![0]);
    let large = alloc(&pool, 30 * MIB, 1);
    let small = alloc(&pool, 4 * KIB, 1);
    assert!(sim.accessible(0, large, 30 * MIB, 0));
    assert!(peer_sees(&sim, large, 30 * MIB));
    assert!(peer_sees(&sim, small, 4 * KIB));
    free(&pool, large, 1);
    free(&pool, small, 1);
    assert_no_leak(&sim, pool);
}

#[test]
fn by_default_only_the_owner_has_access() {
    let (sim, pool) = pool_with(two_devices(), true, "");
    let p = alloc(&pool, 30 * MIB, 1);
    assert!(sim.accessible(0, p, 30 * MIB, 0));
    assert!(!peer_sees(&sim, p, 30 * MIB));
    assert!(pool.device(0).unwrap().peers().is_empty());
    free(&pool, p, 1);
    assert_no_leak(&sim, pool);
}

#[test]
fn enable_peer_access_covers_present_and_future_mappings() {
    let (sim, pool) = pool_with(two_devices(), true, "");
    let before = alloc(&pool, 30 * MIB, 1);
    let small = alloc(&pool, 4 * KIB, 1);
    let donor = alloc(&pool, 40 * MIB, 2);
    // Cached, unmapped-later pages: a block freed leaves its pages mapped as cache.
    let cached = alloc(&pool, 10 * MIB, 1);
    free(&pool, cached, 1);
    let set_access = sim.calls(DriverCall::SetAccess);
    pool.enable_peer_access(0, 1).unwrap();
    assert!(
        sim.calls(DriverCall::SetAccess) > set_access,
        "no access was granted"
    );
    // Twice is a no-op, with no driver call.
    let set_access = sim.calls(DriverCall::SetAccess);
    pool.enable_peer_access(0, 1).unwrap();
    assert_eq!(sim.calls(DriverCall::SetAccess), set_access);
    assert_eq!(pool.device(0).unwrap().peers(), vec![1]);
    for (p, len) in [(before, 30 * MIB), (small, 4 * KIB), (donor, 40 * MIB)] {
        assert!(peer_sees(&sim, p, len), "{p:#x}+{len} not granted");
    }
    // New growth, a cache hit on the pages cached before, and pages stitched from stream 2.
    let grown = alloc(&pool, 64 * MIB, 1);
    let hit = alloc(&pool, 10 * MIB, 1);
    free(&pool, donor, 2);
    let creates = sim.calls(DriverCall::CreatePhysical);
    let stitched = alloc(&pool, 40 * MIB, 3);
    assert_eq!(
        sim.calls(DriverCall::CreatePhysical),
        creates,
        "not served from stream 2's cached pages"
    );
    for (p, len) in [(grown, 64 * MIB), (hit, 10 * MIB), (stitched, 40 * MIB)] {
        assert!(peer_sees(&sim, p, len), "{p:#x}+{len} not granted");
    }
    // Device 1's own memory is not device 0's business.
    let other = pool.alloc_raw(1, 8 * MIB, StreamId(1)).unwrap();
    assert!(!sim.accessible(1, other, 8 * MIB, 0));
    pool.free_raw(other, StreamId(1)).unwrap();
    for (p, s) in [(before, 1), (small, 1), (grown, 1), (hit, 1), (stitched, 3)] {
        free(&pool, p, s);
    }
    assert_no_leak(&sim, pool);
}

#[test]
fn enable_peer_access_rejects_what_cannot_work() {
    let (_, pool) = pool_with(two_devices(), true, "");
    let own = pool.enable_peer_access(0, 0).unwrap_err();
    assert!(
        matches!(own, Error::InvalidArgument(ref m) if m.contains("own device")),
        "{own}"
    );
    let missing = pool.enable_peer_access(0, 2).unwrap_err();
    assert!(
        matches!(
            missing,
            Error::InvalidDevice {
                device: 2,
                count: 2,
                ..
            }
        ),
        "{missing}"
    );
    let (_, pool) = pool_with(two_devices().peers(false), true, "");
    let no = pool.enable_peer_access(0, 1).unwrap_err();
    assert!(
        matches!(no, Error::InvalidArgument(ref m) if m.contains("cuDeviceCanAccessPeer")),
        "{no}"
    );
    assert!(pool.device(0).unwrap().peers().is_empty());
    // peer_access:all takes only the devices that can.
    let (_, pool) = pool_with(two_devices().peers(false), true, "peer_access:all");
    assert!(pool.device(0).unwrap().peers().is_empty());
}

#[test]
fn a_failed_grant_adds_no_peer_and_loses_nothing() {
    let (sim, pool) = pool_with(two_devices(), true, "");
    let a = alloc(&pool, 30 * MIB, 1);
    let b = alloc(&pool, 30 * MIB, 2);
    sim.fail_nth(DriverCall::SetAccess, 2);
    let e = pool.enable_peer_access(0, 1).unwrap_err();
    assert!(matches!(e, Error::Driver(_)), "{e}");
    assert!(pool.device(0).unwrap().peers().is_empty());
    check(&pool);
    // New mappings still get no peer; a retry grants everything.
    let c = alloc(&pool, 30 * MIB, 1);
    assert!(!peer_sees(&sim, c, 30 * MIB));
    sim.clear_faults();
    pool.enable_peer_access(0, 1).unwrap();
    for p in [a, b, c] {
        assert!(peer_sees(&sim, p, 30 * MIB));
    }
    free(&pool, a, 1);
    free(&pool, b, 2);
    free(&pool, c, 1);
    assert_no_leak(&sim, pool);
}

#[test]
fn without_vmm_the_peer_is_recorded_and_no_call_is_made() {
    let (sim, pool) = pool_with(two_devices(), false, "");
    let p = alloc(&pool, 30 * MIB, 1);
    let set_access = sim.calls(DriverCall::SetAccess);
    pool.enable_peer_access(0, 1).unwrap();
    assert_eq!(sim.calls(DriverCall::SetAccess), set_access);
    assert_eq!(pool.device(0).unwrap().peers(), vec![1]);
    free(&pool, p, 1);
    assert_no_leak(&sim, pool);
}

#[test]
fn peer_access_key_is_parsed_and_named_in_errors() {
    use cistern::config::PeerAccess;
    use cistern::Config;
    assert_eq!(Config::default().peer_access, PeerAccess::None);
    assert_eq!(
        Config::parse("peer_access:ALL").unwrap().peer_access,
        PeerAccess::All
    );
    let e = Config::parse("peer_access:some").unwrap_err().to_string();
    assert!(
        e.contains("peer_access") && e.contains("all or none"),
        "{e}"
    );
}
