"""Shared fixtures: the library (found through CISTERN_LIB), and allocations freed at teardown.

Run: ``CISTERN_LIB=target/release/libcistern.so CISTERN_DRIVER=sim python -m pytest pytorch-plugin/tests``

``CISTERN_DRIVER`` defaults to ``sim`` here (the simulated GPU, no CUDA needed); set
``CISTERN_DRIVER=cuda`` to run the same tests against a real GPU. Tests that need the library
skip, with the reason, when ``CISTERN_LIB`` is unset and no bundled copy exists; tests that need
torch or a GPU skip likewise.
"""

from __future__ import annotations

import os
import sys
from typing import Iterator, List, Tuple

import pytest

# Before the library is loaded: it reads these once.
os.environ.setdefault("CISTERN_DRIVER", "sim")

# The installed package when there is one (it bundles the library), else this source tree.
try:
    import cistern_torch  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cistern_torch import _lib  # noqa: E402

NO_LIB = (
    "libcistern.so not found: set CISTERN_LIB=/path/to/libcistern.so "
    "(cargo build --release -p cistern-ffi) or pip install ./pytorch-plugin"
)


@pytest.fixture(scope="session")
def lib() -> object:
    """The loaded library; skips the test when there is none."""
    if _lib.library_path() is None:
        pytest.skip(NO_LIB)
    return _lib.load()


class Allocs:
    """Allocations through the ctypes binding, freed when the test ends."""

    def __init__(self) -> None:
        self.live: List[Tuple[int, int]] = []

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        ptr = _lib.malloc(size, device, stream)
        assert ptr, f"cistern_malloc({size}) failed: {_lib.last_error()}"
        self.live.append((ptr, size))
        return ptr

    def free(self, ptr: int) -> None:
        for i, (p, size) in enumerate(self.live):
            if p == ptr:
                del self.live[i]
                _lib.free(p, size, 0, 0)
                return
        raise AssertionError(f"{ptr:#x} is not live")

    def free_all(self) -> None:
        while self.live:
            p, size = self.live.pop()
            _lib.free(p, size, 0, 0)


@pytest.fixture
def allocs(lib: object) -> Iterator[Allocs]:
    """Allocate through ``allocs.malloc``; whatever is left is freed after the test."""
    a = Allocs()
    try:
        yield a
    finally:
        a.free_all()
