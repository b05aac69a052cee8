"""Chat rendering through the model's template, and completion prompt encoding."""

from __future__ import annotations

import copy

import pytest

from pagerail.cluster.frontend.chat import encode_prompt, render_chat
from pagerail.cluster.frontend.errors import APIError
from pagerail.cluster.frontend.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagerail.common.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


def _reference(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _error(call, *args) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args)
    assert info.value.status == 400
    return info.value


def test_render_matches_the_template(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = render_chat(tokenizer, messages)
    assert ids == _reference(tokenizer, messages)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "Hi there" in text


def test_request_models_and_dicts_render_alike(tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hey"}]}
    request = ChatCompletionRequest.model_validate(copy.deepcopy(body))
    assert render_chat(tokenizer, request.messages) == render_chat(tokenizer, body["messages"])


def test_text_parts_are_flattened(tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    flat = render_chat(tokenizer, [{"role": "user", "content": parts}])
    assert flat == _reference(tokenizer, [{"role": "user", "content": "first\nsecond"}])


def test_developer_role_renders_as_system(tokenizer) -> None:
    assert render_chat(tokenizer, [{"role": "developer", "content": "x"}]) == _reference(
        tokenizer, [{"role": "system", "content": "x"}]
    )


def test_non_text_part_is_refused(tokenizer) -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}, image]}]
    err = _error(render_chat, tokenizer, messages)
    assert err.param == "messages[1].content" and "image_url" in err.message


def test_bad_messages_are_refused(tokenizer) -> None:
    assert _error(render_chat, tokenizer, []).param == "messages"
    err = _error(render_chat, tokenizer, [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    assert err.param == "messages[1].role" and "messages[1].role" in err.message
    assert _error(render_chat, tokenizer, [{"role": "user"}]).param == "messages[0].content"
    assert render_chat(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}])


def test_missing_chat_template(tokenizer) -> None:
    bare = copy.copy(tokenizer)
    bare.chat_template = None
    err = _error(render_chat, bare, [{"role": "user", "content": "hi"}])
    assert "chat template" in err.message and "/v1/completions" in err.message


def test_encode_prompt(tokenizer) -> None:
    assert encode_prompt(tokenizer, "Hello world", tokenizer.vocab_size) == tokenizer.encode("Hello world")
    assert encode_prompt(tokenizer, [1, 2, 3], 10) == [1, 2, 3]
    for bad in ([], [10], [-1], [1, True]):
        err = _error(encode_prompt, tokenizer, bad, 10)
        assert err.param == "prompt"
    assert "[0, 10)" in _error(encode_prompt, tokenizer, [3, 12], 10).message
    assert _error(encode_prompt, tokenizer, "", 10).param == "prompt"
