"""Puts a step's draft tokens in place on the rank: each request the head made room for gets up to that many
proposals appended to its tokens, so the step computes them as one chunk after its next token."""

from __future__ import annotations

from common.speculative_config import SpeculativeConfig
from worker.request_state import RequestState
from worker.spec_decode.ngram import propose_ngram


class NgramProposer:
    """Prompt-lookup drafts. Every tensor-parallel rank proposes from the same tokens and so the same drafts, with
    no message between them."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, scheduled: list[RequestState]) -> list[RequestState]:
        """Draft for every scheduled request with lookahead room; returns those that got drafts."""
        drafted = []
        for state in scheduled:
            room = state.num_lookahead
            if not room or state.num_scheduled_tokens != 1:
                continue
            drafts = propose_ngram(state.token_ids, self.min_n, self.max_n, room)
            if drafts:
                state.drafts = drafts
                state.token_ids.extend(drafts)
                state.num_scheduled_tokens = 1 + len(drafts)
                drafted.append(state)
        return drafted


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    """The proposer for `config`; None without speculation."""
    if config is None:
        return None
    if config.method != "ngram":
        raise ValueError(f"speculative_config.method={config.method!r} is not served by the ranks yet; use 'ngram'")
    return NgramProposer(config)
