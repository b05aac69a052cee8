"""Runs `pagerail serve` as a user would, in its own process session, and waits for its ready line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

_READY = re.compile(r"ready in .*OpenAI API (http://\S+)/v1, gRPC (\S+),")


def start_serve(*args: str) -> subprocess.Popen:
    """`pagerail serve --port 0 --grpc-port 0 *args`; its own session, so SIGTERM reaches the server only."""
    pagerail = Path(sys.executable).parent / "pagerail"
    return subprocess.Popen(
        [str(pagerail), "serve", "--port", "0", "--grpc-port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_ready(process: subprocess.Popen, lines: list[str]) -> tuple[str, str]:
    """The HTTP base URL and gRPC target from the ready line; every line read is appended to `lines`.

    Fails with the last lines of output when the server exits first. The caller bounds the wait with a timeout.
    """
    for line in process.stdout:
        lines.append(line)
        match = _READY.search(line)
        if match:
            return match.group(1), match.group(2)
    raise AssertionError("pagerail serve exited before it was ready:\n" + "".join(lines[-30:]))
