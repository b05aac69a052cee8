"""`pagerail serve` with no model arguments, as a new user runs it: answers chat, JSON-schema and tool-call requests,
drains on SIGTERM."""

from __future__ import annotations

import json
import os
import signal

import jsonschema
import openai
import pytest

from tests.serve_process import start_serve, wait_ready

pytestmark = pytest.mark.slow


def test_serve_answers_chat_then_drains_on_sigterm():
    process = start_serve()
    lines: list[str] = []
    try:
        base_url, _ = wait_ready(process, lines)
        url = base_url + "/v1"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
        # Constraints travel the whole served path (frontend actor, head actor, worker rank over gRPC).
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "maximum": 9}},
            "required": ["city", "rank"],
            "additionalProperties": False,
        }
        structured = client.chat.completions.create(
            model=reply.model,
            messages=[{"role": "user", "content": "Name a city as JSON."}],
            max_tokens=64,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        )
        jsonschema.validate(json.loads(structured.choices[0].message.content), schema)
        assert structured.choices[0].finish_reason == "stop"
        tool = {"type": "function", "function": {"name": "locate", "parameters": schema}}
        called = client.chat.completions.create(
            model=reply.model,
            messages=[{"role": "user", "content": "Where is Paris?"}],
            max_tokens=64,
            temperature=0,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "locate"}},
        )
        (call,) = called.choices[0].message.tool_calls
        assert call.function.name == "locate" and called.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), schema)
        # A request in flight when SIGTERM arrives still finishes; new ones are refused meanwhile.
        stream = client.completions.create(
            model=reply.model,
            prompt="Count:",
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        os.kill(process.pid, signal.SIGTERM)
        pieces = [first.choices[0].text] + [chunk.choices[0].text for chunk in stream]
        assert len(pieces) >= 40
        assert process.wait(timeout=120) == 0
        rest = process.stdout.read()
        assert "draining" in rest and "stopped" in rest, rest
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
