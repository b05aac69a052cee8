"""`POST /v1/embeddings`: each input's prompt pooled into one vector by the engine, normalised, optionally cut to
fewer dimensions (Matryoshka models), as floats or base64, in input order."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Sequence
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from pagerail.cluster.core.embedding import EmbeddingFailed, finish_vector, pooled_vectors
from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.frontend.chat import encode_prompt
from pagerail.cluster.frontend.errors import bad_request, check_model, from_value_error, unavailable
from pagerail.cluster.frontend.protocol import LenientModel, check_prompt_batch, prompt_batch
from pagerail.common.pooling_config import GENERATION_MODEL, PoolingConfig


class TextInputs(LenientModel):
    """A request over inputs, each a text or token ids (embeddings, pooling, classification)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value):
        return check_prompt_batch("input", value)

    def inputs(self) -> list[str | list[int]]:
        return prompt_batch(self.input)


class EmbeddingRequest(TextInputs):
    """POST /v1/embeddings, as the openai client sends it; `pooling` and `normalize` are this server's own (default:
    the model's, from its sentence-transformers files: "cls" for an encoder, "last" for a causal LM)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    pooling: Literal["last", "mean", "cls"] | None = None
    normalize: bool | None = None


async def pooled(engine: EngineClient, prompts: list[list[int]], pooling: str, request_id: str) -> list[list[float]]:
    """Each prompt's pooled vector (a classifier's logits) from the engine; a prompt past the context is a 400
    naming `input`, a failed engine request a 503."""
    longest = max(len(prompt) for prompt in prompts)
    if longest >= engine.max_model_len:
        raise bad_request(f"input holds {longest} tokens; the model takes at most {engine.max_model_len - 1}", "input")
    try:
        return await pooled_vectors(engine, prompts, pooling, request_id)
    except EmbeddingFailed as error:
        raise unavailable(str(error), retry_after_s=1) from None


def as_base64(vector: Sequence[float]) -> str:
    """Little-endian float32, base64: what the openai client decodes with numpy.frombuffer(..., dtype=float32)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embeddings(
    body: EmbeddingRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    label: str | None = None,
    on_stream_end: Callable[[], None] = lambda: None,
    pooling: PoolingConfig = GENERATION_MODEL,
):
    """`request_id` is the server's own id for the engine; `pooling` the model's defaults."""
    check_model(body.model, served)
    if pooling.classifies:
        raise bad_request("this model is a classifier: use /classify, /score or /rerank", "model")
    prompts = [encode_prompt(tokenizer, prompt, engine.vocab_size) for prompt in body.inputs()]
    vectors = await pooled(engine, prompts, body.pooling or pooling.default_pooling, f"embd-{request_id}")
    normalize = pooling.normalize if body.normalize is None else body.normalize
    data = []
    for index, vector in enumerate(vectors):
        try:
            values = finish_vector(vector, body.dimensions, normalize)
        except ValueError as error:
            raise from_value_error(error) from None
        encoded = as_base64(values) if body.encoding_format == "base64" else values
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(len(prompt) for prompt in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": served, "usage": usage})
