"""Device memory from Python without torch: :func:`alloc` and its :class:`Allocation`, and
:func:`check`, the one-call test that the library, the driver and the pool work.

This module owns the public allocation API for Python code that is not PyTorch (a quick
check, a ctypes or CUDA-Python program): an :class:`Allocation` frees its block at most once,
whichever of :meth:`Allocation.free`, a ``with`` block's end or garbage collection comes first,
so that no Python code path can free the same pointer twice. Never imports torch.
"""

from __future__ import annotations

import threading
from typing import Any, Dict

from . import _lib
from ._torch import OutOfMemoryError, device_index

__all__ = ["Allocation", "alloc", "check", "driver_description"]


class Allocation:
    """A block of device memory from cistern: ``ptr`` (the device address, an int), ``size``
    (bytes asked for), ``device``, ``stream``.

    Free it with :meth:`free` or by using it as a context manager; it is also freed when the
    object is garbage collected, so keep the object, not just ``ptr``, while the memory is in
    use. Freeing is done at most once: a second :meth:`free` does nothing.
    """

    __slots__ = ("ptr", "size", "device", "stream", "_freed", "_lock")

    def __init__(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device
        self.stream = stream
        self._freed = False
        self._lock = threading.Lock()

    @property
    def freed(self) -> bool:
        """Whether the block has been given back."""
        return self._freed

    def free(self) -> None:
        """Gives the block back to cistern (for reuse on ``stream``). Does nothing the second
        time, or for a zero-byte allocation (``ptr`` 0)."""
        with self._lock:
            if self._freed:
                return
            self._freed = True
        if self.ptr:
            _lib.free(self.ptr, self.size, self.device, self.stream)

    def __enter__(self) -> "Allocation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __del__(self) -> None:
        # At interpreter exit the module's globals may already be gone: nothing to do then.
        try:
            self.free()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        state = " freed" if self._freed else ""
        return (
            f"<cistern_torch.Allocation {self.size} bytes at {self.ptr:#x} on device "
            f"{self.device}, stream {self.stream:#x}{state}>"
        )


def _index(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def alloc(nbytes: int, device: Any = 0, stream: int = 0) -> Allocation:
    """Allocates ``nbytes`` of device memory on ``device`` for use on ``stream`` (a
    ``cudaStream_t`` value as an int; 0: the default stream). Needs no torch.

    ``alloc(0)`` succeeds with ``ptr`` 0 (cistern returns no block for zero bytes).

    Raises:
        OutOfMemoryError: the device or the configured limit has no room; the message is
            cistern's OOM report.
        ValueError: the device does not exist, or an argument is out of range.
        RuntimeError: the pool cannot start (no CUDA driver, a bad ``CISTERN_CONF`` or
            ``CISTERN_SIM``); the message says what to do.
    """
    size = _index("nbytes", nbytes)
    dev = device_index(device)
    if dev < 0:
        raise ValueError(f"device must be >= 0, got {dev}")
    strm = _index("stream", stream)
    if size == 0:
        return Allocation(0, 0, dev, strm)
    with _lib.errors_raised():
        ptr = _lib.malloc(size, dev, strm)
        why = "" if ptr else _lib.last_error()
    if ptr:
        return Allocation(ptr, size, dev, strm)
    if "out of memory" in why or "limit exceeded" in why:
        raise OutOfMemoryError(why)
    if "invalid device" in why or "invalid argument" in why:
        raise ValueError(why)
    raise RuntimeError(why or f"cistern_malloc({size}) failed without a message")


def driver_description() -> str:
    """The driver in use, in words, with the variable that chose it."""
    import os

    if _lib.driver() == "sim":
        sim = os.environ.get("CISTERN_SIM", "")
        setting = f"CISTERN_SIM={sim}" if sim else "CISTERN_SIM unset: its defaults"
        return f"simulated GPU (CISTERN_DRIVER=sim; {setting})"
    chosen = os.environ.get("CISTERN_DRIVER", "") or "unset"
    return f"CUDA (libcuda.so.1; CISTERN_DRIVER={chosen})"


def check(nbytes: int = 1 << 20, device: Any = 0) -> Dict[str, Any]:
    """Allocates ``nbytes`` on ``device`` once and frees it: the quickest proof that the
    library loads, the driver opens and the pool serves memory.

    Returns ``library``, ``version``, ``driver`` (``"sim"`` or ``"cuda"``),
    ``driver_description``, ``device``, ``ptr``, ``size`` and ``stats`` (the device's
    :func:`~cistern_torch.memory_stats` after the free). Raises what :func:`alloc` raises.
    """
    dev = device_index(device)
    with alloc(nbytes, dev) as a:
        ptr = a.ptr
    stats = _lib.stats(dev)
    return {
        "library": _lib.loaded_path(),
        "version": _lib.version(),
        "driver": _lib.driver(),
        "driver_description": driver_description(),
        "device": dev,
        "ptr": ptr,
        "size": nbytes,
        "stats": dict(sorted(stats.items())),
    }
