"""The input chunks of a streaming-input session kept by the router until a replica surely holds the session."""

from __future__ import annotations

import asyncio
import logging

from pagerail.cluster.core.engine_client import EngineClient

logger = logging.getLogger(__name__)


class SessionLog:
    """A session's chunks, kept until its first delta shows a replica admitted it: when a replica refuses the
    session (its queue is full), the chunks already sent there are lost, and are replayed to the next one.

    `lock` orders the chunks: appends and a replay never interleave. Past `max_tokens` logged tokens the log stops
    (the engine fails so long a session anyway) and the session can no longer move.
    """

    def __init__(self, max_tokens: int) -> None:
        self.lock = asyncio.Lock()
        self.max_tokens = max_tokens
        self.chunks: list[tuple[list[int], bool]] = []
        self.num_tokens = 0
        self.confirmed = False  # a replica holds the session: nothing to replay any more
        self.replayable = True

    def record(self, token_ids: list[int], final: bool) -> None:
        """Keep a chunk about to be sent (call under `lock`)."""
        if self.confirmed or not self.replayable:
            return
        self.chunks.append((list(token_ids), final))
        self.num_tokens += len(token_ids)
        if self.num_tokens > self.max_tokens:
            self.replayable, self.chunks = False, []

    def confirm(self) -> None:
        self.confirmed, self.chunks = True, []

    async def replay(self, client: EngineClient, request_id: str) -> None:
        """Send every kept chunk to `client`, which has just been sent the session (call under `lock`); a failure is
        left to the session's stream to report."""
        try:
            for token_ids, final in self.chunks:
                await client.append_input(request_id, token_ids, final)
        except Exception:
            logger.warning("replaying the chunks of session %s failed", request_id, exc_info=True)
