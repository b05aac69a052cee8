"""A no-op stand-in for the parts of `opentelemetry.trace` pagerail uses, for processes without the package."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

# Without the package nothing can export, so tracing stays off: every span is the one invalid,
# non-recording span, and context propagation carries nothing.


class TraceFlags(int):
    @property
    def sampled(self) -> bool:
        return False


class SpanContext:
    """The invalid span context: what a process that never traces sees everywhere."""

    def __init__(self, trace_id: int = 0, span_id: int = 0, is_remote: bool = False, **_: Any) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.is_remote = is_remote
        self.trace_flags = TraceFlags(0)

    @property
    def is_valid(self) -> bool:
        return False


class StatusCode(enum.Enum):
    ERROR = 2


class SpanKind(enum.Enum):
    SERVER = 1


class Link:
    def __init__(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        self.context = context
        self.attributes = attributes


class NonRecordingSpan:
    """A span that records nothing; every method the engine calls on a span is accepted and ignored."""

    def __init__(self, context: SpanContext) -> None:
        self._context = context

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        pass

    def set_status(self, status: Any, description: str | None = None) -> None:
        pass

    def end(self, end_time: int | None = None) -> None:
        pass

    def __enter__(self) -> NonRecordingSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


Span = NonRecordingSpan
INVALID_SPAN_CONTEXT = SpanContext()
INVALID_SPAN = NonRecordingSpan(INVALID_SPAN_CONTEXT)


class Tracer:
    def start_span(self, name: str, *args: Any, **kwargs: Any) -> NonRecordingSpan:
        return INVALID_SPAN

    def start_as_current_span(self, name: str, *args: Any, **kwargs: Any) -> AbstractContextManager[NonRecordingSpan]:
        return nullcontext(INVALID_SPAN)


_TRACER = Tracer()


def get_tracer(name: str, *args: Any, **kwargs: Any) -> Tracer:
    return _TRACER


def get_current_span(context: Mapping[str, Any] | None = None) -> NonRecordingSpan:
    return INVALID_SPAN


def set_span_in_context(span: NonRecordingSpan, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {}


class propagate:  # noqa: N801 - stands in for the `opentelemetry.propagate` module
    @staticmethod
    def inject(carrier: dict[str, str], context: Mapping[str, Any] | None = None, **_: Any) -> None:
        pass

    @staticmethod
    def extract(carrier: Mapping[str, str], context: Mapping[str, Any] | None = None, **_: Any) -> dict[str, Any]:
        return {}


class context:  # noqa: N801 - stands in for the `opentelemetry.context` module
    Context = dict
