"""Results handed back to Python API callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence (one of `n`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # Per generated token: {token id: logprob} with the sampled token first, then the top ones.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # Set when the engine gave up on the request (retriable), with finish_reason "abort".
    error: str | None = None


@dataclass
class RequestOutput:
    """Everything produced for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # With prompt_logprobs: per prompt token, None (the first) or {its id: logprob, then the most likely ones}.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
