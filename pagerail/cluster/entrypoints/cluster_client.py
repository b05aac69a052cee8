"""The `LLM` API's engine on Ray: head actors and the engine clients `pagerail serve`'s frontend uses, driven
from a private event loop so the API stays synchronous."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any

import ray

from pagerail.cluster.core.outputs import RequestOutput
from pagerail.cluster.distributed.cluster_options import ClusterOptions
from pagerail.cluster.distributed.head_client import HeadEngineClient
from pagerail.cluster.distributed.launcher import connect, start_heads, stop_head, uses_gpu
from pagerail.cluster.frontend.generation import Usage, stream_choices
from pagerail.cluster.frontend.output_processor import append_choice
from pagerail.cluster.routing.replica_pool import ReplicaPool, ReplicaSettings
from pagerail.common.engine_config import EngineConfig
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import SamplingParams


class HeadUnavailableError(RuntimeError):
    """A head actor died while requests were in flight; Ray restarts it, the requests must be retried."""


class _LoopThread:
    """An asyncio event loop in a daemon thread; `run` blocks the caller until a coroutine finished there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="llm-client-loop", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        """Cancel what still runs there (an output channel's reader), then stop the loop and its thread."""
        self.run(_cancel_others())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


async def _cancel_others() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class ClusterClient:
    """One head actor (tensor parallel, or an existing cluster) served through a HeadEngineClient, or
    `data_parallel_size` heads behind the ReplicaPool's routed client: prefix-aware routing, failover, siblings of
    one prompt on one replica."""

    def __init__(
        self,
        config: EngineConfig,
        options: ClusterOptions,
        ray_address: str | None,
        head_name: str,
        data_parallel_size: int,
    ) -> None:
        connect(ray_address)
        options = replace(options, use_gpu=uses_gpu(config.device))
        names = [head_name] if data_parallel_size == 1 else [f"{head_name}-{i}" for i in range(data_parallel_size)]
        self.heads = start_heads(config, options, names)
        info = ray.get(self.heads[0].model_info.remote())
        self._loop = _LoopThread()
        self.pool: ReplicaPool | None = None
        if data_parallel_size == 1:
            self.client = HeadEngineClient(self.heads[0], config.model_name, info)
        else:
            settings = ReplicaSettings(block_size=config.cache.block_size, adapter_slots=config.lora.max_loras)
            self.pool = ReplicaPool(names, config.model_name, info, settings)
            self.client = self.pool.engine
            self._loop.run(self._start_pool())

    async def _start_pool(self) -> None:
        self.pool.start()

    def call(self, coroutine: Coroutine) -> Any:
        """Run `coroutine` (which may use `client`) on the loop the client lives on; its result."""
        return self._loop.run(coroutine)

    def run(
        self,
        outputs: Sequence[RequestOutput],
        params: Sequence[SamplingParams],
        tokenizer: Any,
        loras: Sequence[LoRARequest | None] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> None:
        """Generate every prompt's choices at once (prompt i with adapter loras[i] at priorities[i]), filling
        `outputs` in place."""
        try:
            count = len(outputs)
            self._loop.run(self._run(outputs, params, tokenizer, loras or [None] * count, priorities or [0] * count))
        except ray.exceptions.RayActorError as error:
            raise HeadUnavailableError(
                "the head actor died with requests in flight; it is being restarted, retry the requests"
            ) from error

    async def _run(
        self,
        outputs: Sequence[RequestOutput],
        params: Sequence[SamplingParams],
        tokenizer: Any,
        loras: Sequence[LoRARequest | None],
        priorities: Sequence[int],
    ) -> None:
        async def one(output: RequestOutput, sp: SamplingParams, lora: LoRARequest | None, priority: int) -> None:
            prompt = output.prompt_token_ids
            choices = stream_choices(self.client, tokenizer, output.request_id, prompt, sp, Usage(), lora, priority)
            async for choice in choices:
                append_choice(output, choice)

        # A failure of one prompt cancels the others, which aborts their requests at the heads; the caller gets
        # that failure itself (bad input stays a ValueError), not the group wrapping it.
        try:
            async with asyncio.TaskGroup() as group:
                for output, sp, lora, priority in zip(outputs, params, loras, priorities, strict=True):
                    group.create_task(one(output, sp, lora, priority))
        except BaseExceptionGroup as failures:
            raise failures.exceptions[0] from None

    def stats(self) -> dict:
        return self._loop.run(self.client.stats())

    def shutdown(self) -> None:
        try:
            self._loop.run(self._close_clients())
        finally:
            self._loop.close()
            for head in self.heads:
                stop_head(head)

    async def _close_clients(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()
        else:
            await self.client.aclose()
