"""The frontend's own process: a Ray actor serving HTTP and gRPC for a head actor, so tokenizing and
detokenizing never stall the head's engine loop."""

from __future__ import annotations

import asyncio

import ray
from transformers import AutoTokenizer

from cluster.distributed.head_client import HeadEngineClient
from cluster.distributed.launcher import NAMESPACE
from cluster.frontend.server import FrontendServer, FrontendSettings, configure_frontend_tracing
from common import telemetry


class FrontendActor:
    def __init__(self, head_name: str, tokenizer_dir: str, settings: FrontendSettings, model_info: dict) -> None:
        configure_frontend_tracing(settings)
        head = ray.get_actor(head_name, namespace=NAMESPACE)
        engine = HeadEngineClient(
            head, settings.served_model_name, model_info["max_model_len"], model_info["vocab_size"]
        )
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.engine = engine
        self.server = FrontendServer(engine, tokenizer, settings)

    async def start(self) -> dict:
        return await self.server.start()

    async def drain(self, grace_s: float) -> int:
        return await self.server.drain(grace_s)

    async def stop(self) -> None:
        await self.server.stop()
        await self.engine.aclose()  # the head stops streaming to this process
        await self.flush_traces()

    async def flush_traces(self) -> bool:
        """Export the request spans this process still buffers."""
        return await asyncio.to_thread(telemetry.flush)
