"""SamplingParams: defaults, conversions and one ValueError per bad field."""

from __future__ import annotations

import dataclasses

import pytest

from pagerail.cluster.core.sampling_params import SamplingParams


def test_defaults_are_valid_and_not_greedy() -> None:
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and params.top_k == 0
    assert params.stop_token_ids == () and params.stop == ()
    assert not params.greedy


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_lists_become_tuples_and_ints_become_floats() -> None:
    params = SamplingParams(stop_token_ids=[2, 7], stop=["\n\n", "END"], temperature=0, top_p=1, repetition_penalty=2)
    assert params.stop_token_ids == (2, 7)
    assert params.stop == ("\n\n", "END")
    assert isinstance(params.temperature, float) and isinstance(params.repetition_penalty, float)
    assert params.greedy
    hash(params)  # tuples keep the frozen dataclass hashable


def test_single_stop_string_is_accepted() -> None:
    assert SamplingParams(stop="###").stop == ("###",)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 1},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": 0},
        {"n": 128},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"min_p": 1.0, "top_p": 1e-3},
    ],
)
def test_edge_values_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_bad_field_raises_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_message_names_the_limit() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
