"""Failing over between replicas: the failure a replica reports, and the last delta of a request the router ends."""

from __future__ import annotations

from cluster.core.engine_client import RequestDelta


class ReplicaFailed(RuntimeError):
    """A replica's stream broke after admission (Ray's ActorDiedError, a worker group that gave up, ...)."""


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
