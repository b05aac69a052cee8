"""The frontend's HTTP server runs on httptools, uvicorn's C parser and writer, not its pure-Python h11 fallback."""

from __future__ import annotations

import uvicorn


async def _app(scope, receive, send) -> None:  # never called: the test only loads the configuration
    raise AssertionError("not served")


def test_uvicorn_selects_httptools():
    # The frontend leaves uvicorn's choice on "auto", which silently takes h11 when httptools is missing; each
    # streamed event then costs the event loop noticeably more. A required dependency, so its absence fails here.
    config = uvicorn.Config(_app, lifespan="off")
    config.load()
    assert config.http_protocol_class.__module__ == "uvicorn.protocols.http.httptools_impl"
