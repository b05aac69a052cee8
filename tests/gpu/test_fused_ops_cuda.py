"""CUDA-only checks: the fused norm / RoPE / SiLU kernels against the torch path at real shapes, and a forward."""

from __future__ import annotations

import pytest
import torch

from tests.requirements import TRITON_REQUIRED, require_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Half precision: the kernels round every intermediate as eager torch does, so only the sum of squares (another
# order) and exp (another implementation) can move a value, by a unit of its last place, doubled at most by
# the multiply that follows. float32: those differences, and fused multiply-adds, checked relatively.
HALF_ULPS = 2


@pytest.fixture(autouse=True)
def fused():
    require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)
    from pagerail.worker.layers import triton_fused

    assert triton_fused.ENABLED, "PAGERAIL_FUSED_OPS must not be off for these checks"
    assert triton_fused.fused_available(torch.zeros(1, device="cuda"))
    return triton_fused


def _torch_path(triton_fused, fn, *args):
    triton_fused.ENABLED = False
    try:
        return fn(*args)
    finally:
        triton_fused.ENABLED = True


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    from tests.test_fused_ops import _ulps

    assert got.dtype == want.dtype and got.shape == want.shape and got.is_cuda
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        ulps = _ulps(got.cpu(), want.cpu())
        assert ulps <= HALF_ULPS, f"{ulps} units in the last place from torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 8192])
@pytest.mark.parametrize("hidden", [4096, 576, 5120])
def test_add_and_norm(fused, dtype, tokens, hidden):
    from pagerail.worker.layers.norm import RMSNorm

    torch.manual_seed(tokens + hidden)
    norm = RMSNorm(hidden, 1e-5, dtype).cuda()
    norm.weight.data.copy_(torch.randn(hidden) * 0.3 + 1)
    x = (torch.randn(tokens, hidden, device="cuda") * 4).to(dtype)
    residual = (torch.randn(tokens, hidden, device="cuda") * 4).to(dtype)
    _assert_matches(norm(x), _torch_path(fused, norm, x))
    want, want_residual = _torch_path(fused, norm, x, residual)
    buffer = residual.clone()
    got, got_residual = norm(x, buffer)
    assert got_residual.data_ptr() == buffer.data_ptr()
    # The add is one rounding of the exact sum on both paths: equal bit for bit.
    assert torch.equal(got_residual, want_residual)
    _assert_matches(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_on_a_qkv_view(fused, dtype):
    from pagerail.worker.layers.norm import RMSNorm

    torch.manual_seed(0)
    tokens, heads, kv_heads, head_dim = 8192, 32, 8, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    norm = RMSNorm(head_dim, 1e-6, dtype).cuda()
    norm.weight.data.copy_(torch.randn(head_dim) * 0.3 + 1)
    _assert_matches(norm(q), _torch_path(fused, norm, q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 300, 8192])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64), (40, 8, 128)])
def test_rotary(fused, dtype, tokens, heads, kv_heads, head_dim):
    from pagerail.worker.layers.rotary import RotaryEmbedding

    torch.manual_seed(tokens)
    max_position = 131072
    rope = RotaryEmbedding(head_dim, max_position, {"rope_type": "default", "rope_theta": 500000.0}).cuda()
    positions = torch.randint(0, max_position, (tokens,), device="cuda")
    positions[0] = max_position - 1
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (torch.randn(tokens, q_size + 2 * kv_size, device="cuda") * 2).to(dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_k = _torch_path(fused, rope, positions, q, k)
    for got_q, got_k in (rope(positions, q, k), rope.apply(q, k, rope.tables(positions))):
        if dtype == torch.float32:
            _assert_matches(got_q, want_q)
            _assert_matches(got_k, want_k)
        else:  # products of two half values are exact in float32, so every rounding is torch's
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 8192])
@pytest.mark.parametrize("d", [14336, 1536])
def test_silu_and_mul(fused, dtype, tokens, d):
    from pagerail.worker.layers.activation import SiluAndMul

    torch.manual_seed(d)
    act = SiluAndMul()
    x = (torch.randn(tokens, 2 * d, device="cuda") * 3).to(dtype)
    _assert_matches(act(x), _torch_path(fused, act, x))


def test_kernels_replay_in_a_cuda_graph(fused):
    # The model runner captures decode steps in CUDA graphs; the kernels must capture and replay.
    from pagerail.worker.layers.activation import SiluAndMul
    from pagerail.worker.layers.norm import RMSNorm
    from pagerail.worker.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    tokens, hidden, head_dim = 16, 4096, 128
    norm = RMSNorm(hidden, 1e-5, torch.bfloat16).cuda()
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0}).cuda()
    act = SiluAndMul()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    positions = torch.arange(tokens, device="cuda")

    def step():
        normed, summed = norm(x, residual.clone())
        q, _ = rope(positions, normed, normed[:, : 8 * head_dim])  # 32 query heads, 8 key heads
        return act(q), summed

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    positions.copy_(torch.randint(0, 4096, (tokens,), device="cuda"))
    graph.replay()
    eager = step()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize(("dtype", "allowed"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 1e-2)])
def test_forward_with_fused_ops_matches_forward_without(fused, kind, dtype, allowed):
    from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan
    from tests.test_fused_ops import _random_model

    model = _random_model(kind, dtype).cuda()
    tokens = 200
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
    positions = torch.arange(tokens, device="cuda")

    def prefill():
        for layer in model.attention_layers():
            shape = (2, model.num_kv_heads_per_rank, tokens, model.head_dim)
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device="cuda")
        meta = AttentionMetadata(slot_mapping=positions, prefills=[PrefillSpan(0, tokens)])
        with torch.inference_mode():
            return model(ids, positions, meta).float()

    got = prefill()
    want = _torch_path(fused, prefill)
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() <= allowed
