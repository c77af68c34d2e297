//! The work model: streams of synthetic work ([`SimDriver::launch`]) touching physical memory,
//! their completion (by tests or by synchronising calls, dependencies first), the ordering that
//! `stream_wait_event` establishes between streams, and the hazards found against unfinished
//! work ([`Hazard`], recorded on handout, unmap and release).

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::memory::Piece;
use super::{invalid, DevState, Device, SimDriver};
use crate::driver::{DeviceId, DriverCall, DriverError, PhysHandle, StreamId};

/// The call kind named by errors of [`SimDriver::launch`].
const LAUNCH_CALL: DriverCall = DriverCall::StreamWaitEvent;

/// One unit of work queued by [`SimDriver::launch`]; ids increase per device from 1.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkId(pub u64);

/// What kind of race a [`Hazard`] records.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum HazardKind {
    /// A range was handed out on one stream while unfinished work on another stream, not
    /// ordered before the handout stream, still touches its physical memory.
    ReuseWhileInUse,
    /// A mapping was unmapped while unfinished work launched over its addresses still touches
    /// its physical memory (work reaching the memory through another mapping is unaffected).
    UnmapWhileInUse,
    /// A physical handle was released while unfinished work still touches it.
    ReleaseWhileInUse,
    /// Linear memory was freed while unfinished work still touches it. The simulator's
    /// `mem_free` synchronises the device first (as `cuMemFree` does), so it never reports this
    /// kind itself; it exists for wrappers whose frees do not synchronise.
    FreeWhileInUse,
}

/// A race detected by the simulator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hazard {
    /// The device.
    pub dev: DeviceId,
    /// What happened.
    pub kind: HazardKind,
    /// The start of the range handed out or unmapped (0 for a release, which has no address).
    pub ptr: u64,
    /// The size of the range handed out or unmapped (the handle's size for a release).
    pub size: u64,
    /// The stream the range was handed out on (`None` unless the kind is `ReuseWhileInUse`).
    pub stream: Option<StreamId>,
    /// The released handle (`Some` only for `ReleaseWhileInUse`).
    pub handle: Option<PhysHandle>,
    /// The stream of the unfinished work.
    pub other_stream: StreamId,
    /// The unfinished work that still touches the memory.
    pub work: WorkId,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} on device {}: [{:#x}, +{:#x})",
            self.kind, self.dev, self.ptr, self.size
        )?;
        if let Some(s) = self.stream {
            write!(f, " handed out on stream {s}")?;
        }
        if let Some(h) = self.handle {
            write!(f, " handle {}", h.0)?;
        }
        write!(
            f,
            " while work {} on stream {} is unfinished",
            self.work.0, self.other_stream
        )
    }
}

/// A position in a stream: the work item `work` and everything before it on `stream`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Pos {
    pub(super) stream: u64,
    pub(super) work: u64,
}

/// Adds `p` to `set`, keeping one position (the latest) per stream: streams are FIFO, so the
/// latest position covers the earlier ones.
pub(super) fn merge_pos(set: &mut Vec<Pos>, p: Pos) {
    match set.iter_mut().find(|q| q.stream == p.stream) {
        Some(q) => q.work = q.work.max(p.work),
        None => set.push(p),
    }
}

#[derive(Debug)]
pub(super) struct Work {
    id: u64,
    pieces: Vec<Piece>,
    /// The address ranges it was launched over (`(start, end)`): unmapping one of them under
    /// it is a hazard, unmapping another alias of the same memory is not.
    vas: Vec<(u64, u64)>,
    /// Positions on other streams this work waits for (from `stream_wait_event`).
    deps: Vec<Pos>,
    /// Its stream's `waited` map when it was launched: what is ordered before it.
    pub(super) ordered_after: Arc<FxHashMap<u64, u64>>,
}

#[derive(Debug, Default)]
pub(super) struct StreamState {
    /// Unfinished work, oldest first (ids increase).
    queue: VecDeque<Work>,
    /// The last work item ever launched on this stream.
    pub(super) last: Option<u64>,
    /// Waits not yet attached to launched work.
    pub(super) pending_waits: Vec<Pos>,
    /// For each other stream, the last work id known to be ordered before this stream's future
    /// work (transitively). Shared copy-on-write with the work launched since it last changed.
    pub(super) waited: Arc<FxHashMap<u64, u64>>,
}

impl DevState {
    /// The unfinished work item at `p`, if any.
    pub(super) fn work_item(&self, p: Pos) -> Option<&Work> {
        let q = &self.streams.get(&p.stream)?.queue;
        let i = q.binary_search_by_key(&p.work, |w| w.id).ok()?;
        q.get(i)
    }

    /// What an event recorded on `stream` now captures: the stream's last work and the waits
    /// queued on it, less what has completed already.
    pub(super) fn capture(&self, stream: u64) -> Vec<Pos> {
        let mut positions = Vec::new();
        if let Some(ss) = self.streams.get(&stream) {
            if let Some(work) = ss.last {
                positions.push(Pos { stream, work });
            }
            for &p in &ss.pending_waits {
                merge_pos(&mut positions, p);
            }
        }
        positions.retain(|&p| !self.is_complete(p));
        positions
    }

    pub(super) fn is_complete(&self, p: Pos) -> bool {
        match self.streams.get(&p.stream).and_then(|s| s.queue.front()) {
            Some(w) => w.id > p.work,
            None => true,
        }
    }

    /// Completes the work at `p` and everything before it on its stream, dependencies first.
    /// Returns how many work items completed.
    pub(super) fn complete_through(&mut self, target: Pos) -> usize {
        // An explicit stack instead of recursion: wait chains can be long. Each position stays
        // on the stack until its stream has completed through it; dependencies are pushed above
        // it and so complete first. Dependencies were captured before their dependent work was
        // launched, so they have smaller ids and this terminates.
        let mut done = 0;
        let mut stack = vec![target];
        while let Some(&p) = stack.last() {
            let front = self
                .streams
                .get_mut(&p.stream)
                .and_then(|st| st.queue.front_mut())
                .filter(|w| w.id <= p.work);
            let Some(front) = front else {
                stack.pop();
                continue;
            };
            if front.deps.is_empty() {
                if let Some(st) = self.streams.get_mut(&p.stream) {
                    st.queue.pop_front();
                    done += 1;
                }
            } else {
                stack.append(&mut front.deps);
            }
        }
        done
    }

    fn complete_stream(&mut self, stream: u64) -> usize {
        match self.streams.get(&stream).and_then(|s| s.queue.back()) {
            Some(w) => {
                let work = w.id;
                self.complete_through(Pos { stream, work })
            }
            None => 0,
        }
    }

    pub(super) fn complete_all(&mut self) -> usize {
        let streams: Vec<u64> = self.streams.keys().copied().collect();
        streams.into_iter().map(|s| self.complete_stream(s)).sum()
    }

    /// Every unfinished work item (stream, id) that touches any of `pieces`.
    pub(super) fn work_touching(&self, pieces: &[Piece]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for (&sid, st) in &self.streams {
            for w in &st.queue {
                if w.pieces
                    .iter()
                    .any(|a| pieces.iter().any(|b| a.overlaps(b)))
                {
                    out.push((sid, w.id));
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Every unfinished work item (stream, id) that reaches `pieces` through an address in
    /// `[lo, hi)`: what unmapping that range would pull from under running work. Work that
    /// reaches the same memory through another mapping (an alias) keeps its own.
    pub(super) fn work_through(&self, lo: u64, hi: u64, pieces: &[Piece]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for (&sid, st) in &self.streams {
            for w in &st.queue {
                if w.vas.iter().any(|&(s, e)| s < hi && lo < e)
                    && w.pieces
                        .iter()
                        .any(|a| pieces.iter().any(|b| a.overlaps(b)))
                {
                    out.push((sid, w.id));
                }
            }
        }
        out.sort_unstable();
        out
    }
}

impl SimDriver {
    pub(super) fn record_hazards(&self, hazards: Vec<Hazard>) {
        if !hazards.is_empty() {
            self.hazards.lock().extend(hazards);
        }
    }

    /// Completes work with `f` and updates the device's unfinished counter.
    pub(super) fn complete_with(
        &self,
        d: &Device,
        f: impl FnOnce(&mut DevState) -> usize,
    ) -> usize {
        let mut st = d.state.lock();
        let n = f(&mut st);
        if n > 0 {
            d.unfinished.fetch_sub(n, Ordering::Relaxed);
        }
        n
    }

    // --- work model ---------------------------------------------------------------------------

    /// Queues one unit of synthetic work on `stream` touching the address ranges
    /// `(ptr, len)`. Every byte must be mapped with access granted, or inside a live linear
    /// allocation (else `InvalidValue`); ranges are translated to physical memory now, so a
    /// later remap of the same pages elsewhere is still tracked. Empty ranges are ignored. On
    /// a capturing stream the launch is recorded into the capture's graph instead
    /// ([`SimDriver::begin_capture`]) and its id is `WorkId(0)`.
    pub fn launch(
        &self,
        dev: DeviceId,
        stream: StreamId,
        ranges: &[(u64, u64)],
    ) -> Result<WorkId, DriverError> {
        let d = self.device(LAUNCH_CALL, dev)?;
        let st = d.state.lock();
        let mut pieces = Vec::new();
        for &(ptr, len) in ranges {
            let p = st
                .translate(ptr, len, true)
                .map_err(|m| invalid(LAUNCH_CALL, format!("launch: {m}")))?;
            pieces.extend(p);
        }
        drop(st);
        if self.record_into_capture(dev, stream, ranges) {
            // Recorded into the capture's graph, not run (`capture.rs`): no work item.
            return Ok(WorkId(0));
        }
        let mut st = d.state.lock();
        let id = st.next_work;
        st.next_work += 1;
        let ss = st.streams.entry(stream.0).or_default();
        let deps = std::mem::take(&mut ss.pending_waits);
        let ordered_after = Arc::clone(&ss.waited);
        let vas = ranges
            .iter()
            .filter(|&&(_, len)| len > 0)
            .map(|&(ptr, len)| (ptr, ptr.saturating_add(len)))
            .collect();
        ss.queue.push_back(Work {
            id,
            pieces,
            vas,
            deps,
            ordered_after,
        });
        ss.last = Some(id);
        d.unfinished.fetch_add(1, Ordering::Relaxed);
        Ok(WorkId(id))
    }

    /// Completes the oldest unfinished work item on `stream` (and its dependencies). Returns
    /// whether there was one.
    pub fn complete_next(&self, dev: DeviceId, stream: StreamId) -> bool {
        let Some(d) = self.devices.get(dev) else {
            return false;
        };
        self.complete_with(d, |st| {
            match st.streams.get(&stream.0).and_then(|s| s.queue.front()) {
                Some(w) => {
                    let work = w.id;
                    st.complete_through(Pos {
                        stream: stream.0,
                        work,
                    })
                }
                None => 0,
            }
        }) > 0
    }

    /// Completes all unfinished work on `stream` (and its dependencies).
    pub fn complete_stream(&self, dev: DeviceId, stream: StreamId) {
        if let Some(d) = self.devices.get(dev) {
            self.complete_with(d, |st| st.complete_stream(stream.0));
        }
    }

    /// Completes all unfinished work on device `dev`.
    pub fn complete_all(&self, dev: DeviceId) {
        if let Some(d) = self.devices.get(dev) {
            self.complete_with(d, DevState::complete_all);
        }
    }

    /// How many work items are unfinished on `stream` of device `dev` (host waits and
    /// completions finish them).
    pub fn unfinished_on(&self, dev: DeviceId, stream: StreamId) -> usize {
        self.devices.get(dev).map_or(0, |d| {
            d.state
                .lock()
                .streams
                .get(&stream.0)
                .map_or(0, |s| s.queue.len())
        })
    }

    /// How many work items are unfinished on device `dev`.
    pub fn unfinished_work(&self, dev: DeviceId) -> usize {
        self.devices
            .get(dev)
            .map_or(0, |d| d.unfinished.load(Ordering::Relaxed))
    }

    // --- hazards ------------------------------------------------------------------------------

    /// Every hazard recorded so far.
    pub fn hazards(&self) -> Vec<Hazard> {
        self.hazards.lock().clone()
    }

    /// Every hazard recorded so far, clearing the log.
    pub fn take_hazards(&self) -> Vec<Hazard> {
        std::mem::take(&mut *self.hazards.lock())
    }

    #[cold]
    #[inline(never)]
    pub(super) fn check_handout(
        &self,
        dev: DeviceId,
        d: &Device,
        ptr: u64,
        size: u64,
        stream: StreamId,
    ) {
        let st = d.state.lock();
        let pieces = st.translate_lenient(ptr, size);
        if pieces.is_empty() {
            return;
        }
        let waited = st.streams.get(&stream.0).map(|s| &s.waited);
        let mut found = Vec::new();
        for (&sid, ss) in &st.streams {
            if sid == stream.0 {
                continue;
            }
            let ordered = waited.and_then(|w| w.get(&sid)).copied().unwrap_or(0);
            for w in ss.queue.iter().filter(|w| w.id > ordered) {
                if w.pieces
                    .iter()
                    .any(|a| pieces.iter().any(|b| a.overlaps(b)))
                {
                    found.push(Hazard {
                        dev,
                        kind: HazardKind::ReuseWhileInUse,
                        ptr,
                        size,
                        stream: Some(stream),
                        handle: None,
                        other_stream: StreamId(sid),
                        work: WorkId(w.id),
                    });
                }
            }
        }
        drop(st);
        found.sort_by_key(|h| (h.other_stream, h.work));
        self.record_hazards(found);
    }
}
