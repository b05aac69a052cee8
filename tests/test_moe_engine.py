"""Greedy parity of the engine with transformers' generate on tiny random mixture-of-experts checkpoints."""

from __future__ import annotations

import pytest

from pagerail import LLM
from tests.parity import compare, engine_greedy, reference_greedy
from tests.tiny_models import MOE_KINDS, make_tiny_model

NEW_TOKENS = 32
# Eight prompts of 1 to 70 tokens; the longer ones pass Mixtral's tiny sliding window of 24.
PROMPTS = [
    [5],
    [5, 6, 7, 8, 9],
    [3, 17, 29, 41] * 10,
    list(range(20, 90)),
    [100 + (i * 7) % 120 for i in range(23)],
    [200 - i for i in range(12)],
    [(i * i) % 249 for i in range(33)],
    [42, 7] * 9,
]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_greedy_matches_transformers(kind, tmp_path):
    model_dir = make_tiny_model(kind, tmp_path / kind)
    # A 16-token budget and 48 blocks of 4 force chunked prefill, and preemption on the way.
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=48, max_num_batched_tokens=16)
    report = compare(engine_greedy(llm, PROMPTS, NEW_TOKENS), reference_greedy(model_dir, PROMPTS, NEW_TOKENS))
    assert report.identical == report.total, report.divergences
    assert llm.stats.num_mixed_steps > 0
    # Mixtral's window lets go of the blocks that left it, so its sequences fit without preemption.
    assert llm.stats.num_preemptions > 0 or kind == "mixtral"
