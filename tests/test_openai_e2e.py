"""The official openai client against the HTTP server on the embedded model; disconnects and overload."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from pagerail import LLM, SamplingParams
from pagerail.cluster.bench.workload import random_workload
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.http_server import BackgroundServer

pytestmark = pytest.mark.slow
MODEL = "smollm2"
# A KV cache of 256 MiB rather than the CPU default of 2 GiB: it still holds a 4000-token request (the dropped
# streams' max_tokens).
KV_BYTES = 256 << 20


def serve_llm(llm: LLM, **state):
    engine = llm.engine_client
    return engine, BackgroundServer(create_app(ServerState(engine, llm.tokenizer, FrontendSettings(MODEL, **state))))


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), served_model_name=MODEL, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of LLM.generate, computed before the server's loop thread owns the engine."""
    chat_prompt = [{"role": "user", "content": "Name three fruits."}]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    return {
        "chat": llm.chat(chat_prompt, greedy)[0].outputs[0].text,
        "completion": llm.generate(["The capital of France is"], greedy)[0].outputs[0].text,
    }


@pytest.fixture(scope="module")
def client(llm, reference):
    engine, server = serve_llm(llm, api_key="sk-e2e")
    with server as base_url:
        yield openai.OpenAI(base_url=base_url + "/v1", api_key="sk-e2e", max_retries=0), engine, base_url


def test_chat_and_completions_match_llm_generate(client, reference):
    api, _, _ = client
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=24, temperature=0
    )
    assert chat.choices[0].message.content == reference["chat"]
    assert (
        chat.usage.completion_tokens > 0
        and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    )
    completion = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0)
    assert completion.choices[0].text == reference["completion"]
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_streaming_with_usage_equals_whole_response(client, reference):
    api, _, _ = client
    stream = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three fruits."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    pieces = list(
        api.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces) == reference["completion"]


def test_n_stop_strings_and_logprobs(client):
    api, _, _ = client
    two = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        n=2,
        seed=5,
        temperature=1.0,
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    stopped = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text
    assert "6" in stopped.choices[0].text
    with_logprobs = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    legacy = api.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=2)
    assert len(legacy.choices[0].logprobs.token_logprobs) == 4


async def stream_and_drop(base_url: str, headers: dict, kept: dict, dropped: dict, count: int) -> list[int]:
    """`count` concurrent streams: even ones read `kept` to the end and return the completion tokens its final
    usage chunk reports (-1 without one); odd ones hang up after 3 chunks of `dropped` and return 3.

    Kept streams count tokens, not chunks: a reader that fell behind gets the deltas queued for it merged into
    one chunk, so a complete stream may have fewer chunks than tokens."""

    async def one(index: int) -> int:
        body = {**(dropped if index % 2 else kept), "seed": index}
        if not index % 2:
            body["stream_options"] = {"include_usage": True}
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream("POST", base_url + "/v1/completions", json=body, headers=headers) as response,
        ):
            assert response.status_code == 200
            chunks, completion_tokens, done = 0, -1, False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks += 1
                    if index % 2 and chunks == 3:
                        return chunks  # drop the connection mid-stream
                    usage = json.loads(line[len("data: ") :]).get("usage")
                    if usage:
                        completion_tokens = usage["completion_tokens"]
            return completion_tokens if done else -1

    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), 600)


def wait_for_engine_idle(engine, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = asyncio.run(engine.stats())
        if stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_dropped_streams_are_aborted_and_free_their_blocks(client):
    _, engine, base_url = client
    # The dropped streams ask for far more tokens than the kept ones: if they were not aborted they would still
    # be generating (and holding blocks) long after the kept ones finished.
    kept = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 24, "ignore_eos": True, "stream": True}
    dropped = {**kept, "max_tokens": 4000, "temperature": 0.7}
    before = asyncio.run(engine.stats())
    counts = asyncio.run(stream_and_drop(base_url, {"Authorization": "Bearer sk-e2e"}, kept, dropped, 12))
    assert counts[1::2] == [3] * 6 and counts[0::2] == [24] * 6
    stats = wait_for_engine_idle(engine, timeout_s=60)
    assert stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_aborted"] - before["num_aborted"] == 6
    # Every dropped request stopped long before its 4000 tokens: the engine computed a small part of that.
    assert stats["num_computed_tokens"] - before["num_computed_tokens"] < 6 * 4000 // 4


def test_overload_gets_429_with_retry_after_while_admitted_requests_finish(smollm2_dir):
    llm = LLM(
        str(smollm2_dir),
        served_model_name=MODEL,
        max_num_seqs=2,
        max_waiting_requests=2,
        kv_cache_memory_bytes=KV_BYTES,
    )
    _, server = serve_llm(llm)
    body = {"model": MODEL, "prompt": "Count to twenty:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    results: list[httpx.Response] = []
    lock = threading.Lock()
    with server as base_url:

        def call() -> None:
            response = httpx.post(base_url + "/v1/completions", json=body, timeout=300)
            with lock:
                results.append(response)

        threads = [threading.Thread(target=call) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    refused = [r for r in results if r.status_code == 429]
    served = [r for r in results if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 12
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in served)


def client_tokenizer(client):
    from transformers import AutoTokenizer

    from pagerail.common.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


def test_bench_serve_and_sweep_run_on_the_embedded_model(client, tmp_path, capsys):
    """`pagerail bench serve` and `bench sweep` against this server: every request completes at its exact length."""
    from pagerail.cluster.cli import main

    _, _, base_url = client
    common = ["--base-url", base_url, "--api-key", "sk-e2e", "--num-requests", "4"]
    common += ["--prompt-len", "8", "32", "--output-len", "3", "6", "--json"]
    assert main(["bench", "serve", *common, "--concurrency", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    workload = random_workload(4, (8, 32), (3, 6), vocab_size=len(client_tokenizer(client)), seed=0)
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["total_output_tokens"] == sum(r.output_len for r in workload)
    assert result["total_input_tokens"] == sum(r.prompt_len for r in workload)
    assert 0 < result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]

    assert main(["bench", "sweep", *common, "--concurrencies", "1", "4", "--output-dir", str(tmp_path)]) == 0
    sweep = json.loads(capsys.readouterr().out)
    assert [level["completed"] for level in sweep["levels"]] == [4, 4]
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 3
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
