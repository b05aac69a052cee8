"""SamplingParams: defaults, conversions and one ValueError per bad field."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagerail.common.sampling_params import SamplingParams
from pagerail.common.sampling_wire import sampling_from_step, sampling_to_step
from pagerail.common.structured_outputs import StructuredOutputs
from pagerail.proto import step_pb2


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
        # The per-token cost bounds hold for every front door (HTTP, gRPC and LLM build this class).
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop": ["s" * 257]}, "stop"),
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


# -- on the head-to-rank wire ------------------------------------------------------------------------------------

_WIRE_SETTINGS = st.fixed_dictionaries(
    {},
    optional={
        # Values that float32 holds exactly, so the rank's copy equals the head's.
        "temperature": st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]),
        "top_p": st.sampled_from([0.125, 0.5, 1.0]),
        "top_k": st.integers(-1, 100),
        "min_p": st.sampled_from([0.0, 0.0625, 1.0]),
        "seed": st.integers(-(2**63), 2**64 - 1),
        "repetition_penalty": st.sampled_from([0.5, 1.0, 1.25]),
        "presence_penalty": st.sampled_from([-2.0, 0.0, 0.5]),
        "frequency_penalty": st.sampled_from([-0.5, 0.0, 2.0]),
        "logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "min_tokens": st.integers(0, 8),
        "stop_token_ids": st.lists(st.integers(0, 1000), max_size=4).map(lambda ids: tuple(sorted(set(ids)))),
        "logit_bias": st.dictionaries(st.integers(0, 1000), st.sampled_from([-100.0, -0.5, 0.0, 2.25, 100.0])),
        "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 1000), min_size=1, max_size=5)),
        "bad_words_token_ids": st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=3), max_size=3).map(
            lambda sequences: tuple(tuple(sequence) for sequence in sequences)
        ),
        "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "structured_outputs": st.sampled_from(
            [
                None,
                StructuredOutputs(json={"type": "object"}),
                StructuredOutputs(json_object=True),
                StructuredOutputs(regex="[a-z]+"),
                StructuredOutputs(choice=("yes", "no")),
                StructuredOutputs(grammar='root ::= "a"'),
            ]
        ),
    },
)


@given(_WIRE_SETTINGS)
def test_a_rank_decodes_the_step_message_into_the_heads_sampling_params(settings) -> None:
    """Every setting the ranks act on arrives as the head had it (a negative seed wrapped to uint64, as torch
    wraps it); the head-only limits (max_tokens, stop strings) are not sent."""
    head = SamplingParams(max_tokens=32, stop=("END",), bad_words=("no",), **settings)
    rank = sampling_from_step(step_pb2.SamplingParams.FromString(sampling_to_step(head).SerializeToString()))
    expected = dataclasses.replace(head, max_tokens=None, stop=(), bad_words=())
    if head.seed is not None:
        expected = dataclasses.replace(expected, seed=head.seed & 0xFFFFFFFFFFFFFFFF)
    assert rank == expected


def test_an_empty_step_message_is_the_default_sampling_params() -> None:
    """Absent fields take SamplingParams' defaults (top_p and repetition_penalty 1, not the wire's zero)."""
    assert sampling_from_step(step_pb2.SamplingParams()) == SamplingParams(max_tokens=None)


def test_the_grpc_api_reads_logit_bias_and_allowed_tokens() -> None:
    from pagerail.cluster.frontend.grpc_convert import sampling_params_from_proto
    from pagerail.proto import api_pb2

    params = sampling_params_from_proto(api_pb2.SamplingParams(logit_bias={9: -100, 3: 1.5}, allowed_token_ids=[4, 1]))
    assert params.logit_bias == ((3, 1.5), (9, -100.0)) and params.allowed_token_ids == (1, 4)
    assert sampling_params_from_proto(api_pb2.SamplingParams()).allowed_token_ids is None
    with pytest.raises(ValueError, match=r"logit_bias\[9\] must be in \[-100, 100\]"):
        sampling_params_from_proto(api_pb2.SamplingParams(logit_bias={9: 101}))


def test_the_head_sends_the_requests_stop_ids_with_the_models_eos() -> None:
    message = sampling_to_step(SamplingParams(stop_token_ids=[9, 4]), stop_token_ids={9, 4, 2})
    assert list(message.stop_token_ids) == [2, 4, 9]


def test_a_bad_word_is_banned_where_the_outputs_end_with_the_rest_of_it() -> None:
    from pagerail.worker.request_state import bad_word_bans

    words = ((7,), (3, 4), (1, 2, 5))
    assert bad_word_bans(words, []) == (7,)
    assert bad_word_bans(words, [9, 3]) == (7, 4)
    assert bad_word_bans(words, [1, 2]) == (7, 5)
    assert bad_word_bans(words, [2, 1, 3]) == (7, 4)
    with pytest.raises(ValueError, match="bad_words must hold non-blank strings"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="bad_words_token_ids must hold non-empty"):
        SamplingParams(bad_words_token_ids=[[]])
