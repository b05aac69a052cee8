"""Bearer tokens in gRPC metadata and HTTP headers: the head's token to its workers, and the check every server
makes of the key a caller presents."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

AUTH_METADATA_KEY = "authorization"
SCHEME = "bearer"


def check_token(token: str) -> str:
    """Return `token` if it can travel as a bearer token in gRPC metadata, else raise ValueError."""
    if not isinstance(token, str) or not token:
        raise ValueError("the worker token must be a non-empty string")
    # gRPC metadata values must be printable ASCII; a space would also break the "Bearer <token>" split.
    if not all("!" <= char <= "~" for char in token):
        raise ValueError("the worker token must be printable ASCII without spaces")
    return token


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a client to a worker holding the same token."""
    return ((AUTH_METADATA_KEY, f"Bearer {check_token(token)}"),)


def bearer_token(value: str) -> str | None:
    """The token of an authorization value `Bearer <token>` (the scheme in any case); None for anything else."""
    scheme, _, token = value.strip().partition(" ")
    return token.strip() or None if scheme.lower() == SCHEME else None


def bearer_matches(value: str, expected: bytes) -> bool:
    """Whether an authorization value is `Bearer <expected>` (the scheme in any case). The comparison takes
    constant time, so the time taken does not tell how much of a guess was right."""
    token = bearer_token(value)
    return token is not None and hmac.compare_digest(token.encode(), expected)


def refusing_handler(handler: grpc.RpcMethodHandler | None, refuse: Callable[[Any, Any], Any]) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` (so the call is read as the client sends it) that only
    runs `refuse(request, context)`; a unary one when there is no handler."""
    streaming = (handler is not None and handler.request_streaming, handler is not None and handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[streaming]
    if handler is None:
        return make(refuse)
    return make(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
