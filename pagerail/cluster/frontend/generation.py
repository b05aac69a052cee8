"""Streams one request's n choices to a front door: each choice's engine deltas through its ChoiceState, usage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from opentelemetry import trace

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.core.engine_request import CALLER_TENANT, EngineRequest
from pagerail.cluster.frontend import tracing
from pagerail.cluster.frontend.output_processor import ChoiceDelta, ChoiceState, fan_out
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import SamplingParams


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


async def stream_choice(
    engine: EngineClient, tokenizer, request: EngineRequest, index: int, usage: Usage
) -> AsyncIterator[ChoiceDelta]:
    """One choice: engine deltas → text deltas, cut at a stop string (the engine request then finishes there)."""
    request_id = request.request_id
    state = ChoiceState(tokenizer, request.prompt_token_ids, request.params, index)
    span = trace.get_current_span()  # the request span, when the route runs inside one
    stream = engine.generate(request)
    tracing.record_queued(span, request_id)
    try:
        async for delta in stream:
            usage.cached_tokens = max(usage.cached_tokens, delta.num_cached_tokens)
            tracing.record_delta(span, request_id, delta)
            choice = state.process(delta)
            usage.completion_tokens += len(choice.token_ids)
            if state.stopped:
                await engine.abort(request_id, stopped=True)
            if state.finished:
                _trace_finished(span, request_id, choice.finish_reason, state.num_output_tokens, usage)
                yield choice
                return
            if choice.text or choice.token_ids:
                yield choice
    finally:
        await stream.aclose()


def _trace_finished(span: trace.Span, request_id: str, reason: str | None, num_outputs: int, usage: Usage) -> None:
    """One choice finished: its event, and the request's token counts so far."""
    tracing.record_finished(span, request_id, reason, num_outputs)
    tracing.record_usage(span, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


# JSON has no -Infinity: a token the sampling settings or a grammar ruled out shows this logprob instead (as in
# OpenAI's and vLLM's answers), so the body stays valid JSON for every client.
MIN_JSON_LOGPROB = -9999.0


def logprob_entries(tokenizer, delta: ChoiceDelta) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Per token of `delta`: (its text, its logprob, [(text, logprob) of the most likely tokens, best first]),
    every logprob a finite number."""
    entries = []
    for position, token in enumerate(delta.token_ids):
        logprob = delta.logprobs[position] if position < len(delta.logprobs) else 0.0
        top = delta.top_logprobs[position] if position < len(delta.top_logprobs) else {}
        ranked = [(token_text(tokenizer, t), _finite(lp)) for t, lp in sorted(top.items(), key=lambda item: -item[1])]
        entries.append((token_text(tokenizer, token), _finite(logprob), ranked))
    return entries


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_JSON_LOGPROB else MIN_JSON_LOGPROB  # NaN compares false: it becomes the floor too


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token on its own, as logprobs show it."""
    return tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens([token_id]))


def stream_choices(
    engine: EngineClient,
    tokenizer,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    usage: Usage,
    lora: LoRARequest | None = None,
    priority: int = 0,
    service_tier: str = "default",
) -> AsyncIterator[ChoiceDelta]:
    """All n choices of one prompt (run with adapter `lora`, at scheduling `priority` in `service_tier`),
    interleaved as they arrive. Each choice is its own engine request."""
    usage.prompt_tokens += len(prompt_ids)
    span = trace.get_current_span()
    tracing.annotate_adapter(span, lora)
    tracing.annotate_tenant(span, CALLER_TENANT.get()[0], priority, service_tier)
    carrier = tracing.engine_carrier(span)
    children = fan_out(
        request_id, prompt_ids, params, trace_context=carrier, lora=lora, priority=priority, service_tier=service_tier
    )
    if len(children) == 1:  # the choice's own stream: no generator in between for every chunk to pass
        return stream_choice(engine, tokenizer, children[0], 0, usage)
    return _interleaved_choices(engine, tokenizer, children, usage)


async def _interleaved_choices(
    engine: EngineClient, tokenizer, children: list[EngineRequest], usage: Usage
) -> AsyncIterator[ChoiceDelta]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, child: EngineRequest) -> None:
        try:
            async for delta in stream_choice(engine, tokenizer, child, index, usage):
                await queue.put(delta)
        except BaseException as error:  # surfaced to the consumer below
            await queue.put(error)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(index, child)) for index, child in enumerate(children)]
    try:
        remaining = len(children)
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
