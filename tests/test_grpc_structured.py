"""Output constraints on the public gRPC API: the `constraint` oneof to StructuredOutputs, refusals before anything
is queued, and constrained generations on a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from pagerail.cluster.frontend.grpc_api import build_grpc_server
from pagerail.cluster.frontend.grpc_convert import constraint_field, sampling_params_from_proto
from pagerail.common.structured_outputs import StructuredOutputs
from pagerail.proto import api_pb2, api_pb2_grpc
from tests.fake_engine import FakeEngineClient

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagerail.common.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


class RecordingEngine(FakeEngineClient):
    """The fake engine, remembering the sampling params of every request that reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: list = []

    async def generate(self, request):
        self.queued.append(request.params)
        async for delta in super().generate(request):
            yield delta


@contextlib.asynccontextmanager
async def stub_for(engine, tokenizer) -> AsyncIterator[api_pb2_grpc.GenerationStub]:
    server, port = build_grpc_server(engine, tokenizer, host="127.0.0.1", port=0)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield api_pb2_grpc.GenerationStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


def request(**sampling) -> api_pb2.GenerateRequest:
    params = api_pb2.SamplingParams(max_tokens=4, **sampling)
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[5, 6, 7]), sampling_params=params)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(json_schema=json.dumps(SCHEMA)), StructuredOutputs(json=SCHEMA)),
        (dict(regex=r"\d+"), StructuredOutputs(regex=r"\d+")),
        (dict(choice=api_pb2.Choices(choices=["yes", "no"])), StructuredOutputs(choice=("yes", "no"))),
        (dict(grammar='root ::= "a"+'), StructuredOutputs(grammar='root ::= "a"+')),
        (dict(json_object=True), StructuredOutputs(json_object=True)),
        (dict(json_object=False), None),  # proto3's false: off
        ({}, None),
    ],
)
def test_the_constraint_oneof_becomes_structured_outputs(fields, expected):
    message = api_pb2.SamplingParams(temperature=0.0, **fields)
    params = sampling_params_from_proto(message)
    assert params.structured_outputs == expected and params.temperature == 0.0
    name = next(iter(fields), None)
    assert constraint_field(message) == (None if expected is None else f"sampling_params.{name}")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(json_schema="{"), "is not valid JSON"),
        (dict(json_schema="[1, 2]"), "must be a JSON schema object"),
        (dict(regex=""), "non-empty string"),
        (dict(choice=api_pb2.Choices()), "at least one string"),
        (dict(choice=api_pb2.Choices(choices=["a", ""])), "non-empty strings"),
    ],
)
def test_a_malformed_constraint_is_refused_naming_the_message_field(fields, words):
    with pytest.raises(ValueError, match=f"^sampling_params.{next(iter(fields))} .*{words}"):
        sampling_params_from_proto(api_pb2.SamplingParams(**fields))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(json_schema="{"), "is not valid JSON"),
        (dict(json_schema='{"type": "nonsense"}'), "nonsense"),
        (dict(json_schema='{"$ref": "#/definitions/missing"}'), "missing"),
        (dict(regex="a{3,1}"), "invalid regex"),
        (dict(regex="("), "unclosed group"),
        (dict(grammar="root ::= ("), "cannot read the grammar"),
        (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_invalid_argument_and_never_queued(tokenizer, fields, words):
    engine = RecordingEngine()

    async def scenario():
        async with stub_for(engine, tokenizer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in stub.Generate(request(**fields))]
            return error.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"sampling_params.{next(iter(fields))}") and words in error.details()
    assert engine.queued == []


def test_a_constraint_without_a_tokenizer_is_invalid_argument():
    engine = RecordingEngine()

    async def scenario():
        async with stub_for(engine, None) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in stub.Generate(request(choice=api_pb2.Choices(choices=["a"])))]
            return error.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("sampling_params.choice: ") and "tokenizer" in error.details()
    assert engine.queued == []


def test_a_valid_constraint_reaches_the_engine_with_the_request(tokenizer):
    engine = RecordingEngine()

    async def scenario():
        async with stub_for(engine, tokenizer) as stub:
            return [r async for r in stub.Generate(request(json_schema=json.dumps(SCHEMA)))]

    responses = run(scenario())
    assert responses[-1].finish_reason == "length"  # the fake engine does not enforce it
    assert [p.structured_outputs for p in engine.queued] == [StructuredOutputs(json=SCHEMA)]


def test_a_session_with_a_constraint_is_refused_before_it_opens(tokenizer):
    engine = RecordingEngine()

    async def scenario():
        async with stub_for(engine, tokenizer) as stub:

            async def messages():
                params = api_pb2.SamplingParams(regex="[a-z]+")
                yield api_pb2.SessionRequest(token_ids=api_pb2.TokenIds(ids=[5, 6]), sampling_params=params)
                await asyncio.sleep(5)  # never reached: the first message is refused

            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in stub.Session(messages())]
            return error.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("sampling_params.regex: a Session takes no output constraint")
    assert engine.queued == []


@pytest.fixture(scope="module")
def constrained_engine(tmp_path_factory, tokenizer):
    """A real in-process engine on the tiny Llama sized to the embedded tokenizer (saved beside it for the ranks)."""
    from pagerail import LLM
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path_factory.mktemp("structured") / "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(path))
    llm = LLM(str(path), served_model_name="tiny", block_size=4, num_gpu_blocks=128, max_model_len=128)
    return llm, llm.engine_client


def test_constrained_generations_over_grpc_follow_the_schema_and_the_choices(constrained_engine, tokenizer):
    import jsonschema

    llm, engine = constrained_engine
    choices = ["red", "green", "blue"]

    async def scenario():
        async with stub_for(engine, llm.tokenizer) as stub:

            async def generate(**constraint):
                params = api_pb2.SamplingParams(temperature=0.0, max_tokens=48, **constraint)
                message = api_pb2.GenerateRequest(text="The answer is", sampling_params=params)
                return [r async for r in stub.Generate(message)]

            return await asyncio.gather(
                generate(json_schema=json.dumps(SCHEMA)), generate(choice=api_pb2.Choices(choices=choices))
            )

    as_json, as_choice = run(scenario())
    text = "".join(r.text for r in as_json)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert as_json[-1].finish_reason == "stop" and as_json[-1].usage.completion_tokens < 48
    assert "".join(r.text for r in as_choice) in choices and as_choice[-1].finish_reason == "stop"


def test_a_grpc_request_may_turn_speculation_off():
    assert sampling_params_from_proto(api_pb2.SamplingParams()).speculative is True
    assert sampling_params_from_proto(api_pb2.SamplingParams(speculative=False)).speculative is False
