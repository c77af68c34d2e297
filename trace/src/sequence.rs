//! Allocator-level operation sequences: what every trace reader produces and replays consume.

use std::collections::HashMap;

/// One allocator operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Allocate `size` requested bytes on `stream`; `id` names the allocation until its `Free`.
    Alloc {
        /// Unique per allocation within one sequence.
        id: u64,
        /// Requested bytes (not rounded by any allocator).
        size: u64,
        /// The stream the allocation belongs to (PyTorch's `CUstream` value, or 0).
        stream: u64,
    },
    /// Free the allocation `id`; the memory may be reused from here on.
    Free {
        /// The id of an earlier, still live `Alloc`.
        id: u64,
    },
}

/// Test shorthand for `Op::Alloc { id, size, stream }`, for tests that spell out expected ops.
#[cfg(test)]
pub(crate) fn alloc(id: u64, size: u64, stream: u64) -> Op {
    Op::Alloc { id, size, stream }
}

/// A replayable sequence of allocations and frees.
///
/// Invariants (checked by [`AllocSequence::new`]): every `Alloc` id is unique, every `Free` names
/// an allocation that is live at that point. Allocations still live at the end are never freed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocSequence {
    /// The operations in order.
    pub ops: Vec<Op>,
    /// Largest sum of requested bytes live at once.
    pub peak_live_requested: u64,
    /// How many leading `Alloc`s stand for blocks that were already live when the trace began
    /// (reconstructed, not observed). Zero for complete traces.
    pub initially_live: usize,
}

/// A sequence that breaks the [`AllocSequence`] invariants.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SequenceError {
    /// An `Alloc` reuses an id that was already allocated.
    #[error("op {op_index}: allocation id {id} was already used")]
    DuplicateId {
        /// Position in `ops`.
        op_index: usize,
        /// The repeated id.
        id: u64,
    },
    /// A `Free` names an id that is not live.
    #[error("op {op_index}: free of id {id}, which is not live")]
    FreeOfDead {
        /// Position in `ops`.
        op_index: usize,
        /// The id freed.
        id: u64,
    },
    /// Live bytes exceed `u64::MAX`.
    #[error("op {op_index}: live bytes overflow u64")]
    Overflow {
        /// Position in `ops`.
        op_index: usize,
    },
}

/// What a replay of a sequence observed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Number of `Alloc` ops.
    pub allocs: usize,
    /// Number of `Free` ops.
    pub frees: usize,
    /// Largest sum of requested bytes live at once.
    pub peak_live: u64,
    /// Index of the first op after which `peak_live` was reached (0 for an empty sequence).
    pub peak_at_op: usize,
    /// Allocations live after the last op, as `(id, size)` in allocation order.
    pub live_at_end: Vec<(u64, u64)>,
}

impl ReplayStats {
    /// Sum of the sizes in `live_at_end`.
    pub fn live_bytes_at_end(&self) -> u64 {
        self.live_at_end.iter().map(|&(_, s)| s).sum()
    }
}

impl AllocSequence {
    /// Check `ops` and compute the peak.
    pub fn new(ops: Vec<Op>, initially_live: usize) -> Result<Self, SequenceError> {
        let stats = replay(&ops)?;
        Ok(AllocSequence {
            ops,
            peak_live_requested: stats.peak_live,
            initially_live,
        })
    }

    /// Replay the sequence, checking its invariants, and report peak and final live set.
    pub fn replay(&self) -> Result<ReplayStats, SequenceError> {
        replay(&self.ops)
    }

    /// Largest sum of requested bytes live at once (recomputed; 0 if the sequence is invalid).
    pub fn peak_live(&self) -> u64 {
        replay(&self.ops).map(|s| s.peak_live).unwrap_or(0)
    }

    /// Number of `Alloc` ops.
    pub fn alloc_count(&self) -> usize {
        self.ops
            .iter()
            .filter(|o| matches!(o, Op::Alloc { .. }))
            .count()
    }

    /// Live requested bytes after each op (one entry per op).
    pub fn live_curve(&self) -> Vec<u64> {
        let mut sizes: HashMap<u64, u64> = HashMap::new();
        let mut live = 0u64;
        self.ops
            .iter()
            .map(|op| {
                match *op {
                    Op::Alloc { id, size, .. } => {
                        sizes.insert(id, size);
                        live = live.saturating_add(size);
                    }
                    Op::Free { id } => live = live.saturating_sub(sizes.remove(&id).unwrap_or(0)),
                }
                live
            })
            .collect()
    }
}

pub(crate) fn replay(ops: &[Op]) -> Result<ReplayStats, SequenceError> {
    // id -> (size, position in allocation order); the order keeps `live_at_end` deterministic.
    let mut live: HashMap<u64, (u64, usize)> = HashMap::new();
    let mut dead: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut stats = ReplayStats::default();
    let mut bytes = 0u64;
    for (op_index, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, .. } => {
                if live.contains_key(&id) || dead.contains(&id) {
                    return Err(SequenceError::DuplicateId { op_index, id });
                }
                live.insert(id, (size, stats.allocs));
                stats.allocs += 1;
                bytes = bytes
                    .checked_add(size)
                    .ok_or(SequenceError::Overflow { op_index })?;
                if bytes > stats.peak_live {
                    stats.peak_live = bytes;
                    stats.peak_at_op = op_index;
                }
            }
            Op::Free { id } => {
                let Some((size, _)) = live.remove(&id) else {
                    return Err(SequenceError::FreeOfDead { op_index, id });
                };
                dead.insert(id);
                stats.frees += 1;
                // Cannot underflow: `bytes` includes `size` since its Alloc.
                bytes -= size;
            }
        }
    }
    let mut end: Vec<(usize, u64, u64)> = live
        .into_iter()
        .map(|(id, (size, order))| (order, id, size))
        .collect();
    end.sort_unstable();
    stats.live_at_end = end.into_iter().map(|(_, id, size)| (id, size)).collect();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_and_errors() {
        let ops = vec![
            Op::Alloc {
                id: 1,
                size: 10,
                stream: 0,
            },
            Op::Alloc {
                id: 2,
                size: 5,
                stream: 0,
            },
            Op::Free { id: 1 },
            Op::Alloc {
                id: 3,
                size: 7,
                stream: 0,
            },
        ];
        let s = AllocSequence::new(ops.clone(), 0).unwrap();
        assert_eq!(s.peak_live_requested, 15);
        assert_eq!(s.peak_live(), 15);
        assert_eq!(s.live_curve(), vec![10, 15, 5, 12]);
        let r = s.replay().unwrap();
        assert_eq!(r.live_at_end, vec![(2, 5), (3, 7)]);
        assert_eq!(r.peak_at_op, 1);

        let mut bad = ops.clone();
        bad.push(Op::Free { id: 1 });
        assert_eq!(
            AllocSequence::new(bad, 0),
            Err(SequenceError::FreeOfDead { op_index: 4, id: 1 })
        );
        let mut bad = ops;
        bad.push(Op::Alloc {
            id: 1,
            size: 1,
            stream: 0,
        });
        assert_eq!(
            AllocSequence::new(bad, 0),
            Err(SequenceError::DuplicateId { op_index: 4, id: 1 })
        );
    }
}
