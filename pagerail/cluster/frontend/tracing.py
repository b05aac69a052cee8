"""Request spans of the front doors: one SERVER span per OpenAI HTTP generation or gRPC Generate call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, StatusCode

from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.common.lora import LoRARequest
from pagerail.common.sampling_params import SamplingParams
from pagerail.common.telemetry import extract_metadata, get_tracer, inject_carrier, tracing_enabled

CACHED_TOKENS = "pagerail.usage.cached_tokens"
ENGINE_REQUEST_ID = "pagerail.engine_request_id"
CLIENT_REQUEST_ID = "pagerail.client_request_id"  # the caller's own X-Request-Id / gRPC request_id: a label

# The routes that run a generation, and the gen_ai operation each one is.
TRACED_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}

# The codes that mean the server failed, after OpenTelemetry's RPC conventions; the others are the caller's doing.
_GRPC_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

_tracer = get_tracer("pagerail.frontend")


async def traced_http(app, scope: dict, receive: Callable, send: Callable, headers: Mapping[str, str]) -> None:
    """Run the ASGI `app` for one request; a generation route runs inside its SERVER span.

    The span continues the caller's trace when the request carries a W3C `traceparent` header, and is current
    while the route runs and its response streams, so the route and the engine client find it.
    """
    operation = TRACED_ROUTES.get(scope["path"])
    if operation is None or scope.get("method") != "POST" or not tracing_enabled():
        await app(scope, receive, send)
        return
    attributes = {
        "http.request.method": "POST",
        "http.route": scope["path"],
        "url.path": scope["path"],
        "gen_ai.operation.name": operation,
        "gen_ai.system": "pagerail",
    }
    client_label = scope.get("state", {}).get("client_request_id")
    if client_label:
        attributes[CLIENT_REQUEST_ID] = client_label
    with _tracer.start_as_current_span(
        f"POST {scope['path']}", context=propagate.extract(headers), kind=SpanKind.SERVER, attributes=attributes
    ) as span:

        async def send_traced(message: dict) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)
            await send(message)

        await app(scope, receive, send_traced)


def start_grpc_span(method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> trace.Span:
    """A SERVER span for one call of the public gRPC API, continuing the trace in its metadata; the caller ends it."""
    return _tracer.start_span(
        f"pagerail.api.Generation/{method}",
        context=extract_metadata(metadata),
        kind=SpanKind.SERVER,
        attributes={
            "rpc.system": "grpc",
            "rpc.service": "pagerail.api.Generation",
            "rpc.method": method,
            "gen_ai.operation.name": "text_completion",
            "gen_ai.system": "pagerail",
        },
    )


def end_grpc_span(span: trace.Span, code: grpc.StatusCode | None) -> None:
    """End a call's span with the status code it answered (None: OK)."""
    if span.is_recording():
        code = code or grpc.StatusCode.OK
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code in _GRPC_SERVER_ERRORS:
            span.set_status(StatusCode.ERROR, code.name)
    span.end()


def annotate_request(span: trace.Span, request_id: str, model: str, params: SamplingParams | None) -> None:
    """The gen_ai request attributes of a request span."""
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.request.id", request_id)
    span.set_attribute("gen_ai.request.model", model)
    if params is None:
        return
    span.set_attribute("gen_ai.request.temperature", params.temperature)
    span.set_attribute("gen_ai.request.top_p", params.top_p)
    span.set_attribute("gen_ai.request.n", params.n)
    if params.max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", params.max_tokens)
    if params.seed is not None:
        span.set_attribute("gen_ai.request.seed", params.seed)


def annotate_adapter(span: trace.Span, lora: LoRARequest | None) -> None:
    """The LoRA adapter a request runs with, on its span."""
    if lora is not None and span.is_recording():
        span.set_attribute("pagerail.lora.adapter", lora.lora_name)
        span.set_attribute("pagerail.lora.id", lora.lora_int_id)


def annotate_tenant(span: trace.Span, tenant: str, priority: int, service_tier: str = "default") -> None:
    """The request's tenant (--tenants; `default` for every other key), scheduling priority and service tier, on
    its span."""
    if span.is_recording():
        span.set_attribute("pagerail.tenant", tenant)
        span.set_attribute("pagerail.priority", priority)
        span.set_attribute("pagerail.service_tier", service_tier)


def engine_carrier(span: trace.Span) -> dict[str, str] | None:
    """The W3C carrier the engine request takes along, so the head's step spans can link to `span`."""
    return inject_carrier(trace.set_span_in_context(span)) if span.get_span_context().is_valid else None


def record_queued(span: trace.Span, engine_request_id: str) -> None:
    """The request (one choice of it) was handed to the engine."""
    if span.is_recording():
        span.add_event("queued", {ENGINE_REQUEST_ID: engine_request_id})


def record_delta(span: trace.Span, engine_request_id: str, delta: RequestDelta) -> None:
    """`first_token` when this delta carries the request's first output tokens."""
    if span.is_recording() and delta.token_ids and delta.num_output_tokens == len(delta.token_ids):
        span.add_event("first_token", {ENGINE_REQUEST_ID: engine_request_id})


def record_finished(span: trace.Span, engine_request_id: str, reason: str | None, num_output_tokens: int) -> None:
    if span.is_recording():
        attributes = {ENGINE_REQUEST_ID: engine_request_id, "pagerail.num_output_tokens": num_output_tokens}
        if reason is not None:
            attributes["gen_ai.response.finish_reason"] = reason
        span.add_event("finished", attributes)


def record_usage(span: trace.Span, input_tokens: int, output_tokens: int, cached_tokens: int) -> None:
    """Token counts so far; the last call, when the last choice finishes, leaves the request's totals."""
    if span.is_recording():
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        span.set_attribute(CACHED_TOKENS, cached_tokens)
