"""The engine client of a model replica's head actor on Ray: one output channel per head, fanned out here."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

from pagerail.cluster.core.engine_client import RequestDelta, next_delta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.routing.failover import ReplicaFailed

logger = logging.getLogger(__name__)


class _OutputReader:
    """This process's end of one output channel: a single long-lived Ray stream from the head, one message per
    engine step, split here into the per-request queues of the open streams."""

    def __init__(self, head) -> None:
        self.channel_id = uuid.uuid4().hex
        self.loop = asyncio.get_running_loop()
        self.failure: BaseException | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._task = self.loop.create_task(self._read(head))

    @property
    def usable(self) -> bool:
        return self.failure is None and not self.loop.is_closed() and self.loop is asyncio.get_running_loop()

    def open(self, request_id: str) -> asyncio.Queue:
        if self.failure is not None:
            raise self.failure
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        deltas = self._streams[request_id] = asyncio.Queue()
        return deltas

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _read(self, head) -> None:
        try:
            streams = self._streams
            async for ref in head.outputs.remote(self.channel_id):
                batch = await ref  # an OutputBatch keyed by request id: one per engine step
                for request_id, delta in batch.deltas:
                    deltas = streams.get(request_id)
                    if deltas is not None:  # else its caller already left (and aborted it)
                        deltas.put_nowait(delta)
                for request_id, error in batch.errors:  # after the tokens that came before the failure
                    deltas = streams.get(request_id)
                    if deltas is not None:
                        deltas.put_nowait(error)
            raise ReplicaFailed("the head actor closed its output stream")
        except Exception as error:  # a dead or restarting head: every open stream fails with Ray's own error
            self.failure = error
            for deltas in self._streams.values():
                deltas.put_nowait(error)
            self._streams.clear()


class HeadEngineClient:
    """A model replica's head actor on Ray. Requests are submitted with one actor call each; their deltas arrive
    together, one message per engine step, on one stream per head."""

    def __init__(self, head, model_name: str, model_info: dict) -> None:
        """`model_info`: the head's model_info() (max_model_len, vocab_size, eos_token_ids)."""
        self._head = head
        self.model_name = model_name
        self.max_model_len = model_info["max_model_len"]
        self.vocab_size = model_info["vocab_size"]
        self.eos_token_ids = frozenset(model_info["eos_token_ids"])
        self._reader: _OutputReader | None = None
        # Requests whose submit call has not returned yet: a session's next chunk waits for its admission. The
        # head runs its actor calls as coroutines, so a chunk sent at once could reach its engine before the
        # request it belongs to, find no such session, and be lost (the session then times out idle).
        self._admitting: dict[str, asyncio.Event] = {}
        # Submissions of this event-loop turn, sent together by one submit_many call at its end: one actor call
        # (and one head coroutine) per batch of requests instead of one per request.
        self._unsent: list[tuple[str, EngineRequest, asyncio.Future]] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        reader = self._current_reader()
        # Open before submitting: the first delta may arrive before the submit call returns.
        request_id = request.request_id
        deltas = reader.open(request_id)
        finished = refused = False
        admitted = self._admitting[request_id] = asyncio.Event()
        try:
            try:
                await self._submit(reader.channel_id, request)
            except (ValueError, QueueFullError):
                refused = True  # the head's own exception: bad input, or a full queue
                raise
            finally:
                admitted.set()
                if self._admitting.get(request_id) is admitted:
                    del self._admitting[request_id]
            while not finished:
                item = await next_delta(deltas)
                finished = item.finished
                yield item
        finally:
            reader.close(request_id)
            if not finished and not refused and reader.failure is None:
                # The client went away: the head must free the request's blocks.
                self._head.abort.remote(request_id, reader.channel_id)

    def _submit(self, channel_id: str, request: EngineRequest) -> asyncio.Future:
        """Resolves once the head admitted the request; raises the exception the head refused it with."""
        loop = asyncio.get_running_loop()
        if not self._unsent:
            loop.call_soon(self._send_unsent)
        admitted = loop.create_future()
        self._unsent.append((channel_id, request, admitted))
        return admitted

    def _send_unsent(self) -> None:
        # A caller that left before its turn ended (cancelled) is not sent at all: nothing to abort later.
        batch = [entry for entry in self._unsent if not entry[2].done()]
        self._unsent = []
        if batch:
            asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[tuple[str, EngineRequest, asyncio.Future]]) -> None:
        try:
            results = await self._head.submit_many.remote([(channel_id, request) for channel_id, request, _ in batch])
        except Exception as error:  # the head is gone or restarting: every caller gets Ray's own error
            results = [error] * len(batch)
        for (_, _, admitted), result in zip(batch, results, strict=True):
            if admitted.done():
                continue
            if result is None:
                admitted.set_result(None)
            else:
                admitted.set_exception(result)

    def _current_reader(self) -> _OutputReader:
        """The output channel of this event loop; a new one after the head died or restarted."""
        reader = self._reader
        if reader is None or not reader.usable:
            if reader is not None:
                # Its loop is gone, or its stream broke while the head may live on: end it there too, which
                # aborts what it still holds (a no-op at a restarted head, which never knew it).
                self._head.close_channel.remote(reader.channel_id)
            reader = self._reader = _OutputReader(self._head)
        return reader

    async def aclose(self) -> None:
        """End this client's output channel (open streams fail)."""
        if self._reader is not None and self._reader.failure is None:
            await self._head.close_channel.remote(self._reader.channel_id)
        self._reader = None

    async def append_input(self, request_id: str, token_ids: list[int], final: bool) -> None:
        admitting = self._admitting.get(request_id)
        if admitting is not None:
            await admitting.wait()
        await self._head.append_input.remote(request_id, token_ids, final)

    async def abort(self, request_id: str, stopped: bool = False) -> None:
        if self._reader is not None:  # only a request of this client
            await self._head.abort.remote(request_id, self._reader.channel_id, stopped)

    async def is_ready(self) -> bool:
        try:
            return await self._head.ready.remote()
        except Exception:  # a restarting or dead head is simply not ready
            return False

    async def pause(self, mode: str) -> None:
        await self._head.pause.remote(mode)

    async def resume(self) -> None:
        await self._head.resume.remote()

    async def stats(self) -> dict:
        return await self._head.stats.remote()

    async def kv_events(self, epoch: int | None, seq: int) -> dict:
        return await self._head.kv_events.remote(epoch, seq)

    async def export_kv(self, token_ids: list[int]):
        return await self._head.export_kv.remote(token_ids)

    async def import_kv(self, handoff) -> int:
        return await self._head.import_kv.remote(handoff)

    async def kv_call(self, method: str, *args):
        """One step of a KV move over the ranks' own channel (the head's kv_* methods; cluster/routing/kv_moves.py)."""
        return await getattr(self._head, method).remote(*args)

    async def metrics(self) -> str:
        return await self._head.metrics.remote()
