"""Prompts to token ids: chat messages through the model's chat template, completion prompts checked."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from pagerail.cluster.frontend.errors import APIError, bad_request, from_validation_error
from pagerail.cluster.frontend.protocol import ChatMessage
from pagerail.cluster.frontend.tool_choice import MessageToolCall

# "developer" is OpenAI's newer name for the system role; templates only know "system".
_TEMPLATE_ROLE = {"developer": "system"}


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage | Mapping[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the conversation rendered by the chat template, ending where the assistant's reply begins.

    `tools` (OpenAI function tools) go to the template, which shows them to the model its own way.
    """
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "This model has no chat template, so /v1/chat/completions cannot format the conversation; "
            "use /v1/completions with a plain prompt",
            "messages",
        )
    conversation = [_template_message(index, message) for index, message in enumerate(messages)]
    try:
        # Rendering to text and encoding without extra special tokens keeps a template's own BOS from doubling.
        text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # templates raise whatever their Jinja code raises, e.g. on role order
        raise bad_request(f"messages could not be rendered by the chat template: {err}", "messages") from err
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("messages render to an empty prompt", "messages")
    return list(ids)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """Token ids of one completion prompt: a string is encoded, token ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return list(tokenizer.encode(prompt))
    ids = list(prompt)
    if not ids:
        raise bad_request("prompt must hold at least one token id", "prompt")
    for position, token_id in enumerate(ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise bad_request(
                f"prompt must hold token ids in [0, {vocab_size}), got {token_id!r} at position {position}", "prompt"
            )
    return ids


def _template_message(index: int, message: ChatMessage | Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, ChatMessage):
        try:
            message = ChatMessage.model_validate(message)
        except ValidationError as err:
            raise _at_index(from_validation_error(err), index) from err
    where = f"messages[{index}].content"
    content = message.content
    _check_tool_fields(index, message)
    if content is None:
        if message.role != "assistant":  # only an assistant turn (e.g. one that called a tool) may be empty
            raise bad_request(f"{where} is required for role {message.role!r}", where)
        content = ""
    elif not isinstance(content, str):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"{where} holds a {part.type!r} part; only text parts are supported", where)
            texts.append(part.text)
        content = "\n".join(texts)  # parts are separate blocks of text, as other servers render them
    rendered: dict[str, Any] = {"role": _TEMPLATE_ROLE.get(message.role, message.role), "content": content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.role == "tool":
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _check_tool_fields(index: int, message: ChatMessage) -> None:
    if message.tool_calls and message.role != "assistant":
        where = f"messages[{index}].tool_calls"
        raise bad_request(f"{where} is only allowed for role 'assistant', got {message.role!r}", where)
    if message.role == "tool" and not message.tool_call_id:
        where = f"messages[{index}].tool_call_id"
        raise bad_request(f"{where} is required for role 'tool' (the id of the call it answers)", where)


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    # Templates write the arguments out as JSON themselves (Qwen's `tojson`, Llama's), so they take an object; text
    # that is no JSON object (a call cut short) is passed as it was written.
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _at_index(err: APIError, index: int) -> APIError:
    """Place an error found in one message at its position in the request."""
    where = f"messages[{index}]"
    if err.param is None:
        return bad_request(f"{where} must be an object with a role and content", where)
    param = f"{where}.{err.param}"
    return bad_request(err.message.replace(err.param, param, 1), param)
