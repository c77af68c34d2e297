"""The native allocator (``_native.cpp``): cistern as PyTorch's own ``CUDAAllocator``.

Without a GPU:

- it is compiled against real torch headers: every torch named by ``CISTERN_TORCH_TORCH_DIRS``
  (unpacked wheels, separated by ``os.pathsep``; ``scripts/torch-headers.sh`` fetches the newest
  and 2.5), else ``CISTERN_TORCH_TORCH_DIR``, else the installed torch. A torch whose allocator
  interface the class does not match fails to compile, so each version is checked;
- a C++ harness includes ``_native_history.h`` and drives the history rings as
  ``_record_memory_history`` sets them (bounds, stacks per ``context``, ``skip_actions``), and
  as cistern's observer feeds them (segment map/unmap/alloc/free, completed frees);
- a C++ harness includes ``_native_json.h`` and converts cistern's statistics and snapshot (from
  the library, on the simulated GPU) into PyTorch's ``DeviceStats`` and ``SnapshotInfo``; the
  test compares every field with the JSON as Python reads it.

With torch and a GPU, ``test_torch.py``'s subprocess tests and ``scripts/gpu-check.sh`` run it
for real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import subprocess
from typing import Dict, List, Tuple

import pytest

from cistern_torch import _lib, _shim

HERE = os.path.dirname(os.path.abspath(__file__))

# Nothing here depends on the driver (the harness runs the library on the simulated GPU itself):
# scripts/test.sh's second pytest run, over the fake libcuda, skips it rather than compile the
# same things again.
if os.environ.get("CISTERN_DRIVER") == "cuda" and os.environ.get("CISTERN_FAKECUDA") == "1":
    pytest.skip("compiled and checked in the simulated-GPU run", allow_module_level=True)


def _cxx() -> str:
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        pytest.skip("no C++ compiler")
    return cxx


def _torch_roots() -> List[str]:
    """Every torch to build against (unpacked packages, or the installed one)."""
    names = os.environ.get("CISTERN_TORCH_TORCH_DIRS", "")
    roots = [r for r in names.split(os.pathsep) if _shim.find_unpacked_torch(r)]
    if not roots:
        one = _shim.find_unpacked_torch(os.environ.get("CISTERN_TORCH_TORCH_DIR"))
        if one:
            roots = [one]
    if not roots:
        try:
            import torch  # noqa: F401
        except ImportError:
            pytest.skip(
                "needs torch's headers: run scripts/torch-headers.sh (it sets "
                "CISTERN_TORCH_TORCH_DIRS) or install torch"
            )
        roots = [os.path.dirname(os.path.abspath(torch.__file__))]
    return roots


def _cuda_include(root: str) -> str:
    inc = _shim.find_cuda_include(root)
    if inc is None:
        pytest.skip(
            f"no CUDA runtime headers for {root}: set CISTERN_TORCH_CUDA_INCLUDE "
            "(scripts/torch-headers.sh unpacks triton's)"
        )
    return inc


def _symbols(path: str, which: str) -> List[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the built library's symbols")
    out = subprocess.run([nm, "-D", which, path], capture_output=True, text=True,
                         check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def _exports(path: str) -> List[str]:
    return _symbols(path, "--defined-only")


# What the native allocator may not call: functions torch's headers declare but libtorch does
# not export, so that the library builds and then fails to load ("undefined symbol") in a torch
# that hides them. torch 2.11's libtorch_cuda.so hides the constructors of
# CUDAPluggableAllocator's _AllocationMetadata (declared out of line, without
# TORCH_CUDA_CPP_API): found on a GPU, where cistern_torch fell back to pluggable mode.
UNEXPORTED = ("_AllocationMetadata",)


def _compile_cxx(cxx: str, args: List[str], what: str) -> "subprocess.CompletedProcess[str]":
    """Runs ``cxx`` with ``args`` as C++17, then C++20 (newer torch headers want it); the first
    that succeeds, or an AssertionError with both compilers' complaints naming ``what``."""
    errors = []
    for std in ("c++17", "c++20"):
        proc = subprocess.run([cxx, f"-std={std}", *args], capture_output=True, text=True)
        if proc.returncode == 0:
            return proc
        errors.append(proc.stderr[-2000:])
    raise AssertionError(f"{what} did not compile:\n" + "\n".join(errors))


def test_native_allocator_compiles_against_each_torch(tmp_path, monkeypatch) -> None:
    _cxx()
    monkeypatch.setenv("CISTERN_TORCH_CACHE", str(tmp_path / "cache"))
    built: Dict[str, str] = {}
    for root in _torch_roots():
        inc = _cuda_include(root)
        abi = _shim.cxx11_abi_of(root)
        path = _shim.build_native(root, abi, f"test@{root}", cuda_include=inc)
        assert _shim.build_native(root, abi, f"test@{root}", cuda_include=inc) == path  # cached
        exports = _exports(path)
        for sym in ("cistern_torch_native_bind", "cistern_torch_native_install",
                    "cistern_torch_native_error"):
            assert sym in exports, (root, exports)
        # cistern's own C++ stays inside the library (built with -fvisibility=hidden; torch's
        # inline functions keep the visibility torch's headers give them).
        assert not [e for e in exports if "cistern_native" in e or "CisternAllocator" in e]
        needed = _symbols(path, "--undefined-only")
        assert not [u for u in needed if any(h in u for h in UNEXPORTED)], (root, needed)
        assert "libstdc++.so.6" in (_shim.elf_needed(path) or []), (root, _shim.elf_needed(path))
        built[root] = path
    assert built


def test_elf_needed_reads_a_library_or_says_it_cannot(tmp_path) -> None:
    import _ctypes  # an ELF shared object wherever these tests run (Linux)

    lib = _ctypes.__file__
    needed = _shim.elf_needed(lib)
    if needed is None:
        pytest.skip(f"{lib} is not a 64-bit ELF shared object")
    assert all(isinstance(n, str) and n for n in needed), needed
    data = open(lib, "rb").read()
    # Truncated, empty, missing or not ELF at all: None, never an exception.
    for name, blob in (("four", data[:4]), ("header", data[:64]), ("half", data[: len(data) // 2]),
                       ("empty", b""), ("text", b"not an ELF file\n" * 8)):
        p = tmp_path / name
        p.write_bytes(blob)
        assert _shim.elf_needed(str(p)) is None, name
    assert _shim.elf_needed(str(tmp_path / "missing")) is None


def test_the_cxx_runtime_is_linked_shared_even_where_the_compiler_links_it_statically(
    tmp_path, monkeypatch
) -> None:
    # Found on a GPU: a compiler that linked libstdc++ into the library statically put a second
    # copy beside torch's, and the first OOM message (an ostringstream) segfaulted.
    _cxx()
    root = _torch_roots()[0]
    inc = _cuda_include(root)
    monkeypatch.setenv("CISTERN_TORCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CISTERN_TORCH_CXXFLAGS", "-static-libstdc++")
    path = _shim.build_native(root, _shim.cxx11_abi_of(root), "static-runtime", cuda_include=inc)
    assert "libstdc++.so.6" in (_shim.elf_needed(path) or []), _shim.elf_needed(path)
    # No libstdc++ of its own: nothing of std:: defined in the library.
    assert not [e for e in _exports(path) if e.startswith(("_ZNSo", "_ZNKSt6locale"))]


# Methods whose signature differs between torch versions are declared without `override`
# (_native.cpp says why); in a torch that declares them virtual they must override, or PyTorch
# calls its base's version, which raises. The compiler names each method that overrides without
# saying so (-Wsuggest-override): those of the newest torch must all be there.
NEWEST_OVERRIDES = (
    "getMemoryFraction", "snapshot", "emptyCache", "createOrIncrefPool", "getPoolUseCount",
    "setUseOnOOM", "recordHistory", "attachOomRejectionObserver", "getExpandableSegmentSizes",
    "pushCompileContext", "popCompileContext", "supportsUserMetadata", "setUserMetadata",
    "getUserMetadata", "annotateMemory", "getContextForPointer", "setNoSplit",
)


def test_version_dependent_methods_override_the_newest_torchs(tmp_path) -> None:
    cxx = _cxx()
    checked = 0
    for root in _torch_roots():
        inc = os.path.join(root, "include")
        header = os.path.join(inc, "c10", "cuda", "CUDACachingAllocator.h")
        with open(header, encoding="utf-8", errors="replace") as f:
            if "attachOomRejectionObserver" not in f.read():
                continue  # an older torch: some of these are not virtual there
        pkg = os.path.dirname(_shim.source_path())
        proc = _compile_cxx(
            cxx,
            ["-fsyntax-only", "-Wsuggest-override",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(_shim.cxx11_abi_of(root))}", "-I", pkg,
             "-I", inc, "-I", os.path.join(inc, "torch", "csrc", "api", "include"),
             "-I", _cuda_include(root), _shim.source_path("_native.cpp")],
            "_native.cpp")
        marked = {line for line in proc.stderr.splitlines()
                  if "_native.cpp" in line and "override" in line}
        for name in NEWEST_OVERRIDES:
            assert any(re.search(rf"\b{name}\b", line) for line in marked), (
                name, sorted(marked))
        checked += 1
    if not checked:
        pytest.skip("no torch with attachOomRejectionObserver among the roots")


def test_native_build_errors_name_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CISTERN_TORCH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(_shim.ShimBuildError, match="CUDA build of torch"):
        _shim.build_native(str(tmp_path), True, "none")
    fake = tmp_path / "torch"
    (fake / "include" / "torch" / "csrc" / "cuda").mkdir(parents=True)
    (fake / "include" / "torch" / "csrc" / "cuda" / "CUDAPluggableAllocator.h").write_text("")
    (fake / "lib").mkdir()
    (fake / "lib" / "libc10.so").write_bytes(b"")
    monkeypatch.setenv("CISTERN_TORCH_CUDA_INCLUDE", str(tmp_path / "nowhere"))
    with pytest.raises(_shim.ShimBuildError, match="CISTERN_TORCH_CUDA_INCLUDE"):
        _shim.build_native(str(fake), True, "none")


HARNESS = r"""
#include "_native_json.h"
#include <dlfcn.h>
#include <cstdio>
#include <string>

using Malloc = void* (*)(size_t, int, void*);
using Free = void (*)(void*, size_t, int, void*);
using Json = size_t (*)(int, char*, size_t);
using Snap = size_t (*)(char*, size_t);
using Begin = int (*)(int, uint64_t, uint64_t, void*, void*, void*);
using PoolCall = int (*)(int, uint64_t, uint64_t);

template <class T> T sym(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) { std::printf("MISSING|%s\n", name); std::exit(3); }
  return reinterpret_cast<T>(p);
}

static std::string read(size_t (*f)(int, char*, size_t), int dev) {
  size_t n = f(dev, nullptr, 0);
  std::string s(n + 1, '\0');
  f(dev, &s[0], s.size());
  s.resize(n);
  return s;
}

static std::string read_snap(Snap f) {
  size_t n = f(nullptr, 0);
  std::string s(n + 1, '\0');
  f(&s[0], s.size());
  s.resize(n);
  return s;
}

static void print_stats(const char* tag, const c10::CachingDeviceAllocator::DeviceStats& s) {
  const char* pools[3] = {"all", "small_pool", "large_pool"};
  struct { const char* name; const c10::CachingDeviceAllocator::StatArray* arr; } arrays[] = {
    {"allocation", &s.allocation}, {"segment", &s.segment}, {"active", &s.active},
    {"inactive_split", &s.inactive_split}, {"allocated_bytes", &s.allocated_bytes},
    {"reserved_bytes", &s.reserved_bytes}, {"active_bytes", &s.active_bytes},
    {"inactive_split_bytes", &s.inactive_split_bytes}, {"requested_bytes", &s.requested_bytes},
  };
  for (auto& a : arrays) {
    for (int i = 0; i < 3; ++i) {
      const auto& st = (*a.arr)[i];
      std::printf("%s|%s.%s.current|%lld\n", tag, a.name, pools[i], (long long)st.current);
      std::printf("%s|%s.%s.peak|%lld\n", tag, a.name, pools[i], (long long)st.peak);
      std::printf("%s|%s.%s.allocated|%lld\n", tag, a.name, pools[i], (long long)st.allocated);
      std::printf("%s|%s.%s.freed|%lld\n", tag, a.name, pools[i], (long long)st.freed);
    }
  }
  std::printf("%s|num_alloc_retries|%lld\n", tag, (long long)s.num_alloc_retries);
  std::printf("%s|num_ooms|%lld\n", tag, (long long)s.num_ooms);
  std::printf("%s|num_device_alloc|%lld\n", tag, (long long)s.num_device_alloc);
  std::printf("%s|num_device_free|%lld\n", tag, (long long)s.num_device_free);
  std::printf("%s|num_sync_all_streams|%lld\n", tag, (long long)s.num_sync_all_streams);
  std::printf("%s|max_split_size|%lld\n", tag, (long long)s.max_split_size);
  std::printf("%s|oversize_allocations.all.current|%lld\n", tag,
              (long long)s.oversize_allocations.current);
}

// Each graph pool's reserved bytes, in a torch whose DeviceStats has them.
template <class S>
auto print_private(const char* tag, const S& s, int)
    -> decltype((void)s.reserved_bytes_by_private_pools, void()) {
  const char* pools[3] = {"all", "small_pool", "large_pool"};
  for (const auto& kv : s.reserved_bytes_by_private_pools) {
    for (int i = 0; i < 3; ++i) {
      const auto& st = kv.second[i];
      std::printf("%s|%llu_%llu.%s|%lld|%lld|%lld|%lld\n", tag,
                  (unsigned long long)kv.first.first, (unsigned long long)kv.first.second,
                  pools[i], (long long)st.current, (long long)st.peak, (long long)st.allocated,
                  (long long)st.freed);
    }
  }
}
template <class S>
void print_private(const char*, const S&, long) {}

int main(int argc, char** argv) {
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) { std::printf("DLOPEN|%s\n", dlerror()); return 2; }
  auto m = sym<Malloc>(lib, "cistern_malloc");
  auto f = sym<Free>(lib, "cistern_free");
  auto stats = sym<Json>(lib, "cistern_stats_json");
  auto snap = sym<Snap>(lib, "cistern_snapshot_json");
  auto begin = sym<Begin>(lib, "cistern_begin_allocate_to_pool");
  auto end = sym<PoolCall>(lib, "cistern_end_allocate_to_pool");
  void* s1 = reinterpret_cast<void*>(0x10);
  void* a = m(3 << 20, 0, s1);
  void* b = m(1000, 0, s1);
  void* c = m(40 << 20, 0, s1);
  f(b, 1000, 0, s1);
  if (begin(0, 5, 0, nullptr, nullptr, nullptr) != 1 || !m(2 << 20, 0, reinterpret_cast<void*>(0x20))) return 4;
  end(0, 5, 0);

  std::string st = read(stats, 0);
  std::printf("STATS_JSON|%s\n", st.c_str());
  cistern_native::Json flat;
  if (!cistern_native::parse(st, flat)) return 5;
  print_stats("STAT", cistern_native::stats_from_json(flat));
  print_private("PRIV", cistern_native::stats_from_json(flat), 0);
  // resetAccumulatedStats: counters from the reset on.
  auto base = cistern_native::baseline_of(flat);
  f(c, 40 << 20, 0, s1);
  void* d = m(5 << 20, 0, s1);
  std::string st2 = read(stats, 0);
  std::printf("STATS2_JSON|%s\n", st2.c_str());
  cistern_native::Json flat2;
  if (!cistern_native::parse(st2, flat2)) return 6;
  print_stats("RESET", cistern_native::stats_from_json(flat2, base));

  std::string sn = read_snap(snap);
  std::printf("SNAP_JSON|%s\n", sn.c_str());
  cistern_native::Json sj;
  if (!cistern_native::parse(sn, sj)) return 7;
  auto info = cistern_native::snapshot_from_json(sj);
  std::printf("TRACES|%zu\n", info.device_traces.size());
  for (const auto& seg : info.segments) {
    std::printf("SEG|%zu|%zu|%zu|%zu|%zu|%llu|%d|%d|%llu|%llu|%zu|%d\n", seg.address,
                seg.total_size, seg.allocated_size, seg.active_size, seg.requested_size,
                (unsigned long long)(uintptr_t)seg.stream, (int)seg.is_large,
                (int)seg.is_expandable, (unsigned long long)seg.owner_private_pool_id.first,
                (unsigned long long)seg.owner_private_pool_id.second, seg.blocks.size(),
                (int)seg.device);
    for (const auto& bl : seg.blocks) {
      std::printf("BLK|%zu|%zu|%d|%d\n", bl.size, bl.requested_size, (int)bl.allocated,
                  (int)bl.active);
    }
  }
  auto pool = cistern_native::snapshot_from_json(sj, {5, 0});
  std::printf("POOLSEGS|%zu\n", pool.segments.size());
  for (const auto& e : cistern_native::expandable_sizes(info, 0)) {
    std::printf("EXP|%llu|%d|%zu\n", (unsigned long long)(uintptr_t)e.stream, (int)e.small,
                e.bytes);
  }
  // Documents that are not JSON are refused, not misread.
  cistern_native::Json bad;
  std::printf("BAD|%d|%d|%d\n", (int)cistern_native::parse("{\"a\": }", bad),
              (int)cistern_native::parse("[1, 2", bad), (int)cistern_native::parse("{} x", bad));
  f(a, 3 << 20, 0, s1);
  f(d, 5 << 20, 0, s1);
  return 0;
}
"""


def _run_harness(tmp_path, root: str) -> Tuple[Dict[str, List[str]], str]:
    cxx = _cxx()
    inc = os.path.join(root, "include")
    cuda = _cuda_include(root)
    libdir = os.path.join(root, "lib")
    abi = _shim.cxx11_abi_of(root)
    src = tmp_path / "harness.cpp"
    src.write_text(HARNESS)
    exe = tmp_path / "harness"
    pkg = os.path.dirname(_shim.source_path())
    _compile_cxx(
        cxx,
        [f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}", "-I", pkg, "-I", inc, "-I", cuda, str(src),
         "-o", str(exe), "-L", libdir, "-lc10", "-ldl", f"-Wl,-rpath,{libdir}"],
        "the harness")
    env = dict(os.environ, CISTERN_DRIVER="sim", CISTERN_CONF="registry:off",
               CISTERN_SIM="capacity:8GiB")
    out = subprocess.run([str(exe), _lib.library_path()], capture_output=True, text=True, env=env)
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    lines: Dict[str, List[str]] = {}
    for line in out.stdout.splitlines():
        kind, _, rest = line.partition("|")
        lines.setdefault(kind, []).append(rest)
    return lines, out.stdout


def test_stats_and_snapshot_convert_to_pytorchs_types(tmp_path, lib) -> None:
    for i, root in enumerate(_torch_roots()):
        work = tmp_path / str(i)
        work.mkdir()
        lines, out = _run_harness(work, root)
        _check_conversion(lines, out)
        header = os.path.join(root, "include", "c10", "core", "CachingDeviceAllocator.h")
        if os.path.isfile(header):
            with open(header, encoding="utf-8", errors="replace") as f:
                if "reserved_bytes_by_private_pools" in f.read():
                    assert any(r.startswith("5_0.all|") for r in lines.get("PRIV", [])), lines


def _check_conversion(lines: Dict[str, List[str]], _out: str) -> None:
    stats = json.loads(lines["STATS_JSON"][0])
    stats2 = json.loads(lines["STATS2_JSON"][0])
    got = {k: int(v) for k, v in (r.rsplit("|", 1) for r in lines["STAT"])}
    assert got, lines
    for key, value in got.items():
        assert value == stats[key], (key, value, stats[key])
    assert got["allocated_bytes.all.current"] == (3 << 20) + (40 << 20) + (2 << 20)
    # The graph pool's reserved bytes: in cistern's statistics always, in DeviceStats where the
    # torch has reserved_bytes_by_private_pools.
    assert stats["reserved_bytes_by_private_pools.5_0.all.current"] >= 2 << 20
    for row in lines.get("PRIV", []):
        name, *values = row.split("|")
        prefix = f"reserved_bytes_by_private_pools.{name}"
        assert [int(v) for v in values] == [
            stats[f"{prefix}.{f}"] for f in ("current", "peak", "allocated", "freed")], row
    assert got["allocation.all.allocated"] == 4
    # After resetAccumulatedStats: current and peak as cistern has them, "allocated" and
    # "freed" and the event counts from the reset on.
    reset = {k: int(v) for k, v in (r.rsplit("|", 1) for r in lines["RESET"])}
    for key, value in reset.items():
        accumulated = key.endswith((".allocated", ".freed")) or key in (
            "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
            "num_sync_all_streams")
        want = stats2[key] - stats[key] if accumulated else stats2[key]
        assert value == want, (key, value, want)
    assert reset["allocation.all.allocated"] == 1
    assert reset["allocation.all.freed"] == 1

    snap = json.loads(lines["SNAP_JSON"][0])
    segs = [r.split("|") for r in lines["SEG"]]
    assert len(segs) == len(snap["segments"]) > 0
    blocks = iter(r.split("|") for r in lines["BLK"])
    states = {"active_allocated": (1, 1), "active_pending_free": (0, 1), "inactive": (0, 0)}
    for seg, want in zip(segs, snap["segments"]):
        assert [int(x) for x in seg] == [
            want["address"], want["total_size"], want["allocated_size"], want["active_size"],
            want["requested_size"], want["stream"], int(want["segment_type"] == "large"),
            int(want["is_expandable"]), want["segment_pool_id"][0], want["segment_pool_id"][1],
            len(want["blocks"]), want["device"],
        ]
        for b in want["blocks"]:
            size, req, allocated, active = (int(x) for x in next(blocks))
            assert (size, req) == (b["size"], b["requested_size"])
            assert (allocated, active) == states[b["state"]], b
    in_pool = [s for s in snap["segments"] if s["segment_pool_id"] == [5, 0]]
    assert int(lines["POOLSEGS"][0]) == len(in_pool) > 0
    # getExpandableSegmentSizes: the VMM runs of device 0, summed per stream and heap.
    want: Dict[Tuple[int, int], int] = {}
    for s in snap["segments"]:
        if s["device"] == 0 and s["is_expandable"]:
            k = (s["stream"], int(s["segment_type"] == "small"))
            want[k] = want.get(k, 0) + s["total_size"]
    got_exp = {(int(a), int(b)): int(c) for a, b, c in (r.split("|") for r in lines.get("EXP", []))}
    assert got_exp == want and want, (got_exp, want)
    assert int(lines["TRACES"][0]) == len(snap["device_traces"])
    assert lines["BAD"] == ["0|0|0"]


def test_build_shim_command_builds_against_a_torch_on_disk(tmp_path) -> None:
    _cxx()
    root = _torch_roots()[0]
    cuda = _cuda_include(root)
    env = dict(os.environ, CISTERN_TORCH_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "cistern_torch", "build-shim", "--torch-root", root,
           "--cuda-include", cuda]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    parts = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert set(parts) == {"native", "shim"}
    assert all(os.path.isfile(p) for p in parts.values()), parts
    bad = subprocess.run(cmd[:4] + ["--torch-root", str(tmp_path)], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 1 and "is not a torch package" in bad.stderr, bad.stderr


HISTORY_HARNESS = r"""
#include "_native_history.h"
#include <cstdio>
#include <tuple>
#include <vector>

using namespace cistern_native;

struct Ctx : c10::GatheredContext {
  explicit Ctx(int n) : id(n) {}
  int id;
};
static int calls = 0;
static std::shared_ptr<c10::GatheredContext> recorder() { return std::make_shared<Ctx>(++calls); }

static void dump(const char* tag, const History& h) {
  auto traces = h.traces(h.devices());
  for (size_t d = 0; d < traces.size(); ++d) {
    for (const auto& e : traces[d]) {
      int ctx = e.context_ ? static_cast<Ctx*>(e.context_.get())->id : 0;
      std::printf("%s|%zu|%d|%zu|%zu|%lld|%d\n", tag, d, (int)e.action_, e.addr_, e.size_,
                  (long long)e.time_.t_, ctx);
    }
  }
}

// Each entry's compile context and user metadata, in a torch whose entries have them.
template <class H, class TE = c10::cuda::CUDACachingAllocator::TraceEntry>
void print_extras(const H& h) {
  if constexpr (HasCompileContext<TE>::value && HasUserMetadata<TE>::value) {
    auto traces = h.traces(1);
    for (const auto& e : traces[0]) {
      std::printf("EXTRA|%d|%zu|%s|%s\n", (int)e.action_, e.addr_, e.compile_context_.c_str(),
                  e.user_metadata_.c_str());
    }
  }
}

// Each entry's graph pool, in a torch whose entries have one.
template <class TE, class = void>
struct HasMempool : std::false_type {};
template <class TE>
struct HasMempool<TE, std::void_t<decltype(std::declval<TE&>().mempool_)>> : std::true_type {};
template <class H, class TE = c10::cuda::CUDACachingAllocator::TraceEntry>
void print_pools(const H& h) {
  if constexpr (HasMempool<TE>::value) {
    auto traces = h.traces(1);
    for (const auto& e : traces[0]) {
      std::printf("POOLID|%d|%llu|%llu\n", (int)e.action_, (unsigned long long)e.mempool_.first,
                  (unsigned long long)e.mempool_.second);
    }
  }
}

static int ctx_of(const History& h, size_t addr) {
  auto c = h.context_of(addr);
  return c ? static_cast<Ctx*>(c.get())->id : 0;
}

int main() {
  using RC = c10::cuda::CUDACachingAllocator::RecordContext;
  History h;
  h.alloc(0, (void*)0x1000, 512, nullptr);  // before recording: nothing
  std::printf("OFF|%d|%zu|%d\n", (int)h.enabled(), h.devices(), calls);
  h.record(true, recorder, 3, RC::ALL, false);
  h.alloc(0, (void*)0x1000, 512, nullptr);
  h.alloc(1, (void*)0x2000, 1024, nullptr);
  h.free(0, (void*)0x1000, 512, nullptr);
  h.alloc(0, (void*)0x3000, 2048, nullptr);
  h.oom(0, 1 << 30, 77, nullptr);
  dump("ALL", h);
  std::printf("CTX|%d|%d|%d\n", ctx_of(h, 0x1000), ctx_of(h, 0x2000), ctx_of(h, 0x3000));
  // STATE: stacks for live blocks only, none in the trace; the trace was cleared.
  h.record(true, recorder, 10, RC::STATE, true);
  h.alloc(0, (void*)0x4000, 4096, nullptr);
  dump("STATE", h);
  std::printf("CTX2|%d\n", ctx_of(h, 0x4000));
  // skip_actions: no alloc entries.
  h.record(true, recorder, 10, RC::ALLOC, true, {"alloc"});
  h.alloc(0, (void*)0x5000, 512, nullptr);
  h.free(0, (void*)0x5000, 512, nullptr);
  dump("SKIP", h);
  // Off: nothing more recorded, no stack taken; the record stays.
  h.record(false, recorder, 10, RC::ALL, false);
  int before = calls;
  h.alloc(0, (void*)0x6000, 512, nullptr);
  std::printf("DISABLED|%d|%zu|%d|%d\n", (int)h.enabled(), h.devices(), calls - before,
              ctx_of(h, 0x4000));
  // A block freed with recording off takes its stack along: a later block at its address
  // never shows it.
  h.free(0, (void*)0x4000, 4096, nullptr);
  h.alloc(0, (void*)0x4000, 4096, nullptr);
  std::printf("FREED_OFF|%d\n", ctx_of(h, 0x4000));
  // cistern's observer: segment events and completions come from the pool, without stacks;
  // free() records the request only; skip_actions names segment actions too.
  h.record(true, recorder, 20, RC::ALL, true);
  h.pool_completes(true);
  h.pool_event(1, 0, 0x10000, 20 << 20);
  h.alloc(0, (void*)0x10000, 4096, nullptr);
  h.free(0, (void*)0x10000, 4096, nullptr);
  h.pool_event(5, 0, 0x10000, 4096);
  h.pool_event(2, 0, 0x10000, 20 << 20);
  h.pool_event(3, 0, 0x90000, 2 << 20);
  h.pool_event(4, 0, 0x90000, 2 << 20);
  h.pool_event(42, 0, 0x90000, 1);
  dump("POOL", h);
  h.record(true, recorder, 20, RC::ALL, true, {"segment_map", "free_completed"});
  h.pool_event(1, 0, 0x10000, 20 << 20);
  h.pool_event(5, 0, 0x10000, 4096);
  h.pool_event(2, 0, 0x10000, 20 << 20);
  dump("POOLSKIP", h);
  // Trace trackers (attachAllocatorTraceTracker): every entry, with the history off and
  // whatever its skip_actions; the rings are untouched.
  History t;
  std::vector<std::tuple<int, size_t, size_t>> seen;
  bool attached = t.attach_tracker([&seen](const c10::cuda::CUDACachingAllocator::TraceEntry& e) {
    seen.emplace_back((int)e.action_, e.addr_, e.size_);
  });
  std::printf("TRACKED|%d|%d\n", (int)attached, (int)t.tracked());
  t.pool_event(1, 0, 0x20000, 2 << 20);
  t.alloc(0, (void*)0x20000, 4096, nullptr);
  t.free(0, (void*)0x20000, 4096, nullptr);
  t.oom(0, 1 << 30, 99, nullptr);
  t.record(true, recorder, 20, RC::ALL, true, {"alloc", "segment_unmap"});
  t.pool_completes(true);
  t.alloc(0, (void*)0x30000, 512, nullptr);
  t.free(0, (void*)0x30000, 512, nullptr);
  t.pool_event(5, 0, 0x30000, 512);
  t.pool_event(2, 0, 0x20000, 2 << 20);
  t.pool_event(42, 0, 0x20000, 1);
  for (const auto& e : seen) {
    std::printf("SEEN|%d|%zu|%zu\n", std::get<0>(e), std::get<1>(e), std::get<2>(e));
  }
  dump("TRACKRING", t);
  int more = 0;
  while (t.attach_tracker([](const c10::cuda::CUDACachingAllocator::TraceEntry&) {})) {
    ++more;
  }
  std::printf("LIMIT|%d\n", more);
  // record_function annotations (bounded as the rings, kept only while recording), compile
  // contexts, user metadata and annotate entries.
  History m;
  m.annotation(0, {{"name", "before"}, {"stage", "START"}});
  m.record(true, recorder, 3, RC::ALLOC, false);
  m.annotation(0, {{"name", "fwd"}, {"stage", "START"}});
  m.annotation(1, {{"name", "fwd"}, {"stage", "END"}});
  m.annotation(0, {{"name", "bwd"}, {"stage", "START"}});
  m.annotation(0, {{"name", "bwd"}, {"stage", "END"}});
  for (auto a : m.annotations()) {
    std::printf("ANN|%d|%s|%s|%lld\n", (int)a.device_, a.metadata_["name"].c_str(),
                a.metadata_["stage"].c_str(), (long long)a.time_.t_);
  }
  History::push_compile_context("region1");
  m.alloc(0, (void*)0x7000, 512, nullptr);
  History::pop_compile_context();
  History::pop_compile_context();  // one too many: harmless
  m.set_user_metadata("step=3");
  m.alloc(0, (void*)0x8000, 512, nullptr);
  std::printf("META|%s\n", m.user_metadata().c_str());
  m.set_user_metadata("");
  int annotated = m.annotate(0, (void*)0x8000, 512, nullptr, "kv") ? 1 : 0;
  std::printf("ANNOTATE|%d|%d\n", annotated, (int)History::kUserMetadata);
  print_extras(m);
  m.record(true, recorder, 3, RC::ALLOC, true);
  std::printf("ANNCLEAR|%zu\n", m.annotations().size());
  // Segment entries name their graph pool.
  History q;
  q.record(true, recorder, 5, RC::ALLOC, false);
  q.pool_event(1, 0, 0x50000, 2 << 20, {7, 1});
  q.pool_event(2, 0, 0x50000, 2 << 20);
  print_pools(q);
  return 0;
}
"""


def test_history_rings_follow_pytorchs_rules(tmp_path) -> None:
    cxx = _cxx()
    for i, root in enumerate(_torch_roots()):
        inc, libdir = os.path.join(root, "include"), os.path.join(root, "lib")
        src = tmp_path / f"history{i}.cpp"
        src.write_text(HISTORY_HARNESS)
        exe = tmp_path / f"history{i}"
        pkg = os.path.dirname(_shim.source_path())
        _compile_cxx(
            cxx,
            [f"-D_GLIBCXX_USE_CXX11_ABI={int(_shim.cxx11_abi_of(root))}", "-I", pkg, "-I", inc,
             "-I", _cuda_include(root), str(src), "-o", str(exe), "-L", libdir, "-lc10",
             f"-Wl,-rpath,{libdir}"],
            "the history harness")
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
        rows: Dict[str, List[List[int]]] = {}
        texts: Dict[str, List[List[str]]] = {}
        for line in out.splitlines():
            tag, _, rest = line.partition("|")
            if tag in ("ANN", "EXTRA", "META"):
                texts.setdefault(tag, []).append(rest.split("|"))
            else:
                rows.setdefault(tag, []).append([int(x) for x in rest.split("|")])
        assert rows["OFF"] == [[0, 0, 0]]
        # PyTorch's actions: 0 alloc, 1 free_requested, 2 free_completed, 8 oom.
        ALLOC, FREE_REQ, FREE_DONE, OOM = 0, 1, 2, 8
        dev0 = [(r[1], r[2], r[3]) for r in rows["ALL"] if r[0] == 0]
        dev1 = [(r[1], r[2], r[3]) for r in rows["ALL"] if r[0] == 1]
        # Device 0 kept its last 3 of 5 entries; the OOM's addr is the device's free bytes.
        assert dev0 == [(FREE_DONE, 0x1000, 512), (ALLOC, 0x3000, 2048), (OOM, 77, 1 << 30)]
        assert dev1 == [(ALLOC, 0x2000, 1024)]
        assert all(r[5] > 0 for r in rows["ALL"]), "ALL keeps a stack with every entry"
        assert all(r[4] > 1_600_000_000_000_000 for r in rows["ALL"]), "time_us since the epoch"
        times = [r[4] for r in rows["ALL"] if r[0] == 0]
        assert times == sorted(times)
        ctx = rows["CTX"][0]
        assert ctx[0] == 0 and ctx[1] > 0 and ctx[2] > 0, "live blocks keep their stacks"
        assert [(r[1], r[2], r[5]) for r in rows["STATE"]] == [(ALLOC, 0x4000, 0)]
        assert rows["CTX2"][0][0] > 0
        assert [r[1] for r in rows["SKIP"]] == [FREE_REQ, FREE_DONE]
        # Switched off: nothing more is recorded and no stack taken, but what was recorded
        # stays for a snapshot taken after (as PyTorch keeps it).
        assert rows["DISABLED"][0][0] == 0 and rows["DISABLED"][0][2] == 0
        assert rows["DISABLED"][0][1] == 1 and rows["DISABLED"][0][3] > 0
        assert rows["FREED_OFF"] == [[0]], "a freed block's stack outlived it"
        # The pool's events, in PyTorch's actions (3 segment_alloc, 4 segment_free, 5
        # segment_map, 6 segment_unmap); an unknown kind is dropped.
        SEG_ALLOC, SEG_FREE, SEG_MAP, SEG_UNMAP = 3, 4, 5, 6
        assert [(r[1], r[2], r[3]) for r in rows["POOL"]] == [
            (SEG_MAP, 0x10000, 20 << 20), (ALLOC, 0x10000, 4096), (FREE_REQ, 0x10000, 4096),
            (FREE_DONE, 0x10000, 4096), (SEG_UNMAP, 0x10000, 20 << 20),
            (SEG_ALLOC, 0x90000, 2 << 20), (SEG_FREE, 0x90000, 2 << 20)]
        pool_rows = {r[1]: r[5] for r in rows["POOL"]}
        assert pool_rows[SEG_MAP] == 0 and pool_rows[FREE_DONE] == 0, "no stack under cistern's locks"
        assert pool_rows[ALLOC] > 0
        assert [r[1] for r in rows["POOLSKIP"]] == [SEG_UNMAP]
        # Trackers see every entry, recording or not, skipped or not; the ring keeps its rules.
        assert rows["TRACKED"] == [[1, 1]]
        assert [tuple(r) for r in rows["SEEN"]] == [
            (SEG_MAP, 0x20000, 2 << 20), (ALLOC, 0x20000, 4096), (FREE_REQ, 0x20000, 4096),
            (FREE_DONE, 0x20000, 4096), (OOM, 99, 1 << 30),
            (ALLOC, 0x30000, 512), (FREE_REQ, 0x30000, 512), (FREE_DONE, 0x30000, 512),
            (SEG_UNMAP, 0x20000, 2 << 20)]
        assert [(r[1], r[2]) for r in rows["TRACKRING"]] == [
            (FREE_REQ, 0x30000), (FREE_DONE, 0x30000)]
        assert rows["LIMIT"] == [[63]]
        # Annotations: only while recording, the last max_entries, each with its device, name,
        # stage and time; cleared with the history.
        assert [a[:3] for a in texts["ANN"]] == [
            ["1", "fwd", "END"], ["0", "bwd", "START"], ["0", "bwd", "END"]]
        assert all(int(a[3]) > 1_600_000_000_000_000 for a in texts["ANN"])
        assert rows["ANNCLEAR"] == [[0]]
        assert texts["META"] == [["step=3"]]
        with open(os.path.join(inc, "c10", "core", "CachingDeviceAllocator.h") if os.path.isfile(
                os.path.join(inc, "c10", "core", "CachingDeviceAllocator.h")) else os.devnull,
                encoding="utf-8", errors="replace") as f:
            newer = "user_metadata_" in f.read()
        assert rows["ANNOTATE"] == [[int(newer), int(newer)]]
        if newer:
            # 0 alloc, 9 annotate: the compile region, then "N/A"; the metadata set then.
            assert texts["EXTRA"] == [
                ["0", str(0x7000), "region1", ""], ["0", str(0x8000), "N/A", "step=3"],
                ["9", str(0x8000), "N/A", "kv"]]
        else:
            assert "EXTRA" not in texts
        if newer:
            assert rows["POOLID"] == [[5, 7, 1], [6, 0, 0]]
