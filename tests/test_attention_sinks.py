"""Attention sinks (gpt-oss) on the CPU paths: the native kernel, both its builds, and the torch decode and prefill
paths of the attention layer, against an fp64 softmax whose denominator holds each head's sink."""

from __future__ import annotations

import pytest
import torch

from pagerail.worker.layers import cpu_paged_attention
from pagerail.worker.layers.attention import Attention, AttentionMetadata, PrefillSpan
from pagerail.worker.layers.cpu_paged_attention import NativeKernel, build_native_kernel, find_compiler
from tests.native_isa import source_without_avx512
from tests.requirements import require

NEEDS_COMPILER = "needs a C compiler (cc or gcc) for the native CPU attention kernel"


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict[str, NativeKernel]:
    """The shipped kernel (its AVX-512 paths where the compiler targets them) and its generic-loop build."""
    require(find_compiler(), NEEDS_COMPILER)
    scratch = tmp_path_factory.mktemp("generic")
    source = source_without_avx512("paged_attention_cpu.c", "PAGED_ATTENTION_NO_AVX512", scratch)
    return {"default": build_native_kernel(), "generic": build_native_kernel(source, scratch)}


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor | None, scale: float, softcap=0.0
) -> torch.Tensor:
    """One query row per head over its visible keys: q [H, d], keys/values [H, ctx, d] → [H, d] in fp64."""
    scores = torch.einsum("hd,htd->ht", q.double(), keys.double()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if sinks is not None:
        weights = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(-1)[:, :-1]
    else:
        weights = scores.softmax(-1)
    return torch.einsum("ht,htd->hd", weights, values.double())


@pytest.mark.parametrize("build", ["default", "generic"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window", "softcap"),
    [
        (8, 2, 64, 16, 0, 0.0),  # a shape the AVX-512 path specialises: sinks must send it to the generic loop
        (8, 2, 64, 16, 21, 0.0),
        (6, 2, 48, 4, 12, 1.5),
        (4, 4, 32, 8, 1, 0.0),
    ],
)
def test_native_kernel_counts_each_heads_sink_in_the_denominator(
    kernels, build, heads, kv_heads, head_dim, block_size, window, softcap
):
    kernel = kernels[build]
    generator = torch.Generator().manual_seed(heads * head_dim + window)
    lens = [1, 5, 23, 100, 130]
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 2
    pool = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(lens), max(blocks)), int(pool[-1]), dtype=torch.int64)
    taken = 0
    for row, count in enumerate(blocks):
        table[row, :count] = pool[taken : taken + count]
        taken += count
    key_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=generator)
    value_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=generator)
    q = torch.randn(len(lens), heads, head_dim, generator=generator)
    sinks = torch.randn(heads, generator=generator) * 2.0
    scale = head_dim**-0.5
    args = (q, key_cache, value_cache, table, torch.tensor(lens), block_size, scale, window, softcap)
    got = kernel.decode(*args, sinks)
    without = kernel.decode(*args)
    group = heads // kv_heads
    for row, length in enumerate(lens):
        positions = torch.arange(max(0, length - window) if window else 0, length)
        slots = table[row][positions // block_size] * block_size + positions % block_size
        keys = key_cache[:, slots].repeat_interleave(group, 0)
        values = value_cache[:, slots].repeat_interleave(group, 0)
        want = reference(q[row], keys, values, sinks, scale, softcap)
        torch.testing.assert_close(got[row].double(), want, rtol=1e-5, atol=1e-5)
    assert (got - without).abs().max() > 1e-2, "the sinks must change the answer"


def test_native_kernel_refuses_sinks_of_the_wrong_size(kernels):
    q, cache = torch.zeros(1, 4, 16), torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads=4\], got shape \(2,\)"):
        kernels["default"].decode(q, cache, cache, torch.zeros(1, 2, dtype=torch.long), torch.ones(1), 4, 1.0, 0, 0.0,
                                  torch.zeros(2))  # fmt: skip


BLOCK_SIZE, HEADS, KV_HEADS, DIM = 4, 4, 2, 16
LENGTH = 21  # tokens of one sequence: a fresh prefill of 9, a chunk of 11 after it, one decode
BLOCKS = [5, 2, 8, 0, 7, 3]


def _sequence(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(LENGTH, h * DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS))


def _steps(paged: bool):
    """The three steps' (rows, metadata) of one sequence, laid out as the input buffers lay them; `paged` adds
    each prefill row's table row and context length, the native kernel's one-call view of a step."""
    slots = torch.tensor([BLOCKS[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(LENGTH)])
    table = torch.tensor(BLOCKS)
    chunk_keys = torch.arange(20)[None, :]
    chunk_mask = chunk_keys <= torch.arange(9, 20)[:, None]
    fresh = AttentionMetadata(slot_mapping=slots[:9], block_size=BLOCK_SIZE, prefills=[PrefillSpan(0, 9)])
    chunk = AttentionMetadata(
        slot_mapping=slots[9:20], block_size=BLOCK_SIZE, prefills=[PrefillSpan(0, 11, table[:5], 20, chunk_mask)]
    )
    decode = AttentionMetadata(
        slot_mapping=slots[20:],
        block_size=BLOCK_SIZE,
        num_decodes=1,
        decode_block_table=table[None],
        decode_context_lens=torch.tensor([LENGTH]),
    )
    if paged:
        for meta, positions in ((fresh, range(9)), (chunk, range(9, 20))):
            meta.paged_block_table = table[None].repeat(len(positions), 1)
            meta.paged_context_lens = torch.tensor([p + 1 for p in positions])
    return [(slice(0, 9), fresh), (slice(9, 20), chunk), (slice(20, 21), decode)]


@pytest.mark.parametrize("path", ["torch", "native", "native_paged"])
@pytest.mark.parametrize("window", [None, 6])
def test_attention_layer_adds_sinks_on_every_cpu_path(monkeypatch, path, window):
    """A fresh prefill (SDPA's place, taken by the explicit softmax), a chunk over a cached prefix and a decode
    (torch gather or native kernel; or every row through the native kernel) against one causal reference over
    the whole sequence."""
    if path != "torch":
        require(find_compiler(), NEEDS_COMPILER)
    monkeypatch.setenv("PAGERAIL_CPU_ATTENTION", "torch" if path == "torch" else "native")
    cpu_paged_attention.native_kernel.cache_clear()
    try:
        generator = torch.Generator().manual_seed(3)
        q, k, v = _sequence(generator)
        sinks = torch.randn(HEADS, generator=generator) * 2.0
        attention = Attention(HEADS, KV_HEADS, DIM, DIM**-0.5, sliding_window=window)
        attention.kv_cache = torch.zeros(2, KV_HEADS, 10 * BLOCK_SIZE, DIM)
        got = torch.cat(
            [attention(q[rows], k[rows], v[rows], meta, sinks) for rows, meta in _steps(path == "native_paged")]
        )
    finally:
        cpu_paged_attention.native_kernel.cache_clear()
    group = HEADS // KV_HEADS
    keys = k.view(LENGTH, KV_HEADS, DIM).transpose(0, 1).repeat_interleave(group, 0)
    values = v.view(LENGTH, KV_HEADS, DIM).transpose(0, 1).repeat_interleave(group, 0)
    for position in range(LENGTH):
        first = 0 if window is None else max(0, position - window + 1)
        visible = slice(first, position + 1)
        want = reference(q[position].view(HEADS, DIM), keys[:, visible], values[:, visible], sinks, DIM**-0.5)
        torch.testing.assert_close(got[position].view(HEADS, DIM).double(), want, rtol=1e-5, atol=1e-5)
