"""The soak's own checks (pagerail bench soak): its fault schedule, what it calls left over, how it compares
process memory, that a refusal to admit is retried while a mid-answer failure is a violation, and that its
reused gRPC request id is refused on the twin, never on the first call."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import grpc
import httpx
import pytest

from pagerail.cluster.bench.process_cpu import ProcessMemory
from pagerail.cluster.bench.soak import (
    WEATHER_TOOL,
    Busy,
    Clients,
    FaultSchedule,
    Record,
    leftovers,
    memory_growth,
    role_pids,
)


def test_the_fault_schedule_parses_each_kind_and_refuses_unknown_or_negative_ones():
    assert FaultSchedule.parse("worker=15,head=35") == FaultSchedule(15.0, 35.0, 420.0)
    assert FaultSchedule.parse("none") == FaultSchedule(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="unknown fault 'rank'"):
        FaultSchedule.parse("rank=5")
    with pytest.raises(ValueError, match="head must be at least 0"):
        FaultSchedule.parse("head=-1")


def test_leftovers_name_each_replica_still_holding_requests_sessions_or_blocks():
    quiet = {"replicas.a.num_blocks": 8, "replicas.a.num_free_blocks": 8, "replicas.a.num_unfinished": 0}
    busy = {"replicas.b.num_blocks": 8, "replicas.b.num_free_blocks": 5, "replicas.b.num_unfinished": 1,
            "replicas.b.num_open_sessions": 1}  # fmt: skip
    assert leftovers(quiet) == []
    assert leftovers({**quiet, **busy}) == ["replica b: 1 unfinished, 1 sessions, 3 blocks"]
    # A replica whose head a fault killed reports nothing until it is back: its blocks are not yet known to be free.
    assert leftovers(quiet, frozenset({"a", "b"})) == ["replica b: not reporting (its head is not back)"]
    assert leftovers(quiet, frozenset({"a"})) == []
    # A single engine reports at the top level.
    assert leftovers({"num_blocks": 4, "num_free_blocks": 3, "num_unfinished": 0}) == [
        "replica the: 0 unfinished, 0 sessions, 1 blocks"
    ]


def test_memory_growth_compares_only_the_same_engine_process_at_both_readings():
    before = {1: ProcessMemory("ray::HeadActor", 100 << 20, 10, 7), 2: ProcessMemory("ray::WorkerActor", 1, 1, 7),
              3: ProcessMemory("raylet", 1, 1, 7)}  # fmt: skip
    after = {1: ProcessMemory("ray::HeadActor", 150 << 20, 12, 7), 2: ProcessMemory("ray::WorkerActor", 1, 1, 9),
             3: ProcessMemory("raylet", 9 << 30, 99, 7)}  # fmt: skip
    # pid 2 is another process now (a restarted rank); raylet is not the engine's.
    assert memory_growth(before, after) == [["ray::HeadActor", 1, "100 → 150", "10 → 12", 50 << 20, 2]]


def test_the_fault_injector_finds_an_actor_by_its_title_idle_or_in_a_call():
    titles = {5: "ray::HeadActor", 6: "ray::HeadActor.drain", 7: "ray::HeadActorProxy", 8: "ray::WorkerActor"}
    processes = {pid: ProcessMemory(title, 1, 1, 7) for pid, title in titles.items()}
    assert role_pids(processes, "HeadActor") == [5, 6] and role_pids(processes, "FrontendActor") == []


def _clients() -> tuple[Clients, Record]:
    record = Record()
    return Clients("http://soak", "unused:0", record, seed=3), record


def test_a_429_is_busy_while_an_abort_mid_answer_is_a_violation():
    clients, record = _clients()
    busy = httpx.Response(429, headers={"retry-after": "2"})
    with pytest.raises(Busy) as refused:
        clients.ok(busy, "completion")
    assert refused.value.retry_after_s == 2.0 and not record.unexpected
    assert not clients.finished_well("abort", "stream") and "finished with 'abort'" in record.unexpected[0]
    assert clients.finished_well("length", "stream") and clients.finished_well("tool_calls", "chat")


def test_a_resource_exhausted_call_is_busy_and_another_status_is_a_violation():
    clients, record = _clients()

    class Error(grpc.aio.AioRpcError):
        def __init__(self, code):
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(("retry-after", "3")), details="x")

    with pytest.raises(Busy) as refused:
        clients.rpc_failed(Error(grpc.StatusCode.RESOURCE_EXHAUSTED), "gRPC Generate")
    assert refused.value.retry_after_s == 3.0
    clients.rpc_failed(Error(grpc.StatusCode.INTERNAL), "gRPC Generate")
    assert record.unexpected and "INTERNAL" in record.unexpected[0]


class _FakeGenerations:
    """The server's side of a reused request id on one connection: the call that reaches it first holds the id,
    and a call only reaches it once the client waits on it (its metadata or its responses)."""

    def __init__(self) -> None:
        self.holder: dict[str, object] = {}

    def Generate(self, request):  # noqa: N802
        return _FakeCall(self, request.request_id)


class _FakeCall:
    def __init__(self, server: _FakeGenerations, request_id: str) -> None:
        self.server, self.request_id = server, request_id

    def _arrive(self) -> None:
        holder = self.server.holder.setdefault(self.request_id, self)
        if holder is not self:
            metadata = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.ALREADY_EXISTS, metadata, metadata, details="already streaming")

    async def initial_metadata(self):
        self._arrive()
        return grpc.aio.Metadata()

    def __aiter__(self):
        return self._responses()

    async def _responses(self):
        self._arrive()
        yield type("Response", (), {"token_ids": [1, 2], "finish_reason": "length"})()
        self.server.holder.pop(self.request_id)


class _Rolls:
    """Random draws that take the twin path of a gRPC generation: no disconnect, a twin, greedy."""

    def __init__(self) -> None:
        self.rolls = iter([0.1, 0.5, 0.05])  # greedy sampling; no disconnect; send a twin

    def random(self) -> float:
        return next(self.rolls)

    def randint(self, low: int, high: int) -> int:
        return low

    def choice(self, options):
        return options[0]


def test_the_twin_of_a_grpc_request_is_refused_and_the_first_call_completes():
    clients, record = _clients()
    clients.rng = _Rolls()
    asyncio.run(clients.grpc_generate(_FakeGenerations(), stranger=None))
    assert not record.unexpected, record.unexpected
    assert record.counts["provoked_already_exists"] == 1 and record.counts["completed"] == 1


def test_the_clean_run_sends_a_request_with_its_keys_in_the_order_sent():
    # The chat template writes tools out in the order they came: a replay with sorted keys is another prompt, and
    # its seeded output legitimately differs from the soak's.
    clients, record = _clients()
    body = {"model": "soak", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL],
            "tool_choice": "required", "max_tokens": 4, "temperature": 0.8, "seed": 1}  # fmt: skip
    record.answer("chat", body, [None, []])
    [(kind, request)] = record.answers
    sent = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, json={"choices": [{"message": {"content": None, "tool_calls": []}}]})

    async def replay() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://soak") as http:
            return await clients.replay(kind, json.loads(request), http, None)

    assert asyncio.run(replay()) == [None, []]
    in_order = json.loads(sent[0], object_pairs_hook=list)
    assert in_order == json.loads(json.dumps(body), object_pairs_hook=list)
    assert list(WEATHER_TOOL["function"]) != sorted(WEATHER_TOOL["function"])  # the check above can tell


@pytest.mark.parametrize("refusals, drained", [(2, True), (1000, False)])
def test_a_drain_refused_while_the_other_replica_is_out_is_tried_again(monkeypatch, refusals, drained):
    """A drain due while the other replica restarts waits for it (the one-minute soak kills a rank every 14 s, and
    its drains were refused outright when they fell in a restart), and counts as refused only after its wait."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from pagerail.cluster.bench import soak
    from tests.http_server import BackgroundServer

    calls = Counter()
    app = FastAPI()

    @app.post("/replicas/drain")
    async def drain(replica: str):
        calls["drain"] += 1
        if calls["drain"] <= refusals:
            return JSONResponse({"error": {"message": "draining would leave no replica in rotation"}}, status_code=400)
        return {"moved_requests": 3}

    @app.post("/replicas/undrain")
    async def undrain(replica: str):
        calls["undrain"] += 1
        return {"status": "in rotation"}

    async def stats(target):
        return {"replicas.r0.num_blocks": 8.0, "replicas.r1.num_blocks": 8.0}

    monkeypatch.setattr(soak, "server_stats", stats)
    record = Record()
    with BackgroundServer(app) as base_url:
        faults = soak.Faults(SimpleNamespace(base_url=base_url), "unused", FaultSchedule(), record, seed=0)
        faults.drain_retry_s, faults.retry_every_s, faults.undrain_after_s = 0.5, 0.01, 0.0
        asyncio.run(faults.drain())
    if drained:
        assert calls == Counter(drain=3, undrain=1) and record.faults == Counter({"replica drained": 1})
        assert record.counts["migrated_requests"] == 3
    else:
        assert calls["drain"] > 3 and calls["undrain"] == 0
        assert record.faults == Counter({"drain refused: no other replica in rotation": 1})
    assert not record.unexpected
