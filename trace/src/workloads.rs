//! Synthetic workloads (placeholder).
