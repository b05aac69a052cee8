"""Turns engine token deltas into text deltas for one request's n choices: detokenizing, stop strings, usage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from cluster.core.engine_client import EngineClient
from cluster.core.sampling_params import SamplingParams
from cluster.frontend import tracing
from cluster.frontend.detokenizer import IncrementalDetokenizer


@dataclass
class ChoiceDelta:
    """New text of one choice; the last one carries finish_reason."""

    index: int
    text: str
    token_ids: list[int]
    # Per new token: (token text, logprob, [(top token text, logprob), ...]) when logprobs were asked for.
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


async def stream_choice(
    engine: EngineClient,
    tokenizer,
    request_id: str,
    index: int,
    prompt_ids: list[int],
    params: SamplingParams,
    usage: Usage,
) -> AsyncIterator[ChoiceDelta]:
    """One sequence: engine deltas → text deltas, cut at a stop string (the engine request is then aborted)."""
    detokenizer = IncrementalDetokenizer(
        tokenizer,
        prompt_ids,
        params.skip_special_tokens,
        params.stop,
        params.include_stop_str_in_output,
        min_tokens=params.min_tokens,
    )
    want_logprobs = params.logprobs is not None
    span = trace.get_current_span()  # the request span, when the route runs inside one
    stream = engine.generate(request_id, prompt_ids, params, trace_context=tracing.engine_carrier(span))
    tracing.record_queued(span, request_id)
    try:
        async for delta in stream:
            usage.completion_tokens += len(delta.token_ids)
            usage.cached_tokens = max(usage.cached_tokens, delta.num_cached_tokens)
            tracing.record_delta(span, request_id, delta)
            text = detokenizer.add(delta.token_ids)
            logprobs = _logprob_entries(detokenizer, delta) if want_logprobs else []
            if detokenizer.stopped:
                await engine.abort(request_id)
                _trace_finished(span, request_id, "stop", delta.num_output_tokens, usage)
                yield ChoiceDelta(index, text, delta.token_ids, logprobs, "stop")
                return
            if delta.finished:
                _trace_finished(span, request_id, delta.finish_reason, delta.num_output_tokens, usage)
                yield ChoiceDelta(index, text + detokenizer.flush(), delta.token_ids, logprobs, delta.finish_reason)
                return
            if text or delta.token_ids:
                yield ChoiceDelta(index, text, delta.token_ids, logprobs)
    finally:
        await stream.aclose()


def _trace_finished(span: trace.Span, request_id: str, reason: str | None, num_outputs: int, usage: Usage) -> None:
    """One choice finished: its event, and the request's token counts so far."""
    tracing.record_finished(span, request_id, reason, num_outputs)
    tracing.record_usage(span, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


def _logprob_entries(detokenizer: IncrementalDetokenizer, delta) -> list[tuple[str, float, list[tuple[str, float]]]]:
    entries = []
    for position, token in enumerate(delta.token_ids):
        logprob = delta.logprobs[position] if position < len(delta.logprobs) else 0.0
        top = delta.top_logprobs[position] if position < len(delta.top_logprobs) else {}
        ranked = sorted(top.items(), key=lambda item: -item[1])
        entries.append((detokenizer.token_text(token), logprob, [(detokenizer.token_text(t), lp) for t, lp in ranked]))
    return entries


async def stream_choices(
    engine: EngineClient, tokenizer, request_id: str, prompt_ids: list[int], params: SamplingParams, usage: Usage
) -> AsyncIterator[ChoiceDelta]:
    """All n choices of one prompt, interleaved as they arrive. Each choice is its own engine request."""
    usage.prompt_tokens += len(prompt_ids)
    if params.n == 1:
        async for delta in stream_choice(engine, tokenizer, request_id, 0, prompt_ids, params, usage):
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int) -> None:
        # Distinct seeds keep seeded choices from being identical copies of each other.
        child = params if params.seed is None else replace(params, seed=params.seed + index)
        try:
            async for delta in stream_choice(
                engine, tokenizer, f"{request_id}-{index}", index, prompt_ids, child, usage
            ):
                await queue.put(delta)
        except BaseException as error:  # surfaced to the consumer below
            await queue.put(error)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(index)) for index in range(params.n)]
    try:
        remaining = params.n
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
