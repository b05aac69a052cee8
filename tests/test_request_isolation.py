"""No client can reach another client's request: ids a client sends are labels, over the real engine loop."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.local_client import LocalEngineClient
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from tests.fake_workers import FakeKVWorkers
from tests.http_server import BackgroundServer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def make_async_engine(vocab_size: int, step_delay_s: float = 0.005) -> tuple[AsyncEngine, FakeKVWorkers]:
    workers = FakeKVWorkers(256, 16, vocab_size, step_delay_s=step_delay_s)
    config = EngineConfig(cache=CacheConfig(block_size=16), scheduler=SchedulerConfig(max_num_batched_tokens=256))
    core = EngineCore(config, workers, max_model_len=1024, vocab_size=vocab_size, eos_token_ids=[vocab_size - 1])
    return AsyncEngine(core), workers


@pytest.fixture
def served(tokenizer):
    engine, workers = make_async_engine(len(tokenizer))
    state = ServerState(LocalEngineClient(engine, "fake"), tokenizer, FrontendSettings("fake"))
    with BackgroundServer(create_app(state)) as base_url:
        yield base_url, engine
    engine.shutdown()


def test_a_reused_x_request_id_neither_fails_nor_aborts_the_first_request(served):
    base_url, engine = served
    body = {"model": "fake", "prompt": "hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "same-id"}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", base_url + "/v1/completions", json=body, headers=headers) as first,
    ):
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the first request is running
        second = client.post(
            base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, headers=headers
        )
        assert second.status_code == 200, second.text
        assert second.headers["x-request-id"] == "same-id"
        assert second.json()["choices"][0]["finish_reason"] == "length"
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert first.headers["x-request-id"] == "same-id"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert engine.engine.scheduler.stats.num_steps > 0 and not engine.engine.has_unfinished()


def test_a_refused_duplicate_engine_id_does_not_abort_the_request_holding_it(tokenizer):
    engine, _ = make_async_engine(len(tokenizer))

    async def scenario() -> tuple[str | None, str]:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        first = engine.stream(EngineRequest("r", [1, 2, 3], params))
        await anext(first)
        with pytest.raises(ValueError, match="already in use"):
            async for _ in engine.stream(EngineRequest("r", [4, 5], SamplingParams(max_tokens=2))):
                pass
        rest = [delta async for delta in first]
        return rest[-1].finish_reason, rest[-1].num_output_tokens

    try:
        assert asyncio.run(asyncio.wait_for(scenario(), 30)) == ("length", 40)
    finally:
        engine.shutdown()


def test_x_request_id_is_length_limited_and_printable(served):
    base_url, _ = served
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    response = httpx.post(base_url + "/v1/completions", json=body, headers={"X-Request-Id": "a b\tc" + "x" * 500})
    assert response.status_code == 200
    label = response.headers["x-request-id"]
    assert label.startswith("abc") and len(label) == 128


def test_the_engine_loop_serves_many_concurrent_callers_with_the_same_label(served):
    base_url, engine = served
    body = {"model": "fake", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
    results: list[int] = []

    def call() -> None:
        response = httpx.post(base_url + "/v1/completions", json=body, headers={"X-Request-Id": "x"}, timeout=30)
        results.append(response.status_code)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [200] * 8
    assert engine.engine.block_table.num_free_blocks == engine.engine.block_table.num_blocks


def test_models_route_shows_the_context_capped_to_the_cache(tokenizer):
    workers = FakeKVWorkers(8, 16, len(tokenizer))  # 128 tokens of KV cache for a model that allows 1024
    config = EngineConfig(cache=CacheConfig(block_size=16))
    core = EngineCore(config, workers, max_model_len=1024, vocab_size=len(tokenizer), eos_token_ids=[0])
    engine = AsyncEngine(core)
    try:
        state = ServerState(LocalEngineClient(engine, "fake"), tokenizer, FrontendSettings("fake"))
        with BackgroundServer(create_app(state)) as base_url:
            assert httpx.get(base_url + "/v1/models").json()["data"][0]["max_model_len"] == 128
            # No max_tokens: up to the capped context, never "needs more blocks than the cache holds".
            response = httpx.post(
                base_url + "/v1/completions",
                json={"model": "fake", "prompt": "hi", "max_tokens": None, "ignore_eos": True},
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["total_tokens"] == 128
    finally:
        engine.shutdown()
