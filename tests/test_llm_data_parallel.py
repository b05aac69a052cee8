"""`LLM(data_parallel_size=N)`: replicas on Ray share each batch by prefix-aware routing and give the tokens a single
in-process replica gives; the n choices of one prompt stay on one replica."""

from __future__ import annotations

import pytest

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")

from pagerail import LLM, SamplingParams  # noqa: E402
from tests.ray_start import start_ray  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

SHARED = [7, 11, 13, 17] * 6
PROMPTS = [SHARED + [p + 20] * (3 + p % 4) for p in range(4)]
PROMPTS += [[(p * 13 + i) % 200 + 3 for i in range(9)] for p in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_replicas_share_a_batch_and_match_one_replica(tmp_path):
    model_dir = str(make_tiny_model("llama", tmp_path / "llama"))
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(model_dir, data_parallel_size=0)
    alone = LLM(model_dir, block_size=4, num_gpu_blocks=256)
    expected = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, GREEDY)]
    start_ray(num_cpus=2, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(model_dir, block_size=4, num_gpu_blocks=256, data_parallel_size=2)
        try:
            outputs = llm.generate(PROMPTS, GREEDY)
            assert [o.outputs[0].token_ids for o in outputs] == expected
            routed = llm.stats["router"]["num_routed"]
            assert len(routed) == 2 and sum(routed.values()) == len(PROMPTS)  # both replicas took a share
            # The four prompts behind one shared prefix go where it is cached: one replica.
            llm.generate(PROMPTS[:4], GREEDY)
            after = llm.stats["router"]["num_routed"]
            assert sorted(after[name] - routed[name] for name in after) == [0, 4]
            (choices,) = llm.generate([PROMPTS[5]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
            assert len(choices.outputs) == 3 and all(len(c.token_ids) == 6 for c in choices.outputs)
            last = llm.stats["router"]["num_routed"]
            assert sorted(last[name] - after[name] for name in last) == [0, 3]  # siblings stay together
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()


def test_the_placement_strategy_reaches_the_cluster_options(tmp_path):
    """`LLM(placement_strategy=...)` is what the worker groups reserve with (one rank per node under STRICT_SPREAD is
    held end to end by test_deploy_cluster.py, through `serve`'s flag): an unknown one is refused before Ray starts."""
    model_dir = str(make_tiny_model("llama", tmp_path / "llama"))
    with pytest.raises(ValueError, match="placement_strategy must be one of .*got 'SCATTER'"):
        LLM(model_dir, tensor_parallel_size=2, placement_strategy="SCATTER")
