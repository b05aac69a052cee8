"""The gRPC server a worker rank runs for its head: bearer-token auth, optional TLS, steps one at a time in order."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import nullcontext
from typing import Any

import grpc

from pagerail.common.auth import AUTH_METADATA_KEY, bearer_matches, check_token, refusing_handler
from pagerail.common.telemetry import RANK_ATTRIBUTE, extract_carrier, get_tracer, trace, tracing_enabled
from pagerail.common.tls import TlsConfig
from pagerail.proto import STEP_LINK_OPTIONS, step_pb2, worker_pb2_grpc
from pagerail.worker.step_stream import serve_step_stream
from pagerail.worker.worker import Worker

logger = logging.getLogger(__name__)
_tracer = get_tracer("pagerail.worker")

# The head's step stream holds one thread for its lifetime; the spare ones refuse bad calls.
_NUM_THREADS = 4


def _refuse(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks `authorization: Bearer <token>` with this server's token."""

    def __init__(self, token: str) -> None:
        self._expected = check_token(token).encode()

    def _authorized(self, metadata: tuple[Any, ...] | None) -> bool:
        values = [item.value for item in metadata or () if item.key == AUTH_METADATA_KEY]
        # Two authorization entries are ambiguous; refuse rather than guess which one counts.
        return len(values) == 1 and isinstance(values[0], str) and bearer_matches(values[0], self._expected)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if self._authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        logger.warning("refused an unauthenticated call to %s", handler_call_details.method)
        return refusing_handler(continuation(handler_call_details), _refuse)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Serves one Worker: steps one at a time, from the head's stream, in order."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        # The model runner keeps per-request state and the KV cache; two steps at once would corrupt both.
        self._step_lock = threading.Lock()

    def StepStream(
        self, request_iterator: Iterator[step_pb2.StepBatch], context: grpc.ServicerContext
    ) -> Iterator[step_pb2.StepResult]:
        """The steps in the order they arrive, each answered in turn; the head queues step N+1 while step N runs.
        A failed step ends the stream with INTERNAL, and the steps queued behind it are not run."""
        return serve_step_stream(request_iterator, context, self._run_step, self._step_span, self.worker.tp.rank)

    def _run_step(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        with self._step_lock:
            return self.worker.execute_step(batch)

    def _step_span(self, batch: step_pb2.StepBatch):
        """A child of the head's dispatch span, whose context came in the batch; it includes the wait for the step
        lock."""
        if not tracing_enabled():
            return nullcontext()
        return _tracer.start_as_current_span(
            "ExecuteStep",
            context=extract_carrier(batch.trace_context),
            kind=trace.SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "pagerail.worker.WorkerService",
                "rpc.method": "StepStream",
                "pagerail.step_id": batch.step_id,
                RANK_ATTRIBUTE: self.worker.tp.rank,
            },
        )


def _bind_address(host: str, port: int) -> str:
    if not host:
        raise ValueError("host must be a non-empty address to bind, e.g. '127.0.0.1'")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in 0..65535 (0: any free port), got {port!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


def start_worker_server(
    worker: Worker, host: str, token: str, tls: TlsConfig | None = None, port: int = 0
) -> tuple[grpc.Server, int]:
    """Serve `worker` on `host`:`port` (0: the OS picks a free port) and return the running server and its port."""
    address = _bind_address(host, port)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=_NUM_THREADS, thread_name_prefix="worker-grpc"),
        interceptors=[TokenAuthInterceptor(token)],
        # Without so_reuseport off a second server could silently share a fixed port and steal half the calls.
        options=[*STEP_LINK_OPTIONS, ("grpc.so_reuseport", 0)],
    )
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(worker), server)
    try:
        bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError as error:
        raise RuntimeError(f"worker server could not bind {address}: {error}") from error
    if bound == 0:
        raise RuntimeError(f"worker server could not bind {address}")
    server.start()
    logger.info("rank %d: serving on %s:%d (%s)", worker.tp.rank, host, bound, "TLS" if tls else "plaintext")
    return server, bound
