"""When a request stops: a sampled token that ends it, and a token in flight that will be its last by length."""

from __future__ import annotations

from pagerail.cluster.core.request import Request, RequestStatus


def stop_status(
    request: Request, token_id: int, max_model_len: int, constraint_done: bool = False
) -> RequestStatus | None:
    """The reason a request finishes on this sampled token, or None when it goes on.

    `constraint_done`: the request's output constraint accepts nothing after this token (a closed JSON value).
    """
    if constraint_done or (
        token_id in request.stop_token_ids and request.num_output_tokens >= request.sampling_params.min_tokens
    ):
        return RequestStatus.FINISHED_STOPPED
    max_tokens = request.max_tokens
    if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (request.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None


def ends_in_flight(request: Request, max_model_len: int) -> bool:
    """True when a token still being sampled is the request's last by length: nothing more to schedule."""
    if not request.num_pending_samples:
        return False
    max_tokens = request.max_tokens
    num_outputs = request.num_output_tokens + request.num_pending_samples
    return (max_tokens is not None and num_outputs >= max_tokens) or (request.num_tokens_expected >= max_model_len)
