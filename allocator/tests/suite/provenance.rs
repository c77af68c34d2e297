//! Provenance: tags, threads, marks, sampled call sites, the ledger and the OOM report's top
//! tags. The ledger is checked against the pool's own statistics under random programs of
//! allocations, frees, `record_stream`s and tag pushes and pops on several threads and streams.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;

use crate::common::*;
use cistern::{group_live, site_frames, tag_pop, tag_push, with_tag, StreamId, TagGuard};
use proptest::prelude::*;

/// A thread that runs closures sent to it, one at a time: its tag stack persists between them.
struct Worker {
    tx: Option<mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn new() -> Worker {
        let (tx, rx) = mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let handle = std::thread::spawn(move || {
            for job in rx {
                job();
            }
        });
        Worker {
            tx: Some(tx),
            handle: Some(handle),
        }
    }

    fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (rtx, rrx) = mpsc::channel();
        let job = Box::new(move || {
            let _ = rtx.send(f());
        });
        self.tx.as_ref().unwrap().send(job).unwrap();
        rrx.recv().expect("the worker panicked")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

const WORKERS: usize = 3;
const STREAMS: u64 = 3;
const TAGS: [&str; 4] = ["prop-embed", "prop-attn", "prop-mlp", "prop-optim"];

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        size: u64,
        stream: u64,
        worker: usize,
    },
    Free(usize),
    RecordStream(usize, u64),
    CompleteWork,
    Push {
        worker: usize,
        tag: usize,
    },
    Pop {
        worker: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u64..=2 * MIB, 0..STREAMS, 0..WORKERS)
            .prop_map(|(size, stream, worker)| Op::Alloc { size, stream, worker }),
        2 => (2 * MIB..=24 * MIB, 0..STREAMS, 0..WORKERS)
            .prop_map(|(size, stream, worker)| Op::Alloc { size, stream, worker }),
        6 => any::<usize>().prop_map(Op::Free),
        1 => (any::<usize>(), 0..STREAMS).prop_map(|(i, s)| Op::RecordStream(i, s)),
        1 => Just(Op::CompleteWork),
        3 => (0..WORKERS, 0..TAGS.len()).prop_map(|(worker, tag)| Op::Push { worker, tag }),
        3 => (0..WORKERS).prop_map(|worker| Op::Pop { worker }),
    ]
}

/// A live allocation of the model: pointer, stream, rounded size, tag.
type Live = (u64, u64, u64, Option<&'static str>);

fn run(vmm: bool, ops: &[Op]) -> Result<(), TestCaseError> {
    let (sim, pool) = pool(512 * MIB, vmm);
    let pool = Arc::new(pool);
    let workers: Vec<Worker> = (0..WORKERS).map(|_| Worker::new()).collect();
    let mut stacks: Vec<Vec<&'static str>> = vec![Vec::new(); WORKERS];
    let mut live: Vec<Live> = Vec::new();
    let mut total = 0u64;
    for op in ops {
        match *op {
            Op::Alloc {
                size,
                stream,
                worker,
            } => {
                let p = pool.clone();
                let r = workers[worker].run(move || p.alloc_raw(0, size, StreamId(stream)));
                if let Ok(ptr) = r {
                    if size > 0 {
                        let rounded = size.div_ceil(512) * 512;
                        live.push((ptr, stream, rounded, stacks[worker].last().copied()));
                        total += 1;
                    }
                }
            }
            Op::Free(i) if !live.is_empty() => {
                let (ptr, stream, _, _) = live.swap_remove(i % live.len());
                pool.free_raw(ptr, StreamId(stream)).unwrap();
            }
            Op::Free(_) => {}
            Op::RecordStream(i, s) if !live.is_empty() => {
                let (ptr, _, _, _) = live[i % live.len()];
                pool.record_stream(ptr, StreamId(s)).unwrap();
                let _ = sim.launch(0, StreamId(s), &[(ptr, 512)]);
            }
            Op::RecordStream(..) => {}
            Op::CompleteWork => {
                sim.complete_all(0);
            }
            Op::Push { worker, tag } => {
                let name = TAGS[tag];
                workers[worker].run(move || {
                    tag_push(name);
                });
                stacks[worker].push(name);
            }
            Op::Pop { worker } => {
                let popped = workers[worker].run(tag_pop);
                prop_assert_eq!(popped, stacks[worker].pop().is_some());
            }
        }
        let dev = pool.device(0).unwrap();
        let stats = pool.stats(0).unwrap();
        let ledger = dev.ledger();
        let sum = |f: fn(&cistern::LedgerEntry) -> u64| ledger.iter().map(f).sum::<u64>() as i64;
        prop_assert_eq!(
            sum(|e| e.live_bytes),
            stats.get("allocated_bytes.all.current")
        );
        prop_assert_eq!(sum(|e| e.live_blocks), stats.get("allocation.all.current"));
        prop_assert_eq!(
            sum(|e| e.total_allocs),
            stats.get("allocation.all.allocated")
        );
        prop_assert_eq!(sum(|e| e.total_allocs), total as i64);
        // Per tag, the model's live bytes.
        let mut want: HashMap<&str, (u64, u64)> = HashMap::new();
        for &(_, _, size, tag) in &live {
            let e = want.entry(tag.unwrap_or("")).or_default();
            e.0 += size;
            e.1 += 1;
        }
        for e in &ledger {
            let w = want.remove(e.tag.as_str()).unwrap_or((0, 0));
            prop_assert_eq!((e.live_bytes, e.live_blocks), w, "tag `{}`", e.tag);
            prop_assert!(e.peak_bytes >= e.live_bytes);
            prop_assert_eq!(e.site, None);
        }
        prop_assert!(want.is_empty(), "tags missing from the ledger: {:?}", want);
        // Every live block carries its tag.
        let blocks = dev.live_blocks_detailed();
        prop_assert_eq!(blocks.len(), live.len());
        for &(ptr, stream, size, tag) in &live {
            let b = blocks.iter().find(|b| b.ptr == ptr).unwrap();
            prop_assert_eq!(b.tag.as_deref(), tag);
            prop_assert_eq!((b.stream, b.size), (stream, size));
            prop_assert!(b.thread > 0 && b.time_ns > 0);
        }
        // Sorted by live bytes.
        prop_assert!(ledger
            .windows(2)
            .all(|w| w[0].live_bytes >= w[1].live_bytes));
    }
    for (ptr, stream, _, _) in live.drain(..) {
        pool.free_raw(ptr, StreamId(stream)).unwrap();
    }
    prop_assert!(pool
        .device(0)
        .unwrap()
        .ledger()
        .iter()
        .all(|e| e.live_bytes == 0));
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn ledger_matches_stats_vmm(ops in proptest::collection::vec(op(), 1..60)) {
        run(true, &ops)?;
    }

    #[test]
    fn ledger_matches_stats_segments(ops in proptest::collection::vec(op(), 1..60)) {
        run(false, &ops)?;
    }
}

#[test]
fn tags_nest_per_thread_and_stay_there() {
    let (_sim, pool) = pool(GIB, true);
    let pool = Arc::new(pool);
    let outer = with_tag("nest-outer", || {
        let a = alloc(&pool, 4096, 0);
        let _g = TagGuard::new("nest-inner");
        let b = alloc(&pool, 4096, 0);
        let p = pool.clone();
        // Another thread does not see this thread's tags.
        let c = std::thread::spawn(move || p.alloc_raw(0, 4096, StreamId(0)).unwrap())
            .join()
            .unwrap();
        (a, b, c)
    });
    let d = alloc(&pool, 4096, 0);
    let blocks = pool.device(0).unwrap().live_blocks_detailed();
    let tag = |p: u64| blocks.iter().find(|b| b.ptr == p).unwrap().tag.clone();
    assert_eq!(tag(outer.0).as_deref(), Some("nest-outer"));
    assert_eq!(tag(outer.1).as_deref(), Some("nest-inner"));
    assert_eq!(tag(outer.2), None);
    assert_eq!(tag(d), None);
    let thread = |p: u64| blocks.iter().find(|b| b.ptr == p).unwrap().thread;
    assert_eq!(thread(outer.0), thread(d));
    assert_ne!(thread(outer.2), thread(d));
}

#[test]
fn live_since_mark() {
    let (_sim, pool) = pool(GIB, true);
    let dev = pool.device(0).unwrap().clone();
    let old: Vec<u64> = (0..4).map(|_| alloc(&pool, 8 * KIB, 0)).collect();
    let mark = dev.mark();
    assert!(dev.live_since(&mark).is_empty());
    let (kept, freed, other_stream) = with_tag("step", || {
        (
            alloc(&pool, 16 * KIB, 0),
            alloc(&pool, 16 * KIB, 0),
            // A stream first used after the mark.
            alloc(&pool, 3 * MIB, 5),
        )
    });
    free(&pool, old[0], 0);
    free(&pool, freed, 0);
    // A block freed before the mark and reused after it counts as new.
    let reuse = alloc(&pool, 8 * KIB, 0);
    let since = dev.live_since(&mark);
    let ptrs: Vec<u64> = since.iter().map(|b| b.ptr).collect();
    let mut want = vec![kept, other_stream, reuse];
    want.sort_unstable();
    assert_eq!(ptrs, want);
    let groups = group_live(&since);
    assert_eq!(groups[0].tag, "step");
    assert_eq!((groups[0].bytes, groups[0].blocks), (3 * MIB + 16 * KIB, 2));
    assert_eq!((groups[1].tag.as_str(), groups[1].blocks), ("", 1));
    // A mark of another pool selects nothing.
    let (_s2, other) = crate::common::pool(GIB, true);
    let _x = alloc(&other, 4096, 0);
    assert!(dev.live_since(&other.device(0).unwrap().mark()).is_empty());
    assert_eq!(dev.live_blocks_detailed().len(), 6);
}

#[inline(never)]
fn allocate_here_for_the_site_test(pool: &SimPool, n: usize) -> Vec<u64> {
    (0..n).map(|_| alloc(pool, 4096, 0)).collect()
}

#[test]
fn sampled_sites_are_interned_and_symbolised() {
    let (_sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "provenance:stacks,stack_sample_rate:1",
    );
    let pool = Arc::new(pool);
    let p = pool.clone();
    // A fresh thread, so the sampling countdown starts there.
    let ptrs = std::thread::spawn(move || allocate_here_for_the_site_test(&p, 3))
        .join()
        .unwrap();
    let dev = pool.device(0).unwrap();
    let blocks = dev.live_blocks_detailed();
    let sites: Vec<u32> = ptrs
        .iter()
        .map(|p| blocks.iter().find(|b| b.ptr == *p).unwrap().site.unwrap())
        .collect();
    assert!(sites.iter().all(|s| *s == sites[0]), "{sites:?}");
    let frames = site_frames(sites[0]);
    assert!(
        frames
            .iter()
            .any(|f| f.contains("allocate_here_for_the_site_test")),
        "{frames:#?}"
    );
    assert!(!frames[0].contains("backtrace::"), "{frames:#?}");
    let e = dev.ledger();
    assert_eq!(e[0].site, Some(sites[0]));
    assert_eq!((e[0].live_blocks, e[0].total_allocs), (3, 3));
}

#[test]
fn sampling_rate_is_per_thread() {
    let (_sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "provenance:stacks,stack_sample_rate:4",
    );
    let pool = Arc::new(pool);
    let p = pool.clone();
    std::thread::spawn(move || allocate_here_for_the_site_test(&p, 9))
        .join()
        .unwrap();
    let blocks = pool.device(0).unwrap().live_blocks_detailed();
    // The 1st, 5th and 9th allocation of the thread.
    assert_eq!(blocks.iter().filter(|b| b.site.is_some()).count(), 3);
    // Tags only: no stacks.
    let (_sim, tags_only) = crate::common::pool(GIB, true);
    allocate_here_for_the_site_test(&tags_only, 3);
    let blocks = tags_only.device(0).unwrap().live_blocks_detailed();
    assert!(blocks.iter().all(|b| b.site.is_none()));
}

#[test]
fn oom_report_names_the_top_tags() {
    both(|vmm| {
        let (_sim, pool) = pool_with(
            cistern::SimConfig::default().capacity(128 * MIB),
            vmm,
            "provenance:stacks,stack_sample_rate:1",
        );
        let _w = with_tag("oom-weights", || alloc(&pool, 60 * MIB, 0));
        let _a = with_tag("oom-activations", || alloc(&pool, 20 * MIB, 0));
        let _n = alloc(&pool, 2 * MIB, 0);
        let e = pool.alloc_raw(0, 100 * MIB, StreamId(0)).unwrap_err();
        let r = e.oom_report().expect("an OOM report");
        let names: Vec<&str> = r.top_tags.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["oom-weights", "oom-activations", "(no tag)"], "{r}");
        assert_eq!((r.top_tags[0].bytes, r.top_tags[0].blocks), (60 * MIB, 1));
        assert!(!r.top_sites.is_empty());
        assert!(
            r.top_sites
                .iter()
                .any(|s| s.name.contains("oom_report_names_the_top_tags")),
            "{:?}",
            r.top_sites
        );
        let text = r.to_string();
        assert!(text.contains("top tags by live bytes"), "{text}");
        assert!(text.contains("oom-weights"), "{text}");
    });
}

#[test]
fn provenance_off_records_nothing() {
    let (_sim, pool) = pool_with(
        cistern::SimConfig::default().capacity(GIB),
        true,
        "provenance:off",
    );
    let dev = pool.device(0).unwrap().clone();
    let mark = dev.mark();
    let p = with_tag("off-tag", || alloc(&pool, 4096, 0));
    assert!(dev.ledger().is_empty());
    assert!(dev.live_since(&mark).is_empty());
    let blocks = dev.live_blocks_detailed();
    assert_eq!(blocks.len(), 1);
    assert_eq!((blocks[0].ptr, blocks[0].tag.as_ref()), (p, None));
    assert_eq!(blocks[0].thread, 0);
    free(&pool, p, 0);
}

/// The cost of one captured stack and of symbolising it. Informational; run with
/// `cargo test --release -p cistern --test suite provenance:: -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_stack_capture() {
    use std::time::Instant;
    #[inline(never)]
    fn deeper(n: u32) -> u32 {
        if n == 0 {
            cistern::provenance::capture_site()
        } else {
            std::hint::black_box(deeper(n - 1))
        }
    }
    for depth in [0, 10, 30, 60] {
        let n = 20_000;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(deeper(depth));
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        eprintln!("capture_site at depth +{depth}: {ns:.0} ns");
    }
    let site = deeper(5);
    let t = Instant::now();
    let frames = site_frames(site);
    eprintln!(
        "site_frames (first, loads debug info): {:?} for {} frames",
        t.elapsed(),
        frames.len()
    );
    let t = Instant::now();
    let _ = site_frames(site);
    eprintln!("site_frames (again): {:?}", t.elapsed());
}
