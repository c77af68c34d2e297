"""memory_stats and friends: PyTorch's keys, values after allocations, peaks, cache, fraction."""

from __future__ import annotations

import collections
import math

import pytest

import cistern_torch

GAUGES = [
    "allocation",
    "allocated_bytes",
    "active",
    "active_bytes",
    "inactive_split",
    "inactive_split_bytes",
    "requested_bytes",
    "reserved_bytes",
    "segment",
]
POOLS = ["all", "small_pool", "large_pool"]
METRICS = ["current", "peak", "allocated", "freed"]
COUNTERS = ["num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"]


def test_stats_have_pytorch_keys_sorted(lib: object) -> None:
    s = cistern_torch.memory_stats(0)
    assert isinstance(s, collections.OrderedDict)
    assert list(s) == sorted(s)
    expected = [f"{g}.{p}.{m}" for g in GAUGES for p in POOLS for m in METRICS] + COUNTERS
    missing = [k for k in expected if k not in s]
    assert not missing, missing
    for k, v in s.items():
        assert isinstance(v, (int, float)), (k, v)


def test_device_spellings_agree(lib: object) -> None:
    assert list(cistern_torch.memory_stats("cuda:0")) == list(cistern_torch.memory_stats(0))
    assert list(cistern_torch.memory_stats(None)) == list(cistern_torch.memory_stats(0))


def test_a_device_that_does_not_exist_raises(lib: object) -> None:
    with pytest.raises(ValueError):
        cistern_torch.memory_stats(97)


def test_values_follow_allocations(allocs) -> None:
    s0 = cistern_torch.memory_stats(0)
    small, large = 4000, 8 << 20
    a = allocs.malloc(small)
    b = allocs.malloc(large)
    s1 = cistern_torch.memory_stats(0)

    def d(key: str) -> int:
        return s1[key] - s0[key]

    assert d("allocation.all.current") == 2
    assert d("allocation.small_pool.current") == 1
    assert d("allocation.large_pool.current") == 1
    assert d("requested_bytes.all.current") == small + large
    assert d("allocated_bytes.small_pool.current") == 4096  # rounded to 512 B
    assert d("allocated_bytes.large_pool.current") == large
    assert d("allocation.all.allocated") == 2
    assert cistern_torch.memory_allocated(0) == s1["allocated_bytes.all.current"]
    assert cistern_torch.memory_reserved(0) >= cistern_torch.memory_allocated(0)
    assert s1["allocated_bytes.all.peak"] >= s1["allocated_bytes.all.current"]

    allocs.free(a)
    allocs.free(b)
    s2 = cistern_torch.memory_stats(0)
    assert s2["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"]
    assert s2["allocation.all.freed"] - s0["allocation.all.freed"] == 2


def test_reset_peak_memory_stats(allocs) -> None:
    p = allocs.malloc(64 << 20)
    allocs.free(p)
    assert cistern_torch.max_memory_allocated(0) >= cistern_torch.memory_allocated(0) + (64 << 20)
    cistern_torch.reset_peak_memory_stats(0)
    s = cistern_torch.memory_stats(0)
    assert s["allocated_bytes.all.peak"] == s["allocated_bytes.all.current"]
    assert s["reserved_bytes.all.peak"] == s["reserved_bytes.all.current"]
    assert cistern_torch.max_memory_reserved(0) == cistern_torch.memory_reserved(0)


def test_empty_cache_returns_cached_memory(allocs) -> None:
    ptrs = [allocs.malloc(16 << 20) for _ in range(4)]
    for p in ptrs:
        allocs.free(p)
    cached_before = cistern_torch.memory_reserved(0) - cistern_torch.memory_allocated(0)
    assert cached_before >= 64 << 20, "freed blocks should stay cached"
    cistern_torch.empty_cache()
    cached_after = cistern_torch.memory_reserved(0) - cistern_torch.memory_allocated(0)
    assert cached_after < cached_before


@pytest.fixture
def restore_fraction(lib: object):
    yield
    cistern_torch.set_per_process_memory_fraction(1.0, 0)


@pytest.mark.parametrize("bad", ["0.5", 1, None])
def test_fraction_must_be_a_float(bad: object) -> None:
    with pytest.raises(TypeError):
        cistern_torch.set_per_process_memory_fraction(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan])
def test_fraction_must_be_in_0_1(bad: float) -> None:
    with pytest.raises(ValueError):
        cistern_torch.set_per_process_memory_fraction(bad)


def test_fraction_getter_returns_what_was_set(restore_fraction) -> None:
    cistern_torch.set_per_process_memory_fraction(0.5, 0)
    assert cistern_torch.get_per_process_memory_fraction(0) == 0.5
    cistern_torch.set_per_process_memory_fraction(1.0)
    assert cistern_torch.get_per_process_memory_fraction() == 1.0


def test_fraction_limits_allocations(restore_fraction, allocs) -> None:
    cistern_torch.set_per_process_memory_fraction(0.5, 0)
    limit = cistern_torch.memory_stats(0).get("memory_limit")
    if not limit:
        pytest.skip("libcistern reports no memory_limit stat")
    cistern_torch.empty_cache()
    assert cistern_torch._lib.malloc(limit + (2 << 20), 0, 0) == 0
    assert "limit" in cistern_torch.last_error() or "out of memory" in cistern_torch.last_error()
    allocs.free(allocs.malloc(limit // 4))


def test_enable_peer_access_raises_with_cisterns_reason(lib: object) -> None:
    with pytest.raises(ValueError, match="own device"):
        cistern_torch.enable_peer_access(0, "cuda:0")
    with pytest.raises(ValueError, match="device 64"):
        cistern_torch.enable_peer_access(0, 64)
    with pytest.raises(ValueError, match="negative"):
        cistern_torch.enable_peer_access(0, -1)
