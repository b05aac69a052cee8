"""An OTLP/gRPC trace receiver on loopback that keeps every exported span with its resource's attributes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs) -> dict:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict
    resource: dict
    events: list[tuple[str, dict]] = field(default_factory=list)
    links: list[tuple[str, str, dict]] = field(default_factory=list)  # (trace id, span id, attributes)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`with OtlpReceiver() as endpoint:` collects spans sent to `endpoint` (http://127.0.0.1:port) until the end."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.endpoint = ""

    def Export(self, request, context):  # noqa: N802
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            events=[(event.name, _attributes(event.attributes)) for event in span.events],
                            links=[
                                (link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                                for link in span.links
                            ],
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """The spans so far, once `predicate` holds for them (or when `timeout_s` has passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)
