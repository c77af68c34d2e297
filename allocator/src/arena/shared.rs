//! What every arena of one device shares: the driver, the settings, the published statistics,
//! a cache of events and the pool's event counters ([`DeviceCore`]). The device pool creates one
//! per device and hands an `Arc` of it to each arena, so that an arena can free, poll its
//! pending frees and tear itself down without reaching back into the pool.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::config::Config;
use crate::driver::{DeviceCaps, DeviceId, Driver, DriverResult, EventId, StreamId, StreamInfo};
use crate::error::Error;
use crate::stats::SharedGauges;

/// A cache of driver events, so that pending frees do not create and destroy one each time.
#[derive(Debug, Default)]
pub(crate) struct EventCache {
    free: Mutex<Vec<EventId>>,
}

impl EventCache {
    /// An event, from the cache or freshly created.
    pub(crate) fn get<D: Driver + ?Sized>(
        &self,
        driver: &D,
        dev: DeviceId,
    ) -> crate::driver::DriverResult<EventId> {
        if let Some(ev) = self.free.lock().pop() {
            return Ok(ev);
        }
        driver.event_create(dev)
    }

    /// Returns an event to the cache.
    pub(crate) fn put(&self, ev: EventId) {
        self.free.lock().push(ev);
    }

    /// Takes every cached event (to destroy them when the pool closes).
    pub(crate) fn drain(&self) -> Vec<EventId> {
        std::mem::take(&mut *self.free.lock())
    }
}

/// Event counters of a device pool (read into [`crate::Stats`]): mostly slow-path events, and
/// the hot path's pending frees, invalid frees and `record_stream` calls.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) num_alloc_retries: AtomicU64,
    pub(crate) num_ooms: AtomicU64,
    pub(crate) num_limit_ooms: AtomicU64,
    pub(crate) num_invalid_frees: AtomicU64,
    pub(crate) num_stitches: AtomicU64,
    pub(crate) num_stitched_pages: AtomicU64,
    pub(crate) num_cross_stream_pages: AtomicU64,
    pub(crate) num_device_alloc: AtomicU64,
    pub(crate) num_device_free: AtomicU64,
    pub(crate) num_sync_all_streams: AtomicU64,
    pub(crate) num_stream_syncs: AtomicU64,
    pub(crate) num_pending_frees: AtomicU64,
    pub(crate) num_released_pages: AtomicU64,
    pub(crate) num_driver_errors: AtomicU64,
    pub(crate) num_record_streams: AtomicU64,
    /// Chunks moved from a busy stream with the order kept on the device.
    pub(crate) num_ordered_moves: AtomicU64,
    /// Old mappings of such moves unmapped once the donor's work was done.
    pub(crate) num_deferred_unmaps: AtomicU64,
}

/// What [`DeviceCore::stream_mark`] found a stream doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamMark {
    /// All its queued work has finished.
    Idle,
    /// Work is queued: this event, recorded after it, completes when it has finished.
    Busy(EventId),
    /// Not known: a capture is underway, the stream cannot be named here, or the driver
    /// failed to record or query an event.
    Unknown,
}

/// What every arena of a device shares: the driver, the settings, the published statistics.
pub(crate) struct DeviceCore<D: Driver> {
    pub(crate) uid: u64,
    pub(crate) dev: DeviceId,
    pub(crate) driver: Arc<D>,
    pub(crate) caps: DeviceCaps,
    pub(crate) config: Config,
    pub(crate) granularity: u64,
    pub(crate) vmm: bool,
    pub(crate) shared: SharedGauges,
    pub(crate) events: EventCache,
    pub(crate) counters: Counters,
    pub(crate) closed: AtomicBool,
    /// Allocation windows into graph pools now open (`begin_allocate_to_pool` without its
    /// `end`): while any is, a stream of the device may be capturing a CUDA graph, and nothing
    /// here queries or waits for an event, a stream or the device (see Note [Capture-safe]
    /// in `crate::pool::graphs`).
    pub(crate) capturing: AtomicUsize,
    pub(crate) recorder: Option<crate::trace_writer::Recorder>,
    /// Who hears of mappings, segments and completed frees (`DevicePool::set_observer`).
    pub(crate) observer: crate::pool::ObserverSlot,
    /// Chunks exported to other processes, ranges opened from them (`pool/share.rs`).
    pub(crate) share: crate::pool::ShareState,
    /// The handles of the streams with an arena of the device (not the special handles): asked
    /// whether they capture before a device synchronisation ([`Self::sync_device`]). Kept by
    /// the device pool as it makes, retires and sweeps arenas; a leaf lock.
    pub(crate) streams: Mutex<Vec<StreamId>>,
}

impl<D: Driver> DeviceCore<D> {
    /// Blocks the host until all work on device `dev` has completed, unless a graph capture
    /// may be under way that the synchronisation would invalidate (`cuCtxSynchronize` does, in
    /// every capture mode): while a graph pool's window is open, and where the driver refuses
    /// because it sees one. So that it sees the captures of the streams cistern knows, each
    /// stream with an arena here is asked first (`Driver::stream_capturing`; the CUDA backend
    /// remembers those that capture): a stream used before the capture and captured since,
    /// whose allocations during it are served from this thread's cache without a driver call,
    /// is otherwise unseen. Slow paths only. Whether the device was synchronised.
    pub(crate) fn sync_device(&self, dev: DeviceId) -> bool {
        if self.capturing() {
            return false;
        }
        if dev == self.dev {
            let streams = self.streams.lock().clone();
            for s in streams {
                let _ = self.driver.stream_capturing(dev, s);
            }
        }
        self.driver.device_synchronize(dev).is_ok()
    }

    /// Adds `stream` to those [`Self::sync_device`] asks of (not a special handle: the backend
    /// asks of the legacy stream itself).
    pub(crate) fn know_stream(&self, stream: StreamId) {
        let mut known = self.streams.lock();
        if !stream.is_special() && !known.contains(&stream) {
            known.push(stream);
        }
    }

    /// `stream` is gone, or its handle names another stream now: never asked of again here,
    /// and the driver forgets it too ([`Driver::forget_stream`]).
    pub(crate) fn forget_stream(&self, stream: StreamId) {
        self.streams.lock().retain(|&s| s != stream);
        self.driver.forget_stream(stream);
    }

    /// Whether a graph capture may be underway on the device: no event query, no host wait.
    #[inline]
    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(Relaxed) != 0
    }

    /// Counts, logs (or aborts, with `strict`) and describes the free of an unknown pointer.
    pub(crate) fn invalid_free(&self, ptr: u64, why: &str) -> Error {
        self.counters.num_invalid_frees.fetch_add(1, Relaxed);
        let msg = format!(
            "cistern: ignoring free of {ptr:#x} on device {}: {why} (counted in num_invalid_frees)",
            self.dev
        );
        if self.config.strict {
            eprintln!("{msg}; aborting because strict:true is set");
            std::process::abort();
        }
        crate::log_rate_limited(&msg);
        Error::InvalidArgument(format!("{ptr:#x} is not a live allocation: {why}"))
    }

    /// What `stream`, named by a caller of `record_stream`, is: a special handle means the
    /// stream of the caller's current device (this device when it has none), as the driver
    /// resolves it.
    pub(crate) fn resolve_use(&self, stream: StreamId) -> DriverResult<StreamInfo> {
        let on = if stream.is_special() {
            self.driver.current_device().unwrap_or(self.dev)
        } else {
            self.dev
        };
        self.driver.stream_info(on, stream)
    }

    /// Whether all work queued on `stream` so far has finished, without blocking: records an
    /// event there and queries it. A failure to record or query counts as "busy", and so does
    /// a stream that cannot be named here (`None`: gone, or another thread's per-thread one).
    /// While capturing it is "busy" without an event: a graph pool's window is open, or the
    /// stream itself is capturing a graph cistern was not told of (an event recorded there is
    /// a captured event, and querying one breaks its capture in every mode).
    pub(crate) fn stream_idle(&self, stream: Option<StreamId>) -> bool {
        let Some(stream) = stream else {
            return false;
        };
        if self.capturing() || self.driver.stream_capturing(self.dev, stream) != Ok(false) {
            return false;
        }
        let d = &*self.driver;
        let Ok(ev) = self.events.get(d, self.dev) else {
            return false;
        };
        let idle =
            d.event_record(self.dev, ev, stream).is_ok() && d.event_query(self.dev, ev) == Ok(true);
        self.events.put(ev);
        idle
    }

    /// As [`Self::stream_idle`], but a busy stream's event is handed over: recorded after all
    /// the work queued there so far, and not complete yet, for the caller to order other work
    /// after it (`cuStreamWaitEvent`) and to query later; it goes back to the cache (`put`)
    /// once done with.
    pub(crate) fn stream_mark(&self, stream: Option<StreamId>) -> StreamMark {
        let Some(stream) = stream else {
            return StreamMark::Unknown;
        };
        if self.capturing() || self.driver.stream_capturing(self.dev, stream) != Ok(false) {
            return StreamMark::Unknown;
        }
        let d = &*self.driver;
        let Ok(ev) = self.events.get(d, self.dev) else {
            return StreamMark::Unknown;
        };
        if d.event_record(self.dev, ev, stream).is_err() {
            self.events.put(ev);
            return StreamMark::Unknown;
        }
        match d.event_query(self.dev, ev) {
            Ok(true) => {
                self.events.put(ev);
                StreamMark::Idle
            }
            Ok(false) => StreamMark::Busy(ev),
            Err(_) => {
                self.events.put(ev);
                StreamMark::Unknown
            }
        }
    }

    /// Records an event on `stream` and waits for it: all work queued there so far is done.
    /// Never while capturing, nor for a stream that is capturing (false: not known to be done).
    /// When no event can be recorded there (or the stream cannot be named here: `None`), waits
    /// for the whole device instead, which never touches the stream's handle.
    pub(crate) fn sync_stream(&self, stream: Option<StreamId>) -> bool {
        // Only a stream known to be capturing is refused: one the driver cannot answer for (a
        // destroyed stream) falls through to the device synchronisation below.
        if self.capturing()
            || stream.is_some_and(|s| self.driver.stream_capturing(self.dev, s) == Ok(true))
        {
            return false;
        }
        self.counters.num_stream_syncs.fetch_add(1, Relaxed);
        let d = &*self.driver;
        if let Some(stream) = stream {
            if let Ok(ev) = self.events.get(d, self.dev) {
                let ok = d.event_record(self.dev, ev, stream).is_ok()
                    && d.event_synchronize(self.dev, ev).is_ok();
                self.events.put(ev);
                if ok {
                    return true;
                }
            }
        }
        self.counters.num_sync_all_streams.fetch_add(1, Relaxed);
        self.sync_device(self.dev)
    }
}
