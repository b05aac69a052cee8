"""`pagerail bench soak`: a served cluster under mixed clients and scheduled faults, then checked for exactness and
leaks.

The server is a real `pagerail serve` (by default two data-parallel replicas of tensor-parallel size 2 on a small
random Llama, with the host KV tier and n-gram speculation). Clients mix streamed and whole completions, chat with
tools, JSON-schema outputs, `n > 1` with seeds, gRPC generations and streaming-input sessions, with cancels,
disconnects, reused request ids and oversized bodies. On a schedule a worker rank is killed, a replica's head is
killed and a replica is drained (its requests migrate) and put back. At the end:

- every completed greedy or seeded request is sent again on the quiet server: its output must be the same;
- no request failed except those the client provoked (oversized bodies, a reused gRPC request id);
- nothing is in flight, every KV block of every replica is free, no streaming-input session is open;
- the RSS and open file descriptors of each process grew less than a bound.

A summary table goes to stdout (and JSON next to the server log); the exit status is 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from pagerail.cluster.bench.process_cpu import ProcessMemory, session_memory
from pagerail.cluster.bench.server_process import ServerProcess, free_port, pagerail_serve_command
from pagerail.cluster.bench.stats import format_table
from pagerail.proto import api_pb2, api_pb2_grpc

MODEL_NAME = "soak"
ADMIN_KEY = "soak-admin"
PROMPTS = (
    "Tell me about the sea.",
    "Write a haiku about rain.",
    "List three prime numbers:",
    "Say hello.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 16}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
}
# Above the server's body limit (4 MiB by default): answered 413 without reaching the engine.
OVERSIZED_BODY_BYTES = (4 << 20) + 1024
RSS_GROWTH_LIMIT_BYTES = 200 << 20
FD_GROWTH_LIMIT = 64


@dataclass(frozen=True)
class FaultSchedule:
    """Seconds between faults of each kind; 0 turns a kind off."""

    kill_worker_s: float = 120.0
    kill_head_s: float = 300.0
    drain_s: float = 420.0

    @classmethod
    def parse(cls, text: str) -> FaultSchedule:
        """`worker=120,head=300,drain=420` (any subset; "none" for no faults)."""
        if text.strip() == "none":
            return cls(0.0, 0.0, 0.0)
        names = {"worker": "kill_worker_s", "head": "kill_head_s", "drain": "drain_s"}
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, seconds = part.partition("=")
            if name not in names:
                raise ValueError(f"--faults: unknown fault {name!r}; use {', '.join(names)}")
            values[names[name]] = float(seconds)
            if values[names[name]] < 0:
                raise ValueError(f"--faults: {name} must be at least 0 seconds, got {seconds}")
        return cls(**values)


@dataclass
class Record:
    """What the clients did and got: counts by outcome, answers to compare, and anything unexpected."""

    counts: Counter = field(default_factory=Counter)
    # (kind, the request's JSON as sent) → the outputs of every completed copy of that request. Key order is kept,
    # not sorted: a chat template writes the tools out in the order they came, so a reordered tool is another prompt.
    answers: dict[tuple[str, str], list] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    fault_times: list[str] = field(default_factory=list)
    # The most preemptions the server counted at once, read before each head kill and drain's end: a killed head's
    # count starts again, so the end's count alone can miss the preemptions of a replica whose head was killed.
    preemptions_seen: int = 0

    def answer(self, kind: str, request: dict, output) -> None:
        self.counts["completed"] += 1
        self.answers.setdefault((kind, json.dumps(request)), []).append(output)

    started: float = field(default_factory=time.monotonic)

    def fail(self, what: str) -> None:
        self.counts["unexpected_errors"] += 1
        self.unexpected.append(f"at {time.monotonic() - self.started:.1f}s: {what}")

    def fault(self, what: str) -> None:
        self.faults[what] += 1
        self.fault_times.append(f"at {time.monotonic() - self.started:.1f}s: {what}")


class Busy(Exception):
    """The server refused a request for now (HTTP 429, gRPC RESOURCE_EXHAUSTED): a client waits and sends again."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"busy; retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


class Clients:
    """One soak's clients: each picks a random kind of request in a loop until the deadline."""

    def __init__(self, http_url: str, grpc_target: str, record: Record, seed: int) -> None:
        self.http_url = http_url
        self.grpc_target = grpc_target
        self.record = record
        self.rng = random.Random(seed)

    # -- the kinds of request ------------------------------------------------------------------------------------

    def sampling(self) -> dict:
        """Greedy, or seeded sampling: both have one right answer to compare with the clean run."""
        if self.rng.random() < 0.5:
            return {"temperature": 0.0}
        return {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randint(0, 7)}

    def completion(self, **extra) -> dict:
        body = {"model": MODEL_NAME, "prompt": self.rng.choice(PROMPTS), "max_tokens": self.rng.randint(4, 48)}
        return {**body, **self.sampling(), **extra}

    async def http_stream(self, http: httpx.AsyncClient) -> None:
        body = self.completion(stream=True)
        disconnect_after = self.rng.choice([None, None, None, 1, 4])
        text, finished = [], False
        async with http.stream("POST", "/v1/completions", json=body, headers=self.label()) as response:
            if response.status_code == 429:
                raise Busy(float(response.headers.get("retry-after", 1)))
            if response.status_code != 200:
                self.record.fail(f"stream: HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                if choice.get("finish_reason") is not None:
                    finished = True
                    if not self.finished_well(choice["finish_reason"], "stream"):
                        return
                if disconnect_after is not None and len(text) >= disconnect_after and not finished:
                    self.record.counts["disconnected"] += 1
                    return
        if not finished:
            self.record.fail("stream: ended without a finish_reason")
            return
        self.record.answer("completion", {k: v for k, v in body.items() if k != "stream"}, "".join(text))

    async def http_whole(self, http: httpx.AsyncClient) -> None:
        body = self.completion()
        if self.rng.random() < 0.2:
            try:  # the client gives up before the answer: a disconnect the server must notice
                await asyncio.wait_for(http.post("/v1/completions", json=body), self.rng.uniform(0.05, 0.5))
            except TimeoutError:
                self.record.counts["disconnected"] += 1
                return
            self.record.counts["completed_unchecked"] += 1
            return
        response = await http.post("/v1/completions", json=body, headers=self.label())
        if self.ok(response, "completion"):
            choice = response.json()["choices"][0]
            if self.finished_well(choice["finish_reason"], "completion"):
                self.record.answer("completion", body, choice["text"])

    async def n_seeded(self, http: httpx.AsyncClient) -> None:
        body = self.completion(n=self.rng.randint(2, 3), temperature=0.9, seed=self.rng.randint(0, 7))
        response = await http.post("/v1/completions", json=body)
        if self.ok(response, "n > 1"):
            choices = sorted(response.json()["choices"], key=lambda c: c["index"])
            if all(self.finished_well(c["finish_reason"], "n > 1") for c in choices):
                self.record.answer("completion", body, [c["text"] for c in choices])

    async def chat_tools(self, http: httpx.AsyncClient) -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"What is the weather in {self.rng.choice(['Oslo', 'Lima'])}?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": self.rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}]),
            "max_tokens": 64,
            **self.sampling(),
        }
        response = await http.post("/v1/chat/completions", json=body)
        if self.ok(response, "chat with tools"):
            choice = response.json()["choices"][0]
            if not self.finished_well(choice["finish_reason"], "chat with tools"):
                return
            message = choice["message"]
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
            self.record.answer("chat", body, [message.get("content"), calls])

    async def json_schema(self, http: httpx.AsyncClient) -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
            "max_tokens": 96,
            **self.sampling(),
        }
        response = await http.post("/v1/chat/completions", json=body)
        if self.ok(response, "json schema"):
            choice = response.json()["choices"][0]
            if not self.finished_well(choice["finish_reason"], "json schema"):
                return
            content = choice["message"]["content"]
            if choice["finish_reason"] == "stop":
                try:
                    json.loads(content)
                except ValueError:
                    self.record.fail(f"json schema: not JSON: {content[:200]!r}")
                    return
            self.record.answer("chat", body, content)

    async def oversized(self, http: httpx.AsyncClient) -> None:
        response = await http.post("/v1/completions", json=self.completion(prompt="x" * OVERSIZED_BODY_BYTES))
        if response.status_code == 413:
            self.record.counts["provoked_413"] += 1
        else:
            self.record.fail(f"oversized body: HTTP {response.status_code}, expected 413")

    async def grpc_generate(self, stub: api_pb2_grpc.GenerationStub, stranger: api_pb2_grpc.GenerationStub) -> None:
        sampling = self.sampling()
        params = api_pb2.SamplingParams(max_tokens=self.rng.randint(4, 48), temperature=sampling["temperature"])
        if "seed" in sampling:
            params.top_p, params.seed = sampling["top_p"], sampling["seed"]
        prompt = self.rng.choice(PROMPTS)
        request_id = f"g-{self.rng.randint(0, 1_000_000)}"
        call = stub.Generate(api_pb2.GenerateRequest(request_id=request_id, text=prompt, sampling_params=params))
        try:
            if self.rng.random() < 0.2:
                await call.read()
                # Another caller's Abort with the same id finds nothing of ours; then this client goes away.
                found = (await stranger.Abort(api_pb2.AbortRequest(request_id=request_id))).found
                if found:
                    self.record.fail("gRPC: a stranger's Abort found another connection's request")
                call.cancel()
                self.record.counts["disconnected"] += 1
                return
            if self.rng.random() < 0.1:
                # The same id again on the same connection while the first still streams: refused. The server holds
                # the id before it sends the first call's metadata; sent earlier, the twin could reach it first
                # and take the id, and then the first call would be the one refused.
                await call.initial_metadata()
                twin = stub.Generate(
                    api_pb2.GenerateRequest(request_id=request_id, text=prompt, sampling_params=params)
                )
                await self.expect_already_exists(twin)
            tokens, reason = [], ""
            async for response in call:
                tokens.extend(response.token_ids)
                reason = response.finish_reason or reason
            if self.finished_well(reason, "gRPC Generate"):
                key = {"prompt": prompt, "max_tokens": params.max_tokens, **sampling}
                self.record.answer("grpc", key, tokens)
        except grpc.aio.AioRpcError as error:
            self.rpc_failed(error, "gRPC Generate")

    async def expect_already_exists(self, call) -> None:
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.ALREADY_EXISTS:
                self.record.counts["provoked_already_exists"] += 1
                return
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.record.counts["refused_busy_then_retried"] += 1  # the twin was turned away before the id check
                return
            self.record.fail(f"gRPC twin: {error.code().name}, expected ALREADY_EXISTS")
            return
        # The first call may have ended before the twin arrived: then the id was free again.
        self.record.counts["completed_unchecked"] += 1

    async def grpc_session(self, stub: api_pb2_grpc.GenerationStub, stranger=None) -> None:
        chunks = [self.rng.choice(PROMPTS) for _ in range(self.rng.randint(1, 3))]
        abandon = self.rng.random() < 0.2
        max_tokens = self.rng.randint(4, 24)

        async def messages():
            for index, chunk in enumerate(chunks):
                last = index == len(chunks) - 1
                params = api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0) if index == 0 else None
                yield api_pb2.SessionRequest(text=chunk, final=last and not abandon, sampling_params=params)
                await asyncio.sleep(self.rng.uniform(0.0, 0.2))
            if abandon:
                await asyncio.sleep(3600)

        call = stub.Session(messages())
        try:
            if abandon:
                await asyncio.sleep(self.rng.uniform(0.1, 0.8))
                call.cancel()
                self.record.counts["sessions_abandoned"] += 1
                return
            tokens, reason = [], ""
            async for response in call:
                tokens.extend(response.token_ids)
                reason = response.finish_reason or reason
            if self.finished_well(reason, "gRPC Session"):
                self.record.answer("session", {"chunks": chunks, "max_tokens": max_tokens}, tokens)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE and "session" in (error.details() or ""):
                # A session cannot move off a replica that died under it; the server says so and the client
                # opens a new one. Counted, not hidden: the report shows how many.
                self.record.counts["sessions_lost_with_their_replica"] += 1
                return
            self.rpc_failed(error, "gRPC Session")

    # -- plumbing ------------------------------------------------------------------------------------------------

    def label(self) -> dict:
        # A handful of shared X-Request-Id labels: labels only, so reusing them must not matter.
        return {"X-Request-Id": f"shared-{self.rng.randint(0, 3)}"}

    def rpc_failed(self, error: grpc.aio.AioRpcError, what: str) -> None:
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            metadata = dict(error.trailing_metadata() or ())
            raise Busy(float(metadata.get("retry-after", 1)))
        self.record.fail(f"{what}: {error.code().name}: {error.details()}")

    def finished_well(self, reason: str, what: str) -> bool:
        """A finish the client asked for (a stop or its length limit); any other ended the request under it."""
        if reason in ("stop", "length", "tool_calls"):
            return True
        self.record.fail(f"{what}: finished with {reason!r}")
        return False

    def ok(self, response: httpx.Response, what: str) -> bool:
        if response.status_code == 200:
            return True
        if response.status_code == 429:
            raise Busy(float(response.headers.get("retry-after", 1)))
        self.record.fail(f"{what}: HTTP {response.status_code}: {response.text[:200]}")
        return False

    async def client(self, deadline: float) -> None:
        http_kinds = [self.http_stream, self.http_stream, self.http_whole, self.n_seeded, self.chat_tools]
        http_kinds += [self.json_schema]
        grpc_kinds = [self.grpc_generate, self.grpc_generate, self.grpc_session]
        async with httpx.AsyncClient(base_url=self.http_url, timeout=300) as http:
            channel = grpc.aio.insecure_channel(self.grpc_target)
            # Its own connection: a request id is the caller's on its connection only.
            stranger_channel = grpc.aio.insecure_channel(
                self.grpc_target, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            stub, stranger = api_pb2_grpc.GenerationStub(channel), api_pb2_grpc.GenerationStub(stranger_channel)
            try:
                while time.monotonic() < deadline:
                    self.record.counts["requests"] += 1
                    roll = self.rng.random()
                    try:
                        if roll < 0.01:
                            await self.oversized(http)
                        elif roll < 0.65:
                            await self.rng.choice(http_kinds)(http)
                        else:
                            await self.rng.choice(grpc_kinds)(stub, stranger)
                    except Busy as busy:  # never admitted, so nothing was lost: wait as told, then go on
                        self.record.counts["refused_busy_then_retried"] += 1
                        await asyncio.sleep(min(busy.retry_after_s, 5.0))
            except Exception as error:  # a client library error is a failed request too, never a crashed soak
                self.record.fail(f"client: {error!r}")
            finally:
                await channel.close()
                await stranger_channel.close()

    # -- the clean run -------------------------------------------------------------------------------------------

    async def replay(self, kind: str, request: dict, http: httpx.AsyncClient, stub) -> object:
        """The output of one recorded request sent again, alone on a quiet server."""
        if kind == "completion":
            body = json.loads(json.dumps(request))
            response = (await http.post("/v1/completions", json=body)).json()
            choices = sorted(response["choices"], key=lambda c: c["index"])
            return [c["text"] for c in choices] if body.get("n", 1) > 1 else choices[0]["text"]
        if kind == "chat":
            message_choice = (await http.post("/v1/chat/completions", json=request)).json()["choices"][0]
            message = message_choice["message"]
            if "tools" in request:
                calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
                return [message.get("content"), calls]
            return message["content"]
        if kind == "grpc":
            params = api_pb2.SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"])
            if "seed" in request:
                params.top_p, params.seed = request["top_p"], request["seed"]
            call = stub.Generate(api_pb2.GenerateRequest(text=request["prompt"], sampling_params=params))
            return [token for response in [r async for r in call] for token in response.token_ids]

        async def messages():
            for index, chunk in enumerate(request["chunks"]):
                params = (
                    api_pb2.SamplingParams(max_tokens=request["max_tokens"], temperature=0.0) if not index else None
                )
                yield api_pb2.SessionRequest(
                    text=chunk, final=index == len(request["chunks"]) - 1, sampling_params=params
                )

        return [token for response in [r async for r in stub.Session(messages())] for token in response.token_ids]


# How long a drain waits for the other replica to be back in rotation before it counts as refused.
DRAIN_RETRY_S = 30.0


class Faults:
    """Kills and drains on the schedule, from a task beside the clients."""

    def __init__(self, server: ServerProcess, grpc_target: str, schedule: FaultSchedule, record: Record, seed: int):
        self.server = server
        self.grpc_target = grpc_target
        self.schedule = schedule
        self.record = record
        self.rng = random.Random(seed)
        # A drain is tried again each `retry_every_s` for up to `drain_retry_s` while the other replica is out, and
        # the drained replica is put back `undrain_after_s` later.
        self.drain_retry_s, self.retry_every_s, self.undrain_after_s = DRAIN_RETRY_S, 1.0, 5.0

    async def run(self, seconds: float) -> None:
        every = {
            self.kill_worker: self.schedule.kill_worker_s,
            self.kill_head: self.schedule.kill_head_s,
            self.drain: self.schedule.drain_s,
        }
        due = {fault: interval for fault, interval in every.items() if interval > 0}
        started = time.monotonic()
        drains: list[asyncio.Task] = []  # a drain waits for its moment and its undrain: kills go on meanwhile
        try:
            while due:
                fault, at = min(due.items(), key=lambda item: item[1])
                if at >= seconds:
                    return
                await asyncio.sleep(max(0.0, started + at - time.monotonic()))
                if fault == self.drain:
                    drains.append(asyncio.create_task(fault()))
                else:
                    await fault()
                due[fault] = at + every[fault]
        finally:
            await asyncio.gather(*drains)

    def _kill(self, role: str) -> None:
        pids = role_pids(session_memory(self.server.process.pid), role)
        if not pids:
            # Every one of them is being replaced right now (a replica restarts its killed head): nothing to kill
            # until they are back, and the requests they held are checked like every other.
            self.record.fault(f"{role} kill skipped: none running")
            return
        try:
            os.kill(self.rng.choice(sorted(pids)), signal.SIGKILL)
            self.record.fault(f"{role} killed")
        except ProcessLookupError:
            pass  # it ended on its own in between: the next one is due soon enough

    async def kill_worker(self) -> None:
        self._kill("WorkerActor")

    async def kill_head(self) -> None:
        await self._note_preemptions()
        self._kill("HeadActor")

    async def _note_preemptions(self) -> None:
        try:
            stats = await server_stats(self.grpc_target)
        except grpc.aio.AioRpcError:  # a replica restarting: the next reading counts
            return
        self.record.preemptions_seen = max(self.record.preemptions_seen, int(stats.get("num_preemptions", 0)))

    async def drain(self) -> None:
        """Drain one replica (its requests move, with their KV, to the other), and put it back a while later. While
        the other replica is out (a killed rank or head still restarting) the server rightly refuses: the drain is
        tried again, as an operator would (see __init__)."""
        replicas = sorted(replica_names(await server_stats(self.grpc_target)))
        replica = self.rng.choice(replicas)
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        give_up_at = time.monotonic() + self.drain_retry_s
        async with httpx.AsyncClient(base_url=self.server.base_url, timeout=300, headers=headers) as admin:
            while True:
                response = await admin.post("/replicas/drain", params={"replica": replica})
                refused = response.status_code == 400 and "no replica in rotation" in response.text
                if not refused or time.monotonic() >= give_up_at:
                    break
                await asyncio.sleep(self.retry_every_s)
            if refused:
                self.record.fault("drain refused: no other replica in rotation")
                return
            if response.status_code != 200:
                self.record.fail(f"drain {replica}: HTTP {response.status_code}: {response.text[:200]}")
                return
            self.record.fault("replica drained")
            self.record.counts["migrated_requests"] += response.json()["moved_requests"]
            await asyncio.sleep(self.undrain_after_s)  # the other replica serves alone for a while
            await self._note_preemptions()
            response = await admin.post("/replicas/undrain", params={"replica": replica})
            if response.status_code != 200:
                self.record.fail(f"undrain {replica}: HTTP {response.status_code}: {response.text[:200]}")


def role_pids(processes: dict[int, ProcessMemory], role: str) -> list[int]:
    """The pids of an actor class's processes, by Ray's title: "ray::Role" when idle, "ray::Role.method" while
    it runs a call."""
    title = f"ray::{role}"
    return sorted(pid for pid, usage in processes.items() if usage.label.split(".")[0] == title)


async def server_stats(grpc_target: str) -> dict[str, float]:
    """The server's numeric stats (GetServerInfo): sums at the top, "replicas.NAME.KEY" for each replica."""
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        info = await api_pb2_grpc.GenerationStub(channel).GetServerInfo(api_pb2.ServerInfoRequest(), timeout=60)
        return dict(info.stats)


def replica_names(stats: dict[str, float]) -> set[str]:
    return {key.split(".")[1] for key in stats if key.startswith("replicas.") and key.endswith(".num_blocks")}


def leftovers(stats: dict[str, float], replicas: frozenset[str] = frozenset()) -> list[str]:
    """What a server that finished every request still holds: requests, sessions, KV blocks (each replica's).
    A replica of `replicas` (those the server had before the faults) that does not report is left over too: until
    its head is back, its blocks cannot be checked."""
    missing = sorted(replicas - replica_names(stats))
    found = [f"replica {name}: not reporting (its head is not back)" for name in missing]
    for name in sorted(replica_names(stats)) or [""]:
        prefix = f"replicas.{name}." if name else ""
        if f"{prefix}num_blocks" not in stats:
            found.append(f"replica {name}: no stats")
            continue
        unfinished, sessions = stats[f"{prefix}num_unfinished"], stats.get(f"{prefix}num_open_sessions", 0)
        used = stats[f"{prefix}num_blocks"] - stats[f"{prefix}num_free_blocks"]
        if unfinished or sessions or used:
            found.append(f"replica {name or 'the'}: {unfinished:g} unfinished, {sessions:g} sessions, {used:g} blocks")
    return found


async def wait_idle(
    grpc_target: str, timeout_s: float, replicas: frozenset[str] = frozenset()
) -> tuple[dict[str, float], list[str]]:
    """The stats once nothing is left over on any replica (each of `replicas` reporting), or at the timeout with
    what is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = await server_stats(grpc_target)
            left = leftovers(stats, replicas)
        except grpc.aio.AioRpcError as error:  # a restarting replica may not answer for a moment
            stats, left = {}, [f"GetServerInfo: {error.code().name}"]
        if not left or time.monotonic() > deadline:
            return stats, left
        await asyncio.sleep(0.5)


def memory_growth(before: dict[int, ProcessMemory], after: dict[int, ProcessMemory]) -> list[list]:
    """Rows (process, pid, RSS MiB before → after, fds before → after) for the engine's processes alive at both
    readings; processes a fault replaced start new rows of their own and are not compared."""
    rows = []
    for pid, now in sorted(after.items(), key=lambda item: item[1].label):
        then = before.get(pid)
        if not now.label.startswith("ray::") or then is None or then.started != now.started:
            continue
        rss = f"{then.rss_bytes / 2**20:.0f} → {now.rss_bytes / 2**20:.0f}"
        rows.append([now.label, pid, rss, f"{then.open_fds} → {now.open_fds}", now.rss_bytes - then.rss_bytes,
                     now.open_fds - then.open_fds])  # fmt: skip
    return rows


async def compare_with_clean_run(record: Record, http_url: str, grpc_target: str, seed: int) -> tuple[int, list]:
    """Each distinct completed request once more on the quiet server: (how many compared, mismatches)."""
    replayer = Clients(http_url, grpc_target, record, seed)
    mismatches, compared, failures = [], 0, []
    limit = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=http_url, timeout=300) as http:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = api_pb2_grpc.GenerationStub(channel)

            async def check(key: tuple[str, str], outputs: list) -> None:
                nonlocal compared
                kind, request = key[0], json.loads(key[1])
                async with limit:
                    try:
                        clean = await replayer.replay(kind, request, http, stub)
                    except Exception as error:  # the quiet server failing a request is a finding too
                        failures.append(f"the clean run of a {kind} request failed: {error!r}"[:400])
                        return
                for output in outputs:
                    compared += 1
                    if output != clean:
                        mismatches.append({"kind": kind, "request": request, "soak": output, "clean": clean})

            await asyncio.gather(*(check(key, outputs) for key, outputs in record.answers.items()))
    for failure in failures:
        record.fail(failure)
    return compared, mismatches


# ChatML, with the tools listed in the system turn: enough for chat and tool calls on a random model.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_chat_template(model_dir: Path) -> Path:
    """The random model's tokenizer with a chat template, so the chat routes serve it."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=1))
    return model_dir


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 1.0
    clients: int = 16
    seed: int = 0
    faults: FaultSchedule = FaultSchedule()
    model: str | None = None  # None: a small random Llama written under `out`
    out: Path = Path("bench-results/soak")
    data_parallel_size: int = 2
    tensor_parallel_size: int = 2
    idle_timeout_s: float = 120.0
    server_flags: tuple[str, ...] = ()


def serve_flags(config: SoakConfig, grpc_port: int) -> list[str]:
    speculative = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    flags = ["--served-model-name", MODEL_NAME, "--device", "cpu", "--dtype", "float32"]
    flags += ["--data-parallel-size", str(config.data_parallel_size)]
    flags += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    # A small device cache, so that preemption, eviction to the host tier and loads back all happen.
    flags += ["--kv-cache-memory-bytes", str(4 << 20), "--kv-offload-bytes", str(16 << 20)]
    flags += ["--max-num-seqs", "16", "--max-waiting-requests", "256", "--session-idle-timeout", "10"]
    flags += ["--speculative-config", speculative, "--admin-api-key", ADMIN_KEY, "--max-worker-restarts", "1000"]
    num_ranks = config.data_parallel_size * config.tensor_parallel_size
    cores = os.cpu_count() or 1
    if cores < num_ranks:  # every rank gets a share of a core instead of waiting for one of its own
        flags += ["--cpus-per-worker", f"{cores / num_ranks:g}"]
    return [*flags, "--grpc-port", str(grpc_port), *config.server_flags]


def run_soak(config: SoakConfig) -> dict:
    """Start the server, warm it up, soak it with faults, check it; the report (its "violations" empty when
    everything held)."""
    config.out.mkdir(parents=True, exist_ok=True)
    model = config.model
    if model is None:
        from pagerail.cluster.bench.tiny_llama import write_tiny_llama

        model = str(with_chat_template(write_tiny_llama(config.out / "tiny-llama")))
    port, grpc_port = free_port(), free_port()
    command = pagerail_serve_command(sys.executable, model, port, *serve_flags(config, grpc_port))
    # The last --grpc-port wins: the soak names its own so that its clients know it.
    server = ServerProcess(command, f"http://127.0.0.1:{port}", config.out / "server.log", ready_timeout_s=900)
    grpc_target = f"127.0.0.1:{grpc_port}"
    record = Record()
    with server:
        replicas = frozenset(replica_names(asyncio.run(_warm_up(server.base_url, grpc_target, config))))
        before = session_memory(server.process.pid)
        record.started = time.monotonic()
        asyncio.run(_soak(server, grpc_target, record, config))
        soaked_s = time.monotonic() - record.started
        stats, left = asyncio.run(wait_idle(grpc_target, config.idle_timeout_s, replicas))
        after = session_memory(server.process.pid)
        compared, mismatches = asyncio.run(compare_with_clean_run(record, server.base_url, grpc_target, config.seed))
    growth = memory_growth(before, after)
    violations = [f"unexpected error: {what}" for what in record.unexpected]
    violations += [f"left over after the soak: {what}" for what in left]
    violations += [f"differs from the clean run ({m['kind']}): see mismatch_details in soak.json" for m in mismatches]
    violations += [f"{row[0]}[{row[1]}] RSS grew {row[4] / 2**20:.0f} MiB" for row in growth
                   if row[4] > RSS_GROWTH_LIMIT_BYTES]  # fmt: skip
    violations += [f"{row[0]}[{row[1]}] holds {row[5]} more descriptors" for row in growth
                   if row[5] > FD_GROWTH_LIMIT]  # fmt: skip
    report = {
        "minutes": round(soaked_s / 60, 2),
        "counts": dict(record.counts),
        "faults": dict(record.faults),
        "fault_times": record.fault_times,
        "outputs_compared": compared,
        "mismatches": len(mismatches),
        "mismatch_details": mismatches[:20],
        "leftovers": left,
        # The end's count (since each replica's head last started), or more counted before a head was killed.
        "preemptions": max(int(stats.get("num_preemptions", 0)), record.preemptions_seen),
        "blocks_in_use": {
            name: stats.get(f"replicas.{name}.num_blocks", 0) - stats.get(f"replicas.{name}.num_free_blocks", 0)
            for name in sorted(replica_names(stats))
        },  # fmt: skip
        "memory": [{"process": r[0], "pid": r[1], "rss_mib": r[2], "fds": r[3]} for r in growth],
        "violations": violations,
    }
    (config.out / "soak.json").write_text(json.dumps(report, indent=1))
    return report


async def _warm_up(http_url: str, grpc_target: str, config: SoakConfig) -> dict[str, float]:
    """A few of each kind of request before the memory readings: first-use allocations are not growth. Returns the
    server's stats once it is idle again."""
    record = Record()
    await asyncio.gather(
        *(Clients(http_url, grpc_target, record, -1 - i).client(time.monotonic() + 10) for i in range(4))
    )
    stats, _ = await wait_idle(grpc_target, config.idle_timeout_s)
    return stats


async def _soak(server: ServerProcess, grpc_target: str, record: Record, config: SoakConfig) -> None:
    seconds = config.minutes * 60
    deadline = time.monotonic() + seconds
    clients = [Clients(server.base_url, grpc_target, record, config.seed * 1000 + i) for i in range(config.clients)]
    faults = Faults(server, grpc_target, config.faults, record, config.seed)
    await asyncio.gather(faults.run(seconds), *(client.client(deadline) for client in clients))


def format_report(report: dict) -> str:
    counts, faults = report["counts"], report["faults"]
    rows = [["minutes", report["minutes"]]]
    rows += [[f"requests {name}", value] for name, value in sorted(counts.items())]
    rows += [[f"fault: {name}", value] for name, value in sorted(faults.items())]
    rows += [["preemptions (the most counted at once)", report["preemptions"]]]
    rows += [["outputs compared with the clean run", report["outputs_compared"]], ["mismatches", report["mismatches"]]]
    rows += [[f"blocks in use at the end ({name})", used] for name, used in report["blocks_in_use"].items()]
    rows += [[f"RSS MiB {m['process']}[{m['pid']}]", f"{m['rss_mib']} (fds {m['fds']})"] for m in report["memory"]]
    rows += [["violations", len(report["violations"])]]
    lines = [format_table(["soak", "value"], rows)]
    lines += [f"VIOLATION: {violation}" for violation in report["violations"][:50]]
    return "\n".join(lines)


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=1.0, help="how long the clients run (default 1)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--faults",
        type=FaultSchedule.parse,
        default=FaultSchedule(),
        help="seconds between faults: worker=120,head=300,drain=420 (the default), or none",
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a small random Llama)")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results/soak"), help="server log and soak.json")


def run_soak_command(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.clients < 1:
        raise SystemExit("--minutes must be above 0 and --clients at least 1")
    config = SoakConfig(
        minutes=args.minutes,
        clients=args.clients,
        seed=args.seed,
        faults=args.faults,
        model=args.model,
        out=args.out,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    report = run_soak(config)
    print(format_report(report))
    return 1 if report["violations"] else 0
