"""Building and loading cistern_torch's C++ pieces, compiled against the installed torch.

* The *native allocator* (``_native.cpp``, with ``_native_json.h``): cistern as PyTorch's own
  ``CUDAAllocator``, so that every ``torch.cuda`` memory API and CUDA graphs' private pools
  work. It needs torch's C++ headers, CUDA's runtime headers (found next to torch: a CUDA
  toolkit, or the copy triton bundles) and ``libtorch_cuda.so``.
* The *OOM shim* (``_shim.cpp``): for the pluggable-allocator fallback, the piece that makes
  an OOM raise. It needs only torch's headers and ``libc10.so``.

See the notes at the top of each C++ file for why they exist. This module compiles it with the
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
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Any, Callable, List, Optional, Sequence

from . import _lib

__all__ = [
    "ShimBuildError", "source_path", "cache_dir", "build", "build_for_torch", "bind",
    "find_cuda_include", "build_native", "build_native_for_torch", "bind_native",
    "NATIVE_FUNCTIONS",
]

#: What ``cistern_torch_bind`` returns; bumped when the shim's exports change.
SHIM_ABI = 1

#: The library's exports the native allocator calls, in the order of its ``Api`` struct.
NATIVE_FUNCTIONS = (
    "cistern_malloc", "cistern_free", "cistern_last_error", "cistern_init",
    "cistern_empty_cache", "cistern_set_memory_fraction", "cistern_record_stream",
    "cistern_base_alloc", "cistern_stats_json", "cistern_snapshot_json",
    "cistern_reset_peak_stats", "cistern_enable_peer_access", "cistern_begin_allocate_to_pool",
    "cistern_end_allocate_to_pool", "cistern_release_pool", "cistern_create_or_incref_pool",
    "cistern_pool_use_count", "cistern_get_memory_fraction", "cistern_last_oom",
    "cistern_set_observer", "cistern_ipc_share", "cistern_ipc_open", "cistern_ipc_close",
    "cistern_set_use_on_oom", "cistern_pool_live_blocks", "cistern_pool_checkpoint",
    "cistern_checkpoint_free", "cistern_pool_restore", "cistern_empty_pool_cache",
    "cistern_cache_info", "cistern_uses_vmm",
)


class ShimBuildError(RuntimeError):
    """The OOM shim could not be built or loaded; the message says why and what to install."""


def source_path(name: str = "_shim.cpp") -> str:
    """A C++ source shipped inside the package (the OOM shim by default)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


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


@functools.lru_cache(maxsize=None)
def _libstdcxx(cxx: str) -> Optional[str]:
    """The shared C++ runtime to link against by path: the compiler's ``libstdc++.so`` (where it
    resolves to a file), else the ``libstdc++.so*`` this process has mapped (torch's). None when
    neither is found (the compiler's default then). Asked once per compiler and process: it is
    part of every build's cache key, so even a cached build would run the compiler for it."""
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    if os.path.isabs(out) and os.path.isfile(out):
        return os.path.realpath(out)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if path.startswith("/") and os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def elf_needed(path: str) -> Optional[List[str]]:
    """The DT_NEEDED entries of the 64-bit ELF shared library at ``path``; None when it is not
    one that can be read so (another platform's format, a truncated file, no dynamic section
    in the section headers): the caller then cannot tell, and checks nothing."""
    import struct

    try:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:
            return None
        end = "<" if data[5] == 1 else ">"
        shoff = struct.unpack_from(end + "Q", data, 0x28)[0]
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, ...)
        sections = [struct.unpack_from(end + "IIQQQQIIQQ", data, shoff + i * shentsize)
                    for i in range(shnum)]
        dynamic = [sec for sec in sections if sec[1] == 6]  # SHT_DYNAMIC
        if not dynamic:
            return None
        sec = dynamic[0]
        strtab = sections[sec[6]][4]
        needed: List[str] = []
        for off in range(sec[4], sec[4] + sec[5], 16):
            tag, val = struct.unpack_from(end + "qQ", data, off)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strtab + val
                needed.append(data[start:data.index(b"\0", start)].decode(errors="replace"))
        return needed
    except (OSError, struct.error, IndexError, ValueError):
        return None


def build(
    torch_include: str,
    torch_lib: str,
    cxx11_abi: bool,
    tag: str,
    extra_flags: Sequence[str] = (),
) -> str:
    """Compiles the OOM shim (or reuses the cached build) and returns the path of the ``.so``.

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
    if not os.path.isfile(os.path.join(torch_include, "c10", "util", "Exception.h")):
        raise ShimBuildError(f"torch's C++ headers are missing ({torch_include}/c10/util)")
    return _compile(
        "cistern_torch_shim", [source_path()], ["-I", torch_include], torch_lib, ["c10"],
        cxx11_abi, tag, extra_flags,
    )


def _compile(
    stem: str,
    sources: Sequence[str],
    includes: Sequence[str],
    torch_lib: str,
    libs: Sequence[str],
    cxx11_abi: bool,
    tag: str,
    extra_flags: Sequence[str],
    late_includes: Optional[Callable[[], List[str]]] = None,
) -> str:
    """Compiles ``sources[0]`` (the others are headers it includes, part of the cache key)
    into ``<cache>/<stem>-<key>.so``, linked against ``libs`` in ``torch_lib``.
    ``late_includes`` gives more include flags, asked for only when nothing is cached (and not
    part of the key: they name where the same headers are)."""
    cxx = _compiler()
    flags: List[str] = list(extra_flags) + os.environ.get("CISTERN_TORCH_CXXFLAGS", "").split()
    # The C++ runtime by path, as a shared library: a compiler that would link it statically
    # (-static-libstdc++ in its specs, its flags or CXX; no libstdc++.so beside it) puts a
    # second libstdc++ in a process that already has torch's, and the first stream written
    # through it crashes (found on a GPU: every OOM message segfaulted). Named in the cache key
    # so that such a build is never reused.
    runtime = _libstdcxx(cxx)
    parts = []
    for src in sources:
        with open(src, "rb") as f:
            parts.append(f.read())
    key = hashlib.sha256(
        b"\0".join(
            parts + [tag.encode(), " ".join(includes).encode(), str(int(cxx11_abi)).encode(),
                     cxx.encode(), " ".join(flags).encode(), " ".join(libs).encode(),
                     b"runtime:" + (runtime or "default").encode()]
        )
    ).hexdigest()[:20]
    out_dir = cache_dir()
    out = os.path.join(out_dir, f"{stem}-{key}.so")
    if os.path.isfile(out):
        return out
    includes = list(includes) + (late_includes() if late_includes else [])
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ShimBuildError(f"cannot write the build cache {out_dir}: {e} (set CISTERN_TORCH_CACHE)") from e
    errors = []
    # torch's headers need C++17; newer ones (2.10 on) want C++20: try both.
    for std in ("c++17", "c++20"):
        try:
            fd, tmp = tempfile.mkstemp(prefix=".shim-", suffix=".so", dir=out_dir)
        except OSError as e:
            raise ShimBuildError(
                f"cannot write the build cache {out_dir}: {e} (set CISTERN_TORCH_CACHE)"
            ) from e
        os.close(fd)
        cmd = [
            cxx, f"-std={std}", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
            *includes, *flags, sources[0], "-o", tmp,
            "-L", torch_lib, *[f"-l{lib}" for lib in libs], *([runtime] if runtime else []),
            f"-Wl,-rpath,{torch_lib}",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            raise ShimBuildError(f"running {cxx} failed: {e}") from e
        if proc.returncode == 0:
            needed = elf_needed(tmp)
            if needed is not None and not any(n.startswith(("libstdc++", "libc++")) for n in needed):
                os.unlink(tmp)
                raise ShimBuildError(
                    f"{cxx} linked the C++ runtime into {os.path.basename(out)} statically "
                    f"(it needs only {', '.join(needed)}): a second libstdc++ beside torch's "
                    "crashes the process. Fix: install the compiler's shared libstdc++ "
                    "(libstdc++-dev), or drop -static-libstdc++ from CXX and "
                    "CISTERN_TORCH_CXXFLAGS"
                )
            os.replace(tmp, out)  # atomic: concurrent installs never see half a file
            return out
        os.unlink(tmp)
        errors.append(f"-std={std}: " + (proc.stderr or proc.stdout).strip()[-1500:])
    raise ShimBuildError(f"compiling {os.path.basename(sources[0])} failed:\n" + "\n".join(errors))


def build_for_torch(torch: object) -> str:
    """:func:`build` for an imported torch module."""
    root = os.path.dirname(os.path.abspath(getattr(torch, "__file__")))
    abi = bool(getattr(torch, "compiled_with_cxx11_abi", lambda: True)())
    return build(os.path.join(root, "include"), os.path.join(root, "lib"), abi, torch_tag(root))


def _load(path: str, symbol: str, what: str) -> "tuple[ctypes.CDLL, Any]":
    """Loads a built library and its bind function, or says why not."""
    try:
        lib = ctypes.CDLL(path)
        return lib, getattr(lib, symbol)
    except (OSError, AttributeError) as e:
        raise ShimBuildError(f"could not load {what} {path}: {e}") from e


def bind(shim_path: str) -> ctypes.CDLL:
    """Loads a built shim and points it at the loaded ``libcistern.so``.

    Must run before PyTorch first calls ``cistern_torch_malloc``. The returned handle must stay
    alive (the caller keeps it for the life of the process).

    Raises:
        ShimBuildError: the shim does not load, or is from another version of this package.
    """
    shim, fn = _load(shim_path, "cistern_torch_bind", "the OOM shim")
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


def _has_cuda_headers(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) and os.path.isfile(
        os.path.join(d, "crt", "host_defines.h")
    )


def find_cuda_include(torch_root: str) -> Optional[str]:
    """A directory with CUDA's runtime headers (``cuda_runtime_api.h`` and the
    ``crt/host_defines.h`` it includes), which torch's CUDA headers need.

    Looked for in ``CISTERN_TORCH_CUDA_INCLUDE``, ``CUDA_HOME`` / ``CUDA_PATH``,
    ``/usr/local/cuda``, then beside torch (``torch_root``'s parent, the site-packages): the
    headers triton bundles (triton is a dependency of torch on Linux), and NVIDIA's wheels.
    The runtime wheel alone lacks ``crt/``, so it counts only when ``nvidia-cuda-crt`` (or
    nvcc's wheel) is installed too. ``None`` when none is found.
    """
    env = os.environ.get("CISTERN_TORCH_CUDA_INCLUDE")
    if env:
        return env if _has_cuda_headers(env) else None
    site = os.path.dirname(os.path.abspath(torch_root))
    candidates = [
        os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH")
        if os.environ.get(v)
    ]
    candidates += [
        "/usr/local/cuda/include",
        os.path.join(site, "triton", "backends", "nvidia", "include"),
        os.path.join(site, "nvidia", "cu13", "include"),
        os.path.join(site, "nvidia", "cuda_runtime", "include"),
        os.path.join(site, "nvidia", "cuda_nvcc", "include"),
    ]
    for d in candidates:
        if _has_cuda_headers(d):
            return d
    return None


def torch_tag(torch_root: str) -> str:
    """How a torch build is named in the cache key: its version (read from
    ``torch/version.py``, without importing it) and location. ``install()`` and ``build-shim``
    name it the same way, so a prebuilt library is found."""
    version = "?"
    try:
        with open(os.path.join(torch_root, "version.py"), encoding="utf-8") as f:
            for line in f:
                if line.startswith("__version__"):
                    version = line.split("=", 1)[1].strip().strip("'\"")
                    break
    except OSError:
        pass
    return f"{version}@{os.path.abspath(torch_root)}"


def build_native(
    torch_root: str,
    cxx11_abi: bool,
    tag: str,
    cuda_include: Optional[str] = None,
    extra_flags: Sequence[str] = (),
) -> str:
    """Compiles the native allocator (``_native.cpp``) against the torch at ``torch_root``
    (or reuses the cached build) and returns the path of the ``.so``.

    Links ``libc10``, ``libc10_cuda`` and ``libtorch_cuda`` from ``<torch_root>/lib`` when they
    are there (a test against an unpacked wheel's headers may leave them out: the library then
    resolves those symbols from the torch already loaded).

    Raises:
        ShimBuildError: no compiler, no torch headers, no CUDA headers (the message says where
            they were looked for and how to name them), or the compiler failed.
    """
    include = os.path.join(torch_root, "include")
    header = os.path.join(include, "torch", "csrc", "cuda", "CUDAPluggableAllocator.h")
    if not os.path.isfile(header):
        raise ShimBuildError(
            f"torch's CUDA allocator header is missing ({header}): the native allocator needs a "
            "CUDA build of torch"
        )
    def cuda_flags() -> List[str]:
        # Looked for only when there is something to build: a library prebuilt where the
        # headers were (build-shim in a builder image) is found without them.
        cuda = cuda_include or find_cuda_include(torch_root)
        if cuda is None or not _has_cuda_headers(cuda):
            raise ShimBuildError(
                "no CUDA runtime headers (cuda_runtime_api.h with crt/host_defines.h) were found "
                "in CISTERN_TORCH_CUDA_INCLUDE, CUDA_HOME, /usr/local/cuda, triton's bundled "
                "headers or NVIDIA's wheels: install a CUDA toolkit or `pip install "
                "nvidia-cuda-crt`, or set CISTERN_TORCH_CUDA_INCLUDE to a directory that has them"
            )
        return ["-I", cuda]

    lib = os.path.join(torch_root, "lib")
    libs = [n for n in ("c10", "c10_cuda", "torch_cuda")
            if os.path.isfile(os.path.join(lib, f"lib{n}.so"))]
    if "c10" not in libs:
        raise ShimBuildError(f"torch's libc10.so is missing ({lib})")
    api = os.path.join(include, "torch", "csrc", "api", "include")
    return _compile(
        "cistern_torch_native",
        [source_path("_native.cpp"), source_path("_native_json.h"),
         source_path("_native_history.h")],
        ["-I", include, "-I", api], lib, libs, cxx11_abi, tag, extra_flags,
        late_includes=cuda_flags,
    )


def build_native_for_torch(torch: object) -> str:
    """:func:`build_native` for an imported torch module."""
    where = getattr(torch, "__file__", None)
    if not where:
        raise ShimBuildError("this torch module has no location (__file__) to build against")
    root = os.path.dirname(os.path.abspath(where))
    abi = bool(getattr(torch, "compiled_with_cxx11_abi", lambda: True)())
    return build_native(root, abi, torch_tag(root))


def bind_native(path: str) -> ctypes.CDLL:
    """Loads a built native allocator and points it at the loaded ``libcistern.so``.

    Torch (with its CUDA library) must be imported first. The returned handle must stay alive
    for the life of the process.

    Raises:
        ShimBuildError: it does not load, or is from another version of this package.
    """
    lib, fn = _load(path, "cistern_torch_native_bind", "the native allocator")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    try:
        addrs = (ctypes.c_void_p * len(NATIVE_FUNCTIONS))(
            *[_lib.function_address(n) for n in NATIVE_FUNCTIONS]
        )
    except (AttributeError, _lib.LibraryNotFoundError) as e:
        raise ShimBuildError(
            f"the loaded libcistern.so ({_lib.loaded_path()}) lacks a function the native "
            f"allocator needs ({e}): rebuild it from the same checkout as this package"
        ) from e
    got = fn(addrs, len(NATIVE_FUNCTIONS))
    if got == 1:
        return lib
    if got <= -len(NATIVE_FUNCTIONS) or got == 0:
        why = (f"it expects {-got} functions and this package gives {len(NATIVE_FUNCTIONS)}: a "
               "stale build (remove it from the cache)")
    else:
        why = f"function {-got - 1} ({NATIVE_FUNCTIONS[-got - 1]}) was NULL"
    raise ShimBuildError(f"{path} refused the library's functions: {why}")


def install_native(lib: ctypes.CDLL) -> None:
    """Makes the bound native allocator PyTorch's current allocator.

    Raises:
        RuntimeError: PyTorch refused (its message, e.g. CUDA already initialised).
    """
    fn = lib.cistern_torch_native_install
    fn.restype = ctypes.c_int
    err = lib.cistern_torch_native_error
    err.restype = ctypes.c_char_p
    if fn() != 1:
        raise RuntimeError((err() or b"").decode(errors="replace"))


def cxx11_abi_of(torch_root: str) -> bool:
    """Whether the torch at ``torch_root`` was built with the C++11 ABI, read off its
    ``libc10.so`` without importing it: how ``c10::Error(SourceLocation, std::string)`` is
    mangled (``std::__cxx11::basic_string`` or the old ``Ss``). Other ``__cxx11`` symbols do
    not tell: libstdc++ parts are linked in statically either way."""
    with open(os.path.join(torch_root, "lib", "libc10.so"), "rb") as f:
        data = f.read()
    if b"_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx11" in data:
        return True
    if b"_ZN3c105ErrorC1ENS_14SourceLocationESs" in data:
        return False
    return True


def find_unpacked_torch(root: Optional[str]) -> Optional[str]:
    """``root`` if it looks like an unpacked torch package (include/ and lib/libc10.so)."""
    if root and os.path.isfile(os.path.join(root, "lib", "libc10.so")) and os.path.isdir(
        os.path.join(root, "include", "c10")
    ):
        return root
    return None
