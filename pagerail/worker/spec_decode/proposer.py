"""Puts a step's draft tokens in place on the rank: each request the head made room for gets up to that many
proposals appended to its tokens, so the step computes them as one chunk after its next token."""

from __future__ import annotations

from pagerail.common.speculative_config import SpeculativeConfig
from pagerail.worker.request_state import RequestState
from pagerail.worker.spec_decode.ngram import propose_ngram


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

    def bytes_per_block(self) -> int:
        return 0

    def allocate(self, num_blocks: int) -> None:
        """Nothing to allocate: lookups read the request's own tokens."""

    def observe(self, ordered: list[RequestState], hidden) -> None:
        """Nothing read from the target's forward."""

    def advanced(self) -> None:
        """Nothing kept from the step."""

    def kept(self, state: RequestState) -> None:
        """Nothing to update after verification."""

    def forget(self, state: RequestState) -> None:
        """Nothing is kept per request."""


def make_proposer(config: SpeculativeConfig | None, **draft_args):
    """The proposer for `config` (None without speculation); `draft_args` build a draft model's
    (DraftModelProposer's arguments after the config)."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft_model":
        from pagerail.worker.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, **draft_args)
    from pagerail.worker.spec_decode.eagle import EagleProposer

    return EagleProposer(config, **draft_args)
