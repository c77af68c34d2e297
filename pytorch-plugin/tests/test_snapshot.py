"""Snapshots: normalisation to PyTorch's schema (no library needed) and the library's snapshot."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
from typing import Any, Dict

import pytest

import cistern_torch
from cistern_torch import _snapshot

MiB = 1 << 20

RAW: Dict[str, Any] = {
    "segments": [
        {
            "device": 0,
            "address": 0x7F0000000000,
            "total_size": 4 * MiB,
            "stream": 0,
            "segment_pool_id": [0, 0],
            "is_expandable": True,
            "blocks": [
                {"size": MiB, "requested_size": 1000000, "state": "active_allocated", "tag": "opt"},
                {"size": MiB, "requested_size": MiB, "state": "active_awaiting_free"},
                {"size": 2 * MiB, "state": "inactive"},
            ],
        }
    ],
    "device_traces": [
        [
            {"action": "segment_map", "addr": 0x7F0000000000, "size": 4 * MiB, "stream": 0},
            {"action": "alloc", "addr": 0x7F0000000000, "size": 1000000, "stream": 0,
             "time_us": 5, "tag": "opt"},
            {"action": "oom", "device_free": 0, "size": 1 << 50, "stream": 0},
        ]
    ],
    "cistern": {"tags": {"opt": 1048576}},
}


class _NoClasses(pickle.Unpickler):
    """Refuses every class: a snapshot pickle must hold builtins only (loadable anywhere)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"snapshot pickle references {module}.{name}")


def test_normalize_fills_pytorch_schema() -> None:
    snap = _snapshot.normalize(json.loads(json.dumps(RAW)))
    assert _snapshot.validate(snap) == []
    seg = snap["segments"][0]
    assert seg["segment_pool_id"] == (0, 0)
    assert seg["segment_type"] == "large"
    assert seg["allocated_size"] == MiB
    assert seg["active_size"] == 2 * MiB
    assert seg["requested_size"] == 1000000 + MiB
    states = [b["state"] for b in seg["blocks"]]
    assert states == ["active_allocated", "active_pending_free", "inactive"]
    addrs = [b["address"] for b in seg["blocks"]]
    assert addrs == [0x7F0000000000, 0x7F0000000000 + MiB, 0x7F0000000000 + 2 * MiB]
    assert seg["blocks"][0]["frames"] == [{"filename": "<cistern tag>", "line": 0, "name": "opt"}]
    assert seg["blocks"][2]["requested_size"] == 0
    alloc = snap["device_traces"][0][1]
    assert alloc["size"] == 1000000 and alloc["frames"][0]["name"] == "opt"
    oom = snap["device_traces"][0][2]
    assert "device_free" in oom and "addr" not in oom
    assert snap["allocator_settings"] == {} and snap["external_annotations"] == []
    assert snap["cistern"] == RAW["cistern"]


def test_normalize_rejects_unknown_states() -> None:
    raw = json.loads(json.dumps(RAW))
    raw["segments"][0]["blocks"][0]["state"] = "weird"
    with pytest.raises(ValueError):
        _snapshot.normalize(raw)


def test_validate_reports_gaps() -> None:
    snap = _snapshot.normalize(json.loads(json.dumps(RAW)))
    snap["segments"][0]["total_size"] += 512
    assert any("sum" in p for p in _snapshot.validate(snap))


def test_dump_snapshot_pickles_builtins(tmp_path) -> None:
    path = tmp_path / "snap.pickle"
    snap = _snapshot.normalize(json.loads(json.dumps(RAW)))
    cistern_torch.dump_snapshot(str(path), snap=snap)
    loaded = _NoClasses(io.BytesIO(path.read_bytes())).load()
    assert loaded == snap


def _memory_viz() -> Any:
    """PyTorch's ``torch.cuda._memory_viz`` (pure Python: it imports no torch): the installed
    torch's, else the file ``scripts/torch-headers.sh`` unpacks from the newest torch wheel."""
    try:
        from torch.cuda import _memory_viz as viz

        return viz
    except ImportError:
        pass
    for root in os.environ.get("CISTERN_TORCH_TORCH_DIRS", "").split(os.pathsep):
        path = os.path.join(root, "cuda", "_memory_viz.py") if root else ""
        if path and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_cistern_test_memory_viz", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    pytest.skip("needs torch's _memory_viz: install torch, or run scripts/torch-headers.sh "
                "(scripts/test.sh then sets CISTERN_TORCH_TORCH_DIRS)")


def test_memory_viz_reads_a_normalized_snapshot() -> None:
    viz = _memory_viz()
    snap = _snapshot.normalize(json.loads(json.dumps(RAW)))
    assert "total_reserved: 4.0MiB" in viz.segsum(snap)
    assert "Device 0" in viz.trace(snap)


def test_memory_viz_reads_the_librarys_snapshot(allocs) -> None:
    """torch's own readers of a snapshot (the flame graphs of ``segments`` and ``memory``, the
    segment summary with its accounting checks, the trace and the HTML timeline) take
    cistern's, with live, freed and merged blocks."""
    viz = _memory_viz()
    live = [allocs.malloc(size) for size in (3 * MiB + 100, 5000, 40 * MiB, 512)]
    gone = allocs.malloc(2 * MiB)
    allocs.free(gone)
    other = allocs.malloc(6 * MiB)
    snap = cistern_torch.snapshot()
    pickled = pickle.loads(pickle.dumps(snap))
    lines = viz.segments(pickled, format_flamegraph=lambda text: text)
    assert "active_allocated" in lines
    # Each segment's lines (blocks, and the gaps torch adds for what a block's requested size
    # leaves) add up to the segment.
    per_segment: Dict[str, int] = {}
    for line in lines.splitlines():
        stack, size = line.rsplit(" ", 1)
        assert stack.startswith("stream_") and int(size) >= 0, line
        seg = stack.split(";")[1]
        per_segment[seg] = per_segment.get(seg, 0) + int(size)
    assert per_segment == {f"seg_{seg['address']}": seg["total_size"] for seg in snap["segments"]}
    assert "stream_0;active_allocated" in viz.memory(pickled, format_flamegraph=lambda t: t)
    summary = viz.segsum(pickled)
    reserved = sum(seg["total_size"] for seg in snap["segments"])
    assert f"segments: {len(snap['segments'])}" in summary
    assert reserved == cistern_torch.memory_reserved(0)
    viz.trace(pickled)
    html = viz.trace_plot(pickled)
    assert "snapshot.pickle" in html and "add_local_files" in html
    allocs.free(other)
    for p in live:
        allocs.free(p)


def test_library_snapshot_shows_live_and_freed_blocks(allocs) -> None:
    a = allocs.malloc(3 * MiB + 100)
    b = allocs.malloc(5000)
    c = allocs.malloc(2 * MiB)
    allocs.free(c)
    snap = cistern_torch.snapshot()
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    assert _snapshot.validate(snap) == []
    blocks = {blk["address"]: blk for seg in snap["segments"] for blk in seg["blocks"]}
    assert blocks[a]["state"] == "active_allocated"
    assert blocks[a]["requested_size"] == 3 * MiB + 100
    assert blocks[a]["size"] >= 3 * MiB + 100
    assert blocks[b]["state"] == "active_allocated"
    assert blocks[b]["requested_size"] == 5000
    if c in blocks:  # a freed block may have merged with its neighbours
        assert blocks[c]["state"] in ("inactive", "active_pending_free")
    reserved = sum(seg["total_size"] for seg in snap["segments"] if seg["device"] == 0)
    assert reserved == cistern_torch.memory_reserved(0)
    allocs_seen = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == a]
    if snap["device_traces"][0]:
        assert allocs_seen and allocs_seen[-1]["size"] == 3 * MiB + 100


def test_dump_snapshot_of_the_library(allocs, tmp_path) -> None:
    allocs.malloc(MiB)
    path = tmp_path / "dump.pickle"
    assert cistern_torch.dump_snapshot(str(path)) == str(path)
    loaded = _NoClasses(io.BytesIO(path.read_bytes())).load()
    assert isinstance(loaded["segments"], list) and loaded["segments"]
    assert isinstance(loaded["device_traces"], list)
