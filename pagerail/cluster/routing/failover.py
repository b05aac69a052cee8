"""Failing over between replicas: the failure a replica reports, and the last delta of a request the router ends."""

from __future__ import annotations

import sys

from pagerail.cluster.core.engine_client import RequestDelta


class ReplicaFailed(RuntimeError):
    """A replica's stream broke after admission (its head ended the output stream, its workers gave up, ...)."""


def is_replica_failure(error: BaseException) -> bool:
    """True when `error` means the replica itself is gone or unreachable, so its request may move to another.

    That is Ray's error for a dead or unreachable actor (or Ray itself failing), a lost connection, and
    ReplicaFailed. Anything else, a bug in our own code first of all, is no reason to move a request: moving it
    would hide the bug and repeat it on every replica, so it must surface.
    """
    if isinstance(error, (ReplicaFailed, OSError)):  # OSError: ConnectionError and the other socket failures
        return True
    # Looked up, never imported: the core runs without Ray and gRPC, and without them no such error exists.
    ray_errors = sys.modules.get("ray.exceptions")
    if ray_errors is not None and isinstance(error, (ray_errors.RayActorError, ray_errors.RaySystemError)):
        return True  # RayActorError covers ActorDiedError and ActorUnavailableError
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(error, grpc.RpcError):
        code = getattr(error, "code", None)
        return callable(code) and code() == grpc.StatusCode.UNAVAILABLE
    return False


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
