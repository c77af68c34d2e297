"""record_oom_snapshot(): a clear error without torch, and against a fake ``torch`` package on
``sys.path`` that records which PyTorch APIs were called and with what."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest

import cistern_torch
from cistern_torch import _oom, _torch

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)

FAKE_TORCH = {
    "torch/__init__.py": """
        __version__ = "2.5.0+fake"
        CALLS = []
        from . import _C, cuda  # noqa: E402
    """,
    "torch/_C.py": """
        import torch
        OBSERVERS = []
        def _cuda_attach_out_of_memory_observer(f):
            torch.CALLS.append(("_cuda_attach_out_of_memory_observer", f))
            OBSERVERS.append(f)
    """,
    "torch/cuda/__init__.py": """
        from . import memory
    """,
    "torch/cuda/memory.py": """
        import pickle
        import torch
        def _record_memory_history(enabled="all", context="all", stacks="all",
                                   max_entries=2**63, device=None):
            torch.CALLS.append(("_record_memory_history", dict(
                enabled=enabled, context=context, stacks=stacks, max_entries=max_entries)))
        def _dump_snapshot(filename="dump_snapshot.pickle"):
            torch.CALLS.append(("_dump_snapshot", filename))
            with open(filename, "wb") as f:
                pickle.dump({"segments": [], "device_traces": [[{"action": "oom",
                    "device_free": 5, "size": 7, "stream": 0, "time_us": 1}]]}, f)
    """,
}


@pytest.fixture
def fake_torch(tmp_path: Any, monkeypatch: Any) -> Iterator[Any]:
    root = tmp_path / "fake"
    for rel, text in FAKE_TORCH.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    saved = {k: v for k, v in sys.modules.items() if k == "torch" or k.startswith("torch.")}
    for k in saved:
        del sys.modules[k]
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(_oom, "_state", {})
    import torch

    yield torch
    for k in [k for k in sys.modules if k == "torch" or k.startswith("torch.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_without_torch_the_error_says_what_is_needed() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # import torch fails, as when it is not installed
        import cistern_torch
        try:
            cistern_torch.record_oom_snapshot("x.pickle")
        except ImportError as e:
            print("ERR", e)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "needs PyTorch" in out.stdout and "pip install torch" in out.stdout


def test_records_history_attaches_the_observer_and_writes_on_oom(
    fake_torch: Any, tmp_path: Any, capsys: Any
) -> None:
    path = str(tmp_path / "oom.pickle")
    assert cistern_torch.record_oom_snapshot(path, max_entries=1234) == path
    names = [c[0] for c in fake_torch.CALLS]
    assert names == ["_record_memory_history", "_cuda_attach_out_of_memory_observer"]
    assert fake_torch.CALLS[0][1] == {
        "enabled": "all", "context": "all", "stacks": "python", "max_entries": 1234
    }
    assert not os.path.exists(path)  # nothing written before an OOM
    # PyTorch calls the observer before raising OutOfMemoryError.
    (observer,) = fake_torch._C.OBSERVERS
    observer(0, 1 << 30, 5 << 30, 1 << 20)
    assert fake_torch.CALLS[-1][0] == "_dump_snapshot"
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert snap["device_traces"][0][0]["action"] == "oom"
    err = capsys.readouterr().err
    assert f"cistern whatif {path}" in err and "cuda:0" in err
    assert _oom.last_written() == path
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_second_call_changes_the_path_and_attaches_no_second_observer(
    fake_torch: Any, tmp_path: Any
) -> None:
    cistern_torch.record_oom_snapshot(str(tmp_path / "a.pickle"), stacks=False)
    assert fake_torch.CALLS[0][1]["context"] is None
    second = str(tmp_path / "rank{rank}-dev{device}.pickle")
    cistern_torch.record_oom_snapshot(second)
    assert len(fake_torch._C.OBSERVERS) == 1
    os.environ["RANK"] = "3"
    try:
        fake_torch._C.OBSERVERS[0](1, 10, 20, 30)
    finally:
        del os.environ["RANK"]
    assert os.path.exists(tmp_path / "rank3-dev1.pickle")
    assert not os.path.exists(tmp_path / "a.pickle")


def test_a_failing_dump_does_not_mask_the_oom(fake_torch: Any, tmp_path: Any, capsys: Any) -> None:
    cistern_torch.record_oom_snapshot(str(tmp_path / "missing-dir" / "oom.pickle"))
    fake_torch._C.OBSERVERS[0](0, 1, 2, 3)  # must not raise
    assert "could not write the OOM snapshot" in capsys.readouterr().err


def test_old_or_cpu_only_torch_is_named(fake_torch: Any, monkeypatch: Any) -> None:
    monkeypatch.delattr(fake_torch._C, "_cuda_attach_out_of_memory_observer")
    with pytest.raises(RuntimeError, match=r"_cuda_attach_out_of_memory_observer.*2\.1"):
        cistern_torch.record_oom_snapshot("x.pickle")


def test_refused_when_cistern_is_the_allocator(fake_torch: Any, monkeypatch: Any) -> None:
    monkeypatch.setitem(_torch._state, "allocator", object())
    with pytest.raises(RuntimeError, match="dump_snapshot"):
        cistern_torch.record_oom_snapshot("x.pickle")
    assert fake_torch.CALLS == []
