"""The torch-free public API: alloc() and its Allocation, check() and `python -m cistern_torch
check`, errors shown once, and the bad-device hint of the driver in use (needs libcistern.so)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import cistern_torch
from cistern_torch import _lib

PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _allocated() -> int:
    return int(cistern_torch.memory_stats(0)["allocated_bytes.all.current"])


def test_alloc_gives_a_block_and_frees_it_once(lib: object) -> None:
    before = _allocated()
    a = cistern_torch.alloc(1 << 20)
    assert a.ptr and a.ptr % 512 == 0, a
    assert (a.size, a.device, a.stream) == (1 << 20, 0, 0)
    assert not a.freed
    assert _allocated() == before + (1 << 20)
    invalid = cistern_torch.memory_stats(0).get("num_invalid_frees", 0)
    a.free()
    assert a.freed and _allocated() == before
    a.free()  # a second free is a no-op: never a double free in the library
    assert cistern_torch.memory_stats(0).get("num_invalid_frees", 0) == invalid
    assert "freed" in repr(a)


def test_alloc_as_a_context_manager_frees_at_the_end_even_on_error(lib: object) -> None:
    before = _allocated()
    with cistern_torch.alloc(4096) as a:
        assert _allocated() == before + 4096
        base, size = _lib.base_alloc(a.ptr)
        assert base <= a.ptr and a.ptr + 4096 <= base + size
    assert a.freed and _allocated() == before
    with pytest.raises(KeyError):
        with cistern_torch.alloc(4096) as b:
            raise KeyError("boom")
    assert b.freed and _allocated() == before


def test_a_dropped_allocation_is_freed(lib: object) -> None:
    before = _allocated()
    a = cistern_torch.alloc(8192)
    assert _allocated() == before + 8192
    del a
    assert _allocated() == before


def test_alloc_zero_and_bad_arguments(lib: object) -> None:
    z = cistern_torch.alloc(0)
    assert z.ptr == 0 and z.size == 0
    z.free()
    with pytest.raises(ValueError):
        cistern_torch.alloc(-1)
    with pytest.raises(TypeError):
        cistern_torch.alloc(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cistern_torch.alloc(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cistern_torch.alloc(512, stream=-1)


def test_an_impossible_alloc_raises_out_of_memory_with_the_report(lib: object) -> None:
    with pytest.raises(cistern_torch.OutOfMemoryError) as e:
        cistern_torch.alloc(1 << 50)
    assert "out of memory" in str(e.value) or "limit exceeded" in str(e.value), e.value


def test_a_bad_device_names_what_sets_the_device_count(lib: object) -> None:
    with pytest.raises(ValueError) as e:
        cistern_torch.alloc(512, device=97)
    text = str(e.value)
    assert "invalid device 97" in text, text
    if _lib.driver() == "sim":
        assert "CISTERN_SIM=devices:98" in text and "CUDA_VISIBLE_DEVICES" not in text, text
    else:
        assert "CUDA_VISIBLE_DEVICES" in text and "CISTERN_SIM" not in text, text


def test_check_allocates_frees_and_names_the_driver(lib: object) -> None:
    before = _allocated()
    r = cistern_torch.check(1 << 16)
    assert r["driver"] == _lib.driver()
    assert r["ptr"] and r["size"] == 1 << 16 and r["device"] == 0
    assert r["version"] == cistern_torch.version()
    assert r["stats"]["allocated_bytes.all.current"] == before
    assert r["stats"]["allocated_bytes.all.peak"] >= 1 << 16
    word = "simulated GPU" if _lib.driver() == "sim" else "CUDA"
    assert r["driver_description"].startswith(word), r


def _python(code: str, env: "dict | None" = None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter over this source tree and library, in `env` (default:
    this process's environment)."""
    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = PLUGIN + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_m_check_prints_the_driver(lib: object) -> None:
    p = _python("from cistern_torch.__main__ import main; raise SystemExit(main(['check']))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ok: allocated and freed 1048576 bytes on device 0"), p.stdout
    word = "simulated GPU" if _lib.driver() == "sim" else "CUDA"
    assert f"driver:  {word}" in p.stdout, p.stdout
    assert p.stderr == "", p.stderr


def test_a_bad_device_is_said_once(lib: object) -> None:
    p = _python(
        "from cistern_torch.__main__ import main\n"
        "raise SystemExit(main(['check', '--device', '97']))"
    )
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stderr.count("invalid device 97") == 1, p.stderr


def test_no_driver_is_said_once_in_the_exception_and_not_on_stderr(lib: object) -> None:
    """Without a CUDA driver, the library used to log the error on stderr and Python raised
    it again: the user read it twice."""
    drop = ("LD_LIBRARY_PATH", "CISTERN_FAKECUDA")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["CISTERN_DRIVER"] = "cuda"
    code = """
        import cistern_torch
        for call in (lambda: cistern_torch.memory_stats(0), lambda: cistern_torch.alloc(512)):
            try:
                call()
            except (ValueError, RuntimeError) as e:
                print("raised:", e)
            else:
                print("a driver was found")
    """
    p = _python(code, env)
    if "a driver was found" in p.stdout:
        pytest.skip("this machine has a CUDA driver: no 'no driver' error to see")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("raised:") == 2 and "no CUDA driver" in p.stdout, p.stdout
    assert "no CUDA driver" not in p.stderr, f"said on stderr too: {p.stderr}"
