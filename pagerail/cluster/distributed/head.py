"""The head actor: one model replica's scheduler, block table and engine loop, driving its workers over gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import ray

from pagerail.cluster.core.async_engine import AsyncEngine, OutputBatch
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.kv_handoff import describe_prefix, held_blocks, release_held, reserve_slots
from pagerail.cluster.core.model_info import read_model_info
from pagerail.cluster.distributed.cluster_options import ClusterOptions
from pagerail.cluster.distributed.output_channel import OutputChannel
from pagerail.cluster.distributed.worker_group import WorkerGroup
from pagerail.common import telemetry
from pagerail.common.engine_config import EngineConfig
from pagerail.common.heap import freeze_startup_heap
from pagerail.common.logs import configure_logging
from pagerail.common.model_source import resolve_model_dir
from pagerail.worker.config import worker_config


class HeadActor:
    """Runs the engine loop in a thread; async methods hand requests in and results out."""

    def __init__(self, config: EngineConfig, options: ClusterOptions, token: str) -> None:
        configure_logging()
        observability = config.observability
        telemetry.configure_tracing(
            "head", endpoint=observability.otlp_traces_endpoint, sampling_ratio=observability.trace_sampling_ratio
        )
        model_dir = resolve_model_dir(config.model)
        info = read_model_info(model_dir, config.runner, config.convert, config.pooler_config)
        info.check_engine(config)
        self.group = WorkerGroup(
            worker_config(config, model_dir),
            config.tensor_parallel_size,
            token,
            use_gpu=options.use_gpu,
            cpus_per_worker=options.cpus_per_worker,
            placement_strategy=options.placement_strategy,
            tls=options.tls,
            step_timeout_s=options.step_timeout_s,
            # Named after this actor, so that after a restart it finds and removes what its previous life left.
            name=ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None,
        )
        # A rank may die while its group starts (killed while this head restarts after a fault of its own): the
        # head starts the group again rather than fail its constructor, after which Ray would not restart it.
        self.group.start_despite_deaths(options.max_restarts)
        self.engine = EngineCore.for_model(config, self.group, info)
        self.engine.max_restarts = options.max_restarts
        self.async_engine = AsyncEngine(self.engine)
        # Consumers' output channels by id; created by whichever of submit() and outputs() comes first.
        self._channels: dict[str, OutputChannel] = {}
        self.num_output_messages = 0  # sent on every channel, all lives of channels together
        freeze_startup_heap()  # the engine loop runs from here on: start-up's objects need no more collecting

    # -- called by clients ----------------------------------------------------------------------

    def ready(self) -> bool:
        """Model loaded and every rank up (false while the worker group restarts)."""
        return self.group.running

    def model_info(self) -> dict:
        return {
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "eos_token_ids": sorted(self.engine.eos_token_ids),
        }

    async def submit_many(self, submissions: list[tuple[str, EngineRequest]]) -> list[Exception | None]:
        """Admit requests whose outputs go to the channels named with them, with one actor call for a frontend's
        submissions of one event-loop turn (an embedding batch's inputs, n choices, requests that arrived
        together); per request None once admitted, or the exception that refused it (ValueError, QueueFullError).

        A request's `trace_context`: the W3C carrier of the caller's request span, which the step spans link to.
        """
        results = await asyncio.gather(
            *(self._channel(channel_id).submit(request) for channel_id, request in submissions), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # a cancellation, not a refusal
        return list(results)

    async def outputs(self, channel_id: str) -> AsyncIterator[OutputBatch]:
        """The channel's stream: one message per engine step, every delta of the channel's requests in it.

        Ending the call (the consumer closed it or died) aborts the channel's requests.
        """
        channel = self._channel(channel_id)
        try:
            while (message := await channel.next_message()) is not None:
                self.num_output_messages += 1
                yield message
        finally:
            self._close_channel(channel_id)

    async def close_channel(self, channel_id: str) -> None:
        """The consumer is done with the channel: its stream ends and its unfinished requests are aborted."""
        self._close_channel(channel_id)

    def _close_channel(self, channel_id: str) -> None:
        channel = self._channels.pop(channel_id, None)
        if channel is not None:
            channel.close()

    def abort(self, request_id: str, channel_id: str | None = None, stopped: bool = False) -> None:
        """Abort a request; with `channel_id`, only if that channel holds it. `stopped`: on a stop string."""
        if channel_id is None:
            self.async_engine.abort(request_id, stopped=stopped)
        elif (channel := self._channels.get(channel_id)) is not None:
            channel.abort(request_id, stopped)

    def _channel(self, channel_id: str) -> OutputChannel:
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = OutputChannel(self.async_engine, asyncio.get_running_loop())
        return channel

    async def generate(self, request: EngineRequest) -> RequestDelta:
        """Run one request to completion and return its output (warm-up and tests; serving uses channels)."""
        return await self.async_engine.generate(request)

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """One request's deltas as their own Ray stream (bench/dispatch.py and the cluster tests drive a head this way);
        serving uses a channel, one message per step."""
        async for delta in self.async_engine.stream(request):
            yield delta

    def append_input(self, request_id: str, token_ids: Sequence[int], final: bool) -> None:
        """Next chunk of an open streaming-input session."""
        self.async_engine.append_input(request_id, token_ids, final)

    def pause(self, mode: str = "all") -> None:
        """Hold new requests ("new") or every request ("all") until resume()."""
        self.async_engine.pause(mode)

    def resume(self) -> None:
        self.async_engine.resume()

    def stats(self) -> dict:
        dispatch = self.group.dispatch_stats
        return {
            **self.async_engine.stats(),
            "num_output_messages": self.num_output_messages,
            "dispatch": dispatch.summary() if dispatch is not None else {},
        }

    def metrics(self) -> str:
        return self.async_engine.metrics_text()

    async def export_kv(self, token_ids: list[int]):
        """The KV blocks this replica caches for `token_ids` (cluster/core/kv_handoff.py), or None."""
        return await self.async_engine.export_kv(token_ids)

    async def import_kv(self, handoff) -> int:
        """Another replica's KV blocks into this replica's host tier; how many it took."""
        return await self.async_engine.import_kv(handoff)

    # KV over the ranks' own channel (worker/kv_channel.py): describe and hold, reserve, open, send, receive, settle.

    def kv_layout(self) -> dict:
        """What one KV block of this replica is, and its vocabulary: replicas that move blocks must agree."""
        return {**self.group.kv_layout, "vocab_size": self.engine.vocab_size}

    async def kv_endpoint(self) -> tuple[str, int, int]:
        return await asyncio.to_thread(self.group.kv_endpoint)

    async def kv_open_channel(
        self, channel_id: str, host: str, port: int, first: int, senders: int, receivers: int,
        transfer_base_s: float | None = None,
    ):  # fmt: skip
        # `transfer_base_s`: the fixed part of each transfer's deadline on this channel (None: the ranks' default).
        channel = (channel_id, host, port, first, senders, receivers)
        await asyncio.to_thread(self.group.open_kv_channel, *channel, transfer_base_s=transfer_base_s)

    async def kv_describe(self, token_ids: list[int], holder: str):
        return await self.async_engine.run_on_loop(lambda engine: describe_prefix(engine, token_ids, holder))

    async def kv_send(self, holder: str, rows: list[int], channel_id: str) -> None:
        # Off the engine loop, which goes on stepping: the held blocks stay as they are until released.
        try:
            block_ids = await self.async_engine.run_on_loop(lambda engine: held_blocks(engine, holder, rows))
            await asyncio.to_thread(self.group.send_blocks, channel_id, block_ids)
        finally:
            await self.kv_release(holder)

    async def kv_release(self, holder: str) -> None:
        await self.async_engine.run_on_loop(lambda engine: release_held(engine, holder))

    async def kv_reserve(self, handoff) -> tuple[list[int], list[int]]:
        return await self.async_engine.run_on_loop(lambda engine: reserve_slots(engine, handoff, False), drain=True)

    async def kv_receive(self, channel_id: str, slots: list[int], shape: tuple[int, ...], dtype: str) -> None:
        await asyncio.to_thread(self.group.receive_blocks, channel_id, slots, shape, dtype)

    async def kv_settle(self, hashes: list[int], arrived: bool) -> None:
        await self.async_engine.run_on_loop(lambda engine: engine.block_table.host_tier.settle(hashes, arrived))

    def kv_events(self, epoch: int | None, seq: int) -> dict:
        """The block events of this replica's caches after (epoch, seq), or a snapshot (cluster/core/kv_events.py)."""
        return self.async_engine.kv_events(epoch, seq)

    def reset_dispatch_stats(self) -> None:
        if self.group.dispatch_stats is not None:
            self.group.dispatch_stats.reset()

    async def flush_traces(self) -> bool:
        """Export the spans the head and every rank still buffer; True when all did."""
        # In threads: flushing waits on exporters and on the ranks, and must not stall this actor's event loop.
        flushed = await asyncio.gather(asyncio.to_thread(telemetry.flush), asyncio.to_thread(self.group.flush_traces))
        return all(flushed)

    def shutdown(self) -> None:
        for channel_id in list(self._channels):
            self._close_channel(channel_id)  # consumers' streams end instead of waiting on a stopped engine
        self.async_engine.shutdown()
        if telemetry.tracing_enabled():
            self.group.flush_traces(timeout_s=5.0)  # the ranks' last spans, before they are killed
        self.group.shutdown()
        telemetry.flush(timeout_s=5.0)
