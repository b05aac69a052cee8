"""OpenTelemetry tracing for every pagerail process: one provider per process, W3C context across the hops."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from urllib.parse import urlsplit

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace

    OTEL_AVAILABLE = True
except ImportError:
    # Tracing is optional: a bare inference machine runs without the package and tracing simply stays off.
    from pagerail.common import otel_noop as trace
    from pagerail.common.otel_noop import context as otel_context
    from pagerail.common.otel_noop import propagate

    OTEL_AVAILABLE = False

logger = logging.getLogger(__name__)

RANK_ATTRIBUTE = "pagerail.tensor_parallel_rank"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
LINK_LIMIT_ENV = "OTEL_SPAN_LINK_COUNT_LIMIT"
# A step span links to every request it runs (up to max_num_seqs): the SDK's default of 128 would cut them short.
DEFAULT_LINK_LIMIT = 4096

_provider = None  # the SDK TracerProvider this module installed; None while tracing is off
_NOT_TRACED = nullcontext(trace.INVALID_SPAN)


def check_sampling_ratio(ratio: float) -> float:
    """Return `ratio` if it is a valid trace sampling ratio, else raise ValueError."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"trace sampling ratio must be a number in [0, 1], got {ratio!r}")
    return float(ratio)


def configure_tracing(
    service_name: str,
    *,
    endpoint: str | None,
    sampling_ratio: float = 1.0,
    rank: int | None = None,
    exporter=None,
    respect_remote_sampling: bool = True,
) -> bool:
    """Install this process's TracerProvider, exporting to `endpoint` over OTLP (or to `exporter`).

    Without an endpoint or exporter nothing is installed: every tracer stays the API's no-op one, so tracing
    off costs a no-op call per span. Only the first call in a process installs anything; returns whether
    tracing is on. `respect_remote_sampling`: see make_sampler.
    """
    global _provider
    check_sampling_ratio(sampling_ratio)
    if _provider is not None:
        return True
    if endpoint is None and exporter is None:
        return False
    if not OTEL_AVAILABLE:
        raise ImportError(
            f"tracing to endpoint={endpoint!r} needs the opentelemetry-sdk and opentelemetry-exporter-otlp "
            "packages, which are not installed (pip install opentelemetry-sdk opentelemetry-exporter-otlp)"
        )
    # Imported here: a process with tracing off never loads the SDK or an exporter.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes: dict[str, str | int] = {
        "service.name": service_name,
        "service.instance.id": uuid.uuid4().hex,
        "process.pid": os.getpid(),
    }
    if rank is not None:
        attributes[RANK_ATTRIBUTE] = rank
    provider = TracerProvider(
        resource=Resource.create(attributes),
        sampler=make_sampler(sampling_ratio, respect_remote_sampling=respect_remote_sampling),
        span_limits=SpanLimits(max_links=int(os.environ.get(LINK_LIMIT_ENV, DEFAULT_LINK_LIMIT))),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter if exporter is not None else otlp_exporter(endpoint)))
    trace.set_tracer_provider(provider)
    _provider = provider
    logger.info("tracing on: %s exports to %s", service_name, endpoint or type(exporter).__name__)
    return True


def make_sampler(ratio: float, *, respect_remote_sampling: bool = True):
    """The sampler of a process that keeps `ratio` of the traces it starts.

    With `respect_remote_sampling` (head, workers) a span whose parent came from another process follows that
    parent's decision, so a trace is kept or dropped whole. Without it (the frontend, whose remote parents are
    clients) the ratio decides even for a client's trace: a client cannot force tracing on every rank, yet its
    trace id is still continued. Spans under a parent in the same process always follow it.
    """
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    root = TraceIdRatioBased(check_sampling_ratio(ratio))
    if respect_remote_sampling:
        return ParentBased(root)
    return ParentBased(root, remote_parent_sampled=root, remote_parent_not_sampled=root)


def otlp_exporter(endpoint: str):
    """OTLP over gRPC, or HTTP/protobuf when the standard protocol variable asks for it."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc").strip().lower()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        parts = urlsplit(endpoint)
        if parts.path in ("", "/"):
            # A bare collector address: the traces path is what the user means.
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol != "grpc":
        raise ValueError(f"{PROTOCOL_ENV} must be 'grpc' or 'http/protobuf', got {protocol!r}")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def tracing_enabled() -> bool:
    return _provider is not None


def get_tracer(name: str) -> trace.Tracer:
    """A tracer that follows the process's provider, even when taken before configure_tracing ran."""
    return trace.get_tracer(name)


def traced(tracer: trace.Tracer, name: str, **kwargs) -> AbstractContextManager[trace.Span]:
    """`tracer.start_as_current_span(name, ...)`, or a shared no-op when this process does not trace.

    For the per-step hot paths: with tracing off a span costs nothing but this call.
    """
    return tracer.start_as_current_span(name, **kwargs) if _provider is not None else _NOT_TRACED


def inject_carrier(context: otel_context.Context | None = None) -> dict[str, str] | None:
    """The current (or given) span context as a W3C carrier dict; None when there is no span to continue."""
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def extract_carrier(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """The context a W3C carrier names (the empty context for None)."""
    return propagate.extract(carrier or {})


def extract_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The context in a call's gRPC metadata (`context.invocation_metadata()`), ignoring binary entries."""
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier)


def flush(timeout_s: float = 10.0) -> bool:
    """Export every finished span this process still buffers; True when done (or when tracing is off)."""
    if _provider is None:
        return True
    return _provider.force_flush(int(timeout_s * 1000))
