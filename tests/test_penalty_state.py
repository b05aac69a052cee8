"""The incremental penalty history against counts rebuilt from each request's token list, over random histories."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagerail.common.sampling_params import SamplingParams
from pagerail.worker.penalty_state import PenaltyState
from pagerail.worker.request_state import RequestState

VOCAB = 40
HANDLES = st.integers(0, 5)
TOKENS = st.lists(st.integers(0, VOCAB - 1), max_size=8)


def _state(handle: int, tokens: list[int], num_prompt: int) -> RequestState:
    sampling = SamplingParams(repetition_penalty=1.2)
    return RequestState(handle, tokens, num_prompt, sampling, [], 0, None)


class PenaltyMachine(RuleBasedStateMachine):
    """Requests come and go, sample tokens and receive input chunks; any of them may ask for its history."""

    def __init__(self) -> None:
        super().__init__()
        self.penalties = PenaltyState(VOCAB, torch.device("cpu"), initial_rows=1)
        self.states: dict[int, RequestState] = {}

    @rule(handle=HANDLES, prompt=TOKENS, outputs=TOKENS)
    def join(self, handle: int, prompt: list[int], outputs: list[int]) -> None:
        """A new request (a reused handle replaces the old one); a restart brings outputs along."""
        old = self.states.pop(handle, None)
        if old is not None:
            self.penalties.release(old)
        self.states[handle] = _state(handle, prompt + outputs, len(prompt))

    @rule(handle=HANDLES, token=st.integers(0, VOCAB - 1))
    def sample(self, handle: int, token: int) -> None:
        if handle in self.states:
            self.states[handle].token_ids.append(token)

    @rule(handle=HANDLES, chunk=TOKENS.filter(bool))
    def input_chunk(self, handle: int, chunk: list[int]) -> None:
        """A streaming-input chunk: earlier outputs become prompt."""
        if handle in self.states:
            state = self.states[handle]
            state.token_ids.extend(chunk)
            state.num_prompt_tokens = len(state.token_ids)

    @rule(handle=HANDLES)
    def finish(self, handle: int) -> None:
        state = self.states.pop(handle, None)
        if state is not None:
            self.penalties.release(state)

    @rule(handles=st.lists(HANDLES, unique=True))
    def history(self, handles: list[int]) -> None:
        states = [self.states[h] for h in handles if h in self.states]
        got = self.penalties.history(states)
        for i, state in enumerate(states):
            outputs = torch.tensor(state.token_ids[state.num_prompt_tokens :], dtype=torch.long)
            counts = torch.bincount(outputs, minlength=VOCAB).to(torch.int32)
            seen = torch.zeros(VOCAB, dtype=torch.bool)
            seen[torch.tensor(state.token_ids, dtype=torch.long)] = True
            assert torch.equal(got.output_counts[i], counts), f"handle {state.handle}: output counts"
            assert torch.equal(got.seen[i], seen), f"handle {state.handle}: seen mask"

    @invariant()
    def rows_belong_to_live_requests(self) -> None:
        tracked = self.penalties._tracks
        assert all(self.states.get(h) is track.owner for h, track in tracked.items())
        rows = [track.row for track in tracked.values()] + self.penalties._free
        assert sorted(rows) == list(range(self.penalties.seen.shape[0]))


TestPenaltyState = PenaltyMachine.TestCase


def test_out_of_vocabulary_tokens_are_refused_and_leave_the_history_whole() -> None:
    penalties = PenaltyState(VOCAB, torch.device("cpu"))
    good, bad = _state(0, [1, 2], 1), _state(1, [3], 1)
    penalties.history([good])
    good.token_ids.append(4)
    bad.token_ids.append(VOCAB)
    with pytest.raises(ValueError, match="token ids"):
        penalties.history([good, bad])
    history = penalties.history([good])
    assert history.output_counts[0].nonzero().flatten().tolist() == [2, 4]
    assert history.seen[0].nonzero().flatten().tolist() == [1, 2, 4]
