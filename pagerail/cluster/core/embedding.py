"""Embedding requests through any engine client: each prompt pooled into one vector, scaled to unit length."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.common.sampling_params import SamplingParams

# An embedding request computes its prompt and samples one token it never shows (the step that ends the prompt).
_ONE_STEP = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class EmbeddingFailed(RuntimeError):
    """The engine ended an embedding request without its vector (a worker failure, an abort)."""


async def pooled_vectors(
    engine: EngineClient, prompts: list[list[int]], pooling: str, request_id: str
) -> list[list[float]]:
    """Each prompt's pooled final hidden state, from the engine, in prompt order (the prompts batch together)."""

    async def one(number: int, prompt: list[int]) -> list[float]:
        request = EngineRequest(f"{request_id}-{number}", prompt, _ONE_STEP, pooling=pooling, stream=False)
        last = None
        async for delta in engine.generate(request):
            last = delta
        if last is None or last.pooled is None:
            reason = (last.error if last is not None else None) or "the engine ended the request without a vector"
            raise EmbeddingFailed(f"input[{number}] was not embedded: {reason}")
        return last.pooled

    return list(await asyncio.gather(*(one(number, prompt) for number, prompt in enumerate(prompts))))


def finish_vector(vector: Sequence[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values (all when None), scaled to unit length when `normalize`; ValueError naming
    `dimensions` past the vector's length."""
    if dimensions is not None:
        if dimensions > len(vector):
            raise ValueError(f"dimensions must be at most the model's {len(vector)}, got {dimensions}")
        vector = vector[:dimensions]
    if not normalize:
        return list(vector)
    norm = math.sqrt(math.fsum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]
