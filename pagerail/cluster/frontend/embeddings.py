"""`POST /v1/embeddings`: each input's prompt pooled into one vector by the engine, normalised, optionally cut to
fewer dimensions (Matryoshka models), as floats or base64, in input order."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import Callable, Sequence
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.frontend.chat import encode_prompt
from pagerail.cluster.frontend.errors import bad_request, not_found_model, unavailable
from pagerail.cluster.frontend.protocol import LenientModel, is_token_id
from pagerail.common.sampling_params import SamplingParams

# An embedding request computes its prompt and samples one token it never shows (the step that ends the prompt).
_ONE_STEP = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class EmbeddingRequest(LenientModel):
    """POST /v1/embeddings, as the openai client sends it; `pooling` is this server's own (default "last")."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    pooling: Literal["last", "mean", "cls"] = "last"
    normalize: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value):
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            return value
        if isinstance(value, list) and value and all(is_token_id(t) for t in value):
            return value
        if (
            isinstance(value, list)
            and value
            and all(isinstance(v, list) and v and all(is_token_id(t) for t in v) for v in value)
        ):
            return value
        raise ValueError("input must be a string, a list of strings, a list of token ids or a list of token-id lists")

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(v, int) for v in self.input):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


def finish_vector(vector: Sequence[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values (all when None), scaled to unit length when `normalize`."""
    if dimensions is not None:
        if dimensions > len(vector):
            raise bad_request(f"dimensions must be at most the model's {len(vector)}, got {dimensions}", "dimensions")
        vector = vector[:dimensions]
    if not normalize:
        return list(vector)
    norm = math.sqrt(math.fsum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def as_base64(vector: Sequence[float]) -> str:
    """Little-endian float32, base64: what the openai client decodes with numpy.frombuffer(..., dtype=float32)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


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
            raise unavailable(f"input[{number}] was not embedded: {reason}", retry_after_s=1)
        return last.pooled

    return list(await asyncio.gather(*(one(number, prompt) for number, prompt in enumerate(prompts))))


async def embeddings(
    body: EmbeddingRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    label: str | None = None,
    on_stream_end: Callable[[], None] = lambda: None,
):
    """`request_id` is the server's own id for the engine."""
    if body.model and body.model != served:
        raise not_found_model(body.model)
    prompts = [encode_prompt(tokenizer, prompt, engine.vocab_size) for prompt in body.inputs()]
    longest = max(len(prompt) for prompt in prompts)
    if longest >= engine.max_model_len:
        raise bad_request(f"input holds {longest} tokens; the model takes at most {engine.max_model_len - 1}", "input")
    vectors = await pooled_vectors(engine, prompts, body.pooling, f"embd-{request_id}")
    data = []
    for index, vector in enumerate(vectors):
        values = finish_vector(vector, body.dimensions, body.normalize)
        encoded = as_base64(values) if body.encoding_format == "base64" else values
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(len(prompt) for prompt in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": served, "usage": usage})
