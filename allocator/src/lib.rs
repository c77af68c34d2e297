//! cistern: a stream-ordered, VMM-backed caching allocator for CUDA device memory.
//!
//! See the README for the ideas the pool rests on, and [`driver`] for the seam between the pool
//! and a device.
#![deny(missing_docs)]

pub mod driver;
