"""PyTorch integration: ``install()`` (cistern as PyTorch's allocator), ``mem_pool()``, OOM.

The only module that imports torch, and only inside its functions.

Two modes
---------
* **native** (preferred): ``install()`` compiles ``_native.cpp`` against the installed torch's
  headers (cached after the first time) and installs it with PyTorch's own
  ``changeCurrentAllocator``: a ``CUDAAllocator`` that answers ``torch.cuda.memory_stats()``,
  ``memory_allocated()``, ``max_memory_allocated()``, ``reset_peak_memory_stats()``,
  ``memory_summary()``, ``memory_snapshot()``, ``_record_memory_history()`` and
  ``empty_cache()`` from cistern, gives CUDA
  graphs private pools (memory a capture allocates is reused only inside the graph, and nothing
  cistern does during a capture invalidates it), grants peers access to VMM mappings, and
  raises ``torch.OutOfMemoryError`` with cistern's report on OOM.
* **pluggable** (fallback, when the native allocator cannot be built: no CUDA headers, no
  compiler): ``CUDAPluggableAllocator``, with the OOM shim below. PyTorch's memory APIs raise
  in this mode (use ``cistern_torch.memory_stats()``), and CUDA graphs get no private pools.
  ``install()`` says so once, with the fix.

:func:`allocator_mode` says which is in use.

How an out-of-memory error reaches Python
-----------------------------------------
PyTorch's ``CUDAPluggableAllocator`` stores whatever the allocation function returns, NULL
included (a tensor with a null data pointer results). So ``install()`` does not hand PyTorch
``cistern_malloc`` itself but ``cistern_torch_malloc`` from a small C++ shim (``_shim.cpp``),
compiled on first use against the installed torch's headers: it calls ``cistern_malloc`` and, when
a non-empty request fails, throws ``c10::OutOfMemoryError`` whose message is cistern's OOM report.
PyTorch converts that exception exactly as it converts its own allocator's OOM: the user gets
``torch.OutOfMemoryError`` (the same class as ``torch.cuda.OutOfMemoryError``) with the message
``CUDA out of memory. cistern could not allocate N bytes on device D: <cistern's report>``.

When the shim cannot be built either (no C++ compiler), ``install()`` warns and falls back to
plain ``cistern_malloc``, which PyTorch would turn into a tensor on a NULL pointer: so in that
mode cistern never returns NULL to PyTorch. A failed allocation prints cistern's report and
aborts the process (``cistern_abort_on_failure``; ``oom_mode() == "abort"``) rather than let a
kernel fail later with an illegal address far from the cause. Build the shim (``python -m
cistern_torch build-shim``) to get the exception instead.

In ``mem_pool()`` mode PyTorch's own caching allocator calls cistern for whole segments and does
check for NULL: it frees its cache, retries, then raises its own ``OutOfMemoryError``; cistern's
report is then in :func:`cistern_torch.last_error` on the allocating thread. PyTorch gives a
segment back only to release it (``empty_cache``, its OOM retry, the pool's end), so cistern
returns the memory to the driver at once (``cistern_free_and_release``), where PyTorch's own
``cudaMalloc`` can have it.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Dict, Optional

from . import _lib, _shim, _tags

__all__ = [
    "InstallError",
    "CisternWarning",
    "OutOfMemoryError",
    "install",
    "is_installed",
    "oom_mode",
    "allocator_mode",
    "check_oom",
    "mem_pool",
    "current_device",
    "device_index",
]


class InstallError(RuntimeError):
    """``install()`` could not swap PyTorch's allocator; the message says what to do."""


class CisternWarning(UserWarning):
    """Something works in a degraded mode (e.g. OOM detected only after the fact)."""


class OutOfMemoryError(RuntimeError):
    """cistern could not serve an allocation; ``str()`` is cistern's OOM report.

    Raised by :func:`check_oom`. When torch is loaded the raised object is also a
    ``torch.OutOfMemoryError``, so ``except torch.cuda.OutOfMemoryError`` catches it.
    """


TOO_LATE = (
    "cistern_torch.install() must run before CUDA is initialised, but this process already "
    "initialised CUDA (a CUDA tensor, torch.cuda.* call or model.cuda() came first). "
    "Call cistern_torch.install() before any CUDA work, e.g. at the top of your script, "
    "right after `import torch`."
)

_lock = threading.Lock()
_state: Dict[str, Any] = {}


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - message only
        raise ImportError(
            "this cistern_torch function needs PyTorch (pip install torch); the stats, tag and "
            "snapshot functions work without it"
        ) from e
    return torch


def device_index(device: Any = None) -> int:
    """The device ordinal for ``device`` (None, int, ``"cuda:1"``, ``torch.device``).

    None means the current device: ``torch.cuda.current_device()`` when torch is loaded and CUDA
    is initialised, else 0. Never imports torch.
    """
    if device is None:
        return current_device()
    if isinstance(device, bool):
        raise TypeError("a device is an int, a str or a torch.device, not a bool")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        return int(idx) if idx else current_device()
    kind = getattr(device, "type", None)
    if kind is not None:
        if kind != "cuda":
            raise ValueError(f"expected a CUDA device, got {device!r}")
        idx = getattr(device, "index", None)
        return current_device() if idx is None else int(idx)
    raise TypeError(f"cannot use {device!r} as a device")


def current_device() -> int:
    """``torch.cuda.current_device()`` if torch is loaded and CUDA initialised, else 0."""
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is not None and cuda.is_initialized():
                return int(cuda.current_device())
        except Exception:  # a half-imported or mocked torch: fall back to device 0
            pass
    return 0


def is_installed() -> bool:
    """Whether :func:`install` swapped PyTorch's allocator for cistern in this process."""
    return "allocator" in _state


def allocator_mode() -> Optional[str]:
    """``"native"`` (cistern is PyTorch's own allocator), ``"pluggable"`` (the fallback), or
    None (not installed)."""
    return _state.get("mode")


def _wanted(arg: Optional[bool], env_var: str) -> Optional[bool]:
    """An optional part of install(), from its argument, else the environment variable: True
    required; False off; None try, and fall back with a warning."""
    if arg is not None:
        return arg
    env = os.environ.get(env_var, "auto").strip().lower()
    if env in ("1", "true", "yes", "on", "required"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    return None


def _install_native(torch: Any) -> Any:
    """Builds, binds and installs the native allocator; returns PyTorch's handle on it.

    Raises:
        ShimBuildError: it cannot be built or loaded.
        InstallError: PyTorch refused the swap (CUDA already initialised).
    """
    try:
        path = _shim.build_native_for_torch(torch)
        handle = _shim.bind_native(path)
    except (OSError, AttributeError, _lib.LibraryNotFoundError) as e:
        raise _shim.ShimBuildError(f"{type(e).__name__}: {e}") from e
    try:
        _shim.install_native(handle)
    except RuntimeError as e:
        if "initialized" in str(e) or "initialised" in str(e):
            raise InstallError(TOO_LATE) from e
        raise _shim.ShimBuildError(f"PyTorch refused the native allocator: {e}") from e
    _state["native_handle"] = handle
    _state["native_path"] = path
    getter = getattr(torch.cuda.memory, "_get_current_allocator", None)
    return getter() if getter is not None else handle


def oom_mode() -> Optional[str]:
    """``"raise"`` (native mode, or the shim is in place), ``"abort"`` (the pluggable fallback
    without the shim: a failed allocation aborts with cistern's report rather than give PyTorch
    a NULL pointer), None (not installed)."""
    return _state.get("oom_mode")



def _set_hook(raw: Any, method: str, symbol: str, missing: list) -> None:
    setter = getattr(raw, method, None)
    if setter is None:
        missing.append(method)
        return
    setter(_lib.function_address(symbol))


def install(*, native: Optional[bool] = None, shim: Optional[bool] = None) -> Any:
    """Makes cistern PyTorch's CUDA allocator for the rest of the process.

    Must run before CUDA is initialised (before the first CUDA tensor or ``torch.cuda`` call):
    put it at the top of the script. In native mode (see the module documentation) every
    ``torch.cuda`` memory API answers from cistern and CUDA graphs get private pools. In the
    pluggable fallback it sets PyTorch's init, reset (``empty_cache``), memory-fraction,
    record-stream and base-alloc hooks, so ``torch.cuda.empty_cache()``,
    ``torch.cuda.set_per_process_memory_fraction`` and ``Tensor.record_stream`` reach cistern;
    PyTorch's ``torch.cuda.memory_stats()`` and snapshots raise there: use
    ``cistern_torch.memory_stats()`` and ``cistern_torch.snapshot()`` instead.

    Calling it again is a no-op that returns the same allocator.

    Args:
        native: True: require the native allocator (raise if it cannot be built); False: use
            the pluggable allocator; None (default, or ``CISTERN_TORCH_NATIVE``): try native,
            and fall back with a :class:`CisternWarning` that says why.
        shim: for the pluggable mode. True: require the OOM shim (raise if it cannot be
            built); False: do not use it (OOM detected after the fact only); None (default, or
            ``CISTERN_TORCH_SHIM``): build it, and fall back with a :class:`CisternWarning`.

    Returns:
        PyTorch's handle on the allocator now in use (``torch.cuda.memory._CUDAAllocator``
        in native mode, the ``CUDAPluggableAllocator`` in the fallback).

    Raises:
        InstallError: CUDA is already initialised, or this torch has no CUDA support.
        cistern_torch.LibraryNotFoundError: no ``libcistern.so`` (set ``CISTERN_LIB``).
        cistern_torch.ShimBuildError: ``native=True`` or ``shim=True`` and that part could
            not be built.
    """
    with _lock:
        if "allocator" in _state:
            return _state["allocator"]
        torch = _torch()
        if getattr(torch.version, "cuda", None) is None:
            raise InstallError(
                "cistern_torch.install() needs a CUDA build of PyTorch (torch.version.cuda is None)"
            )
        if torch.cuda.is_initialized():
            raise InstallError(TOO_LATE)
        _lib.load()
        lib_path = _lib.loaded_path()
        assert lib_path is not None

        want_native = _wanted(native, "CISTERN_TORCH_NATIVE")
        if want_native is not False:
            try:
                allocator = _install_native(torch)
            except _shim.ShimBuildError as e:
                if want_native:
                    raise
                warnings.warn(
                    "cistern_torch: the native allocator could not be built, so cistern is "
                    "installed as a pluggable allocator: torch.cuda.memory_stats(), "
                    "memory_snapshot() and friends raise (use cistern_torch.memory_stats()), "
                    f"and CUDA graphs get no private pools. Fix: {e}",
                    CisternWarning,
                    stacklevel=2,
                )
            else:
                _state["allocator"] = allocator
                _state["mode"] = "native"
                _state["oom_mode"] = "raise"
                return allocator

        want = _wanted(shim, "CISTERN_TORCH_SHIM")
        shim_path: Optional[str] = None
        if want is not False:
            try:
                shim_path = _shim.build_for_torch(torch)
                _state["shim_handle"] = _shim.bind(shim_path)
            except _shim.ShimBuildError as e:
                if want:
                    raise
                shim_path = None
                warnings.warn(
                    "cistern_torch: the OOM shim could not be built, so an out-of-memory "
                    "error cannot raise at the allocation: a failed allocation will print "
                    "cistern's report and abort the process (PyTorch would otherwise build a "
                    f"tensor on a NULL pointer). Fix: {e}",
                    CisternWarning,
                    stacklevel=2,
                )
        mem = torch.cuda.memory
        if shim_path is not None:
            allocator = mem.CUDAPluggableAllocator(
                shim_path, "cistern_torch_malloc", "cistern_torch_free"
            )
        else:
            allocator = mem.CUDAPluggableAllocator(lib_path, "cistern_malloc", "cistern_free")
        raw = allocator.allocator()
        missing: list = []
        _set_hook(raw, "set_init_fn", "cistern_init", missing)
        _set_hook(raw, "set_reset_fn", "cistern_empty_cache", missing)
        _set_hook(raw, "set_memory_fraction_fn", "cistern_set_memory_fraction", missing)
        _set_hook(raw, "set_record_stream_fn", "cistern_record_stream", missing)
        _set_hook(raw, "set_base_alloc_fn", "cistern_base_alloc", missing)
        if missing:
            warnings.warn(
                f"cistern_torch: this torch ({torch.__version__}) lacks {', '.join(missing)}; "
                "the matching PyTorch calls will not reach cistern (without set_record_stream_fn, "
                "Tensor.record_stream is ignored: use cistern_torch.record_stream)",
                CisternWarning,
                stacklevel=2,
            )
        try:
            mem.change_current_allocator(allocator)
        except RuntimeError as e:
            if "already initialized" in str(e):
                raise InstallError(TOO_LATE) from e
            raise
        _state["allocator"] = allocator
        _state["mode"] = "pluggable"
        _state["oom_mode"] = "raise" if shim_path is not None else "abort"
        _state["shim_path"] = shim_path
        if shim_path is None:
            # Never a NULL pointer to PyTorch (see the module documentation).
            _lib.abort_on_failure(True)
        return allocator


def _oom_count(device: int) -> int:
    try:
        return int(_lib.stats(device).get("num_ooms", 0))
    except (ValueError, RuntimeError):
        return 0


def _oom_class() -> type:
    torch = sys.modules.get("torch")
    base = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if base is None:
        return OutOfMemoryError
    cls = _state.get("oom_class")
    if cls is None:
        cls = type("OutOfMemoryError", (OutOfMemoryError, base), {"__module__": __name__})
        _state["oom_class"] = cls
    return cls


def check_oom(device: Any = None) -> None:
    """Raises :class:`OutOfMemoryError` if cistern failed an allocation since the last check.

    For code that allocates through cistern without raising (``cistern_torch.alloc`` callers
    that checked a pointer, other libraries over ``libcistern.so``); under ``install()`` the
    failing allocation itself raises (or, without the shim, aborts). The message is this
    thread's last cistern error when it is an OOM report (allocations on other threads leave
    theirs on those threads).
    """
    dev = device_index(device)
    seen: Dict[int, int] = _state.setdefault("oom_seen", {})
    count = _oom_count(dev)
    before = seen.get(dev, 0)  # cistern counts OOMs from process start
    seen[dev] = count
    if count > before:
        report = _lib.last_error()
        if "out of memory" not in report and "limit exceeded" not in report:
            report = (
                f"cistern failed {count - before} allocation(s) on device {dev} for lack of "
                "memory (the report is on the thread that allocated; see cistern's log)"
            )
        raise _oom_class()(f"CUDA out of memory. {report}")


def mem_pool(**kwargs: Any) -> Any:
    """A ``torch.cuda.MemPool`` whose segments come from cistern (torch >= 2.5).

    For programs that keep PyTorch's caching allocator and want cistern for some allocations::

        pool = cistern_torch.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            kv_cache = torch.empty(...)   # PyTorch's allocator, segments from cistern

    PyTorch asks cistern for whole segments and frees them through cistern when it releases
    them (``empty_cache`` or the pool's destruction). Keyword arguments go to ``MemPool``
    (``use_on_oom``, ``no_split``, where the torch version has them).

    Sampled call sites are native backtraces in this mode (``python_frames`` is turned off
    for good): PyTorch calls cistern holding its allocator's lock, and reading Python frames
    would take the GIL under it.

    Raises:
        InstallError: cistern is already PyTorch's allocator (``install()`` ran), or torch is
            older than 2.5.
    """
    torch = _torch()
    if "allocator" in _state:
        raise InstallError(
            "mem_pool() is for programs that keep PyTorch's allocator; after "
            "cistern_torch.install() every allocation already comes from cistern"
        )
    pool_cls = getattr(torch.cuda, "MemPool", None)
    if pool_cls is None:
        raise InstallError(f"mem_pool() needs torch >= 2.5 (torch.cuda.MemPool); this is {torch.__version__}")
    _lib.load()
    # PyTorch's caching allocator calls cistern with its device lock held, and reading Python
    # frames takes the GIL: a thread holding the GIL that waits for that lock (freeing a
    # tensor) would deadlock with one sampling a stack. Native backtraces from here on.
    _lib.forbid_python_frames(
        "cistern serves a torch.cuda.MemPool in this process (cistern_torch.mem_pool()), and "
        "PyTorch calls it holding its allocator's lock, which taking the GIL to read frames "
        "could deadlock against; sampled sites stay native backtraces"
    )
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        _lib.loaded_path(), "cistern_malloc", "cistern_free_and_release"
    )
    # Kept alive with the process: PyTorch may free segments through it late.
    _state.setdefault("pool_allocators", []).append(allocator)
    return pool_cls(allocator.allocator(), **kwargs)
