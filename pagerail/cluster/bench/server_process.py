"""An OpenAI-compatible server (pagerail or another engine) run as a child process for a benchmark: started on a
free port, awaited until it lists its models, and stopped with its whole process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pagerail_serve_command(python: str, model_dir: str | Path, port: int, *flags: str) -> list[str]:
    """`pagerail serve` through the given interpreter, on `port` with any free gRPC port."""
    command = [python, "-m", "pagerail.cluster.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    return [*command, "--grpc-port", "0", *flags]


class ServerProcess:
    """`with ServerProcess(command, base_url, log) as server:` runs the server for the block's duration.

    Its output goes to `log_path`, which is where to look when it fails to start. It runs in a session of its
    own, so stopping it reaches every process it started (engine cores, Ray workers) and nothing else.
    """

    def __init__(
        self,
        command: Sequence[str],
        base_url: str,
        log_path: str | Path,
        *,
        ready_timeout_s: float = 600.0,
        stop_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.base_url = base_url.rstrip("/")
        self.log_path = Path(log_path)
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        try:
            self._wait_until_serving(started)
        except BaseException:
            self.stop()
            raise

    def _wait_until_serving(self, started: float) -> None:
        url = f"{self.base_url}/v1/models"
        while time.monotonic() - started < self.ready_timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.command[0]} exited with {self.process.returncode} before serving; "
                    f"last output ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(1.0)
        raise TimeoutError(f"no answer at {url} after {self.ready_timeout_s:g}s; last output:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics_text(self) -> str:
        """The server's Prometheus exposition."""
        response = httpx.get(f"{self.base_url}/metrics", timeout=30.0)
        response.raise_for_status()
        return response.text

    def stop(self) -> None:
        """SIGTERM to the server (a graceful drain), then SIGKILL to whatever is left of its process group."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            # Whatever the server left behind in its session (a child that ignored the drain) goes too.
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)
