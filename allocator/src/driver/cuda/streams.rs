//! What a stream handle names, and whether it is capturing a graph (see "Streams" and "Stream
//! capture" in the module docs). The [`Driver`](crate::driver::Driver) methods `stream_info`
//! and `stream_capturing` of [`CudaDriver`] call these.

use std::ffi::{c_uint, c_ulonglong};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use cudarc::driver::sys::{self, CUresult};

use super::call::{cu, cuda_error, stream_ptr, unavailable};
use super::CudaDriver;
use crate::driver::{
    DeviceId, DriverCall, DriverError, DriverErrorKind, DriverResult, StreamId, StreamInfo,
    CAPTURING_ID,
};

/// `CU_STREAM_CAPTURE_STATUS_NONE`: the stream is not capturing.
const CAPTURE_STATUS_NONE: c_uint = 0;

impl CudaDriver {
    /// Whether the stream `st` (the handle `stream`) is capturing now, or may not be used
    /// because of a capture. The caller has bound the context the handle needs.
    ///
    /// The legacy stream (`StreamId::LEGACY`, and the null handle, which names it for the
    /// driver API cistern calls) cannot capture, but while a blocking stream of its context is
    /// capturing every use of it is an implicit dependency on that capture, which the driver
    /// refuses and which invalidates the capture: an event record, `cuStreamWaitEvent`, even
    /// `cuStreamGetId` (driver 580, `scripts/gpu/capture_rules.py`). `cuStreamIsCapturing` of
    /// it answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` then, without harm (documented, and
    /// measured there): reported as capturing, so the pool neither names the stream nor
    /// records an event on it until the capture ends.
    fn capture_status(&self, call: DriverCall, st: sys::CUstream) -> DriverResult<bool> {
        const FUNC: &str = "cuStreamIsCapturing";
        let mut status: c_uint = CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a live, writable integer; `st` is a stream handle of the caller's
        // (the driver refuses one it does not know) or a special one. Allowed during any
        // capture; changes nothing.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe {
            (self.api.cuStreamIsCapturing)(st, &mut status)
        }))
        .map_err(|_| unavailable(call, FUNC))?;
        // IMPLICIT is an answer here, asked on every growth during such a capture: matched
        // before an error (and its text) is made.
        match r {
            CUresult::CUDA_SUCCESS => Ok(status != CAPTURE_STATUS_NONE),
            CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
            r => Err(cuda_error(call, FUNC, r)),
        }
    }

    pub(super) fn stream_is_capturing(
        &self,
        dev: DeviceId,
        stream: StreamId,
    ) -> DriverResult<bool> {
        let call = DriverCall::StreamWaitEvent;
        let st = stream_ptr(call, stream)?;
        let _bound = self.bind(call, dev)?;
        let capturing = self.capture_status(call, st)?;
        if !stream.is_special() {
            self.note_capture(call, dev, st, capturing);
        }
        Ok(capturing)
    }

    /// Remembers whether the stream `st` of device `dev` was found capturing: one that is is
    /// asked again by [`Self::refuse_during_capture`]; one that is not is forgotten at once, so
    /// that a stream destroyed after its capture is not asked of (see "Handles" in the module
    /// docs).
    fn note_capture(&self, call: DriverCall, dev: DeviceId, st: sys::CUstream, capturing: bool) {
        let Ok(d) = self.device(call, dev) else {
            return;
        };
        let mut seen = d.captures.lock();
        let at = seen.iter().position(|&s| s == st as usize);
        match (capturing, at) {
            (true, None) => seen.push(st as usize),
            (false, Some(i)) => {
                seen.swap_remove(i);
            }
            _ => {}
        }
    }

    /// `Err` (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, saying which stream) while a capture is
    /// seen under way on device `dev`, whose context the caller has bound: a synchronisation of
    /// the device now would invalidate it in any capture mode (driver 580,
    /// `capture_rules.py`). Seen: a blocking stream of the context captures (the legacy stream
    /// answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`), or a stream found capturing before still
    /// is. A remembered stream is forgotten once found not capturing (here, or whenever the
    /// backend asks of it), or an error answers for it, and when the pool retires its handle
    /// or is told the stream is gone ([`Driver::forget_stream`](crate::driver::Driver)). One
    /// destroyed while still remembered (its capture ended, no call of cistern's since, the
    /// pool not told) is asked of once more: the limit of "Handles" in the module docs.
    pub(super) fn refuse_during_capture(
        &self,
        call: DriverCall,
        dev: DeviceId,
    ) -> DriverResult<()> {
        let d = self.device(call, dev)?;
        let refuse = |which: String| {
            Err(DriverError::new(
                call,
                DriverErrorKind::NotSupported,
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as i32,
                format!(
                    "not synchronising device {dev}: {which} is capturing a CUDA graph, and \
                     cuCtxSynchronize would invalidate the capture (in every capture mode); \
                     synchronise after the capture ends"
                ),
            ))
        };
        let legacy = stream_ptr(call, StreamId::LEGACY)?;
        if self.capture_status(call, legacy) == Ok(true) {
            return refuse("a blocking stream of its context".to_string());
        }
        let mut seen = d.captures.lock();
        let mut capturing: Option<usize> = None;
        seen.retain(|&st| {
            let yes = self.capture_status(call, st as sys::CUstream) == Ok(true);
            if yes {
                capturing.get_or_insert(st);
            }
            yes
        });
        match capturing {
            Some(st) => refuse(format!("stream {st:#x}")),
            None => Ok(()),
        }
    }

    /// Forgets the stream `stream` ([`Driver::forget_stream`](crate::driver::Driver)): it is
    /// not asked of again unless a stream with its handle is found capturing.
    pub(super) fn forget_capture(&self, stream: StreamId) {
        for d in &self.devices {
            d.captures.lock().retain(|&st| st as u64 != stream.0);
        }
    }

    pub(super) fn resolve_stream(
        &self,
        dev: DeviceId,
        stream: StreamId,
    ) -> DriverResult<StreamInfo> {
        // Errors name cuEventRecord: the pool resolves a stream to record events on it.
        let call = DriverCall::EventRecord;
        let api = self.api;
        let st = stream_ptr(call, stream)?;
        let device = if stream.is_special() {
            dev
        } else {
            let mut ctx: sys::CUcontext = ptr::null_mut();
            // SAFETY: `ctx` is a live, writable CUcontext; `st` is a stream handle of the
            // caller's (the driver refuses one it does not know).
            cu(call, "cuStreamGetCtx", || unsafe {
                (api.cuStreamGetCtx)(st, &mut ctx)
            })?;
            self.device_of_ctx(call, ctx)?
        };
        // A special handle means the stream of `device`'s context on this thread.
        let _bound = if stream.is_special() {
            Some(self.bind(call, device)?)
        } else {
            None
        };
        // A capturing stream cannot be named: cuStreamGetId would break its capture.
        if self.capture_status(call, st)? {
            if !stream.is_special() {
                self.note_capture(call, device, st, true);
            }
            if stream == StreamId::PER_THREAD {
                return Err(DriverError::new(
                    call,
                    DriverErrorKind::NotSupported,
                    CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as i32,
                    "this thread's per-thread default stream is capturing a graph, and the \
                     driver cannot name it during a capture: capture on a stream created for \
                     it (cuStreamCreate), as torch.cuda.graph does",
                ));
            }
            return Ok(StreamInfo {
                device,
                // The null handle and CU_STREAM_LEGACY are one stream: one id.
                id: CAPTURING_ID | stream.canonical().0,
                per_thread: false,
                capturing: true,
            });
        }
        if !stream.is_special() {
            self.note_capture(call, device, st, false);
        }
        let mut id: c_ulonglong = 0;
        // SAFETY: `id` is a live, writable integer; `st` is a live stream handle or a special
        // handle resolved through the context bound above.
        cu(call, "cuStreamGetId", || unsafe {
            (api.cuStreamGetId)(st, &mut id)
        })?;
        Ok(StreamInfo {
            device,
            id,
            per_thread: stream == StreamId::PER_THREAD,
            capturing: false,
        })
    }
}
