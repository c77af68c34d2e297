//! Streams and events: stream objects of a context (`cuStreamCreate`, `cuStreamDestroy_v2`,
//! `cuStreamQuery`, `cuStreamSynchronize`, `cuStreamGetId`, `cuStreamGetCtx`), the special
//! handles, and events (`cuEventCreate`, `cuEventRecord`, `cuEventQuery`, `cuEventSynchronize`,
//! `cuEventDestroy_v2`, `cuStreamWaitEvent`).
//!
//! Every stream the fake resolves is a distinct simulator [`StreamId`], never reused: a created
//! stream, each context's legacy stream (`0` and `CU_STREAM_LEGACY` = `0x1`, the same stream: the
//! driver API's "Stream synchronization behavior": "The legacy default stream ... is an implicit
//! stream which synchronizes with all other streams in the same CUcontext except for
//! non-blocking streams"), and each thread's per-thread stream (`CU_STREAM_PER_THREAD` = `0x2`:
//! "The per-thread default stream is not a non-blocking stream and will synchronize with the
//! legacy default stream"). The special handles need a current context
//! (`CUDA_ERROR_INVALID_CONTEXT`). The simulator id is also the stream's `cuStreamGetId`.
//!
//! Handles of unknown or destroyed streams are `CUDA_ERROR_INVALID_HANDLE` (the real driver's
//! behaviour is undefined; refusing lets tests see the misuse).
//!
//! Limits: the legacy stream's implicit synchronisation with blocking streams is not simulated
//! (the simulator treats it as an ordinary stream). Simulated work on another device's memory
//! (see [`hooks`](crate::hooks)) is queued on that device's simulator under the same stream id
//! and completes no later than the next record of an event on the stream, or a synchronisation
//! of the stream or its context. `cuStreamWaitEvent` on an event of another device (which the
//! docs allow: "The event may be from a different context or device than the stream") completes
//! the event's stream at the time of the wait, a valid schedule in which the wait is satisfied
//! at once (a hazard against that work can no longer be seen).

use std::ffi::{c_uint, c_ulonglong};

use cistern::driver::{Driver, EventId, StreamId};

use crate::CUresult::{self, *};
use crate::{
    capture, code, entry, fake, put, CUcontext, CUevent, CUstream, Event, Fake, State, Stream,
    StreamKind, CU_EVENT_DISABLE_TIMING, CU_EVENT_FLAGS, CU_EVENT_INTERPROCESS,
};

/// `CU_STREAM_LEGACY`.
pub const CU_STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`.
pub const CU_STREAM_PER_THREAD: usize = 0x2;
/// `CU_STREAM_NON_BLOCKING`.
const CU_STREAM_NON_BLOCKING: c_uint = 0x1;
/// Created streams' handles are this base plus their simulator id times 16: never 0, 1 or 2.
const STREAM_HANDLE_BASE: u64 = 0x5157_0000_0000;

impl Fake {
    /// The simulator stream a `CUstream` names (see the module documentation).
    pub(crate) fn resolve(&self, st: &mut State, h: CUstream) -> Result<u64, CUresult> {
        match h as usize {
            0 | CU_STREAM_LEGACY => {
                let d = self.current(st)?;
                Ok(st.legacy[d])
            }
            CU_STREAM_PER_THREAD => {
                let d = self.current(st)?;
                let key = (std::thread::current().id(), d);
                if let Some(&sid) = st.per_thread.get(&key) {
                    return Ok(sid);
                }
                let sid = st.new_id();
                st.streams.insert(
                    sid,
                    Stream {
                        dev: d,
                        kind: StreamKind::PerThread,
                        blocking: true,
                        capture: None,
                        work_devs: 0,
                    },
                );
                st.per_thread.insert(key, sid);
                Ok(sid)
            }
            _ => {
                let sid = *st
                    .created
                    .get(&(h as usize as u64))
                    .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
                st.alive(st.streams[&sid].dev)?;
                Ok(sid)
            }
        }
    }

    /// [`Fake::resolve`] for a call that queues on or waits for the stream: the legacy stream
    /// may not be used while a blocking stream of its context is capturing (see
    /// [`capture`]).
    pub(crate) fn use_stream(&self, st: &mut State, h: CUstream) -> Result<u64, CUresult> {
        let sid = self.resolve(st, h)?;
        capture::implicit(st, sid, true)?;
        Ok(sid)
    }

    /// Completes stream `sid`'s simulated work on other devices' memory.
    pub(crate) fn complete_peer_work(&self, st: &State, sid: u64) {
        let Some(s) = st.streams.get(&sid) else {
            return;
        };
        for d in (0..self.ctxs.len()).filter(|&d| d != s.dev && s.work_devs & (1 << d) != 0) {
            self.sim.complete_stream(d, StreamId(sid));
        }
    }

    /// Whether all simulated work queued on stream `sid` has completed (probed with the
    /// fake's own event of each device the stream has work on).
    fn stream_done(&self, st: &State, sid: u64) -> Result<bool, CUresult> {
        let work_devs = st.streams.get(&sid).map_or(0, |s| s.work_devs);
        for d in (0..self.ctxs.len()).filter(|&d| work_devs & (1 << d) != 0) {
            let probe = EventId(self.probes[d]);
            self.sim
                .event_record(d, probe, StreamId(sid))
                .map_err(|e| code(&e))?;
            if !self.sim.event_query(d, probe).map_err(|e| code(&e))? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The event `ev` names, on a context not corrupted by a sticky error.
    fn event(st: &State, ev: CUevent) -> Result<&Event, CUresult> {
        let e = st
            .events
            .get(&(ev as usize as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.alive(e.dev)?;
        Ok(e)
    }
}

/// `cuStreamCreate`: a stream of the current context ("Creates a stream and returns a handle in
/// phStream"); flags 0 (a blocking stream, which synchronises with the legacy stream) or
/// `CU_STREAM_NON_BLOCKING`, else `CUDA_ERROR_INVALID_VALUE`. Needs a current context.
///
/// # Safety
///
/// `phStream` is null or valid for writing a `CUstream`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(phStream: *mut CUstream, Flags: c_uint) -> CUresult {
    entry("cuStreamCreate", || {
        let f = fake()?;
        if phStream.is_null() || Flags & !CU_STREAM_NON_BLOCKING != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let d = f.current(&st)?;
        let sid = st.new_id();
        let handle = STREAM_HANDLE_BASE + (sid << 4);
        st.streams.insert(
            sid,
            Stream {
                dev: d,
                kind: StreamKind::Created,
                blocking: Flags == 0,
                capture: None,
                work_devs: 0,
            },
        );
        st.created.insert(handle, sid);
        // SAFETY: `phStream` is non-null and writable (contract).
        unsafe { put(phStream, handle as usize as CUstream) }
    })
}

/// `cuStreamDestroy_v2`: destroys a created stream. "In case the device is still doing work in
/// the stream hStream when cuStreamDestroy() is called, the function will return immediately and
/// the resources associated with hStream will be released automatically once the device has
/// completed all work in hStream": the queued simulated work stays and completes later, and
/// events recorded on the stream stay queryable. The special handles are
/// `CUDA_ERROR_INVALID_HANDLE`. A capture on the stream is invalidated.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(hStream: CUstream) -> CUresult {
    entry("cuStreamDestroy_v2", || {
        let f = fake()?;
        let mut st = f.state();
        let h = hStream as usize as u64;
        let sid = *st.created.get(&h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.alive(st.streams[&sid].dev)?;
        capture::leave(&mut st, sid);
        st.created.remove(&h);
        Ok(())
    })
}

/// `cuStreamQuery`: `CUDA_SUCCESS` when all work queued on the stream has completed, else
/// `CUDA_ERROR_NOT_READY` ("Returns CUDA_SUCCESS if all operations in the stream specified by
/// hStream have completed, or CUDA_ERROR_NOT_READY if not"). Potentially unsafe during stream
/// capture, and not permitted on a capturing stream (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`,
/// invalidating the capture).
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(hStream: CUstream) -> CUresult {
    entry("cuStreamQuery", || {
        let f = fake()?;
        let mut st = f.state();
        let sid = f.use_stream(&mut st, hStream)?;
        capture::unsafe_call(&mut st)?;
        capture::not_capturing(&mut st, sid)?;
        if f.stream_done(&st, sid)? {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    })
}

/// `cuStreamSynchronize`: "Waits until the device has completed all operations in the stream
/// specified by hStream": the simulator completes them (and the stream's work on other devices'
/// memory). Potentially unsafe during stream capture, and not permitted on a capturing stream.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    entry("cuStreamSynchronize", || {
        let f = fake()?;
        let mut st = f.state();
        let sid = f.use_stream(&mut st, hStream)?;
        capture::unsafe_call(&mut st)?;
        capture::not_capturing(&mut st, sid)?;
        let d = st.streams[&sid].dev;
        f.sim
            .stream_synchronize(d, StreamId(sid))
            .map_err(|e| code(&e))?;
        f.complete_peer_work(&st, sid);
        Ok(())
    })
}

/// `cuStreamGetId`: "Returns in streamId the unique Id of the stream": the stream's simulator
/// id, non-zero and unique among all streams of the process, the legacy stream of each context
/// and each thread's per-thread stream included.
///
/// # Safety
///
/// `streamId` is null or valid for writing an `unsigned long long`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetId(hStream: CUstream, streamId: *mut c_ulonglong) -> CUresult {
    entry("cuStreamGetId", || {
        let f = fake()?;
        if streamId.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        // Refused on a capturing stream, whatever the capture mode or thread, and the capture
        // is invalidated; on the legacy stream while a blocking stream of its context
        // captures, `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, invalidating that capture as using
        // the stream would (driver 580 on an H200: `scripts/gpu/capture_rules.py`).
        let sid = f.use_stream(&mut st, hStream)?;
        capture::not_capturing(&mut st, sid)?;
        // SAFETY: `streamId` is non-null and writable (contract).
        unsafe { put(streamId, sid) }
    })
}

/// `cuStreamGetCtx`: "Returns the CUDA context that the stream is associated with": the primary
/// context of the device the stream was created on (for the special handles, the current one).
///
/// # Safety
///
/// `pctx` is null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(hStream: CUstream, pctx: *mut CUcontext) -> CUresult {
    entry("cuStreamGetCtx", || {
        let f = fake()?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let sid = f.resolve(&mut st, hStream)?;
        let d = st.streams[&sid].dev;
        // SAFETY: `pctx` is non-null and writable (contract).
        unsafe { put(pctx, f.ctx_ptr(d)) }
    })
}

/// `cuEventCreate`: an event of the current context ("Creates an event *phEvent for the current
/// context"); needs one (`CUDA_ERROR_INVALID_CONTEXT`).
///
/// # Safety
///
/// `phEvent` is null or valid for writing a `CUevent`.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) -> CUresult {
    entry("cuEventCreate", || {
        let f = fake()?;
        let interprocess_needs = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
        if phEvent.is_null()
            || Flags & !CU_EVENT_FLAGS != 0
            || (Flags & CU_EVENT_INTERPROCESS != 0
                && Flags & interprocess_needs != interprocess_needs)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let d = f.current(&st)?;
        let ev = f.sim.event_create(d).map_err(|e| code(&e))?;
        st.events.insert(
            ev.0,
            Event {
                dev: d,
                recorded: None,
                captured: None,
            },
        );
        // SAFETY: `phEvent` is non-null and writable (contract).
        unsafe { put(phEvent, ev.0 as usize as CUevent) }
    })
}

/// `cuEventRecord`: records `hEvent` on `hStream`. "hEvent and hStream must be from the same
/// context", else `CUDA_ERROR_INVALID_HANDLE`. On a capturing stream the record becomes a node
/// of the capture's graph (nothing runs), and the event is then a captured event.
///
/// # Safety
///
/// None: both handles are only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(hEvent: CUevent, hStream: CUstream) -> CUresult {
    entry("cuEventRecord", || {
        let f = fake()?;
        let mut st = f.state();
        let ed = Fake::event(&st, hEvent)?.dev;
        let sid = f.use_stream(&mut st, hStream)?;
        let (sdev, scapture) = (st.streams[&sid].dev, st.streams[&sid].capture);
        if sdev != ed {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let id = hEvent as usize as u64;
        if let Some(cid) = scapture {
            if let Some(e) = st.events.get_mut(&id) {
                e.captured = Some(cid);
            }
            return Ok(());
        }
        f.complete_peer_work(&st, sid);
        f.sim
            .event_record(ed, EventId(id), StreamId(sid))
            .map_err(|e| code(&e))?;
        if let Some(e) = st.events.get_mut(&id) {
            e.recorded = Some(sid);
            e.captured = None;
        }
        Ok(())
    })
}

/// `cuEventQuery`: `CUDA_SUCCESS` when the recorded work has completed, else
/// `CUDA_ERROR_NOT_READY`. Potentially unsafe during stream capture; an event last recorded in
/// a capturing stream is `CUDA_ERROR_CAPTURED_EVENT` ("This error indicates that the operation
/// is not permitted on an event which was last recorded in a capturing stream").
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(hEvent: CUevent) -> CUresult {
    entry("cuEventQuery", || {
        let f = fake()?;
        let mut st = f.state();
        let e = Fake::event(&st, hEvent)?;
        let (d, captured) = (e.dev, e.captured);
        capture::captured_event_first(&mut st, captured)?;
        match f.sim.event_query(d, EventId(hEvent as usize as u64)) {
            Ok(true) => Ok(()),
            Ok(false) => Err(CUDA_ERROR_NOT_READY),
            Err(e) => Err(code(&e)),
        }
    })
}

/// `cuEventSynchronize`: completes the work the event captured. The same capture rules as
/// `cuEventQuery`.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    entry("cuEventSynchronize", || {
        let f = fake()?;
        let mut st = f.state();
        let e = Fake::event(&st, hEvent)?;
        let (d, captured) = (e.dev, e.captured);
        capture::captured_event_first(&mut st, captured)?;
        f.sim
            .event_synchronize(d, EventId(hEvent as usize as u64))
            .map_err(|e| code(&e))
    })
}

/// `cuEventDestroy_v2`: destroys an event.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(hEvent: CUevent) -> CUresult {
    entry("cuEventDestroy_v2", || {
        let f = fake()?;
        let mut st = f.state();
        let d = Fake::event(&st, hEvent)?.dev;
        let id = hEvent as usize as u64;
        f.sim.event_destroy(d, EventId(id)).map_err(|e| code(&e))?;
        st.events.remove(&id);
        Ok(())
    })
}

/// `cuStreamWaitEvent`: later work on `hStream` waits for the event's work (flags 0 or
/// `CU_EVENT_WAIT_EXTERNAL`). "The event may be from a different context or device than the
/// stream": see the module documentation for how the simulator orders that case. On a
/// capturing stream the wait is a node of the graph; waiting on an event recorded in a capture
/// makes a non-capturing stream join that capture (cross-stream capture), and joining a second
/// capture is `CUDA_ERROR_STREAM_CAPTURE_MERGE`. A capturing stream may not wait on an event
/// recorded outside a capture (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, invalidating the capture).
///
/// # Safety
///
/// None: both handles are only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    hStream: CUstream,
    hEvent: CUevent,
    Flags: c_uint,
) -> CUresult {
    entry("cuStreamWaitEvent", || {
        let f = fake()?;
        if Flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let e = Fake::event(&st, hEvent)?;
        let (ed, recorded, captured) = (e.dev, e.recorded, e.captured);
        let sid = f.use_stream(&mut st, hStream)?;
        if let Some(cid) = captured.filter(|c| st.captures.contains_key(c)) {
            return capture::join(&mut st, sid, cid);
        }
        if let Some(cid) = st.streams[&sid].capture {
            // A capture may not depend on work recorded outside it: refused, and the capture
            // invalidated, whatever the mode (driver 580 on an H200:
            // `scripts/gpu/capture_rules.py`). An event never recorded adds no dependency.
            if recorded.is_some() {
                if let Some(c) = st.captures.get_mut(&cid) {
                    c.invalidated = true;
                }
                return Err(CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
            }
            return Ok(());
        }
        if captured.is_some() {
            return Err(CUDA_ERROR_CAPTURED_EVENT);
        }
        let sd = st.streams[&sid].dev;
        if sd == ed {
            return f
                .sim
                .stream_wait_event(sd, StreamId(sid), EventId(hEvent as usize as u64))
                .map_err(|e| code(&e));
        }
        if let Some(rs) = recorded {
            f.sim.complete_stream(ed, StreamId(rs));
            f.complete_peer_work(&st, rs);
        }
        Ok(())
    })
}
