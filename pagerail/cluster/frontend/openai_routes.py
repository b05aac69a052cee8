"""OpenAI `/v1/completions` and `/v1/chat/completions`: streaming (SSE) and whole responses."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.frontend.bad_words import with_bad_words
from pagerail.cluster.frontend.beam_choices import beam_choices
from pagerail.cluster.frontend.chat import encode_prompt, render_chat
from pagerail.cluster.frontend.chat_output import ChoiceOutput
from pagerail.cluster.frontend.constraints import check_output_constraint
from pagerail.cluster.frontend.errors import check_model, from_value_error
from pagerail.cluster.frontend.generation import ChoiceDelta, Usage, logprob_entries, stream_choices
from pagerail.cluster.frontend.prompt_echo import Echo, completion_logprobs, prompt_logprobs_json
from pagerail.cluster.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pagerail.cluster.frontend.sse_events import ChunkEvents
from pagerail.cluster.frontend.tool_calls import choose_parser
from pagerail.cluster.frontend.tool_choice import output_parser
from pagerail.cluster.frontend.tracing import annotate_request
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import SamplingParams, truncate_prompt


def _sampling(request, engine: EngineClient, prompt_len: int, tokenizer) -> SamplingParams:
    try:
        params = request.to_sampling_params(default_max_tokens=max(1, engine.max_model_len - prompt_len))
        return with_bad_words(params, tokenizer)
    except ValueError as error:
        raise from_value_error(error) from None


def _truncation(body) -> int | None:
    """truncate_prompt_tokens of a request, checked as SamplingParams checks it (a 400 naming it)."""
    keep = body.truncate_prompt_tokens
    if keep is not None and keep != -1 and keep < 1:
        raise from_value_error(ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {keep}"))
    return keep


def _usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _nothing() -> None:
    """A streamed response's end, where nobody counts it."""


@dataclass
class _Choices:
    """One prompt's choice stream whose first delta was already pulled (so bad input and a full queue became real
    errors before the response started); readers take `first`, then the stream itself: no iterator in between."""

    offset: int  # the response index of the prompt's first choice
    first: ChoiceDelta | None
    stream: AsyncIterator[ChoiceDelta]

    async def next(self) -> ChoiceDelta | None:
        """The next delta, or None once the stream ended."""
        first = self.first
        if first is not None:
            self.first = None
            return first
        return await anext(self.stream, None)


async def _started(offset: int, stream: AsyncIterator[ChoiceDelta]) -> _Choices:
    """Pull the first delta before the response starts, so bad input (a 400) and a full queue become real errors."""
    try:
        first = await anext(stream, None)
    except ValueError as error:
        raise from_value_error(error) from None
    return _Choices(offset, first, stream)


async def collect_choices(streams: list[_Choices]) -> dict[int, list[ChoiceDelta]]:
    """Every choice's deltas by its index in the response (each stream's choices start at its offset)."""
    collected: dict[int, list[ChoiceDelta]] = {}
    try:
        for choices in streams:
            while (delta := await choices.next()) is not None:
                collected.setdefault(choices.offset + delta.index, []).append(delta)
    finally:
        # Cancelled (the client hung up) while reading one stream: every engine request is aborted now.
        for choices in streams:
            await choices.stream.aclose()
    return collected


def _whole_response(
    response_id: str, kind: str, created: int, served: str, choices: list, usage: Usage, **extra
) -> JSONResponse:
    return JSONResponse(
        {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": served,
            "choices": choices,
            "usage": _usage_json(usage),
            **extra,
        }
    )


# -- completions -----------------------------------------------------------------------------------


async def completions(
    body: CompletionRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    label: str | None = None,
    on_stream_end: Callable[[], None] = _nothing,
    lora: LoRARequest | None = None,
):
    """`request_id` is the server's own id for the engine; `label` (the client's X-Request-Id) names the response;
    `on_stream_end` runs once a streamed response's last event was sent (or its client left); `lora`: the adapter
    the request's `model` named (`served` is then its name)."""
    check_model(body.model, served)
    prompts = body.prompt_list()
    keep = _truncation(body)
    whole = [encode_prompt(tokenizer, prompt, engine.vocab_size) for prompt in prompts]
    encoded = [truncate_prompt(ids, keep, engine.max_model_len) for ids in whole]
    created = int(time.time())
    completion_id = f"cmpl-{label or request_id}"
    engine_id = f"cmpl-{request_id}"
    if body.use_beam_search:
        usage = Usage()
        beams = await beam_choices(engine, tokenizer, body, encoded, engine_id, usage, lora)
        width = body.n or 1
        choices = [
            {"index": number * width + rank, "text": beam.text, "logprobs": None, "finish_reason": beam.finish_reason}
            for number, group in enumerate(beams)
            for rank, beam in enumerate(group)
        ]
        return _whole_response(completion_id, "text_completion", created, served, choices, usage)
    n = body.n or 1
    # best_of > n: best_of choices run (their logprobs kept to rank them), the best n are answered.
    best_of = body.best_of if body.best_of is not None and body.best_of > n else None
    params = [_sampling(body, engine, len(ids), tokenizer) for ids in encoded]
    if best_of is not None:
        logprobs = params[0].logprobs if params[0].logprobs is not None else 0
        params = [dataclasses.replace(sp, n=best_of, logprobs=logprobs) for sp in params]
    if params:  # every prompt has the same constraint
        await check_output_constraint(params[0], tokenizer, engine.vocab_size, body.output_constraint()[1])
    annotate_request(trace.get_current_span(), completion_id, body.model or served, params[0] if params else None)
    usage = Usage()
    streams = []
    for number, (ids, sp) in enumerate(zip(encoded, params, strict=True)):
        stream = stream_choices(
            engine, tokenizer, f"{engine_id}-{number}", ids, sp, usage, lora, body.priority or 0, body.tier
        )
        streams.append(await _started(number * sp.n, stream))
    # With echo, each prompt's text (and its scored tokens) comes first in each of its choices.
    echoes = None
    if body.echo:
        # A truncated prompt is echoed as what the model read: its kept tokens.
        shown = [p if len(ids) == len(w) else ids for p, ids, w in zip(prompts, encoded, whole, strict=True)]
        echoes = [Echo.of(tokenizer, p, ids, body.max_tokens == 0) for p, ids in zip(shown, encoded, strict=True)]
    wants_logprobs = body.logprobs is not None

    if body.stream:
        chunks = ChunkEvents(completion_id, "text_completion", created, served)

        async def events() -> AsyncIterator[str]:
            try:
                for number, choices in enumerate(streams):
                    echo = echoes[number] if echoes is not None else None
                    echoed: set[int] = set()
                    while (delta := await choices.next()) is not None:
                        text, leading = delta.text, []
                        if echo is not None:
                            shown = echo.output(delta)
                            usage.completion_tokens -= len(delta.token_ids) - len(shown.token_ids)
                            text = shown.text
                            if delta.index not in echoed:  # a choice's first chunk starts with the prompt
                                echoed.add(delta.index)
                                text = echo.text + text
                                leading = echo.entries(tokenizer, delta) if wants_logprobs else []
                            delta = shown
                        logprobs = completion_logprobs(tokenizer, [delta], leading) if wants_logprobs else None
                        index = choices.offset + delta.index
                        yield chunks.text_choice(index, text, logprobs, delta.finish_reason)
                if body.include_usage():
                    yield chunks.event([], usage=_usage_json(usage))
                yield "data: [DONE]\n\n"
            finally:
                # A client that hung up mid-stream: every prompt's engine requests are aborted now, not when the
                # streams are collected.
                for choices in streams:
                    await choices.stream.aclose()
                on_stream_end()

        return StreamingResponse(events(), media_type="text/event-stream")

    collected = await collect_choices(streams)
    if best_of is not None:
        collected = _best_n(collected, best_of, n)
    choices = []
    for index in sorted(collected):
        deltas = collected[index]
        first = deltas[0]
        echo = echoes[index // n] if echoes is not None else None
        text, leading = "", []
        if echo is not None:
            shown = [echo.output(delta) for delta in deltas]
            usage.completion_tokens -= sum(len(d.token_ids) for d in deltas) - sum(len(d.token_ids) for d in shown)
            text, deltas = echo.text, shown
            leading = echo.entries(tokenizer, first) if wants_logprobs else []
        choice = {
            "index": index,
            "text": text + "".join(d.text for d in deltas),
            "logprobs": completion_logprobs(tokenizer, deltas, leading) if wants_logprobs else None,
            "finish_reason": deltas[-1].finish_reason,
        }
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer, encoded[index // n], first.prompt_logprobs)
        choices.append(choice)
    return _whole_response(completion_id, "text_completion", created, served, choices, usage)


def _best_n(collected: dict[int, list[ChoiceDelta]], best_of: int, n: int) -> dict[int, list[ChoiceDelta]]:
    """Of each prompt's best_of choices, the n whose tokens have the highest summed logprob, best first, indexed as
    the response numbers them (prompt × n + rank)."""
    kept = {}
    for number in range(max(collected, default=-1) // best_of + 1):
        group = [collected[i] for i in range(number * best_of, (number + 1) * best_of) if i in collected]
        group.sort(key=lambda deltas: -sum(logprob for delta in deltas for logprob in delta.logprobs))
        for rank, deltas in enumerate(group[:n]):
            kept[number * n + rank] = [dataclasses.replace(delta, index=rank) for delta in deltas]
    return kept


# -- chat ------------------------------------------------------------------------------------------


def _chat_logprobs(tokenizer, deltas: list[ChoiceDelta]) -> dict:
    content = []
    for delta in deltas:
        for text, logprob, top in logprob_entries(tokenizer, delta):
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
                }
            )
    return {"content": content}


@dataclass
class ChatRun:
    """A chat request under way: its choices' stream (first delta pulled), each choice's tool-call reader, the
    usage counted as the choices run, and the rendered prompt."""

    stream: _Choices
    output: Callable[[int], ChoiceOutput]
    usage: Usage
    prompt_ids: list[int]

    async def whole_message(self) -> tuple[dict, str | None]:
        """The single choice's whole assistant message (tool calls read out) and its finish reason."""
        deltas = (await collect_choices([self.stream])).get(0, [])
        out = self.output(0)
        message = out.message("".join(delta.text for delta in deltas))
        return message, out.finish_reason(deltas[-1].finish_reason if deltas else "stop")


async def start_chat(
    body: ChatCompletionRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    response_id: str,
    tool_call_parser: str | None = None,
    lora: LoRARequest | None = None,
) -> ChatRun:
    """Render the conversation, check the settings and start its choices: the chat path every chat-shaped API
    (OpenAI's chat completions, Anthropic's messages) formats its answer from."""
    check_model(body.model, served)
    prompt_ids = render_chat(tokenizer, body.messages, body.tool_dicts())
    prompt_ids = truncate_prompt(prompt_ids, _truncation(body), engine.max_model_len)
    params = _sampling(body, engine, len(prompt_ids), tokenizer)
    await check_output_constraint(params, tokenizer, engine.vocab_size, body.output_constraint()[1], body.tools)
    tool_choice = body.tool_choice_in_effect()
    call_format = choose_parser(getattr(tokenizer, "chat_template", None), tool_call_parser)
    outputs: dict[int, ChoiceOutput] = {}

    def output(index: int) -> ChoiceOutput:
        """Each choice reads its own tool calls out of its own text."""
        if index not in outputs:
            parallel = body.parallel_tool_calls is not False
            outputs[index] = ChoiceOutput(output_parser(tool_choice, call_format, parallel))
        return outputs[index]

    annotate_request(trace.get_current_span(), response_id, body.model or served, params)
    usage = Usage()
    stream = await _started(
        0,
        stream_choices(
            engine, tokenizer, f"chatcmpl-{request_id}", prompt_ids, params, usage, lora, body.priority or 0, body.tier
        ),
    )
    return ChatRun(stream, output, usage, prompt_ids)


async def chat_completions(
    body: ChatCompletionRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    label: str | None = None,
    tool_call_parser: str | None = None,
    on_stream_end: Callable[[], None] = _nothing,
    lora: LoRARequest | None = None,
):
    """`request_id` is the server's own id for the engine; `label` (the client's X-Request-Id) names the response;
    `tool_call_parser` names the model's tool-call format (None: the one its chat template teaches);
    `on_stream_end` runs once a streamed response's last event was sent (or its client left); `lora`: the adapter
    the request's `model` named."""
    created = int(time.time())
    chat_id = f"chatcmpl-{label or request_id}"
    if body.use_beam_search:
        check_model(body.model, served)
        prompt_ids = render_chat(tokenizer, body.messages, None)
        prompt_ids = truncate_prompt(prompt_ids, _truncation(body), engine.max_model_len)
        usage = Usage()
        (beams,) = await beam_choices(engine, tokenizer, body, [prompt_ids], f"chatcmpl-{request_id}", usage, lora)
        choices = [
            {
                "index": rank,
                "message": {"role": "assistant", "content": beam.text},
                "logprobs": None,
                "finish_reason": beam.finish_reason,
            }
            for rank, beam in enumerate(beams)
        ]
        return _whole_response(chat_id, "chat.completion", created, served, choices, usage)
    run = await start_chat(body, engine, tokenizer, served, request_id, chat_id, tool_call_parser, lora)
    stream, output, usage, prompt_ids = run.stream, run.output, run.usage, run.prompt_ids

    if body.stream:
        chunks = ChunkEvents(chat_id, "chat.completion.chunk", created, served)

        async def events() -> AsyncIterator[str]:
            try:
                started: set[int] = set()
                while (delta := await stream.next()) is not None:
                    if delta.index not in started:
                        started.add(delta.index)
                        yield chunks.delta_choice(delta.index, output(delta.index).opening(), None, None)
                    out = output(delta.index)
                    # Content, or a tool call's start and its argument pieces, one chunk each; an empty delta when the
                    # text is held (a tag arriving in pieces) still carries its logprobs and finish_reason.
                    pieces = out.deltas(delta.text, final=delta.finish_reason is not None) or [{}]
                    logprobs = _chat_logprobs(tokenizer, [delta]) if body.wants_logprobs() else None
                    for number, piece in enumerate(pieces):
                        last = number == len(pieces) - 1
                        yield chunks.delta_choice(
                            delta.index,
                            piece,
                            logprobs if number == 0 else None,
                            out.finish_reason(delta.finish_reason) if last else None,
                        )
                if body.include_usage():
                    yield chunks.event([], usage=_usage_json(usage))
                yield "data: [DONE]\n\n"
            finally:
                await stream.stream.aclose()  # a client that hung up: its engine requests are aborted now
                on_stream_end()

        return StreamingResponse(events(), media_type="text/event-stream")

    collected = await collect_choices([stream])
    choices = []
    for index in sorted(collected):
        deltas = collected[index]
        out = output(index)
        choices.append(
            {
                "index": index,
                "message": out.message("".join(d.text for d in deltas)),
                "logprobs": _chat_logprobs(tokenizer, deltas) if body.wants_logprobs() else None,
                "finish_reason": out.finish_reason(deltas[-1].finish_reason),
            }
        )
    extra = {}
    if body.prompt_logprobs is not None and collected:  # vLLM's: once per response, the prompt is the choices'
        scored = collected[min(collected)][0].prompt_logprobs
        extra["prompt_logprobs"] = prompt_logprobs_json(tokenizer, prompt_ids, scored)
    return _whole_response(chat_id, "chat.completion", created, served, choices, usage, **extra)
