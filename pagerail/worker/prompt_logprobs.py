"""Logprobs of prompt tokens, for the requests that ask for them (prompt_logprobs, and echo with logprobs).

The hidden state at position p predicts the token at p + 1, so a prefill chunk over positions [c, c + n) scores
the prompt tokens at c + 1 .. c + n, all but the one after the prompt's end (that is the first sampled token,
whose logprob the sampler gives). Every rank finds the same rows (the request states are the same on every
rank) and takes part in the logits' gather; rank 0 scores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagerail.proto import step_pb2
from pagerail.worker.host_readback import HostReadback, to_host
from pagerail.worker.request_state import RequestState


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Rows `row`, `row + 1`, ... of a step score the prompt tokens at positions `start`, `start + 1`, ..."""

    state: RequestState
    row: int
    start: int
    count: int


def prompt_spans(ordered: list[RequestState]) -> list[PromptSpan]:
    """The spans of this step's rows that score prompt tokens, in row order (rows follow `ordered`, each request
    owning num_scheduled_tokens consecutive rows). Call before the step advances the states."""
    spans: list[PromptSpan] = []
    row = 0
    for state in ordered:
        count = state.num_scheduled_tokens
        if state.sampling.prompt_logprobs is not None:
            first = state.num_computed_tokens
            scored = min(first + count, state.num_prompt_tokens - 1) - first
            if scored > 0:
                spans.append(PromptSpan(state, row, first + 1, scored))
        row += count
    return spans


def span_rows(spans: list[PromptSpan], device: torch.device) -> torch.Tensor:
    """The row index of every scored position, in span order."""
    rows = [row for span in spans for row in range(span.row, span.row + span.count)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def write_prompt_logprobs(
    result: step_pb2.StepResult, spans: list[PromptSpan], logits: torch.Tensor, readback: HostReadback | None
) -> None:
    """Score each span's prompt tokens from `logits` (one row per scored position, in span order) into `result`."""
    targets = [token for span in spans for token in span.state.token_ids[span.start : span.start + span.count]]
    logprobs = logits.float().log_softmax(dim=-1)
    target_index = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, target_index)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    max_top = max(span.state.sampling.prompt_logprobs for span in spans)
    if max_top:
        top = logprobs.topk(max_top, dim=-1)
        chosen_l, ranks_l, top_values, top_ids = to_host(readback, chosen.squeeze(1), ranks, top.values, top.indices)
    else:
        chosen_l, ranks_l = to_host(readback, chosen.squeeze(1), ranks)
    at = 0
    for span in spans:
        end = at + span.count
        entry = result.prompt_logprobs.add(handle=span.state.handle, start=span.start)
        entry.logprobs.extend(chosen_l[at:end])
        entry.ranks.extend(ranks_l[at:end])
        k = span.state.sampling.prompt_logprobs
        if k:
            for ids, values in zip(top_ids[at:end], top_values[at:end], strict=True):
                entry.top_logprobs.add(token_ids=ids[:k], logprobs=values[:k])
        at = end
