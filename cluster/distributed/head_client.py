"""The engine client of a model replica's head actor on Ray."""

from __future__ import annotations

from collections.abc import AsyncIterator

import ray

from cluster.core.engine_client import RequestDelta
from cluster.core.errors import QueueFullError
from cluster.core.sampling_params import SamplingParams


class HeadEngineClient:
    """A model replica's head actor on Ray; token deltas stream back as Ray object refs."""

    def __init__(self, head, model_name: str, max_model_len: int, vocab_size: int) -> None:
        self._head = head
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        final: bool = True,
        trace_context: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestDelta]:
        refs = self._head.stream.remote(request_id, prompt_token_ids, params, final, trace_context)
        finished = False
        try:
            async for ref in refs:
                try:
                    delta = await ref
                except ray.exceptions.RayTaskError as error:
                    # Hand the caller the head's own exception (bad input, queue full), not Ray's wrapper.
                    cause = getattr(error, "cause", None)
                    if isinstance(cause, (ValueError, QueueFullError)):
                        raise cause from None
                    raise
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                # The client went away: the head must free the request's blocks.
                self._head.abort.remote(request_id)

    async def append_input(self, request_id: str, token_ids: list[int], final: bool) -> None:
        await self._head.append_input.remote(request_id, token_ids, final)

    async def abort(self, request_id: str) -> None:
        await self._head.abort.remote(request_id)

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

    async def metrics(self) -> str:
        return await self._head.metrics.remote()
