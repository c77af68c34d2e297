//! The command line's integration tests, in one test binary: each module was once a binary
//! of its own, and linking ten of them in debug and again in release cost CI over a minute.
//! They run the built `cistern` (`CARGO_BIN_EXE_cistern`) as a user would. Run one module
//! with `cargo test -p cistern-cli --test suite export::`.

mod common;
/// Snapshots with known answers, shared with the replay crate's tests.
#[path = "../../../replay/tests/suite/common/oom_traces.rs"]
mod oom_traces;

mod all_users;
mod doctor;
mod e2e_registry;
mod export;
mod fresh_clone;
mod hostile;
mod leaks;
mod nvml_check;
mod ps;
mod replay;
mod whatif;
