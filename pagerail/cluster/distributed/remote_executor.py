"""Drives one worker group over gRPC: each StepBatch serialized once and written to every rank's ordered step stream,
the ranks' replies matched to their step, and a failed, dead or hung rank turned into a WorkerGroupError."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from pagerail.cluster.core.executor import CompletedStep, PendingStep, WorkerGroupError
from pagerail.cluster.distributed.cluster_options import DEFAULT_OPTIONS
from pagerail.cluster.distributed.dispatch_stats import DispatchStats
from pagerail.cluster.distributed.step_streams import StepStreamError, StepStreams
from pagerail.common.auth import auth_metadata
from pagerail.common.telemetry import inject_carrier
from pagerail.common.tls import TlsConfig
from pagerail.proto import step_pb2

__all__ = ["DispatchStats", "RemoteExecutor"]


class _StreamedStep:
    """A step written to every rank's stream; filled in by the streams' thread as the replies arrive."""

    def __init__(self, executor: RemoteExecutor, step_id: int, num_ranks: int, sent: int) -> None:
        self._executor = executor
        self.step_id = step_id
        self.sent = sent
        self.could_start: float | None = None  # perf_counter; set once no earlier step is in flight
        self.since_previous: float | None = None  # from the previous step's last reply to this one's
        self.results: list[step_pb2.StepResult | None] = [None] * num_ranks
        self.received = [0] * num_ranks
        self.arrived = [0.0] * num_ranks
        self.remaining = num_ranks
        self.error: WorkerGroupError | None = None
        self.done = threading.Event()
        self._recorded = False

    def result(self) -> step_pb2.StepResult:
        """Wait for every rank's reply (all ranks at once) and return rank 0's, or raise WorkerGroupError."""
        if not self.done.is_set():
            self._executor.wait(self)
        if self.error is not None:
            raise self.error
        if not self._recorded:
            self._recorded = True
            self._executor.record(self)
        return self.results[0]


class RemoteExecutor:
    """gRPC client of one worker group: one persistent step stream per rank, opened when the group starts.

    `submit` writes the step to every stream and returns; each rank runs its steps one at a time in stream order,
    so step N+1 can wait on the ranks while step N computes. A step's deadline (`step_timeout_s`) counts from when
    the ranks could start it: its submission, or the arrival of the previous step's last reply if that came later.
    After the first failure every step in flight fails and the streams are cancelled: the group is to be rebuilt.
    """

    def __init__(
        self,
        addresses: list[str],
        token: str,
        tls: TlsConfig | None = None,
        step_timeout_s: float = DEFAULT_OPTIONS.step_timeout_s,
        dead_ranks: Callable[[], list[int]] | None = None,
        liveness_interval_s: float = 1.0,
    ) -> None:
        """`dead_ranks`: asked every `liveness_interval_s` while a step runs, the ranks whose process is known dead
        (a rank on a lost node may leave its connection open until the deadline); it must not block.
        Raises WorkerGroupError when a rank refuses its stream (wrong token, unreachable)."""
        self._num_ranks = len(addresses)
        self._timeout = step_timeout_s
        self._dead_ranks = dead_ranks
        self._liveness_interval = liveness_interval_s
        self._lock = threading.Lock()  # the engine's thread and the streams' thread both update what follows
        self._inflight: deque[_StreamedStep] = deque()  # not yet answered by every rank, oldest first
        self._awaiting = [deque() for _ in addresses]  # per rank, the steps it has not answered, oldest first
        self._failure: WorkerGroupError | None = None
        self._last_done: float | None = None  # arrival of the latest completed step's last reply
        self.stats = DispatchStats()
        self._streams: StepStreams | None = None
        try:
            streams = StepStreams(addresses, auth_metadata(token), tls, self._on_reply, self._on_end)
        except StepStreamError as error:
            raise WorkerGroupError(str(error)) from error
        with self._lock:
            self._streams = streams
            if self._failure is not None:  # a rank's stream ended while the others were still opening
                streams.cancel()

    def submit(self, batch: step_pb2.StepBatch) -> PendingStep:
        """Queue the step on every rank's stream and return at once."""
        payload = batch.SerializeToString()
        # The current (dispatch) span travels in the step, so each rank's step span is its child. Protobuf merges
        # concatenated messages: appending the field spares copying or changing the engine's batch.
        carrier = inject_carrier()
        if carrier:
            payload += step_pb2.StepBatch(trace_context=carrier).SerializeToString()
        with self._lock:
            if self._failure is not None:
                return CompletedStep(error=WorkerGroupError(f"step {batch.step_id} was not run: {self._failure}"))
            step = _StreamedStep(self, batch.step_id, self._num_ranks, len(payload))
            if not self._inflight:
                step.could_start = time.perf_counter()
            self._inflight.append(step)
            for awaiting in self._awaiting:
                awaiting.append(step)
            # Under the lock: the order on the streams is the order recorded above.
            self._streams.send(payload)
        return step

    def wait(self, step: _StreamedStep) -> None:
        """Return once `step` is done (answered or failed), checking for dead and hung ranks meanwhile."""
        while not step.done.wait(self._wait_interval()):
            dead = self._dead_ranks() if self._dead_ranks is not None else []
            with self._lock:
                if self._failure is not None or not self._inflight:
                    continue
                oldest = self._inflight[0]
                if dead:
                    self._fail(WorkerGroupError(f"rank {dead[0]} died during step {oldest.step_id}"), oldest)
                elif time.perf_counter() > oldest.could_start + self._timeout:
                    silent = [rank for rank, result in enumerate(oldest.results) if result is None]
                    self._fail(
                        WorkerGroupError(
                            f"rank {silent[0]} did not finish step {oldest.step_id} within {self._timeout:g}s "
                            "(step deadline)"
                        ),
                        oldest,
                    )

    def record(self, step: _StreamedStep) -> None:
        """Add a completed step to the figures; on the engine's thread, once per step, in order."""
        started = step.could_start
        self.stats.record(
            step.sent,
            step.received,
            [max(0.0, arrived - started) for arrived in step.arrived],
            max(result.compute_seconds for result in step.results),
            step.since_previous,
        )

    def close(self) -> None:
        """Fail what is still in flight and tear the streams down; safe to call more than once."""
        with self._lock:
            if self._failure is None:
                self._fail(WorkerGroupError("the worker group was stopped"), None)
        if self._streams is not None:
            self._streams.close()

    # -- bookkeeping ----------------------------------------------------------------------------

    def _wait_interval(self) -> float:
        """Until the next liveness check, or sooner if the oldest step's deadline comes first."""
        with self._lock:
            if self._failure is not None or not self._inflight:
                return self._liveness_interval
            left = self._inflight[0].could_start + self._timeout - time.perf_counter()
        return max(0.0, min(self._liveness_interval, left))

    def _on_reply(self, rank: int, reply: bytes, arrived: float) -> None:
        """On the streams' thread: match a rank's reply to the oldest step it has not answered."""
        try:
            result = step_pb2.StepResult.FromString(reply)
        except DecodeError as error:
            with self._lock:
                if self._failure is None:
                    awaiting = self._awaiting[rank]
                    failure = WorkerGroupError(f"rank {rank} sent an unreadable step result: {error}")
                    self._fail(failure, awaiting[0] if awaiting else None)
            return
        with self._lock:
            if self._failure is not None:
                return
            awaiting = self._awaiting[rank]
            if not awaiting or awaiting[0].step_id != result.step_id:
                expected = f"step {awaiting[0].step_id}" if awaiting else "no step"
                error = WorkerGroupError(f"rank {rank} answered step {result.step_id} while {expected} was due")
                self._fail(error, awaiting[0] if awaiting else None)
                return
            if result.error:
                # The rank's own account of its failure, read before the stream's end could blur it.
                failure = WorkerGroupError(f"rank {rank} failed during step {result.step_id}: {result.error}")
                self._fail(failure, awaiting[0])
                return
            step = awaiting.popleft()
            step.results[rank] = result
            step.received[rank] = len(reply)
            step.arrived[rank] = arrived
            step.remaining -= 1
            if step.remaining:
                return
            # Every rank answers in order, so a step all of them answered is the oldest in flight.
            self._inflight.popleft()
            if self._last_done is not None:
                step.since_previous = arrived - self._last_done
            self._last_done = arrived
            if self._inflight:
                self._inflight[0].could_start = arrived
        step.done.set()

    def _on_end(self, rank: int, error: grpc.aio.AioRpcError | None) -> None:
        """On the streams' thread: a rank's stream ended, which only a failed or dying rank does."""
        with self._lock:
            if self._failure is not None:
                return
            awaiting = self._awaiting[rank]
            step = awaiting[0] if awaiting else None
            during = f"during step {step.step_id}" if step is not None else "between steps"
            if error is None:
                failure = WorkerGroupError(f"rank {rank} closed its step stream {during}")
            else:
                failure = WorkerGroupError(f"rank {rank} failed {during}: {error.code()}: {error.details()}")
            self._fail(failure, step)

    def _fail(self, error: WorkerGroupError, culprit: _StreamedStep | None) -> None:
        """With the lock held: fail every step in flight (`culprit` with `error` itself) and end the streams."""
        self._failure = error
        for step in self._inflight:
            step.error = error if step is culprit else WorkerGroupError(f"step {step.step_id} was abandoned: {error}")
            step.done.set()
        self._inflight.clear()
        for awaiting in self._awaiting:
            awaiting.clear()
        if self._streams is not None:
            self._streams.cancel()
