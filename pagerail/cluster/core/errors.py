"""Errors the engine raises to callers that can act on them."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; the caller should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        # Crosses Ray process boundaries intact, retry hint included.
        return (QueueFullError, (str(self), self.retry_after_s))
