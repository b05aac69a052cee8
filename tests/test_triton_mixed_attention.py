"""The Triton mixed-batch paged-attention kernel, run by triton's CPU interpreter, against a plain-torch reference."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from pagerail.common.sampling_params import SamplingParams
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.input_buffers import InputBuffers
from pagerail.worker.request_state import RequestState
from pagerail.worker.step_inputs import prepare_step
from tests.requirements import TRITON_REQUIRED, require_module
from tests.triton_interpreter import interpreted_report

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # (context length, query length) per sequence: the queries are the context's last positions.
    seqs: tuple[tuple[int, int], ...]
    dtype: str = "float32"
    index_dtype: str = "int32"
    atol: float = 1e-5
    window: int = 0  # > 0: the query at p sees keys p - window + 1 .. p only
    softcap: float = 0.0  # > 0: scores pass through softcap * tanh(score / softcap)
    sinks: bool = False  # a random per-head sink logit joins each softmax's denominator (gpt-oss)


CASES = [
    Case("decodes_only", 4, 4, 32, 16, ((1, 1), (17, 1), (40, 1), (64, 1))),
    Case("fresh_prefills_gqa3", 6, 2, 64, 4, ((23, 23), (5, 5), (2, 2), (70, 70))),
    # Chunks starting at 24 and 13 with blocks of 16: the first query sits mid-block.
    Case("prefix_hits_mid_block_gqa4", 8, 2, 32, 16, ((37, 13), (20, 7), (90, 77))),
    # Chunks starting exactly on block boundaries, and one ending on one.
    Case("block_boundaries", 4, 2, 32, 16, ((32, 16), (48, 32), (16, 16), (65, 1))),
    Case("mixed_head_dim_80_gqa4", 4, 1, 80, 8, ((9, 1), (70, 70), (50, 21), (130, 1), (10, 0))),
    # A chunk crossing position 128 inside one block of 128 tokens, and a decode past it.
    Case("block_128_gqa1", 2, 2, 32, 128, ((200, 90), (1, 1), (129, 129), (300, 1))),
    Case("int64_indices", 6, 2, 32, 16, ((100, 3), (3, 3), (45, 1)), index_dtype="int64"),
    Case("fp16_mixed", 8, 2, 64, 16, ((9, 1), (150, 40), (33, 33)), dtype="float16", atol=3e-3),
    Case("bf16_mixed", 6, 2, 80, 4, ((9, 1), (75, 30), (33, 33)), dtype="bfloat16", atol=2e-2),
    # Sliding windows: shorter than a chunk, starting mid-block and mid-tile, and 1 (each query sees itself).
    Case("window_chunks", 4, 2, 32, 16, ((90, 77), (37, 13), (200, 1), (5, 5)), window=19),
    Case("window_1_fp16", 8, 2, 64, 4, ((9, 1), (75, 30), (33, 33)), dtype="float16", atol=3e-3, window=1),
    Case("softcap_window", 4, 2, 32, 16, ((90, 77), (37, 13), (200, 1)), window=19, softcap=1.5),
    Case("softcap_full", 6, 2, 64, 4, ((9, 1), (75, 30), (33, 33)), softcap=2.0),
    # gpt-oss's sinks: with a window (alternating layers), without, in fp16, and beside an empty query range.
    Case("sinks_window", 4, 2, 32, 16, ((90, 77), (37, 13), (200, 1), (5, 5)), window=19, sinks=True),
    Case("sinks_full_gqa3", 6, 2, 64, 4, ((9, 1), (75, 30), (33, 33), (10, 0)), sinks=True),
    Case("sinks_fp16", 8, 2, 64, 16, ((9, 1), (150, 40), (33, 33)), dtype="float16", atol=3e-3, sinks=True),
]


def _random_layout(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables over a shuffled pool, so no sequence owns contiguous or ascending block ids."""
    blocks_per_seq = [-(-context // case.block_size) for context, _ in case.seqs]
    max_blocks = max(blocks_per_seq) + 2  # spare columns: the table is wider than any context
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold values the kernel must never read
    pool = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros((len(case.seqs), max_blocks), dtype=torch.int32)
    taken = 0
    for row, count in enumerate(blocks_per_seq):
        table[row, :count] = pool[taken : taken + count].to(torch.int32)
        # Padding points at a real block: a read past the context would then show up as a wrong answer.
        table[row, count:] = int(pool[-1])
        taken += count
    return table, num_blocks


def reference_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's context slot by slot; fp64 causal softmax of its queries over it (over the last
    `window` positions up to each query when > 0, of softcapped scores when softcap > 0, with each head's sink
    logit in the denominator when given)."""
    group = q.shape[1] // key_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = query_starts.tolist()
    for seq, length in enumerate(context_lens.tolist()):
        first, last = starts[seq], starts[seq + 1]
        if first == last:
            continue
        positions = torch.arange(length)
        slots = block_tables[seq].long()[positions // block_size] * block_size + positions % block_size
        keys = key_cache[slots].double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = value_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[first:last].double(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_positions = torch.arange(length - (last - first), length)
        hidden = positions[None, :] > query_positions[:, None]  # [q, ctx]: keys after the query
        if window:
            hidden |= positions[None, :] <= query_positions[:, None] - window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        if sinks is not None:
            column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
            weights = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            weights = scores.softmax(dim=-1)
        out[first:last] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def _max_error(case: Case, seed: int = 0) -> float:
    """Run one case through the kernel; needs TRITON_INTERPRET=1 set before triton was imported."""
    from pagerail.worker.layers.triton_mixed_attention import paged_mixed_attention, triton_available

    assert triton_available("cpu"), "the interpreter must be on for CPU tensors"
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    index_dtype = getattr(torch, case.index_dtype)
    block_tables, num_blocks = _random_layout(case, generator)
    cache_shape = (case.num_kv_heads, num_blocks * case.block_size, case.head_dim)
    # The worker's cache is head-major; the kernel reads it as [slots, kv_heads, head_dim] through strides.
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype).transpose(0, 1)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype).transpose(0, 1)
    query_lens = torch.tensor([query for _, query in case.seqs])
    query_starts = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]).to(index_dtype)
    context_lens = torch.tensor([context for context, _ in case.seqs], dtype=index_dtype)
    q = torch.randn((int(query_lens.sum()), case.num_heads, case.head_dim), generator=generator).to(dtype)
    block_tables = block_tables.to(index_dtype)
    scale = case.head_dim**-0.5

    # Sinks of the scores' size, so they take a real share of each softmax.
    sinks = torch.randn(case.num_heads, generator=generator) * 2.0 if case.sinks else None

    args = (q, key_cache, value_cache, block_tables, query_starts, context_lens, case.block_size, scale)
    got = paged_mixed_attention(*args, case.window, case.softcap, sinks)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference_attention(*args, case.window, case.softcap, sinks)
    return (got.double() - want).abs().max().item()


def _report() -> None:
    """Entry point of the interpreter subprocess: one JSON line of {case name: max abs error}."""
    print(json.dumps({case.name: _max_error(case) for case in CASES}))


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    return interpreted_report("tests.test_triton_mixed_attention")


@pytest.mark.slow  # the Triton interpreter, in a child process
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_kernel_matches_reference(case: Case, interpreter_errors: dict[str, float]) -> None:
    error = interpreter_errors[case.name]
    assert error <= case.atol, f"{asdict(case)}: max abs error {error:.3g}"


def _valid_inputs() -> dict[str, object]:
    """A well-formed call: two sequences (a decode and a 3-token chunk) over blocks of 4, GQA 2."""
    return dict(
        q=torch.zeros(4, 4, 16),
        key_cache=torch.zeros(32, 2, 16),
        value_cache=torch.zeros(32, 2, 16),
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        query_starts=torch.tensor([0, 1, 4], dtype=torch.int32),
        context_lens=torch.tensor([5, 7], dtype=torch.int32),
        block_size=4,
        scale=0.25,
    )


BAD_INPUTS = [
    ("q", torch.zeros(4, 64), "q must be"),
    ("key_cache", torch.zeros(32, 2, 8), "key/value cache"),
    ("q", torch.zeros(4, 5, 16), "5 query heads cannot share 2 KV heads"),
    ("block_size", 6, "power of two"),
    ("value_cache", torch.zeros(32, 2, 16, dtype=torch.float16), "one dtype"),
    ("key_cache", torch.zeros(32, 16, 2).transpose(1, 2), "contiguous in head_dim"),
    ("context_lens", torch.tensor([5.0, 7.0]), "context_lens must be int32 or int64"),
    ("query_starts", torch.tensor([0, 4], dtype=torch.int32), r"query_starts \[S \+ 1\]"),
    ("block_tables", torch.zeros(3, 3, dtype=torch.int32), r"block_tables must be \[2, max_blocks\]"),
    ("query_starts", torch.tensor([0, 1, 3], dtype=torch.int32), "run from 0 to the 4 query tokens"),
    ("context_lens", torch.tensor([5, 2], dtype=torch.int32), "sequence 1"),
    ("block_tables", torch.zeros(2, 1, dtype=torch.int32), "exceeds the block table's 4 slots"),
    ("sinks", torch.zeros(3), r"sinks must be float \[num_heads=4\], got torch.float32 \(3,\)"),
]


@pytest.mark.parametrize(("argument", "value", "message"), BAD_INPUTS, ids=[f"{a}-{m}" for a, _, m in BAD_INPUTS])
def test_launcher_rejects_bad_inputs(argument: str, value: object, message: str) -> None:
    require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)
    # Validation runs before any launch, so this process needs no interpreter.
    from pagerail.worker.layers.triton_mixed_attention import paged_mixed_attention

    with pytest.raises(ValueError, match=message):
        paged_mixed_attention(**{**_valid_inputs(), argument: value})


def _state(handle: int, num_tokens: int, blocks: list[int], computed: int, scheduled: int) -> RequestState:
    return RequestState(
        handle=handle,
        token_ids=list(range(100 * handle, 100 * handle + num_tokens)),
        num_prompt_tokens=num_tokens,
        sampling=SamplingParams(),
        block_ids=blocks,
        num_computed_tokens=computed,
        generator=None,
        num_scheduled_tokens=scheduled,
    )


@pytest.mark.parametrize("in_place", [True, False])
def test_input_buffers_build_mixed_metadata(in_place: bool) -> None:
    """A step with a prefill gets the kernel's per-sequence indices and no dense mask; decode-only steps as before."""
    buffers = InputBuffers(4, torch.device("cpu"), max_num_seqs=2, max_blocks_per_seq=2, in_place=in_place)
    triton = AttentionSettings("triton")
    decode = _state(0, 10, [7, 3, 9], computed=9, scheduled=1)
    prefix_hit = _state(1, 14, [4, 11, 2, 8], computed=6, scheduled=7)  # a chunk from mid-block 1 to 12
    fresh = _state(2, 5, [5, 6], computed=0, scheduled=5)
    flat = prepare_step(buffers, triton, [prefix_hit, decode, fresh])
    meta = flat.attention
    assert meta.mixed_query_starts.tolist() == [0, 1, 8, 13]
    assert meta.mixed_context_lens.tolist() == [10, 13, 5]
    # Rows in batch order (decode first), each as wide as the longest context needs and zero past its blocks.
    assert meta.mixed_block_table.tolist() == [[7, 3, 9, 0], [4, 11, 2, 8], [5, 6, 0, 0]]
    assert meta.decode_block_table is None and meta.decode_context_lens is None
    assert [(span.start, span.end) for span in meta.prefills] == [(1, 8), (8, 13)]
    assert all(span.mask is None and span.context_blocks is None for span in meta.prefills)
    assert meta.slot_mapping.tolist() == [9 * 4 + 1, 11 * 4 + 2, 11 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2,
                                          2 * 4 + 3, 8 * 4, 20, 21, 22, 23, 24]  # fmt: skip
    assert flat.sample_rows.tolist() == [0, 7, 12]

    for state in flat.ordered:
        state.num_computed_tokens += state.num_scheduled_tokens
        state.num_scheduled_tokens = 1
    decode.token_ids.append(1)
    prefix_hit.token_ids.append(1)
    flat = prepare_step(buffers, triton, [decode, prefix_hit])
    meta = flat.attention
    assert meta.mixed_query_starts is None and meta.mixed_block_table is None
    assert meta.decode_block_table.tolist() == [[7, 3, 9, 0], [4, 11, 2, 8]]
    assert meta.decode_context_lens.tolist() == [11, 14]
