"""Build script: compiles the `cistern-ffi` crate and ships `libcistern.so` inside the package.

Why setuptools-rust and not maturin: `libcistern.so` is a plain C-ABI ``cdylib`` that Python
loads with ctypes (and PyTorch loads with ``dlopen``). setuptools-rust supports exactly that
with ``Binding.NoBinding``: it runs cargo, finds the artifact from cargo's JSON messages, copies
it into the package and tags the wheel for the platform, with no Python binding in the crate.
maturin's modes do not fit: ``pyo3``/``uniffi`` want bindings compiled into the crate, ``cffi``
generates and requires a cffi module, and ``bin`` ships executables, not libraries.

The crate lives outside this folder (``../ffi``), so ``pip install ./pytorch-plugin`` must run
from a checkout of the whole repository (pip builds local directories in place). Set
``CISTERN_TORCH_SKIP_RUST=1`` to build a pure-Python package without the library (for machines
without a Rust toolchain); it then needs ``CISTERN_LIB=/path/to/libcistern.so`` at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
FFI_MANIFEST = HERE.parent / "ffi" / "Cargo.toml"


def rust_extensions() -> list:
    """The `libcistern` artifact to build, or nothing when the build is skipped."""
    if os.environ.get("CISTERN_TORCH_SKIP_RUST", "") not in ("", "0"):
        return []
    if not FFI_MANIFEST.is_file():
        raise SystemExit(
            f"cistern-torch: {FFI_MANIFEST} not found. Install from a checkout of the cistern "
            "repository (`pip install ./pytorch-plugin` at its root), or set "
            "CISTERN_TORCH_SKIP_RUST=1 and point CISTERN_LIB at a prebuilt libcistern.so."
        )
    from setuptools_rust import Binding, RustExtension, Strip

    return [
        RustExtension(
            # Lands as cistern_torch/libcistern.abi3.so: the loader globs libcistern*.so.
            "cistern_torch.libcistern",
            path=os.path.relpath(FFI_MANIFEST, HERE),
            binding=Binding.NoBinding,
            # The library has no Python ABI dependency at all: one wheel fits every CPython.
            py_limited_api=True,
            strip=Strip.Debug,
        )
    ]


exts = rust_extensions()
setup(
    rust_extensions=exts,
    zip_safe=False,
    options={"bdist_wheel": {"py_limited_api": "cp39"}} if exts else {},
)
