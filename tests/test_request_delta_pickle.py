"""A RequestDelta crosses from a head to a frontend pickled by its fields in order; nothing is lost on the way."""

from __future__ import annotations

import dataclasses
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from pagerail.cluster.core.engine_client import RequestDelta

_VALUES = {
    "request_id": st.text(max_size=12),
    "token_ids": st.lists(st.integers(0, 2**31), max_size=5),
    "num_prompt_tokens": st.integers(0, 2**20),
    "num_output_tokens": st.integers(0, 2**20),
    "finished": st.booleans(),
    "finish_reason": st.one_of(st.none(), st.sampled_from(["stop", "length", "abort"])),
    "logprobs": st.lists(st.floats(allow_nan=False), max_size=5),
    "top_logprobs": st.lists(st.dictionaries(st.integers(0, 100), st.floats(allow_nan=False), max_size=3), max_size=3),
    "num_cached_tokens": st.integers(0, 2**20),
    "error": st.one_of(st.none(), st.text(max_size=12)),
    "error_code": st.one_of(st.none(), st.sampled_from(["worker_failure", "session_idle_timeout", "quarantined"])),
    "prompt_logprobs": st.one_of(
        st.none(),
        st.lists(
            st.one_of(
                st.none(),
                st.tuples(
                    st.floats(allow_nan=False),
                    st.integers(1, 2**20),
                    st.dictionaries(st.integers(0, 100), st.floats(allow_nan=False), max_size=3),
                ),
            ),
            max_size=4,
        ),
    ),
    "pooled": st.one_of(st.none(), st.lists(st.floats(allow_nan=False), max_size=4)),
}


def test_every_field_has_a_strategy():
    # A field added to RequestDelta but not to its __reduce__ would be dropped or shifted; the test below then
    # fails, once the new field has a strategy here.
    assert [field.name for field in dataclasses.fields(RequestDelta)] == list(_VALUES)


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries(_VALUES))
def test_pickle_round_trip_keeps_every_field(values):
    delta = RequestDelta(**values)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        copy = pickle.loads(pickle.dumps(delta, protocol=protocol))
        assert type(copy) is RequestDelta
        assert dataclasses.asdict(copy) == values


def test_a_batch_of_deltas_round_trips():
    deltas = [RequestDelta(f"r{i}", [i, i + 1], 3, i, finished=i == 2, finish_reason="stop") for i in range(3)]
    message = [(delta.request_id, delta) for delta in deltas]
    assert pickle.loads(pickle.dumps(message, protocol=5)) == message
