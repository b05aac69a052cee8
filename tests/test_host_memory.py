"""The CPU KV cache's memory: zero when handed out, and paid for (resident) only where a block was written."""

from __future__ import annotations

import gc

import pytest
import torch

from pagerail.worker.host_memory import keep_freed_memory, zeros_on_huge_pages

MIB = 1 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_cache_is_zero_contiguous_and_writable(dtype):
    cache = zeros_on_huge_pages((2, 3, 4096, 16), dtype)
    assert cache.shape == (2, 3, 4096, 16) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.float().any()
    cache[1, 2, -1] = 1.0
    assert cache.float().sum().item() == 16


def test_a_large_cache_costs_only_the_pages_its_blocks_touched():
    before = _resident_bytes()
    cache = zeros_on_huge_pages((2, 4, 1 << 19, 64), torch.float32)  # 1 GiB
    assert _resident_bytes() - before < 64 * MIB  # nothing written yet: nothing resident
    cache[0, :, : 1 << 16].fill_(1.0)  # 64 MiB of it
    assert 60 * MIB < _resident_bytes() - before < 160 * MIB
    del cache
    gc.collect()
    assert _resident_bytes() - before < 32 * MIB  # unmapped with the tensor


def test_memory_a_freed_cache_left_dirty_comes_back_zero():
    # As on a rank, whose heap keeps freed memory for reuse: a new cache must never see an old one's values.
    keep_freed_memory()
    for _ in range(3):
        cache = zeros_on_huge_pages((2, 2, 1 << 16, 64), torch.float32)
        assert not cache.any()
        cache.fill_(float("nan"))
        del cache
        gc.collect()
