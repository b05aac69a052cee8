"""A lean HTTP/1.1 client for streamed POSTs: keep-alive connections straight on asyncio streams.

The load generator shares the machine with the server it measures, so every microsecond it spends per streamed
event is taken from the server. A general-purpose client (httpx on anyio) costs about 300 µs of CPU per SSE
event; this one reads the chunked body with a few stream reads per event and hands back its lines.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

_READ_SIZE = 1 << 16


class HttpProtocolError(Exception):
    """The server's answer is not HTTP/1.1 this client understands."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class StreamedResponse:
    """One response: its status and headers are read; its body is read by `aread` or `aiter_lines`."""

    def __init__(self, connection: _Connection, status_code: int, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.headers = headers
        self._connection = connection
        self.complete = False  # the whole body was read, so the connection may serve another request
        encoding = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in encoding
        length = headers.get("content-length")
        self._remaining = int(length) if length is not None and not self._chunked else None

    @property
    def reusable(self) -> bool:
        closes = self.headers.get("connection", "").lower() == "close"
        return self.complete and not closes and (self._chunked or self._remaining is not None)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        if self._chunked:
            while True:
                size_line = await reader.readline()
                if not size_line.endswith(b"\n"):
                    raise HttpProtocolError("the connection closed inside a chunked body")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HttpProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailer fields, which nothing here reads
                    self.complete = True
                    return
                data = await reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2]
        elif self._remaining is not None:
            while self._remaining:
                data = await reader.read(min(self._remaining, _READ_SIZE))
                if not data:
                    raise HttpProtocolError("the connection closed before Content-Length bytes arrived")
                self._remaining -= len(data)
                yield data
            self.complete = True
        else:
            while data := await reader.read(_READ_SIZE):
                yield data
            self.complete = True

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_bytes()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines, without their line ends; a line split across chunks comes out whole."""
        pending = b""
        async for data in self.aiter_bytes():
            pending += data
            if b"\n" not in data:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.rstrip(b"\r").decode()


class SseClient:
    """Streams POSTs to one origin over a pool of keep-alive connections (one per request in flight)."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URL must be http:// or https:// with a host, got {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._prefix = parts.path.rstrip("/")
        self._idle: list[_Connection] = []

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def __aenter__(self) -> SseClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @asynccontextmanager
    async def stream(
        self, path: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> AsyncIterator[StreamedResponse]:
        """POST `payload` as JSON to `path` (under the base URL's path); the response, its body unread."""
        body = json.dumps(payload).encode()
        head = [f"POST {self._prefix}{path} HTTP/1.1", f"Host: {self._host_header}"]
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}", "Accept: text/event-stream"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        connection = self._idle.pop() if self._idle else None
        response = None
        try:
            if connection is not None:
                try:
                    response = await self._send(connection, request)
                except (ConnectionError, HttpProtocolError, asyncio.IncompleteReadError):
                    # The server closed an idle keep-alive connection: send once more on a fresh one.
                    connection.close()
                    connection = None
            if connection is None:
                connection = _Connection(*await asyncio.open_connection(self._host, self._port, ssl=self._ssl))
                response = await self._send(connection, request)
            yield response
        finally:
            if connection is not None:
                if response is not None and response.reusable:
                    self._idle.append(connection)
                else:
                    connection.close()

    @staticmethod
    async def _send(connection: _Connection, request: bytes) -> StreamedResponse:
        connection.writer.write(request)
        await connection.writer.drain()
        status_line = await connection.reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection before answering")
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
            raise HttpProtocolError(f"bad status line {status_line[:60]!r}")
        headers: dict[str, str] = {}
        while (line := await connection.reader.readline()) not in (b"\r\n", b"\n"):
            if not line:
                raise HttpProtocolError("the connection closed inside the response headers")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return StreamedResponse(connection, int(fields[1]), headers)
