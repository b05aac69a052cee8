"""Token history of the requests that use penalties, kept on the sampling device and updated with each new token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagerail.worker.request_state import RequestState
from pagerail.worker.sampler import TokenHistory


@dataclass
class _Track:
    """One request's row of the tables, and how much of its token list the row has counted."""

    row: int
    owner: RequestState  # a reused handle is a different request: it starts from an empty row
    num_prompt_tokens: int  # the prompt/output split the counts were made with
    num_tokens: int  # leading tokens of owner.token_ids already counted


class PenaltyState:
    """Rows of two [rows, vocab] tables for the requests that use penalties (rank 0 only, which samples):

    - output_counts: how often each token occurs among the request's outputs (presence, frequency);
    - seen: whether each token occurs in its prompt or outputs (repetition).

    A row is synced with its request's tokens when the request samples: the tokens appended since (sampled
    ones, input chunks) are scattered into the row, all rows of the step in one batched write. Only a
    prompt that grows (a streaming-input chunk turns earlier outputs into prompt) recounts a row from scratch.
    Requests without penalties get no row.
    """

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts = torch.zeros(initial_rows, vocab_size, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(initial_rows, vocab_size, dtype=torch.bool, device=self.device)
        self._free = list(range(initial_rows - 1, -1, -1))
        self._tracks: dict[int, _Track] = {}

    def release(self, state: RequestState) -> None:
        """Forget a dropped request; its row is cleared when it is handed out again."""
        track = self._tracks.get(state.handle)
        if track is not None and track.owner is state:
            del self._tracks[state.handle]
            self._free.append(track.row)

    def history(self, states: list[RequestState], seen: bool = True, output_counts: bool = True) -> TokenHistory:
        """The up-to-date history of `states`, one row each in order, for the sampler; the parts not asked for
        (no row has that kind of penalty) are None, which spares copying them."""
        rows: list[int] = []
        cleared: list[int] = []  # rows recounted from scratch: the prompt grew
        synced: list[tuple[_Track, int, int]] = []  # (track, num_prompt_tokens, num_tokens) once scattered
        # Token scatters: (row, token id, 1 when the token is an output else 0).
        new_rows: list[int] = []
        new_tokens: list[int] = []
        is_output: list[int] = []
        for state in states:
            track = self._track(state)
            tokens, start = state.token_ids, track.num_tokens
            if track.num_prompt_tokens != state.num_prompt_tokens or len(tokens) < start:
                cleared.append(track.row)
                start = 0
            fresh = tokens[start:]
            if fresh:
                if min(fresh) < 0 or max(fresh) >= self.vocab_size:
                    # Raised before any track moves on, so every history stays whole.
                    raise ValueError(f"token ids must lie in [0, {self.vocab_size}) for penalties")
                # Tokens before num_prompt_tokens are prompt: seen, but not counted as outputs.
                num_prompt = min(max(state.num_prompt_tokens - start, 0), len(fresh))
                new_rows.extend([track.row] * len(fresh))
                new_tokens.extend(fresh)
                is_output.extend([0] * num_prompt + [1] * (len(fresh) - num_prompt))
            synced.append((track, state.num_prompt_tokens, len(tokens)))
            rows.append(track.row)
        if cleared:
            index = torch.tensor(cleared, dtype=torch.long, device=self.device)
            self.output_counts.index_fill_(0, index, 0)
            self.seen.index_fill_(0, index, False)
        if new_tokens:
            scatter = torch.tensor([new_rows, new_tokens, is_output], dtype=torch.long).to(self.device)
            self.seen.index_put_((scatter[0], scatter[1]), torch.ones((), dtype=torch.bool, device=self.device))
            counts = scatter[2].to(torch.int32)
            self.output_counts.index_put_((scatter[0], scatter[1]), counts, accumulate=True)
        for track, num_prompt_tokens, num_tokens in synced:
            track.num_prompt_tokens, track.num_tokens = num_prompt_tokens, num_tokens
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        return TokenHistory(
            self.output_counts.index_select(0, index) if output_counts else None,
            self.seen.index_select(0, index) if seen else None,
        )

    def _track(self, state: RequestState) -> _Track:
        """The state's track; a request new to this table gets a row, cleared of whatever it held before."""
        track = self._tracks.get(state.handle)
        if track is not None and track.owner is state:
            return track
        if track is not None:
            self._free.append(track.row)  # the handle was reused without the old request being released
        if not self._free:
            self._grow()
        track = _Track(self._free.pop(), state, state.num_prompt_tokens, 0)
        self.output_counts[track.row].zero_()
        self.seen[track.row].zero_()
        self._tracks[state.handle] = track
        return track

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        rows = max(1, 2 * old)
        counts = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=self.device)
        seen = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], seen[:old] = self.output_counts, self.seen
        self.output_counts, self.seen = counts, seen
        self._free = list(range(rows - 1, old - 1, -1)) + self._free
