"""Tool-call parsers (Hermes, Llama 3 JSON, named, required), their streamed deltas against whole messages, and
the constraint each tool_choice asks for."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pagerail.cluster.frontend.chat_output import ChoiceOutput
from pagerail.cluster.frontend.tool_calls import (
    ArgumentsDelta,
    ContentParser,
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolCallStart,
    choose_parser,
    collect,
)
from pagerail.cluster.frontend.tool_choice import (
    NO_PARAMETERS,
    ToolDefinition,
    output_parser,
    parse_tool_choice,
    required_schema,
    tool_constraint,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TREE = {
    "type": "object",
    "properties": {"root": {"$ref": "#/$defs/node"}},
    "required": ["root"],
    "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
}


def tool(name: str, parameters: dict | None = None) -> ToolDefinition:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return ToolDefinition.model_validate({"type": "function", "function": function})


def run(parser, text: str, seed: int | None = None) -> list:
    """All events of `text` fed whole (seed None) or in random pieces of 1 to 6 characters."""
    if seed is None:
        return parser.feed(text) + parser.finish()
    rng, events, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        events += parser.feed(text[at : at + step])
        at += step
    return events + parser.finish()


def same_however_cut(make, text: str) -> tuple[str, list[tuple[str, str]]]:
    whole = collect(run(make(), text))
    for seed in range(30):
        assert collect(run(make(), text, seed)) == whole, seed
    return whole


HERMES_CASES = [
    # (generated text, content, calls)
    ("The weather is fine.", "The weather is fine.", []),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}'
        "</tool_call>",
        "",
        [("a", "{}"), ("b", '{"x": 1}')],
    ),
    # SmolLM2 writes a JSON list inside one tag.
    (
        '<tool_call>[{"name": "a", "arguments": {"q": "<x>"}}, {"name": "b", "arguments": {}}]</tool_call>',
        "",
        [("a", '{"q": "<x>"}'), ("b", "{}")],
    ),
    # A call whose JSON does not parse stays text; so does a lone "<tool".
    ("<tool_call>{not json}</tool_call> and <tool", "<tool_call>{not json}</tool_call> and <tool", []),
    # Generation that ends inside the tag is read as far as it goes.
    ('<tool_call>{"name": "a", "arguments": {"k": "v"}}', "", [("a", '{"k": "v"}')]),
    ('  <tool_call>{"name": "a", "arguments": {"k": ', '  <tool_call>{"name": "a", "arguments": {"k": ', []),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>', "", [("a", '{"k": 2}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser(text: str, content: str, calls: list) -> None:
    assert same_however_cut(HermesParser, text) == (content, calls)


def test_hermes_streams_content_before_the_call_and_holds_only_a_possible_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Sure, ") == ["Sure,"]
    assert parser.feed("here <tool") == [" here"]
    assert parser.feed("_call>") == []
    assert parser.feed('{"name": "f", "arguments": {}}</tool_call>') == [ToolCallStart(0, "f"), ArgumentsDelta(0, "{}")]
    assert parser.finish() == []


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", "{}")]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"a": [1]}}', "", [("f", "{}"), ("g", '{"a": [1]}')]),
    ("It is sunny in Oslo.", "It is sunny in Oslo.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_parser(text: str, content: str, calls: list) -> None:
    assert same_however_cut(Llama3JsonParser, text) == (content, calls)


def test_llama3_streams_plain_answers_at_once() -> None:
    parser = Llama3JsonParser()
    assert parser.feed("  ") == [] and parser.feed("Hi") == ["  Hi"] and parser.feed(" there") == [" there"]


def test_named_parser_streams_the_whole_output_as_arguments() -> None:
    assert same_however_cut(lambda: NamedCallParser("f"), '{"city": "Paris"}') == ("", [("f", '{"city": "Paris"}')])
    parser = NamedCallParser("f")
    assert parser.feed('{"a"') == [ToolCallStart(0, "f"), ArgumentsDelta(0, '{"a"')]
    assert parser.feed(": 1}") == [ArgumentsDelta(0, ": 1}")] and parser.finish() == []
    assert collect(NamedCallParser("g").finish()) == ("", [("g", "")])


def test_required_parser_reads_each_element() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "P}a\\"ris", "days": [1, {"n": 2}]}}, '
        '{"parameters": {"b": true}, "name": "g\\u00e9"}, {"name": "h", "parameters": {}}]'
    )
    content, calls = same_however_cut(RequiredCallsParser, text)
    assert content == "" and calls == [
        ("get_weather", '{"city": "P}a\\"ris", "days": [1, {"n": 2}]}'),
        ("gé", '{"b": true}'),
        ("h", "{}"),
    ]
    assert [json.loads(arguments) for _, arguments in calls][0]["city"] == 'P}a"ris'


def test_required_parser_streams_arguments_as_they_come() -> None:
    parser = RequiredCallsParser()
    assert parser.feed('[{"name": "f", "param') == [ToolCallStart(0, "f")]
    assert parser.feed('eters": {"a": ') == [ArgumentsDelta(0, '{"a": ')]
    assert parser.feed('1}}, {"name"') == [ArgumentsDelta(0, "1}")]
    assert parser.feed(': "g", "parameters": {}}]') == [ToolCallStart(1, "g"), ArgumentsDelta(1, "{}")]


def test_content_parser_passes_text_through() -> None:
    assert run(ContentParser(), "plain") == ["plain"] and ContentParser().feed("") == []


def test_choose_parser(smollm2_template: str) -> None:
    assert choose_parser(smollm2_template) == "hermes"
    assert choose_parser("{{ '<tool_call>' }}") == "hermes"
    assert choose_parser("{{ '<|python_tag|>' }}{{ '<|eom_id|>' }}") == "llama3_json"
    assert choose_parser(None) == "hermes"
    assert choose_parser(smollm2_template, "llama3_json") == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser"):
        choose_parser(smollm2_template, "mistral")


@pytest.fixture(scope="module")
def smollm2_template(smollm2_dir) -> str:
    return (smollm2_dir / "chat_template.jinja").read_text() if (smollm2_dir / "chat_template.jinja").exists() else ""


# -- streamed deltas assemble into the whole message -----------------------------------------------


def streamed(output: ChoiceOutput, text: str, seed: int, engine_reason: str = "stop") -> dict:
    """The chunks a stream of `text` in random pieces sends, assembled by the openai client's own code."""
    state = ChatCompletionStreamState()
    rng, at, pieces = random.Random(seed), 0, []
    while at < len(text):
        step = rng.randint(1, 8)
        pieces.append(text[at : at + step])
        at += step
    chunks = [output.opening()]
    for number, piece in enumerate(pieces):
        chunks += output.deltas(piece, final=number == len(pieces) - 1) or [{}]
    for number, delta in enumerate(chunks):
        reason = output.finish_reason(engine_reason) if number == len(chunks) - 1 else None
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    calls = [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    ids = [c.id for c in final.message.tool_calls or []]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    return {"content": final.message.content, "calls": calls, "finish_reason": final.finish_reason}


def whole(output: ChoiceOutput, text: str, engine_reason: str = "stop") -> dict:
    message = output.message(text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return {"content": message["content"], "calls": calls, "finish_reason": output.finish_reason(engine_reason)}


TOOLS = [tool("get_weather", WEATHER), tool("get_time")]
STREAM_CASES = [
    ("auto", HERMES_CASES[1][0]),
    ("auto", HERMES_CASES[3][0]),
    ("auto", "No tools needed."),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}'),
    ("none", HERMES_CASES[1][0]),
]


@pytest.mark.parametrize(("choice", "text"), STREAM_CASES)
def test_streamed_tool_calls_assemble_into_the_whole_message(choice, text: str) -> None:
    choice = parse_tool_choice(choice, TOOLS)
    expected = whole(ChoiceOutput(output_parser(choice, "hermes", True)), text)
    for seed in range(10):
        assert streamed(ChoiceOutput(output_parser(choice, "hermes", True)), text, seed) == expected
    assert (expected["finish_reason"] == "tool_calls") == bool(expected["calls"])
    if expected["calls"]:
        assert expected["content"] is None or expected["content"].strip()
    else:
        assert expected["content"] == text


def test_first_delta_of_a_call_carries_its_name_and_empty_arguments() -> None:
    output = ChoiceOutput(output_parser(parse_tool_choice("required", TOOLS), "hermes", True))
    first, second = output.deltas('[{"name": "get_weather", "parameters": {"ci', final=False)
    call = first["tool_calls"][0]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}


def test_a_call_cut_short_keeps_the_engine_reason() -> None:
    output = ChoiceOutput(output_parser(parse_tool_choice("required", TOOLS), "hermes", True))
    assert whole(output, '[{"name": "get_weather", "parameters": {"ci', "length")["finish_reason"] == "length"


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    output = ChoiceOutput(output_parser("auto", "hermes", False))
    assert whole(output, HERMES_CASES[2][0])["calls"] == [("a", "{}")]


# -- tool_choice → constraint ----------------------------------------------------------------------


def test_named_choice_constrains_to_the_function_parameters() -> None:
    choice = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    constraint, field = tool_constraint(TOOLS, choice, True)
    assert constraint.kind == "json" and json.loads(constraint.spec) == WEATHER
    assert field == "tools[0].function.parameters"
    constraint, _ = tool_constraint(
        TOOLS, parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS), True
    )
    assert json.loads(constraint.spec) == NO_PARAMETERS


def test_auto_and_none_do_not_constrain() -> None:
    assert tool_constraint(TOOLS, "auto", True) == (None, None)
    assert tool_constraint(TOOLS, "none", True) == (None, None)


def test_required_schema_accepts_calls_of_the_tools_only() -> None:
    tools = [*TOOLS, tool("grow", TREE)]
    constraint, field = tool_constraint(tools, "required", True)
    assert field == "tools" and constraint.kind == "json"
    schema = json.loads(constraint.spec)
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo"}},
        {"name": "get_time", "parameters": {}},
        {"name": "grow", "parameters": {"root": {"kids": [{"kids": []}]}}},
    ]
    jsonschema.validate(good, schema)
    bad = [
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "get_time", "parameters": {"extra": 1}}],
        [{"name": "get_time", "parameters": {}, "more": 1}],
        [{"name": "grow", "parameters": {"root": {"kids": [5]}}}],
    ]
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    single = required_schema(tools, parallel=False)
    assert single["maxItems"] == 1 and single["minItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


@pytest.mark.parametrize(
    ("value", "tools", "message"),
    [
        ("sometimes", TOOLS, "tool_choice must be 'none', 'auto', 'required'"),
        ({"type": "function"}, TOOLS, "tool_choice must be"),
        (5, TOOLS, "tool_choice must be"),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS, "must name one of the tools"),
        ("required", None, "tool_choice requires tools"),
        ("auto", [], "tool_choice requires tools"),
    ],
)
def test_bad_tool_choice(value, tools, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tool_choice(value, tools)


def test_tool_choice_none_needs_no_tools() -> None:
    assert parse_tool_choice("none", None) == "none"
    assert parse_tool_choice(None, TOOLS) is None
