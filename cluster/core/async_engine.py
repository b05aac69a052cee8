"""Runs an EngineCore's loop in its own thread; asyncio callers hand requests in and receive token deltas."""

from __future__ import annotations

import asyncio
import logging
import queue
import statistics
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from cluster.core.engine import EngineCore
from cluster.core.engine_client import RequestDelta
from cluster.core.request import Request
from cluster.core.sampling_params import SamplingParams
from cluster.core.scheduler_output import PauseMode

logger = logging.getLogger(__name__)

# How long the loop sleeps when only paused requests or sessions waiting for input are open.
_IDLE_WAIT_S = 0.05


def delta_of(request: Request, start: int = 0) -> RequestDelta:
    """A request's output tokens from `start` on, and its state."""
    return RequestDelta(
        request_id=request.request_id,
        token_ids=list(request.output_token_ids[start:]),
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        finished=request.finished,
        finish_reason=request.status.value if request.finished else None,
        logprobs=list(request.logprobs[start:]),
        top_logprobs=list(request.top_logprobs[start:]),
        num_cached_tokens=request.num_cached_tokens,
        error=request.error,
        error_code=request.error_code,
    )


@dataclass
class _Subscriber:
    """Where one request's deltas go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue
    published_tokens: int = 0


class AsyncEngine:
    """The only thread that touches the engine is the loop thread; everything else sends it commands."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------------------------

    async def stream(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        final: bool = True,
        trace_context: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Yield new tokens as they come, the last delta with finished=True; ValueError/QueueFullError first."""
        subscriber = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(("add", request_id, list(token_ids), params, final, subscriber, trace_context))
        finished = False
        try:
            while True:
                delta = await subscriber.deltas.get()
                if isinstance(delta, BaseException):
                    raise delta
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                # The caller went away (disconnect, cancel): free the request's blocks. Only this caller's own
                # request: a refused duplicate id must not abort the request that holds it.
                self._submit(("abort", request_id, subscriber))

    async def generate(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, final: bool = True
    ) -> RequestDelta:
        """Run one request to completion; the result holds every output token."""
        result: RequestDelta | None = None
        async for delta in self.stream(request_id, token_ids, params, final):
            if result is None:
                result = delta
            else:
                result.token_ids.extend(delta.token_ids)
                result.logprobs.extend(delta.logprobs)
                result.top_logprobs.extend(delta.top_logprobs)
                result.num_output_tokens = delta.num_output_tokens
                result.num_cached_tokens = delta.num_cached_tokens
                result.finished, result.finish_reason, result.error = delta.finished, delta.finish_reason, delta.error
        return result

    def append_input(self, request_id: str, token_ids: Sequence[int], final: bool) -> None:
        self._submit(("append", request_id, list(token_ids), final))

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id, None))

    def pause(self, mode: str = "all") -> None:
        """Hold new requests ("new") or every request ("all") until resume()."""
        self._submit(("pause", PauseMode(mode)))

    def resume(self) -> None:
        self._submit(("pause", PauseMode.NONE))

    def stats(self) -> dict:
        engine, scheduler = self.engine, self.engine.scheduler
        return {
            "num_restarts": engine.num_restarts,
            "num_unfinished": scheduler.num_unfinished,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_blocks": engine.block_table.num_blocks,
            "num_free_blocks": engine.block_table.num_free_blocks,
            "num_preemptions": scheduler.stats.num_preemptions,
            "num_aborted": scheduler.stats.num_aborted,
            "num_computed_tokens": scheduler.stats.num_computed_tokens,
            "num_prefix_hit_tokens": scheduler.stats.num_prefix_hit_tokens,
            "schedule_p50_s": statistics.median(engine.schedule_seconds) if engine.schedule_seconds else 0.0,
        }

    def metrics_text(self) -> str:
        """The engine's Prometheus exposition."""
        return self.engine.metrics.render(self.engine).decode()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                changed = self.engine.step()
            except Exception as error:  # never let one bad step kill the loop silently
                logger.exception("engine step failed")
                self._fail_everything(error)
                continue
            for request in changed:
                self._publish(request)
            if self.engine.last_step_idle:
                self._wakeup.wait(_IDLE_WAIT_S)
                self._wakeup.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, request_id, token_ids, params, final, subscriber, trace_context = command
                if request_id in self._subscribers:
                    self._deliver(subscriber, ValueError(f"request_id {request_id!r} is already in use"))
                    continue
                try:
                    request = self.engine.add_request(
                        request_id, token_ids, params, final=final, trace_context=trace_context
                    )
                except (ValueError, RuntimeError) as error:  # bad input, or the waiting queue is full
                    self._deliver(subscriber, error)
                    continue
                self._subscribers[request.request_id] = subscriber
            elif kind == "append":
                _, request_id, token_ids, final = command
                try:
                    self.engine.append_input(request_id, token_ids, final)
                except ValueError as error:
                    subscriber = self._subscribers.pop(request_id, None)
                    if subscriber is not None:
                        self.engine.abort(request_id)
                        self._deliver(subscriber, error)
            elif kind == "pause":
                self.engine.pause(command[1])
            elif kind == "abort":
                _, request_id, owner = command
                if owner is not None and self._subscribers.get(request_id) is not owner:
                    continue  # that caller's request already ended, or was never admitted
                request = self.engine.abort(request_id)
                if request is not None:
                    self._publish(request)

    def _publish(self, request: Request) -> None:
        subscriber = self._subscribers.get(request.request_id)
        if subscriber is None:
            return
        self._deliver(subscriber, delta_of(request, subscriber.published_tokens))
        subscriber.published_tokens = request.num_output_tokens
        if request.finished:
            del self._subscribers[request.request_id]

    def _deliver(self, subscriber: _Subscriber, item: object) -> None:
        subscriber.loop.call_soon_threadsafe(subscriber.deltas.put_nowait, item)

    def _fail_everything(self, error: Exception) -> None:
        for request_id, subscriber in list(self._subscribers.items()):
            self.engine.abort(request_id)
            self._deliver(subscriber, RuntimeError(f"engine step failed: {error}"))
        self._subscribers.clear()
