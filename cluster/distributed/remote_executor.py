"""Sends each StepBatch to every tensor-parallel rank over gRPC at once and keeps the dispatch figures."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cluster.core.executor import PendingStep, WorkerGroupError, run_now
from common.auth import auth_metadata
from common.telemetry import inject_metadata
from common.tls import TlsConfig
from proto import step_pb2

_EXECUTE_STEP = "/pagerail.worker.WorkerService/ExecuteStep"
_MAX_MESSAGE = 256 << 20
# How long past the step deadline the head waits for gRPC to report it before giving up on the call itself.
_DEADLINE_GRACE_S = 5.0


@dataclass
class DispatchStats:
    """Per-step wire figures: what the observability layer exports."""

    num_steps: int = 0
    bytes_sent_per_rank: int = 0  # latest step
    bytes_received_per_rank: list[int] = field(default_factory=list)  # latest step
    last_round_trip_per_rank: list[float] = field(default_factory=list)  # latest step
    total_bytes_sent: int = 0
    total_bytes_received: int = 0
    round_trip_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    # Round trip minus the slowest rank's own reported compute time: the cost of dispatching.
    overhead_s: deque = field(default_factory=lambda: deque(maxlen=4096))

    def reset(self) -> None:
        self.__init__()

    def summary(self) -> dict:
        def pct(values, q):
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        return {
            "steps": self.num_steps,
            "round_trip_p50_s": statistics.median(self.round_trip_s) if self.round_trip_s else 0.0,
            "round_trip_p99_s": pct(self.round_trip_s, 0.99),
            "overhead_p50_s": statistics.median(self.overhead_s) if self.overhead_s else 0.0,
            "overhead_p99_s": pct(self.overhead_s, 0.99),
            "bytes_sent_per_rank": self.bytes_sent_per_rank,
            "total_bytes_sent": self.total_bytes_sent,
            "total_bytes_received": self.total_bytes_received,
        }


class _StepWaiter:
    """Collects the ranks' completions, from gRPC's threads; `done` is set by the first failure or the last reply."""

    def __init__(self, num_ranks: int) -> None:
        self.done = threading.Event()
        self.finished_at = [0.0] * num_ranks
        self.failed: tuple[int, grpc.RpcError] | None = None  # the first rank that failed, and how
        self._pending = num_ranks
        self._lock = threading.Lock()

    def on_done(self, rank: int, future: grpc.Future) -> None:
        self.finished_at[rank] = time.perf_counter()
        error = None if future.cancelled() else future.exception()
        with self._lock:
            self._pending -= 1
            if error is not None and self.failed is None:
                self.failed = (rank, error)
            if error is not None or self._pending == 0:
                self.done.set()


class RemoteExecutor:
    """gRPC client of one worker group: the same serialized message to every rank, concurrently."""

    def __init__(
        self,
        addresses: list[str],
        token: str,
        tls: TlsConfig | None = None,
        step_timeout_s: float = 300.0,
        dead_ranks: Callable[[], list[int]] | None = None,
        liveness_interval_s: float = 1.0,
    ) -> None:
        """`dead_ranks`: asked every `liveness_interval_s` while a step runs, the ranks whose process is known dead
        (a rank on a lost node may leave its connection open until the deadline); it must not block."""
        options = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]
        if tls is None:
            self._channels = [grpc.insecure_channel(a, options=options) for a in addresses]
        else:
            credentials = tls.channel_credentials()
            self._channels = [grpc.secure_channel(a, credentials, options=options) for a in addresses]
        # Raw-bytes calls: the batch is serialized once, not once per rank.
        self._calls = [c.unary_unary(_EXECUTE_STEP, response_deserializer=None) for c in self._channels]
        self._metadata = auth_metadata(token)
        self._timeout = step_timeout_s
        self._dead_ranks = dead_ranks
        self._liveness_interval = liveness_interval_s
        self.stats = DispatchStats()

    def submit(self, batch: step_pb2.StepBatch) -> PendingStep:
        """Run the step on every rank before returning (steps are not yet pipelined over the wire)."""
        return run_now(self.execute, batch)

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        """Send the step to every rank at once; rank 0's result, or WorkerGroupError as soon as any rank fails.

        The ranks are waited on together, not in order: a rank that fails or dies ends the step at once, while
        the others may sit in a collective with it until the deadline. The deadline is for a hung rank only.
        """
        payload = batch.SerializeToString()
        started = time.perf_counter()
        # The current (dispatch) span travels with the token, so each rank's ExecuteStep span is its child.
        metadata = (*self._metadata, *inject_metadata())
        futures = [call.future(payload, metadata=metadata, timeout=self._timeout) for call in self._calls]
        waiter = _StepWaiter(len(futures))
        for rank, future in enumerate(futures):
            future.add_done_callback(functools.partial(waiter.on_done, rank))
        try:
            self._wait(waiter, batch.step_id, started)
        except WorkerGroupError:
            for future in futures:
                future.cancel()  # the group is rebuilt: nothing waits for the other ranks' replies
            raise
        replies = [future.result() for future in futures]
        elapsed = time.perf_counter() - started
        results = [step_pb2.StepResult.FromString(reply) for reply in replies]
        self._record(len(payload), [len(r) for r in replies], elapsed, max(r.compute_seconds for r in results))
        self.stats.last_round_trip_per_rank = [max(0.0, t - started) for t in waiter.finished_at]
        return results[0]

    def _wait(self, waiter: _StepWaiter, step_id: int, started: float) -> None:
        """Return when every rank replied; raise WorkerGroupError on the first failed, dead or hung rank."""
        # gRPC ends each call at its deadline; this bound only guards against a call that never completes.
        deadline = started + self._timeout + _DEADLINE_GRACE_S
        while not waiter.done.wait(min(self._liveness_interval, max(0.0, deadline - time.perf_counter()))):
            dead = self._dead_ranks() if self._dead_ranks is not None else []
            if dead:
                raise WorkerGroupError(f"rank {dead[0]} died during step {step_id}")
            if time.perf_counter() > deadline:
                raise WorkerGroupError(f"step {step_id} got no reply within {self._timeout:g}s (step deadline)")
        if waiter.failed is not None:
            rank, error = waiter.failed
            code = error.code() if hasattr(error, "code") else None
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise WorkerGroupError(
                    f"rank {rank} did not finish step {step_id} within {self._timeout:g}s (step deadline)"
                ) from error
            details = error.details() if hasattr(error, "details") else str(error)
            raise WorkerGroupError(f"rank {rank} failed during step {step_id}: {code}: {details}") from error

    def _record(self, sent: int, received: list[int], elapsed: float, compute: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.bytes_sent_per_rank = sent
        stats.bytes_received_per_rank = received
        stats.total_bytes_sent += sent * len(received)
        stats.total_bytes_received += sum(received)
        stats.round_trip_s.append(elapsed)
        stats.overhead_s.append(max(0.0, elapsed - compute))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
