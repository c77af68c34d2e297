//! Test hooks: functions only the fake exports (C ABI, prefixed `cisternFake`, never
//! panicking), so that a test client can run simulated work over the fake and see the hazards
//! and access faults the simulator finds.
//!
//! * `cisternFakeLaunch(CUstream, CUdeviceptr ptr, size_t bytes) -> CUresult`: queues one unit
//!   of simulated work on the stream touching `[ptr, ptr + bytes)` (on a capturing stream it is
//!   recorded into the graph instead). First the simulator's handout check records a hazard
//!   for unfinished work of another stream, not ordered before this one, on that memory. Memory
//!   that is not mapped with access for the stream's device (another device's memory without
//!   peer access granted by `cuMemSetAccess`, or memory of no allocation) is
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`, which corrupts the stream's context (sticky; the real driver
//!   reports it at the next synchronising call, the fake at once).
//! * `cisternFakeComplete(CUstream) -> CUresult`: completes all work queued on the stream (as
//!   the GPU would, eventually), without counting as a driver call.
//! * `cisternFakeHazards() -> unsigned long long`: how many hazards were recorded so far (0
//!   before `cuInit`).
//! * `cisternFakePrintHazards() -> unsigned long long`: the same, after printing each hazard on
//!   stderr, one line each.

use std::ffi::c_ulonglong;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cistern::driver::{Driver, StreamId};

use crate::CUresult::{self, *};
use crate::{entry, fake, CUdeviceptr, CUstream, FAKE};

/// `cisternFakeLaunch`: simulated work on a stream (see the module documentation).
///
/// # Safety
///
/// None: the stream handle is only looked up and the range is never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cisternFakeLaunch(
    hStream: CUstream,
    ptr: CUdeviceptr,
    bytes: usize,
) -> CUresult {
    entry("cisternFakeLaunch", || {
        let f = fake()?;
        let mut st = f.state();
        let sid = f.use_stream(&mut st, hStream)?;
        let (dev, capture) = (st.streams[&sid].dev, st.streams[&sid].capture);
        if capture.is_some() {
            return Ok(());
        }
        let len = bytes as u64;
        if len == 0 {
            return Ok(());
        }
        let linear = st
            .linear
            .range(..=ptr)
            .next_back()
            .filter(|(&b, &(size, _))| ptr - b < size)
            .map(|(_, &(_, d))| d);
        let owner = match linear {
            Some(d) if d == dev => d,
            Some(_) => return Err(st.corrupt(dev, CUDA_ERROR_ILLEGAL_ADDRESS)),
            None => {
                let Some((_, _, owner)) = st.reservation(ptr) else {
                    return Err(st.corrupt(dev, CUDA_ERROR_ILLEGAL_ADDRESS));
                };
                let granted = st.covering(ptr, len).is_some_and(|maps| {
                    maps.iter().all(|s| st.mappings[s].access & (1 << dev) != 0)
                });
                if !granted {
                    return Err(st.corrupt(dev, CUDA_ERROR_ILLEGAL_ADDRESS));
                }
                owner
            }
        };
        f.sim.note_handout(owner, ptr, len, StreamId(sid));
        if f.sim.launch(owner, StreamId(sid), &[(ptr, len)]).is_err() {
            return Err(st.corrupt(dev, CUDA_ERROR_ILLEGAL_ADDRESS));
        }
        if let Some(s) = st.streams.get_mut(&sid) {
            s.work_devs |= 1 << owner;
        }
        Ok(())
    })
}

/// `cisternFakeComplete`: completes the stream's queued work (see the module documentation).
///
/// # Safety
///
/// None: the stream handle is only looked up.
#[no_mangle]
pub unsafe extern "C" fn cisternFakeComplete(hStream: CUstream) -> CUresult {
    entry("cisternFakeComplete", || {
        let f = fake()?;
        let mut st = f.state();
        let sid = f.resolve(&mut st, hStream)?;
        let work_devs = st.streams[&sid].work_devs;
        for d in (0..f.ctxs.len()).filter(|&d| work_devs & (1 << d) != 0) {
            f.sim.complete_stream(d, StreamId(sid));
        }
        Ok(())
    })
}

/// `cisternFakeHazards`: the number of hazards recorded so far.
#[no_mangle]
pub extern "C" fn cisternFakeHazards() -> c_ulonglong {
    catch_unwind(|| FAKE.get().map_or(0, |f| f.sim.hazards().len() as u64)).unwrap_or(0)
}

/// `cisternFakePrintHazards`: prints each hazard recorded so far on stderr and returns their
/// number.
#[no_mangle]
pub extern "C" fn cisternFakePrintHazards() -> c_ulonglong {
    catch_unwind(AssertUnwindSafe(|| {
        let Some(f) = FAKE.get() else {
            return 0;
        };
        let hazards = f.sim.hazards();
        for h in &hazards {
            eprintln!("cistern-fakecuda: hazard: {h}");
        }
        hazards.len() as u64
    }))
    .unwrap_or(0)
}
