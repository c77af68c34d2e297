//! Replay throughput of the real cistern pool and of the `pytorch` model on the same trace, in
//! one run: `cargo bench -p cistern-replay --bench replay`.
//!
//! The trace is the dev snapshot `cs336-wedsonlin__gpt-medium_train_ctx128` (13.5k operations)
//! when `../shared/traces` (or `CISTERN_TRACES_DIR`) has it, else a synthetic training-like
//! sequence, so the bench always runs. Each iteration builds a fresh model (a fresh simulated
//! device) and replays the whole sequence; throughput is reported in operations per second.

use std::path::PathBuf;
use std::time::Duration;

use cistern_replay::{make, replay};
use cistern_trace::{AllocSequence, Op, Snapshot};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

const TRACE: &str = "cs336-wedsonlin__gpt-medium_train_ctx128.pickle";

fn dev_trace() -> Option<AllocSequence> {
    let dir = std::env::var_os("CISTERN_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"));
    let path = dir.join("pytorch_snapshots").join(TRACE);
    match Snapshot::read(&path) {
        Ok(s) => Some(s.reconstruct(0).sequence),
        Err(e) => {
            eprintln!("skipping the dev trace ({e}); using a synthetic sequence");
            None
        }
    }
}

/// Layers of activations allocated forward and freed backward, with sizes varying per step.
fn synthetic() -> AllocSequence {
    let mut ops = Vec::new();
    let mut id = 0u64;
    for step in 0..40u64 {
        let mut stack = Vec::new();
        for layer in 0..48u64 {
            for k in 0..4u64 {
                let size = (((layer % 5 + 1) * (k + 1)) << 20) + (step % 7) * 4096 + 512 * k;
                ops.push(Op::Alloc {
                    id,
                    size,
                    stream: 0,
                });
                stack.push(id);
                id += 1;
            }
        }
        while let Some(i) = stack.pop() {
            ops.push(Op::Free { id: i });
        }
    }
    AllocSequence::new(ops, 0).unwrap_or_default()
}

fn bench(c: &mut Criterion) {
    let (label, seq) = match dev_trace() {
        Some(s) => ("gpt-medium_train_ctx128", s),
        None => ("synthetic", synthetic()),
    };
    let mut g = c.benchmark_group(format!("replay/{label}"));
    g.throughput(Throughput::Elements(seq.ops.len() as u64));
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for name in ["cistern", "pytorch"] {
        g.bench_function(name, |b| {
            b.iter_batched(
                || make(name, 80 << 30).expect("registered allocator"),
                // Hand the model back so that its teardown is not timed.
                |mut m| (replay(&seq, m.as_mut()).peak_reserved, m),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
