"""The C ABI through ctypes: allocation, errors, version, threads (needs libcistern.so)."""

from __future__ import annotations

import re
import threading

import cistern_torch
from cistern_torch import _lib


def test_version_is_a_version_string(lib: object) -> None:
    v = cistern_torch.version()
    assert re.search(r"\d+\.\d+\.\d+", v), v


def test_malloc_returns_aligned_distinct_pointers(allocs) -> None:
    sizes = [4, 1024, 1 << 20, 3 << 20]
    ptrs = [allocs.malloc(s) for s in sizes]
    assert all(p % 512 == 0 for p in ptrs), [hex(p) for p in ptrs]
    spans = sorted(zip(ptrs, sizes))
    for (a, sa), (b, _) in zip(spans, spans[1:]):
        assert a + sa <= b, "live allocations overlap"


def test_size_zero_never_fails(lib: object) -> None:
    ptr = _lib.malloc(0, 0, 0)
    _lib.free(ptr, 0, 0, 0)  # NULL or a real block: either way freeing it is fine


def test_bad_free_sets_last_error_and_counts(allocs) -> None:
    before = cistern_torch.memory_stats(0).get("num_invalid_frees", 0)
    _lib.free(0xDEAD0000, 4096, 0, 0)
    assert cistern_torch.last_error(), "a bad free must leave a last-error message"
    assert cistern_torch.memory_stats(0).get("num_invalid_frees", 0) == before + 1
    # The pool is still healthy.
    allocs.free(allocs.malloc(4096))


def test_impossible_request_fails_with_an_oom_report(allocs) -> None:
    before = cistern_torch.memory_stats(0)["num_ooms"]
    assert _lib.malloc(1 << 50, 0, 0) == 0  # 1 PiB
    report = cistern_torch.last_error()
    assert "out of memory" in report or "limit exceeded" in report, report
    assert cistern_torch.memory_stats(0)["num_ooms"] == before + 1
    allocs.free(allocs.malloc(1 << 20))


def test_base_alloc_finds_the_block_of_an_inner_pointer(allocs) -> None:
    ptr = allocs.malloc(1 << 20)
    base, size = _lib.base_alloc(ptr + 4096)
    assert base <= ptr and ptr + (1 << 20) <= base + size, (hex(base), size, hex(ptr))


def test_record_stream_on_a_live_block_is_accepted(allocs) -> None:
    ptr = allocs.malloc(1 << 20)
    before = cistern_torch.memory_stats(0).get("num_record_streams")
    _lib.record_stream(ptr, 0)
    after = cistern_torch.memory_stats(0).get("num_record_streams")
    if before is not None:
        assert after is not None and after >= before


def test_four_threads_allocate_and_free(lib: object) -> None:
    errors = []

    def work(seed: int) -> None:
        try:
            with cistern_torch.tag(f"thread{seed}"):
                live = []
                for i in range(200):
                    size = 512 * (1 + (seed * 7919 + i * 104729) % 4096)
                    p = _lib.malloc(size, 0, 0)
                    assert p, _lib.last_error()
                    live.append((p, size))
                    if i % 3 == 0:
                        q, qs = live.pop(0)
                        _lib.free(q, qs, 0, 0)
                for p, size in live:
                    _lib.free(p, size, 0, 0)
        except BaseException as e:  # reported below
            errors.append(e)

    before = cistern_torch.memory_allocated(0)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cistern_torch.memory_allocated(0) == before
