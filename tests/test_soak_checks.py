"""The soak's own checks (pagerail bench soak): its fault schedule, what it calls left over, how it compares
process memory, and that a refusal to admit is retried while a mid-answer failure is a violation."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pagerail.cluster.bench.process_cpu import ProcessMemory
from pagerail.cluster.bench.soak import Busy, Clients, FaultSchedule, Record, leftovers, memory_growth


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
