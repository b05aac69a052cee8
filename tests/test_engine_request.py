"""The request envelope: validated when built, frozen on its way, and resumable without losing anything."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagerail.cluster.core.engine_request import EngineRequest, SiblingGroup
from pagerail.common.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8, seed=3)


def test_lists_become_tuples_and_the_envelope_is_frozen_and_pickles_whole():
    request = EngineRequest(
        "r", [1, 2, 3], PARAMS, trace_context={"traceparent": "x"}, group=SiblingGroup("parent", 1, 2)
    )
    assert request.prompt_token_ids == (1, 2, 3) and request.resumed_output_token_ids == ()
    assert request.final and request.arrival_time > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.request_id = "other"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(request)) == request


def test_resumed_keeps_everything_but_the_offset():
    request = EngineRequest("r", [1, 2, 3], PARAMS, group=SiblingGroup("p", 0, 3))
    resumed = request.resumed([7, 8])
    assert resumed.resumed_output_token_ids == (7, 8) and resumed.num_resumed_tokens == 2
    assert dataclasses.replace(resumed, resumed_output_token_ids=()) == request


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": 5}, "request_id"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids"),
        ({"params": {"max_tokens": 3}}, "params"),
        ({"final": 0}, "final"),
        ({"trace_context": {"a": 1}}, "trace_context"),
        ({"arrival_time": "now"}, "arrival_time"),
        ({"resumed_output_token_ids": [4, -1]}, "resumed_output_token_ids"),
        ({"resumed_output_token_ids": [4], "final": False}, "resumed_output_token_ids"),
        ({"group": ("p", 0, 2)}, "group"),
    ],
)
def test_bad_fields_are_refused_by_name(changes, field):
    fields = {"request_id": "r", "prompt_token_ids": [1, 2], "params": PARAMS, **changes}
    with pytest.raises(ValueError, match=field):
        EngineRequest(**fields)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", 0, 2), "group.parent_id"),
        (("p", -1, 2), "group.index"),
        (("p", 2, 2), "group.index"),
        (("p", 0, 0), "group.size"),
        (("p", True, 2), "group.index"),
    ],
)
def test_a_sibling_group_names_a_real_sibling(args, field):
    with pytest.raises(ValueError, match=field):
        SiblingGroup(*args)
