"""Runs an EngineCore's loop in its own thread; callers hand requests in and receive one batch of deltas per step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import statistics
import threading
import weakref
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import dataclass

from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_client import RequestDelta, merge_deltas, next_delta
from pagerail.cluster.core.engine_commands import Abort, Add, Append, Call, Command, DropSink, Pause
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.kv_handoff import KvHandoff, export_prefix, import_handoff
from pagerail.cluster.core.output_sink import LoopSink, OutputBatch, OutputSink
from pagerail.cluster.core.request import Request
from pagerail.cluster.core.scheduler_output import PauseMode

__all__ = ["AsyncEngine", "LoopSink", "OutputBatch", "OutputSink", "delta_of"]

logger = logging.getLogger(__name__)

# How long the loop sleeps when only paused requests or sessions waiting for input are open.
_IDLE_WAIT_S = 0.05


def delta_of(request: Request, start: int = 0) -> RequestDelta:
    """A request's output tokens from `start` on, and its state."""
    return RequestDelta(
        request_id=request.request_id,
        token_ids=request.output_token_ids[start:],
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        finished=request.finished,
        finish_reason=request.status.value if request.finished else None,
        logprobs=request.logprobs[start:],
        top_logprobs=request.top_logprobs[start:],
        num_cached_tokens=request.num_cached_tokens,
        error=request.error,
        error_code=request.error_code,
        prompt_logprobs=request.prompt_logprobs if start == 0 else None,
        pooled=request.pooled if request.finished else None,
    )


@dataclass(slots=True)
class _Owner:
    """Who receives one request's deltas: a sink, and the key its items carry there."""

    sink: OutputSink
    key: Hashable
    published_tokens: int = 0
    stream: bool = True  # False: one delta, when the request ends


class AsyncEngine:
    """The only thread that touches the engine is the loop thread; everything else sends it commands.

    Each loop iteration (commands, then one engine step) ends with at most one hand-off per sink, carrying
    every delta, admission and error that sink's requests produced: per-request work stays on the sink's side.
    """

    def __init__(self, engine: EngineCore, *, start: bool = True) -> None:
        """`start=False`: no loop thread until `start()`; meanwhile the owner drives the loop with `run_once()`."""
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._owners: dict[str, _Owner] = {}
        self._outbox: dict[OutputSink, OutputBatch] = {}
        # One sink per event loop that called stream(): its requests share the loop's per-step hand-off.
        self._loop_sinks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSink] = weakref.WeakKeyDictionary()
        self._loop_sinks_lock = threading.Lock()
        # Counted on the loop thread: iterations that delivered something, hand-offs, deltas handed off.
        self.num_deliveries = 0
        self.num_handoffs = 0
        self.num_deltas = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Run the loop in its own thread from now on (once started, the only thread that drives the engine)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def run_once(self) -> None:
        """One iteration of the loop (commands, one engine step, the hand-offs) in the caller's thread, for an owner
        that waits on the outputs anyway: no second thread then competes for the interpreter, and the forward runs
        in the caller's thread, where the CPU kernels run measurably faster than in a thread started later."""
        if self._thread is not None:
            raise RuntimeError("the engine loop runs in its own thread; run_once() would drive it from a second one")
        self._iterate()

    # -- any thread -----------------------------------------------------------------------------

    def submit(self, request: EngineRequest, sink: OutputSink, key: Hashable) -> None:
        """Queue a request whose admission (or ValueError/QueueFullError), deltas and errors go to `sink`,
        tagged with `key`."""
        self._submit(Add(request, sink, key))

    def append_input(self, request_id: str, token_ids: Sequence[int], final: bool) -> None:
        self._submit(Append(request_id, list(token_ids), final))

    def abort(
        self, request_id: str, sink: OutputSink | None = None, key: Hashable = None, stopped: bool = False
    ) -> None:
        """Abort a request; with `sink`, only when that sink still owns it under `key` (a refused duplicate id
        must not abort the request holding it). `stopped`: the caller found a stop string (reason "stop")."""
        self._submit(Abort(request_id, sink, key, stopped))

    def drop_sink(self, sink: OutputSink) -> None:
        """The consumer behind `sink` is gone: abort every request it owns."""
        self._submit(DropSink(sink))

    def pause(self, mode: str = "all") -> None:
        """Hold new requests ("new") or every request ("all") until resume()."""
        self._submit(Pause(PauseMode(mode)))

    def resume(self) -> None:
        self._submit(Pause(PauseMode.NONE))

    async def export_kv(self, token_ids: list[int]) -> KvHandoff | None:
        """The cached KV blocks of `token_ids`, to continue their request on another replica (kv_handoff.py)."""
        return await self.run_on_loop(lambda engine: export_prefix(engine, token_ids))

    async def import_kv(self, handoff: KvHandoff) -> int:
        """Take another replica's blocks into this one's host tier; how many it took."""
        return await self.run_on_loop(lambda engine: import_handoff(engine, handoff), drain=True)

    async def run_on_loop(self, fn, drain: bool = False):
        """`fn(engine)` on the loop thread, between steps (with `drain`, once none is in flight); its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(Call(fn, future, drain))
        return await asyncio.wrap_future(future)

    def kv_events(self, epoch: int | None, seq: int) -> dict:
        """This replica's block events after (epoch, seq), or a snapshot of its caches (cluster/core/kv_events.py)."""
        return self.engine.kv_events.since(epoch, seq)

    def stats(self) -> dict:
        engine, scheduler = self.engine, self.engine.scheduler
        return {
            "num_restarts": engine.num_restarts,
            "num_unfinished": scheduler.num_unfinished,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_open_sessions": scheduler.num_open_sessions,
            "num_blocks": engine.block_table.num_blocks,
            "num_free_blocks": engine.block_table.num_free_blocks,
            "num_preemptions": scheduler.stats.num_preemptions,
            "num_aborted": scheduler.stats.num_aborted,
            "num_stopped_by_caller": scheduler.stats.num_stopped_by_caller,
            "num_computed_tokens": scheduler.stats.num_computed_tokens,
            "num_prefix_hit_tokens": scheduler.stats.num_prefix_hit_tokens,
            "num_host_hit_tokens": scheduler.stats.num_host_hit_tokens,
            "schedule_p50_s": statistics.median(engine.schedule_seconds) if engine.schedule_seconds else 0.0,
            "num_steps": scheduler.stats.num_steps,
            "num_output_deliveries": self.num_deliveries,
            "num_output_handoffs": self.num_handoffs,
            "num_output_deltas": self.num_deltas,
            "num_lora_loads": engine.metrics.num_lora_loads,
        }

    def metrics_text(self) -> str:
        """The engine's Prometheus exposition."""
        return self.engine.metrics_text().decode()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _submit(self, command: Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- asyncio callers in this process ----------------------------------------------------------

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Yield new tokens as they come, the last delta with finished=True; ValueError/QueueFullError first."""
        sink = self._sink_of(asyncio.get_running_loop())
        deltas: asyncio.Queue = asyncio.Queue()  # this call's own key: nothing else can reach it
        self.submit(request, sink, deltas)
        finished = False
        try:
            while not finished:
                delta = await next_delta(deltas)
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                # The caller went away (disconnect, cancel): free the request's blocks, if it is still its own.
                self.abort(request.request_id, sink, deltas)

    async def generate(self, request: EngineRequest) -> RequestDelta:
        """Run one request to completion; the result holds every output token."""
        deltas = [delta async for delta in self.stream(request)]
        return merge_deltas(deltas)

    def _sink_of(self, loop: asyncio.AbstractEventLoop) -> LoopSink:
        with self._loop_sinks_lock:
            sink = self._loop_sinks.get(loop)
            if sink is None:
                sink = self._loop_sinks[loop] = LoopSink(loop, _fan_out_to_queues)
            return sink

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            busy = self._iterate()
            if not busy:
                self._wakeup.wait()
                self._wakeup.clear()
            elif self.engine.last_step_idle:
                self._wakeup.wait(_IDLE_WAIT_S)
                self._wakeup.clear()

    def _iterate(self) -> bool:
        """Commands, one step if any request is open, then the hand-offs; whether a request was open."""
        self._drain_commands()
        busy = self.engine.has_unfinished()
        if busy:
            self._step()
        self._deliver_outbox()
        return busy

    def _step(self) -> None:
        try:
            changed = self.engine.step()
        except Exception as error:  # never let one bad step kill the loop silently
            logger.exception("engine step failed")
            self._fail_everything(error)
            return
        for request in changed:
            self._publish(request)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case Add():
                    self._add(command)
                case Append():
                    self._append(command)
                case Pause():
                    self.engine.pause(command.mode)
                case Abort():
                    owner = self._owners.get(command.request_id)
                    sink = command.sink
                    if sink is not None and (owner is None or owner.sink is not sink or owner.key != command.key):
                        continue  # that caller's request already ended, or was never admitted
                    self._abort(command.request_id, command.stopped)
                case DropSink():
                    for request_id in [rid for rid, owner in self._owners.items() if owner.sink is command.sink]:
                        self._abort(request_id)
                        self._owners.pop(request_id, None)
                case Call():
                    self._call(command)

    def _call(self, command: Call) -> None:
        try:
            if command.drain:
                for request in self.engine.drain():
                    self._publish(request)
            command.future.set_result(command.fn(self.engine))
        except Exception as error:  # the caller's to see
            command.future.set_exception(error)

    def _add(self, command: Add) -> None:
        request_id = command.request.request_id
        batch = self._batch_for(command.sink)
        if request_id in self._owners:
            batch.errors.append((command.key, ValueError(f"request_id {request_id!r} is already in use")))
            return
        try:
            self.engine.add_request(command.request)
        except (ValueError, RuntimeError) as error:  # bad input, or the waiting queue is full
            batch.errors.append((command.key, error))
            return
        # A resumed request's earlier outputs reached its caller already: its deltas start after them.
        request = command.request
        self._owners[request_id] = _Owner(command.sink, command.key, request.num_resumed_tokens, request.stream)
        batch.admitted.append(command.key)

    def _append(self, command: Append) -> None:
        try:
            self.engine.append_input(command.request_id, command.token_ids, command.final)
        except ValueError as error:
            owner = self._owners.pop(command.request_id, None)
            if owner is not None:
                self.engine.abort(command.request_id)
                self._batch_for(owner.sink).errors.append((owner.key, error))

    def _abort(self, request_id: str, stopped: bool = False) -> None:
        request = self.engine.abort(request_id, stopped)
        if request is not None:
            self._publish(request)

    def _publish(self, request: Request) -> None:
        owner = self._owners.get(request.request_id)
        if owner is None or not (owner.stream or request.finished):
            return
        self._batch_for(owner.sink).deltas.append((owner.key, delta_of(request, owner.published_tokens)))
        owner.published_tokens = request.num_output_tokens
        if request.finished:
            del self._owners[request.request_id]

    def _batch_for(self, sink: OutputSink) -> OutputBatch:
        batch = self._outbox.get(sink)
        if batch is None:
            batch = self._outbox[sink] = OutputBatch()
        return batch

    def _deliver_outbox(self) -> None:
        """One hand-off per sink for everything this iteration produced."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        self.num_deliveries += 1
        for sink, batch in outbox.items():
            self.num_handoffs += 1
            self.num_deltas += len(batch.deltas)
            try:
                sink.deliver(batch)
            except Exception:  # one broken consumer must not stop the others' outputs
                logger.exception("an output sink failed to take its batch")

    def _fail_everything(self, error: Exception) -> None:
        for request_id, owner in list(self._owners.items()):
            self.engine.abort(request_id)
            self._batch_for(owner.sink).errors.append((owner.key, RuntimeError(f"engine step failed: {error}")))
        self._owners.clear()


def _fan_out_to_queues(batch: OutputBatch) -> None:
    """On a stream() caller's loop: each item to its stream's queue (the key); admissions need no reply."""
    for deltas, delta in batch.deltas:
        deltas.put_nowait(delta)
    for deltas, error in batch.errors:
        deltas.put_nowait(error)
