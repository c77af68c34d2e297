//! Trace readers (being written).
