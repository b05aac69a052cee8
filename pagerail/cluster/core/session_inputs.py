"""Streaming-input sessions in the scheduler: a session's next chunk, its wait out of the batch, its idle timeout."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagerail.cluster.core.admission import check_fits
from pagerail.cluster.core.request import Request, RequestStatus

if TYPE_CHECKING:  # the scheduler imports this module
    from pagerail.cluster.core.scheduler import Scheduler


def append_input(scheduler: Scheduler, request_id: str, token_ids: list[int], final: bool) -> Request:
    """Next chunk of a streaming-input session. A chunk that would not fit is refused, the session unchanged."""
    request = scheduler.requests.get(request_id)
    if request is None or not request.input_open:
        raise ValueError(f"request_id {request_id!r} is not an open streaming-input session")
    num_tokens = request.num_tokens + len(token_ids)
    check_fits(request, num_tokens, scheduler.max_model_len, scheduler.config, scheduler.block_table)
    request.append_input(token_ids)
    request.input_open = not final
    if not request.awaiting_input:
        return request  # still running or waiting: the new tokens are picked up by the next steps
    if not token_ids and not final:
        request.idle_since = scheduler.clock()  # an empty chunk only shows the client is still there
        return request
    del scheduler.idle_sessions[request_id]
    request.idle_since = None
    if not token_ids and request.num_computed_tokens == request.num_tokens:
        # The input ended after its last chunk was computed, but positions computed while input was open
        # kept no logits: recompute the last one to sample the first output token.
        request.num_computed_tokens -= 1
        request.needs_resync = True
    request.status = RequestStatus.WAITING
    scheduler.waiting.append(request)
    return request


def park_until_input(scheduler: Scheduler, request: Request) -> None:
    """A running session computed all the input it has: it waits, out of the batch, for its next chunk."""
    scheduler.running.remove(request)
    request.status = RequestStatus.AWAITING_INPUT
    request.idle_since = scheduler.clock()
    scheduler.idle_sessions[request.request_id] = request


def expire_idle(scheduler: Scheduler) -> list[Request]:
    """Close sessions that waited longer than session_idle_timeout_s for their next chunk."""
    timeout = scheduler.config.session_idle_timeout_s
    now = scheduler.clock()
    expired = [r for r in scheduler.idle_sessions.values() if now - r.idle_since > timeout]
    for request in expired:
        request.error = f"the session received no input for {timeout:g} s (session_idle_timeout) and was closed"
        request.error_code = "session_idle_timeout"
        scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
    return expired
