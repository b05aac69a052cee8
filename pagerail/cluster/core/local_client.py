"""The engine client of the embedded single-process mode: the engine loop runs in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagerail.cluster.core.async_engine import AsyncEngine
from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest


class LocalEngineClient:
    """The engine loop runs in this process (the embedded single-process mode and tests)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self.model_name = model_name
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.vocab_size
        self.eos_token_ids = engine.engine.eos_token_ids

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        return self._engine.stream(request)

    async def append_input(self, request_id: str, token_ids: list[int], final: bool) -> None:
        self._engine.append_input(request_id, token_ids, final)

    async def abort(self, request_id: str, stopped: bool = False) -> None:
        self._engine.abort(request_id, stopped=stopped)

    async def is_ready(self) -> bool:
        return True

    async def pause(self, mode: str) -> None:
        self._engine.pause(mode)

    async def resume(self) -> None:
        self._engine.resume()

    async def stats(self) -> dict:
        return self._engine.stats()

    async def kv_events(self, epoch: int | None, seq: int) -> dict:
        return self._engine.kv_events(epoch, seq)

    async def export_kv(self, token_ids: list[int]):
        return await self._engine.export_kv(token_ids)

    async def import_kv(self, handoff) -> int:
        return await self._engine.import_kv(handoff)

    async def metrics(self) -> str:
        return self._engine.metrics_text()
