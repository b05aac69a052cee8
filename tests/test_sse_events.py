"""Streamed chunks written from templates are byte for byte what json.dumps(..., ensure_ascii=False) writes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pagerail.cluster.frontend.sse_events import ChunkEvents

# Any text a model or a client can put in a field: quotes, backslashes, control characters, non-ASCII, surrogates.
texts = st.text(alphabet=st.characters(codec=None), max_size=20)
floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), floats, texts)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
finish_reasons = st.one_of(st.none(), st.sampled_from(["stop", "length", "abort", "tool_calls"]), texts)
indices = st.integers(0, 2**40)
deltas = st.one_of(
    st.fixed_dictionaries({"content": texts}),
    st.fixed_dictionaries({"content": st.none()}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), texts)}),
    st.dictionaries(texts, values, max_size=3),
)
objects = st.sampled_from(["text_completion", "chat.completion.chunk"])
envelopes = st.tuples(texts, objects, st.integers(0, 2**40), texts)


def _dumped(envelope: tuple, choices: list, **extra) -> str:
    id, object, created, model = envelope
    payload = {"id": id, "object": object, "created": created, "model": model, "choices": choices, **extra}
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# A completions chunk carries "text", a chat chunk a "delta" object; both are written from the same template.
contents = st.one_of(st.tuples(st.just("text"), texts), st.tuples(st.just("delta"), deltas))


@settings(max_examples=600, deadline=None)
@given(envelopes, indices, contents, st.one_of(st.none(), values), finish_reasons)
def test_chunk_matches_json_dumps(envelope, index, content, logprobs, finish_reason):
    key, value = content
    events = ChunkEvents(*envelope)
    write = events.text_choice if key == "text" else events.delta_choice
    choice = {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}
    assert write(index, value, logprobs, finish_reason) == _dumped(envelope, [choice])


@settings(max_examples=100, deadline=None)
@given(envelopes, st.lists(st.dictionaries(texts, values, max_size=3), max_size=3), st.dictionaries(texts, values))
def test_any_event_matches_json_dumps(envelope, choices, extra):
    extra = {key: value for key, value in extra.items() if key not in {"id", "object", "created", "model", "choices"}}
    assert ChunkEvents(*envelope).event(choices, **extra) == _dumped(envelope, choices, **extra)


def test_a_chunk_parses_back_to_its_fields():
    event = ChunkEvents('cmpl-"1"', "text_completion", 7, "m\u00e9").text_choice(2, 'a "b"\n\u00e9', None, "stop")
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: ") :]) == {
        "id": 'cmpl-"1"',
        "object": "text_completion",
        "created": 7,
        "model": "m\u00e9",
        "choices": [{"index": 2, "text": 'a "b"\n\u00e9', "logprobs": None, "finish_reason": "stop"}],
    }
