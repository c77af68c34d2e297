//! The pool's observer (`Pool::set_observer`): every mapping, unmapping, segment and completed
//! free is reported, once, with its range; a `record_stream`ed free completes only when the
//! other stream's work has.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::common::*;
use cistern::{PoolEvent, PoolEventKind, StreamId};

const A: u64 = 1;
const B: u64 = 2;

fn watch(pool: &SimPool) -> Arc<Mutex<Vec<PoolEvent>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    pool.set_observer(Some(Arc::new(move |e: &PoolEvent| s.lock().push(*e))));
    seen
}

fn total(seen: &[PoolEvent], kind: PoolEventKind) -> u64 {
    seen.iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.bytes)
        .sum()
}

/// VMM: what is mapped is what the driver committed; a free completes at once with the block's
/// range; `empty_cache` unmaps everything that was mapped.
#[test]
fn mappings_and_frees_are_reported() {
    let (sim, pool) = pool(GIB, true);
    let seen = watch(&pool);
    let p = alloc(&pool, 200 * MIB, A);
    let q = alloc(&pool, 3 * MIB, A);
    assert_eq!(
        total(&seen.lock(), PoolEventKind::SegmentMap),
        sim.committed_bytes(0)
    );
    assert!(seen.lock().iter().all(|e| e.device == 0));
    free(&pool, p, A);
    let completed: Vec<PoolEvent> = seen
        .lock()
        .iter()
        .filter(|e| e.kind == PoolEventKind::FreeCompleted)
        .copied()
        .collect();
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0].addr, p);
    assert!(completed[0].bytes >= 200 * MIB);
    free(&pool, q, A);
    pool.empty_cache();
    let s = seen.lock();
    assert_eq!(sim.committed_bytes(0), 0);
    assert_eq!(
        total(&s, PoolEventKind::SegmentUnmap),
        total(&s, PoolEventKind::SegmentMap)
    );
    assert_eq!(total(&s, PoolEventKind::FreeCompleted), 200 * MIB + 3 * MIB);
    drop(s);
    assert_no_leak(&sim, pool);
}

/// A block used by stream B and freed on A completes only once B's work has: its
/// `FreeCompleted` comes at the poll after `complete_stream`, not at the free.
#[test]
fn a_record_stream_free_completes_when_the_other_stream_is_done() {
    both(|vmm| {
        let (sim, pool) = pool(GIB, vmm);
        let seen = watch(&pool);
        let x = alloc(&pool, 100 * MIB, A);
        sim.launch(0, StreamId(B), &[(x, 100 * MIB)]).unwrap();
        pool.record_stream(x, StreamId(B)).unwrap();
        free(&pool, x, A);
        let completed = |s: &[PoolEvent]| {
            s.iter()
                .filter(|e| e.kind == PoolEventKind::FreeCompleted && e.addr == x)
                .count()
        };
        assert_eq!(completed(&seen.lock()), 0, "completed while B still runs");
        sim.complete_stream(0, StreamId(B));
        // Any allocation polls the pending frees.
        let y = alloc(&pool, 100 * MIB, A);
        assert_eq!(completed(&seen.lock()), 1);
        free(&pool, y, A);
        assert_no_leak(&sim, pool);
    });
}

/// Without VMM, segments are reported as allocated and freed.
#[test]
fn linear_segments_are_reported() {
    let (sim, pool) = pool(GIB, false);
    let seen = watch(&pool);
    let p = alloc(&pool, 30 * MIB, A);
    free(&pool, p, A);
    pool.empty_cache();
    let s = seen.lock();
    let allocated = total(&s, PoolEventKind::SegmentAlloc);
    assert!(allocated >= 30 * MIB);
    assert_eq!(total(&s, PoolEventKind::SegmentFree), allocated);
    assert_eq!(total(&s, PoolEventKind::SegmentMap), 0);
    drop(s);
    assert_no_leak(&sim, pool);
}

/// The observer set on the pool reaches devices created after it; removing it stops events.
#[test]
fn the_observer_reaches_later_devices_and_can_be_removed() {
    let (sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB).devices(2),
        true,
        "",
    );
    let seen = watch(&pool);
    let d1 = pool.device(1).unwrap();
    let p = d1.alloc_raw(4 * MIB, StreamId(A)).unwrap();
    assert!(seen
        .lock()
        .iter()
        .any(|e| e.device == 1 && e.kind == PoolEventKind::SegmentMap));
    pool.set_observer(None);
    let n = seen.lock().len();
    d1.free_raw(p, StreamId(A)).unwrap();
    assert_eq!(seen.lock().len(), n);
    assert_no_leak(&sim, pool);
}

/// Dropping the pool unmaps (or frees) what it still caches, and says so: maps and unmaps,
/// segment allocations and frees, balance.
#[test]
fn dropping_the_pool_reports_what_it_gives_back() {
    both(|vmm| {
        let (sim, pool) = pool(GIB, vmm);
        let seen = watch(&pool);
        let p = alloc(&pool, 50 * MIB, A);
        free(&pool, p, A);
        drop(pool);
        assert_eq!(sim.committed_bytes(0), 0);
        let s = seen.lock();
        let (got, gave) = if vmm {
            (PoolEventKind::SegmentMap, PoolEventKind::SegmentUnmap)
        } else {
            (PoolEventKind::SegmentAlloc, PoolEventKind::SegmentFree)
        };
        assert!(total(&s, got) >= 50 * MIB);
        assert_eq!(total(&s, gave), total(&s, got), "vmm {vmm}");
    });
}

/// Unmaps and segment frees are told before the driver call, while the memory is still there
/// (a trace tracker, NCCL's registration hook, lets go of it then), and a failed call is
/// followed by the range told as mapped (or allocated) again: the events still balance with
/// what the driver holds.
#[test]
fn unmaps_and_frees_are_told_before_the_driver_call() {
    use cistern::driver::DriverCall;
    both(|vmm| {
        let (sim, pool) = pool(GIB, vmm);
        let seen: Arc<Mutex<Vec<(PoolEvent, bool)>>> = Arc::new(Mutex::new(Vec::new()));
        let (s, d) = (seen.clone(), sim.clone());
        pool.set_observer(Some(Arc::new(move |e: &PoolEvent| {
            // Whether the event's own range is still there (mapped, or a live segment) when
            // it is told.
            let there = d.accessible(0, e.addr, e.bytes, 0);
            s.lock().push((*e, there));
        })));
        let p = alloc(&pool, 50 * MIB, A);
        let q = alloc(&pool, 30 * MIB, B);
        free(&pool, p, A);
        free(&pool, q, B);
        let (gone, back) = if vmm {
            (PoolEventKind::SegmentUnmap, PoolEventKind::SegmentMap)
        } else {
            (PoolEventKind::SegmentFree, PoolEventKind::SegmentAlloc)
        };
        let call = if vmm {
            DriverCall::Unmap
        } else {
            DriverCall::MemFree
        };
        // The first release fails: the range stays, and is told as back.
        sim.fail_nth(call, 1);
        pool.empty_cache();
        let held_now = if vmm {
            sim.mapped_bytes(0)
        } else {
            sim.live_linear_allocations(0) as u64
        };
        assert!(held_now > 0, "the failed release kept nothing");
        {
            let s = seen.lock();
            let first = s
                .iter()
                .position(|(e, _)| e.kind == gone)
                .expect("a release");
            let e = s[first].0;
            let next = s[first + 1].0;
            assert_eq!((next.kind, next.addr, next.bytes), (back, e.addr, e.bytes));
            assert!(s.iter().filter(|(e, _)| e.kind == gone).count() >= 2);
            for (e, there) in s.iter().filter(|(e, _)| e.kind == gone) {
                assert!(*there, "{e:?} told after the driver let it go");
            }
            let got = |k| {
                s.iter()
                    .filter(|(e, _)| e.kind == k)
                    .map(|(e, _)| e.bytes)
                    .sum::<u64>()
            };
            if vmm {
                assert_eq!(got(back) - got(gone), sim.mapped_bytes(0));
            }
        }
        pool.empty_cache();
        assert_no_leak(&sim, pool);
    });
}
