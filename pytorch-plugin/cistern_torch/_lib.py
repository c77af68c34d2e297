"""Low-level ctypes binding of ``libcistern.so``: finding it, loading it, typed calls.

This module owns the C ABI as seen from Python and nothing else: it never imports torch. Every
other module of the package goes through the functions here. Tests use :func:`malloc` and
:func:`free` directly to make allocations without PyTorch.

Where the library comes from, in order:

1. ``CISTERN_LIB=/path/to/libcistern.so`` (developers, tests, the GPU kit);
2. the copy bundled in this package by ``pip install ./pytorch-plugin``
   (``cistern_torch/libcistern*.so``).

The library is loaded once per process, on first use, and kept loaded for the life of the
process: PyTorch holds raw pointers to its functions once :func:`cistern_torch.install` ran.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import json
import os
import threading
from typing import Any, Dict, Iterator, Optional

__all__ = [
    "LibraryNotFoundError",
    "library_path",
    "load",
    "function_address",
    "malloc",
    "free",
    "errors_raised",
    "driver",
    "init",
    "empty_cache",
    "set_memory_fraction",
    "enable_peer_access",
    "record_stream",
    "base_alloc",
    "stats_json",
    "stats",
    "snapshot_json",
    "reset_peak_stats",
    "last_error",
    "version",
    "tag_push",
    "tag_pop",
]

ENV_LIB = "CISTERN_LIB"


class LibraryNotFoundError(ImportError):
    """``libcistern.so`` could not be found or loaded; the message says how to get one."""


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None
#: ``CISTERN_DRIVER`` when the library was loaded (the pool reads it once, on first use).
_driver_env: Optional[str] = None


def _bundled_candidates() -> list:
    here = os.path.dirname(os.path.abspath(__file__))
    # setuptools-rust names it libcistern.abi3.so; a hand-copied one is libcistern.so.
    return sorted(glob.glob(os.path.join(here, "libcistern*.so")))


def library_path() -> Optional[str]:
    """The path :func:`load` would use: ``$CISTERN_LIB``, else the bundled copy, else None.

    A set but wrong ``CISTERN_LIB`` is returned as is (so that loading it fails loudly rather
    than silently falling back to another copy).
    """
    env = os.environ.get(ENV_LIB, "")
    if env:
        # Absolute, so that PyTorch's own dlopen of the same path finds the same library.
        return os.path.abspath(env) if os.path.exists(env) else env
    found = _bundled_candidates()
    return found[0] if found else None


_NOT_FOUND = (
    "libcistern.so not found: set CISTERN_LIB=/path/to/libcistern.so "
    "(build it with `cargo build --release -p cistern-ffi`; it lands in target/release/), "
    "or install the package with `pip install ./pytorch-plugin` from the cistern repository, "
    "which builds and bundles it"
)


def _declare(lib: ctypes.CDLL) -> None:
    """Sets the C signatures of every export (the ABI in ffi/include/cistern.h)."""
    c = ctypes
    sigs = {
        "cistern_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "cistern_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "cistern_free_and_release": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "cistern_abort_on_failure": (c.c_int, [c.c_int]),
        "cistern_init": (None, [c.c_int]),
        "cistern_empty_cache": (None, []),
        "cistern_set_memory_fraction": (None, [c.c_double, c.c_int]),
        "cistern_enable_peer_access": (c.c_int, [c.c_int, c.c_int]),
        "cistern_record_stream": (None, [c.c_void_p, c.c_void_p]),
        "cistern_base_alloc": (c.c_void_p, [c.c_void_p, c.POINTER(c.c_size_t)]),
        "cistern_stats_json": (c.c_size_t, [c.c_int, c.c_void_p, c.c_size_t]),
        "cistern_snapshot_json": (c.c_size_t, [c.c_void_p, c.c_size_t]),
        "cistern_reset_peak_stats": (None, [c.c_int]),
        "cistern_last_error": (c.c_char_p, []),
        "cistern_version": (c.c_char_p, []),
        "cistern_tag_push": (None, [c.c_char_p]),
        "cistern_tag_pop": (None, []),
    }
    missing = []
    for name, (restype, argtypes) in sigs.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    if missing:
        raise LibraryNotFoundError(
            f"{_path} is not a compatible libcistern.so: it lacks {', '.join(missing)} "
            "(rebuild it from the same checkout as this package)"
        )
    # Optional exports, used when present.
    if hasattr(lib, "cistern_get_memory_fraction"):
        lib.cistern_get_memory_fraction.restype = c.c_double
        lib.cistern_get_memory_fraction.argtypes = [c.c_int]
    if hasattr(lib, "cistern_log_errors"):
        lib.cistern_log_errors.restype = c.c_int
        lib.cistern_log_errors.argtypes = [c.c_int]
    if hasattr(lib, "cistern_python_frames"):
        lib.cistern_python_frames.restype = c.c_int
        lib.cistern_python_frames.argtypes = [c.c_int]
    if hasattr(lib, "cistern_ipc_share"):
        lib.cistern_ipc_share.restype = c.c_size_t
        lib.cistern_ipc_share.argtypes = [
            c.c_void_p, c.c_int, c.c_void_p, c.c_size_t, c.POINTER(c.c_uint64),
        ]
        lib.cistern_ipc_open.restype = c.c_void_p
        lib.cistern_ipc_open.argtypes = [c.c_char_p, c.c_size_t, c.c_int]
        lib.cistern_ipc_close.restype = c.c_int
        lib.cistern_ipc_close.argtypes = [c.c_void_p, c.c_int]


def load() -> ctypes.CDLL:
    """Loads ``libcistern.so`` once and returns it.

    Raises:
        LibraryNotFoundError: no library was found, it failed to load, or it lacks an export.
    """
    global _lib, _path, _driver_env
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if path is None:
            raise LibraryNotFoundError(_NOT_FOUND)
        if not os.path.exists(path):
            raise LibraryNotFoundError(f"{ENV_LIB}={path}: no such file. {_NOT_FOUND}")
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryNotFoundError(f"could not load {path}: {e}") from e
        _path = path
        _declare(lib)
        _driver_env = os.environ.get("CISTERN_DRIVER", "")
        _lib = lib
        # Sampled call sites (provenance:stacks) name this process's Python lines, not the
        # interpreter's C frames. Costs nothing until a stack is sampled.
        if os.environ.get("CISTERN_TORCH_PYTHON_FRAMES", "1") != "0" and _python_frames(lib, True):
            # Off before the interpreter finalises: a thread that takes the GIL then (to read
            # its frames) is ended by CPython mid-allocation.
            atexit.register(_python_frames, lib, False)
        return lib


def loaded_path() -> Optional[str]:
    """The path of the loaded library, or None before the first :func:`load`."""
    return _path


def function_address(name: str) -> int:
    """The address of an exported function, as PyTorch's ``set_*_fn`` hooks take it."""
    addr = ctypes.cast(getattr(load(), name), ctypes.c_void_p).value
    if not addr:
        raise LibraryNotFoundError(f"{_path}: {name} resolves to NULL")
    return int(addr)


def driver() -> str:
    """The driver the library's pool uses: ``"sim"`` (the simulated GPU) or ``"cuda"``.

    Read from ``CISTERN_DRIVER`` as it was when the library was loaded (unset or ``auto``:
    the CUDA driver, as the library picks it).
    """
    load()
    return "sim" if _driver_env == "sim" else "cuda"


@contextlib.contextmanager
def errors_raised() -> Iterator[None]:
    """Within it, this thread's failed calls set :func:`last_error` without the library also
    logging it on stderr: for calls whose failure Python raises, so that the message is shown
    once. A library without ``cistern_log_errors`` keeps logging."""
    lib = load()
    if not hasattr(lib, "cistern_log_errors"):
        yield
        return
    previous = lib.cistern_log_errors(0)
    try:
        yield
    finally:
        lib.cistern_log_errors(previous)


# --- the allocator entry points -------------------------------------------------------------


def malloc(size: int, device: int = 0, stream: int = 0) -> int:
    """``cistern_malloc``: returns the device address, 0 on failure (see :func:`last_error`).

    ``stream`` is a ``cudaStream_t`` value (0: the legacy default stream).
    """
    return load().cistern_malloc(size, device, stream or None) or 0


def abort_on_failure(on: bool) -> bool:
    """``cistern_abort_on_failure``: from now on a failed :func:`malloc` prints its report and
    aborts the process instead of returning 0 (``on``), or returns 0 again. Returns the
    previous setting."""
    return bool(load().cistern_abort_on_failure(1 if on else 0))


def free(ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> None:
    """``cistern_free``: frees what :func:`malloc` returned. Bad pointers are counted, not fatal."""
    load().cistern_free(ptr or None, size, device, stream or None)


def init(device_count: int) -> None:
    """``cistern_init``: PyTorch's init hook."""
    load().cistern_init(device_count)


def empty_cache() -> None:
    """``cistern_empty_cache``: returns every cached page to the driver."""
    load().cistern_empty_cache()


def set_memory_fraction(fraction: float, device: int) -> None:
    """``cistern_set_memory_fraction`` (no validation here; see the public setter)."""
    load().cistern_set_memory_fraction(float(fraction), device)


def get_memory_fraction(device: int) -> Optional[float]:
    """The library's fraction for ``device`` when it exports a getter, else None."""
    lib = load()
    if hasattr(lib, "cistern_get_memory_fraction"):
        f = float(lib.cistern_get_memory_fraction(device))
        if f < 0:
            raise ValueError(last_error() or f"cistern_get_memory_fraction({device}) failed")
        return f
    return None


def enable_peer_access(device: int, peer: int) -> None:
    """``cistern_enable_peer_access``: ``peer`` may use every mapping of ``device``.

    Raises:
        ValueError: the library refused (its message: a bad ordinal, or devices that cannot
            reach each other).
    """
    with errors_raised():
        ok = load().cistern_enable_peer_access(device, peer)
    if not ok:
        raise ValueError(last_error())


def record_stream(ptr: int, stream: int) -> None:
    """``cistern_record_stream``: the block must not be reused before ``stream``'s work ends."""
    load().cistern_record_stream(ptr or None, stream or None)


def base_alloc(ptr: int) -> "tuple[int, int]":
    """``cistern_base_alloc``: the base address and size of the block holding ``ptr``."""
    size = ctypes.c_size_t(0)
    base = load().cistern_base_alloc(ptr or None, ctypes.byref(size)) or 0
    return base, size.value


def ipc_share(ptr: int, torch_version: int = 0) -> "tuple[bytes, int]":
    """``cistern_ipc_share``: the live block holding ``ptr`` as PyTorch's shareable handle
    bytes for a receiver running torch ``torch_version`` (``major * 100 + minor``; 0: the
    newest format), and the block's offset in the shared range.

    Raises:
        ValueError: the library refused (its message says why and what to do).
    """
    lib = load()
    offset = ctypes.c_uint64(0)
    with errors_raised():
        need = int(lib.cistern_ipc_share(ptr or None, torch_version, None, 0, ctypes.byref(offset)))
        for _ in range(4):
            if need == 0:
                raise ValueError(last_error())
            buf = ctypes.create_string_buffer(need)
            got = int(lib.cistern_ipc_share(ptr or None, torch_version, buf, need,
                                            ctypes.byref(offset)))
            if 0 < got <= need:
                return buf.raw[:got], offset.value
            need = got
    raise RuntimeError("cistern: the shareable handle kept growing while it was read")


def ipc_open(handle: bytes, device: int = 0) -> int:
    """``cistern_ipc_open``: maps memory another process shared (``handle`` from
    :func:`ipc_share` there, or PyTorch's own); returns the shared range's base.

    Raises:
        ValueError: the library refused (its message says why and what to do).
    """
    with errors_raised():
        base = load().cistern_ipc_open(handle, len(handle), device) or 0
    if not base:
        raise ValueError(last_error())
    return base


def ipc_close(base: int, device: int = 0) -> None:
    """``cistern_ipc_close``: undoes one :func:`ipc_open` of ``base``.

    Raises:
        ValueError: nothing opened starts at ``base``.
    """
    with errors_raised():
        ok = load().cistern_ipc_close(base or None, device)
    if not ok:
        raise ValueError(last_error())


def _read_snprintf(call: Any) -> str:
    """Runs an snprintf-style export (returns the length it needs) until the text fits."""
    need = int(call(None, 0))
    for _ in range(8):
        cap = need + 1
        buf = ctypes.create_string_buffer(cap)
        got = int(call(buf, cap))
        if got < cap:
            return buf.value.decode("utf-8", errors="replace")
        need = got  # the state grew between the two calls: try again with the new length
    raise RuntimeError("cistern: the JSON kept growing while it was read")


def stats_json(device: int = 0) -> str:
    """``cistern_stats_json``: the device's stats as a JSON object (PyTorch key names); ""
    when there are none (see :func:`last_error`; not logged on stderr: callers raise it)."""
    lib = load()
    with errors_raised():
        return _read_snprintf(lambda buf, cap: lib.cistern_stats_json(device, buf, cap))


def stats(device: int = 0) -> Dict[str, Any]:
    """The parsed :func:`stats_json`.

    Raises:
        ValueError: the library wrote no stats for this device (bad device: the message is
            the library's last error).
    """
    text = stats_json(device)
    try:
        value = json.loads(text) if text else None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"cistern_stats_json wrote invalid JSON ({e}): {text[:200]!r}") from e
    if not isinstance(value, dict):
        why = last_error()
        why = why[len("cistern: ") :] if why.startswith("cistern: ") else why
        raise ValueError(f"cistern has no stats for device {device}: {why}")
    return value


def snapshot_json() -> str:
    """``cistern_snapshot_json``: the pool state in PyTorch's snapshot schema, as JSON (""
    on failure, not logged on stderr: callers raise :func:`last_error`)."""
    lib = load()
    with errors_raised():
        return _read_snprintf(lambda buf, cap: lib.cistern_snapshot_json(buf, cap))


def reset_peak_stats(device: int = 0) -> None:
    """``cistern_reset_peak_stats``: sets every peak to its current value."""
    load().cistern_reset_peak_stats(device)


def last_error() -> str:
    """``cistern_last_error``: this thread's last error message ("" when none)."""
    raw = load().cistern_last_error()
    return raw.decode("utf-8", errors="replace") if raw else ""


def version() -> str:
    """``cistern_version``: the library's version string."""
    raw = load().cistern_version()
    return raw.decode("utf-8", errors="replace") if raw else ""


def _python_frames(lib: ctypes.CDLL, on: bool) -> bool:
    fn = getattr(lib, "cistern_python_frames", None)
    return fn is not None and fn(1 if on else 0) == 1


# Why Python frames may not be turned on in this process (None: they may).
_frames_forbidden: Optional[str] = None


def forbid_python_frames(reason: str) -> None:
    """Turns Python frames off for good in this process, for ``reason`` (which
    :func:`python_frames` then raises with)."""
    global _frames_forbidden
    _frames_forbidden = reason
    _python_frames(load(), False)


def python_frames(on: bool) -> bool:
    """``cistern_python_frames``: whether sampled call sites (``provenance:stacks``) are the
    allocating thread's Python frames (on by default once the library is loaded, unless
    ``CISTERN_TORCH_PYTHON_FRAMES=0``) or native backtraces. Returns whether it is on now.

    Raises:
        RuntimeError: ``on`` in a process where they cannot be read safely (after
            ``cistern_torch.mem_pool()``: the message says why).
    """
    if on and _frames_forbidden is not None:
        raise RuntimeError(f"Python frames cannot be turned on: {_frames_forbidden}")
    return _python_frames(load(), on)


def tag_push(tag: str) -> None:
    """``cistern_tag_push``: this thread's allocations carry ``tag`` until the matching pop."""
    load().cistern_tag_push(tag.encode("utf-8"))


def tag_pop() -> None:
    """``cistern_tag_pop``: ends the innermost tag of this thread."""
    load().cistern_tag_pop()
