//! cistern's integration tests, in one test binary: each module was once a binary of its own,
//! and linking fourteen binaries in debug and again in release cost CI about two minutes.
//! `cuda_driver` stays apart: `scripts/test.sh` runs it again over the fake libcuda, and the
//! GPU kit ships it alone. Run one module with `cargo test -p cistern --test suite stitching::`.

mod common;

mod acceptance;
mod busy_donors;
mod faults;
mod graphs;
mod interop;
mod model;
mod observe;
mod peers;
mod provenance;
mod registry;
mod registry_pool;
mod regressions;
mod replay;
mod share;
mod smoke;
mod stitching;
mod streams;
mod threads;
