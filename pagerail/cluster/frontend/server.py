"""Runs the HTTP (uvicorn) and gRPC servers on one event loop over one engine client, and drains them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvicorn

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.frontend.grpc_api import build_grpc_server
from pagerail.cluster.frontend.grpc_guards import EngineHealth
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.common import telemetry


def configure_frontend_tracing(settings: FrontendSettings, exporter=None) -> bool:
    """This process's tracing as a frontend; returns whether tracing is on."""
    return telemetry.configure_tracing(
        "frontend",
        endpoint=settings.otlp_traces_endpoint,
        sampling_ratio=settings.trace_sampling_ratio,
        exporter=exporter,
        respect_remote_sampling=settings.trace_respect_client_sampling,
    )


class FrontendServer:
    """Both front doors of one model replica."""

    def __init__(self, engine: EngineClient, tokenizer, settings: FrontendSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.state = ServerState(engine, tokenizer, settings)
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task | None = None
        self._grpc = None
        self._health: EngineHealth | None = None

    async def start(self) -> dict:
        """Bind both ports (0 picks a free one) and serve; returns the bound ports."""
        self._http = uvicorn.Server(http_config(create_app(self.state), self.settings.host, self.settings.port))
        self._http_task = asyncio.create_task(self._http.serve())
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # raises the bind error
                raise RuntimeError(f"HTTP server could not listen on {self.settings.host}:{self.settings.port}")
            await asyncio.sleep(0.01)
        http_port = self._http.servers[0].sockets[0].getsockname()[1]
        self._health = EngineHealth(self.engine.is_ready, services=("pagerail.api.Generation",))
        self._grpc, grpc_port = build_grpc_server(
            self.engine,
            self.state.tokenizer,
            host=self.settings.host,
            port=self.settings.grpc_port,
            api_key=self.settings.api_key,
            health=self._health,
            tls=self.settings.grpc_tls,
            responses=self.state.responses,
            tool_call_parser=self.settings.tool_call_parser,
            lora_modules=self.state.lora_modules,
            tenants=self.settings.tenants,
            quotas=self.state.quotas,
        )
        await self._grpc.start()
        return {"http_port": http_port, "grpc_port": grpc_port}

    async def drain(self, grace_s: float) -> int:
        """Stop admitting, let in-flight requests finish for up to `grace_s`; returns how many were still open."""
        self.state.draining = True
        await self._health.set_serving(False)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            stats = await self.engine.stats()
            if stats.get("num_unfinished", 0) == 0 and self.state.in_flight == 0:
                return 0
            await asyncio.sleep(0.1)
        stats = await self.engine.stats()
        return int(stats.get("num_unfinished", 0))

    async def stop(self) -> None:
        """Close both servers; requests still open are cancelled, which aborts them in the engine."""
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._http is not None:
            self._http.should_exit = True
            await self._http_task


def http_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """The HTTP server's settings. httptools, uvicorn's C parser and writer, is asked for by name: left on
    "auto", uvicorn silently falls back to its pure-Python h11 when httptools is missing, and every streamed
    event then costs the event loop noticeably more. Missing, it now fails the server's start instead."""
    return uvicorn.Config(
        app, host=host, port=port, http="httptools", log_level="warning", lifespan="off", timeout_graceful_shutdown=5
    )
