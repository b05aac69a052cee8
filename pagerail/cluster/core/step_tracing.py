"""Spans of the engine loop: one `engine.step` per step, with its `schedule` and `dispatch` children.

A step serves many requests, so it cannot be the child of each: it carries a span link to the request span
(the frontend's SERVER span, whose W3C carrier the request brought along) of every request it schedules,
one link per request span (the n choices of a request share theirs), without attributes, as links cost
per request per step. When all of a step's requests come from one request span (a lone request, or the n
choices of one), the step is also that span's child, so a quiet server yields one connected trace from the
HTTP call down to every rank; with several, the step is a root and the links lead from it to the requests.

Span events belong to the process that owns the span, so the head cannot add `scheduled` and `preempted`
to the frontend's request span: they are events on the step span, with the request ids in
`pagerail.request_ids`.
"""

from __future__ import annotations

import functools
import time
from contextlib import AbstractContextManager, nullcontext

from pagerail.cluster.core.request import Request
from pagerail.cluster.core.scheduler_output import SchedulerOutput

# `trace` is OpenTelemetry's, or a no-op stand-in when the package is missing (tracing is then always off).
from pagerail.common.telemetry import extract_carrier, get_tracer, trace, tracing_enabled
from pagerail.proto import step_pb2

REQUEST_IDS = "pagerail.request_ids"

_tracer = get_tracer("pagerail.engine")


@functools.lru_cache(maxsize=4096)
def _parse(traceparent: str, tracestate: str) -> trace.SpanContext:
    # Cached: a request is linked from every step it runs in, its carrier parsed once.
    carrier = {"traceparent": traceparent, "tracestate": tracestate} if tracestate else {"traceparent": traceparent}
    return trace.get_current_span(extract_carrier(carrier)).get_span_context()


def request_span_context(request: Request) -> trace.SpanContext | None:
    """The request span a request was sent from, or None for an untraced request."""
    carrier = request.trace_context
    if not carrier or "traceparent" not in carrier:
        return None
    context = _parse(carrier["traceparent"], carrier.get("tracestate", ""))
    return context if context.is_valid else None


def start_step_span(out: SchedulerOutput, started_ns: int) -> trace.Span:
    """The step's span, begun when scheduling began, with a finished `schedule` child; end it with end_step_span."""
    if not tracing_enabled():
        return trace.INVALID_SPAN
    scheduled_ns = time.time_ns()
    # The distinct request spans of this step's requests, keyed by (trace id, span id).
    sources: dict[tuple[int, int], trace.SpanContext] = {}
    for item in out.scheduled:
        context = request_span_context(item.request)
        if context is not None:
            sources[context.trace_id, context.span_id] = context
    parent = None
    if len(sources) == 1:
        parent = trace.set_span_in_context(trace.NonRecordingSpan(next(iter(sources.values()))))
    links = [trace.Link(context) for context in sources.values() if context.trace_flags.sampled]
    span = _tracer.start_span(
        "engine.step",
        context=parent,
        links=links,
        start_time=started_ns,
        attributes={
            "pagerail.num_scheduled_requests": len(out.scheduled),
            "pagerail.num_batched_tokens": out.num_batched_tokens,
        },
    )
    if not span.is_recording():
        return span
    schedule = _tracer.start_span("schedule", context=trace.set_span_in_context(span), start_time=started_ns)
    schedule.set_attribute("pagerail.num_preempted_requests", len(out.preempted))
    schedule.end(end_time=scheduled_ns)
    admitted = [item.request.request_id for item in out.scheduled if item.admitted]
    if admitted:
        span.add_event("scheduled", {REQUEST_IDS: admitted}, timestamp=scheduled_ns)
    if out.preempted:
        span.add_event("preempted", {REQUEST_IDS: [r.request_id for r in out.preempted]}, timestamp=scheduled_ns)
    return span


def dispatch_span(step: trace.Span, batch: step_pb2.StepBatch) -> AbstractContextManager:
    """The executor call, current while it runs so the gRPC transport can carry it to the ranks."""
    # A sampled-out step still has a valid context: it must travel, so the ranks drop their spans too.
    if not step.get_span_context().is_valid:
        return nullcontext()
    return _tracer.start_as_current_span(
        "dispatch", context=trace.set_span_in_context(step), attributes={"pagerail.step_id": batch.step_id}
    )


def end_step_span(
    step: trace.Span, error: BaseException | None = None, result: step_pb2.StepResult | None = None
) -> None:
    if result is not None and result.moe_collective_bytes and step.is_recording():
        step.set_attribute("pagerail.moe_collective_bytes", result.moe_collective_bytes)
    if error is not None and step.is_recording():
        step.record_exception(error)
        step.set_status(trace.StatusCode.ERROR, str(error))
    step.end()
