"""Structured outputs and tool calling over HTTP with a scripted engine: the constraint each request hands the
engine, tool calls read from the text it generates (whole and streamed), and 400s that queue nothing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.fake_engine import FakeEngineClient
from tests.http_server import BackgroundServer

# A Hermes-style template that shows tools, earlier calls and tool results, like Qwen's.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    '{%- for call in message.tool_calls or [] %}<tool_call>{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "{%- if message.role == 'tool' %} [answers {{ message.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class ScriptedEngine(FakeEngineClient):
    """Generates `script` one token at a time (finishing "stop", or "length" at max_tokens), recording requests."""

    def __init__(self, tokenizer) -> None:
        super().__init__(model_name="fake", max_model_len=4096, vocab_size=len(tokenizer))
        self.tokenizer = tokenizer
        self.script = "Hello."
        self.requests: list[tuple[list[int], object]] = []

    async def generate(self, request):
        request_id, prompt_token_ids, params = request.request_id, request.prompt_token_ids, request.params
        self.requests.append((list(prompt_token_ids), params))
        tokens = self.tokenizer.encode(self.script, add_special_tokens=False)
        count = min(len(tokens), params.max_tokens or len(tokens))
        for position in range(count):
            done = position + 1 == count
            reason = ("stop" if count == len(tokens) else "length") if done else None
            yield RequestDelta(request_id, [tokens[position]], len(prompt_token_ids), position + 1, done, reason)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with BackgroundServer(create_app(ServerState(engine, tokenizer, FrontendSettings("fake")))) as base_url:
        yield base_url, engine


@pytest.fixture
def engine(server):
    engine = server[1]
    engine.requests.clear()
    return engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[0] + path, json={"model": "fake", "max_tokens": 50, **body}, timeout=60)


def constraint_sent(server, engine, path: str, body: dict):
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return engine.requests[-1][1].structured_outputs


# -- constraints handed to the engine --------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CONSTRAINTS = [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
        "json",
        json.dumps(SCHEMA),
    ),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "grammar", 'root ::= "a" | "b"'),
    ({"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA)),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("fields", "kind", "spec"), CONSTRAINTS)
def test_request_constraint_reaches_the_engine(server, engine, path, fields, kind, spec) -> None:
    body = {"messages": USER} if path == "/v1/chat/completions" else {"prompt": "Q:"}
    sent = constraint_sent(server, engine, path, {**body, **fields})
    # A schema's text is compared as JSON: its key order is the constraint's own business.
    got = (sent.kind, json.loads(sent.spec) if sent.kind == "json" else sent.spec) if sent else None
    assert got == ((kind, json.loads(spec) if kind == "json" else spec) if kind else None)


def test_tool_choice_constraints_reach_the_engine(server, engine) -> None:
    sent = constraint_sent(
        server, engine, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": NAMED}
    )
    assert sent.kind == "json" and json.loads(sent.spec) == WEATHER
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    schema = json.loads(constraint_sent(server, engine, "/v1/chat/completions", body).spec)
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    assert {o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]} == {"get_weather", "get_time"}
    for choice in ("auto", "none", None):
        body = {"messages": USER, "tools": TOOLS, **({"tool_choice": choice} if choice else {})}
        assert constraint_sent(server, engine, "/v1/chat/completions", body) is None


def test_tools_and_tool_turns_render_through_the_template(server, engine, tokenizer) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    assert post(server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS}).status_code == 200
    prompt = tokenizer.decode(engine.requests[-1][0])
    assert '"name": "get_weather"' in prompt and '"description": "Weather"' in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "Sunny, 24 C [answers call_1]" in prompt


# -- bad input: a 400 naming the field, nothing queued -----------------------------------------------

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
BAD = [
    ("json schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema"),
    ("no schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("json_schema missing", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("format type", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("regex", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ("grammar", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ("so schema", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ("two kinds", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("unknown kind", {"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ("empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("both", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("legacy", {"guided_json": SCHEMA}, "guided_json"),
]  # fmt: skip
TOOL_BAD = [
    ("unknown tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no"}}}, "tool_choice"),
    ("choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("choice word", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("choice and format", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("tool name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ("tool type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ("no function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("parameters list", {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ("parameters type", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ("twice", {"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ("named bad schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
                          "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ("required bad schema", {"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
                                       ], "tool_choice": "required"},
     "tools[2].function.parameters"),
    ("parallel", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("tool turn without id", {"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ("tool_calls on user", {"messages": [{"role": "user", "content": "x", "tool_calls": []}, *USER],
                            "tools": TOOLS}, None),
    ("call shape", {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("tool_calls on a user turn", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "fields", "param"), BAD + TOOL_BAD, ids=[c[0] for c in BAD + TOOL_BAD])
def test_bad_constraints_and_tools_are_400_and_queue_nothing(server, engine, name, fields, param) -> None:
    response = post(server, "/v1/chat/completions", {"messages": USER, **fields})
    if param is None:  # an empty list of calls is no call at all
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error", error
    assert engine.requests == []


@pytest.mark.parametrize(("name", "fields", "param"), BAD, ids=[c[0] for c in BAD])
def test_bad_constraints_on_completions(server, engine, name, fields, param) -> None:
    response = post(server, "/v1/completions", {"prompt": "Q:", **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert engine.requests == []


# -- tool calls in responses, whole and streamed -------------------------------------------------------


def ask(client, stream: bool, **fields) -> dict:
    """One chat request through the openai client; a stream is assembled by the client's own accumulator."""
    body = {"model": "fake", "messages": USER, "max_tokens": 200, **fields}
    if stream:
        try:
            with client.chat.completions.stream(**body) as events:
                completion = events.get_final_completion()
        except openai.LengthFinishReasonError as error:  # the client's parser refuses a cut answer, but keeps it
            completion = error.completion
    else:
        completion = client.chat.completions.create(**body)
    choice = completion.choices[0]
    calls = choice.message.tool_calls or []
    assert all(call.id.startswith("call_") and call.type == "function" for call in calls)
    named = [(call.function.name, call.function.arguments) for call in calls]
    return {"content": choice.message.content, "calls": named, "finish_reason": choice.finish_reason}


CALL_CASES = [
    # (tool_choice, generated text, content, calls)
    (NAMED, '{"city": "Paris", "days": 2}', None, [("get_weather", '{"city": "Paris", "days": 2}')]),
    (
        "required",
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]',
        None,
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    (
        "auto",
        'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        "I will look.",
        [("get_weather", '{"city": "Rome"}')],
    ),
    ("auto", "It is sunny.", "It is sunny.", []),
    ("none", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, []),
]


@pytest.mark.parametrize(("choice", "text", "content", "calls"), CALL_CASES)
def test_tool_calls_whole_and_streamed(client, engine, choice, text, content, calls) -> None:
    engine.script = text
    whole = ask(client, False, tools=TOOLS, tool_choice=choice)
    assert whole["calls"] == calls
    assert whole["content"] == (content if calls else text)
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    assert ask(client, True, tools=TOOLS, tool_choice=choice) == whole


def test_truncated_call_finishes_with_length(client, engine) -> None:
    engine.script = '{"city": "Paris", "days": 2}'
    cut = ask(client, False, tools=TOOLS, tool_choice=NAMED, max_tokens=3)
    assert cut["finish_reason"] == "length" and cut["calls"][0][0] == "get_weather"
    assert ask(client, True, tools=TOOLS, tool_choice=NAMED, max_tokens=3) == cut


def test_each_choice_reads_its_own_calls(server, engine) -> None:
    engine.script = '{"city": "Paris"}'
    body = {"messages": USER, "tools": TOOLS, "tool_choice": NAMED, "n": 2}
    choices = post(server, "/v1/chat/completions", body).json()["choices"]
    assert [c["message"]["tool_calls"][0]["function"]["arguments"] for c in choices] == ['{"city": "Paris"}'] * 2
    ids = {c["message"]["tool_calls"][0]["id"] for c in choices}
    assert len(ids) == 2 and all(c["finish_reason"] == "tool_calls" for c in choices)


def test_plain_chat_stream_is_unchanged(server, engine) -> None:
    engine.script = "Hi there."
    body = {"messages": USER, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json={"model": "fake", **body}) as response:
        lines = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in lines]
    assert (
        deltas[0] == {"role": "assistant", "content": ""}
        and "".join(d.get("content", "") for d in deltas) == "Hi there."
    )
    assert all("tool_calls" not in d for d in deltas) and lines[-1]["choices"][0]["finish_reason"] == "stop"


def test_server_refuses_an_unknown_tool_call_parser(tokenizer) -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerState(ScriptedEngine(tokenizer), tokenizer, FrontendSettings("fake", tool_call_parser="mistral"))


def test_configured_parser_reads_llama3_calls(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer)
    engine.script = '{"name": "get_time", "parameters": {}}'
    state = ServerState(engine, tokenizer, FrontendSettings("fake", tool_call_parser="llama3_json"))
    with BackgroundServer(create_app(state)) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
        assert ask(client, False, tools=TOOLS)["calls"] == [("get_time", "{}")]
