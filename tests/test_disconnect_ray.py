"""Clients that hang up mid-stream are aborted through the real Ray head client, and their blocks freed."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from transformers import AutoTokenizer

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")

from pagerail.cluster.distributed.cluster_options import ClusterOptions  # noqa: E402
from pagerail.cluster.distributed.head_client import HeadEngineClient  # noqa: E402
from pagerail.cluster.distributed.launcher import start_heads  # noqa: E402
from pagerail.cluster.frontend.http_app import ServerState, create_app  # noqa: E402
from pagerail.cluster.frontend.settings import FrontendSettings  # noqa: E402
from pagerail.common.engine_config import CacheConfig, EngineConfig  # noqa: E402
from tests.http_server import BackgroundServer  # noqa: E402
from tests.ray_start import start_ray  # noqa: E402
from tests.test_openai_e2e import stream_and_drop, wait_for_engine_idle  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


def test_dropped_streams_are_aborted_through_the_head_actor(tmp_path, smollm2_dir):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    start_ray(num_cpus=2, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    try:
        config = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=4, num_gpu_blocks=1024))
        head = start_heads(config, ClusterOptions(), [f"drop-head-{uuid.uuid4().hex[:8]}"])[0]
        info = ray.get(head.model_info.remote())
        engine = HeadEngineClient(head, "tiny", info)
        # The tiny model has no tokenizer: prompts go in as token ids, and any tokenizer can show ids below 250.
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
        with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings("tiny")))) as base_url:
            kept = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True, "stream": True}
            dropped = {**kept, "max_tokens": 240, "temperature": 0.7}
            before = asyncio.run(engine.stats())
            counts = asyncio.run(stream_and_drop(base_url, {}, kept, dropped, 8))
            assert counts[1::2] == [3] * 4 and counts[0::2] == [8] * 4
            stats = wait_for_engine_idle(engine, timeout_s=60)
        assert stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
        assert stats["num_aborted"] - before["num_aborted"] == 4
        # Unaborted, the dropped streams would have computed 4 × 240 tokens; they stopped well before.
        assert stats["num_computed_tokens"] - before["num_computed_tokens"] < 4 * 240 // 2
        ray.get(head.shutdown.remote())
    finally:
        ray.shutdown()
