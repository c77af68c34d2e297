"""Snapshots in PyTorch's schema, so ``torch.cuda._memory_viz`` and the memory viewer open them.

``libcistern.so`` writes the snapshot as JSON (``cistern_snapshot_json``). JSON cannot say
everything a pickled PyTorch snapshot holds (tuples, for one), and the library may omit keys
that PyTorch always writes, so :func:`normalize` turns the JSON into exactly the dictionary
``torch.cuda.memory._snapshot()`` returns:

``{"segments": [Segment], "device_traces": [[TraceEntry]], "allocator_settings": {...},
"external_annotations": []}``, where a Segment has ``device, address, total_size,
allocated_size, active_size, requested_size, stream, segment_type ("small"|"large"),
segment_pool_id (tuple), is_expandable, frames, blocks`` and a Block has ``address, size,
requested_size, state ("active_allocated"|"active_pending_free"|"inactive"), frames``.

A block's or trace entry's cistern tag (key ``tag``) becomes a one-frame stack named after the
tag when it has no frames of its own, so the viewer groups memory by tag.

Never imports torch.
"""

from __future__ import annotations

import json
import pickle
from typing import Any, Dict, List, Optional

from . import _lib

__all__ = ["snapshot", "dump_snapshot", "normalize", "validate", "BLOCK_STATES"]

#: The block states PyTorch writes (``Module.cpp``, ``THCPModule_memorySnapshot``).
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")

# Spellings other writers use for the same states.
_STATE_ALIASES = {
    "active_awaiting_free": "active_pending_free",
    "pending_free": "active_pending_free",
    "allocated": "active_allocated",
    "free": "inactive",
}

_TRACE_ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
)

#: Size below which PyTorch calls a segment "small" (its small pool serves requests <= 1 MiB
#: from 2 MiB segments).
_SMALL_SEGMENT = 2 << 20


def _tag_frames(tag: Any) -> List[Dict[str, Any]]:
    if not tag:
        return []
    return [{"filename": "<cistern tag>", "line": 0, "name": str(tag)}]


def _frames(d: Dict[str, Any]) -> List[Dict[str, Any]]:
    frames = d.get("frames")
    if isinstance(frames, list) and frames:
        return [
            {
                "filename": str(f.get("filename", "??")),
                "line": int(f.get("line", 0)),
                "name": str(f.get("name", "??")),
            }
            for f in frames
            if isinstance(f, dict)
        ]
    return _tag_frames(d.get("tag"))


def _state(raw: Any) -> str:
    s = str(raw)
    s = _STATE_ALIASES.get(s, s)
    if s not in BLOCK_STATES:
        raise ValueError(f"unknown block state {raw!r} (expected one of {BLOCK_STATES})")
    return s


def _pool_id(raw: Any) -> tuple:
    if isinstance(raw, (list, tuple)) and len(raw) == 2:
        return (int(raw[0]), int(raw[1]))
    return (0, 0)


def _block(b: Dict[str, Any], address: int) -> Dict[str, Any]:
    size = int(b["size"])
    state = _state(b.get("state", "inactive"))
    requested = b.get("requested_size")
    if requested is None:
        requested = size if state != "inactive" else 0
    out: Dict[str, Any] = {
        "address": int(b.get("address", address)),
        "size": size,
        "requested_size": int(requested),
        "state": state,
        "frames": _frames(b),
    }
    if b.get("tag"):
        out["tag"] = str(b["tag"])
    return out


def _segment(s: Dict[str, Any]) -> Dict[str, Any]:
    address = int(s["address"])
    blocks = []
    cursor = address
    for b in s.get("blocks", []):
        nb = _block(b, cursor)
        blocks.append(nb)
        cursor = nb["address"] + nb["size"]
    total = int(s.get("total_size", sum(b["size"] for b in blocks)))
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    requested = sum(b["requested_size"] for b in blocks if b["state"] != "inactive")
    seg_type = s.get("segment_type")
    if seg_type not in ("small", "large"):
        seg_type = "small" if total <= _SMALL_SEGMENT else "large"
    return {
        "device": int(s.get("device", 0)),
        "address": address,
        "total_size": total,
        "allocated_size": int(s.get("allocated_size", allocated)),
        "active_size": int(s.get("active_size", active)),
        "requested_size": int(s.get("requested_size", requested)),
        "stream": int(s.get("stream", 0)),
        "segment_type": seg_type,
        "segment_pool_id": _pool_id(s.get("segment_pool_id")),
        "is_expandable": bool(s.get("is_expandable", False)),
        "frames": _frames(s),
        "blocks": blocks,
    }


def _trace_entry(e: Dict[str, Any]) -> Dict[str, Any]:
    action = str(e["action"])
    out: Dict[str, Any] = {"action": action}
    if action == "oom":
        out["device_free"] = int(e.get("device_free", 0))
    else:
        out["addr"] = int(e.get("addr", 0))
    out["size"] = int(e.get("size", 0))
    out["stream"] = int(e.get("stream", 0))
    out["time_us"] = int(e.get("time_us", 0))
    out["frames"] = _frames(e)
    for k, v in e.items():
        # Keep cistern's extra fields (tag, requested size, ...) for tools that want them.
        out.setdefault(k, v)
    return out


def normalize(raw: Dict[str, Any]) -> Dict[str, Any]:
    """Turns cistern's snapshot JSON (already parsed) into PyTorch's snapshot dictionary.

    Raises:
        ValueError: a block has a state PyTorch does not know, or ``segments`` is missing.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("segments"), list):
        raise ValueError("a snapshot must be an object with a `segments` list")
    segments = [_segment(s) for s in raw["segments"]]
    traces_raw = raw.get("device_traces") or []
    device_count = max(
        [len(traces_raw)] + [s["device"] + 1 for s in segments] + [1]
    )
    traces: List[List[Dict[str, Any]]] = []
    for i in range(device_count):
        entries = traces_raw[i] if i < len(traces_raw) and traces_raw[i] else []
        traces.append([_trace_entry(e) for e in entries])
    settings = raw.get("allocator_settings")
    out: Dict[str, Any] = {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": dict(settings) if isinstance(settings, dict) else {},
        "external_annotations": list(raw.get("external_annotations") or []),
    }
    for k, v in raw.items():
        out.setdefault(k, v)  # cistern's own sections (e.g. tags) ride along
    return out


def validate(snap: Dict[str, Any]) -> List[str]:
    """Checks what ``torch.cuda._memory_viz`` relies on; returns the problems (empty: fine).

    ``_memory_viz.segsum`` asserts that a segment's blocks tile it exactly (contiguous, sizes
    summing to ``total_size``); the viewer needs the keys listed in the module docs.
    """
    problems: List[str] = []
    seg_keys = ("device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id", "blocks")
    blk_keys = ("address", "size", "requested_size", "state", "frames")
    for i, seg in enumerate(snap.get("segments", [])):
        for k in seg_keys:
            if k not in seg:
                problems.append(f"segment {i}: missing {k}")
        cursor = seg.get("address", 0)
        total = 0
        for j, b in enumerate(seg.get("blocks", [])):
            for k in blk_keys:
                if k not in b:
                    problems.append(f"segment {i} block {j}: missing {k}")
            if b.get("state") not in BLOCK_STATES:
                problems.append(f"segment {i} block {j}: bad state {b.get('state')!r}")
            if b.get("address") != cursor:
                problems.append(f"segment {i} block {j}: not contiguous")
            if b.get("state") != "inactive" and b.get("requested_size", 0) > b.get("size", 0):
                problems.append(f"segment {i} block {j}: requested_size above size")
            cursor = b.get("address", 0) + b.get("size", 0)
            total += b.get("size", 0)
        if total != seg.get("total_size"):
            problems.append(f"segment {i}: blocks sum to {total}, total_size {seg.get('total_size')}")
    for d, entries in enumerate(snap.get("device_traces", [])):
        for j, e in enumerate(entries):
            if e.get("action") not in _TRACE_ACTIONS:
                problems.append(f"trace {d}/{j}: unknown action {e.get('action')!r}")
    return problems


def snapshot() -> Dict[str, Any]:
    """cistern's memory state in the schema of ``torch.cuda.memory._snapshot()``.

    Raises:
        RuntimeError: the library could not write a snapshot (message: its last error).
    """
    text = _lib.snapshot_json()
    if not text:
        raise RuntimeError(f"cistern wrote no snapshot: {_lib.last_error()}")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"cistern_snapshot_json wrote invalid JSON ({e})") from e
    return normalize(raw)


def dump_snapshot(filename: str = "dump_snapshot.pickle", snap: Optional[Dict[str, Any]] = None) -> str:
    """Pickles :func:`snapshot` to ``filename``, as ``torch.cuda.memory._dump_snapshot`` does.

    The file opens in PyTorch's memory viewer and in ``python -m torch.cuda._memory_viz``.
    Returns ``filename``.
    """
    if snap is None:
        snap = snapshot()
    with open(filename, "wb") as f:
        pickle.dump(snap, f)
    return filename
