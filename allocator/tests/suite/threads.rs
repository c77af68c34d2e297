//! Four threads on four streams: random allocations and frees, frees of other threads' blocks
//! handed over through channels, and blocks used by other streams' work (record_stream +
//! launch) while the streams complete their work at random. Afterwards: no hazard, invariants
//! hold, counters are exact, and nothing leaks.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};

use crate::common::*;
use cistern::stats::SLACK_BYTES;
use cistern::StreamId;

const THREADS: u64 = 4;
const OPS: usize = 600;

struct Outcome {
    allocs: u64,
    inbox: mpsc::Receiver<(u64, u64)>,
}

/// Bounds on the pool's live bytes at every instant: `lo` counts a block from after its
/// allocation returned until before its free is called, `hi` from before the allocation is
/// asked for until after its free returned. lo <= live <= hi, so their maxima bound the peak.
#[derive(Default)]
struct LiveBounds {
    lo: AtomicU64,
    hi: AtomicU64,
    lo_max: AtomicU64,
    hi_max: AtomicU64,
}

impl LiveBounds {
    fn up(v: &AtomicU64, max: &AtomicU64, n: u64) {
        max.fetch_max(v.fetch_add(n, SeqCst) + n, SeqCst);
    }
    fn alloc(&self, pool: &SimPool, size: u64, s: StreamId) -> u64 {
        let r = size.div_ceil(512) * 512;
        Self::up(&self.hi, &self.hi_max, r);
        let p = pool.alloc_raw(0, size, s).unwrap_or_else(|e| panic!("{e}"));
        Self::up(&self.lo, &self.lo_max, r);
        p
    }
    fn free(&self, pool: &SimPool, p: u64, size: u64, s: StreamId) {
        let r = size.div_ceil(512) * 512;
        self.lo.fetch_sub(r, SeqCst);
        pool.free_raw(p, s).unwrap();
        self.hi.fetch_sub(r, SeqCst);
    }
}

fn stress(vmm: bool, cap: u64) {
    let (sim, pool) = pool(cap, vmm);
    let pool = Arc::new(pool);
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel::<(u64, u64)>()).unzip();
    let start = Arc::new(Barrier::new(THREADS as usize));
    let bounds = Arc::new(LiveBounds::default());
    let handles: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(t, inbox)| {
            let (sim, pool, txs, start) = (sim.clone(), pool.clone(), txs.clone(), start.clone());
            let bounds = bounds.clone();
            std::thread::spawn(move || {
                let t = t as u64;
                let me = StreamId(t + 1);
                let mut rng = Rng::new(40 + t);
                let mut live: Vec<(u64, u64)> = Vec::new();
                let mut allocs = 0u64;
                start.wait();
                for _ in 0..OPS {
                    match rng.range(0, 19) {
                        0..=8 => {
                            let size = match rng.range(0, 3) {
                                0 => 0,
                                1 => rng.range(1, 64 * KIB),
                                2 => rng.range(1, MIB),
                                _ => rng.range(MIB, 24 * MIB),
                            };
                            match bounds.alloc(&pool, size, me) {
                                0 => assert_eq!(size, 0),
                                p => {
                                    allocs += 1;
                                    live.push((p, size));
                                }
                            }
                        }
                        9..=13 if !live.is_empty() => {
                            let (p, size) =
                                live.swap_remove(rng.range(0, live.len() as u64 - 1) as usize);
                            bounds.free(&pool, p, size, me);
                        }
                        14..=15 if !live.is_empty() => {
                            // Hand a block to another thread, which frees it on its own stream.
                            let (p, size) =
                                live.swap_remove(rng.range(0, live.len() as u64 - 1) as usize);
                            let to = (t + rng.range(1, THREADS - 1)) % THREADS;
                            txs[to as usize].send((p, size)).unwrap();
                        }
                        16..=17 if !live.is_empty() => {
                            // Another stream works on one of our blocks.
                            let (p, size) = live[rng.range(0, live.len() as u64 - 1) as usize];
                            let other = StreamId(1 + (t + rng.range(1, THREADS - 1)) % THREADS);
                            pool.record_stream(p, other).unwrap();
                            sim.launch(0, other, &[(p, size.max(1))]).unwrap();
                        }
                        18 => {
                            sim.complete_next(0, StreamId(rng.range(1, THREADS)));
                        }
                        _ => {}
                    }
                    while let Ok((p, size)) = inbox.try_recv() {
                        bounds.free(&pool, p, size, me);
                    }
                    if rng.chance(0.1) {
                        check(&pool);
                    }
                }
                for (p, size) in live {
                    bounds.free(&pool, p, size, me);
                }
                Outcome { allocs, inbox }
            })
        })
        .collect();
    drop(txs);
    let outcomes: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for o in &outcomes {
        for (p, _) in o.inbox.try_iter() {
            free(&pool, p, 0);
        }
    }
    check(&pool);
    assert!(sim.hazards().is_empty(), "{:#?}", sim.hazards());
    sim.complete_all(0);
    let pool = Arc::into_inner(pool).unwrap();
    let allocs: u64 = outcomes.iter().map(|o| o.allocs).sum();
    let s = pool.stats(0).unwrap();
    for k in ["allocation", "allocated_bytes", "requested_bytes"] {
        assert_eq!(s.get(&format!("{k}.all.current")), 0, "{k}");
    }
    assert_eq!(s.get("allocation.all.allocated") as u64, allocs);
    assert_eq!(s.get("allocation.all.freed") as u64, allocs);
    assert_eq!(s.get("num_invalid_frees"), 0);
    // The peak lies within the bounds on live bytes, give or take the arenas' unpublished
    // slack (stats.rs, Note [Sharded gauges]), and never above reserved memory.
    let peak = s.get("allocated_bytes.all.peak") as u64;
    let slack = SLACK_BYTES as u64 * THREADS;
    let (lo, hi) = (bounds.lo_max.load(SeqCst), bounds.hi_max.load(SeqCst));
    assert!(peak + slack >= lo, "peak {peak} < the live bytes seen {lo}");
    assert!(
        peak <= hi + slack,
        "peak {peak} > the most that was ever live {hi}"
    );
    assert!(peak <= s.get("reserved_bytes.all.peak") as u64);
    let count_peak = s.get("allocation.all.peak") as u64;
    assert!(count_peak > 0 && count_peak <= allocs);
    assert_no_leak(&sim, pool);
}

#[test]
fn four_threads_four_streams_vmm() {
    stress(true, 4 * GIB);
}

#[test]
fn four_threads_four_streams_segments() {
    stress(false, 4 * GIB);
}

/// The same, short of memory: every thread meets the OOM protocol, stitching and releases
/// while the others allocate. Allocations may fail (typed OOM), nothing else may go wrong.
#[test]
fn four_threads_tight_capacity() {
    for vmm in MODES {
        let (sim, pool) = pool(192 * MIB, vmm);
        let pool = Arc::new(pool);
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let (sim, pool) = (sim.clone(), pool.clone());
                std::thread::spawn(move || {
                    let me = StreamId(t + 1);
                    let mut rng = Rng::new(90 + t);
                    let mut live = Vec::new();
                    for _ in 0..300 {
                        if live.len() < 4 && rng.chance(0.6) {
                            match pool.alloc_raw(0, rng.range(MIB, 40 * MIB), me) {
                                Ok(p) => live.push(p),
                                Err(e) => assert!(e.is_oom(), "{e}"),
                            }
                        } else if let Some(p) = live.pop() {
                            if rng.chance(0.3) {
                                let other = StreamId(1 + (t + 1) % THREADS);
                                pool.record_stream(p, other).unwrap();
                                sim.launch(0, other, &[(p, MIB)]).unwrap();
                            }
                            pool.free_raw(p, me).unwrap();
                        }
                        if rng.chance(0.2) {
                            sim.complete_next(0, StreamId(rng.range(1, THREADS)));
                        }
                        if rng.chance(0.05) {
                            pool.empty_cache();
                        }
                    }
                    for p in live {
                        pool.free_raw(p, me).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        check(&pool);
        assert!(sim.hazards().is_empty(), "vmm:{vmm}: {:#?}", sim.hazards());
        sim.complete_all(0);
        let pool = Arc::into_inner(pool).unwrap();
        assert_eq!(stat(&pool, "allocated_bytes.all.current"), 0);
        assert_no_leak(&sim, pool);
    }
}
