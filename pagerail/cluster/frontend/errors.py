"""API errors in OpenAI's shape, and the mapping from validation failures to them."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import ValidationError

INVALID_REQUEST = "invalid_request_error"

# A message that opens with a field path and a verb, e.g. "top_p must be in (0, 1]" or "messages[2].content is empty".
_FIELD_AT_START = re.compile(
    r"^(?P<param>[a-z_][a-z0-9_]*(?:\[\d+\]|\.[a-z_][a-z0-9_]*)*) "
    r"(?:must|should|cannot|can't|is|are|has|have|exceeds|needs|requires|holds)\b"
)
# Pydantic names union members in the error location ("str", "list[int]", "function-after[...]"); they are no field.
_UNION_TAG = re.compile(r"[\[\]()\-,]|^(?:str|int|float|bool|list|dict|none|tuple)$")
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


class APIError(Exception):
    """A failure that the HTTP layer answers with `status` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        """Extra response headers; Retry-After takes whole seconds, so a fraction is rounded up."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def __repr__(self) -> str:
        return f"APIError(status={self.status}, message={self.message!r}, param={self.param!r}, code={self.code!r})"


def error_body(err: APIError) -> dict[str, Any]:
    """The JSON body OpenAI clients parse: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param=param)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key", INVALID_REQUEST, code="invalid_api_key")


def not_found_model(name: str) -> APIError:
    return APIError(
        404, f"The model {name!r} does not exist on this server", INVALID_REQUEST, param="model", code="model_not_found"
    )


def check_model(requested: str | None, served: str) -> None:
    """404 naming `requested` when a request names another model than the one served (None: the served one)."""
    if requested and requested != served:
        raise not_found_model(requested)


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds the limit of {limit} bytes", INVALID_REQUEST, code="request_too_large")


def overloaded(retry_after_s: float) -> APIError:
    return APIError(
        429,
        f"The server is at capacity; retry after {retry_after_s:g} s",
        "rate_limit_error",
        code="rate_limit_exceeded",
        retry_after_s=retry_after_s,
    )


def over_quota(message: str, retry_after_s: float) -> APIError:
    """429 for one tenant's request over its own quota (the server itself may have room)."""
    return APIError(429, message, "rate_limit_error", code="rate_limit_exceeded", retry_after_s=retry_after_s)


def unavailable(message: str, retry_after_s: float | None = None) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable", retry_after_s=retry_after_s)


def internal_error() -> APIError:
    """500 for an error the server did not expect: its details stay in the server's log."""
    return APIError(500, "The server had an error while processing the request", "server_error", code="internal_error")


def from_value_error(err: ValueError) -> APIError:
    """400 for a ValueError raised by validation code; the field it names first becomes `param`."""
    message = str(err)
    match = _FIELD_AT_START.match(message)
    return bad_request(message, match.group("param") if match else None)


def from_validation_error(err: ValidationError) -> APIError:
    """400 naming the first invalid field (as `messages[0].content`) and what is wrong with it."""
    errors = err.errors(include_url=False)
    if not errors:
        return bad_request(str(err))
    root = _field_path(errors[0]["loc"])
    related = [e for e in errors if _is_under(_field_path(e["loc"]), root)]
    # A union reports one error per member; the one that got deepest into the input says the most.
    first = max(related, key=lambda e: len(e["loc"]))
    param = _field_path(first["loc"])
    message = _strip_prefix(str(first["msg"]))
    if first["type"] == "missing":
        text = f"Missing required field {param!r}"
    elif param is None and (named := _FIELD_AT_START.match(message)):
        # A check across fields (a model validator) names the field it refuses first.
        param, text = named.group("param"), message
    elif param is None:
        text = f"Invalid request body: {message}"
    elif (named := _FIELD_AT_START.match(message)) and param.endswith(named.group("param")):
        # Our own validators name the field without its place in the body; give its full path.
        text = param + message[named.end("param") :]
    else:
        text = f"Invalid value for {param!r}: {message}"
    others = {_field_path(e["loc"]) for e in errors if not _is_under(_field_path(e["loc"]), root)}
    if others:
        text += f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''})"
    return bad_request(text, param)


def _field_path(loc: tuple[int | str, ...]) -> str | None:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _UNION_TAG.search(part) or part[:1].isupper():  # union member or model class name
            continue
        else:
            path += f".{part}" if path else part
    return path or None


def _is_under(path: str | None, root: str | None) -> bool:
    if root is None or path is None:
        return path == root
    return path == root or path.startswith((root + "[", root + "."))


def _strip_prefix(message: str) -> str:
    for prefix in _PYDANTIC_PREFIXES:
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message
