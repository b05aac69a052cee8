"""CUDA-only checks of the Triton mixed-batch paged-attention kernel: fp32/fp16/bf16 against an fp64 torch reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _layout(
    seqs: list[tuple[int, int]], block_size: int, index_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Query starts, context lengths and a shuffled block table (one spare column) for (context, query) pairs."""
    generator = torch.Generator().manual_seed(1)
    blocks_per_seq = [-(-context // block_size) for context, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 4  # spare blocks the kernel must never read
    pool = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(seqs), max(blocks_per_seq) + 1), int(pool[-1]), dtype=torch.long)
    taken = 0
    for row, count in enumerate(blocks_per_seq):
        table[row, :count] = pool[taken : taken + count]
        taken += count
    query_lens = torch.tensor([query for _, query in seqs])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
    context_lens = torch.tensor([context for context, _ in seqs])
    to_device = dict(device="cuda", dtype=index_dtype)
    return starts.to(**to_device), context_lens.to(**to_device), table.to(**to_device), num_blocks


def _reference(q, key_cache, value_cache, table, starts, context_lens, block_size, scale) -> torch.Tensor:
    """fp64 gather of each context slot by slot, causal softmax of the sequence's last positions over it."""
    group = q.shape[1] // key_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    bounds = starts.tolist()
    for seq, length in enumerate(context_lens.tolist()):
        first, last = bounds[seq], bounds[seq + 1]
        positions = torch.arange(length, device=q.device)
        slots = table[seq].long()[positions // block_size] * block_size + positions % block_size
        keys = key_cache[slots].double().repeat_interleave(group, dim=1)
        values = value_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[first:last].double(), keys) * scale
        query_positions = torch.arange(length - (last - first), length, device=q.device)
        scores = scores.masked_fill((positions[None, :] > query_positions[:, None])[None], float("-inf"))
        out[first:last] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
    return out


def _run(heads, kv_heads, head_dim, block_size, seqs, dtype, index_dtype=torch.long):
    from pagerail.worker.layers.triton_mixed_attention import paged_mixed_attention

    torch.manual_seed(0)
    starts, context_lens, table, num_blocks = _layout(seqs, block_size, index_dtype)
    # Head-major like the worker's cache, read as [slots, kv_heads, head_dim] through strides.
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, device="cuda", dtype=dtype)
    key_cache, value_cache = cache[0].transpose(0, 1), cache[1].transpose(0, 1)
    q = torch.randn(int(starts[-1]), heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim**-0.5
    got = paged_mixed_attention(q, key_cache, value_cache, table, starts, context_lens, block_size, scale)
    torch.cuda.synchronize()
    want = _reference(q, key_cache, value_cache, table, starts, context_lens, block_size, scale)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


# (context, queries): decodes (one a context of 8200), a 1000-token chunk starting mid-block after an 8229-token
# prefix, a fresh 517-token prefill, and a chunk that starts and ends on block boundaries.
LONG_MIXED = [(1, 1), (300, 1), (8229, 1000), (8200, 1), (517, 517), (96, 64), (33, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_long_mixed_batch_llama_shapes(dtype):
    _run(32, 8, 128, 16, LONG_MIXED, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_long_prefill_chunk_of_8192_with_decodes(dtype):
    # The whole 8192-token context computed in one chunk (every causal tile shape), next to two decodes.
    _run(8, 2, 64, 16, [(8192, 8192), (5000, 1), (7, 1)], dtype)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(12, 4, 80, 128), (28, 4, 128, 32), (16, 16, 64, 16), (8, 1, 256, 16)],
    ids=["gqa3-d80-bs128", "gqa7-d128", "mha-d64", "gqa8-d256"],
)
def test_shapes_with_int32_indices(heads, kv_heads, head_dim, block_size):
    seqs = [(1, 1), (200, 130), (129, 129), (300, 1), (77, 13)]
    _run(heads, kv_heads, head_dim, block_size, seqs, torch.bfloat16, index_dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_attention_layer_mixed_path_matches_sdpa_spans(dtype):
    """Attention.forward through the mixed kernel against its per-span SDPA path, both writing K/V first."""
    from pagerail.worker.layers.attention import Attention, AttentionMetadata, PrefillSpan

    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 16, 4, 128, 16
    seqs = [(2100, 300), (40, 40), (512, 17)]  # prefill chunks only: the SDPA path has no decode rows then
    starts, context_lens, table, num_blocks = _layout(seqs, block_size, torch.long)
    slots, spans = [], []
    for seq, (context, queries) in enumerate(seqs):
        positions = torch.arange(context - queries, context, device="cuda")
        slots.append(table[seq][positions // block_size] * block_size + positions % block_size)
        span = PrefillSpan(int(starts[seq]), int(starts[seq + 1]))
        if context > queries:
            span.context_blocks = table[seq, : -(-context // block_size)]
            span.context_len = context
            keys = torch.arange(context, device="cuda")
            span.mask = keys[None, :] <= positions[:, None]
        spans.append(span)
    slot_mapping = torch.cat(slots)
    num_tokens = slot_mapping.numel()
    q = torch.randn(num_tokens, heads * head_dim, device="cuda", dtype=dtype)
    k = torch.randn(num_tokens, kv_heads * head_dim, device="cuda", dtype=dtype)
    v = torch.randn(num_tokens, kv_heads * head_dim, device="cuda", dtype=dtype)
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, device="cuda", dtype=dtype)
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5)

    layer.kv_cache = cache.clone()
    mixed = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_size=block_size,
        mixed_query_starts=starts,
        mixed_context_lens=context_lens,
        mixed_block_table=table,
        prefills=[PrefillSpan(span.start, span.end) for span in spans],
    )
    got = layer(q, k, v, mixed)
    layer.kv_cache = cache.clone()
    want = layer(q, k, v, AttentionMetadata(slot_mapping=slot_mapping, block_size=block_size, prefills=spans))
    tolerance = TOLERANCE[dtype] if dtype != torch.float32 else 2e-3  # SDPA may use TF32 for fp32
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
