"""cistern for PyTorch: a CUDA memory allocator written in Rust, as PyTorch's allocator.

Quick start::

    import torch
    import cistern_torch
    cistern_torch.install()          # before any CUDA work

    x = torch.randn(1024, 1024, device="cuda")
    print(cistern_torch.memory_allocated())
    with cistern_torch.tag("optimizer"):
        ...
    cistern_torch.dump_snapshot("snap.pickle")   # opens in PyTorch's memory viewer

Without torch, :func:`alloc` gives device memory (``with cistern_torch.alloc(1 << 20) as a:
a.ptr``) and :func:`check` (``python -m cistern_torch check``) allocates and frees once and says
which driver is in use.

Everything but :func:`install` and :func:`mem_pool` works without torch (ctypes over
``libcistern.so``); importing this package never imports torch. The library is found through
``CISTERN_LIB=/path/to/libcistern.so``, else the copy bundled by ``pip install``.

Layout: ``_lib`` (the C ABI through ctypes), ``_alloc`` (alloc, check), ``_memory`` (stats and
limits), ``_tags``, ``_snapshot``, ``_torch`` (install, mem_pool, OOM) and ``_shim`` (building
the C++ pieces: the native allocator and the OOM shim).
"""

from __future__ import annotations

from . import _lib
from ._alloc import Allocation, alloc, check
from ._lib import LibraryNotFoundError
from ._memory import (
    enable_peer_access,
    empty_cache,
    get_per_process_memory_fraction,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    record_stream,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)
from ._shim import ShimBuildError
from ._oom import record_oom_snapshot
from ._snapshot import dump_snapshot, snapshot
from ._tags import TagHandle, tag, tag_modules
from ._torch import (
    CisternWarning,
    InstallError,
    OutOfMemoryError,
    allocator_mode,
    check_oom,
    install,
    is_installed,
    mem_pool,
    oom_mode,
)

__version__ = "0.1.0"

__all__ = [
    "alloc",
    "Allocation",
    "check",
    "install",
    "is_installed",
    "oom_mode",
    "allocator_mode",
    "mem_pool",
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
    "tag",
    "tag_modules",
    "TagHandle",
    "snapshot",
    "dump_snapshot",
    "check_oom",
    "last_error",
    "version",
    "library_path",
    "OutOfMemoryError",
    "InstallError",
    "CisternWarning",
    "LibraryNotFoundError",
    "ShimBuildError",
]


def last_error() -> str:
    """This thread's last error message from cistern ("" when there was none).

    After a failed allocation it holds cistern's OOM report; after a bad free, what was wrong.
    """
    return _lib.last_error()


def version() -> str:
    """The version string of the loaded ``libcistern.so``."""
    return _lib.version()


def library_path() -> "str | None":
    """The ``libcistern.so`` this package uses (``$CISTERN_LIB``, else the bundled copy)."""
    return _lib.loaded_path() or _lib.library_path()
