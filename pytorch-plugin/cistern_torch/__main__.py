"""``python -m cistern_torch``: ``info`` (library, version, stats) or ``build-shim``.

``build-shim`` compiles the OOM shim for the installed torch ahead of time (e.g. in a container
build), so that ``install()`` finds it in the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the command line; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m cistern_torch")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="library path, version and device 0's stats")
    sub.add_parser("build-shim", help="compile the OOM shim for the installed torch")
    args = p.parse_args(argv)

    import cistern_torch

    if args.cmd == "info":
        try:
            print(f"library: {cistern_torch.library_path()}")
            print(f"version: {cistern_torch.version()}")
            print(json.dumps(cistern_torch.memory_stats(0), indent=1))
        except cistern_torch.LibraryNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        import torch
    except ImportError:
        print("error: build-shim needs torch installed", file=sys.stderr)
        return 1
    from cistern_torch import _shim

    try:
        print(_shim.build_for_torch(torch))
    except _shim.ShimBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
