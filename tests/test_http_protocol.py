"""The frontend's HTTP server runs on httptools, uvicorn's C parser and writer, not its pure-Python h11 fallback."""

from __future__ import annotations

from pagerail.cluster.frontend.server import http_config


async def _app(scope, receive, send) -> None:  # never called: the test only loads the configuration
    raise AssertionError("not served")


def test_the_frontend_serves_http_on_httptools():
    # The frontend's own configuration asks for httptools by name, so a missing httptools fails the start
    # (and this test, as a required dependency) instead of silently costing every streamed event more.
    config = http_config(_app, "127.0.0.1", 0)
    assert config.http == "httptools"
    config.load()
    assert config.http_protocol_class.__module__ == "uvicorn.protocols.http.httptools_impl"
