//! Writes the seed corpus of the targets whose inputs cistern writes itself: registry records
//! (from a real pool on the simulator, one with an OOM report, one with leaks), cistern's own
//! trace format (the built-in workloads, cut short), and the format-detecting `load` target's
//! share of both. `fuzz/make-corpus.sh` runs it with the Python part (pickles, profiler JSON,
//! RMM logs, MiniMalloc CSVs, configuration strings); see fuzz/README.md.
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example make-corpus -- fuzz/corpus
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cistern::registry::{build_record, encode_record, Identity, RecordSource, State};
use cistern::{with_tag, Config, Pool, SimConfig, SimDriver, StreamId};
use cistern_trace::sequence::AllocSequence;
use cistern_trace::{own, workloads};

fn put(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn records() -> Vec<(String, Vec<u8>)> {
    let sim = Arc::new(SimDriver::new(
        SimConfig::default().capacity(1 << 30).devices(2),
    ));
    let pool = Pool::new(
        sim,
        Config::parse("registry:off,provenance:stacks,stack_sample_rate:1").unwrap(),
    )
    .unwrap();
    let me = Identity::current().expect("this process's identity");
    let mut out = Vec::new();
    let kept: Vec<_> = ["weights", "activations", "kv_cache"]
        .iter()
        .enumerate()
        .map(|(i, tag)| {
            with_tag(tag, || {
                pool.try_alloc(i % 2, (i as u64 + 1) << 24, StreamId(0))
                    .unwrap()
            })
        })
        .collect();
    let mut rec = build_record(&me, &pool.snapshot(), State::Running, Vec::new());
    out.push(("running.json".to_string(), encode_record(&mut rec)));
    let _ = pool.try_alloc(0, 1 << 40, StreamId(7)).unwrap_err();
    let mut rec = build_record(&me, &pool.snapshot(), State::Running, Vec::new());
    out.push(("after-oom.json".to_string(), encode_record(&mut rec)));
    let mut rec = build_record(&me, &pool.snapshot(), State::Exited, pool.leaks());
    out.push((
        "exited-with-leaks.json".to_string(),
        encode_record(&mut rec),
    ));
    drop(kept);
    out
}

fn cut(seq: &AllocSequence, ops: usize) -> AllocSequence {
    // The first `ops` operations, with every block still live freed at the end.
    let mut kept: Vec<_> = seq.ops.iter().take(ops).cloned().collect();
    let mut live = std::collections::BTreeSet::new();
    for op in &kept {
        match *op {
            cistern_trace::Op::Alloc { id, .. } => {
                live.insert(id);
            }
            cistern_trace::Op::Free { id } => {
                live.remove(&id);
            }
        }
    }
    kept.extend(live.into_iter().map(|id| cistern_trace::Op::Free { id }));
    AllocSequence::new(kept, 0).unwrap_or_else(|_| seq.clone())
}

fn main() {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus".into()),
    );
    for (name, bytes) in records() {
        put(&dir, "registry_record", &name, &bytes);
        // The scan target reads its first bytes as structure; a record after a few zeros
        // gives it JSON to mutate.
        let mut scan = vec![0u8; 6];
        scan.extend_from_slice(&bytes);
        put(&dir, "registry_scan", &name, &scan);
    }
    for (name, ops) in [
        ("training", 300),
        ("llm-serving", 200),
        ("rmm-random", 120),
        ("packed-A", 150),
    ] {
        let t = workloads::generate(name, 1).unwrap();
        let seq = cut(&t.sequence, ops);
        let mut text = Vec::new();
        own::write(&seq, &mut text).unwrap();
        put(&dir, "own", &format!("{name}.trace"), &text);
        put(&dir, "load", &format!("{name}.trace"), &text);
    }
    eprintln!(
        "make-corpus: wrote registry and own-format seeds under {}",
        dir.display()
    );
}
