//! Readers for GPU allocation traces, turned into replayable allocation sequences.
//!
//! * [`pickle`]: a small reader for builtin-type Python pickles (what PyTorch snapshots are).
//! * [`snapshot`]: PyTorch memory snapshots, with the reconstruction of a ring-buffer window
//!   into a valid [`AllocSequence`] and PyTorch's own reserved-bytes curve.
//! * [`minimalloc`]: google/minimalloc static-lifetime benchmark CSVs.
//! * [`sequence`]: the common [`AllocSequence`] of [`Op`]s.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod minimalloc;
pub mod pickle;
pub mod sequence;
pub mod snapshot;

pub use sequence::{AllocSequence, Op, ReplayStats, SequenceError};
pub use snapshot::{Reconstruction, ReservedCurve, Snapshot, SnapshotError};
