"""One persistent gRPC step stream per tensor-parallel rank, driven by an event loop on a thread of its own."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from pagerail.common import event_loops
from pagerail.common.tls import TlsConfig
from pagerail.proto import STEP_LINK_OPTIONS

logger = logging.getLogger(__name__)

STEP_STREAM = "/pagerail.worker.WorkerService/StepStream"
# How long closing waits for the loop to cancel the calls and stop; it only runs short callbacks.
_CLOSE_TIMEOUT_S = 5.0

ReplyCallback = Callable[[int, bytes, float], None]
EndCallback = Callable[[int, "grpc.aio.AioRpcError | None"], None]


class StepStreamError(RuntimeError):
    """A rank's step stream could not be opened."""


class StepStreams:
    """Writes the same bytes to every rank's stream and hands each rank's replies over as they arrive.

    The streams live on an asyncio loop in a thread of their own, so sending a step costs the caller one wake-up
    of that loop, whatever the number of ranks. `on_reply(rank, reply_bytes, arrival_perf_counter)` and
    `on_end(rank, error_or_None)` run on that thread: they must be short and must not block.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        metadata: Sequence[tuple[str, str]],
        tls: TlsConfig | None,
        on_reply: ReplyCallback,
        on_end: EndCallback,
        open_timeout_s: float = 30.0,
    ) -> None:
        self._on_reply = on_reply
        self._on_end = on_end
        self._loop = event_loops.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagerail-step-streams", daemon=True)
        self._thread.start()
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[grpc.aio.StreamStreamCall] = []
        self._queues: list[asyncio.Queue] = []
        self._tasks: list[asyncio.Task] = []
        opening = asyncio.run_coroutine_threadsafe(self._open(addresses, tuple(metadata), tls), self._loop)
        try:
            opening.result(timeout=open_timeout_s)
        except BaseException as error:
            opening.cancel()
            self.close()
            if isinstance(error, StepStreamError):
                raise
            raise StepStreamError(f"the step streams did not open within {open_timeout_s:g}s: {error!r}") from error

    def send(self, payload: bytes) -> None:
        """Queue `payload` on every rank's stream; returns at once. Payloads go out in the order they were sent."""
        self._loop.call_soon_threadsafe(self._enqueue, payload)

    def cancel(self) -> None:
        """End every stream (the ranks stop reading); returns at once. Later replies and ends are not reported."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._cancel_calls)

    def close(self) -> None:
        """Cancel the streams, close the channels and stop the loop's thread; safe to call more than once."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            closing = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
            try:
                closing.result(timeout=_CLOSE_TIMEOUT_S)
            except Exception as error:  # the channels are dropped with the loop all the same
                logger.warning("step streams did not close cleanly: %r", error)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    # -- on the loop's thread -------------------------------------------------------------------

    async def _open(self, addresses: Sequence[str], metadata: tuple, tls: TlsConfig | None) -> None:
        for address in addresses:
            if tls is None:
                channel = grpc.aio.insecure_channel(address, options=STEP_LINK_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=STEP_LINK_OPTIONS)
            self._channels.append(channel)
            # Raw bytes both ways: the head serializes a step once for every rank.
            method = channel.stream_stream(STEP_STREAM, request_serializer=None, response_deserializer=None)
            self._calls.append(method(metadata=metadata))
        # Each rank acknowledges its stream at once, so a refused token or an unreachable rank fails the start
        # of the group rather than its first step.
        await asyncio.gather(*(call.initial_metadata() for call in self._calls))
        for rank, call in enumerate(self._calls):
            if call.done():
                code, details = await call.code(), await call.details()
                raise StepStreamError(f"rank {rank} refused the step stream: {code.name}: {details}")
        for rank, call in enumerate(self._calls):
            queue: asyncio.Queue = asyncio.Queue()
            self._queues.append(queue)
            self._tasks.append(asyncio.create_task(self._write(call, queue), name=f"step-stream-write-{rank}"))
            self._tasks.append(asyncio.create_task(self._read(rank, call), name=f"step-stream-read-{rank}"))

    def _enqueue(self, payload: bytes) -> None:
        for queue in self._queues:
            queue.put_nowait(payload)

    @staticmethod
    async def _write(call: grpc.aio.StreamStreamCall, queue: asyncio.Queue) -> None:
        try:
            while True:
                await call.write(await queue.get())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream ended; its reader reports how

    async def _read(self, rank: int, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    break
                self._on_reply(rank, reply, time.perf_counter())
        except grpc.aio.AioRpcError as error:
            self._on_end(rank, error)
            return
        self._on_end(rank, None)

    def _cancel_calls(self) -> None:
        for task in self._tasks:
            task.cancel()
        for call in self._calls:
            call.cancel()

    async def _close(self) -> None:
        self._cancel_calls()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close(grace=None)
        # gRPC's own tasks (a call's status, for one) must end before the loop does, or asyncio warns on closing.
        leftovers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
