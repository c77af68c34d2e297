//! Blocks freed while other streams may still use them: who used them ([`StreamRef`]), what
//! their free waits for ([`Pending`]: events, a device synchronisation, or a capture's end),
//! and the polls that give them back ([`ArenaState::process_pending`]).

use std::thread::ThreadId;

use super::{ArenaState, DeviceCore, EventCache, HeapKind};
use crate::driver::{DeviceId, Driver, EventId, StreamId, StreamInfo};
use crate::heap::SpanId;
use crate::pool::PoolEventKind;

/// A stream, as an arena or a `record_stream` use knows it: the handle to name it with, and
/// what identifies it (see [`crate::driver::Driver::stream_info`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct StreamRef {
    /// The handle the stream was first seen with.
    pub handle: StreamId,
    /// The device whose context the stream belongs to.
    pub dev: DeviceId,
    /// The driver's id of the stream (unique among live streams).
    pub id: u64,
    /// For `CU_STREAM_PER_THREAD`: the only thread on which `handle` names this stream.
    pub thread: Option<ThreadId>,
}

impl StreamRef {
    /// The stream `info` describes, seen as `handle` on the calling thread.
    pub fn new(handle: StreamId, info: StreamInfo) -> Self {
        StreamRef {
            handle,
            dev: info.device,
            id: info.id,
            thread: info.per_thread.then(|| std::thread::current().id()),
        }
    }

    /// The handle that names this stream on the calling thread, if one does (a per-thread
    /// stream can only be named on its own thread).
    pub fn handle_here(&self) -> Option<StreamId> {
        match self.thread {
            Some(t) if t != std::thread::current().id() => None,
            _ => Some(self.handle),
        }
    }

    /// Whether both name the same stream: the same driver id, or, where either was resolved
    /// while its stream captured (no driver id: [`crate::driver::CAPTURING_ID`]), the same
    /// handle on the same device.
    pub fn same(&self, other: &StreamRef) -> bool {
        self.dev == other.dev
            && (self.id == other.id
                || ((self.id | other.id) & crate::driver::CAPTURING_ID != 0
                    && self.handle.canonical() == other.handle.canonical()
                    && self.thread.is_none()
                    && other.thread.is_none()))
    }
}

/// A block freed while other streams may still use it.
#[derive(Debug)]
pub(crate) struct Pending {
    pub kind: HeapKind,
    pub span: SpanId,
    /// One event per other stream that used the block: the stream's (device, id) and the
    /// event, created on that device.
    pub events: Vec<((DeviceId, u64), EventId)>,
    /// Some stream's use could not be captured by an event and its device could not be
    /// synchronised: the block waits for a successful synchronisation of device `sync_dev`.
    pub needs_device_sync: bool,
    /// The device to synchronise when `needs_device_sync`.
    pub sync_dev: DeviceId,
    /// Streams whose events are not recorded yet: the block was freed while a graph capture
    /// may have been underway (a graph pool's window was open, or the stream itself was
    /// capturing), when an event recorded on a capturing stream would be part of the graph and
    /// never complete. They are recorded at the first poll after the capture (later than the
    /// free, so they order at least as much work: safe); the block stays pending until then.
    pub deferred: Vec<StreamRef>,
}

impl Pending {
    /// Records an event on each of `streams` (other streams that used the block). A stream on
    /// which no event can be recorded (another thread's per-thread stream, a driver fault) is
    /// waited for by synchronising its whole device instead, so the block is still never
    /// reused too early; if even that fails, the block waits for a later successful
    /// synchronisation of that device.
    ///
    /// `keep_unnamed` (a poll that may not block: deferred uses recorded at last): a use this
    /// thread cannot name (another thread's per-thread stream) stays deferred rather than
    /// synchronise the device on the allocation path, where the stream may still be capturing;
    /// its own thread's next poll, or a blocking one, records it.
    pub(super) fn record<D: Driver>(
        &mut self,
        streams: Vec<StreamRef>,
        core: &DeviceCore<D>,
        keep_unnamed: bool,
    ) {
        let (dev, driver, events) = (core.dev, &*core.driver, &core.events);
        for u in streams {
            let handle = u.handle_here();
            if handle.is_none() && keep_unnamed {
                self.deferred.push(u);
                continue;
            }
            // Only a stream known to be capturing: one the driver cannot answer for (destroyed)
            // takes the path below (no event: the device is waited for instead).
            if handle.is_some_and(|h| driver.stream_capturing(u.dev, h) == Ok(true)) {
                // A stream capturing a graph cistern was not told of: an event recorded there
                // would be a captured event, which no query may touch without breaking the
                // capture, and a device synchronisation now would break it too. Deferred, as
                // during a graph pool's window: recorded at a poll once the capture is over.
                self.deferred.push(u);
                continue;
            }
            let recorded = handle.and_then(|h| record_use(driver, events, dev, u.dev, h));
            match recorded {
                Some(ev) => self.events.push(((u.dev, u.id), ev)),
                None => {
                    if !self.needs_device_sync && !core.sync_device(u.dev) {
                        self.needs_device_sync = true;
                        self.sync_dev = u.dev;
                    }
                }
            }
        }
    }
}

impl ArenaState {
    /// Frees pending blocks whose events have all completed. With `wait`, blocks on the events
    /// first (the OOM protocol). Returns how many blocks were freed.
    ///
    /// Without `wait` (the hot path), pending frees are polled in the order they were made and,
    /// per stream, only up to the first event that has not completed, as PyTorch's
    /// `process_events` does: events recorded later on the same stream cannot have completed
    /// before it, so querying them would be a wasted driver call. A poll costs at most one
    /// query per stream with unfinished work, however many frees are pending.
    ///
    /// While a graph capture may be underway it does nothing (no query, no wait); after it,
    /// the events of frees made during it are recorded first.
    pub fn process_pending<D: Driver>(&mut self, wait: bool, core: &DeviceCore<D>) -> usize {
        if core.capturing() {
            return 0;
        }
        for p in self.pending.iter_mut().filter(|p| !p.deferred.is_empty()) {
            let streams = std::mem::take(&mut p.deferred);
            p.record(streams, core, !wait);
        }
        let (dev, driver, events) = (core.dev, &*core.driver, &core.events);
        // Streams whose oldest pending event has not completed yet (small: one per stream).
        let mut blocked: Vec<(DeviceId, u64)> = Vec::new();
        let mut done_spans: Vec<(HeapKind, SpanId)> = Vec::new();
        // Taken out (no allocation) so that the list can be filtered in order while the
        // finished blocks' spans are collected.
        let mut pending = std::mem::take(&mut self.pending);
        pending.retain_mut(|p| {
            if p.needs_device_sync {
                // Only a blocking wait may synchronise the device (never the hot path).
                if !wait || !core.sync_device(p.sync_dev) {
                    return true;
                }
                p.needs_device_sync = false;
            }
            // Completed events leave the block as they are seen, so that a block held back by
            // one stream does not query another stream's finished event again on every poll.
            let mut k = 0;
            while k < p.events.len() {
                let (s, ev) = p.events[k];
                let ev_dev = s.0;
                let ok = if wait {
                    // An event the driver cannot wait for: the whole device is waited for.
                    driver.event_synchronize(ev_dev, ev).is_ok() || core.sync_device(ev_dev)
                } else if blocked.contains(&s) {
                    false
                } else {
                    match driver.event_query(ev_dev, ev) {
                        Ok(true) => true,
                        Ok(false) => {
                            blocked.push(s);
                            false
                        }
                        // A failed query is not "done": the block stays pending rather than
                        // risk reuse while another stream writes it. It may never answer
                        // (driver 580 refuses, for as long as it is not recorded again, an
                        // event recorded in a capture that has ended), so the block waits for
                        // a device synchronisation, which a blocking poll makes, and holds
                        // back no later free on the stream.
                        Err(_) => {
                            if !p.needs_device_sync {
                                p.needs_device_sync = true;
                                p.sync_dev = ev_dev;
                            }
                            false
                        }
                    }
                };
                if ok {
                    if ev_dev == dev {
                        events.put(ev);
                    } else {
                        let _ = driver.event_destroy(ev_dev, ev);
                    }
                    p.events.swap_remove(k);
                } else if wait {
                    break;
                } else {
                    k += 1;
                }
            }
            // Not while a use is still deferred (its stream was capturing at the last poll).
            let done = p.events.is_empty() && p.deferred.is_empty();
            if done {
                done_spans.push((p.kind, p.span));
            }
            !done
        });
        self.pending = pending;
        for &(kind, span) in &done_spans {
            let s = self.kinds[kind].heap.span(span);
            core.observer.emit(
                PoolEventKind::FreeCompleted,
                core.dev,
                s.start,
                s.requested,
                self.graph_pool,
            );
            self.release_span(kind, span, None, &core.shared);
        }
        done_spans.len()
    }

    /// Retries the device synchronisation that blocks pending frees whose uses no event could
    /// capture (slow paths only: it blocks the host). Returns whether none is left waiting.
    pub fn retry_device_sync<D: Driver>(&mut self, core: &DeviceCore<D>) -> bool {
        if core.capturing() {
            return false;
        }
        let mut devs: Vec<DeviceId> = Vec::new();
        for p in self.pending.iter().filter(|p| p.needs_device_sync) {
            if !devs.contains(&p.sync_dev) {
                devs.push(p.sync_dev);
            }
        }
        let mut all = true;
        for d in devs {
            if core.sync_device(d) {
                for p in self.pending.iter_mut().filter(|p| p.sync_dev == d) {
                    p.needs_device_sync = false;
                }
            } else {
                all = false;
            }
        }
        all
    }
}

/// Records an event on `stream` of device `on` for a block of device `dev`: from `dev`'s event
/// cache when the stream is on the same device, else a fresh event of `on` (destroyed when it
/// has completed). `None` when no event could be recorded.
fn record_use<D: Driver>(
    driver: &D,
    events: &EventCache,
    dev: DeviceId,
    on: DeviceId,
    stream: StreamId,
) -> Option<EventId> {
    let ev = if on == dev {
        events.get(driver, dev).ok()?
    } else {
        driver.event_create(on).ok()?
    };
    if driver.event_record(on, ev, stream).is_ok() {
        return Some(ev);
    }
    if on == dev {
        events.put(ev);
    } else {
        let _ = driver.event_destroy(on, ev);
    }
    None
}
