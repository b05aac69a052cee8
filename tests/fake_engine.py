"""A fake engine implementing the whole EngineClient interface, so API tests need no model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.errors import QueueFullError


class FakeEngineClient:
    """Emits one deterministic token per step: token i of a request is (sum(prompt) + 7 * i) % vocab_size, plus
    13 * seed with `vary_by_seed` (so a seeded request's choices differ)."""

    def __init__(
        self,
        model_name: str = "fake",
        max_model_len: int = 256,
        vocab_size: int = 1000,
        eos_token_id: int = 0,
        max_waiting: int | None = None,
        step_delay_s: float = 0.0,
        vary_by_seed: bool = False,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_token_ids = frozenset({eos_token_id})
        self.max_waiting = max_waiting
        self.step_delay_s = step_delay_s
        self.vary_by_seed = vary_by_seed
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.stopped: list[str] = []  # ended by the caller on a stop string
        self.requests: list[EngineRequest] = []  # every envelope received, in order
        self.ready = True
        self.paused = False
        self._inputs: dict[str, list[int]] = {}
        self._more_input: dict[str, asyncio.Event] = {}

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        self.requests.append(request)
        request_id, prompt_token_ids, params, final = (
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.final,
        )
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        if self.max_waiting is not None and len(self.active) >= self.max_waiting:
            raise QueueFullError("waiting queue is full", retry_after_s=1.0)
        self.active.add(request_id)
        self._inputs[request_id] = list(prompt_token_ids)
        try:
            if not final:
                event = self._more_input[request_id] = asyncio.Event()
                while request_id in self._more_input:
                    await event.wait()
                    event.clear()
            prompt = self._inputs[request_id]
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
            for i in range(max_tokens):
                await asyncio.sleep(self.step_delay_s)
                while self.paused:
                    await asyncio.sleep(0.01)
                if request_id not in self.active:
                    yield RequestDelta(request_id, [], len(prompt), i, True, "abort")
                    return
                offset = 13 * (params.seed or 0) if self.vary_by_seed else 0
                token = (sum(prompt) + 7 * i + offset) % self.vocab_size
                stopped = token in stop_ids and i + 1 >= params.min_tokens
                finished = stopped or i + 1 == max_tokens
                reason = ("stop" if stopped else "length") if finished else None
                logprobs = [-0.5] if params.logprobs is not None else []
                top = [{token: -0.5, (token + 1) % self.vocab_size: -1.5}] if params.logprobs else []
                delta = RequestDelta(request_id, [token], len(prompt), i + 1, finished, reason, logprobs, top)
                if finished and request.pooling is not None:
                    delta.pooled = [float(sum(prompt) % 7 + 1), float(len(prompt))]  # a stand-in embedding
                yield delta
                if finished:
                    return
        finally:
            self.active.discard(request_id)

    async def append_input(self, request_id: str, token_ids: list[int], final: bool) -> None:
        if request_id not in self._inputs:
            raise ValueError(f"request_id {request_id!r} is not an open streaming-input session")
        self._inputs[request_id].extend(token_ids)
        event = self._more_input.get(request_id)
        if final:
            self._more_input.pop(request_id, None)
        if event is not None:
            event.set()

    async def abort(self, request_id: str, stopped: bool = False) -> None:
        if request_id in self.active:
            (self.stopped if stopped else self.aborted).append(request_id)
            self.active.discard(request_id)

    async def is_ready(self) -> bool:
        return self.ready

    async def pause(self, mode: str) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def stats(self) -> dict:
        return {"num_unfinished": len(self.active)}

    async def metrics(self) -> str:
        return ""
