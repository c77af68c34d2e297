"""``record_oom_snapshot(path)``: the on-ramp to ``cistern whatif`` for programs on PyTorch's own
allocator. One call at the top of a training script::

    import cistern_torch
    cistern_torch.record_oom_snapshot("oom.pickle")

starts PyTorch's memory history (``torch.cuda.memory._record_memory_history``: every
allocation, free and segment event with its stack, in a ring buffer) and attaches an observer
(``torch._C._cuda_attach_out_of_memory_observer``) that PyTorch's caching allocator calls with
``(device, alloc_size, device_total, device_free)`` (``device_total`` is the allowed maximum
under ``set_per_process_memory_fraction``) each time it is about to raise ``OutOfMemoryError``; the observer writes the snapshot (``torch.cuda.memory._dump_snapshot``).
After the OOM, ``cistern whatif oom.pickle`` says whether other settings or cistern would have
fitted the request.

This module owns only that call. It imports torch when called, never on import.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, Optional, Union

__all__ = ["record_oom_snapshot", "DEFAULT_MAX_ENTRIES"]

#: Events kept by default: about 100,000 (a few training steps; some MB of host memory).
DEFAULT_MAX_ENTRIES = 100_000

_lock = threading.Lock()
_state: Dict[str, Any] = {}


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "cistern_torch.record_oom_snapshot needs PyTorch (pip install torch): it records "
            "PyTorch's own CUDA allocator; cistern whatif then reads the snapshot without torch"
        ) from e
    return torch


def _path_for(template: str, device: int) -> str:
    """``{pid}``, ``{rank}`` (``$RANK``, as torchrun sets it; else 0) and ``{device}``
    filled in, so that every process of a multi-GPU job writes its own file."""
    rank = os.environ.get("RANK", "0")
    try:
        return template.format(pid=os.getpid(), rank=rank, device=device)
    except (KeyError, IndexError, ValueError):
        return template


def _observer(device: int, alloc_size: int, device_total: int, device_free: int) -> None:
    """Called by PyTorch before it raises OutOfMemoryError: writes the snapshot."""
    with _lock:
        template = _state.get("path")
        dump = _state.get("dump")
    if template is None or dump is None:
        return
    path = _path_for(template, int(device))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        dump(tmp)
        os.replace(tmp, path)
    except Exception as e:  # never mask the OOM itself
        print(f"cistern_torch: could not write the OOM snapshot {path}: {e}", file=sys.stderr)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return
    with _lock:
        _state["written"] = path
        _state["count"] = _state.get("count", 0) + 1
    print(
        f"cistern_torch: out of memory on cuda:{device} (a {alloc_size}-byte allocation, "
        f"{device_free} of {device_total} bytes free); wrote {path}; next: cistern whatif {path}",
        file=sys.stderr,
    )


def record_oom_snapshot(
    path: Union[str, "os.PathLike[str]"] = "oom.pickle",
    *,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    stacks: bool = True,
) -> str:
    """Records PyTorch's memory history and writes a snapshot to ``path`` when an OOM happens.

    Call it once, early (before the memory you want to see is allocated); calling it again
    changes the path. Each OOM rewrites the file (PyTorch may report several while retrying,
    e.g. cuDNN trying a smaller workspace); the last one holds every OOM still in the history.
    ``path`` may contain ``{rank}``, ``{pid}`` and ``{device}``. Returns the path (as given).

    Args:
        path: where the snapshot goes (a ``.pickle``; read it with ``cistern whatif path``).
        max_entries: events kept in PyTorch's ring buffer.
        stacks: record Python stacks with each event (``stacks="python"``), so that the answer
            names the line that asked; False records none (cheaper).

    Raises:
        ImportError: torch is not installed.
        RuntimeError: cistern is PyTorch's allocator in this process (PyTorch's history does not
            see it: catch ``cistern_torch.OutOfMemoryError`` and call
            ``cistern_torch.dump_snapshot(path)`` instead), or this PyTorch lacks the APIs
            (PyTorch 2.1 or later is needed).
    """
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ValueError("record_oom_snapshot: path must be a non-empty file name")
    if max_entries < 1:
        raise ValueError("record_oom_snapshot: max_entries must be at least 1")
    from . import _torch as _cistern_torch

    if _cistern_torch.is_installed():
        raise RuntimeError(
            "record_oom_snapshot records PyTorch's native allocator, but cistern is PyTorch's "
            "allocator in this process: catch cistern_torch.OutOfMemoryError and call "
            f"cistern_torch.dump_snapshot({path!r}), then run cistern whatif {path}"
        )
    torch = _import_torch()
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    record = getattr(memory, "_record_memory_history", None)
    dump = getattr(memory, "_dump_snapshot", None)
    attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    missing = [
        name
        for name, f in (
            ("torch.cuda.memory._record_memory_history", record),
            ("torch.cuda.memory._dump_snapshot", dump),
            ("torch._C._cuda_attach_out_of_memory_observer", attach),
        )
        if f is None
    ]
    if missing:
        version = getattr(torch, "__version__", "?")
        raise RuntimeError(
            f"record_oom_snapshot: this PyTorch ({version}) lacks {', '.join(missing)}; it "
            "needs PyTorch 2.1 or later, built with CUDA"
        )
    try:
        record(
            enabled="all",
            context="all" if stacks else None,
            stacks="python",
            max_entries=max_entries,
        )
    except TypeError:
        # PyTorch 2.0's signature.
        record(True, trace_alloc_max_entries=max_entries, trace_alloc_record_context=stacks)
    with _lock:
        _state["path"] = path
        _state["dump"] = dump
        attached = _state.get("attached", False)
        _state["attached"] = True
    if not attached:
        # PyTorch has no way to detach an observer: one observer, reading the current path.
        attach(_observer)
    return path


def last_written() -> Optional[str]:
    """The file the last OOM wrote (None before any)."""
    with _lock:
        return _state.get("written")
