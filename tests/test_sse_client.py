"""The load generator's own HTTP/1.1 client: chunked and sized bodies, lines across chunks, keep-alive reuse."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagerail.cluster.bench.sse_client import HttpProtocolError, SseClient


class RawServer:
    """Answers each request on a connection with the next canned response; records what it was sent."""

    def __init__(self, responses: list[bytes], close_after: int | None = None) -> None:
        self.responses = responses
        self.close_after = close_after  # requests served per connection before the server hangs up
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append((request_line.decode().strip(), headers, body))
                for piece in self.responses[len(self.requests) - 1 : len(self.requests)][0].split(b"|"):
                    writer.write(piece)  # "|" marks where the server flushes, so reads split there
                    await writer.drain()
                    await asyncio.sleep(0.001)
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    return
        finally:
            writer.close()


def chunked(*chunks: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n|"
    return head + b"".join(b"%x\r\n%s\r\n|" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


async def serve(server: RawServer, body):
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with SseClient(f"http://127.0.0.1:{port}/base") as client:
            return await body(client)
    finally:
        listener.close()
        await listener.wait_closed()


def test_chunked_sse_lines_come_out_whole_even_when_split_across_chunks():
    response = chunked(b'data: {"a": 1}\n\n', b'data: {"b"', b": 2}\n\nda", b"ta: [DONE]\n\n")
    server = RawServer([response])

    async def body(client):
        async with client.stream("/v1/completions", {"x": [1, 2]}, {"Authorization": "Bearer k"}) as r:
            assert r.status_code == 200
            return [line async for line in r.aiter_lines()]

    lines = asyncio.run(serve(server, body))
    assert [line for line in lines if line] == ['data: {"a": 1}', 'data: {"b": 2}', "data: [DONE]"]
    request_line, headers, sent = server.requests[0]
    assert request_line == "POST /base/v1/completions HTTP/1.1"
    assert headers["authorization"] == "Bearer k" and headers["content-type"] == "application/json"
    assert json.loads(sent) == {"x": [1, 2]}


def test_a_sized_error_body_is_read_and_the_connection_is_reused():
    error = b'{"error": {"message": "bad"}}'
    sized = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n|%s" % (len(error), error)
    server = RawServer([sized, chunked(b"data: [DONE]\n\n")])

    async def body(client):
        async with client.stream("/x", {}, {}) as r:
            first = (r.status_code, await r.aread())
        async with client.stream("/x", {}, {}) as r:
            second = [line async for line in r.aiter_lines() if line]
        return first, second

    first, second = asyncio.run(serve(server, body))
    assert first == (400, error)
    assert second == ["data: [DONE]"]
    assert server.connections == 1  # keep-alive: both requests on one connection


def test_a_connection_the_server_closed_while_idle_is_replaced_without_failing_the_request():
    server = RawServer([chunked(b"data: 1\n\n"), chunked(b"data: 2\n\n")], close_after=1)

    async def body(client):
        out = []
        for _ in range(2):
            async with client.stream("/x", {}, {}) as r:
                out += [line async for line in r.aiter_lines() if line]
            await asyncio.sleep(0.01)  # let the server's close arrive
        return out

    assert asyncio.run(serve(server, body)) == ["data: 1", "data: 2"]
    assert server.connections == 2


def test_a_response_cut_inside_its_chunked_body_raises_and_the_connection_is_dropped():
    cut = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n|5\r\nda"
    server = RawServer([cut], close_after=1)

    async def body(client):
        with pytest.raises((HttpProtocolError, asyncio.IncompleteReadError)):
            async with client.stream("/x", {}, {}) as r:
                async for _ in r.aiter_lines():
                    pass
        return client._idle

    assert asyncio.run(serve(server, body)) == []


def test_bad_base_urls_are_refused_by_name():
    for url in ("ftp://host", "localhost:8000", "http://"):
        with pytest.raises(ValueError, match="base URL must be http"):
            SseClient(url)
