"""The official openai client against the HTTP server on the embedded model: constrained outputs follow their JSON
schema, regex or choice, and tool calls carry arguments that follow the tool's schema, streamed or whole."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from pagerail import LLM
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.http_server import BackgroundServer

pytestmark = pytest.mark.slow
MODEL = "smollm2"
MAX_TOKENS = 300
# A KV cache of 512 MiB rather than the CPU default of 2 GiB: still over 11,000 tokens, room for the whole batch of
# schemas at once.
KV_BYTES = 512 << 20


def text(max_length: int = 12, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


def closed(properties: dict, required: list[str] | None = None) -> dict:
    """An object with exactly these properties, all required unless `required` says otherwise."""
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


# Bounded shapes (short strings, few items, integer ranges), so every answer is complete well within MAX_TOKENS.
SCHEMAS = [
    closed({"name": text(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    closed({"person": closed({"first": text(), "last": text()})}),
    closed({"fruits": {"type": "array", "items": text(10), "minItems": 2, "maxItems": 3}}),
    closed({"color": {"enum": ["red", "green", "blue"]}}),
    closed({"celsius": {"type": "number", "minimum": -50, "maximum": 50}}),
    closed({"done": {"type": "boolean"}, "note": text(8)}),
    closed({"title": text(), "subtitle": text()}, required=["title"]),
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 4},
    closed(
        {
            "lines": {
                "type": "array",
                "items": closed({"sku": text(6), "qty": {"type": "integer", "minimum": 1, "maximum": 99}}),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    closed({"version": {"const": "1.0"}, "ok": {"type": "boolean"}}),
    closed({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, text(8)]}}),
    closed({"nickname": {"type": ["string", "null"], "maxLength": 10}}),
    closed({"rating": {"enum": [1, 2, 3, 4, 5]}, "comment": text(16)}),
    closed({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    closed({"a": closed({"b": closed({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})}),
    {
        **closed({"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}}),
        "$defs": {"address": closed({"city": text(), "street": text(16)})},
    },
    closed({"percent": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
    closed({"tags": {"type": "array", "items": {"enum": ["news", "sport", "tech"]}, "minItems": 1, "maxItems": 3}}),
    closed({"code": text(6, minLength=3), "count": {"type": "integer", "minimum": 0, "maximum": 10}}),
    closed(
        {
            "event": text(),
            "labels": {"type": "array", "items": text(5), "maxItems": 2},
            "active": {"type": "boolean"},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        required=["event", "active"],
    ),
]
WEATHER = closed(
    {
        "city": text(16),
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    required=["city", "unit"],
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "add", "parameters": closed({"a": {"type": "integer"}, "b": {"type": "integer"}})},
    },
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def base_url(smollm2_dir):
    llm = LLM(str(smollm2_dir), served_model_name=MODEL, kv_cache_memory_bytes=KV_BYTES)
    engine = llm.engine_client
    with BackgroundServer(create_app(ServerState(engine, llm.tokenizer, FrontendSettings(MODEL)))) as url:
        yield url + "/v1"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)


def chat(content: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, **fields}


def test_json_schemas_hold_greedy_and_sampled_in_one_batch(base_url) -> None:
    async def all_at_once() -> list:
        api = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
        requests = []
        for number, schema in enumerate(SCHEMAS):
            response_format = {"type": "json_schema", "json_schema": {"name": f"s{number}", "schema": schema}}
            prompt = "Reply with JSON."  # short: the constraint, not the prompt, is under test
            for temperature in (0.0, 1.0):
                body = chat(prompt, response_format=response_format, temperature=temperature, seed=number)
                requests.append(api.chat.completions.create(**body))
        try:
            return await asyncio.gather(*requests)
        finally:
            await api.close()

    responses = asyncio.run(all_at_once())
    for number, response in enumerate(responses):
        schema, choice = SCHEMAS[number // 2], response.choices[0]
        assert choice.finish_reason == "stop", (number, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_and_json_object(client) -> None:
    pattern = "[A-Z][a-z]{2,8} [0-9]{2}"
    for temperature in (0.0, 1.0):
        answer = client.chat.completions.create(
            **chat(
                "Name a month and a day.",
                temperature=temperature,
                extra_body={"structured_outputs": {"regex": pattern}},
            )
        )
        assert re.fullmatch(pattern, answer.choices[0].message.content), answer.choices[0].message.content
        picked = client.completions.create(
            model=MODEL,
            prompt="The colour of the sky is",
            max_tokens=20,
            temperature=temperature,
            extra_body={"structured_outputs": {"choice": ["blue", "green", "red"]}},
        )
        assert picked.choices[0].text in ("blue", "green", "red")
    anything = client.chat.completions.create(
        **chat(
            'Return a JSON object with one key, "capital", for France.',
            temperature=0.0,
            response_format={"type": "json_object"},
        )
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def calls_of(client, stream: bool, **fields) -> list[tuple[str, str]]:
    body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": MAX_TOKENS, "temperature": 0.0, **fields}
    if stream:
        with client.chat.completions.stream(**body) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**body)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    return [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]


def test_named_and_required_tool_calls_follow_the_tool_schema(client) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (named, "required"):
        whole = calls_of(client, False, tools=TOOLS, tool_choice=tool_choice)
        assert whole and all(name in schemas for name, _ in whole)
        assert tool_choice == "required" or [name for name, _ in whole] == ["get_weather"]
        for name, arguments in whole:
            jsonschema.validate(json.loads(arguments), schemas[name])
        assert calls_of(client, True, tools=TOOLS, tool_choice=tool_choice) == whole
