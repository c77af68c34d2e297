//! The trace readers' integration tests, in one test binary (each module was once a binary of
//! its own; linking them in debug and again in release cost CI time). Run one module with
//! `cargo test -p cistern-trace --test suite real_traces::`.

mod common;

mod formats;
mod fuzz;
mod fuzz_readers;
mod real_traces;
