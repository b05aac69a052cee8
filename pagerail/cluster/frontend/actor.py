"""The frontend's own process: a Ray actor serving HTTP and gRPC for the head actors of a model's replicas, so
tokenizing and detokenizing never stall a head's engine loop."""

from __future__ import annotations

import asyncio

import ray
from transformers import AutoTokenizer

from pagerail.cluster.distributed.head_client import HeadEngineClient
from pagerail.cluster.distributed.launcher import NAMESPACE
from pagerail.cluster.frontend.server import FrontendServer, configure_frontend_tracing
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.cluster.routing.replica_pool import ReplicaPool, ReplicaSettings
from pagerail.common import telemetry
from pagerail.common.heap import freeze_startup_heap


class FrontendActor:
    """`head_names`: one head (served directly, as a single replica) or several, routed between by a ReplicaPool;
    with `replicas` given, a single head is routed and scaled too."""

    def __init__(
        self,
        head_names: str | list[str],
        tokenizer_dir: str,
        settings: FrontendSettings,
        model_info: dict,
        replicas: ReplicaSettings | None = None,
    ) -> None:
        configure_frontend_tracing(settings)
        names = [head_names] if isinstance(head_names, str) else list(head_names)
        self.pool: ReplicaPool | None = None
        if len(names) == 1 and replicas is None:
            head = ray.get_actor(names[0], namespace=NAMESPACE)
            engine = HeadEngineClient(head, settings.served_model_name, model_info)
        else:
            self.pool = ReplicaPool(names, settings.served_model_name, model_info, replicas or ReplicaSettings())
            engine = self.pool.engine
        self._head_names = names
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.engine = engine
        self.server = FrontendServer(engine, tokenizer, settings)

    async def start(self) -> dict:
        if self.pool is not None:
            self.pool.start()
        ports = await self.server.start()
        freeze_startup_heap()  # serving from here on: start-up's objects need no more collecting
        return ports

    def head_names(self) -> list[str]:
        """The heads serving now or draining: the ones to stop at shutdown."""
        return self.pool.head_names() if self.pool is not None else list(self._head_names)

    async def drain(self, grace_s: float) -> int:
        return await self.server.drain(grace_s)

    async def stop(self) -> None:
        await self.server.stop()
        if self.pool is not None:
            await self.pool.aclose()  # no more scaling; the heads stop streaming to this process
        else:
            await self.engine.aclose()
        await self.flush_traces()

    async def stats(self) -> dict:
        return await self.engine.stats()

    async def flush_traces(self) -> bool:
        """Export the request spans this process still buffers."""
        return await asyncio.to_thread(telemetry.flush)
