"""The newer architectures at tensor parallel size 2 over gloo on a local Ray, through the whole engine: greedy
parity with transformers for mixtures of experts (experts split by columns, or whole experts per rank), Gemma 2's
windows and softcaps and gpt-oss's sinks past the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")

from pagerail import LLM  # noqa: E402
from pagerail.cluster.bench.random_checkpoints import save_random_weights  # noqa: E402
from pagerail.worker.model_loader import load_hf_config  # noqa: E402
from tests.parity import compare, engine_greedy, reference_greedy  # noqa: E402
from tests.ray_start import start_ray  # noqa: E402
from tests.test_gpt_oss import gpt_oss_config  # noqa: E402
from tests.test_model_families import family_config  # noqa: E402
from tests.test_moe_engine import NEW_TOKENS, PROMPTS  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    start_ray(num_cpus=4, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _moe_bytes(metrics_text: str) -> float:
    lines = [line for line in metrics_text.splitlines() if line.startswith("pagerail_moe_collective_bytes_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _model_dir(kind: str, path: Path) -> Path:
    if kind == "gemma2":
        return save_random_weights(family_config("gemma2"), path, 0, scale=0.08)
    if kind == "gpt_oss":
        return save_random_weights(gpt_oss_config(), path, 0, scale=0.08)
    return make_tiny_model(kind, path)


# Experts split by columns, and (with the shared expert, and gpt-oss's biased experts) whole experts per rank.
@pytest.mark.parametrize(
    ("kind", "expert_parallel"), [("qwen3_moe", False), ("qwen2_moe", True), ("gemma2", False), ("gpt_oss", True)]
)
def test_tp2_matches_transformers(local_ray, kind, expert_parallel, tmp_path):
    model_dir = _model_dir(kind, tmp_path / kind)
    llm = LLM(
        str(model_dir),
        block_size=4,
        num_gpu_blocks=128,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    try:
        ours = engine_greedy(llm, PROMPTS, NEW_TOKENS)
        metrics = ray.get(llm._cluster.heads[0].metrics.remote())
    finally:
        llm.shutdown()
    report = compare(ours, reference_greedy(model_dir, PROMPTS, NEW_TOKENS))
    assert report.identical == report.total, report.divergences
    # The step telemetry counts what every rank put into the MoE all-reduces: whole [tokens, hidden] fp32 rows,
    # one per MoE layer, at least one per generated token; none for a dense model.
    config = load_hf_config(model_dir)
    if kind == "gemma2":
        assert _moe_bytes(metrics) == 0
        return
    row = config.hidden_size * 4 * config.num_hidden_layers
    moe_bytes = _moe_bytes(metrics)
    assert moe_bytes >= row * NEW_TOKENS * len(PROMPTS) and moe_bytes % row == 0


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_tp2_speculative_decoding_matches_transformers(local_ray, method, tmp_path):
    """Speculation at tensor parallel size 2, with steps overlapped (Ray ranks schedule ahead). n-gram: both ranks
    propose the same drafts from their own tokens. A draft model (here the target itself, so every draft must be
    kept) runs on rank 0, which broadcasts its drafts. EAGLE heads (built to reproduce a transparent target, so
    every draft must be kept) run on rank 0 with whole copies of the split target's embeddings and LM head, read
    from its checkpoint, and EAGLE-3 reads rank 0's residual stream."""
    model_dir = make_tiny_model("llama", tmp_path / "llama", num_layers=4 if method.startswith("eagle") else None)
    speculative = {"method": method, "num_speculative_tokens": 4, "disable_by_batch_size": 1000}
    if method == "ngram":
        speculative.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "draft_model":
        speculative["model"] = str(model_dir)
    else:
        from pagerail.cluster.bench.random_eagle_heads import make_eagle_head, make_transparent

        make_transparent(model_dir)
        speculative["model"] = str(make_eagle_head(model_dir, tmp_path / "head", method == "eagle3", exact=True))
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=128, tensor_parallel_size=2, speculative_config=speculative)
    try:
        ours = engine_greedy(llm, PROMPTS, NEW_TOKENS)
        metrics = ray.get(llm._cluster.heads[0].metrics.remote())
    finally:
        llm.shutdown()
    report = compare(ours, reference_greedy(model_dir, PROMPTS, NEW_TOKENS))
    assert report.identical == report.total, report.divergences

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))

    kept, drafted = (
        total("pagerail_spec_decode_num_accepted_tokens_total"),
        total("pagerail_spec_decode_num_draft_tokens_total"),
    )
    assert kept > 0 and (method == "ngram" or kept == drafted)
