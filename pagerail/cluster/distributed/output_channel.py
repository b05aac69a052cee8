"""The head's end of one consumer's output channel: the engine loop's batches, forwarded as one message per step.

A consumer (a frontend process, an offline LLM) opens a channel, submits requests into it, and reads one long-lived
stream of OutputBatch messages (the engine's one per-step output type, keyed by request id): the deltas and failures
of every request of the channel that changed since the previous message. The head's event loop only resolves
admissions and forwards the batch.
"""

from __future__ import annotations

import asyncio

from pagerail.cluster.core.async_engine import AsyncEngine, LoopSink, OutputBatch
from pagerail.cluster.core.engine_request import EngineRequest


class OutputChannel:
    """Lives on the head actor's event loop; the engine loop hands it one batch per step through its sink."""

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self.sink = LoopSink(loop, self._receive)
        self._admissions: dict[str, asyncio.Future] = {}
        self._outgoing = OutputBatch()
        self._ready = asyncio.Event()
        self.closed = False

    async def submit(self, request: EngineRequest) -> None:
        """Return once the engine admitted the request; raise its ValueError/QueueFullError when it refused."""
        if self.closed:
            raise RuntimeError("this output channel is closed; open a new one")
        request_id = request.request_id
        if request_id in self._admissions:
            raise ValueError(f"request_id {request_id!r} is already in use")
        future = self._loop.create_future()
        self._admissions[request_id] = future
        try:
            self._engine.submit(request, self.sink, request_id)
            await future
        finally:
            del self._admissions[request_id]

    def abort(self, request_id: str, stopped: bool = False) -> None:
        """Abort one of this channel's requests (a request another channel holds under that id is left alone)."""
        self._engine.abort(request_id, self.sink, request_id, stopped)

    async def next_message(self) -> OutputBatch | None:
        """Everything that arrived since the previous message (waiting for something); None once closed."""
        while not (self._outgoing.deltas or self._outgoing.errors):
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        message, self._outgoing = self._outgoing, OutputBatch()
        return message

    def close(self) -> None:
        """The consumer left: abort what it still runs and end its stream."""
        if not self.closed:
            self.closed = True
            self._engine.drop_sink(self.sink)
            self._ready.set()

    def _receive(self, batch: OutputBatch) -> None:
        # On the head's event loop, once per engine step that touched this channel.
        for key in batch.admitted:
            future = self._admissions.get(key)
            if future is not None and not future.done():
                future.set_result(None)
        outgoing = self._outgoing
        for key, error in batch.errors:
            future = self._admissions.get(key)
            if future is not None and not future.done():
                future.set_exception(error)  # refused: the submit call raises it, no stream ever started
            else:
                outgoing.errors.append((key, error))
        if self.closed:
            self._outgoing = OutputBatch()  # nobody reads them any more
            return
        outgoing.deltas.extend(batch.deltas)
        if outgoing.deltas or outgoing.errors:
            self._ready.set()
