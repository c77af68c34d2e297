//! Replays GPU allocation traces against cistern and against faithful models of other
//! allocators, on a simulated device, and measures fragmentation (the fragmentation suite).
//!
//! * [`model`]: the [`AllocatorModel`] trait, its [`Oom`] and the helpers models share.
//! * [`catalog`]: the models by name ([`ALLOCATORS`], [`make`]).
//! * [`simple`]: the simple models (`cistern`, `cistern-novmm`, `cudamalloc`, `ideal`).
//! * [`pytorch`]: PyTorch's caching allocator reimplemented from its rules (`pytorch`,
//!   `pytorch-expandable`).
//! * [`engine`]: [`replay`], [`min_capacity`], [`evaluate`] and the [`ReplayResult`] metrics.
//! * [`recorded`](mod@recorded): the `pytorch-recorded` row from a snapshot's own segment events, and
//!   [`evaluate_snapshot`], which puts it beside the models.
//! * [`whatif`]: recorded OOMs replayed under other allocators and settings (`cistern whatif`).
//!
//! ```
//! use cistern_replay::{evaluate, EvalOptions};
//! use cistern_trace::{AllocSequence, Op};
//! let seq = AllocSequence::new(
//!     vec![Op::Alloc { id: 0, size: 3 << 20, stream: 0 }, Op::Free { id: 0 }],
//!     0,
//! )
//! .unwrap();
//! let rows = evaluate(&seq, &["pytorch", "ideal"], EvalOptions::default()).unwrap();
//! assert_eq!(rows[0].peak_reserved, 20 << 20); // a 20 MiB segment for a 3 MiB request
//! assert_eq!(rows[1].peak_reserved, 3 << 20);
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod catalog;
pub mod engine;
pub mod model;
pub mod pytorch;
pub mod recorded;
pub mod simple;
pub mod whatif;

pub use catalog::{as_recorded, make, make_with, ALLOCATORS, AS_RECORDED, GPU_LAG, RECORDED};
pub use cistern::{CallCost, CostTable};
pub use engine::{
    evaluate, frag, min_capacity, min_capacity_from, min_capacity_with, replay, run, run_from,
    run_with, EvalOptions, OomAt, Point, ReplayResult, TraceReport,
};
pub use model::{AllocatorModel, Cost, Oom, SeedError};
pub use pytorch::{PytorchConfig, PytorchModel};
pub use recorded::{default_allocators, evaluate_snapshot, recorded};
