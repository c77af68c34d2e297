"""install(), mem_pool() and the OOM shim.

Three layers, so that most of it runs without a GPU:

- a fake ``torch`` module checks install()'s logic (hooks, the too-late error, idempotence);
- the shim is compiled against real torch headers (the installed torch, or an unpacked torch
  wheel named by ``CISTERN_TORCH_TORCH_DIR``) and a C++ harness checks that a failed allocation
  throws ``c10::OutOfMemoryError`` carrying cistern's report;
- with torch and a GPU, subprocesses install cistern for real (install() is process-wide).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import types
from typing import Any, Dict, List

import pytest

import cistern_torch
from cistern_torch import _lib, _shim, _torch

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)


def test_import_does_not_import_torch() -> None:
    code = "import sys, cistern_torch; assert 'torch' not in sys.modules, 'torch imported'"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --- install() against a fake torch -----------------------------------------------------------


class FakeRawAllocator:
    def __init__(self) -> None:
        self.hooks: Dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("set_") and name.endswith("_fn"):
            return lambda addr: self.hooks.__setitem__(name, addr)
        raise AttributeError(name)


class FakePluggable:
    def __init__(self, path: str, alloc: str, free: str) -> None:
        self.args = (path, alloc, free)
        self.raw = FakeRawAllocator()

    def allocator(self) -> FakeRawAllocator:
        return self.raw


def make_fake_torch(initialized: bool = False) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0"  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(cuda="12.8")  # type: ignore[attr-defined]
    swapped: List[Any] = []

    def change(allocator: Any) -> None:
        if initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        swapped.append(allocator)

    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_initialized=lambda: initialized,
        memory=types.SimpleNamespace(CUDAPluggableAllocator=FakePluggable, change_current_allocator=change),
        swapped=swapped,
    )
    return torch


@pytest.fixture
def fake_env(monkeypatch: pytest.MonkeyPatch):
    """A fake torch, a fake library (addresses only) and a clean install state."""
    addrs = {name: 0x1000 + 16 * i for i, name in enumerate(
        ["cistern_init", "cistern_empty_cache", "cistern_set_memory_fraction",
         "cistern_record_stream", "cistern_base_alloc", "cistern_malloc", "cistern_free",
         "cistern_last_error"])}
    monkeypatch.setattr(_lib, "load", lambda: None)
    monkeypatch.setattr(_lib, "loaded_path", lambda: "/opt/libcistern.so")
    monkeypatch.setattr(_lib, "function_address", lambda n: addrs[n])
    monkeypatch.setattr(_torch, "_state", {})
    monkeypatch.setattr(cistern_torch._tags, "after_scope", None)
    # The pluggable path unless a test asks for the native one.
    monkeypatch.setenv("CISTERN_TORCH_NATIVE", "0")
    aborts: List[bool] = []
    monkeypatch.setattr(_lib, "abort_on_failure", lambda on: aborts.append(on) or False)
    addrs["aborts"] = aborts  # type: ignore[assignment]
    return addrs


def test_install_native_when_it_builds(fake_env, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = make_fake_torch()
    torch.cuda.memory._get_current_allocator = lambda: "torch's handle"
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delenv("CISTERN_TORCH_NATIVE")
    calls: List[str] = []
    monkeypatch.setattr(_shim, "build_native_for_torch", lambda t: "/cache/native.so")
    monkeypatch.setattr(_shim, "bind_native", lambda p: calls.append(p) or "handle")
    monkeypatch.setattr(_shim, "install_native", lambda h: calls.append(h))
    assert cistern_torch.install() == "torch's handle"
    assert calls == ["/cache/native.so", "handle"]
    assert cistern_torch.allocator_mode() == "native" and cistern_torch.oom_mode() == "raise"
    assert torch.cuda.swapped == [], "the pluggable allocator was installed too"
    assert cistern_torch.install() == "torch's handle"  # idempotent
    assert calls == ["/cache/native.so", "handle"]


def test_install_falls_back_to_pluggable_and_says_why(fake_env, monkeypatch) -> None:
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delenv("CISTERN_TORCH_NATIVE")

    def fail(t: Any) -> str:
        raise _shim.ShimBuildError("no CUDA runtime headers (...): install a CUDA toolkit")

    monkeypatch.setattr(_shim, "build_native_for_torch", fail)
    with pytest.warns(cistern_torch.CisternWarning, match="pluggable allocator.*install a CUDA toolkit"):
        alloc = cistern_torch.install(shim=False)
    assert cistern_torch.allocator_mode() == "pluggable"
    assert torch.cuda.swapped == [alloc]


def test_install_with_required_native_raises(fake_env, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch())
    with pytest.raises(cistern_torch.ShimBuildError, match="location"):
        cistern_torch.install(native=True)
    assert not cistern_torch.is_installed()


def test_native_install_too_late_says_what_to_do(fake_env, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch())
    monkeypatch.setattr(_shim, "build_native_for_torch", lambda t: "/cache/native.so")
    monkeypatch.setattr(_shim, "bind_native", lambda p: "handle")

    def refuse(h: Any) -> None:
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(_shim, "install_native", refuse)
    with pytest.raises(cistern_torch.InstallError, match="before any CUDA work"):
        cistern_torch.install(native=True)
    assert not cistern_torch.is_installed()


def test_install_sets_every_hook(fake_env: Dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    torch = make_fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    alloc = cistern_torch.install(shim=False)
    assert alloc.args == ("/opt/libcistern.so", "cistern_malloc", "cistern_free")
    assert alloc.raw.hooks == {
        "set_init_fn": fake_env["cistern_init"],
        "set_reset_fn": fake_env["cistern_empty_cache"],
        "set_memory_fraction_fn": fake_env["cistern_set_memory_fraction"],
        "set_record_stream_fn": fake_env["cistern_record_stream"],
        "set_base_alloc_fn": fake_env["cistern_base_alloc"],
    }
    assert torch.cuda.swapped == [alloc]
    assert cistern_torch.is_installed() and cistern_torch.oom_mode() == "abort"
    assert fake_env["aborts"] == [True], "the library would hand PyTorch NULL pointers"
    assert cistern_torch.install() is alloc  # idempotent
    assert torch.cuda.swapped == [alloc]
    with pytest.raises(cistern_torch.InstallError):
        cistern_torch.mem_pool()


def test_mem_pool_turns_python_frames_off_for_good(fake_env, monkeypatch) -> None:
    # PyTorch calls a MemPool's allocator holding its own lock; reading frames takes the GIL.
    torch = make_fake_torch()
    made: List[Any] = []
    torch.cuda.MemPool = lambda raw, **kw: made.append((raw, kw)) or "pool"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(_lib, "_frames_forbidden", None)
    turned: List[bool] = []
    monkeypatch.setattr(_lib, "_python_frames", lambda lib, on: turned.append(on) or False)
    assert cistern_torch.mem_pool(use_on_oom=True) == "pool"
    assert isinstance(made[0][0], FakeRawAllocator) and made[0][1] == {"use_on_oom": True}
    assert turned == [False]
    with pytest.raises(RuntimeError, match="MemPool.*deadlock"):
        _lib.python_frames(True)
    assert turned == [False], "refused before the library was asked"
    assert _lib.python_frames(False) is False


def test_install_uses_the_shim_when_it_builds(fake_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch())
    monkeypatch.setattr(_shim, "build_for_torch", lambda t: "/cache/shim.so")
    monkeypatch.setattr(_shim, "bind", lambda p: object())
    alloc = cistern_torch.install()
    assert alloc.args == ("/cache/shim.so", "cistern_torch_malloc", "cistern_torch_free")
    assert cistern_torch.oom_mode() == "raise"
    assert fake_env["aborts"] == []


def test_install_warns_and_falls_back_without_a_compiler(fake_env, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch())

    def fail(t: Any) -> str:
        raise _shim.ShimBuildError("no C++ compiler")

    monkeypatch.setattr(_shim, "build_for_torch", fail)
    with pytest.warns(cistern_torch.CisternWarning, match="abort the process.*no C.. compiler"):
        alloc = cistern_torch.install()
    assert alloc.args[1] == "cistern_malloc"
    assert cistern_torch.oom_mode() == "abort" and fake_env["aborts"] == [True]


def test_install_with_required_shim_raises(fake_env, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch())
    monkeypatch.setattr(_shim, "build_for_torch", lambda t: (_ for _ in ()).throw(_shim.ShimBuildError("x")))
    with pytest.raises(cistern_torch.ShimBuildError):
        cistern_torch.install(shim=True)
    assert not cistern_torch.is_installed()


@pytest.mark.parametrize("how", ["is_initialized", "swap_refused"])
def test_install_after_cuda_init_says_what_to_do(fake_env, monkeypatch, how: str) -> None:
    torch = make_fake_torch(initialized=True)
    if how == "swap_refused":  # CUDA initialised behind torch.cuda's back
        torch.cuda.is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(cistern_torch.InstallError, match="before any CUDA work, e.g. at the top of your script"):
        cistern_torch.install(shim=False)
    assert not cistern_torch.is_installed()


def test_check_oom_raises_after_the_fact(fake_env, monkeypatch) -> None:
    counts = {"n": 0}
    monkeypatch.setattr(_lib, "stats", lambda d: {"num_ooms": counts["n"]})
    monkeypatch.setattr(_lib, "last_error", lambda: "out of memory: tried to allocate 1.00 PiB")
    cistern_torch.check_oom(0)
    counts["n"] = 1
    with pytest.raises(cistern_torch.OutOfMemoryError, match="CUDA out of memory. out of memory: tried"):
        cistern_torch.check_oom(0)
    cistern_torch.check_oom(0)  # reported once


# --- the shim against real torch headers ------------------------------------------------------

HARNESS = r"""
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <cstdio>
static const char* msg = "out of memory: tried to allocate 1.00 PiB";
static void* fake_malloc(size_t s, int, void*) { return s == 512 ? (void*)0x1000 : nullptr; }
static void fake_free(void*, size_t, int, void*) {}
static const char* fake_err() { return msg; }
int main(int, char** argv) {
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) { std::printf("dlopen: %s\n", dlerror()); return 2; }
  auto bind = (int (*)(void*, void*, void*))dlsym(h, "cistern_torch_bind");
  auto m = (void* (*)(size_t, int, void*))dlsym(h, "cistern_torch_malloc");
  if (bind((void*)fake_malloc, (void*)fake_free, (void*)fake_err) != 1) return 3;
  if (m(512, 0, nullptr) != (void*)0x1000 || m(0, 0, nullptr) != nullptr) return 4;
  try { m(1ull << 50, 0, nullptr); return 5; }
  catch (c10::OutOfMemoryError& e) { std::printf("OOM|%s\n", e.what_without_backtrace()); }
  msg = "driver error: cuMemCreate failed";
  try { m(4096, 1, nullptr); return 6; }
  catch (c10::OutOfMemoryError&) { return 7; }
  catch (c10::Error& e) { std::printf("ERR|%s\n", e.what_without_backtrace()); }
  return 0;
}
"""


def _torch_dirs() -> "tuple[str, str, bool, str]":
    named = os.environ.get("CISTERN_TORCH_TORCH_DIRS", "").split(os.pathsep)
    named.append(os.environ.get("CISTERN_TORCH_TORCH_DIR", ""))
    for candidate in named:
        root = _shim.find_unpacked_torch(candidate)
        if root is not None:
            return (os.path.join(root, "include"), os.path.join(root, "lib"),
                    _shim.cxx11_abi_of(root), f"dir@{root}")
    torch = pytest.importorskip(
        "torch", reason="needs torch, or CISTERN_TORCH_TORCH_DIR=<unpacked torch package>"
    )
    root = os.path.dirname(torch.__file__)
    return (os.path.join(root, "include"), os.path.join(root, "lib"),
            bool(torch.compiled_with_cxx11_abi()), torch.__version__)


def test_shim_throws_out_of_memory_error_with_the_report(tmp_path, monkeypatch) -> None:
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no C++ compiler")
    inc, libdir, abi, tag = _torch_dirs()
    monkeypatch.setenv("CISTERN_TORCH_CACHE", str(tmp_path / "cache"))
    shim = _shim.build(inc, libdir, abi, tag)
    assert _shim.build(inc, libdir, abi, tag) == shim  # cached
    src = tmp_path / "harness.cpp"
    src.write_text(HARNESS)
    exe = tmp_path / "harness"
    subprocess.run(
        [os.environ.get("CXX") or "c++", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}",
         "-I", inc, str(src), "-o", str(exe), "-L", libdir, "-lc10", "-ldl",
         f"-Wl,-rpath,{libdir}"],
        check=True,
    )
    out = subprocess.run([str(exe), shim], capture_output=True, text=True)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    lines = dict(line.split("|", 1) for line in out.stdout.strip().splitlines())
    assert lines["OOM"].startswith("CUDA out of memory. cistern could not allocate 1125899906842624 bytes on device 0: out of memory: tried to allocate 1.00 PiB")
    assert "cuMemCreate failed" in lines["ERR"]


# --- for real: torch with a GPU, in subprocesses ----------------------------------------------


def _gpu() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if _lib.library_path() is None:
        pytest.skip("libcistern.so not found: set CISTERN_LIB")
    if os.environ.get("CISTERN_DRIVER", "sim") == "sim":
        pytest.skip("CISTERN_DRIVER=sim: the GPU tests need CISTERN_DRIVER=cuda (or auto)")


def _run(script: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_gpu_install_allocates_and_reports() -> None:
    _gpu()
    out = _run("""
        import torch, cistern_torch
        cistern_torch.install(shim=True)
        before = cistern_torch.memory_allocated()
        x = torch.randn(1024, 1024, device="cuda")
        assert cistern_torch.memory_allocated() >= before + 4 * 1024 * 1024
        y = (x @ x).sum().item()
        del x
        torch.cuda.empty_cache()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            z = torch.ones(1 << 20, device="cuda")
        with torch.cuda.stream(s2):
            z.record_stream(s2); w = z * 2
        del z
        torch.cuda.synchronize()
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
            print("NO-RAISE")
        except torch.cuda.OutOfMemoryError as e:
            assert "cistern" in str(e), str(e)
            print("OOM-RAISED")
        a = torch.ones(10, device="cuda")  # still healthy
        assert a.sum().item() == 10
        from torch.cuda import _memory_viz
        print(_memory_viz.segsum(cistern_torch.snapshot()).splitlines()[-1])
        print("OK")
    """)
    assert "OOM-RAISED" in out and "OK" in out


def test_gpu_mem_pool_serves_segments() -> None:
    _gpu()
    import torch

    if not hasattr(torch.cuda, "MemPool"):
        pytest.skip(f"torch {torch.__version__} has no MemPool (needs >= 2.5)")
    out = _run("""
        import torch, cistern_torch
        pool = cistern_torch.mem_pool()
        before = cistern_torch.memory_reserved()
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        assert cistern_torch.memory_reserved() > before
        del x, pool
        torch.cuda.empty_cache()
        print("OK")
    """)
    assert "OK" in out
