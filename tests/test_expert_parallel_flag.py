"""--enable-expert-parallel / LLM(enable_expert_parallel=True): refused before any rank starts where the model
cannot use it, and the MoE all-reduce bytes the ranks report reach the head's metrics and step spans."""

from __future__ import annotations

import pytest

from pagerail import LLM
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.common.engine_args import ENGINE_ARG_NAMES
from pagerail.common.engine_config import CacheConfig, EngineConfig
from pagerail.common.sampling_params import SamplingParams
from pagerail.proto import step_pb2
from tests.fake_workers import FakeKVWorkers
from tests.tiny_models import make_tiny_model


def test_the_flag_is_an_engine_argument():
    assert "enable_expert_parallel" in ENGINE_ARG_NAMES
    assert EngineConfig().enable_expert_parallel is False


def test_dense_model_is_refused_before_any_rank_starts(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; model_type='llama'"):
        LLM(str(model_dir), enable_expert_parallel=True)


def test_more_ranks_than_experts_is_refused(tmp_path):
    from pagerail.cluster.core.model_info import read_model_info
    from pagerail.common.engine_args import engine_config

    info = read_model_info(make_tiny_model("qwen3_moe", tmp_path / "moe"))
    config = engine_config(tensor_parallel_size=info.num_routed_experts * 2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={info.num_routed_experts * 2} ranks"):
        info.check_engine(config)
    info.check_engine(engine_config(tensor_parallel_size=2, enable_expert_parallel=True))  # divides: accepted


class MoeFakeWorkers(FakeKVWorkers):
    """Fake ranks whose every step reports MoE all-reduce bytes for its tokens, as a MoE model's ranks do."""

    BYTES_PER_TOKEN = 96

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        result = super().execute(batch)
        tokens = len(batch.decode_handles) + sum(
            r.num_scheduled_tokens for r in [*batch.new_requests, *batch.cached_requests]
        )
        result.moe_collective_bytes = self.BYTES_PER_TOKEN * tokens
        self.reported = getattr(self, "reported", 0) + result.moe_collective_bytes
        return result


def test_reported_moe_bytes_reach_the_metrics():
    workers = MoeFakeWorkers(64, 4, 50)
    engine = EngineCore(EngineConfig(cache=CacheConfig(block_size=4)), workers, 256, 50, eos_token_ids=[])
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", [1 + i, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    text = engine.metrics_text().decode()
    line = next(x for x in text.splitlines() if x.startswith("pagerail_moe_collective_bytes_total"))
    assert float(line.rsplit(" ", 1)[1]) == workers.reported > 0
