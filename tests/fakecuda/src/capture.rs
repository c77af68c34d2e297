//! Stream capture: `cuStreamBeginCapture_v2`, `cuStreamEndCapture`, `cuStreamIsCapturing`,
//! `cuStreamGetCaptureInfo_v2`, `cuThreadExchangeStreamCaptureMode`, `cuGraphDestroy`, and the
//! rules capture imposes on other calls.
//!
//! The rules, from `cuThreadExchangeStreamCaptureMode`'s documentation of the modes:
//! `CU_STREAM_CAPTURE_MODE_GLOBAL` (0, every thread's default): "If the local thread has an
//! ongoing capture sequence that was not initiated with CU_STREAM_CAPTURE_MODE_RELAXED at
//! cuStreamBeginCapture, or if any other thread has a concurrent capture sequence initiated with
//! CU_STREAM_CAPTURE_MODE_GLOBAL, this thread is prohibited from potentially unsafe API calls";
//! `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL` (1): "If the local thread has an ongoing capture
//! sequence not initiated with CU_STREAM_CAPTURE_MODE_RELAXED, it is prohibited from potentially
//! unsafe API calls. Concurrent capture sequences in other threads are ignored";
//! `CU_STREAM_CAPTURE_MODE_RELAXED` (2): "The local thread is not prohibited from potentially
//! unsafe API calls. Note that the thread is still prohibited from API calls which necessarily
//! conflict with stream capture, for example, attempting cuEventQuery on an event that was last
//! recorded inside a capture sequence."
//!
//! The potentially unsafe calls modelled: `cuMemAlloc_v2`, `cuMemFree_v2` (the docs' example,
//! `cudaMalloc`, "is not enqueued asynchronously to a stream, and is not observed by stream
//! capture"), and the synchronising calls `cuEventQuery`, `cuEventSynchronize`,
//! `cuStreamQuery`, `cuStreamSynchronize`, `cuCtxSynchronize`. A prohibited call returns
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` ("the operation is not permitted when the stream is
//! capturing") and invalidates the captures that prohibited it, so their `cuStreamEndCapture`
//! returns `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` ("the current capture sequence on the stream
//! has been invalidated due to a previous error"). The VMM calls (`cuMemCreate`, `cuMemMap`,
//! `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`, `cuMemAddressReserve`) are not prohibited:
//! they do not synchronise, the docs name none of them, and PyTorch's expandable segments grow
//! with them during graph capture.
//!
//! Measured on a real driver (580, CUDA 13.0, an H200; `scripts/gpu/capture_rules.py` probes
//! each call in each mode from the capturing thread and another), four rules go beyond the
//! documentation and are kept here too: `cuStreamGetId` of a capturing stream is refused
//! (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) and invalidates the capture in every mode;
//! `cuCtxSynchronize` does the same to every capture of the context, from any thread and in
//! relaxed mode too; a capturing stream may not wait on an event recorded outside a capture
//! (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, invalidating it); and querying or synchronising an
//! event recorded in a capture still under way invalidates that capture, whatever the mode
//! ([`captured_event_first`]). The probe agreed with the rules above on every other call:
//! `cuStreamGetCtx`, `cuStreamIsCapturing`, `cuMemGetInfo`, event creation, records and
//! destruction, the VMM calls (`cuMemAddressFree` too), context pushes and pops, primary
//! context retains, attribute and granularity queries and `cuIpcGetMemHandle` are allowed in
//! every mode.
//! Its answers are committed as `tests/fakecuda/capture-rules-h200.json`, and `tests/probe.rs`
//! runs the same probe on this fake and requires the same answer to every one of them.
//!
//! Using the legacy stream while a blocking stream of its context is capturing is
//! `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` ("the operation would have resulted in an implicit
//! dependency on a capturing stream, as with the legacy stream") and invalidates that capture:
//! an event record, a `cuStreamWaitEvent`, and, measured on driver 580, `cuStreamGetId` of the
//! legacy stream (the null handle too). `cuStreamIsCapturing` of it answers the same error
//! without invalidating (the documentation's case, measured too): how cistern's backend learns
//! that the legacy stream may not be used.
//! Work queued on a capturing stream is recorded into the graph, not run: an event recorded
//! there is a captured event (`CUDA_ERROR_CAPTURED_EVENT` for `cuEventQuery` and
//! `cuEventSynchronize` while the capture is under way, `CUDA_ERROR_INVALID_VALUE` once it has
//! ended, as driver 580 answers, until it is recorded again outside a capture).

use std::cell::Cell;
use std::ffi::{c_uint, c_ulonglong};

use crate::CUresult::{self, *};
use crate::{entry, fake, get, put, CUstream, Capture, State, StreamKind};

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`.
pub const MODE_GLOBAL: c_uint = 0;
/// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
pub const MODE_THREAD_LOCAL: c_uint = 1;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
pub const MODE_RELAXED: c_uint = 2;

/// `CU_STREAM_CAPTURE_STATUS_NONE`, `_ACTIVE`, `_INVALIDATED`.
const STATUS_NONE: c_uint = 0;
const STATUS_ACTIVE: c_uint = 1;
const STATUS_INVALIDATED: c_uint = 2;

/// `CUgraph`: an opaque graph handle.
pub type CUgraph = *mut std::ffi::c_void;
/// `CUgraphNode`: an opaque graph node handle.
pub type CUgraphNode = *mut std::ffi::c_void;

thread_local! {
    /// The calling thread's capture interaction mode.
    static MODE: Cell<c_uint> = const { Cell::new(MODE_GLOBAL) };
}

fn thread_mode() -> c_uint {
    MODE.try_with(Cell::get).unwrap_or(MODE_GLOBAL)
}

/// Checks a potentially unsafe call: with a capture prohibiting it (see the module
/// documentation), invalidates those captures and returns
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub(crate) fn unsafe_call(st: &mut State) -> Result<(), CUresult> {
    let mode = thread_mode();
    if mode == MODE_RELAXED || st.captures.is_empty() {
        return Ok(());
    }
    let me = std::thread::current().id();
    let mut prohibited = false;
    for c in st.captures.values_mut().filter(|c| !c.invalidated) {
        let own = c.thread == me && c.mode != MODE_RELAXED;
        let others = mode == MODE_GLOBAL && c.thread != me && c.mode == MODE_GLOBAL;
        if own || others {
            c.invalidated = true;
            prohibited = true;
        }
    }
    if prohibited {
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}

/// Refuses to synchronise with or query a capturing stream (invalidating its capture).
pub(crate) fn not_capturing(st: &mut State, sid: u64) -> Result<(), CUresult> {
    if let Some(cid) = st.streams.get(&sid).and_then(|s| s.capture) {
        if let Some(c) = st.captures.get_mut(&cid) {
            c.invalidated = true;
        }
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

/// The capture rules of a query or synchronisation of an event last recorded in capture
/// `captured` (when it was), in the order driver 580 applies them (an H200,
/// `scripts/gpu/capture_rules.py`): an event recorded in a capture still under way is
/// `CUDA_ERROR_CAPTURED_EVENT` and that capture is invalidated, in every mode and from any
/// thread, before the mode's own prohibition is looked at (a global-mode capturing thread gets
/// `CAPTURED_EVENT`, not `STREAM_CAPTURE_UNSUPPORTED`); one recorded in a capture that has
/// ended is `CUDA_ERROR_INVALID_VALUE`, also before the prohibition and breaking nothing (the
/// query measured; the synchronisation taken to agree); then the call is a potentially unsafe
/// one ([`unsafe_call`]).
pub(crate) fn captured_event_first(st: &mut State, captured: Option<u64>) -> Result<(), CUresult> {
    if let Some(cid) = captured {
        return Err(match st.captures.get_mut(&cid) {
            Some(c) => {
                c.invalidated = true;
                CUDA_ERROR_CAPTURED_EVENT
            }
            None => CUDA_ERROR_INVALID_VALUE,
        });
    }
    unsafe_call(st)
}

/// Refuses to synchronise device `dev` while any stream of it is capturing, in any mode and
/// from any thread, invalidating those captures: what `cuCtxSynchronize` does on driver 580
/// (an H200, `scripts/gpu/capture_rules.py`), also in relaxed mode, which the documentation
/// would let through.
pub(crate) fn no_capture_on(st: &mut State, dev: usize) -> Result<(), CUresult> {
    let ids: Vec<u64> = st
        .streams
        .values()
        .filter(|s| s.dev == dev)
        .filter_map(|s| s.capture)
        .collect();
    if ids.is_empty() {
        return Ok(());
    }
    for id in ids {
        if let Some(c) = st.captures.get_mut(&id) {
            c.invalidated = true;
        }
    }
    Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
}

/// When `sid` is a legacy stream and a blocking stream of its context is capturing:
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, invalidating those captures when `invalidate`.
pub(crate) fn implicit(st: &mut State, sid: u64, invalidate: bool) -> Result<(), CUresult> {
    let Some(s) = st
        .streams
        .get(&sid)
        .filter(|s| s.kind == StreamKind::Legacy)
    else {
        return Ok(());
    };
    let dev = s.dev;
    let ids: Vec<u64> = st
        .streams
        .values()
        .filter(|o| o.dev == dev && o.blocking && o.kind != StreamKind::Legacy)
        .filter_map(|o| o.capture)
        .collect();
    if ids.is_empty() {
        return Ok(());
    }
    if invalidate {
        for id in ids {
            if let Some(c) = st.captures.get_mut(&id) {
                c.invalidated = true;
            }
        }
    }
    Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
}

/// Stream `sid` waits on an event recorded in capture `cid`: it joins that capture.
pub(crate) fn join(st: &mut State, sid: u64, cid: u64) -> Result<(), CUresult> {
    let Some(s) = st.streams.get_mut(&sid) else {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    };
    match s.capture {
        None => {
            s.capture = Some(cid);
            Ok(())
        }
        Some(c) if c == cid => Ok(()),
        Some(_) => Err(CUDA_ERROR_STREAM_CAPTURE_MERGE),
    }
}

/// Stream `sid` is destroyed: its capture is invalidated, and ended if it began there.
pub(crate) fn leave(st: &mut State, sid: u64) {
    let Some(cid) = st.streams.get_mut(&sid).and_then(|s| s.capture.take()) else {
        return;
    };
    let origin = match st.captures.get_mut(&cid) {
        Some(c) => {
            c.invalidated = true;
            c.origin == sid
        }
        None => false,
    };
    if origin {
        end(st, cid);
    }
}

/// Ends capture `cid`: every stream taking part stops capturing.
fn end(st: &mut State, cid: u64) -> Option<Capture> {
    for s in st.streams.values_mut().filter(|s| s.capture == Some(cid)) {
        s.capture = None;
    }
    st.captures.remove(&cid)
}

/// `cuStreamBeginCapture_v2`: "Begin graph capture on hStream": work queued on the stream is
/// recorded into a graph instead of run. The legacy stream cannot be captured
/// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`); a stream already capturing is
/// `CUDA_ERROR_ILLEGAL_STATE`; a mode other than 0, 1, 2 is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(hStream: CUstream, mode: c_uint) -> CUresult {
    entry("cuStreamBeginCapture_v2", || {
        let f = fake()?;
        if mode > MODE_RELAXED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let sid = f.use_stream(&mut st, hStream)?;
        if st.streams[&sid].kind == StreamKind::Legacy {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if st.streams[&sid].capture.is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let (cid, graph) = (st.new_id(), st.new_id());
        st.captures.insert(
            cid,
            Capture {
                mode,
                thread: std::thread::current().id(),
                origin: sid,
                invalidated: false,
                graph,
            },
        );
        if let Some(s) = st.streams.get_mut(&sid) {
            s.capture = Some(cid);
        }
        Ok(())
    })
}

/// `cuStreamEndCapture`: "End capture on hStream, returning the captured graph via phGraph".
/// Not capturing: `CUDA_ERROR_ILLEGAL_STATE`; a stream that joined but did not begin the
/// capture: `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED`; a non-relaxed capture ended by another
/// thread: `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`; an invalidated capture ends with a NULL
/// graph and `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` ("If capture was invalidated, due to a
/// violation of the rules of stream capture, then a NULL graph will be returned").
///
/// # Safety
///
/// `phGraph` is null or valid for writing a `CUgraph`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(hStream: CUstream, phGraph: *mut CUgraph) -> CUresult {
    entry("cuStreamEndCapture", || {
        let f = fake()?;
        if phGraph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let sid = f.resolve(&mut st, hStream)?;
        let cid = st.streams[&sid].capture.ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        let c = st.captures.get(&cid).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if c.origin != sid {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
        }
        if c.mode != MODE_RELAXED && c.thread != std::thread::current().id() {
            return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
        }
        let c = end(&mut st, cid).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if c.invalidated {
            // SAFETY: `phGraph` is non-null and writable (contract).
            unsafe { put(phGraph, std::ptr::null_mut()) }?;
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        st.graphs.insert(c.graph);
        // SAFETY: `phGraph` is non-null and writable (contract).
        unsafe { put(phGraph, c.graph as usize as CUgraph) }
    })
}

/// The capture status of stream `sid`, and its capture.
fn status(st: &State, sid: u64) -> (c_uint, Option<&Capture>) {
    match st
        .streams
        .get(&sid)
        .and_then(|s| s.capture)
        .and_then(|c| st.captures.get(&c))
    {
        None => (STATUS_NONE, None),
        Some(c) if c.invalidated => (STATUS_INVALIDATED, Some(c)),
        Some(c) => (STATUS_ACTIVE, Some(c)),
    }
}

/// `cuStreamIsCapturing`: the stream's `CUstreamCaptureStatus` (none 0, active 1, invalidated
/// 2). On the legacy stream while a blocking stream is capturing,
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` ("the stream is the legacy stream and a blocking stream
/// is capturing"), without invalidating.
///
/// # Safety
///
/// `captureStatus` is null or valid for writing a `c_uint`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(
    hStream: CUstream,
    captureStatus: *mut c_uint,
) -> CUresult {
    entry("cuStreamIsCapturing", || {
        let f = fake()?;
        if captureStatus.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let sid = f.resolve(&mut st, hStream)?;
        implicit(&mut st, sid, false)?;
        let (s, _) = status(&st, sid);
        // SAFETY: `captureStatus` is non-null and writable (contract).
        unsafe { put(captureStatus, s) }
    })
}

/// `cuStreamGetCaptureInfo_v2` (cudarc 0.19's signature): the status as `cuStreamIsCapturing`
/// gives it and, for a capture underway (active or invalidated), its unique id and graph; the
/// graph's nodes are not modelled, so the dependency set is empty (NULL, 0). Every output but
/// `captureStatus_out` may be NULL.
///
/// # Safety
///
/// Each pointer is null or valid for writing its type.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2(
    hStream: CUstream,
    captureStatus_out: *mut c_uint,
    id_out: *mut c_ulonglong,
    graph_out: *mut CUgraph,
    dependencies_out: *mut *const CUgraphNode,
    numDependencies_out: *mut usize,
) -> CUresult {
    entry("cuStreamGetCaptureInfo_v2", || {
        let f = fake()?;
        if captureStatus_out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let sid = f.resolve(&mut st, hStream)?;
        implicit(&mut st, sid, false)?;
        let (s, c) = status(&st, sid);
        let cid = st.streams.get(&sid).and_then(|s| s.capture).unwrap_or(0);
        let graph = c.map_or(0, |c| c.graph);
        // SAFETY: `captureStatus_out` is non-null and writable (contract).
        unsafe { put(captureStatus_out, s) }?;
        if s == STATUS_NONE {
            return Ok(());
        }
        // SAFETY: each pointer is written only when non-null, and is then writable (contract).
        unsafe {
            if !id_out.is_null() {
                put(id_out, cid)?;
            }
            if !graph_out.is_null() {
                put(graph_out, graph as usize as CUgraph)?;
            }
            if !dependencies_out.is_null() {
                put(dependencies_out, std::ptr::null())?;
            }
            if !numDependencies_out.is_null() {
                put(numDependencies_out, 0)?;
            }
        }
        Ok(())
    })
}

/// `cuThreadExchangeStreamCaptureMode`: "Sets the calling thread's stream capture interaction
/// mode to the value contained in *mode, and overwrites *mode with the previous mode for the
/// thread". A value other than 0, 1, 2 is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
///
/// `mode` is null or valid for reading and writing a `c_uint`.
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) -> CUresult {
    entry("cuThreadExchangeStreamCaptureMode", || {
        fake()?;
        // SAFETY: `mode` is null or readable (contract); `get` refuses null.
        let new = unsafe { get(mode.cast_const()) }?;
        if new > MODE_RELAXED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let old = MODE
            .try_with(|m| m.replace(new))
            .map_err(|_| CUDA_ERROR_DEINITIALIZED)?;
        // SAFETY: `mode` is non-null and writable (contract).
        unsafe { put(mode, old) }
    })
}

/// `cuGraphDestroy`: destroys a graph from `cuStreamEndCapture`; any other value is
/// `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
///
/// None: the handle is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(hGraph: CUgraph) -> CUresult {
    entry("cuGraphDestroy", || {
        let f = fake()?;
        if f.state().graphs.remove(&(hGraph as usize as u64)) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    })
}
