//! Readers for GPU allocation traces, turned into replayable allocation sequences.
//!
//! * [`load()`]: one entry point that detects the format and returns one [`Trace`] per device.
//! * [`pickle`]: a small reader for builtin-type Python pickles (what PyTorch snapshots are).
//! * [`snapshot`]: PyTorch memory snapshots, with the reconstruction of a ring-buffer window
//!   into a valid [`AllocSequence`], PyTorch's own reserved-bytes curve, and the allocator's
//!   state when the window opened ([`WindowStart`]).
//! * [`kineto`]: PyTorch profiler traces (`[memory]` events), JSON or gzipped JSON.
//! * [`rmm`]: RAPIDS RMM `logging_resource_adaptor` CSV logs.
//! * [`own`]: cistern's own line-oriented trace format, its writer and an RMM CSV export.
//! * [`minimalloc`]: google/minimalloc static-lifetime benchmark CSVs.
//! * [`workloads`]: deterministic synthetic workloads (training, LLM serving, RMM's random
//!   allocations, scaled MiniMalloc instances).
//! * [`addrmap`]: address-keyed events to id-keyed sequences (used by `kineto` and `rmm`).
//! * [`line_error`]: the one error type of the line-oriented readers (`own`, `rmm`,
//!   `minimalloc`).
//! * [`sequence`]: the common [`AllocSequence`] of [`Op`]s.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod addrmap;
pub mod kineto;
pub mod line_error;
pub mod load;
pub mod minimalloc;
pub mod own;
pub mod pickle;
pub mod rmm;
pub mod sequence;
pub mod snapshot;
pub mod workloads;

pub use load::{load, load_with, Format, LoadError, LoadOptions, Trace};
pub use sequence::{AllocSequence, Op, ReplayStats, SequenceError};
pub use snapshot::{Reconstruction, ReservedCurve, Snapshot, SnapshotError, WindowStart};
