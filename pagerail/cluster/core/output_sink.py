"""Where the engine loop hands its outputs: one batch per consumer per loop iteration, in one thread-safe call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from pagerail.cluster.core.engine_client import RequestDelta

logger = logging.getLogger(__name__)


@dataclass
class OutputBatch:
    """Everything one engine loop iteration produced for one consumer, each item tagged with the key the
    consumer gave when it submitted the request."""

    deltas: list[tuple[Hashable, RequestDelta]] = field(default_factory=list)
    # Requests the engine accepted (they will have deltas), and requests refused or failed: (key, exception).
    admitted: list[Hashable] = field(default_factory=list)
    errors: list[tuple[Hashable, BaseException]] = field(default_factory=list)


class OutputSink(Protocol):
    """A consumer of engine outputs. `deliver` runs on the engine loop thread and must only hand the batch over
    (one thread-safe call): splitting it per request is the consumer's work, on its own thread."""

    def deliver(self, batch: OutputBatch) -> None: ...


class LoopSink:
    """Hands each batch to an asyncio event loop, where `on_batch` runs: one call_soon_threadsafe per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_batch: Callable[[OutputBatch], None]) -> None:
        self.loop = loop
        self._on_batch = on_batch

    def deliver(self, batch: OutputBatch) -> None:
        try:
            self.loop.call_soon_threadsafe(self._on_batch, batch)
        except RuntimeError:
            # The loop is closed: whoever waited on these outputs is gone with it.
            logger.debug("dropped an output batch for a closed event loop")
