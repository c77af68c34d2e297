"""Building and loading the OOM shim (``_shim.cpp``): the piece that makes an OOM raise.

See the note at the top of ``_shim.cpp`` for why it exists. This module compiles it with the
system C++ compiler against the headers of the installed torch (``<torch>/include``, shipped in
every torch wheel) and links it against ``<torch>/lib/libc10.so``. Builds are cached per
(shim source, torch version and location, C++ ABI, compiler) under
``$CISTERN_TORCH_CACHE`` (default ``$XDG_CACHE_HOME/cistern_torch`` or
``~/.cache/cistern_torch``), so only the first ``install()`` on a machine pays the ~1-2 s.

Everything here takes the torch location as arguments, so tests can build the shim against an
unpacked torch wheel without importing torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import List, Optional, Sequence

from . import _lib

__all__ = ["ShimBuildError", "source_path", "cache_dir", "build", "build_for_torch", "bind"]

#: What ``cistern_torch_bind`` returns; bumped when the shim's exports change.
SHIM_ABI = 1


class ShimBuildError(RuntimeError):
    """The OOM shim could not be built or loaded; the message says why and what to install."""


def source_path() -> str:
    """The shim's C++ source, shipped inside the package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim.cpp")


def cache_dir() -> str:
    """Where built shims are kept."""
    env = os.environ.get("CISTERN_TORCH_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cistern_torch")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise ShimBuildError(
            f"no C++ compiler (`{cxx}` is not on PATH): install one (e.g. `apt-get install g++`) "
            "or set CXX"
        )
    return cxx


def build(
    torch_include: str,
    torch_lib: str,
    cxx11_abi: bool,
    tag: str,
    extra_flags: Sequence[str] = (),
) -> str:
    """Compiles the shim (or reuses the cached build) and returns the path of the ``.so``.

    Args:
        torch_include: ``<torch>/include`` (holds ``c10/util/Exception.h``).
        torch_lib: ``<torch>/lib`` (holds ``libc10.so``).
        cxx11_abi: torch's ``_GLIBCXX_USE_CXX11_ABI`` (``torch.compiled_with_cxx11_abi()``).
        tag: identifies the torch build in the cache key (its version and location).
        extra_flags: more compiler flags (``CISTERN_TORCH_CXXFLAGS`` adds to these).

    Raises:
        ShimBuildError: no compiler, no torch headers, or the compiler failed (its output is
            in the message).
    """
    src = source_path()
    if not os.path.isfile(os.path.join(torch_include, "c10", "util", "Exception.h")):
        raise ShimBuildError(f"torch's C++ headers are missing ({torch_include}/c10/util)")
    cxx = _compiler()
    flags: List[str] = list(extra_flags) + os.environ.get("CISTERN_TORCH_CXXFLAGS", "").split()
    with open(src, "rb") as f:
        source = f.read()
    key = hashlib.sha256(
        b"\0".join(
            [source, tag.encode(), torch_include.encode(), str(int(cxx11_abi)).encode(),
             cxx.encode(), " ".join(flags).encode()]
        )
    ).hexdigest()[:20]
    out_dir = cache_dir()
    out = os.path.join(out_dir, f"cistern_torch_shim-{key}.so")
    if os.path.isfile(out):
        return out
    os.makedirs(out_dir, exist_ok=True)
    errors = []
    # torch's headers need C++17; newer ones may want C++20: try both.
    for std in ("c++17", "c++20"):
        fd, tmp = tempfile.mkstemp(prefix=".shim-", suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [
            cxx, f"-std={std}", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
            "-I", torch_include, *flags, src, "-o", tmp,
            "-L", torch_lib, "-lc10", f"-Wl,-rpath,{torch_lib}",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            raise ShimBuildError(f"running {cxx} failed: {e}") from e
        if proc.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent installs never see half a file
            return out
        os.unlink(tmp)
        errors.append(f"-std={std}: " + (proc.stderr or proc.stdout).strip()[-1500:])
    raise ShimBuildError("compiling the OOM shim failed:\n" + "\n".join(errors))


def build_for_torch(torch: object) -> str:
    """:func:`build` for an imported torch module."""
    root = os.path.dirname(os.path.abspath(getattr(torch, "__file__")))
    abi = bool(getattr(torch, "compiled_with_cxx11_abi", lambda: True)())
    version = str(getattr(torch, "__version__", "?"))
    return build(os.path.join(root, "include"), os.path.join(root, "lib"), abi, f"{version}@{root}")


def bind(shim_path: str) -> ctypes.CDLL:
    """Loads a built shim and points it at the loaded ``libcistern.so``.

    Must run before PyTorch first calls ``cistern_torch_malloc``. The returned handle must stay
    alive (the caller keeps it for the life of the process).

    Raises:
        ShimBuildError: the shim does not load, or is from another version of this package.
    """
    try:
        shim = ctypes.CDLL(shim_path)
        fn = shim.cistern_torch_bind
    except (OSError, AttributeError) as e:
        raise ShimBuildError(f"could not load the OOM shim {shim_path}: {e}") from e
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    got = fn(
        _lib.function_address("cistern_malloc"),
        _lib.function_address("cistern_free"),
        _lib.function_address("cistern_last_error"),
    )
    if got != SHIM_ABI:
        raise ShimBuildError(f"{shim_path} speaks shim ABI {got}, this package {SHIM_ABI}")
    return shim


def find_unpacked_torch(root: Optional[str]) -> Optional[str]:
    """``root`` if it looks like an unpacked torch package (include/ and lib/libc10.so)."""
    if root and os.path.isfile(os.path.join(root, "lib", "libc10.so")) and os.path.isdir(
        os.path.join(root, "include", "c10")
    ):
        return root
    return None
