"""Translations for the public gRPC API: messages to sampling params, deltas to messages, errors to status codes."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.frontend.errors import APIError
from pagerail.cluster.frontend.output_processor import ChoiceDelta
from pagerail.cluster.routing.failover import is_replica_failure
from pagerail.common.sampling_params import SamplingParams
from pagerail.common.structured_outputs import StructuredOutputs
from pagerail.proto import api_pb2

logger = logging.getLogger(__name__)

# The gRPC status of an HTTP API error, by its HTTP status.
_HTTP_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}

# Each member of the `constraint` oneof and the StructuredOutputs field it fills.
_CONSTRAINT_KINDS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_CONSTRAINT_KINDS["json_object"] = "json_object"
# The message's other fields carry SamplingParams fields of the same name, read by the descriptor: (name, has
# presence, repeated). A field without presence has SamplingParams' default as its proto3 zero value.
_FIELDS = tuple(
    (field.name, field.has_presence, field.is_repeated)
    for field in api_pb2.SamplingParams.DESCRIPTOR.fields
    if field.name not in _CONSTRAINT_KINDS
)


# logit_bias, a map: {token id: bias}. allowed_token_ids: empty means any token (SamplingParams' None).
_MAPS = frozenset(
    field.name
    for field in api_pb2.SamplingParams.DESCRIPTOR.fields
    if field.message_type is not None and field.message_type.GetOptions().map_entry
)
_NONE_WHEN_EMPTY = frozenset({"allowed_token_ids"})


def sampling_params_from_proto(message: api_pb2.SamplingParams) -> SamplingParams:
    """SamplingParams from its message; raises ValueError naming the bad field. Absent max_tokens means no limit."""
    kwargs: dict[str, Any] = {"max_tokens": None}
    for name, has_presence, repeated in _FIELDS:
        if name in _MAPS:
            kwargs[name] = dict(getattr(message, name))
        elif repeated:
            values = tuple(getattr(message, name))
            kwargs[name] = None if not values and name in _NONE_WHEN_EMPTY else values
        elif not has_presence or message.HasField(name):
            kwargs[name] = getattr(message, name)
    kwargs["structured_outputs"] = structured_outputs_from_proto(message)
    return SamplingParams(**kwargs)


def constraint_field(message: api_pb2.SamplingParams) -> str | None:
    """The request field that carries the message's constraint ("sampling_params.regex", ...), or None."""
    name = message.WhichOneof("constraint")
    if name is None or (name == "json_object" and not message.json_object):
        return None
    return f"sampling_params.{name}"


def structured_outputs_from_proto(message: api_pb2.SamplingParams) -> StructuredOutputs | None:
    """The constraint of the `constraint` oneof, or None; raises ValueError naming the request field.

    json_object set to false is the same as no constraint: proto3 reads a false bool as off.
    """
    field = constraint_field(message)
    if field is None:
        return None
    name = field.removeprefix("sampling_params.")
    kind = _CONSTRAINT_KINDS[name]
    value: Any = getattr(message, name)
    if name == "choice":
        value = tuple(value.choices)
    try:
        return StructuredOutputs(**{kind: value})
    except ValueError as error:
        # Its messages name StructuredOutputs' own fields; a gRPC caller knows the message's.
        raise ValueError(str(error).replace(f"structured_outputs.{kind}", field, 1)) from None


def token_logprobs(delta: ChoiceDelta) -> list[api_pb2.TokenLogprob]:
    """One TokenLogprob per new token of `delta`, its alternatives most likely first."""
    out = []
    for i, (token, logprob) in enumerate(zip(delta.token_ids, delta.logprobs, strict=False)):
        top = delta.top_logprobs[i] if i < len(delta.top_logprobs) else {}
        ranked = sorted(top.items(), key=lambda item: -item[1])
        top_messages = [api_pb2.TopLogprob(token_id=t, logprob=p) for t, p in ranked]
        out.append(api_pb2.TokenLogprob(token_id=token, logprob=logprob, top_logprobs=top_messages))
    return out


def prompt_token_logprobs(prompt_ids: list[int], scored: list) -> list[api_pb2.TokenLogprob]:
    """One TokenLogprob per scored prompt token (every one after the first), its alternatives most likely first."""
    out = []
    for token, entry in zip(prompt_ids[1:], scored[1:], strict=False):
        logprob, _, top = entry if entry is not None else (0.0, 0, {})
        ranked = sorted(top.items(), key=lambda item: -item[1])
        top_messages = [api_pb2.TopLogprob(token_id=t, logprob=p) for t, p in ranked]
        out.append(api_pb2.TokenLogprob(token_id=token, logprob=logprob, top_logprobs=top_messages))
    return out


def usage(delta: RequestDelta, num_output_tokens: int) -> api_pb2.Usage:
    """The request's usage: its prompt, the output tokens the caller received, the prefix-cache hit."""
    return api_pb2.Usage(
        prompt_tokens=delta.num_prompt_tokens,
        completion_tokens=num_output_tokens,
        cached_tokens=delta.num_cached_tokens,
    )


def numeric_stats(values: dict, prefix: str = "") -> dict[str, float]:
    """The numbers in a (nested) stats dict, keys joined with "."; the rest does not fit a map of doubles."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(numeric_stats(value, f"{prefix}{key}."))
        elif isinstance(value, int | float):
            out[f"{prefix}{key}"] = float(value)
    return out


class RpcError(Exception):
    """A failure answered with its own status code (ValueError and QueueFullError have theirs)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@contextlib.asynccontextmanager
async def status_on_error(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Answer a failed RPC with a status code a client can act on, never a bare crash."""
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except QueueFullError as exc:
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))  # whole seconds, as HTTP's Retry-After
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry after {retry_after} s", (("retry-after", retry_after),)
        )
    except RpcError as exc:
        await context.abort(exc.code, exc.details)
    except APIError as exc:  # from the HTTP API's code paths that gRPC shares (the Responses API)
        code = _HTTP_STATUS_CODES.get(exc.status, grpc.StatusCode.INTERNAL)
        details = f"{exc.param}: {exc.message}" if exc.param and exc.param not in exc.message else exc.message
        await context.abort(code, details)
    except Exception as exc:
        if is_replica_failure(exc):  # e.g. a streaming-input session whose replica died: retriable elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        logger.exception("gRPC request failed")
        await context.abort(grpc.StatusCode.INTERNAL, "internal server error")
