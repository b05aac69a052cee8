"""Engine parity on tiny random-weight Llama, Qwen2 and Qwen3 checkpoints built from transformers configs."""

from __future__ import annotations

import pytest

from pagerail import LLM
from tests.parity import compare, engine_greedy, reference_greedy
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [3, 17, 29, 41] * 10, list(range(20, 90)), [100 + (i * 7) % 120 for i in range(23)]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(kind, tmp_path):
    model_dir = make_tiny_model(kind, tmp_path / kind)
    # A 16-token budget and 24 blocks of 4 force chunked prefill and preemption on the way.
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16)
    report = compare(engine_greedy(llm, PROMPTS, 24), reference_greedy(model_dir, PROMPTS, 24))
    assert report.identical == report.total, report.divergences
    assert llm.stats.num_preemptions > 0 and llm.stats.num_mixed_steps > 0
    assert llm.engine.block_table.num_free_blocks == llm.engine.block_table.num_blocks


def test_top_k_off_is_the_same_whichever_way_it_is_spelled(tmp_path):
    from pagerail import SamplingParams

    llm = LLM(str(make_tiny_model("llama", tmp_path / "llama")), block_size=4, num_gpu_blocks=64)
    runs = {
        top_k: [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, top_k=top_k))
        ]
        for top_k in (-1, 0)
    }
    assert runs[-1] == runs[0]
    limited = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, top_k=2))
    assert [o.outputs[0].token_ids for o in limited] != runs[0]  # top_k does reach the sampler
