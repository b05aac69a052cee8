"""Runs an ASGI app with uvicorn on an ephemeral loopback port in a background thread, for API tests."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn


class BackgroundServer:
    """`with BackgroundServer(app) as base_url:` serves until the block ends."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class BackgroundFrontend:
    """`with BackgroundFrontend(engine, tokenizer, settings) as (base_url, grpc_target):` serves the HTTP and gRPC
    APIs of one FrontendServer (one shared state, as `pagerail serve` runs them) until the block ends."""

    def __init__(self, engine, tokenizer, settings) -> None:
        import dataclasses

        from pagerail.cluster.frontend.server import FrontendServer

        self.frontend = FrontendServer(engine, tokenizer, dataclasses.replace(settings, port=0, grpc_port=0))
        self.ports: dict | None = None
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            self.ports = await self.frontend.start()
        except BaseException as error:
            self.error = error
            return
        await self._stop.wait()
        await self.frontend.stop()

    def __enter__(self) -> tuple[str, str]:
        self.thread.start()
        deadline = time.monotonic() + 30
        while self.ports is None:
            if self.error is not None or time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the test frontend did not start: {self.error!r}")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.ports['http_port']}", f"127.0.0.1:{self.ports['grpc_port']}"

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=30)
