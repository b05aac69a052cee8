"""The engine with attention through the Triton paged kernels (decode, mixed batch) under the CPU interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.requirements import TRITON_REQUIRED, require_module
from tests.triton_interpreter import run_interpreted

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow

require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 8
# Two full blocks and a partial one shared by every prompt of the second batch: prefix-cache hits of 16 tokens.
SHARED = [20 + (i * 13) % 200 for i in range(21)]
FIRST = SHARED + [7, 8, 9]
PROMPTS = [SHARED + [30 + i] * (i + 2) for i in range(3)] + [list(range(40, 77))]


def test_engine_parity_through_triton_kernel():
    result = run_interpreted(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine_tiny.py", "-k", "llama"],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout


def _greedy_tokens(model_dir: str) -> tuple[list[list[int]], object]:
    """Greedy tokens of FIRST, then of PROMPTS once FIRST's blocks are cached; a 13-token budget chunks prompts
    at offsets that are not multiples of the block size."""
    from pagerail import LLM, SamplingParams

    llm = LLM(model_dir, block_size=BLOCK_SIZE, num_gpu_blocks=64, max_num_batched_tokens=13)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([FIRST], params) + llm.generate(PROMPTS, params)
    return [list(output.outputs[0].token_ids) for output in outputs], llm.stats


def _mixed_report(model_dir: str) -> None:
    """Entry point of the interpreter subprocess: greedy tokens and what ran, as one JSON line."""
    import torch.nn.functional as F

    import pagerail.worker.layers.attention as attention
    from pagerail.worker.model_runner import ModelRunner

    counts = {"mixed": 0, "decode": 0, "sdpa": 0, "masks": 0, "mid_block_chunks": 0, "decodes_in_mixed": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return wrapper

    mixed = attention.paged_mixed_attention

    def mixed_spy(q, key_cache, value_cache, block_tables, query_starts, context_lens, block_size, scale, *options):
        counts["mixed"] += 1
        lens = query_starts.diff().tolist()
        for query_len, context_len in zip(lens, context_lens.tolist(), strict=True):
            counts["mid_block_chunks"] += query_len > 1 and (context_len - query_len) % block_size != 0
            counts["decodes_in_mixed"] += query_len == 1
        return mixed(q, key_cache, value_cache, block_tables, query_starts, context_lens, block_size, scale, *options)

    prepare = ModelRunner.prepare

    def prepare_spy(self, batch):
        flat = prepare(self, batch)
        if flat is not None:
            counts["masks"] += sum(span.mask is not None for span in flat.attention.prefills)
        return flat

    attention.paged_mixed_attention = mixed_spy
    attention.paged_decode_attention = counted("decode", attention.paged_decode_attention)
    F.scaled_dot_product_attention = counted("sdpa", F.scaled_dot_product_attention)
    ModelRunner.prepare = prepare_spy
    tokens, stats = _greedy_tokens(model_dir)
    counts.update(prefix_hit_tokens=stats.num_prefix_hit_tokens, mixed_steps=stats.num_mixed_steps)
    print(json.dumps({"tokens": tokens, "counts": counts}))


def test_chunked_prefill_and_prefix_hits_through_mixed_kernel(tmp_path):
    from tests.tiny_models import make_tiny_model

    model_dir = str(make_tiny_model("llama", tmp_path / "llama"))
    result = run_interpreted(
        ["-c", f"from tests.test_engine_triton import _mixed_report; _mixed_report({model_dir!r})"],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counts = report["counts"]
    # Every prefill went through the mixed kernel, without a dense mask or an SDPA call.
    assert counts["mixed"] > 0 and counts["sdpa"] == 0 and counts["masks"] == 0, counts
    assert counts["mid_block_chunks"] > 0 and counts["decodes_in_mixed"] > 0, counts
    assert counts["decode"] > 0, counts  # decode-only steps keep the decode kernel
    assert counts["prefix_hit_tokens"] >= 3 * 2 * BLOCK_SIZE and counts["mixed_steps"] > 0, counts

    # This process never set TRITON_INTERPRET: the same run takes the CPU attention path.
    from pagerail.worker.layers.triton_attention import triton_available

    assert not triton_available("cpu")
    tokens, stats = _greedy_tokens(model_dir)
    assert stats.num_prefix_hit_tokens == counts["prefix_hit_tokens"]
    assert report["tokens"] == tokens
