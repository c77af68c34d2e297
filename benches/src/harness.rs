//! The measured loop and the threads that run it.
//!
//! This module owns the one definition of a timed "pair" (free a live block, allocate a
//! replacement of the same size into its slot), shared by the criterion bench and the quick
//! binary, and the worker threads that hold each lane's live set between timed runs. It owns
//! no sizes (see [`crate::workload`]) and no allocator (see [`crate::backend`]).
//!
//! A [`Harness`] starts one worker per [`Workload`]. Each worker allocates its live set, runs
//! warm-up pairs (so the pool has grown to its steady state before anything is timed), and then
//! waits. [`Harness::run`] releases all workers at once through a barrier; each times its own
//! pairs, and the run's wall time is from the earliest start to the latest end. Dropping the
//! harness frees every live block.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cistern::driver::DriverCall;

use crate::backend::Backend;
use crate::workload::Workload;

/// Runs `pairs` pairs of `workload` on `slots`, continuing the index sequence at `*cursor`.
///
/// Pair `i` frees the block in slot `k = order[cursor + i]` and allocates a block of the same
/// size into slot `k`. This loop is the only code that is timed.
#[inline]
pub fn run_pairs<B: Backend>(
    backend: &B,
    lane: usize,
    slots: &mut [B::Ptr],
    workload: &Workload,
    cursor: &mut usize,
    pairs: u64,
) {
    let order = &workload.order[..];
    let sizes = &workload.sizes[..slots.len()];
    debug_assert!(order.len().is_power_of_two());
    let mask = order.len() - 1;
    let mut c = *cursor;
    for _ in 0..pairs {
        let k = order[c & mask] as usize;
        c = c.wrapping_add(1);
        let size = sizes[k];
        // SAFETY: slot `k` holds the block `backend.alloc(size, lane)` returned (set up by
        // `Harness::new`, or by the previous pair on this slot), and it is overwritten with a
        // fresh block at once, so it is never used or freed again.
        unsafe { backend.free(slots[k], size, lane) };
        slots[k] = backend.alloc(size, lane);
    }
    *cursor = c;
}

/// How many warm-up pairs a lane runs before anything is timed: as many as live blocks (most
/// slots replaced once), at least 10k. The pool has grown by then: a same-size replacement on
/// the same stream reuses the span just freed, which [`Harness::assert_cache_hits`] checks.
pub fn warmup_pairs(live_blocks: usize) -> u64 {
    (live_blocks as u64).max(10_000)
}

/// The driver calls made during the timed runs (zero on a pure cache-hit loop).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TimedDriverCalls {
    /// `CreatePhysical` calls (new physical pages).
    pub create_physical: u64,
    /// `Map` calls.
    pub map: u64,
    /// Calls of every kind.
    pub total: u64,
}

enum Cmd {
    Run(u64),
    Stop,
}

struct Worker {
    cmd: Sender<Cmd>,
    handle: Option<JoinHandle<()>>,
}

/// One worker thread per lane, each holding its live set of a case on a shared backend.
pub struct Harness<B: Backend> {
    backend: Arc<B>,
    workers: Vec<Worker>,
    done: Receiver<(Instant, Instant)>,
    baseline: Option<BTreeMap<DriverCall, u64>>,
    live_bytes: u64,
    scale: f64,
}

impl<B: Backend> Harness<B> {
    /// Starts one worker per workload (lane `i` runs `workloads[i]`), lets each allocate its
    /// live set and run [`warmup_pairs`] pairs, and returns when all are ready.
    pub fn new(backend: Arc<B>, workloads: Vec<Workload>) -> Self {
        let threads = workloads.len();
        assert!(threads > 0, "a harness needs at least one workload");
        let live_bytes = workloads.iter().map(Workload::live_bytes).sum();
        let scale = workloads.iter().map(|w| w.scale).fold(1.0, f64::min);
        let barrier = Arc::new(Barrier::new(threads));
        let (done_tx, done) = channel();
        let (ready_tx, ready) = channel();
        let workers = workloads
            .into_iter()
            .enumerate()
            .map(|(lane, workload)| {
                let (cmd, cmd_rx) = channel();
                let backend = backend.clone();
                let barrier = barrier.clone();
                let done_tx = done_tx.clone();
                let ready_tx = ready_tx.clone();
                let handle = std::thread::Builder::new()
                    .name(format!("{}-lane{lane}", B::NAME))
                    .spawn(move || {
                        let run = AssertUnwindSafe(|| {
                            worker(
                                &*backend, lane, &workload, &barrier, &cmd_rx, &done_tx, &ready_tx,
                            )
                        });
                        if catch_unwind(run).is_err() {
                            // The other lanes would wait for this one at the barrier forever.
                            eprintln!("a {} benchmark thread panicked; exiting", B::NAME);
                            std::process::exit(101);
                        }
                    })
                    .unwrap_or_else(|e| panic!("cannot spawn a benchmark thread: {e}"));
                Worker {
                    cmd,
                    handle: Some(handle),
                }
            })
            .collect();
        drop(ready_tx);
        for _ in 0..threads {
            if ready.recv().is_err() {
                panic!(
                    "a {} worker died during setup (see its panic above)",
                    B::NAME
                );
            }
        }
        let baseline = backend.driver_calls();
        Harness {
            backend,
            workers,
            done,
            baseline,
            live_bytes,
            scale,
        }
    }

    /// The number of threads (lanes).
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Bytes live across all lanes.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// The smallest size scale factor of any lane (1.0 when no sizes were scaled).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Runs `pairs_per_thread` pairs on every lane at once; returns the wall time from the
    /// first lane's start to the last lane's end.
    ///
    /// Wall time divided by `pairs_per_thread` is the per-thread cost of a pair
    /// (`wall * threads / total pairs`); throughput is `threads * pairs_per_thread / wall`.
    pub fn run(&self, pairs_per_thread: u64) -> Duration {
        for w in &self.workers {
            if w.cmd.send(Cmd::Run(pairs_per_thread)).is_err() {
                panic!("a {} worker died (see its panic above)", B::NAME);
            }
        }
        let mut first: Option<Instant> = None;
        let mut last: Option<Instant> = None;
        for _ in 0..self.workers.len() {
            let Ok((t0, t1)) = self.done.recv() else {
                panic!("a {} worker died (see its panic above)", B::NAME);
            };
            first = Some(first.map_or(t0, |f| f.min(t0)));
            last = Some(last.map_or(t1, |l| l.max(t1)));
        }
        match (first, last) {
            (Some(f), Some(l)) => l.saturating_duration_since(f),
            _ => Duration::ZERO,
        }
    }

    /// The driver calls made since warm-up ended (`None` for a backend without a driver).
    pub fn timed_driver_calls(&self) -> Option<TimedDriverCalls> {
        let (Some(before), Some(now)) = (self.baseline.as_ref(), self.backend.driver_calls())
        else {
            return None;
        };
        let delta = |c: &DriverCall| {
            now.get(c)
                .copied()
                .unwrap_or(0)
                .saturating_sub(before.get(c).copied().unwrap_or(0))
        };
        Some(TimedDriverCalls {
            create_physical: delta(&DriverCall::CreatePhysical),
            map: delta(&DriverCall::Map),
            total: now.keys().map(delta).sum(),
        })
    }

    /// Panics unless the timed runs made no driver call at all: every timed pair was a cache
    /// hit. Returns the (zero) counts for the report.
    pub fn assert_cache_hits(&self) -> Option<TimedDriverCalls> {
        let calls = self.timed_driver_calls()?;
        assert_eq!(
            calls,
            TimedDriverCalls::default(),
            "{}: the timed loop called the driver, so its pairs were not all cache hits",
            B::NAME
        );
        Some(calls)
    }
}

impl<B: Backend> Drop for Harness<B> {
    fn drop(&mut self) {
        for w in &self.workers {
            let _ = w.cmd.send(Cmd::Stop);
        }
        for w in &mut self.workers {
            if let Some(h) = w.handle.take() {
                // A worker's panic was already printed; the harness is going away either way.
                let _ = h.join();
            }
        }
    }
}

fn worker<B: Backend>(
    backend: &B,
    lane: usize,
    workload: &Workload,
    barrier: &Barrier,
    cmds: &Receiver<Cmd>,
    done: &Sender<(Instant, Instant)>,
    ready: &Sender<()>,
) {
    let mut slots: Vec<B::Ptr> = workload
        .sizes
        .iter()
        .map(|&size| backend.alloc(size, lane))
        .collect();
    let mut cursor = 0;
    let warmup = warmup_pairs(slots.len());
    run_pairs(backend, lane, &mut slots, workload, &mut cursor, warmup);
    let _ = ready.send(());
    while let Ok(Cmd::Run(pairs)) = cmds.recv() {
        barrier.wait();
        let t0 = Instant::now();
        run_pairs(backend, lane, &mut slots, workload, &mut cursor, pairs);
        let t1 = Instant::now();
        if done.send((t0, t1)).is_err() {
            break;
        }
    }
    for (&ptr, &size) in slots.iter().zip(&workload.sizes) {
        // SAFETY: each slot holds a block `backend.alloc(size, lane)` returned, and the slots
        // are dropped right after, so none is used or freed again.
        unsafe { backend.free(ptr, size, lane) };
    }
}
