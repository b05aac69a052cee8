"""The Responses API on gRPC: a ResponseRequest message to the HTTP API's request model, a Response object back to
its message; the response itself is made by responses_api, the same as over HTTP."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagerail.cluster.frontend.errors import from_validation_error
from pagerail.cluster.frontend.responses_api import ResponsesRequest
from pagerail.proto import api_pb2

_TOOL_CHOICE_MODES = ("", "auto", "none", "required")


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} must be JSON text: {error}") from None


def _input_item(item: api_pb2.ResponseItem, where: str) -> dict[str, Any]:
    kind = item.WhichOneof("item")
    if kind == "message":
        return {"type": "message", "role": item.message.role, "content": item.message.text}
    if kind == "function_call":
        call = item.function_call
        return {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    if kind == "function_call_output":
        result = item.function_call_output
        return {"type": "function_call_output", "call_id": result.call_id, "output": result.output}
    raise ValueError(f"{where}: set message, function_call or function_call_output")


def responses_request(message: api_pb2.ResponseRequest) -> ResponsesRequest:
    """The HTTP API's request for the same response; ValueError naming the field for bad input."""
    if message.input_text and message.input:
        raise ValueError("input: set input_text or input items, not both")
    body: dict[str, Any] = {
        "input": message.input_text
        if not message.input
        else [_input_item(item, f"input[{number}]") for number, item in enumerate(message.input)],
        "metadata": dict(message.metadata) or None,
    }
    for name in ("model", "instructions", "previous_response_id"):
        if getattr(message, name):
            body[name] = getattr(message, name)
    for name in ("max_output_tokens", "temperature", "top_p", "parallel_tool_calls", "store", "priority"):
        if message.HasField(name):
            body[name] = getattr(message, name)
    if message.service_tier:
        body["service_tier"] = message.service_tier
    if message.tools:
        body["tools"] = [
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description,
                "parameters": _json(tool.parameters, f"tools[{number}].parameters") if tool.parameters else {},
            }
            for number, tool in enumerate(message.tools)
        ]
    if message.tool_choice not in _TOOL_CHOICE_MODES:
        body["tool_choice"] = {"type": "function", "name": message.tool_choice}
    elif message.tool_choice:
        body["tool_choice"] = message.tool_choice
    if message.json_schema:
        schema = _json(message.json_schema, "json_schema")
        body["text"] = {"format": {"type": "json_schema", "name": "output", "schema": schema}}
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as error:
        raise ValueError(from_validation_error(error).message) from None


def response_message(answer: dict[str, Any]) -> api_pb2.Response:
    """A Response object (as the HTTP API answers it) as the gRPC message."""
    output, texts = [], []
    for item in answer.get("output") or ():
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            texts.append(text)
            output.append(api_pb2.ResponseItem(message=api_pb2.ResponseMessage(role=item["role"], text=text)))
        elif item["type"] == "function_call":
            call = api_pb2.FunctionCall(call_id=item["call_id"], name=item["name"], arguments=item["arguments"])
            output.append(api_pb2.ResponseItem(function_call=call))
    usage = answer.get("usage")
    error = answer.get("error") or {}
    return api_pb2.Response(
        id=answer["id"],
        status=answer["status"],
        output=output,
        output_text="".join(texts),
        usage=api_pb2.Usage(
            prompt_tokens=usage["input_tokens"],
            completion_tokens=usage["output_tokens"],
            cached_tokens=usage["input_tokens_details"]["cached_tokens"],
        )
        if usage
        else None,
        previous_response_id=answer.get("previous_response_id") or "",
        created_at=answer["created_at"],
        model=answer["model"],
        error=error.get("message", ""),
    )
