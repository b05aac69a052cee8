"""One request set through the `LLM` API (in-process and on Ray), the OpenAI HTTP API and the gRPC API gives the
same tokens and text.

The set holds what the entry points once each did their own way: stop strings that must wait for `min_tokens`, a
stop string in the first tokens, `n` seeded choices, presence/frequency/repetition penalties, logprobs, and a model
whose configs name no EOS id (it must stop at its tokenizer's EOS token whichever entry point serves it). The
servers run over an engine built as the head actor builds its own (`EngineCore.for_model`), not over the LLM's
engine; the Ray run goes through a head actor and a worker actor.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import httpx
import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from pagerail import LLM, SamplingParams
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.local_client import LocalEngineClient
from pagerail.cluster.core.model_info import read_model_info
from pagerail.cluster.distributed.local_executor import InProcessExecutor
from pagerail.cluster.frontend.grpc_api import build_grpc_server
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.proto import api_pb2, api_pb2_grpc
from pagerail.worker.config import worker_config
from tests.http_server import BackgroundServer
from tests.ray_start import start_ray
from tests.requirements import require_module

pytestmark = pytest.mark.slow

EOS = 2  # <|im_end|> in the trimmed SmolLM2 tokenizer: the model's configs do not say so
MODEL = "tiny"
PROMPTS = [[(p * 131 + i * 17) % 900 + 100 for i in range(6 + p % 5)] for p in range(24)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("parity") / "tiny", TinyLlamaShape(vocab_size=1024), seed=3)
    config = json.loads((path / "config.json").read_text())
    for key in ("eos_token_id", "pad_token_id"):
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))
    # A louder EOS row makes the end-of-sequence token likely enough to be sampled within a few dozen tokens.
    weights = load_file(str(path / "model.safetensors"))
    weights["model.embed_tokens.weight"][EOS] *= 6
    save_file(weights, str(path / "model.safetensors"))
    return path


def first_eos_prompt(llm: LLM) -> list[int]:
    """A prompt whose greedy run, EOS ignored, produces the EOS token after a few tokens and before the limit."""
    runs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, run in zip(PROMPTS, runs, strict=True):
        tokens = run.outputs[0].token_ids
        if EOS in tokens[3:30] and EOS not in tokens[:3]:
            return prompt
    raise AssertionError("no prompt reaches EOS mid-run; the fixture's EOS row is not loud enough")


def min_tokens_stop(llm: LLM, tokenizer) -> tuple[list[int], str]:
    """A prompt and a stop string that its greedy text holds within the first 2 tokens and again after 10."""
    runs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for prompt, run in zip(PROMPTS, runs, strict=True):
        tokens = run.outputs[0].token_ids
        early = tokenizer.decode(tokens[:2], skip_special_tokens=True)
        late = tokenizer.decode(tokens[10:], skip_special_tokens=True)
        for char in early:
            if char.strip() and char != "\ufffd" and char in late:
                return prompt, char
    raise AssertionError("no greedy run repeats a character early and late")


def request_set(llm: LLM, tokenizer) -> list[tuple[list[int], SamplingParams]]:
    stop_prompt, stop = min_tokens_stop(llm, tokenizer)
    return [
        (stop_prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=8)),
        (PROMPTS[1], SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)),
        (
            PROMPTS[2],
            SamplingParams(
                temperature=0.8,
                seed=5,
                max_tokens=20,
                ignore_eos=True,
                presence_penalty=0.6,
                frequency_penalty=0.9,
                repetition_penalty=1.3,
            ),
        ),
        (first_eos_prompt(llm), SamplingParams(temperature=0.0, max_tokens=32)),
        (PROMPTS[3], SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True, logprobs=3)),
        # The same stop string with nothing holding it back: it ends the request within its first two tokens.
        (stop_prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])),
        # Biased and restricted draws, and a scored prompt.
        (
            PROMPTS[4],
            SamplingParams(
                temperature=0.9,
                seed=7,
                max_tokens=10,
                ignore_eos=True,
                logit_bias={300: 3.0, 301: -100.0},
                prompt_logprobs=2,
            ),
        ),
        (PROMPTS[5], SamplingParams(temperature=1.0, seed=9, max_tokens=10, allowed_token_ids=[5, 300, 301, 640, EOS])),
    ]


def http_body(prompt: list[int], sp: SamplingParams) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "n": sp.n,
        "temperature": sp.temperature,
        "max_tokens": sp.max_tokens,
        "min_tokens": sp.min_tokens,
        "ignore_eos": sp.ignore_eos,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "stop": list(sp.stop),
    }
    if sp.seed is not None:
        body["seed"] = sp.seed
    if sp.logprobs is not None:
        body["logprobs"] = sp.logprobs
    if sp.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in sp.logit_bias}
    if sp.allowed_token_ids is not None:
        body["allowed_token_ids"] = list(sp.allowed_token_ids)
    if sp.prompt_logprobs is not None:
        body["prompt_logprobs"] = sp.prompt_logprobs
    return body


def grpc_request(prompt: list[int], sp: SamplingParams) -> api_pb2.GenerateRequest:
    params = api_pb2.SamplingParams(
        n=sp.n,
        temperature=sp.temperature,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        ignore_eos=sp.ignore_eos,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        stop=list(sp.stop),
    )
    if sp.seed is not None:
        params.seed = sp.seed
    if sp.logprobs is not None:
        params.logprobs = sp.logprobs
    params.logit_bias.update(dict(sp.logit_bias))
    params.allowed_token_ids.extend(sp.allowed_token_ids or ())
    if sp.prompt_logprobs is not None:
        params.prompt_logprobs = sp.prompt_logprobs
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt), sampling_params=params)


async def grpc_choices(engine: LocalEngineClient, tokenizer, requests) -> list[dict[int, dict]]:
    """Per request: choice index → its token ids, text, finish reason and completion tokens, over gRPC."""
    server, port = build_grpc_server(engine, tokenizer, host="127.0.0.1", port=0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = api_pb2_grpc.GenerationStub(channel)
            results = []
            for prompt, sp in requests:
                choices: dict[int, dict] = {}
                async for response in stub.Generate(grpc_request(prompt, sp)):
                    choice = choices.setdefault(response.index, {"token_ids": [], "text": "", "logprobs": []})
                    choice["token_ids"] += list(response.token_ids)
                    choice["text"] += response.text
                    choice["logprobs"] += [round(entry.logprob, 4) for entry in response.logprobs]
                    choice.setdefault(
                        "prompt_logprobs", [round(entry.logprob, 4) for entry in response.prompt_logprobs]
                    )
                    if response.finish_reason:
                        choice["finish_reason"] = response.finish_reason
                        choice["completion_tokens"] = response.usage.completion_tokens
                results.append(choices)
            return results
    finally:
        await server.stop(None)


def test_llm_http_and_grpc_give_the_same_tokens_and_text(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert read_model_info(model_dir).eos_token_ids == (EOS,)  # from the tokenizer: config.json names none
    engine_args = {"block_size": 4, "num_gpu_blocks": 512, "seed": 0}
    with LLM(str(model_dir), served_model_name=MODEL, **engine_args) as llm:
        requests = request_set(llm, tokenizer)
        offline = llm.generate([prompt for prompt, _ in requests], [sp for _, sp in requests])
        config = llm.config

    # The request set exercises what it is meant to: min_tokens held a stop string back, EOS ended a request.
    stopped = offline[0].outputs[0]
    assert stopped.finish_reason == "stop" and 8 <= len(stopped.token_ids) < 24
    eos_run = offline[3].outputs[0]
    assert eos_run.finish_reason == "stop" and eos_run.token_ids[-1] == EOS and len(eos_run.token_ids) < 32
    assert len({tuple(c.token_ids) for c in offline[1].outputs}) == 3  # seeded choices differ from each other
    early = offline[5].outputs[0]
    assert early.finish_reason == "stop" and 1 <= len(early.token_ids) <= 2

    # The same LLM API on Ray: a head actor drives a worker actor over gRPC.
    ray = require_module("ray", "needs Ray")
    start_ray(num_cpus=2, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    try:
        with LLM(str(model_dir), served_model_name=MODEL, ray_address="auto", **engine_args) as on_ray:
            over_ray = on_ray.generate([prompt for prompt, _ in requests], [sp for _, sp in requests])
    finally:
        ray.shutdown()
    for output, remote in zip(offline, over_ray, strict=True):
        assert [(c.token_ids, c.text, c.finish_reason) for c in remote.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in output.outputs
        ]
        assert remote.prompt_logprobs == output.prompt_logprobs
    # The bias, the restriction and the scored prompt did what they say.
    biased, restricted = offline[6], offline[7]
    assert 301 not in biased.outputs[0].token_ids and set(restricted.outputs[0].token_ids) <= {5, 300, 301, 640, EOS}
    scored = biased.prompt_logprobs
    assert scored[0] is None and len(scored) == len(PROMPTS[4])
    assert all(token in entry and len(entry) in (2, 3) for token, entry in zip(PROMPTS[4][1:], scored[1:], strict=True))

    # The servers' engine, built as the head actor builds its own.
    info = read_model_info(model_dir)
    core = EngineCore.for_model(config, InProcessExecutor(worker_config(config, model_dir)), info)
    engine = LocalEngineClient(AsyncEngine(core), MODEL)
    try:
        with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings(MODEL)))) as base_url:
            http = [
                httpx.post(f"{base_url}/v1/completions", json=http_body(prompt, sp), timeout=60).json()
                for prompt, sp in requests
            ]
        over_grpc = asyncio.run(grpc_choices(engine, tokenizer, requests))
    finally:
        engine._engine.shutdown()
        core.executor.shutdown()

    for output, (prompt, sp), response, choices in zip(offline, requests, http, over_grpc, strict=True):
        assert sorted(choices) == list(range(sp.n))
        assert response["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in output.outputs)
        for completion, http_choice in zip(output.outputs, response["choices"], strict=True):
            grpc_choice = choices[completion.index]
            assert grpc_choice["token_ids"] == completion.token_ids
            assert grpc_choice["completion_tokens"] == len(completion.token_ids)
            assert http_choice["text"] == completion.text == grpc_choice["text"]
            assert http_choice["finish_reason"] == completion.finish_reason == grpc_choice["finish_reason"]
            if sp.prompt_logprobs is not None:
                scored = zip(prompt[1:], output.prompt_logprobs[1:], strict=True)
                expected = [round(entry[token], 4) for token, entry in scored]
                shown = zip(prompt[1:], http_choice["prompt_logprobs"][1:], strict=True)
                assert [round(entry[str(token)]["logprob"], 4) for token, entry in shown] == expected
                assert grpc_choice["prompt_logprobs"] == expected
            if sp.logprobs is not None:
                pairs = zip(completion.logprobs, completion.token_ids, strict=True)
                sampled = [round(entry[token], 4) for entry, token in pairs]
                assert [round(lp, 4) for lp in http_choice["logprobs"]["token_logprobs"]] == sampled
                assert grpc_choice["logprobs"] == sampled
