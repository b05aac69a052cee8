"""The head actor: one model replica's scheduler, block table and engine loop, driving its workers over gRPC."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import statistics
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.executor import locate_model, worker_config
from cluster.model_info import read_model_info
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.scheduler import PauseMode
from cluster.worker_group import WorkerGroup
from worker.tls import TlsConfig

logger = logging.getLogger(__name__)

# How long the idle engine loop sleeps when only streaming sessions waiting for input are open.
_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class ClusterOptions:
    """How the replica's workers are placed and protected."""

    tensor_parallel_size: int = 1
    placement_strategy: str = "PACK"  # SPREAD / STRICT_SPREAD put ranks on different nodes
    use_gpu: bool = False
    cpus_per_worker: float = 1
    step_timeout_s: float = 300.0
    max_restarts: int = 3
    tls: TlsConfig | None = None


@dataclass
class _Subscriber:
    """Where a request's updates go: a future for its final output, or a queue of deltas."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future | None = None
    deltas: asyncio.Queue | None = None
    published_tokens: int = 0


def request_summary(request: Request, start: int = 0) -> dict:
    """A request's tokens from `start` on and its state, as plain data for any caller."""
    return {
        "request_id": request.request_id,
        "token_ids": list(request.output_token_ids[start:]),
        "logprobs": list(request.logprobs[start:]),
        "top_logprobs": list(request.top_logprobs[start:]),
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_output_tokens": request.num_output_tokens,
        "num_cached_tokens": request.num_cached_tokens,
        "finished": request.finished,
        "finish_reason": request.status.value if request.finished else None,
        "error": request.error,
    }


class HeadActor:
    """Runs the engine loop in a thread; async methods hand requests in and results out."""

    def __init__(self, config: EngineConfig, options: ClusterOptions, token: str) -> None:
        model_dir = locate_model(config)
        info = read_model_info(model_dir)
        self.group = WorkerGroup(
            worker_config(config, model_dir),
            options.tensor_parallel_size,
            token,
            use_gpu=options.use_gpu,
            cpus_per_worker=options.cpus_per_worker,
            placement_strategy=options.placement_strategy,
            tls=options.tls,
            step_timeout_s=options.step_timeout_s,
        )
        self.group.start()
        limit = config.scheduler.max_model_len or info.max_position_embeddings
        self.engine = EngineCore(
            config, self.group, min(limit, info.max_position_embeddings), info.vocab_size, info.eos_token_ids
        )
        self.engine.max_restarts = options.max_restarts
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- called by clients (asyncio thread) -----------------------------------------------------

    def ready(self) -> bool:
        return True

    async def generate(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, final: bool = True
    ) -> dict:
        """Run one request to completion and return its output."""
        loop = asyncio.get_running_loop()
        subscriber = _Subscriber(loop, future=loop.create_future())
        self._submit(("add", request_id, list(token_ids), params, final, subscriber))
        return await subscriber.future

    async def stream(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, final: bool = True
    ) -> AsyncIterator[dict]:
        """Yield each batch of new tokens as the engine produces them, the last one with finished=True."""
        loop = asyncio.get_running_loop()
        subscriber = _Subscriber(loop, deltas=asyncio.Queue())
        self._submit(("add", request_id, list(token_ids), params, final, subscriber))
        while True:
            delta = await subscriber.deltas.get()
            if isinstance(delta, BaseException):
                raise delta
            yield delta
            if delta["finished"]:
                return

    def append_input(self, request_id: str, token_ids: Sequence[int], final: bool) -> None:
        """Next chunk of an open streaming-input session."""
        self._submit(("append", request_id, list(token_ids), final))

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def pause(self, mode: str = "all") -> None:
        """Hold new requests ("new") or every request ("all") until resume()."""
        self._submit(("pause", PauseMode(mode)))

    def resume(self) -> None:
        self._submit(("pause", PauseMode.NONE))

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self) -> list[int]:
        return list(self.group.pids)

    def worker_nodes(self) -> list[str]:
        return list(self.group.node_ids)

    def stats(self) -> dict:
        scheduler = self.engine.scheduler
        dispatch = self.group.dispatch_stats
        return {
            "num_restarts": self.engine.num_restarts,
            "num_unfinished": scheduler.num_unfinished,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_blocks": self.engine.block_table.num_blocks,
            "num_free_blocks": self.engine.block_table.num_free_blocks,
            "num_preemptions": scheduler.stats.num_preemptions,
            "num_computed_tokens": scheduler.stats.num_computed_tokens,
            "num_prefix_hit_tokens": scheduler.stats.num_prefix_hit_tokens,
            "schedule_p50_s": statistics.median(self.engine.schedule_seconds) if self.engine.schedule_seconds else 0.0,
            "dispatch": dispatch.summary() if dispatch is not None else {},
        }

    def reset_dispatch_stats(self) -> None:
        if self.group.dispatch_stats is not None:
            self.group.dispatch_stats.reset()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.group.shutdown()

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the engine loop thread -----------------------------------------------------------------

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
                _, request_id, token_ids, params, final, subscriber = command
                try:
                    request = self.engine.add_request(request_id, token_ids, params, final=final)
                except ValueError as error:
                    self._deliver(subscriber, error)
                    continue
                self._subscribers[request.request_id] = subscriber
            elif kind == "append":
                _, request_id, token_ids, final = command
                try:
                    self.engine.add_request(request_id, token_ids, SamplingParams(), final=final)
                except ValueError as error:
                    subscriber = self._subscribers.get(request_id)
                    if subscriber is not None:
                        self._deliver(subscriber, error)
            elif kind == "pause":
                self.engine.pause(command[1])
            elif kind == "abort":
                request = self.engine.abort(command[1])
                if request is not None:
                    self._publish(request)

    def _publish(self, request: Request) -> None:
        subscriber = self._subscribers.get(request.request_id)
        if subscriber is None:
            return
        if subscriber.deltas is not None:
            delta = request_summary(request, subscriber.published_tokens)
            subscriber.published_tokens = request.num_output_tokens
            self._deliver(subscriber, delta)
        elif request.finished:
            self._deliver(subscriber, request_summary(request))
        if request.finished:
            del self._subscribers[request.request_id]

    def _deliver(self, subscriber: _Subscriber, item: object) -> None:
        if subscriber.deltas is not None:
            subscriber.loop.call_soon_threadsafe(subscriber.deltas.put_nowait, item)
        elif isinstance(item, BaseException):
            subscriber.loop.call_soon_threadsafe(_set_exception, subscriber.future, item)
        else:
            subscriber.loop.call_soon_threadsafe(_set_result, subscriber.future, item)

    def _fail_everything(self, error: Exception) -> None:
        for request_id, subscriber in list(self._subscribers.items()):
            self.engine.abort(request_id)
            self._deliver(subscriber, RuntimeError(f"engine step failed: {error}"))
        self._subscribers.clear()


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
