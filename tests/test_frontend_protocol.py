"""OpenAI request models: valid requests become SamplingParams, invalid ones become 400s naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pagerail.cluster.frontend.errors import (
    APIError,
    error_body,
    from_validation_error,
    from_value_error,
    not_found_model,
    overloaded,
    payload_too_large,
    unauthorized,
    unavailable,
)
from pagerail.cluster.frontend.protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})


def _rejected(cls: type, body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    err = from_validation_error(info.value)
    assert err.status == 400
    return err


def test_completion_maps_every_sampling_field() -> None:
    request = _completion(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3, n=2, stop="###",
        stop_token_ids=[5, 6], presence_penalty=0.1, frequency_penalty=-0.2, repetition_penalty=1.1, logprobs=3,
        ignore_eos=True, include_stop_str_in_output=True, min_tokens=2, skip_special_tokens=False, user="u",
        speculative=False,
    )  # fmt: skip
    params = request.to_sampling_params(default_max_tokens=100)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == (7, 0.5, 0.9, 40, 0.05)
    assert (params.seed, params.n, params.stop, params.stop_token_ids) == (3, 2, ("###",), (5, 6))
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.1, -0.2, 1.1)
    assert (params.logprobs, params.ignore_eos, params.include_stop_str_in_output) == (3, True, True)
    assert (params.min_tokens, params.skip_special_tokens, params.speculative) == (2, False, False)


def test_defaults_and_explicit_nulls() -> None:
    params = _completion(temperature=None, top_p=None, n=None, stop=None).to_sampling_params(default_max_tokens=42)
    assert params.max_tokens == 42 and params.temperature == 1.0 and params.n == 1 and params.stop == ()
    assert params.logprobs is None and params.skip_special_tokens


def test_stop_as_string_or_list() -> None:
    assert _completion(stop="\n").to_sampling_params(10).stop == ("\n",)
    assert _completion(stop=["a", "bc"]).to_sampling_params(10).stop == ("a", "bc")
    assert _completion(stop=[]).to_sampling_params(10).stop == ()
    assert _rejected(CompletionRequest, {"prompt": "x", "stop": [1]}).param == "stop"
    assert _rejected(CompletionRequest, {"prompt": "x", "stop": [""]}).param == "stop"
    assert _rejected(CompletionRequest, {"prompt": "x", "stop": ["s"] * 17}).param == "stop"


@pytest.mark.parametrize(
    "prompt, batch",
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_shapes(prompt: Any, batch: list) -> None:
    assert _completion(prompt=prompt).prompt_list() == batch


@pytest.mark.parametrize("prompt", [5, [], [1, "a"], [[]], [True], {"text": "x"}, None])
def test_bad_prompt_names_prompt(prompt: Any) -> None:
    err = _rejected(CompletionRequest, {"prompt": prompt})
    assert err.param == "prompt" and "prompt" in err.message


def test_missing_prompt() -> None:
    err = _rejected(CompletionRequest, {"model": "m"})
    assert err.param == "prompt" and "required" in err.message.lower()


@pytest.mark.parametrize(
    "field, value",
    [("temperature", "0.5"), ("max_tokens", 0), ("max_tokens", 1.5), ("n", True), ("logprobs", 21), ("seed", "1")],
)
def test_type_and_range_errors_name_the_field(field: str, value: Any) -> None:
    assert _rejected(CompletionRequest, {"prompt": "x", field: value}).param == field


@pytest.mark.parametrize(
    "field, value, limit",
    [("top_p", 1.5, "(0, 1]"), ("temperature", -1, ">= 0"), ("n", 0, ">= 1"), ("presence_penalty", 3, "[-2, 2]")],
)
def test_sampling_limits_become_api_errors(field: str, value: Any, limit: str) -> None:
    with pytest.raises(APIError) as info:
        _completion(**{field: value}).to_sampling_params(16)
    assert info.value.status == 400 and info.value.param == field and limit in info.value.message


def test_min_tokens_above_default_max_tokens() -> None:
    with pytest.raises(APIError) as info:
        _completion(min_tokens=50).to_sampling_params(default_max_tokens=10)
    assert info.value.param == "min_tokens"


@pytest.mark.parametrize("field, value", [("suffix", "tail")])
def test_unsupported_completion_fields(field: str, value: Any) -> None:
    err = _rejected(CompletionRequest, {"prompt": "x", field: value})
    assert err.param == field and "not supported" in err.message
    _completion(**{field: None})  # an explicit null or false is fine


@pytest.mark.parametrize("make", [_completion, _chat])
def test_logit_bias_and_allowed_tokens_reach_the_sampling_params(make) -> None:
    params = make(logit_bias={"7": 100, "3": -2.5}, allowed_token_ids=[9, 4, 9]).to_sampling_params(
        default_max_tokens=10
    )
    assert params.logit_bias == ((3, -2.5), (7, 100.0)) and params.allowed_token_ids == (4, 9)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("logit_bias", {"x": 1.0}, "token ids"),
        ("logit_bias", {"5": 101}, "[-100, 100]"),
        ("logit_bias", {"-5": 1}, "token ids"),
        ("allowed_token_ids", [], "non-empty"),
        ("allowed_token_ids", [-1], ">= 0"),
    ],
)
def test_bad_logit_bias_and_allowed_tokens_are_refused_naming_the_field(field: str, value: Any, says: str) -> None:
    with pytest.raises((ValidationError, APIError)) as info:
        _completion(**{field: value}).to_sampling_params(default_max_tokens=10)
    err = from_validation_error(info.value) if isinstance(info.value, ValidationError) else info.value
    assert err.status == 400 and field in (err.param or "") and says in err.message, err


def test_extra_fields_are_ignored() -> None:
    request = _completion(extra_body={"x": 1}, some_vendor_option=True)
    assert not hasattr(request, "some_vendor_option")


def test_stream_options() -> None:
    assert _completion(stream=True, stream_options={"include_usage": True}).include_usage()
    assert not _completion(stream=True).include_usage()
    err = _rejected(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}})
    assert err.param == "stream_options"
    bad = {"prompt": "x", "stream": True, "stream_options": {"include_usage": 3}}
    assert _rejected(CompletionRequest, bad).param == "stream_options.include_usage"


def test_chat_max_tokens_spellings() -> None:
    assert _chat(max_tokens=5).to_sampling_params(99).max_tokens == 5
    assert _chat(max_completion_tokens=6).to_sampling_params(99).max_tokens == 6
    assert _chat(max_tokens=6, max_completion_tokens=6).to_sampling_params(99).max_tokens == 6
    assert _chat().to_sampling_params(99).max_tokens == 99
    err = _rejected(ChatCompletionRequest, {"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 6})
    assert err.param == "max_completion_tokens"
    assert _rejected(ChatCompletionRequest, {"messages": CHAT, "max_completion_tokens": 0}).param == (
        "max_completion_tokens"
    )


def test_chat_logprobs() -> None:
    assert _chat().to_sampling_params(9).logprobs is None
    assert _chat(logprobs=True).to_sampling_params(9).logprobs == 0
    assert _chat(logprobs=True, top_logprobs=5).to_sampling_params(9).logprobs == 5
    assert _rejected(ChatCompletionRequest, {"messages": CHAT, "top_logprobs": 2}).param == "top_logprobs"
    bad = {"messages": CHAT, "logprobs": True, "top_logprobs": 21}
    assert _rejected(ChatCompletionRequest, bad).param == "top_logprobs"


def test_chat_message_errors_name_the_path() -> None:
    err = _rejected(ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]})
    assert err.param == "messages[0].role"
    err = _rejected(ChatCompletionRequest, {"messages": [CHAT[0], {"role": "user", "content": 5}]})
    assert err.param == "messages[1].content" and err.message.startswith("messages[1].content must be")
    assert _rejected(ChatCompletionRequest, {"messages": []}).param == "messages"
    err = _rejected(ChatCompletionRequest, {"messages": CHAT, "response_format": {"type": "yaml"}})
    assert err.param == "response_format.type"
    err = _rejected(ChatCompletionRequest, {"messages": CHAT, "tools": [{"type": "function"}]})
    assert err.param == "tools[0].function"
    assert _chat(response_format={"type": "text"}, tools=[]).to_sampling_params(9).max_tokens == 9
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert _chat(messages=[{"role": "user", "content": parts}]).messages[0].content[1].type == "image_url"


def test_error_body_shape_and_helpers() -> None:
    body = error_body(_rejected(CompletionRequest, {"prompt": "x", "top_k": "5"}))
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "top_k"
    assert unauthorized().status == 401 and unauthorized().code == "invalid_api_key"
    missing = not_found_model("gpt-9")
    assert (missing.status, missing.code, missing.param) == (404, "model_not_found", "model")
    assert payload_too_large(1024).status == 413 and "1024" in payload_too_large(1024).message
    busy = overloaded(0.3)
    assert (busy.status, busy.type, busy.headers) == (429, "rate_limit_error", {"Retry-After": "1"})
    down = unavailable("draining", retry_after_s=5)
    assert (down.status, down.headers) == (503, {"Retry-After": "5"})
    assert unavailable("down").headers == {}


def test_from_value_error_finds_the_field() -> None:
    assert from_value_error(ValueError("top_p must be in (0, 1], got 2")).param == "top_p"
    assert from_value_error(ValueError("messages[2].content is empty")).param == "messages[2].content"
    assert from_value_error(ValueError("Prompt too long for this model")).param is None


def test_every_sampling_setting_reaches_the_engine_from_each_front_door():
    """A SamplingParams field is a request field of the HTTP models and of the gRPC message under its own name
    (or one of the named exceptions), so a new setting cannot be left out of a front door unnoticed."""
    import dataclasses

    from pagerail.cluster.frontend.protocol import ChatCompletionRequest, CompletionRequest
    from pagerail.common.sampling_params import SamplingParams
    from pagerail.proto import api_pb2

    names = {field.name for field in dataclasses.fields(SamplingParams)}
    # Carried by response_format / structured_outputs (HTTP) and the `constraint` oneof (gRPC).
    constraint = {"structured_outputs"}
    # Spelled by the front door from bad_words with the model's tokenizer, never sent.
    derived = {"bad_words_token_ids"}
    names -= derived
    grpc_fields = {field.name for field in api_pb2.SamplingParams.DESCRIPTOR.fields}
    assert names - constraint <= grpc_fields
    for model in (CompletionRequest, ChatCompletionRequest):
        http_fields = set(model.model_fields)
        if model is ChatCompletionRequest:
            http_fields |= {"logprobs"}  # top_logprobs with logprobs: true
        assert names <= http_fields, (model.__name__, names - http_fields)
