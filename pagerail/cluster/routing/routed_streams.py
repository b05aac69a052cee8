"""The routed client's bookkeeping of one open request, and how it reads and closes a replica's stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagerail.cluster.core.engine_client import EngineClient, RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.routing.failover import ReplicaFailed, is_replica_failure
from pagerail.cluster.routing.session_log import SessionLog

logger = logging.getLogger(__name__)


class Aborted(Exception):
    """The caller aborted the request while it was between replicas."""


@dataclass
class OpenRequest:
    """A request this client has open, and the replica holding it now."""

    request_id: str
    replica: str | None = None
    client: EngineClient | None = None
    aborted: bool = False
    session: SessionLog | None = None
    pinned: bool = False  # counted among the open siblings of its pin
    # Moving with its KV (cluster/routing/kv_moves.py): whether it may, the phase of a disaggregated request
    # (prefill, decode), an abort the router asked for to move it, and the replica it moves to.
    movable: bool = False
    phase: str | None = None
    move_requested: bool = False
    move_to: str | None = None


def pin_key(request: EngineRequest) -> str | None:
    """Sibling choices of one prompt (its `n`) go to one replica, which computes their prompt once."""
    group = request.group
    return group.parent_id if group is not None and group.size > 1 and request.final else None


async def close_stream(stream: AsyncIterator[RequestDelta] | None) -> None:
    """Close a replica's stream (which aborts the request there if it is still open); a dead one may fail to."""
    close = getattr(stream, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:
        logger.debug("closing a replica stream failed", exc_info=True)


async def next_delta(stream: AsyncIterator[RequestDelta]) -> tuple[BaseException | None, RequestDelta | None]:
    """The stream's next delta, or the failure of its replica; any other error (bad input, a bug) is raised."""
    try:
        return None, await anext(stream)
    except StopAsyncIteration:
        return ReplicaFailed("the replica ended the stream before the request finished"), None
    except Exception as error:
        if is_replica_failure(error):
            return error, None
        raise


async def replay_into(
    entry: OpenRequest, replica: str, client: EngineClient, stream: AsyncIterator[RequestDelta]
) -> RequestDelta:
    """Open a session on `replica` after another refused it: the chunks sent there are lost, so replay them
    here, holding later chunks back until they are all sent; the stream's first delta."""
    session, first = entry.session, None
    try:
        async with session.lock:
            entry.replica, entry.client = replica, client
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # let the stream submit the request before its chunks
            await session.replay(client, entry.request_id)
        return await first
    except BaseException:
        if first is not None:
            first.cancel()
        raise
