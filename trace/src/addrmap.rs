//! Turning address-keyed allocation events (snapshot windows, profiler traces, RMM logs) into
//! id-keyed [`AllocSequence`]s: addresses are reused, ids are not.
//!
//! The one copy of the rules that [`Snapshot::reconstruct`](crate::Snapshot::reconstruct), the
//! `kineto` and the `rmm` readers share: a free of an address the window never allocated stands
//! for a block that was live before the window opened and becomes an `Alloc` at the start; an
//! alloc over a live address frees the older block first; a second free of the same block is
//! ignored. Each workaround is reported as an [`AddrAnomaly`].

use std::collections::{HashMap, HashSet};

use crate::sequence::{AllocSequence, Op, ReplayStats, SequenceError};

/// Something in an address-keyed event stream that does not fit itself (or, for a snapshot, its
/// final state); worked around.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddrAnomaly {
    /// An allocation at an address that was still live; the older block is freed first.
    AllocOverLive {
        /// Index of the event in the reader's event order.
        event: usize,
        /// The address.
        addr: u64,
    },
    /// A free of an address the window already saw freed and not allocated again; ignored.
    DoubleFree {
        /// Index of the event.
        event: usize,
        /// The address.
        addr: u64,
    },
    /// The free's size differs from its allocation's size (the allocation's is used).
    FreeSizeMismatch {
        /// Index of the event.
        event: usize,
        /// The address.
        addr: u64,
        /// Size at allocation.
        alloc_size: u64,
        /// Size at free.
        free_size: u64,
    },
    /// Snapshots: allocated in the window and never freed, but no active block is at that
    /// address at the end.
    LiveButNotInSegments {
        /// The address.
        addr: u64,
        /// Requested size from the trace.
        size: u64,
    },
    /// Snapshots: allocated in the window and never freed, but the final block's requested size
    /// differs.
    EndSizeMismatch {
        /// The address.
        addr: u64,
        /// Requested size from the trace.
        trace_size: u64,
        /// Requested size (or size) of the final block.
        segment_size: u64,
    },
    /// Snapshots: an active final block at an address the window freed and never allocated
    /// again; left out.
    ActiveButFreedInWindow {
        /// The address.
        addr: u64,
        /// Its requested size (or size).
        size: u64,
    },
}

/// Why [`AddrSequencer::finish`] could not build a replayable sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FinishError {
    /// The reader's event whose op broke the sequence (`None` for an initial block).
    pub event: Option<usize>,
    /// What broke.
    pub error: SequenceError,
}

/// The result of `AddrSequencer::finish`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddrSequence {
    /// The replayable sequence; initial allocations come first.
    pub sequence: AllocSequence,
    /// For each op, the event it came from (`None` for initial allocations).
    pub op_events: Vec<Option<usize>>,
    /// For each initial allocation (the first `sequence.initially_live` ops, in order), where
    /// it was, when the reader knew.
    pub initial_addrs: Vec<Option<u64>>,
    /// How many initial allocations came from frees of blocks never allocated in the window.
    pub initial_from_frees: usize,
    /// Inconsistencies found and worked around.
    pub anomalies: Vec<AddrAnomaly>,
}

enum Step {
    Alloc { key: usize, size: u64, stream: u64 },
    Free { key: usize },
}

/// A block live before the window.
struct Initial {
    key: usize,
    /// Where it was (`None` for a block the reader adds without an address).
    addr: Option<u64>,
    size: u64,
    stream: u64,
}

/// Collects address-keyed events in order and assigns ids.
#[derive(Default)]
pub(crate) struct AddrSequencer {
    next_key: usize,
    steps: Vec<(usize, Step)>,
    live: HashMap<u64, (usize, u64)>,
    seen: HashSet<u64>,
    /// Blocks live before the window, in discovery order.
    initial: Vec<Initial>,
    anomalies: Vec<AddrAnomaly>,
}

impl AddrSequencer {
    fn key(&mut self) -> usize {
        let k = self.next_key;
        self.next_key += 1;
        k
    }

    /// Bytes currently live according to the events so far (initial blocks included).
    pub(crate) fn initial_bytes(&self) -> u64 {
        self.initial
            .iter()
            .map(|b| b.size)
            .fold(0, u64::saturating_add)
    }

    /// Add a block that was live before the window and is never freed in it.
    pub(crate) fn add_initial(&mut self, size: u64, stream: u64) {
        self.push_initial(None, size, stream);
    }

    /// [`AddrSequencer::add_initial`] for a block known to be at `addr`.
    pub(crate) fn add_initial_at(&mut self, addr: u64, size: u64, stream: u64) {
        self.push_initial(Some(addr), size, stream);
    }

    fn push_initial(&mut self, addr: Option<u64>, size: u64, stream: u64) -> usize {
        let key = self.key();
        self.initial.push(Initial {
            key,
            addr,
            size,
            stream,
        });
        key
    }

    /// Whether a block allocated in the window is live at `addr` now.
    pub(crate) fn is_live(&self, addr: u64) -> bool {
        self.live.contains_key(&addr)
    }

    /// Whether any event so far allocated or freed `addr`.
    pub(crate) fn was_seen(&self, addr: u64) -> bool {
        self.seen.contains(&addr)
    }

    /// `(address, size)` of the blocks live now, in address order.
    pub(crate) fn live_blocks(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.live.iter().map(|(&a, &(_, s))| (a, s)).collect();
        v.sort_unstable();
        v
    }

    /// Reports an anomaly the reader found itself (after the anomalies found so far).
    pub(crate) fn report(&mut self, anomaly: AddrAnomaly) {
        self.anomalies.push(anomaly);
    }

    /// Orders the initial blocks by address (then discovery order), instead of discovery order.
    pub(crate) fn sort_initial_by_address(&mut self) {
        self.initial.sort_by_key(|b| (b.addr, b.key));
    }

    pub(crate) fn alloc(&mut self, event: usize, addr: u64, size: u64, stream: u64) {
        if let Some((key, _)) = self.live.remove(&addr) {
            self.anomalies
                .push(AddrAnomaly::AllocOverLive { event, addr });
            self.steps.push((event, Step::Free { key }));
        }
        let key = self.key();
        self.live.insert(addr, (key, size));
        self.seen.insert(addr);
        self.steps.push((event, Step::Alloc { key, size, stream }));
    }

    pub(crate) fn free(&mut self, event: usize, addr: u64, size: u64, stream: u64) {
        if let Some((key, alloc_size)) = self.live.remove(&addr) {
            if alloc_size != size {
                self.anomalies.push(AddrAnomaly::FreeSizeMismatch {
                    event,
                    addr,
                    alloc_size,
                    free_size: size,
                });
            }
            self.steps.push((event, Step::Free { key }));
        } else if self.seen.insert(addr) {
            let key = self.push_initial(Some(addr), size, stream);
            self.steps.push((event, Step::Free { key }));
        } else {
            self.anomalies.push(AddrAnomaly::DoubleFree { event, addr });
        }
    }

    /// The replayable sequence. Addresses make every sequence well formed except one whose
    /// live bytes overflow u64 (absurd sizes): that is an error naming the event of the op.
    pub(crate) fn finish(self, initial_from_frees: usize) -> Result<AddrSequence, FinishError> {
        let (mut r, replayed) = self.assemble(initial_from_frees);
        match replayed {
            Ok(stats) => {
                r.sequence.peak_live_requested = stats.peak_live;
                Ok(r)
            }
            Err(error) => {
                let op = match error {
                    SequenceError::DuplicateId { op_index, .. }
                    | SequenceError::FreeOfDead { op_index, .. }
                    | SequenceError::Overflow { op_index } => op_index,
                };
                Err(FinishError {
                    event: r.op_events.get(op).copied().flatten(),
                    error,
                })
            }
        }
    }

    /// [`AddrSequencer::finish`] for a reader that cannot fail: an unreplayable sequence (live
    /// bytes beyond u64) is kept, with a zero peak.
    pub(crate) fn finish_or_zero_peak(self, initial_from_frees: usize) -> AddrSequence {
        let (mut r, replayed) = self.assemble(initial_from_frees);
        r.sequence.peak_live_requested = replayed.map(|s| s.peak_live).unwrap_or(0);
        r
    }

    /// The ops with their final ids (peak not set yet), and their replay.
    fn assemble(
        self,
        initial_from_frees: usize,
    ) -> (AddrSequence, Result<ReplayStats, SequenceError>) {
        let mut id_of = vec![0u64; self.next_key];
        let n = self.initial.len() + self.steps.len();
        let mut ops = Vec::with_capacity(n);
        let mut op_events = Vec::with_capacity(n);
        let mut next_id = 0u64;
        for &Initial {
            key, size, stream, ..
        } in &self.initial
        {
            id_of[key] = next_id;
            ops.push(Op::Alloc {
                id: next_id,
                size,
                stream,
            });
            op_events.push(None);
            next_id += 1;
        }
        for (event, step) in self.steps {
            ops.push(match step {
                Step::Alloc { key, size, stream } => {
                    id_of[key] = next_id;
                    next_id += 1;
                    Op::Alloc {
                        id: id_of[key],
                        size,
                        stream,
                    }
                }
                Step::Free { key } => Op::Free { id: id_of[key] },
            });
            op_events.push(Some(event));
        }
        let initially_live = self.initial.len();
        let initial_addrs = self.initial.iter().map(|b| b.addr).collect();
        // Keys are fresh per alloc and only live keys are freed, so the replay can fail only by
        // overflowing u64 live bytes.
        let replayed = crate::sequence::replay(&ops);
        let r = AddrSequence {
            sequence: AllocSequence {
                ops,
                peak_live_requested: 0,
                initially_live,
            },
            op_events,
            initial_addrs,
            initial_from_frees,
            anomalies: self.anomalies,
        };
        (r, replayed)
    }

    /// How many initial blocks came from frees so far.
    pub(crate) fn initial_count(&self) -> usize {
        self.initial.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence::alloc;

    #[test]
    fn addresses_become_ids() {
        let mut s = AddrSequencer::default();
        s.free(0, 0x10, 8, 0); // live before the window
        s.alloc(1, 0x10, 4, 1);
        s.alloc(2, 0x10, 4, 1); // over live
        s.free(3, 0x10, 5, 1); // size mismatch
        s.free(4, 0x10, 4, 1); // double free
        let n = s.initial_count();
        let r = s.finish(n).unwrap();
        assert_eq!(
            r.sequence.ops,
            vec![
                alloc(0, 8, 0),
                Op::Free { id: 0 },
                alloc(1, 4, 1),
                Op::Free { id: 1 },
                alloc(2, 4, 1),
                Op::Free { id: 2 },
            ]
        );
        assert_eq!(r.sequence.initially_live, 1);
        assert_eq!(r.initial_from_frees, 1);
        assert_eq!(r.anomalies.len(), 3);
        assert_eq!(r.op_events[0], None);
        assert_eq!(r.initial_addrs, vec![Some(0x10)]);
        assert!(r.sequence.replay().is_ok());
    }
}
