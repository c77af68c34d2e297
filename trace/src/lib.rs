//! Readers for GPU allocation traces, turned into replayable allocation sequences.
//!
//! * [`pickle`]: a small reader for builtin-type Python pickles (what PyTorch snapshots are).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod pickle;
