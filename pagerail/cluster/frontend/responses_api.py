"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) on the chat path.

A request's `instructions` and `input` (text, or messages and function-call items) become the chat request they
mean; with `previous_response_id` the stored conversation comes first, so a continuation sends only its new turn
and finds the earlier turns in the prefix cache. Answers are Response objects (a message item with output_text,
function_call items, usage), whole or as the streamed events the openai SDK reads. Responses are kept (`store`,
on by default) in a bounded store, evicted by age and by count. A `background` response answers at once (status
in_progress) and runs on; GET polls it, and cancelling it aborts its engine request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.core.engine_request import MAX_PRIORITY, MIN_PRIORITY
from pagerail.cluster.frontend.errors import APIError, bad_request, from_validation_error
from pagerail.cluster.frontend.openai_routes import ChatRun, start_chat
from pagerail.cluster.frontend.protocol import ChatCompletionRequest, LenientModel
from pagerail.common.lora import LoRARequest

# How many responses the store keeps, and for how long (seconds), whichever ends first.
STORE_MAX_RESPONSES = 1000
STORE_MAX_AGE_S = 3600.0


class TextFormat(LenientModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextSettings(LenientModel):
    format: TextFormat | None = None


class ResponsesRequest(LenientModel):
    """POST /v1/responses, as the openai SDK sends it."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: TextSettings | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # As on chat completions: the scheduling priority (vLLM's) and OpenAI's service tier ("flex": batch work).
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    service_tier: Literal["auto", "default", "flex"] | None = None


@dataclass
class StoredResponse:
    """A kept response: what it answered, and the whole conversation up to and including its own output."""

    body: dict[str, Any]
    messages: list[dict[str, Any]] | None  # None while a background response runs
    stored_at: float


class ResponseStore:
    """Responses by id, oldest first; bounded by count and by age (an expired one is gone at its next look-up)."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_age_s: float = STORE_MAX_AGE_S) -> None:
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._running: dict[str, asyncio.Task] = {}  # background responses under way

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._kept[response_id] = StoredResponse(body, messages, time.monotonic())
        while len(self._kept) > self.max_responses:
            self._kept.popitem(last=False)

    def run_in_background(self, response_id: str, task: asyncio.Task) -> None:
        self._running[response_id] = task
        task.add_done_callback(lambda _: self._running.pop(response_id, None))

    def cancel(self, response_id: str) -> StoredResponse:
        """Cancel a background response under way (its engine request is aborted); 404 for an unknown id, 400 for
        one that is not running."""
        kept = self.get(response_id)
        if kept is None:
            raise not_found_response(response_id)
        task = self._running.pop(response_id, None)
        if task is None:
            raise bad_request(
                f"response {response_id!r} is {kept.body['status']}: only one running in the background can be",
                "response_id",
            )
        task.cancel()
        kept.body["status"] = "cancelled"
        return kept

    def get(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is not None and time.monotonic() - kept.stored_at > self.max_age_s:
            del self._kept[response_id]
            return None
        return kept


def not_found_response(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response with id {response_id!r} is stored here", param=param, code="not_found")


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its input_text / output_text / text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for number, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}[{number}] is a {kind!r} part; only text is supported", f"{where}[{number}]")
        text = part.get("text")
        if text is not None and not isinstance(text, str):
            raise bad_request(f"{where}[{number}].text must be a string", f"{where}[{number}].text")
        texts.append(text or "")
    return "".join(texts)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of the request's own input (instructions not included)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for number, item in enumerate(body.input):
        where = f"input[{number}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}", f"{where}.role"
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": item.get("call_id"), "type": "function", "function": call}],
                }
            )
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))}
            )
        else:
            raise bad_request(
                f"{where} is a {kind!r} item; message, function_call and function_call_output are supported", where
            )
    return messages


def chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completions request `body` means for `conversation` (the stored turns and this request's input);
    APIError (400) naming the field. Instructions hold for this response only: they lead, and are not kept."""
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    chat: dict[str, Any] = {"messages": messages, "parallel_tool_calls": body.parallel_tool_calls is not False}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "priority", "service_tier"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools:
        tools = []
        for number, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise bad_request(
                    f"tools[{number}] is a {tool.get('type')!r} tool; only function tools run here",
                    f"tools[{number}].type",
                )
            function = {
                "name": tool.get("name"),
                "description": tool.get("description") or "",
                "parameters": tool.get("parameters") or {},
            }
            tools.append({"type": "function", "function": function})
        chat["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        schema = {"name": text_format.name or "output", "schema": text_format.schema_ or {}}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format is not None and text_format.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:
        raise from_validation_error(error) from None


def _output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat assistant message as Responses output items: a message with output_text, then function calls."""
    items: list[dict[str, Any]] = []
    if message.get("content") is not None and (message["content"] or not message.get("tool_calls")):
        text = {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": status,
                "role": "assistant",
                "content": [text],
            }
        )
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    return items


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _response(response_id: str, body: ResponsesRequest, served: str, created: float, **fields) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": served,
        "status": "in_progress",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "text": {"format": {"type": "text"}},
        "metadata": body.metadata or {},
        "store": body.store is not False,
        "usage": None,
        **fields,
    }


@dataclass
class ResponseTurn:
    """One response being made: its id, the conversation it answers (stored turns first), and the chat request."""

    body: ResponsesRequest
    served: str
    store: ResponseStore | None
    conversation: list[dict[str, Any]]
    chat: ChatCompletionRequest
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: float = field(default_factory=time.time)

    @classmethod
    def begin(cls, body: ResponsesRequest, served: str, store: ResponseStore | None) -> ResponseTurn:
        """The turn `body` asks for; APIError (404) for an unknown previous_response_id, (400) for bad input."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id) if store is not None else None
            if previous is None:
                raise not_found_response(body.previous_response_id, "previous_response_id")
            if previous.messages is None:
                raise bad_request(
                    f"response {body.previous_response_id!r} is still in progress", "previous_response_id"
                )
            history = previous.messages
        conversation = [*history, *input_messages(body)]
        chat = chat_request(body, conversation)
        if body.model and body.model != served:
            chat.model = body.model  # the chat path answers 404 for another model, naming it
        return cls(body, served, store, conversation, chat)

    def response(self, **fields: Any) -> dict[str, Any]:
        return _response(self.response_id, self.body, self.served, self.created, **fields)

    def finished(self, run: ChatRun, message: dict[str, Any], reason: str | None) -> dict[str, Any]:
        """The finished Response object for the assistant's `message`, stored unless the request said not to."""
        incomplete = reason == "length"
        status = "incomplete" if incomplete else "completed"
        answer = self.response(status=status, output=_output_items(message, status))
        answer["usage"] = _usage(run.usage.prompt_tokens, run.usage.completion_tokens, run.usage.cached_tokens)
        if incomplete:
            answer["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.store is not None and self.body.store is not False:
            turn = {
                "role": "assistant",
                "content": message.get("content"),
                **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {}),
            }
            self.store.put(self.response_id, answer, [*self.conversation, turn])
        return answer


async def respond_whole(
    body: ResponsesRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    tool_call_parser: str | None = None,
    store: ResponseStore | None = None,
    lora: LoRARequest | None = None,
) -> dict[str, Any]:
    """The finished Response object for `body` (neither streamed nor in the background)."""
    turn = ResponseTurn.begin(body, served, store)
    run = await start_chat(turn.chat, engine, tokenizer, served, request_id, turn.response_id, tool_call_parser, lora)
    message, reason = await run.whole_message()
    return turn.finished(run, message, reason)


async def responses(
    body: ResponsesRequest,
    engine: EngineClient,
    tokenizer,
    served: str,
    request_id: str,
    label: str | None = None,
    tool_call_parser: str | None = None,
    store: ResponseStore | None = None,
    on_stream_end: Callable[[], None] = lambda: None,
    lora: LoRARequest | None = None,
):
    """`request_id` is the server's own id for the engine; `store` keeps stored responses between requests; `lora`:
    the adapter the request's `model` named."""
    if not body.background and not body.stream:
        answer = await respond_whole(body, engine, tokenizer, served, request_id, tool_call_parser, store, lora)
        return JSONResponse(answer)
    turn = ResponseTurn.begin(body, served, store)
    chat, response_id = turn.chat, turn.response_id
    finished = turn.finished

    if body.background:
        if body.stream or body.store is False or store is None:
            raise bad_request("a background response is stored and polled: leave stream and store out", "background")
        queued = turn.response(status="queued", background=True)
        store.put(response_id, queued, None)

        async def run_on() -> None:
            # Queued until the engine admits it; what the engine refuses (or a failure later) makes it "failed".
            try:
                run = await start_chat(chat, engine, tokenizer, served, request_id, response_id, tool_call_parser, lora)
                queued["status"] = "in_progress"
                message, reason = await run.whole_message()
                finished(run, message, reason)["background"] = True
            except asyncio.CancelledError:
                raise
            except Exception as error:
                message = getattr(error, "message", None) or str(error)
                queued.update(status="failed", error={"code": "server_error", "message": message})

        store.run_in_background(response_id, asyncio.get_running_loop().create_task(run_on()))
        return JSONResponse(queued)

    run = await start_chat(chat, engine, tokenizer, served, request_id, response_id, tool_call_parser, lora)
    out = run.output(0)

    if body.stream:

        async def events() -> AsyncIterator[str]:
            number = 0

            def event(kind: str, **payload: Any) -> str:
                nonlocal number
                number += 1
                return (
                    f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number - 1, **payload})}\n\n"
                )

            try:
                started = turn.response()
                yield event("response.created", response=started)
                yield event("response.in_progress", response=started)
                content, reason, message_id, text_open = "", None, f"msg_{uuid.uuid4().hex}", False
                output_index = -1
                calls: dict[int, dict[str, Any]] = {}
                while (delta := await run.stream.next()) is not None:
                    for piece in out.deltas(delta.text, final=delta.finish_reason is not None):
                        content += piece.get("content") or ""
                        if piece.get("content"):
                            if not text_open:
                                output_index += 1
                                text_open = True
                                item = {
                                    "type": "message",
                                    "id": message_id,
                                    "status": "in_progress",
                                    "role": "assistant",
                                    "content": [],
                                }
                                yield event("response.output_item.added", output_index=output_index, item=item)
                                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                                yield event(
                                    "response.content_part.added",
                                    item_id=message_id,
                                    output_index=output_index,
                                    content_index=0,
                                    part=part,
                                )
                            yield event(
                                "response.output_text.delta",
                                item_id=message_id,
                                output_index=output_index,
                                content_index=0,
                                delta=piece["content"],
                                logprobs=[],
                            )
                        for call in piece.get("tool_calls") or ():
                            function = call.get("function", {})
                            if "id" in call:
                                output_index += 1
                                item = {
                                    "type": "function_call",
                                    "id": f"fc_{uuid.uuid4().hex}",
                                    "call_id": call["id"],
                                    "name": function["name"],
                                    "arguments": "",
                                    "status": "in_progress",
                                }
                                calls[call["index"]] = {**item, "output_index": output_index}
                                yield event("response.output_item.added", output_index=output_index, item=item)
                            if function.get("arguments"):
                                open_call = calls[call["index"]]
                                open_call["arguments"] += function["arguments"]
                                yield event(
                                    "response.function_call_arguments.delta",
                                    item_id=open_call["id"],
                                    output_index=open_call["output_index"],
                                    delta=function["arguments"],
                                )
                    if delta.finish_reason is not None:
                        reason = out.finish_reason(delta.finish_reason)
                # The whole message, from the pieces streamed (the parser has read the text once, as it came).
                message: dict[str, Any] = {"role": "assistant", "content": content if text_open or not calls else None}
                if calls:
                    message["tool_calls"] = [
                        {
                            "id": c["call_id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in calls.values()
                    ]
                answer = finished(run, message, reason)
                # The items as the whole answer has them, under the ids the stream announced.
                items = answer["output"]
                for item in items:
                    if item["type"] == "message":
                        item["id"] = message_id
                        content = item["content"][0]
                        done = {"item_id": message_id, "output_index": 0, "content_index": 0}
                        yield event("response.output_text.done", **done, text=content["text"], logprobs=[])
                        yield event("response.content_part.done", **done, part=content)
                    else:
                        announced = next((c for c in calls.values() if c["call_id"] == item["call_id"]), None)
                        if announced is not None:
                            item["id"] = announced["id"]
                            args = {"item_id": item["id"], "output_index": announced["output_index"]}
                            yield event(
                                "response.function_call_arguments.done",
                                **args,
                                arguments=item["arguments"],
                                name=item["name"],
                            )
                for index, item in enumerate(items):
                    yield event("response.output_item.done", output_index=index, item=item)
                kind = "response.incomplete" if answer["status"] == "incomplete" else "response.completed"
                yield event(kind, response=answer)
            finally:
                await run.stream.stream.aclose()  # a client that hung up: its engine request is aborted now
                on_stream_end()

    return StreamingResponse(events(), media_type="text/event-stream")
