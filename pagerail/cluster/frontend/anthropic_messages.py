"""Anthropic's Messages API (`POST /v1/messages`), whole and streamed, on the chat path.

A request is read into the chat request it means (system prompt, turns with text, tool_use and tool_result
blocks, tools with input schemas, tool_choice, stop_sequences) and runs as one; the answer is written in
Anthropic's shapes: content blocks (text, tool_use), stop_reason, usage, and the streamed events the anthropic
SDK assembles (message_start, content_block_start / _delta / _stop, message_delta, message_stop).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.core.engine_request import MAX_PRIORITY, MIN_PRIORITY
from pagerail.cluster.frontend.errors import bad_request, from_validation_error
from pagerail.cluster.frontend.openai_routes import start_chat
from pagerail.cluster.frontend.protocol import ChatCompletionRequest, LenientModel
from pagerail.common.lora import LoRARequest

# Chat finish reasons as Anthropic names them.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class Block(LenientModel):
    """A content block of a turn: text, tool_use (an assistant's call) or tool_result (a user's answer to one)."""

    type: Literal["text", "tool_use", "tool_result", "image", "document", "thinking"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None


class Turn(LenientModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(LenientModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(LenientModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(LenientModel):
    """POST /v1/messages, as the anthropic SDK sends it."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Turn] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's scheduling priority, as an extra field (Anthropic's own service_tier means something else).
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)


def _text_of(content: str | list[Block] | list[dict] | None, field: str) -> str:
    """The text of a string or of text blocks; other blocks here are refused by name."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for block in content:
        kind = block.type if isinstance(block, Block) else block.get("type")
        if kind != "text":
            raise bad_request(f"{field} holds a {kind!r} block; only text is supported there", field)
        text = block.text if isinstance(block, Block) else block.get("text")
        if text is not None and not isinstance(text, str):
            raise bad_request(f"{field} holds a text block whose text is not a string", field)
        texts.append(text or "")
    return "".join(texts)


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completions request `body` means; raises APIError (400) naming the field it cannot read."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for number, turn in enumerate(body.messages):
        where = f"messages[{number}].content"
        if isinstance(turn.content, str):
            messages.append({"role": turn.role, "content": turn.content})
            continue
        texts, calls = [], []
        for block in turn.content:
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use" and turn.role == "assistant":
                arguments = json.dumps(block.input or {})
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
                )
            elif block.type == "tool_result" and turn.role == "user":
                answer = _text_of(block.content, where)
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": answer})
            else:
                raise bad_request(
                    f"{where} holds a {block.type!r} block, which a {turn.role} turn cannot carry here", where
                )
        if texts or calls:
            message: dict[str, Any] = {"role": turn.role, "content": "".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens}
    for name in ("temperature", "top_p", "top_k", "priority"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:
        raise from_validation_error(error) from None


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def _content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat assistant message as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = {}  # a call cut short (stop_reason max_tokens): its arguments never closed
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments})
    return blocks


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


async def messages(
    body: MessagesRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    label: str | None = None,
    tool_call_parser: str | None = None,
    on_stream_end: Callable[[], None] = lambda: None,
    lora: LoRARequest | None = None,
):
    """`request_id` is the server's own id for the engine; `label` (the client's X-Request-Id) names the message;
    `lora`: the adapter the request's `model` named."""
    chat = chat_request(body)
    message_id = f"msg_{label or uuid.uuid4().hex}"
    # The model named in the request is Anthropic's to check (an alias); this server answers with its own.
    chat.model = None
    run = await start_chat(chat, engine, tokenizer, served, request_id, message_id, tool_call_parser, lora)
    out = run.output(0)
    opening = {"id": message_id, "type": "message", "role": "assistant", "model": served, "content": []}

    if body.stream:

        async def events() -> AsyncIterator[str]:
            try:
                start = {**opening, "stop_reason": None, "stop_sequence": None}
                yield _event("message_start", {"message": {**start, "usage": _usage(len(run.prompt_ids), 0)}})
                index, open_kind, reason = -1, None, None
                while (delta := await run.stream.next()) is not None:
                    for piece in out.deltas(delta.text, final=delta.finish_reason is not None):
                        if piece.get("content"):
                            if open_kind != "text":
                                if open_kind is not None:
                                    yield _event("content_block_stop", {"index": index})
                                index, open_kind = index + 1, "text"
                                block = {"type": "text", "text": ""}
                                yield _event("content_block_start", {"index": index, "content_block": block})
                            text_delta = {"type": "text_delta", "text": piece["content"]}
                            yield _event("content_block_delta", {"index": index, "delta": text_delta})
                        for call in piece.get("tool_calls") or ():
                            function = call.get("function", {})
                            if "id" in call:  # a new call: its own block
                                if open_kind is not None:
                                    yield _event("content_block_stop", {"index": index})
                                index, open_kind = index + 1, "tool_use"
                                block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
                                yield _event("content_block_start", {"index": index, "content_block": block})
                            if function.get("arguments"):
                                json_delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
                                yield _event("content_block_delta", {"index": index, "delta": json_delta})
                    if delta.finish_reason is not None:
                        reason = out.finish_reason(delta.finish_reason)
                if open_kind is not None:
                    yield _event("content_block_stop", {"index": index})
                stop = {"stop_reason": _STOP_REASONS.get(reason, "end_turn"), "stop_sequence": None}
                yield _event("message_delta", {"delta": stop, "usage": {"output_tokens": run.usage.completion_tokens}})
                yield _event("message_stop", {})
            finally:
                await run.stream.stream.aclose()  # a client that hung up: its engine request is aborted now
                on_stream_end()

        return StreamingResponse(events(), media_type="text/event-stream")

    message, reason = await run.whole_message()
    return JSONResponse(
        {
            **opening,
            "content": _content_blocks(message),
            "stop_reason": _STOP_REASONS.get(reason, "end_turn"),
            "stop_sequence": None,
            "usage": _usage(run.usage.prompt_tokens, run.usage.completion_tokens),
        }
    )
