//! The JSON documents the ABI hands out (statistics and snapshots), and copying text into a
//! caller's buffer with `snprintf`'s rules.
//!
//! This module builds strings from the pool's read-only reports; it never changes the pool.
//!
//! # The snapshot schema
//!
//! [`snapshot_json`] writes the document `torch.cuda.memory._snapshot()` returns, so that
//! `torch.cuda._memory_viz` and PyTorch's memory viewer read it (after `json.load`, or pickled):
//!
//! ```text
//! {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//!                "requested_size", "stream", "segment_type": "small"|"large",
//!                "segment_pool_id": [s.pool_id.0, s.pool_id.1], "is_expandable", "frames": [],
//!                "blocks": [{"address", "size", "requested_size",
//!                            "state": "active_allocated"|"active_pending_free"|"inactive",
//!                            "frames": []}]}],
//!  "device_traces": [[], ...]}
//! ```
//!
//! One segment per `cuMemAlloc` segment, and one per run of mapped pages of a VMM extent (as
//! PyTorch reports expandable segments); blocks tile their segment exactly (`_memory_viz.segsum`
//! checks that). `device_traces` has one list per device and is empty: the pool keeps no
//! history of events (cistern_torch's native mode keeps PyTorch's). A block's `frames` are its
//! sampled call site (`provenance:stacks`), innermost first, as PyTorch writes them:
//! `{"filename", "line", "name"}` (Python frames when `cistern_python_frames` is on, else the
//! native backtrace); empty for blocks without one, and for segments.

use std::collections::HashMap;

use cistern_alloc::{provenance, BlockState, Driver, Pool, SegmentSnapshot};
use serde_json::{json, Value};

/// Copies `text` into `buf` as a NUL-terminated string, truncated to `cap - 1` bytes, and
/// returns `text.len()` (the length needed, without the NUL), as `snprintf` does. With `cap`
/// 0 or a null `buf`, writes nothing.
///
/// # Safety
///
/// When `buf` is not null and `cap > 0`, `buf` must be valid for writes of `cap` bytes.
pub(crate) unsafe fn write_c_string(text: &str, buf: *mut u8, cap: usize) -> usize {
    if !buf.is_null() && cap > 0 {
        let n = text.len().min(cap - 1);
        // SAFETY: `n < cap` bytes are copied and one NUL is written at index `n < cap`, all
        // inside the `cap` writable bytes the caller vouched for; `text` cannot overlap a
        // buffer the caller owns.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf, n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

/// One device's statistics with PyTorch's key names, plus the ABI's own counters.
pub(crate) fn stats_json<D: Driver>(
    pool: &Pool<D>,
    device: std::ffi::c_int,
) -> cistern_alloc::Result<String> {
    use std::sync::atomic::Ordering::Relaxed;
    let mut s = crate::global::device(pool, device)?.stats();
    s.set(
        "num_abi_errors",
        crate::guard::ABI_ERRORS.load(Relaxed) as i64,
    );
    s.set(
        "num_abi_panics",
        crate::guard::ABI_PANICS.load(Relaxed) as i64,
    );
    Ok(s.to_json())
}

/// The snapshot of every device pool in use, in PyTorch's schema (see the module docs).
pub(crate) fn snapshot_json<D: Driver>(pool: &Pool<D>) -> String {
    // Each site is symbolised once per snapshot (many blocks share one).
    let mut sites = HashMap::new();
    let segments: Vec<Value> = pool
        .devices()
        .flat_map(|d| d.segments_snapshot())
        .map(|s| segment_json(&s, &mut sites))
        .collect();
    let traces: Vec<Value> = (0..pool.device_count()).map(|_| json!([])).collect();
    json!({ "segments": segments, "device_traces": traces }).to_string()
}

/// One frame as PyTorch's snapshots write it (`??` and 0 for what is not known).
fn frame_json(frame: &str) -> Value {
    let (name, file, line) = provenance::split_frame(frame);
    json!({ "filename": file.unwrap_or("??"), "line": line.unwrap_or(0), "name": name })
}

/// The frames of call site `site`, symbolised once per snapshot.
fn site_json(site: Option<u32>, cache: &mut HashMap<u32, Value>) -> Value {
    match site {
        None => json!([]),
        Some(id) => cache
            .entry(id)
            .or_insert_with(|| {
                Value::Array(
                    provenance::site_frames(id)
                        .iter()
                        .map(|f| frame_json(f))
                        .collect(),
                )
            })
            .clone(),
    }
}

fn segment_json(s: &SegmentSnapshot, sites: &mut HashMap<u32, Value>) -> Value {
    let (mut allocated, mut active, mut requested) = (0u64, 0u64, 0u64);
    let blocks: Vec<Value> = s
        .blocks
        .iter()
        .map(|b| {
            match b.state {
                BlockState::Allocated => {
                    allocated += b.size;
                    active += b.size;
                    requested += b.requested_size;
                }
                BlockState::PendingFree => active += b.size,
                BlockState::Free => {}
            }
            let mut v = json!({
                "address": b.address,
                "size": b.size,
                "requested_size": b.requested_size,
                "state": b.state.as_str(),
                "frames": site_json(b.site, sites),
            });
            if let Some(tag) = &b.tag {
                v["tag"] = json!(tag);
            }
            v
        })
        .collect();
    json!({
        "device": s.device,
        "address": s.address,
        "total_size": s.total_size,
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": requested,
        "stream": s.stream,
        "segment_type": if s.large { "large" } else { "small" },
        "segment_pool_id": [s.pool_id.0, s.pool_id.1],
        "is_expandable": s.expandable,
        "frames": [],
        "blocks": blocks,
    })
}

/// The allocation that contains `addr`, as PyTorch's `getBaseAllocation` means it: the base
/// address and size of the driver allocation to share over IPC. For a `cuMemAlloc` segment
/// that is the whole segment (what `cudaIpcGetMemHandle` needs); VMM memory has no such
/// allocation, so it is the live block itself. `None` when `addr` is not inside a live block.
pub(crate) fn base_allocation<D: Driver>(pool: &Pool<D>, addr: u64) -> Option<(u64, u64)> {
    let dev = pool.devices().find(|d| d.owns(addr))?;
    // A scan of the device's blocks: base_alloc is called when a tensor is shared between
    // processes, not per allocation.
    let segs = dev.segments_snapshot();
    let seg = segs
        .iter()
        .find(|s| addr >= s.address && addr < s.address + s.total_size)?;
    let block = seg
        .blocks
        .iter()
        .find(|b| addr >= b.address && addr < b.address + b.size)?;
    if block.state != BlockState::Allocated {
        return None;
    }
    Some(if seg.expandable {
        (block.address, block.size)
    } else {
        (seg.address, seg.total_size)
    })
}

#[cfg(test)]
mod frame_tests {
    use super::frame_json;
    use serde_json::json;

    #[test]
    fn frames_split_into_pytorchs_fields() {
        assert_eq!(
            frame_json("Model.forward (/srv/model.py:88)"),
            json!({"filename": "/srv/model.py", "line": 88, "name": "Model.forward"})
        );
        assert_eq!(
            frame_json("std::rt::lang_start (library/std/src/rt.rs)"),
            json!({"filename": "library/std/src/rt.rs", "line": 0, "name": "std::rt::lang_start"})
        );
        assert_eq!(
            frame_json("0x7f00aa"),
            json!({"filename": "??", "line": 0, "name": "0x7f00aa"})
        );
        // Generic names keep their parentheses; only the last " (...)" is the place.
        assert_eq!(
            frame_json("f<(u8, u16)>::{closure#0} (src/a.rs:3)"),
            json!({"filename": "src/a.rs", "line": 3, "name": "f<(u8, u16)>::{closure#0}"})
        );
    }
}
