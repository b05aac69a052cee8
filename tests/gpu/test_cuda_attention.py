"""CUDA-only checks: the Triton paged decode kernel against the SDPA path, and a bf16 engine run."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_decode_matches_sdpa(dtype):
    from pagerail.worker.layers.attention import Attention, AttentionMetadata

    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 32, 8, 128, 16, 512
    lens = torch.tensor([1, 17, 300, 2049, 64], device="cuda")
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    table = torch.stack([torch.randperm(num_blocks, device="cuda")[:max_blocks] for _ in lens])
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, device="cuda", dtype=dtype)
    q = torch.randn(len(lens), heads * head_dim, device="cuda", dtype=dtype)
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
    layer.kv_cache = cache
    mask = torch.arange(max_blocks * block_size, device="cuda")[None, :] < lens[:, None]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device="cuda"),
        block_size=block_size,
        num_decodes=len(lens),
        decode_block_table=table,
        decode_context_lens=lens,
        decode_mask=mask[:, None, None, :],
    )
    q3 = q.view(len(lens), heads, head_dim)
    kernel = layer._decode(q3, cache[0], cache[1], meta)
    import pagerail.worker.layers.attention as attention

    original = attention.triton_available
    attention.triton_available = lambda device: False
    try:
        reference = layer._decode(q3, cache[0], cache[1], meta)
    finally:
        attention.triton_available = original
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), reference.float(), atol=tolerance, rtol=tolerance)


def test_engine_bf16_on_cuda(smollm2_dir):
    from pagerail import LLM, SamplingParams

    llm = LLM(str(smollm2_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    outputs = llm.generate(["The capital of France is"] * 4, SamplingParams(temperature=0.0, max_tokens=16))
    texts = {o.outputs[0].text for o in outputs}
    assert len(texts) == 1 and "Paris" in texts.pop()
