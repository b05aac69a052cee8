"""`pagerail serve` with no model arguments, as a new user runs it: answers a chat request, drains on SIGTERM."""

from __future__ import annotations

import os
import signal

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
