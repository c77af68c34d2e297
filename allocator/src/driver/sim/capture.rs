//! Stream capture in the simulator: what a CUDA graph capture forbids, and graphs that replay.
//!
//! A test begins a capture on a stream ([`SimDriver::begin_capture`]); until it ends
//! ([`SimDriver::end_capture`]) work launched on that stream is *recorded* into the capture's
//! graph, not queued, and the calls that a global-mode capture forbids are refused and counted
//! as [`CaptureViolation`]s:
//!
//! * anything that queries or waits for GPU work: `cuEventQuery`, `cuEventSynchronize`,
//!   `cuStreamSynchronize`, `cuCtxSynchronize`, and `cuMemFree` (it synchronises the device);
//! * anything that would add a node to the user's graph: `cuEventRecord` and
//!   `cuStreamWaitEvent` on a capturing stream (an event recorded there would never complete
//!   outside the graph).
//!
//! `cuMemAlloc` is allowed: the CUDA backend makes it with the thread's capture mode exchanged
//! to relaxed, as PyTorch's `cudaMallocMaybeCapturing` does, and the simulator stands for that
//! backend. The VMM calls are allowed as on the real driver (they neither synchronise nor
//! enqueue). A refused call returns `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates
//! every capture underway, so its `end_capture` fails, as the real driver's would.
//!
//! A graph ([`SimGraph`]) keeps each recorded launch's *virtual* ranges, as a real graph keeps
//! its kernels' pointers; [`SimDriver::launch_graph`] queues them again on a stream, translated
//! to physical memory then. So a replay over memory that was unmapped since the capture fails
//! (a fault on a real GPU), and one over memory handed out since to another stream is a hazard
//! at that handout, or at the replay's own later handouts.

use std::sync::atomic::Ordering;

use rustc_hash::FxHashMap;

use super::{err, SimDriver, WorkId};
use crate::driver::{DeviceId, DriverCall, DriverError, DriverErrorKind, DriverResult, StreamId};

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: i32 = 900;

/// A call refused because a capture was underway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureViolation {
    /// The refused call.
    pub call: DriverCall,
    /// The device it named.
    pub dev: DeviceId,
    /// Why it was refused.
    pub why: String,
}

/// The launches a capture recorded, by virtual address (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimGraph {
    /// The device captured on.
    pub dev: DeviceId,
    /// Each recorded launch's `(ptr, len)` ranges, in capture order.
    pub launches: Vec<Vec<(u64, u64)>>,
}

/// One capture underway.
#[derive(Debug, Default)]
struct Capture {
    graph: SimGraph,
    invalidated: bool,
}

/// Every capture underway, by (device, stream).
#[derive(Debug, Default)]
pub(super) struct Captures {
    active: FxHashMap<(DeviceId, u64), Capture>,
    violations: Vec<CaptureViolation>,
}

impl SimDriver {
    /// Begins capturing on `stream` of device `dev`: see the module documentation. A stream
    /// already capturing is an error.
    pub fn begin_capture(&self, dev: DeviceId, stream: StreamId) -> DriverResult<()> {
        self.device(DriverCall::StreamWaitEvent, dev)?;
        let mut c = self.captures.lock();
        if c.active.contains_key(&(dev, stream.0)) {
            return Err(err(
                DriverCall::StreamWaitEvent,
                DriverErrorKind::InvalidValue,
                super::codes::CUDA_ERROR_INVALID_VALUE,
                format!("stream {} is already capturing", stream.0),
            ));
        }
        c.active.insert(
            (dev, stream.0),
            Capture {
                graph: SimGraph {
                    dev,
                    launches: Vec::new(),
                },
                invalidated: false,
            },
        );
        self.captures_active.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Ends the capture on `stream` and returns its graph; `Err` with the reasons when a
    /// forbidden call invalidated it (or when the stream was not capturing).
    pub fn end_capture(&self, dev: DeviceId, stream: StreamId) -> Result<SimGraph, String> {
        let mut c = self.captures.lock();
        let Some(cap) = c.active.remove(&(dev, stream.0)) else {
            return Err(format!(
                "stream {} of device {dev} is not capturing",
                stream.0
            ));
        };
        self.captures_active.fetch_sub(1, Ordering::Relaxed);
        if cap.invalidated {
            let why: Vec<String> = c
                .violations
                .iter()
                .map(|v| format!("{} on device {}: {}", v.call, v.dev, v.why))
                .collect();
            return Err(format!(
                "the capture was invalidated by a forbidden call: {}",
                why.join("; ")
            ));
        }
        Ok(cap.graph)
    }

    /// Whether any capture is underway.
    pub fn capturing(&self) -> bool {
        self.captures_active.load(Ordering::Relaxed) != 0
    }

    /// Every call refused so far because a capture was underway.
    pub fn capture_violations(&self) -> Vec<CaptureViolation> {
        self.captures.lock().violations.clone()
    }

    /// Queues every launch of `graph` on `stream`, in order (a replay); see the module
    /// documentation. Fails, having queued the launches before it, at the first launch whose
    /// memory is no longer mapped.
    pub fn launch_graph(&self, graph: &SimGraph, stream: StreamId) -> DriverResult<Vec<WorkId>> {
        graph
            .launches
            .iter()
            .map(|ranges| self.launch(graph.dev, stream, ranges))
            .collect()
    }

    /// When a capture is underway on `stream` of `dev`: records a launch of `ranges` into its
    /// graph and returns true (the launch is not queued).
    pub(super) fn record_into_capture(
        &self,
        dev: DeviceId,
        stream: StreamId,
        ranges: &[(u64, u64)],
    ) -> bool {
        if !self.capturing() {
            return false;
        }
        match self.captures.lock().active.get_mut(&(dev, stream.0)) {
            Some(cap) => {
                cap.graph.launches.push(ranges.to_vec());
                true
            }
            None => false,
        }
    }

    /// The capture rule for `call`: with `stream`, refused only when that stream is
    /// capturing (a node would join the user's graph); without, refused while any capture is
    /// underway (it queries or waits for GPU work). One relaxed load when none is.
    pub(super) fn capture_check(
        &self,
        call: DriverCall,
        dev: DeviceId,
        stream: Option<StreamId>,
    ) -> DriverResult<()> {
        if !self.capturing() {
            return Ok(());
        }
        let mut c = self.captures.lock();
        let why = match stream {
            Some(s) if c.active.contains_key(&(dev, s.0)) => {
                format!("stream {} is capturing: the call would join its graph", s.0)
            }
            Some(_) => return Ok(()),
            None if c.active.is_empty() => return Ok(()),
            None => "a stream capture is underway: the call queries or waits for GPU work".into(),
        };
        for cap in c.active.values_mut() {
            cap.invalidated = true;
        }
        c.violations.push(CaptureViolation {
            call,
            dev,
            why: why.clone(),
        });
        Err(capture_error(call, why))
    }
}

fn capture_error(call: DriverCall, why: String) -> DriverError {
    err(
        call,
        DriverErrorKind::Other,
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        why,
    )
}
