//! Criterion bench of the hot path: allocate+free pairs on cache hits, cistern against host
//! mimalloc, for each case at 1k, 10k and 100k live blocks on 1 and 2 threads.
//!
//! Run with `cargo bench -p cistern-benches --bench hotpath` (a few minutes; add a filter such
//! as `-- small_4KiB/` to run one case). One criterion iteration is one pair on every thread,
//! so the reported time is the per-thread cost of a pair (`wall * threads / pairs`) and the
//! throughput counts the pairs of all threads. This file owns only the criterion wiring; the
//! loop is [`cistern_benches::run_pairs`] and the setup is [`cistern_benches::Harness`].

use std::sync::Arc;
use std::time::Duration;

use cistern_benches::backend::Backend;
use cistern_benches::{CaseKind, Cistern, Harness, HostMimalloc, Workload, LIVE_BLOCKS, THREADS};
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use criterion::{measurement::WallTime, Throughput};

fn bench_backend<B: Backend>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    backend: B,
    workloads: Vec<Workload>,
    live: usize,
    threads: usize,
) {
    let harness = Harness::new(Arc::new(backend), workloads);
    let id = BenchmarkId::new(B::NAME, format!("{live}live/{threads}thr"));
    g.bench_function(id, |b| b.iter_custom(|iters| harness.run(iters)));
    if let Some(calls) = harness.assert_cache_hits() {
        eprintln!(
            "{} {live}live/{threads}thr: driver calls during timed runs: {} \
             (CreatePhysical {}, Map {}): all pairs were cache hits",
            B::NAME,
            calls.total,
            calls.create_physical,
            calls.map
        );
    }
}

fn hotpath(c: &mut Criterion) {
    for kind in CaseKind::ALL {
        let mut g = c.benchmark_group(kind.name());
        g.measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500))
            .sample_size(20);
        'live: for live in LIVE_BLOCKS {
            for threads in THREADS {
                let workloads = match Workload::for_threads(kind, live, threads) {
                    Ok(w) => w,
                    Err(msg) => {
                        eprintln!("{msg}");
                        break 'live;
                    }
                };
                g.throughput(Throughput::Elements(threads as u64));
                bench_backend(&mut g, Cistern::new(), workloads.clone(), live, threads);
                bench_backend(&mut g, HostMimalloc, workloads, live, threads);
            }
        }
        g.finish();
    }
}

criterion_group!(benches, hotpath);
criterion_main!(benches);
