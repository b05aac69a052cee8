"""LoRA adapters: PEFT checkpoints checked and refused naming the field, and requests for the base model and for
several adapters batched together, each matching transformers on that adapter merged into the base weights."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import pytest
import torch

from pagerail import LLM, BeamSearchParams, LoRARequest, SamplingParams
from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from pagerail.cluster.bench.tiny_lora import ATTENTION, MLP, write_adapter
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.request import RequestStatus
from pagerail.common.lora import projection_shapes, read_adapter, read_adapter_config
from pagerail.worker import lora as lora_module
from pagerail.worker.layers import cpu_lora
from pagerail.worker.layers.native_build import find_compiler
from tests.requirements import require

PROMPTS = [[5, 17, 42, 99, 7, 300, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 13], [100, 200, 300]]
EXTRA = [41, 42, 43, 44, 45]
MAX_TOKENS = 12


def merged_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens with the adapter's B A × scaling added to each target weight."""
    return [list(tokens) for tokens in _merged_greedy(model_dir, adapter, tuple(tuple(p) for p in prompts))]


@functools.cache
def _merged_greedy(model_dir: Path, adapter: Path | None, prompts: tuple[tuple[int, ...], ...]) -> tuple:
    model = merged_model(model_dir, adapter)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        generated = model.generate(
            ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
        outputs.append(tuple(generated[0, len(prompt) :].tolist()))
    return tuple(outputs)


def merged_model(model_dir: Path, adapter: Path | None):
    """transformers' model with the adapter's B A × scaling added to each target weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from safetensors.torch import load_file

        settings = json.loads((adapter / "adapter_config.json").read_text())
        rank = settings["r"]
        scaling = settings["lora_alpha"] / (rank**0.5 if settings.get("use_rslora") else rank)
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        with torch.no_grad():
            for name, a in weights.items():
                if ".lora_A." not in name:
                    continue
                b = weights[name.replace(".lora_A.", ".lora_B.")]
                target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                model.get_parameter(target).add_(scaling * (b @ a))
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "every": write_adapter(root / "every", model_dir, 8, ATTENTION + MLP, seed=1),
        "attention": write_adapter(root / "attention", model_dir, 4, ("q_proj", "v_proj"), seed=2, alpha=8.0),
        "mlp-rs": write_adapter(root / "mlp-rs", model_dir, 16, MLP + ("o_proj",), seed=3, use_rslora=True),
    }


@pytest.mark.parametrize("path", ["native", "grouped"])
def test_base_and_two_adapters_in_shared_batches_each_match_transformers_merged(model_dir, adapters, path):
    """On the native CPU kernel, and on the grouped torch path it replaces."""
    if path == "native":
        require(find_compiler(), "needs a C compiler (cc or gcc) for the native CPU LoRA kernel")
    every = LoRARequest("every", 1, str(adapters["every"]))
    attention = LoRARequest("attention", 2, str(adapters["attention"]))
    # Each prompt three times: base, one adapter, the other, all submitted at once (they share every step); and
    # one more for the first adapter, so its group is longer than the other's (the grouped path pads).
    prompts = [prompt for prompt in PROMPTS for _ in range(3)] + [EXTRA]
    loras = [lora for _ in PROMPTS for lora in (None, every, attention)] + [every]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Three slots for two adapters: the grouped path runs the used slots only (the TP 2 test runs all of them).
    cpu_lora.ENABLED = path == "native"
    try:
        with LLM(str(model_dir), enable_lora=True, max_loras=3, kv_cache_memory_bytes=16 << 20) as llm:
            assert llm.engine.executor.worker.lora.native == (path == "native")
            outputs = llm.generate(prompts, params, lora_request=loras)
            stats = llm.stats
    finally:
        cpu_lora.ENABLED = True
    got = [output.outputs[0].token_ids for output in outputs]
    expected = {
        name: merged_greedy(model_dir, adapter, PROMPTS)
        for name, adapter in (("base", None), ("every", adapters["every"]), ("attention", adapters["attention"]))
    }
    assert expected["every"] != expected["base"] and expected["attention"] != expected["base"]
    for number in range(len(PROMPTS)):
        assert got[3 * number] == expected["base"][number]
        assert got[3 * number + 1] == expected["every"][number]
        assert got[3 * number + 2] == expected["attention"][number]
    assert got[-1] == merged_greedy(model_dir, adapters["every"], [EXTRA])[0]
    assert stats.peak_running == len(prompts)  # all of them ran in the same steps


def test_a_third_adapter_waits_for_a_slot_and_runs_correctly_after_an_eviction(model_dir, adapters):
    """max_loras 1: the adapters take turns in the one slot; each still matches transformers."""
    loras = [
        LoRARequest("every", 1, str(adapters["every"])),
        LoRARequest("attention", 2, str(adapters["attention"])),
        LoRARequest("mlp-rs", 3, str(adapters["mlp-rs"])),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), enable_lora=True, max_loras=1, kv_cache_memory_bytes=16 << 20) as llm:
        outputs = llm.generate([PROMPTS[0]] * 3, params, lora_request=loras)
        slots = llm.engine.executor.worker.lora
        assert slots.num_loads == 3 and slots.num_evictions == 2
        assert llm.engine.scheduler.stats.peak_running == 1  # one adapter at a time: they took turns
        metrics = llm.engine.metrics_text().decode()
    assert 'pagerail_lora_adapter_loads_total{model_name="' in metrics
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pagerail_lora_adapter_")
    }
    assert values["pagerail_lora_adapter_loads_total"] == 3 and values["pagerail_lora_adapter_evictions_total"] == 2
    assert values["pagerail_lora_adapter_load_seconds_total"] > 0
    assert 'running_lora_adapters=""' in metrics and 'max_lora="1"' in metrics  # all finished by now
    for output, name in zip(outputs, ("every", "attention", "mlp-rs"), strict=True):
        assert output.outputs[0].token_ids == merged_greedy(model_dir, adapters[name], [PROMPTS[0]])[0]


def test_prefix_blocks_are_never_shared_between_adapters(model_dir, adapters):
    """The same long prompt, first for the base model, then for an adapter, then for the base again: only the
    base model's second run finds cached blocks."""
    every = LoRARequest("every", 1, str(adapters["every"]))
    prompt = list(range(3, 3 + 40))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(str(model_dir), enable_lora=True, kv_cache_memory_bytes=16 << 20, block_size=8) as llm:
        llm.generate([prompt], params)
        hits = llm.stats.num_prefix_hit_tokens
        llm.generate([prompt], params, lora_request=every)
        after_adapter = llm.stats.num_prefix_hit_tokens
        llm.generate([prompt], params, lora_request=every)
        after_second_adapter = llm.stats.num_prefix_hit_tokens
    assert after_adapter == hits, "an adapter's request found the base model's blocks"
    assert after_second_adapter > after_adapter, "the adapter's own blocks were not found again"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"r": 64}, "r"),
        ({"use_dora": True}, "use_dora"),
        ({"target_modules": ["embed_tokens"]}, "target_modules"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_alpha": "big"}, "lora_alpha"),
    ],
)
def test_unsupported_adapter_configs_are_refused_naming_the_field(model_dir, tmp_path, change, field):
    path = write_adapter(tmp_path / "bad", model_dir, 4, ("q_proj",), seed=5)
    settings = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**settings, **change}))
    with pytest.raises(ValueError, match=field):
        read_adapter_config(str(path), max_rank=16)


def test_missing_malformed_and_misshapen_adapters_are_refused(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    shapes = projection_shapes(config)
    layers = config["num_hidden_layers"]
    with pytest.raises(ValueError, match="adapter_config.json"):
        read_adapter(str(tmp_path / "nowhere"), 16, shapes, layers)
    broken = write_adapter(tmp_path / "broken", model_dir, 4, ("q_proj",), seed=6)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_adapter(str(broken), 16, shapes, layers)
    other = dict(config, hidden_size=config["hidden_size"] * 2, intermediate_size=config["intermediate_size"] * 2)
    other_dir = tmp_path / "other-model"
    other_dir.mkdir()
    (other_dir / "config.json").write_text(json.dumps(other))
    wrong = write_adapter(tmp_path / "wrong-shape", other_dir, 4, ("q_proj",), seed=7)
    with pytest.raises(ValueError, match="shape"):
        read_adapter(str(wrong), 16, shapes, layers)


def test_a_request_for_a_bad_adapter_is_refused_before_it_is_queued(model_dir, adapters, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(str(model_dir), kv_cache_memory_bytes=16 << 20) as plain:
        with pytest.raises(ValueError, match="enable-lora"):
            plain.generate([PROMPTS[0]], params, lora_request=LoRARequest("every", 1, str(adapters["every"])))
    with LLM(str(model_dir), enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=16 << 20) as llm:
        with pytest.raises(ValueError, match="max-lora-rank"):
            llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("rs", 3, str(adapters["mlp-rs"])))
        with pytest.raises(ValueError, match="adapter_config.json"):
            llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("gone", 4, str(tmp_path / "gone")))
        # Nothing was lost: the engine serves on, and holds no blocks.
        assert llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
        assert llm.engine.block_table.num_free_blocks == llm.engine.block_table.num_blocks


@pytest.mark.slow
def test_adapters_are_served_by_model_name_over_http_and_grpc_and_load_and_unload_live(model_dir, adapters):
    import concurrent.futures
    import time

    import grpc
    import httpx
    import openai

    from pagerail.cluster.frontend.lora_modules import LoRAModule
    from pagerail.cluster.frontend.settings import FrontendSettings, LoRASettings
    from pagerail.proto import api_pb2, api_pb2_grpc
    from tests.http_server import BackgroundFrontend

    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, kv_cache_memory_bytes=16 << 20, served_model_name="base")
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    try:
        # The texts the engine gives offline, before the server's loop thread owns it.
        names = ("every", "attention", "mlp-rs")
        offline = {None: llm.generate([prompt], params)[0].outputs[0].text}
        for lora_id, name in enumerate(names, start=1):
            request = LoRARequest(name, lora_id, str(adapters[name]))
            offline[name] = llm.generate([prompt], params, lora_request=request)[0].outputs[0].text
        assert len(set(offline.values())) == 4, "each adapter must change the text"
        every = LoRARequest("every", 1, str(adapters["every"]))
        beam_params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
        (beams,) = llm.beam_search([prompt], beam_params, lora_request=every)
        settings = FrontendSettings(
            "base",
            admin_api_key="admin",
            lora=LoRASettings(
                16, (LoRAModule("every", str(adapters["every"])), LoRAModule("attention", str(adapters["attention"])))
            ),
        )
        with BackgroundFrontend(llm.engine_client, llm.tokenizer, settings) as (base_url, grpc_target):
            api = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
            cards = {card.id: card for card in api.models.list().data}
            assert set(cards) == {"base", "every", "attention"} and cards["every"].parent == "base"

            def text(model: str) -> str:
                fields = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
                return api.completions.create(model=model, prompt=prompt, **fields).choices[0].text

            assert text("base") == offline[None]
            assert text("every") == offline["every"] and text("attention") == offline["attention"]
            chat = api.chat.completions.create(
                model="every", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.model == "every"
            # Beam search with the adapter, over HTTP and gRPC: the beams the engine gives offline.
            beamed = api.completions.create(
                model="every",
                prompt=prompt,
                max_tokens=4,
                n=2,
                extra_body={"use_beam_search": True, "ignore_eos": True},
            )
            assert [c.text for c in beamed.choices] == [s.text for s in beams.sequences]
            with grpc.insecure_channel(grpc_target) as channel:
                stub = api_pb2_grpc.GenerationStub(channel)
                message = api_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                request = api_pb2.GenerateRequest(
                    token_ids=api_pb2.TokenIds(ids=prompt), sampling_params=message, lora_name="attention"
                )
                assert "".join(r.text for r in stub.Generate(request)) == offline["attention"]
                beam_request = api_pb2.GenerateRequest(
                    token_ids=api_pb2.TokenIds(ids=prompt),
                    sampling_params=api_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
                    beam_search=api_pb2.BeamSearch(beam_width=2),
                    lora_name="every",
                )
                got = [list(r.token_ids) for r in stub.Generate(beam_request)]
                assert got == [s.token_ids for s in beams.sequences]
                # A streaming-input session with the adapter: the prompt in two chunks, the same text.
                chunks = [
                    api_pb2.SessionRequest(
                        token_ids=api_pb2.TokenIds(ids=prompt[:3]), sampling_params=message, lora_name="attention"
                    ),
                    api_pb2.SessionRequest(token_ids=api_pb2.TokenIds(ids=prompt[3:]), final=True),
                ]
                assert "".join(r.text for r in stub.Session(iter(chunks))) == offline["attention"]
                request.lora_name = "nowhere"
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(request))
                assert info.value.code() == grpc.StatusCode.NOT_FOUND and "lora_name" in info.value.details()
            admin = {"Authorization": "Bearer admin"}
            with httpx.Client(base_url=base_url, timeout=30) as http:
                path = str(adapters["mlp-rs"])
                loaded = http.post(
                    "/v1/load_lora_adapter", json={"lora_name": "mlp-rs", "lora_path": path}, headers=admin
                )
                assert loaded.status_code == 200, loaded.text
                assert text("mlp-rs") == offline["mlp-rs"]  # a third adapter with two slots: one was evicted
                missing = http.post(
                    "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}, headers=admin
                )
                assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
                unauthorised = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp-rs"})
                assert unauthorised.status_code == 401
                # A request for the adapter is in flight (queued behind a pause) when the adapter is unloaded: it
                # still finishes with the adapter's weights.
                assert http.post("/pause", params={"mode": "all"}, headers=admin).status_code == 200
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    in_flight = pool.submit(text, "mlp-rs")
                    deadline = time.monotonic() + 30
                    while llm.engine.scheduler.num_unfinished == 0:
                        assert time.monotonic() < deadline, "the request never reached the engine"
                        time.sleep(0.01)
                    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp-rs"}, headers=admin)
                    assert unloaded.status_code == 200
                    assert http.post("/resume", headers=admin).status_code == 200
                    assert in_flight.result(timeout=60) == offline["mlp-rs"]
            with pytest.raises(openai.NotFoundError):
                text("mlp-rs")
            with pytest.raises(openai.BadRequestError) as refused:
                api.embeddings.create(model="every", input="hi")
            assert refused.value.body["param"] == "model"
    finally:
        llm.shutdown()


@pytest.fixture
def held_reads(monkeypatch):
    """Adapter reads on the ranks that wait, for the paths put in `held`, until `release` is set; a path in
    `broken` fails its read."""

    class Reads:
        held: set[str] = set()
        broken: set[str] = set()
        release = threading.Event()

    original = lora_module.read_parsed

    def read(path: str, *args):
        if path in Reads.held:
            assert Reads.release.wait(60), "the held read was never released"
        if path in Reads.broken:
            raise ValueError("the file is truncated")
        return original(path, *args)

    monkeypatch.setattr(lora_module, "read_parsed", read)
    yield Reads
    Reads.release.set()


def _run_until(engine, done, limit: int = 2000) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise AssertionError("the engine did not get there")


def test_an_adapter_being_read_holds_back_its_requests_only(model_dir, adapters, held_reads):
    """The read of one adapter waits (a slow disk); the base model's and another adapter's requests, queued after
    it, run to their end meanwhile, so the read is not in any step. Released, its request runs and matches
    transformers with the adapter merged."""
    every = LoRARequest("every", 1, str(adapters["every"]))
    attention = LoRARequest("attention", 2, str(adapters["attention"]))
    held_reads.held.add(attention.lora_path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), enable_lora=True, max_loras=2, kv_cache_memory_bytes=16 << 20) as llm:
        engine = llm.engine
        held = engine.add_request(EngineRequest("held", tuple(PROMPTS[0]), params, lora=attention))
        base = engine.add_request(EngineRequest("base", tuple(PROMPTS[1]), params))
        other = engine.add_request(EngineRequest("other", tuple(PROMPTS[2]), params, lora=every))
        _run_until(engine, lambda: base.finished and other.finished)
        assert held.num_computed_tokens == 0 and not held.output_token_ids  # it waited, set aside
        held_reads.release.set()
        _run_until(engine, lambda: held.finished)
        assert engine.block_table.num_used_blocks == 0
    assert held.output_token_ids == merged_greedy(model_dir, adapters["attention"], [PROMPTS[0]])[0]
    assert other.output_token_ids == merged_greedy(model_dir, adapters["every"], [PROMPTS[2]])[0]
    assert base.output_token_ids == merged_greedy(model_dir, None, [PROMPTS[1]])[0]


def test_a_failed_adapter_read_fails_its_requests_only(model_dir, adapters, held_reads):
    """A read that fails on the ranks (the file changed after the head checked it) ends that adapter's requests
    with the reason; the others run, and no block is kept."""
    every = LoRARequest("every", 1, str(adapters["every"]))
    held_reads.broken.add(every.lora_path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), enable_lora=True, kv_cache_memory_bytes=16 << 20) as llm:
        engine = llm.engine
        broken = [
            engine.add_request(EngineRequest(f"broken-{n}", tuple(PROMPTS[n]), params, lora=every)) for n in (0, 1)
        ]
        base = engine.add_request(EngineRequest("base", tuple(PROMPTS[2]), params))
        _run_until(engine, lambda: not engine.has_unfinished())
        assert engine.block_table.num_used_blocks == 0
    for request in broken:
        assert request.status is RequestStatus.FINISHED_ABORTED and request.error_code == "lora_load_failed"
        assert every.lora_path in request.error and "truncated" in request.error
    assert base.output_token_ids == merged_greedy(model_dir, None, [PROMPTS[2]])[0]


def test_a_rank_reports_adapters_read_dropped_and_failed(model_dir, adapters, tmp_path):
    """The news a rank gives the head: an adapter read beside the steps is ready; reading another into a host
    cache of one drops it (it is in no slot); a read that fails says why; an adapter held is ready at once."""
    from pagerail.proto import step_pb2

    def news(slots) -> tuple[list[int], list[int], dict[int, str]]:
        slots.wait_for_reads(30)
        result = step_pb2.StepResult()
        slots.report(result)
        return list(result.lora_ready), list(result.lora_dropped), {f.lora_id: f.message for f in result.lora_failed}

    with LLM(str(model_dir), enable_lora=True, max_loras=1, kv_cache_memory_bytes=16 << 20) as llm:
        slots = llm.engine.executor.worker.lora
        slots.prefetch(1, str(adapters["every"]))
        assert news(slots) == ([1], [], {})
        slots.prefetch(2, str(adapters["attention"]))
        assert news(slots) == ([2], [1], {})
        slots.prefetch(3, str(tmp_path / "missing"))
        ready, dropped, failed = news(slots)
        assert (ready, dropped, list(failed)) == ([], [], [3]) and str(tmp_path / "missing") in failed[3]
        slots.prefetch(2, str(adapters["attention"]))
        assert news(slots) == ([2], [], {})
        assert slots.num_loads == 0  # reads only: nothing was copied into a slot


def test_beam_search_with_an_adapter_matches_transformers_merged(model_dir, adapters):
    """LLM.beam_search with an adapter: the same beams, in the same order, as transformers' beam search on the
    adapter merged into the base weights (and not the base model's beams)."""
    every = LoRARequest("every", 1, str(adapters["every"]))
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir), enable_lora=True, kv_cache_memory_bytes=16 << 20) as llm:
        (with_adapter,) = llm.beam_search([PROMPTS[0]], params, lora_request=every)
        (base,) = llm.beam_search([PROMPTS[0]], params)

    def reference(adapter: Path | None) -> list[list[int]]:
        model = merged_model(model_dir, adapter)
        model.generation_config.eos_token_id = None
        out = model.generate(
            torch.tensor([PROMPTS[0]]),
            num_beams=3,
            num_return_sequences=3,
            max_new_tokens=6,
            do_sample=False,
            early_stopping=False,
            pad_token_id=0,
        )
        return out[:, len(PROMPTS[0]) :].tolist()

    want = reference(adapters["every"])
    assert [s.token_ids for s in with_adapter.sequences] == want
    assert want != reference(None) and [s.token_ids for s in base.sequences] == reference(None)
