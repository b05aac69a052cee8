"""The head's step streams over real gRPC to stand-in ranks: order under pipelining, failures of pipelined steps,
dead and hung ranks, the token check, trace context in the step, teardown, and the dispatch figures."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from pagerail.cluster.core.executor import WorkerGroupError
from pagerail.cluster.distributed.remote_executor import RemoteExecutor
from pagerail.common.auth import auth_metadata
from pagerail.proto import step_pb2, worker_pb2_grpc
from pagerail.worker.grpc_server import start_worker_server

TOKEN = "step-stream-test-token"
WAIT_S = 10.0  # bound on anything that should happen at once; only a broken build waits that long
HANG_S = 8.0  # a rank stuck in a step: longer than any failure takes to be noticed here


class ScriptedRank:
    """Stands in for a rank's Worker: records the steps it runs; per step id, a delay or a failure."""

    def __init__(self, rank: int) -> None:
        self.tp = SimpleNamespace(rank=rank)
        self.ran: list[int] = []
        self.spans: dict[int, tuple[float, float]] = {}  # step id → (start, end), perf_counter
        self.trace_contexts: list[dict[str, str]] = []
        self.delays: dict[int, float] = {}
        self.failures: set[int] = set()
        self.entered = threading.Event()  # set when a step starts

    def execute_step(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        started = time.perf_counter()
        self.entered.set()
        self.ran.append(batch.step_id)
        self.trace_contexts.append(dict(batch.trace_context))
        if batch.step_id in self.failures:
            raise RuntimeError(f"step {batch.step_id} broke")
        time.sleep(self.delays.get(batch.step_id, 0.0))
        self.spans[batch.step_id] = (started, time.perf_counter())
        # Each step's answer names it, so a result matched to the wrong step shows.
        handles = [batch.step_id] if self.tp.rank == 0 else []
        return step_pb2.StepResult(
            step_id=batch.step_id, handles=handles, token_ids=[10 * h for h in handles],
            compute_seconds=time.perf_counter() - started,
        )  # fmt: skip


class Group:
    """Stand-in ranks behind real worker servers, and an executor streaming to them."""

    def __init__(self, size: int, connect: bool, **options) -> None:
        self.ranks = [ScriptedRank(rank) for rank in range(size)]
        self.servers = [start_worker_server(rank, "127.0.0.1", TOKEN) for rank in self.ranks]
        self.addresses = [f"127.0.0.1:{port}" for _, port in self.servers]
        self.executor = RemoteExecutor(self.addresses, TOKEN, **options) if connect else None

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
        for server, _ in self.servers:
            server.stop(grace=None)


@pytest.fixture
def make_group():
    groups: list[Group] = []

    def make(size: int = 2, connect: bool = True, **options) -> Group:
        groups.append(Group(size, connect, **options))
        return groups[-1]

    yield make
    for group in groups:
        group.close()


def batch(step_id: int) -> step_pb2.StepBatch:
    return step_pb2.StepBatch(step_id=step_id)


def test_pipelined_steps_run_in_order_on_every_rank(make_group):
    group = make_group()
    group.ranks[1].delays[1] = 0.3  # step 2 is queued on every rank while step 1 still runs on rank 1
    started = time.perf_counter()
    first, second = group.executor.submit(batch(1)), group.executor.submit(batch(2))
    assert time.perf_counter() - started < 0.3, "submit waited for a step to finish"
    assert second.result().handles == [2]  # asked first: it still waits for step 1 before it
    assert (first.result().step_id, list(first.result().token_ids)) == (1, [10])
    for rank in group.ranks:
        assert rank.ran == [1, 2]
        assert rank.spans[2][0] >= rank.spans[1][1], f"rank {rank.tp.rank} started step 2 before step 1 ended"

    # A longer run, two steps in flight as the engine keeps them, with uneven step times.
    for step_id in range(3, 40):
        group.ranks[step_id % 2].delays[step_id] = 0.002 * (step_id % 5)
    pending = group.executor.submit(batch(3))
    for step_id in range(4, 40):
        following = group.executor.submit(batch(step_id))
        assert pending.result().handles == [step_id - 1]
        pending = following
    assert pending.result().handles == [39]
    assert all(rank.ran == list(range(1, 40)) for rank in group.ranks)
    stats = group.executor.stats
    assert stats.num_steps == 39 and len(stats.overhead_s) == 39 and len(stats.idle_s) == 38
    assert stats.bytes_sent_per_rank == len(batch(39).SerializeToString())
    assert len(stats.bytes_received_per_rank) == len(stats.last_round_trip_per_rank) == 2
    assert stats.total_bytes_sent == 2 * sum(len(batch(i).SerializeToString()) for i in range(1, 40))
    assert all(0 <= overhead <= rtt for overhead, rtt in zip(stats.overhead_s, stats.round_trip_s, strict=True))


def test_the_first_of_two_pipelined_steps_fails(make_group):
    group = make_group()
    group.ranks[1].failures.add(1)
    group.ranks[0].delays[1] = 0.2  # rank 0 is still busy with step 1 when rank 1 fails it
    first, second = group.executor.submit(batch(1)), group.executor.submit(batch(2))
    with pytest.raises(WorkerGroupError, match=r"^rank 1 failed during step 1: RuntimeError: step 1 broke$"):
        first.result()
    with pytest.raises(WorkerGroupError, match="step 2 was abandoned: rank 1 failed during step 1"):
        second.result()
    assert group.ranks[1].ran == [1], "a rank ran a step queued behind its failed one"
    # The group is to be rebuilt: later steps fail at once instead of reaching the ranks.
    with pytest.raises(WorkerGroupError, match="step 3 was not run"):
        group.executor.submit(batch(3)).result()


def test_a_failed_step_keeps_its_reason_while_later_steps_are_on_the_way(make_group):
    # The head writes steps 2-5 while rank 1 fails step 1 at once. Were the rank to end its stream then, a write
    # racing that end could replace the stream's status with a bare "Internal error from Core": the reason travels
    # in a message instead. The race is timing-dependent, so the scenario runs many times.
    for _ in range(25):
        group = make_group()
        group.ranks[1].failures.add(1)
        first = group.executor.submit(batch(1))
        behind = [group.executor.submit(batch(step_id)) for step_id in range(2, 6)]
        with pytest.raises(WorkerGroupError, match=r"^rank 1 failed during step 1: RuntimeError: step 1 broke$"):
            first.result()
        # A step submitted before the failure arrives is abandoned; one submitted after it is refused. Both keep
        # the reason.
        for step in behind:
            with pytest.raises(
                WorkerGroupError, match=r"(was abandoned|was not run): rank 1 failed during step 1: RuntimeError"
            ):
                step.result()
        assert group.ranks[1].ran == [1]
        group.close()


def test_a_rank_that_dies_during_a_pipelined_step_fails_it_at_once(make_group):
    dead: list[int] = []
    group = make_group(dead_ranks=lambda: list(dead), liveness_interval_s=0.05)
    group.ranks[0].delays[1] = HANG_S  # rank 0 sits in step 1 (as in a collective with the dying rank)
    first, second = group.executor.submit(batch(1)), group.executor.submit(batch(2))
    assert group.ranks[0].entered.wait(WAIT_S)
    dead.append(1)
    started = time.perf_counter()
    with pytest.raises(WorkerGroupError, match="rank 1 died during step 1"):
        first.result()
    assert time.perf_counter() - started < HANG_S / 2
    with pytest.raises(WorkerGroupError, match="step 2 was abandoned"):
        second.result()


def test_a_rank_whose_stream_breaks_fails_the_step_at_once(make_group):
    group = make_group()
    group.ranks[1].delays[1] = HANG_S
    first, second = group.executor.submit(batch(1)), group.executor.submit(batch(2))
    assert group.ranks[1].entered.wait(WAIT_S)
    group.servers[1][0].stop(grace=None)  # as when the rank's process is gone: its connection ends
    started = time.perf_counter()
    with pytest.raises(WorkerGroupError, match="rank 1 failed during step 1"):
        first.result()
    assert time.perf_counter() - started < HANG_S / 2
    with pytest.raises(WorkerGroupError, match="step 2 was abandoned"):
        second.result()


def test_the_deadline_counts_from_when_the_ranks_could_start_the_step(make_group):
    group = make_group(step_timeout_s=2.0, liveness_interval_s=0.05)
    for rank in group.ranks:
        rank.delays.update({1: 1.2, 2: 1.2})
    # Step 2 waits 1.2 s behind step 1, then runs 1.2 s: past 2 s from its submission, within 2 s of its start.
    first, second = group.executor.submit(batch(1)), group.executor.submit(batch(2))
    assert first.result().step_id == 1 and second.result().step_id == 2

    group.ranks[1].delays[3] = HANG_S
    started = time.perf_counter()
    with pytest.raises(WorkerGroupError, match=r"rank 1 did not finish step 3 within 2s \(step deadline\)"):
        group.executor.submit(batch(3)).result()
    assert 1.9 < time.perf_counter() - started < HANG_S - 2


def test_a_stream_without_the_token_is_refused(make_group):
    group = make_group(connect=False)
    with pytest.raises(WorkerGroupError, match="rank 0 refused the step stream: UNAUTHENTICATED"):
        RemoteExecutor(group.addresses, "not-the-token")
    with grpc.insecure_channel(group.addresses[1]) as channel:
        replies = worker_pb2_grpc.WorkerServiceStub(channel).StepStream(iter([batch(1)]), timeout=WAIT_S)
        with pytest.raises(grpc.RpcError) as caught:
            list(replies)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the token, the same stream runs the step.
        replies = worker_pb2_grpc.WorkerServiceStub(channel).StepStream(
            iter([batch(1)]), metadata=auth_metadata(TOKEN), timeout=WAIT_S
        )
        assert [reply.step_id for reply in replies] == [1]
    assert [rank.ran for rank in group.ranks] == [[], [1]]


def test_the_dispatch_span_travels_in_the_step(make_group):
    group = make_group()
    caller = SpanContext(0x1234ABCD << 64, 0xFEED, is_remote=False, trace_flags=TraceFlags(1))
    step = batch(1)
    with trace.use_span(NonRecordingSpan(caller)):
        group.executor.submit(step).result()
    group.executor.submit(batch(2)).result()  # no current span: nothing travels
    assert not step.trace_context, "the engine's batch was changed"
    for rank in group.ranks:
        traced, untraced = rank.trace_contexts
        assert traced == {"traceparent": f"00-{caller.trace_id:032x}-{caller.span_id:016x}-01"}
        assert untraced == {}


def test_closing_with_steps_in_flight_fails_them_without_waiting(make_group):
    group = make_group()
    group.ranks[0].delays[1] = HANG_S
    first, second = group.executor.submit(batch(1)), group.executor.submit(batch(2))
    assert group.ranks[0].entered.wait(WAIT_S)
    started = time.perf_counter()
    group.executor.close()
    assert time.perf_counter() - started < HANG_S / 2
    for pending in (first, second):
        with pytest.raises(WorkerGroupError, match="stopped"):
            pending.result()
    group.executor.close()  # twice is harmless
