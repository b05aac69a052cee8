"""The native CPU decode kernel against the torch gather path it replaces, and the switch back to torch."""

from __future__ import annotations

import os

import pytest
import torch

from worker.input_batch import GatherWorkspace
from worker.layers import cpu_paged_attention
from worker.layers.attention import Attention, AttentionMetadata
from worker.layers.cpu_paged_attention import native_kernel


def _torch_decode(q, cache, block_table, lens, num_kv_heads, block_size):
    n, num_heads, head_dim = q.shape
    attention = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    attention.kv_cache = cache
    workspace = GatherWorkspace(block_size, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    max_slots = block_table.shape[1] * block_size
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=block_size,
        num_decodes=n,
        decode_block_table=block_table,
        decode_context_lens=lens,
        decode_mask=(torch.arange(max_slots)[None, :] < lens[:, None])[:, None, None, :],
    )
    meta.decode_key_buffer, meta.decode_value_buffer = workspace.buffers(block_table.numel())
    os.environ["PAGERAIL_CPU_ATTENTION"] = "torch"
    native_kernel.cache_clear()
    try:
        return attention._decode(q, cache[0], cache[1], meta)
    finally:
        del os.environ["PAGERAIL_CPU_ATTENTION"]
        native_kernel.cache_clear()


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 32), (16, 2, 16, 1)],
)
def test_native_decode_matches_torch_gather(num_heads, num_kv_heads, head_dim, block_size):
    kernel = native_kernel()
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    generator = torch.Generator().manual_seed(num_heads * head_dim)
    n = 7
    lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 70, 5], dtype=torch.long)
    max_blocks = int(-(-lens.max() // block_size))
    num_blocks = n * max_blocks + 3
    cache = torch.randn(2, num_kv_heads, num_blocks * block_size, head_dim, generator=generator)
    # Blocks scattered over the cache, and padding entries pointing at block 0 as the scheduler leaves them.
    table = torch.randperm(num_blocks, generator=generator)[: n * max_blocks].view(n, max_blocks).clone()
    for row, length in enumerate(lens.tolist()):
        table[row, -(-length // block_size) :] = 0
    q = torch.randn(n, num_heads, head_dim, generator=generator)

    got = kernel.decode(q, cache[0], cache[1], table, lens, block_size, head_dim**-0.5)
    want = _torch_decode(q, cache, table, lens, num_kv_heads, block_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_declines_what_it_cannot_run():
    kernel = native_kernel()
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    assert kernel.supports(9, 3, 64, torch.float32)
    assert not kernel.supports(9, 3, 64, torch.bfloat16)
    assert not kernel.supports(64, 1, 64, torch.float32)  # a 64-head group exceeds the kernel's scratch
    assert not kernel.supports(8, 8, 512, torch.float32)


def test_environment_switch_selects_the_torch_path(monkeypatch):
    monkeypatch.setenv("PAGERAIL_CPU_ATTENTION", "torch")
    native_kernel.cache_clear()
    try:
        assert cpu_paged_attention.native_kernel() is None
    finally:
        native_kernel.cache_clear()


def test_missing_compiler_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGERAIL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native_kernel.cache_clear()
    try:
        assert cpu_paged_attention.native_kernel() is None
    finally:
        native_kernel.cache_clear()
