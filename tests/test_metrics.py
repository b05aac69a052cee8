"""Prometheus metrics move as they should under real traffic, and the exposition passes promtool."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagerail import LLM, SamplingParams
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.http_server import BackgroundServer
from tests.requirements import require_executable
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) → value."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def value(text: str, name: str, **labels) -> float:
    return samples(text).get(("pagerail_" + name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def served(smollm2_dir):
    # A 512-block cache: a block count these metrics can be checked against.
    llm = LLM(str(smollm2_dir), served_model_name="smollm2", num_gpu_blocks=512)
    engine = llm.engine_client
    with BackgroundServer(create_app(ServerState(engine, llm.tokenizer, FrontendSettings("smollm2")))) as base_url:
        yield base_url


def test_metrics_follow_the_requests(served):
    base_url = served
    before = httpx.get(base_url + "/metrics").text
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    usages = []
    for question in ("Hi!", "Name a color.", "Count to three."):
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
        )
        usages.append(reply.usage)
    for prompt in ("Once upon a time", "The sea is"):
        chunks = list(
            client.completions.create(
                model="smollm2",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usages.append(chunks[-1].usage)
    after = httpx.get(base_url + "/metrics").text
    assert after.count('model_name="smollm2"') > 20

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("time_to_first_token_seconds_count") == 5
    assert grew("e2e_request_latency_seconds_count") == 5
    assert grew("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    finished = grew("request_success_total", finished_reason="stop") + grew(
        "request_success_total", finished_reason="length"
    )
    assert finished == 5
    assert grew("inter_token_latency_seconds_count") > 0
    assert grew("iteration_tokens_sum") >= sum(u.prompt_tokens for u in usages)
    assert grew("step_duration_seconds_count", phase="forward") > 0
    # Idle again: nothing running or waiting, no KV block held.
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0
    assert value(after, "kv_cache_usage_perc") == 0 and value(after, "num_free_blocks") > 0


def test_preemption_counter_rises_when_memory_runs_out(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16)
    prompts = [[5 + i, 6, 7, 8, 9] * 4 for i in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = llm.engine.metrics_text().decode()
    assert llm.stats.num_preemptions > 0
    assert value(text, "num_preemptions_total") == llm.stats.num_preemptions
    assert value(text, "prefix_cache_queries_total") >= sum(len(p) for p in prompts)


def test_promtool_accepts_the_live_exposition(served):
    promtool = require_executable("promtool", "needs promtool (Debian package prometheus)")
    text = httpx.get(served + "/metrics").text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_inter_token_latency_counts_one_gap_per_request_and_step():
    from prometheus_client import generate_latest

    from pagerail.cluster.core.engine_metrics import EngineMetrics
    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.cluster.core.request import Request, RequestStatus

    metrics = EngineMetrics("m")

    def request(name: str, outputs: int, last: float | None, first: float | None) -> Request:
        r = Request(
            EngineRequest(name, [1, 2], SamplingParams(max_tokens=None)), len(name), frozenset(), arrival_time=0.0
        )
        r.output_token_ids = [5] * outputs
        r.num_reported_tokens = outputs - (2 if name == "two" else 1)
        r.status = RequestStatus.RUNNING
        r.last_token_time, r.first_token_time = last, first
        return r

    changed = [
        request("first", 1, None, None),  # its first token: a TTFT, no gap
        request("a", 5, 10.0, 1.0),
        request("b", 5, 10.0, 1.0),  # same previous time as a: grouped, still two gaps
        request("two", 6, 9.0, 1.0),  # two tokens in one step: one gap of half the time
    ]
    changed[-1].status = RequestStatus.FINISHED_LENGTH
    metrics._observe_tokens(changed, now=12.0)
    text = generate_latest(metrics.registry).decode()
    assert value(text, "inter_token_latency_seconds_count") == 3
    assert value(text, "inter_token_latency_seconds_sum") == pytest.approx(2 * 2.0 + 3.0 / 2)
    assert value(text, "time_to_first_token_seconds_count") == 1
    assert value(text, "generation_tokens_total") == 5
    assert value(text, "e2e_request_latency_seconds_count") == 1  # the finished one, counted once
    assert all(r.last_token_time == 12.0 for r in changed)
