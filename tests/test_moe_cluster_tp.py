"""Mixture-of-experts models at tensor parallel size 2 over gloo on a local Ray: greedy parity with transformers."""

from __future__ import annotations

import pytest

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")

from cluster import LLM  # noqa: E402
from tests.parity import compare, engine_greedy, reference_greedy  # noqa: E402
from tests.ray_start import start_ray  # noqa: E402
from tests.test_moe_engine import NEW_TOKENS, PROMPTS  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    start_ray(num_cpus=4, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_tp2_matches_transformers(local_ray, kind, tmp_path):
    model_dir = make_tiny_model(kind, tmp_path / kind)
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=128, tensor_parallel_size=2)
    try:
        ours = engine_greedy(llm, PROMPTS, NEW_TOKENS)
    finally:
        llm.shutdown()
    report = compare(ours, reference_greedy(model_dir, PROMPTS, NEW_TOKENS))
    assert report.identical == report.total, report.divergences
