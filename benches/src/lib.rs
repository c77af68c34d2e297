//! cistern's hot-path benchmarks: allocate+free pairs on cache hits, against host mimalloc.
//!
//! The crate owns the measured loop and everything around it, shared by the criterion bench
//! (`benches/hotpath.rs`, `cargo bench -p cistern-benches`) and the quick binary
//! (`src/bin/hotpath.rs`, `cargo run --release -p cistern-benches --bin hotpath -- --json`):
//!
//! * [`workload`]: the cases (one small size, or a real trace's size mix), at 1k, 10k and 100k
//!   live blocks, and the fixed pseudo-random order of replacements;
//! * [`backend`]: cistern on the simulated GPU and the host reference, behind one trait;
//! * [`harness`]: the timed pair loop and the threads (one stream each) that run it.
//!
//! What is measured: a live set is allocated and kept; a timed *pair* frees one live block,
//! chosen by a precomputed xorshift sequence, and allocates a block of the same size into its
//! slot. Warm-up grows the pool first, so timed pairs are cache hits; [`Harness`] checks that
//! the simulator saw no driver call during the timed runs. With 2 threads each thread has its
//! own stream, live set and sequence; the per-thread cost of a pair is
//! `wall time * threads / pairs`.
#![deny(missing_docs)]

pub mod backend;
pub mod harness;
pub mod workload;

pub use backend::{Backend, Cistern, HostMimalloc, DEVICE_CAPACITY};
pub use harness::{run_pairs, Harness, TimedDriverCalls};
pub use workload::{CaseKind, Workload, LIVE_BLOCKS, THREADS};
