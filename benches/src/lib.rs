//! Benchmarks (being written).
