"""`pagerail serve` with no model arguments, as a new user runs it: answers a chat request, drains on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.slow


def test_serve_answers_chat_then_drains_on_sigterm():
    pagerail = Path(sys.executable).parent / "pagerail"
    command = [str(pagerail), "serve", "--port", "0", "--grpc-port", "0"]
    # Its own session, as under a process supervisor: SIGTERM reaches the server process only.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"ready in .*OpenAI API (http://\S+/v1)", line)
            url = match.group(1).rstrip(",") if match else None
        assert url, "".join(lines[-30:])
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
