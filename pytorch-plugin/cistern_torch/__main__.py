"""``python -m cistern_torch``: ``check`` (allocate and free once, say which driver is used),
``info`` (library, version, stats) or ``build-shim``.

``check`` is the first thing to run on a new machine: it needs no torch, and it fails with the
one message that says what to fix (no library, no driver, a bad device or setting).
``build-shim`` compiles the native allocator and the OOM shim ahead of time (e.g. in a container
build), so that ``install()`` finds them in the cache: for the installed torch, or with
``--torch-root DIR`` for a torch package on disk, without importing it. It prints one line per
part built (``native PATH``, ``shim PATH``) and exits 0, or says what failed and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

#: The stats ``check`` prints (all of them with ``--json``).
CHECK_STATS = [
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "num_device_alloc",
    "num_ooms",
]


def _fail(e: BaseException) -> int:
    # cistern's messages name cistern already.
    text = str(e)
    print(text if text.startswith("cistern") else f"cistern: {text}", file=sys.stderr)
    return 1


def _print_check(r: Dict[str, Any]) -> None:
    print(f"ok: allocated and freed {r['size']} bytes on device {r['device']} at {r['ptr']:#x}")
    print(f"driver:  {r['driver_description']}")
    print(f"library: {r['library']} (version {r['version']})")
    for key in CHECK_STATS:
        if key in r["stats"]:
            print(f"  {key}: {r['stats'][key]}")


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the command line; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m cistern_torch")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser(
        "check", help="allocate and free once; print the driver used (simulated or CUDA)"
    )
    c.add_argument("--device", type=int, default=0, help="device ordinal (default 0)")
    c.add_argument("--bytes", type=int, default=1 << 20, help="bytes to allocate (default 1 MiB)")
    c.add_argument("--json", action="store_true", help="print one JSON object, with every stat")
    sub.add_parser("info", help="library path, version and device 0's stats")
    b = sub.add_parser(
        "build-shim", help="compile the native allocator and the OOM shim for a torch"
    )
    b.add_argument("--torch-root", metavar="DIR",
                   help="a torch package directory (holds include/ and lib/); not imported")
    b.add_argument("--cuda-include", metavar="DIR",
                   help="CUDA's runtime headers (default: found beside torch, or in CUDA_HOME)")
    b.add_argument("--shim-only", action="store_true",
                   help="only the OOM shim (for the pluggable-allocator fallback)")
    args = p.parse_args(argv)

    import cistern_torch

    if args.cmd == "check":
        try:
            report = cistern_torch.check(args.bytes, args.device)
        except (cistern_torch.LibraryNotFoundError, RuntimeError, ValueError, TypeError) as e:
            return _fail(e)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print_check(report)
        return 0
    if args.cmd == "info":
        try:
            print(f"library: {cistern_torch.library_path()}")
            print(f"version: {cistern_torch.version()}")
            print(json.dumps(cistern_torch.memory_stats(0), indent=1))
        except (cistern_torch.LibraryNotFoundError, RuntimeError, ValueError) as e:
            return _fail(e)
        return 0
    return _build_shim(args.torch_root, args.cuda_include, args.shim_only)


def _build_shim(torch_root: Optional[str], cuda_include: Optional[str], shim_only: bool) -> int:
    import os

    from cistern_torch import _shim

    if torch_root:
        root = _shim.find_unpacked_torch(torch_root)
        if root is None:
            print(f"error: {torch_root} is not a torch package (no include/c10 and "
                  "lib/libc10.so)", file=sys.stderr)
            return 1
        abi = _shim.cxx11_abi_of(root)
        tag = _shim.torch_tag(root)
    else:
        try:
            import torch
        except ImportError:
            print("error: build-shim needs torch installed, or --torch-root DIR",
                  file=sys.stderr)
            return 1
        root = os.path.dirname(os.path.abspath(torch.__file__))
        abi = bool(torch.compiled_with_cxx11_abi())
        tag = _shim.torch_tag(root)
    try:
        if not shim_only:
            print(f"native {_shim.build_native(root, abi, tag, cuda_include=cuda_include)}")
        inc, lib = os.path.join(root, "include"), os.path.join(root, "lib")
        print(f"shim {_shim.build(inc, lib, abi, tag)}")
    except _shim.ShimBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
