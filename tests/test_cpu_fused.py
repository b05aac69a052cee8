"""The native float32 CPU kernels for RMSNorm, rotary embedding, the gated activation and the KV cache write,
against the torch formulations they replace, through the layers that pick them; and the switch back to torch.

The kernels are built strictly here: a compile error fails these tests, and so does a missing compiler in CI.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagerail.worker.layers import cpu_fused
from pagerail.worker.layers.activation import SiluAndMul
from pagerail.worker.layers.attention import Attention, AttentionMetadata
from pagerail.worker.layers.cpu_fused import FusedKernels, build_fused_kernels
from pagerail.worker.layers.native_build import KernelBuildError, find_compiler
from pagerail.worker.layers.norm import RMSNorm
from pagerail.worker.layers.rotary import RotaryEmbedding
from tests.requirements import require

# Float rounding only: the kernels sum in another order (and may fuse a multiply-add) than torch does.
TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module")
def kernels() -> FusedKernels:
    require(find_compiler(), "needs a C compiler (cc or gcc) for the native CPU kernels")
    return build_fused_kernels()


@pytest.fixture
def torch_path():
    """Run a block with the native kernels off: what the layers computed before them."""

    class Switch:
        def __enter__(self):
            cpu_fused.ENABLED = False

        def __exit__(self, *exc):
            cpu_fused.ENABLED = True

    return Switch()


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * 2


@pytest.mark.parametrize(("rows", "dim"), [(1, 8), (7, 576), (256, 128), (2048, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_matches_torch(kernels, torch_path, rows, dim, with_residual):
    generator = torch.Generator().manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.rand(dim, generator=generator) + 0.5
    # A strided x, as a column slice of a wider matrix: the kernel must honour the row stride.
    wide = torch.randn(rows, dim + 16, generator=generator) * 3
    x = wide[:, 8 : 8 + dim]
    residual = torch.randn(rows, dim, generator=generator) if with_residual else None
    before = residual.clone() if with_residual else None
    got = norm(x, residual)
    with torch_path:
        want = norm(x, residual)
    if with_residual:
        torch.testing.assert_close(got[0], want[0], **TOLERANCE)
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # one float add: the same bits
        assert torch.equal(residual, before), "the residual passed in must be left as it was"
    else:
        torch.testing.assert_close(got, want, **TOLERANCE)


@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"), [(1, 4, 2, 32), (9, 8, 2, 64), (300, 9, 3, 64), (5, 2, 1, 80)]
)
def test_rotary_matches_torch(kernels, torch_path, tokens, heads, kv_heads, head_dim):
    max_position = 512
    rope = RotaryEmbedding(head_dim, max_position, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.randint(0, max_position, (tokens,), generator=torch.Generator().manual_seed(tokens))
    positions[0] = max_position - 1
    qkv = _qkv(tokens, heads, kv_heads, head_dim, tokens)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)  # strided views, as the model passes them
    with torch_path:
        want_q, want_k = rope(positions, q, k)
    v_before = v.clone()
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q, **TOLERANCE)
    torch.testing.assert_close(got_k, want_k, **TOLERANCE)
    assert torch.equal(v, v_before), "rotating q and k in place must not touch v beside them"


@pytest.mark.parametrize(("rows", "d"), [(1, 4), (256, 256), (700, 1536)])
def test_silu_and_mul_matches_torch(kernels, torch_path, rows, d):
    generator = torch.Generator().manual_seed(d)
    wide = torch.randn(rows, 2 * d + 4, generator=generator) * 4
    x = wide[:, : 2 * d]  # strided rows
    act = SiluAndMul()
    got = act(x)
    with torch_path:
        want = act(x)
    torch.testing.assert_close(got, want, **TOLERANCE)


def _attention_write(tokens: int, slots: list[int], num_slots: int, seed: int):
    heads, kv_heads, head_dim = 4, 2, 16
    attention = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
    attention.kv_cache = torch.zeros(2, kv_heads, num_slots, head_dim)
    qkv = _qkv(tokens, heads, kv_heads, head_dim, seed)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    # k contiguous and v strided, as after Qwen3's k norm: each keeps its own row stride.
    k = k.contiguous()
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=4, num_decodes=0)
    return attention, q, k, v, meta


def test_kv_write_matches_index_copy(kernels, torch_path):
    slots = [5, 0, 11, 3, 8]
    written = []
    for native in (True, False):
        attention, q, k, v, meta = _attention_write(len(slots), slots, 12, seed=1)
        meta.prefills = []  # nothing to attend: only the cache write runs
        if native:
            attention(q, k, v, meta)
        else:
            with torch_path:
                attention(q, k, v, meta)
        written.append(attention.kv_cache.clone())
    assert torch.equal(written[0], written[1])
    assert written[0][:, :, 5].abs().sum() > 0 and not written[0][:, :, 1].any()


def test_kv_write_refuses_a_slot_outside_the_cache(kernels):
    attention, q, k, v, meta = _attention_write(3, [2, 40, 1], 8, seed=2)
    meta.prefills = []
    with pytest.raises(IndexError, match="slot 40 of token 1 is outside the KV cache's 8 slots"):
        attention(q, k, v, meta)
    assert attention.kv_cache[:, :, 2].any() and attention.kv_cache[:, :, 1].any(), "the other tokens are written"
    assert not attention.kv_cache[:, :, [0, 3, 4, 5, 6, 7]].any(), "no other slot is touched"


def test_switch_and_build_failure_fall_back_to_torch(monkeypatch, caplog, tmp_path):
    cpu_fused._shipped_kernels.cache_clear()
    try:
        monkeypatch.setenv("PAGERAIL_CPU_FUSED", "torch")
        assert cpu_fused.fused_kernels() is None
        cpu_fused._shipped_kernels.cache_clear()
        monkeypatch.delenv("PAGERAIL_CPU_FUSED")

        def broken(source=None, cache_dir=None):
            raise KernelBuildError("cc: error: no such file")

        monkeypatch.setattr(cpu_fused, "build_fused_kernels", broken)
        with caplog.at_level(logging.WARNING, logger="pagerail.worker.layers.cpu_fused"):
            assert cpu_fused.fused_kernels() is None
        assert "cc: error: no such file" in caplog.text
        # The layers still compute, on the torch path.
        norm = RMSNorm(8)
        x = torch.randn(3, 8)
        torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    finally:
        cpu_fused._shipped_kernels.cache_clear()


def test_other_dtypes_stay_on_torch(kernels):
    norm = RMSNorm(16, dtype=torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert not cpu_fused.fits(x)
    assert norm(x).dtype == torch.bfloat16
