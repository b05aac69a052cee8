"""How a request resumes on another replica: the rest of its parameters, and deltas that continue the first run."""

from __future__ import annotations

from dataclasses import replace

from cluster.core.engine_client import RequestDelta
from cluster.core.sampling_params import SamplingParams


class ReplicaFailed(RuntimeError):
    """A replica's stream broke after admission (Ray's ActorDiedError, a worker group that gave up, ...)."""


def remaining_params(params: SamplingParams, num_streamed: int) -> SamplingParams | None:
    """The sampling parameters of the rest of a request once `num_streamed` of its tokens were streamed; None when
    none is left to generate."""
    if not num_streamed:
        return params
    max_tokens = None if params.max_tokens is None else params.max_tokens - num_streamed
    if max_tokens is not None and max_tokens < 1:
        return None
    return replace(params, max_tokens=max_tokens, min_tokens=max(0, params.min_tokens - num_streamed))


def continued(delta: RequestDelta, request_id: str, num_prompt: int, num_streamed: int, cached: int) -> RequestDelta:
    """A delta of the resumed run (whose prompt holds the `num_streamed` tokens streamed before) as the caller's
    one request sees it: its own prompt length, the output count going on, the cache hit of its first run."""
    return replace(
        delta,
        request_id=request_id,
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_streamed + delta.num_output_tokens,
        num_cached_tokens=cached,
    )


def ended(
    request_id: str, num_prompt: int, num_outputs: int, cached: int, reason: str, error: str | None = None
) -> RequestDelta:
    """The last delta of a request the router ends itself; with `error`, a retriable failure, as an engine whose
    workers gave up reports it."""
    return RequestDelta(
        request_id,
        [],
        num_prompt,
        num_outputs,
        finished=True,
        finish_reason=reason,
        num_cached_tokens=cached,
        error=error,
        error_code="worker_failure" if error else None,
    )
