"""The bearer token that authenticates the head to its workers, as both sides put it in gRPC metadata."""

from __future__ import annotations

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
