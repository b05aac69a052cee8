"""Sends each StepBatch to every tensor-parallel rank over gRPC at once and keeps the dispatch figures."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from cluster.executor import WorkerGroupError
from proto import step_pb2
from worker.grpc_server import auth_metadata
from worker.telemetry import inject_metadata
from worker.tls import TlsConfig

_EXECUTE_STEP = "/pagerail.worker.WorkerService/ExecuteStep"
_MAX_MESSAGE = 256 << 20


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


class RemoteExecutor:
    """gRPC client of one worker group: the same serialized message to every rank, concurrently."""

    def __init__(
        self, addresses: list[str], token: str, tls: TlsConfig | None = None, step_timeout_s: float = 300.0
    ) -> None:
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
        self.stats = DispatchStats()

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        payload = batch.SerializeToString()
        started = time.perf_counter()
        finished_at = [0.0] * len(self._calls)
        # The current (dispatch) span travels with the token, so each rank's ExecuteStep span is its child.
        metadata = (*self._metadata, *inject_metadata())
        try:
            futures = [call.future(payload, metadata=metadata, timeout=self._timeout) for call in self._calls]
            for rank, future in enumerate(futures):
                future.add_done_callback(lambda _, rank=rank: finished_at.__setitem__(rank, time.perf_counter()))
            replies = []
            for rank, future in enumerate(futures):
                replies.append(future.result())
                # The done callback may run a moment after result() returns: fall back to now.
                finished_at[rank] = finished_at[rank] or time.perf_counter()
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else None
            raise WorkerGroupError(f"a worker rank failed during step {batch.step_id}: {code}") from error
        elapsed = time.perf_counter() - started
        results = [step_pb2.StepResult.FromString(reply) for reply in replies]
        self._record(len(payload), [len(r) for r in replies], elapsed, max(r.compute_seconds for r in results))
        self.stats.last_round_trip_per_rank = [max(0.0, t - started) for t in finished_at]
        return results[0]

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
