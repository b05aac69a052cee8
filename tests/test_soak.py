"""Soak: `pagerail serve` under concurrent streaming and whole-response clients with random cancels, reused
request ids, aborts from strangers and session churn; afterwards nothing runs, nothing waits, every block is
free and no process grew beyond a bound. One minute by default; `pytest --soak-minutes N` for long runs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import pytest

from pagerail.proto import api_pb2, api_pb2_grpc
from tests.serve_process import start_serve, wait_ready

pytestmark = pytest.mark.slow

CLIENTS = 8
ACTOR_NAMES = ("HeadActor", "WorkerActor", "FrontendActor")
# Allowed RSS growth of each engine process from after the warm-up to the end of the soak.
RSS_GROWTH_LIMIT_BYTES = 200 << 20
PROMPTS = ["Tell me about the sea.", "Write a haiku about rain.", "List three prime numbers:", "Say hello."]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def actor_rss(server_pid: int) -> dict[str, int]:
    """RSS in bytes of the head, worker and frontend actor processes, by role and pid."""
    rss = {}
    for pid in descendants(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        role = next((name for name in ACTOR_NAMES if f"ray::{name}" in cmdline), None)
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        if role and match:
            rss[f"{role}[{pid}]"] = int(match.group(1)) * 1024
    return rss


class Soak:
    """Random clients against one server; counts what they did and what they got back."""

    def __init__(self, http_url: str, grpc_target: str, seed: int) -> None:
        self.http_url = http_url
        self.grpc_target = grpc_target
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.unexpected: list[str] = []

    def body(self, stream: bool) -> dict:
        return {
            "model": "soak",
            "prompt": self.rng.choice(PROMPTS),
            "max_tokens": self.rng.randint(1, 24),
            "temperature": self.rng.choice([0.0, 0.8]),
            "stream": stream,
        }

    def headers(self) -> dict:
        # A handful of shared ids: other clients reuse them all the time.
        return {"X-Request-Id": f"shared-{self.rng.randint(0, 3)}"}

    async def http_stream(self, http: httpx.AsyncClient) -> None:
        cancel_after = self.rng.choice([None, None, 1, 3])
        async with http.stream("POST", "/v1/completions", json=self.body(True), headers=self.headers()) as response:
            if response.status_code != 200:
                self.record_status(response.status_code)
                return
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if cancel_after is not None and chunks >= cancel_after:
                        self.counts["cancelled"] += 1
                        return
        self.counts["completed"] += 1

    async def http_whole(self, http: httpx.AsyncClient) -> None:
        request = http.post("/v1/completions", json=self.body(False), headers=self.headers())
        if self.rng.random() < 0.3:
            try:  # the client gives up before the answer comes: a disconnect the server must notice
                await asyncio.wait_for(request, timeout=self.rng.uniform(0.05, 0.5))
            except TimeoutError:
                self.counts["cancelled"] += 1
                return
            self.counts["completed"] += 1
            return
        response = await request
        self.record_status(response.status_code)

    def record_status(self, status: int) -> None:
        if status == 200:
            self.counts["completed"] += 1
        elif status == 429:
            self.counts["rejected_429"] += 1
        else:
            self.unexpected.append(f"HTTP {status}")

    async def grpc_generate(self, stub) -> None:
        request_id = f"g-{self.rng.randint(0, 2)}"
        request = api_pb2.GenerateRequest(
            request_id=request_id,
            text=self.rng.choice(PROMPTS),
            sampling_params=api_pb2.SamplingParams(max_tokens=self.rng.randint(1, 16)),
        )
        call = stub.Generate(request)
        try:
            if self.rng.random() < 0.3:
                await call.read()
                # A stranger on another connection tries the same id: it must find nothing of ours.
                await self.stranger.Abort(api_pb2.AbortRequest(request_id=request_id))
                call.cancel()
                self.counts["cancelled"] += 1
                return
            async for _ in call:
                pass
            self.counts["completed"] += 1
        except grpc.aio.AioRpcError as error:
            self.record_rpc_error(error)

    async def grpc_session(self, stub) -> None:
        num_chunks = self.rng.randint(1, 3)
        ending = self.rng.choice(["final", "half-close", "abandon"])

        async def messages():
            for index in range(num_chunks):
                last = index == num_chunks - 1
                yield api_pb2.SessionRequest(
                    text=self.rng.choice(PROMPTS),
                    final=last and ending == "final",
                    sampling_params=api_pb2.SamplingParams(max_tokens=8) if index == 0 else None,
                )
                await asyncio.sleep(self.rng.uniform(0.0, 0.3))
            if ending == "abandon":
                await asyncio.sleep(60)

        call = stub.Session(messages())
        try:
            if ending == "abandon":
                await asyncio.sleep(self.rng.uniform(0.1, 1.0))
                call.cancel()
                self.counts["sessions_abandoned"] += 1
                return
            async for _ in call:
                pass
            self.counts["sessions_completed"] += 1
        except grpc.aio.AioRpcError as error:
            self.record_rpc_error(error)

    def record_rpc_error(self, error: grpc.aio.AioRpcError) -> None:
        if error.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED):
            self.counts[f"grpc_{error.code().name.lower()}"] += 1
        elif error.code() == grpc.StatusCode.CANCELLED:
            self.counts["cancelled"] += 1
        else:
            self.unexpected.append(f"gRPC {error.code().name}: {error.details()}")

    async def client(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.http_url, timeout=120) as http:
            channel = grpc.aio.insecure_channel(self.grpc_target)
            stub = api_pb2_grpc.GenerationStub(channel)
            try:
                while time.monotonic() < deadline:
                    action = self.rng.choice([self.http_stream, self.http_whole, self.grpc_generate, self.grpc_session])
                    self.counts["requests"] += 1
                    await action(http if action in (self.http_stream, self.http_whole) else stub)
            finally:
                await channel.close()

    async def run(self, seconds: float) -> None:
        stranger_channel = grpc.aio.insecure_channel(self.grpc_target, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stranger = api_pb2_grpc.GenerationStub(stranger_channel)
        deadline = time.monotonic() + seconds
        try:
            await asyncio.gather(*(self.client(deadline) for _ in range(CLIENTS)))
        finally:
            await stranger_channel.close()


async def server_stats(grpc_target: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        info = await api_pb2_grpc.GenerationStub(channel).GetServerInfo(api_pb2.ServerInfoRequest())
        return dict(info.stats)


async def wait_idle(grpc_target: str, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await server_stats(grpc_target)
        idle = stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def test_soak(soak_minutes, tmp_path):
    process = start_serve(
        "--served-model-name", "soak",
        # A small cache, so preemption and idle-session reclaiming happen under this load.
        "--kv-cache-memory-bytes", str(6 << 20), "--max-num-seqs", "16", "--max-waiting-requests", "64",
        "--session-idle-timeout", "5",
    )  # fmt: skip
    lines: list[str] = []
    try:
        http_url, grpc_target = wait_ready(process, lines)

        warmup = Soak(http_url, grpc_target, seed=1)
        asyncio.run(warmup.run(10))
        assert asyncio.run(wait_idle(grpc_target, 60))["num_unfinished"] == 0
        rss_before = actor_rss(process.pid)
        assert {name.split("[")[0] for name in rss_before} == set(ACTOR_NAMES), rss_before

        soak = Soak(http_url, grpc_target, seed=2)
        started = time.monotonic()
        asyncio.run(soak.run(soak_minutes * 60))
        duration = time.monotonic() - started
        stats = asyncio.run(wait_idle(grpc_target, 60))
        rss_after = actor_rss(process.pid)

        report = {
            "duration_s": round(duration, 1),
            "counts": dict(soak.counts),
            "unexpected": soak.unexpected[:10],
            "after": {k: stats[k] for k in ("num_unfinished", "num_running", "num_waiting", "num_free_blocks",
                                           "num_blocks", "num_preemptions", "num_aborted")},
            "rss_mib": {
                name: [round(rss_before[name] / 2**20, 1), round(rss_after.get(name, 0) / 2**20, 1)]
                for name in rss_before
            },
        }  # fmt: skip
        print("soak report: " + json.dumps(report, indent=1))
        (tmp_path / "soak.json").write_text(json.dumps(report))

        assert not soak.unexpected, soak.unexpected
        assert soak.counts["requests"] >= 20 and soak.counts["cancelled"] > 0, soak.counts
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_unfinished"] == 0, stats
        assert stats["num_free_blocks"] == stats["num_blocks"], stats
        for name, before in rss_before.items():
            assert name in rss_after, f"{name} is gone: a process died during the soak"
            assert rss_after[name] - before < RSS_GROWTH_LIMIT_BYTES, (name, before, rss_after[name])
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
