"""``torch.cuda``-style memory functions, answered by cistern (PyTorch's raise once cistern is
installed: its pluggable-allocator mode has no stats, peaks or fraction getter).

Names, arguments and results follow ``torch.cuda.memory``: ``memory_stats`` returns an
``OrderedDict`` sorted by key with PyTorch's key names (``allocated_bytes.all.current``,
``reserved_bytes.large_pool.peak``, ``num_ooms``, ...) plus cistern's own counters
(``num_stitches``, ``num_invalid_frees``, ...). Never imports torch.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Dict

from . import _lib
from ._torch import device_index

__all__ = [
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "empty_cache",
    "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
    "enable_peer_access",
    "record_stream",
]

_fractions: Dict[int, float] = {}
_fractions_lock = threading.Lock()


def memory_stats(device: Any = None) -> "collections.OrderedDict[str, Any]":
    """cistern's statistics for ``device``, as ``torch.cuda.memory_stats`` returns them.

    Args:
        device: an int, ``"cuda:N"``, a ``torch.device``, or None for the current device.

    Raises:
        ValueError: the device does not exist (the message is cistern's).
    """
    stats = _lib.stats(device_index(device))
    return collections.OrderedDict(sorted(stats.items()))


def memory_allocated(device: Any = None) -> int:
    """Bytes in live allocations (``allocated_bytes.all.current``)."""
    return int(memory_stats(device).get("allocated_bytes.all.current", 0))


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` since start or the last peak reset."""
    return int(memory_stats(device).get("allocated_bytes.all.peak", 0))


def memory_reserved(device: Any = None) -> int:
    """Bytes cistern holds from the driver, live or cached (``reserved_bytes.all.current``)."""
    return int(memory_stats(device).get("reserved_bytes.all.current", 0))


def max_memory_reserved(device: Any = None) -> int:
    """Peak of :func:`memory_reserved` since start or the last peak reset."""
    return int(memory_stats(device).get("reserved_bytes.all.peak", 0))


def reset_peak_memory_stats(device: Any = None) -> None:
    """Sets every ``*.peak`` of ``device`` to its current value."""
    _lib.reset_peak_stats(device_index(device))


def empty_cache() -> None:
    """Returns every cached (free) page to the driver; live memory stays."""
    _lib.empty_cache()


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limits cistern's reserved memory on ``device`` to ``fraction`` of its total memory.

    As in PyTorch: ``fraction`` must be a float in [0, 1]; an allocation that would exceed the
    limit fails with an out-of-memory error. Lowering the limit below what is reserved releases
    cached memory down to it.

    Raises:
        TypeError: ``fraction`` is not a float.
        ValueError: ``fraction`` is outside [0, 1].
    """
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0.0 <= fraction <= 1.0:  # also rejects NaN
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    dev = device_index(device)
    _lib.set_memory_fraction(fraction, dev)
    with _fractions_lock:
        _fractions[dev] = fraction


def _configured_fraction() -> float:
    """``memory_fraction`` from ``CISTERN_CONF`` (what the library starts with), else 1.0."""
    for entry in os.environ.get("CISTERN_CONF", "").split(","):
        key, _, value = entry.partition(":")
        if key.strip() == "memory_fraction":
            try:
                return float(value.strip())
            except ValueError:
                break
    return 1.0


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The fraction set for ``device`` (by the setter, or ``memory_fraction`` in CISTERN_CONF).

    Asks the library when it exports ``cistern_get_memory_fraction``; otherwise returns what
    this module set, else the configured value. (A fraction set through
    ``torch.cuda.set_per_process_memory_fraction`` reaches cistern through the hook, but is
    seen here only with the library getter.)
    """
    dev = device_index(device)
    from_lib = _lib.get_memory_fraction(dev)
    if from_lib is not None:
        return from_lib
    with _fractions_lock:
        if dev in _fractions:
            return _fractions[dev]
    return _configured_fraction()


def enable_peer_access(device: Any, peer: Any) -> None:
    """Lets device ``peer`` read and write every block cistern holds on ``device``, now and later.

    ``torch.cuda``'s peer access (``cudaDeviceEnablePeerAccess``) does not cover memory mapped
    with the CUDA VMM API, which is what cistern's blocks are: without this (or
    ``peer_access:all`` in ``CISTERN_CONF``), a kernel on ``peer`` that touches them faults.
    Granting twice is harmless.

    Raises:
        ValueError: a device does not exist, ``peer`` is ``device``, or the two cannot reach
            each other (``cuDeviceCanAccessPeer``); the message is cistern's.
    """
    _lib.enable_peer_access(device_index(device), device_index(peer))


def record_stream(ptr_or_tensor: Any, stream: Any) -> None:
    """Tells cistern that ``stream`` uses the block until its queued work completes.

    ``Tensor.record_stream`` does this already after :func:`cistern_torch.install`; this is for
    raw pointers. ``ptr_or_tensor``: an int address or a tensor (its storage's pointer);
    ``stream``: a ``torch.cuda.Stream`` or a raw ``cudaStream_t`` int.
    """
    ptr = ptr_or_tensor
    if not isinstance(ptr, int):
        storage = ptr.untyped_storage() if hasattr(ptr, "untyped_storage") else ptr
        ptr = int(storage.data_ptr())
    raw_stream = getattr(stream, "cuda_stream", stream)
    _lib.record_stream(ptr, int(raw_stream or 0))
