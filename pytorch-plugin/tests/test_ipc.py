"""Sharing memory with another process through the C ABI (``cistern_ipc_share``, ``_open``,
``_close``), driven through ctypes: the calls under the native allocator's ``shareIpcHandle`` /
``getIpcDevPtr`` (those C++ overrides are compiled by test_native.py and run only with torch on a
GPU: ``scripts/gpu/torch_checks.py ipc``).

On the simulated GPU (one process's memory) only the sender's side is checked. Over the fake
libcuda (``scripts/test.sh``'s second run), a sender process started by this one shares blocks
and this process opens them: the fake's ``cisternFakeOrigin`` says that each opened pointer is
the sender's memory at the sender's offset. The receiver is the sender's parent, as
``pidfd_getfd`` allows under Yama's ``ptrace_scope`` 1.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from typing import Tuple

import pytest

from cistern_torch import _lib

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def _over_fake() -> bool:
    return _lib.driver() == "cuda" and os.environ.get("CISTERN_FAKECUDA") == "1"


def test_a_block_is_shared_in_pytorchs_format(lib: object, allocs: object) -> None:
    p = allocs.malloc(3 * MIB)
    for version, byte in ((205, 1), (212, 1), (213, 3), (0, 3)):
        handle, offset = _lib.ipc_share(p + 4096, version)
        assert handle[0] == byte, (version, handle[:2])
        assert handle[1:2] in (b"e", b"v", b"c"), handle[:2]
        assert offset >= 4096
    # The same pointer gives the same bytes (PyTorch's receivers cache by them).
    assert _lib.ipc_share(p, 0) == _lib.ipc_share(p, 0)


def test_sharing_what_is_not_live_is_a_clear_error(lib: object, allocs: object) -> None:
    p = allocs.malloc(MIB)
    allocs.free(p)
    with pytest.raises(ValueError, match="not inside a live block|not memory of this pool"):
        _lib.ipc_share(p)
    with pytest.raises(ValueError, match="not a shareable handle"):
        _lib.ipc_open(b"\x01z-garbage")
    with pytest.raises(ValueError, match="nothing opened"):
        _lib.ipc_close(0x1000)


def test_this_processs_own_memory_opens_at_a_second_address(lib: object, allocs: object) -> None:
    p = allocs.malloc(5 * MIB)
    handle, offset = _lib.ipc_share(p)
    base = _lib.ipc_open(handle)
    assert base and base + offset != p
    assert _lib.ipc_open(handle) == base
    _lib.ipc_close(base)
    _lib.ipc_close(base)
    with pytest.raises(ValueError, match="nothing opened"):
        _lib.ipc_close(base)


SENDER = """
    import ctypes, sys
    sys.path.insert(0, {root!r})
    from cistern_torch import _lib
    cuda = ctypes.CDLL("libcuda.so.1")
    def origin(p):
        a = [ctypes.c_ulonglong(0) for _ in range(3)]
        assert cuda.cisternFakeOrigin(ctypes.c_ulonglong(p), *map(ctypes.byref, a)) == 0
        return [x.value for x in a]
    MIB = 1 << 20
    for size in (4096, 3 * MIB, 30 * MIB, 100 * MIB):
        p = _lib.malloc(size)
        assert p, _lib.last_error()
        for at in (p, p + size // 2):
            handle, offset = _lib.ipc_share(at, {version})
            print("SHARE", handle.hex(), offset, *origin(at), flush=True)
    print("READY", flush=True)
    assert sys.stdin.readline().strip() == "DONE"
"""


def _origin(ptr: int) -> Tuple[int, int, int]:
    cuda = ctypes.CDLL("libcuda.so.1")
    out = [ctypes.c_ulonglong(0) for _ in range(3)]
    rc = cuda.cisternFakeOrigin(ctypes.c_ulonglong(ptr), *map(ctypes.byref, out))
    assert rc == 0, f"cisternFakeOrigin({ptr:#x}) = {rc}"
    return out[0].value, out[1].value, out[2].value


@pytest.mark.parametrize("version", [205, 215])
def test_another_process_opens_the_senders_memory(lib: object, version: int) -> None:
    if not _over_fake():
        pytest.skip("two processes share memory over the fake libcuda (scripts/test.sh's "
                    "second run) or a GPU, not on the simulated GPU")
    code = textwrap.dedent(SENDER).format(root=os.path.dirname(HERE), version=version)
    sender = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    try:
        shares = []
        assert sender.stdout is not None
        for line in sender.stdout:
            if line.startswith("READY"):
                break
            if line.startswith("SHARE "):
                _, h, off, pid, alloc, at = line.split()
                shares.append((bytes.fromhex(h), int(off), (int(pid), int(alloc), int(at))))
        assert len(shares) == 8, sender.stderr.read() if sender.stderr else ""
        bases = []
        for handle, offset, sent in shares:
            base = _lib.ipc_open(handle)
            assert _origin(base + offset) == sent, (handle[:2], offset)
            bases.append(base)
        for base in bases:
            _lib.ipc_close(base)
        with pytest.raises(ValueError):
            _lib.ipc_close(bases[0])
    finally:
        if sender.stdin is not None:
            sender.stdin.write("DONE\n")
            sender.stdin.close()
        rc = sender.wait(timeout=60)
    assert rc == 0, sender.stderr.read() if sender.stderr else rc
