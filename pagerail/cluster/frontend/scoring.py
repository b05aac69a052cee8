"""vLLM's pooling routes beside /v1/embeddings: `/pooling` (the raw pooled vector), `/classify` (a classifier's label
probabilities), `/score` (text pairs) and `/rerank` (Jina's and Cohere's shape). A pair is scored by a cross-encoder
(the pair as one prompt, its head's logit through a sigmoid) or, on an embedder, by the cosine of the two texts'
embeddings."""

from __future__ import annotations

import math
import time

from fastapi.responses import JSONResponse
from pydantic import Field

from pagerail.cluster.core.embedding import finish_vector
from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.frontend.chat import encode_prompt
from pagerail.cluster.frontend.embeddings import EmbeddingRequest, TextInputs, as_base64, pooled
from pagerail.cluster.frontend.errors import bad_request, check_model
from pagerail.cluster.frontend.protocol import LenientModel
from pagerail.common.pooling_config import PoolingConfig

MAX_PAIRS = 1024


class PoolingRequest(EmbeddingRequest):
    """POST /pooling: the inputs of /v1/embeddings; each answer is the model's pooled vector as computed (an
    embedder's unnormalised, a classifier's label logits)."""


class ClassifyRequest(TextInputs):
    """POST /classify."""


class ScoreRequest(LenientModel):
    """POST /score: `text_1` against each `text_2` (one string against a list, or two lists pairwise)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)

    def pairs(self) -> list[tuple[str, str]]:
        """The (first, second) texts to score, in answer order; ValueError naming the field when they do not pair."""
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not firsts or not seconds:
            raise ValueError("text_1 and text_2 must not be empty")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ValueError(
                f"text_2 must hold as many texts as text_1 ({len(firsts)}) or text_1 one, got {len(seconds)}"
            )
        if len(seconds) > MAX_PAIRS:
            raise ValueError(f"text_2 must hold at most {MAX_PAIRS} texts, got {len(seconds)}")
        return list(zip(firsts, seconds, strict=True))


class RerankDocument(LenientModel):
    text: str


class RerankRequest(LenientModel):
    """POST /rerank and /v1/rerank, in Jina's and Cohere's shape."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_PAIRS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


async def pooling_route(
    body: PoolingRequest, engine: EngineClient, tokenizer, served: str, request_id: str, label=None, **options
):
    pooling: PoolingConfig = options["pooling"]
    check_model(body.model, served)
    prompts = [encode_prompt(tokenizer, prompt, engine.vocab_size) for prompt in body.inputs()]
    vectors = await pooled(engine, prompts, body.pooling or pooling.default_pooling, f"pool-{request_id}")
    data = []
    for index, vector in enumerate(vectors):
        values = finish_vector(vector, body.dimensions, bool(body.normalize)) if body.dimensions else vector
        encoded = as_base64(values) if body.encoding_format == "base64" else values
        data.append({"index": index, "object": "pooling", "data": encoded})
    return _listed(f"pool-{label or request_id}", served, data, prompts)


async def classify_route(
    body: ClassifyRequest, engine: EngineClient, tokenizer, served: str, request_id: str, label=None, **options
):
    pooling: PoolingConfig = options["pooling"]
    check_model(body.model, served)
    if not pooling.classifies:
        raise bad_request("this model has no classification head; /classify needs a *ForSequenceClassification model")
    prompts = [encode_prompt(tokenizer, prompt, engine.vocab_size) for prompt in body.inputs()]
    logits = await pooled(engine, prompts, "cls", f"clsf-{request_id}")
    data = []
    for index, row in enumerate(logits):
        probs = _probabilities(row)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": pooling.labels[best], "probs": probs, "num_classes": len(probs)})
    return _listed(f"classify-{label or request_id}", served, data, prompts)


async def score_route(
    body: ScoreRequest, engine: EngineClient, tokenizer, served: str, request_id: str, label=None, **options
):
    check_model(body.model, served)
    try:
        pairs = body.pairs()
    except ValueError as error:
        raise bad_request(str(error), "text_2" if "text_2" in str(error) else "text_1") from None
    scores, tokens = await _scores(engine, tokenizer, options["pooling"], pairs, f"score-{request_id}")
    data = [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    body_id = f"score-{label or request_id}"
    return JSONResponse(
        {"id": body_id, "object": "list", "created": int(time.time()), "model": served, "data": data, "usage": usage}
    )


async def rerank_route(
    body: RerankRequest, engine: EngineClient, tokenizer, served: str, request_id: str, label=None, **options
):
    check_model(body.model, served)
    texts = body.texts()
    scores, tokens = await _scores(
        engine, tokenizer, options["pooling"], [(body.query, t) for t in texts], f"rerank-{request_id}"
    )
    ranked = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n or len(texts)]
    results = []
    for index in ranked:
        result = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return JSONResponse(
        {"id": f"rerank-{label or request_id}", "model": served, "usage": {"total_tokens": tokens}, "results": results}
    )


async def _scores(
    engine: EngineClient, tokenizer, pooling: PoolingConfig, pairs: list[tuple[str, str]], request_id: str
) -> tuple[list[float], int]:
    """Each pair's score and the tokens read: a cross-encoder's sigmoid of its one logit, else the cosine of the two
    texts' embeddings."""
    if pooling.classifies:
        if len(pooling.labels) != 1:
            raise bad_request(
                f"/score and /rerank need a cross-encoder with one label; this model has {len(pooling.labels)}"
            )
        limit = engine.max_model_len - 1
        prompts = [
            list(tokenizer(first, second, truncation=True, max_length=limit)["input_ids"]) for first, second in pairs
        ]
        logits = await pooled(engine, prompts, "cls", request_id)
        return [1.0 / (1.0 + math.exp(-row[0])) for row in logits], sum(len(p) for p in prompts)
    texts = sorted({text for pair in pairs for text in pair})
    prompts = [encode_prompt(tokenizer, text, engine.vocab_size) for text in texts]
    vectors = await pooled(engine, prompts, pooling.default_pooling, request_id)
    unit = {text: finish_vector(vector, None, True) for text, vector in zip(texts, vectors, strict=True)}
    scores = [math.fsum(a * b for a, b in zip(unit[first], unit[second], strict=True)) for first, second in pairs]
    return scores, sum(len(p) for p in prompts)


def _probabilities(logits: list[float]) -> list[float]:
    """A single label's sigmoid; several labels' softmax."""
    if len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-logits[0]))]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = math.fsum(weights)
    return [w / total for w in weights]


def _listed(response_id: str, served: str, data: list, prompts: list[list[int]]) -> JSONResponse:
    tokens = sum(len(p) for p in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse(
        {
            "id": response_id,
            "object": "list",
            "created": int(time.time()),
            "model": served,
            "data": data,
            "usage": usage,
        }
    )
