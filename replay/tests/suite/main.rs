//! The replay suite's integration tests, in one test binary (each module was once a binary
//! of its own; linking them in debug and again in release cost CI time). Run one module with
//! `cargo test -p cistern-replay --test suite faithful::`.

mod common;

mod cost;
mod engine;
mod faithful;
mod pytorch_rules;
mod seeded;
mod whatif;
