"""Constrained decoding in the batched step: outputs obey their constraint whatever the model prefers (a random one
here), unconstrained neighbours are untouched, and preemption, overlap, n > 1, penalties and logprobs keep it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagerail import LLM, SamplingParams, StructuredOutputs
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
from pagerail.common.grammar import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
GBNF = 'root ::= "(" num ("," num)? ")"\nnum ::= [0-9] [0-9]?'
PROMPTS = ["Describe a pet as JSON:", "hello there", "a b c d e f g", "1 2 3"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # The trimmed SmolLM2 tokenizer: byte tokens plus the first merges, so any text can be spelled.
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), TinyLlamaShape(hidden_size=64, vocab_size=600))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), block_size=4, num_gpu_blocks=1024, max_num_batched_tokens=64)


def constrained(kind: str, temperature: float = 0.0, seed: int | None = None, **extra) -> SamplingParams:
    constraint = {
        "json": StructuredOutputs(json=SCHEMA),
        "regex": StructuredOutputs(regex=REGEX),
        "choice": StructuredOutputs(choice=CHOICES),
        "grammar": StructuredOutputs(grammar=GBNF),
        "json_object": StructuredOutputs(json_object=True),
    }[kind]
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=160, structured_outputs=constraint, **extra)


def check_text(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})?\)", text), text


# Any JSON object (json_object) is unbounded, and a random model never closes one: it is tested on a real model over
# HTTP (tests/test_structured_http.py).
KINDS = ["json", "regex", "choice", "grammar"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_of_constraint_holds_on_a_random_model(llm, temperature):
    params = [constrained(kind, temperature, seed=3) for kind in KINDS]
    outputs = llm.generate(PROMPTS[:1] * len(KINDS), params)
    for kind, output in zip(KINDS, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (kind, completion.text)
        check_text(kind, completion.text)
    # Unconstrained, the same random model produces none of this.
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=temperature, seed=3, max_tokens=40))
    with pytest.raises((ValueError, AssertionError)):
        check_text("json", free[0].outputs[0].text)


def test_unconstrained_requests_get_the_same_tokens_next_to_constrained_ones(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    mixed_prompts, mixed_params = [], []
    for prompt, kind in zip(PROMPTS, KINDS, strict=False):
        mixed_prompts += [prompt, prompt]
        mixed_params += [plain, constrained(kind)]
    before = constrain_steps(llm)
    mixed = llm.generate(mixed_prompts, mixed_params)
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]
    for kind, output in zip(KINDS, mixed[1::2], strict=False):
        check_text(kind, output.outputs[0].text)
    # The rank's time on masks is its own step phase, observed only in steps with constrained rows.
    assert constrain_steps(llm) > before
    unchanged = constrain_steps(llm)
    llm.generate(PROMPTS, plain)
    assert constrain_steps(llm) == unchanged


def constrain_steps(llm: LLM) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = llm.engine.metrics_text().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagerail_step_duration_seconds_count" and sample.labels.get("phase") == "constrain":
                return sample.value
    return 0.0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_chunked_prefill_and_overlap_keep_constrained_outputs(tiny_dir, llm, async_scheduling):
    prompts = [p * 2 for p in PROMPTS]  # longer than one step's budget: prefilled in chunks
    params = [constrained("json", 0.0), constrained("json", 1.0, seed=5), constrained("grammar", 1.0, seed=9)]
    params.append(constrained("regex", 0.0))
    prompts, params = prompts * 2, params * 2
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # 48 blocks of 4 tokens cannot hold eight requests of this length at once: some are preempted and recomputed.
    tight = LLM(
        str(tiny_dir), block_size=4, num_gpu_blocks=48, max_num_batched_tokens=16, async_scheduling=async_scheduling
    )
    outputs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == roomy
    assert tight.stats.num_preemptions > 0
    assert tight.engine.block_table.num_free_blocks == tight.engine.block_table.num_blocks
    tight.shutdown()


def test_n_penalties_and_logprobs_with_a_constraint(llm):
    params = constrained("json", 1.0, seed=1, n=3, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2)
    (output,) = llm.generate(PROMPTS[:1], params)
    assert len(output.outputs) == 3
    for completion in output.outputs:
        check_text("json", completion.text)
        # Every sampled token was allowed, so its logprob is finite.
        pairs = zip(completion.logprobs, completion.token_ids, strict=True)
        assert all(entry[token] > float("-inf") for entry, token in pairs)


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"json": {"type": "nope"}}, "structured_outputs.json"),
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_anything_is_queued(llm, constraint, field):
    with pytest.raises(GrammarError) as caught:
        llm.generate(["x", "y"], [SamplingParams(), SamplingParams(structured_outputs=constraint)])
    assert caught.value.field == field
    assert not llm.engine.has_unfinished() and not llm.engine.scheduler.requests


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"choice": []}, "at least one"),
        ({"choice": "yes"}, "list of strings"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1, 2]}, "schema object"),
        ({"regex": ""}, "non-empty"),
        ({"json_object": "yes"}, "bool"),
    ],
)
def test_the_shape_of_a_constraint_is_checked_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)


def test_a_schema_keeps_its_property_order_and_dicts_are_accepted():
    params = SamplingParams(structured_outputs={"json": '{"properties": {"b": {}, "a": {}}}'})
    assert params.structured_outputs.kind == "json"
    assert list(json.loads(params.structured_outputs.spec)["properties"]) == ["b", "a"]
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"unknown": 1})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=42)


def test_a_matcher_follows_its_request_through_a_restart_and_a_rollback(tiny_dir):
    import torch

    from pagerail.common.sampling_wire import sampling_from_step
    from pagerail.proto import step_pb2
    from pagerail.worker.constraints import ConstraintMatchers
    from pagerail.worker.request_state import RequestState

    sampling = sampling_from_step(
        step_pb2.SamplingParams(
            temperature=1.0, constraint_kind="json", constraint_spec=json.dumps(SCHEMA), stop_token_ids=[2]
        )
    )

    def state_with(outputs: list[int]) -> RequestState:
        return RequestState(7, [5, 6, 7, *outputs], 3, sampling, [], 0, None)

    def forbidden(matchers: ConstraintMatchers, state: RequestState) -> list[int]:
        logits = torch.zeros(1, 600)
        matchers.mask(logits, [state])
        return torch.isinf(logits[0]).nonzero().flatten().tolist()

    live, state = ConstraintMatchers(tiny_dir, 600), state_with([])
    live.start([state])
    generator = torch.Generator().manual_seed(0)
    masks, done = [], []
    while not done and len(state.token_ids) < 80:
        logits = torch.rand(1, 600, generator=generator)
        live.mask(logits, [state])
        masks.append(torch.isinf(logits[0]).nonzero().flatten().tolist())
        token = int(logits.argmax())
        done = live.advance([state], [token])
        state.token_ids.append(token)
    outputs = state.token_ids[3:]
    assert done == [7] and len(outputs) > 10
    jsonschema.validate(json.loads(_decode(tiny_dir, outputs)), SCHEMA)
    # A rank restarted mid-request gets the request anew with its outputs so far: the matcher replays them.
    restarted = ConstraintMatchers(tiny_dir, 600)
    for k in (0, 5, len(outputs) - 1):
        fresh = state_with(outputs[:k])
        restarted.release(fresh)
        restarted.start([fresh])
        assert forbidden(restarted, fresh) == masks[k]
    # Fewer outputs than the matcher has seen (a rolled-back request): it is brought back to them.
    assert forbidden(live, state_with(outputs[:4])) == masks[4]
    assert forbidden(live, state_with(outputs[:9])) == masks[9]


def _decode(model_dir, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)).decode(token_ids)


def test_the_accelerator_mask_forbids_exactly_what_the_host_mask_does():
    import numpy as np
    import torch

    from pagerail.worker.constraints import mask_on_device

    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31 - 1, size=(3, 20), dtype=np.int32)  # 640 bits for a 600-token vocabulary
    logits = torch.randn(5, 600)
    rows = [4, 0, 2]
    expected = logits.clone()
    forbidden = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little").view(np.bool_)[:, :600]
    for index, row in enumerate(rows):
        expected[row][torch.from_numpy(forbidden[index])] = float("-inf")
    mask_on_device(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[1]).sum() == 0 and torch.isinf(logits[4]).sum() > 250
