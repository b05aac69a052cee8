"""The Triton paged decode kernel, run by triton's CPU interpreter, against a plain-torch gather + softmax."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import interpreted_report

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]
    dtype: str = "float32"
    partition_size: int | None = None
    index_dtype: str = "int32"
    atol: float = 1e-4
    window: int = 0  # > 0: a sliding-window layer's last `window` positions only
    softcap: float = 0.0  # > 0: scores pass through softcap * tanh(score / softcap)
    sinks: bool = False  # a random per-head sink logit joins each softmax's denominator (gpt-oss)


CASES = [
    Case("mha", 4, 4, 32, 16, (1, 17, 40)),
    Case("gqa3_small_blocks", 6, 2, 64, 4, (5, 23, 64)),
    Case("gqa4_head_dim_48", 8, 2, 48, 8, (3, 33, 70)),
    Case("gqa4_blocks_wider_than_tile", 4, 1, 32, 128, (1, 130, 200)),
    Case("gqa4_split_context", 8, 2, 32, 16, (150, 1, 64, 129), partition_size=64),
    Case("gqa3_split_head_dim_80", 3, 1, 80, 8, (7, 191), partition_size=64),
    Case("int64_tables_split", 6, 2, 32, 16, (100, 3), partition_size=64, index_dtype="int64"),
    Case("bf16", 8, 2, 64, 16, (9, 50), dtype="bfloat16", atol=2e-2),
    Case("fp16_split", 8, 2, 64, 16, (9, 150), dtype="float16", partition_size=64, atol=2e-3),
    # A window that starts mid-block, one longer than some contexts, and one wholly past early partitions.
    Case("window_mid_block", 6, 2, 32, 16, (5, 23, 100), window=21),
    Case("window_split", 8, 2, 32, 16, (150, 1, 64, 300), partition_size=64, window=70),
    Case("window_1_bf16", 8, 2, 64, 4, (9, 50), dtype="bfloat16", atol=2e-2, window=1),
    # Gemma 2's softcap, small enough to bind on these scores, with and without a split and a window.
    Case("softcap", 6, 2, 32, 16, (5, 23, 100), softcap=1.5),
    Case("softcap_split_window", 8, 2, 32, 16, (150, 1, 300), partition_size=64, window=70, softcap=2.0),
    # gpt-oss's sinks: whole contexts, split ones (the reduce counts the sink once; partitions before the window
    # are empty), with a window and in bf16.
    Case("sinks", 6, 2, 32, 16, (1, 23, 100), sinks=True),
    Case("sinks_split", 8, 2, 32, 16, (150, 1, 64, 129), partition_size=64, sinks=True),
    Case("sinks_split_window", 8, 2, 64, 16, (150, 1, 300), partition_size=64, window=70, sinks=True),
    Case("sinks_window_bf16", 8, 2, 64, 4, (9, 50), dtype="bfloat16", atol=2e-2, window=12, sinks=True),
]


def _random_layout(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables over a shuffled pool, so no sequence owns contiguous or ascending block ids."""
    blocks_per_seq = [-(-length // case.block_size) for length in case.context_lens]
    max_blocks = max(blocks_per_seq) + 1  # a spare column: the table is wider than any context
    num_blocks = sum(blocks_per_seq) + 5  # spare blocks hold garbage the kernel must never read
    pool = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros((len(case.context_lens), max_blocks), dtype=torch.int32)
    taken = 0
    for row, count in enumerate(blocks_per_seq):
        table[row, :count] = pool[taken : taken + count].to(torch.int32)
        # Padding points at a real block: a masked-off read would then show up as a wrong answer.
        table[row, count:] = int(pool[-1])
        taken += count
    return table, num_blocks


def _reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's context slot by slot (its last `window` positions when > 0) and run an fp64 softmax
    over it (of softcapped scores when softcap > 0, with each head's sink logit in the denominator when given)."""
    group = q.shape[1] // key_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for seq, length in enumerate(context_lens.tolist()):
        positions = torch.arange(max(0, length - window) if window else 0, length)
        slots = block_tables[seq].long()[positions // block_size] * block_size + positions % block_size
        keys = key_cache[slots].double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = value_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[seq].double(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            weights = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(dim=-1)[:, :-1]
        else:
            weights = scores.softmax(dim=-1)
        out[seq] = torch.einsum("ht,thd->hd", weights, values)
    return out


def _max_error(case: Case, seed: int = 0) -> float:
    """Run one case through the kernel; needs TRITON_INTERPRET=1 set before triton was imported."""
    from pagerail.worker.layers.triton_attention import paged_decode_attention, triton_available

    assert triton_available("cpu"), "the interpreter must be on for CPU tensors"
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    block_tables, num_blocks = _random_layout(case, generator)
    num_slots = num_blocks * case.block_size
    cache_shape = (num_slots, case.num_kv_heads, case.head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    q = torch.randn((len(case.context_lens), case.num_heads, case.head_dim), generator=generator).to(dtype)
    index_dtype = getattr(torch, case.index_dtype)
    block_tables = block_tables.to(index_dtype)
    context_lens = torch.tensor(case.context_lens, dtype=index_dtype)
    scale = case.head_dim**-0.5
    # Sinks of the scores' size, so they take a real share of each softmax.
    sinks = torch.randn(case.num_heads, generator=generator) * 2.0 if case.sinks else None

    got = paged_decode_attention(
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        case.block_size,
        scale,
        case.window,
        case.softcap,
        sinks,
        partition_size=case.partition_size,
    )
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(
        q, key_cache, value_cache, block_tables, context_lens, case.block_size, scale, case.window, case.softcap, sinks
    )
    return (got.double() - want).abs().max().item()


def _report() -> None:
    """Entry point of the interpreter subprocess: one JSON line of {case name: max abs error}."""
    print(json.dumps({case.name: _max_error(case) for case in CASES}))


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    return interpreted_report("tests.test_triton_attention")


@pytest.mark.slow  # the Triton interpreter, in a child process
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_kernel_matches_reference(case: Case, interpreter_errors: dict[str, float]) -> None:
    error = interpreter_errors[case.name]
    assert error <= case.atol, f"{asdict(case)}: max abs error {error:.3g}"


@pytest.mark.slow
def test_module_imports_and_reports_without_triton() -> None:
    # A CPU-only install has no triton: the module must still import, and report the kernel as unavailable.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from pagerail.worker.layers.triton_attention import triton_available\n"
        "assert not triton_available('cpu') and not triton_available('cuda')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-4000:]
