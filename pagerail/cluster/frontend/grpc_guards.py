"""What guards the gRPC server: API-key checks, and a health status that follows the engine's readiness."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagerail.common.auth import AUTH_METADATA_KEY, bearer_matches, refusing_handler

logger = logging.getLogger(__name__)

# Load-balancer probes carry no credentials, and reflection only describes the schema, which is public anyway.
OPEN_SERVICES = frozenset({HEALTH_SERVICE, reflection.SERVICE_NAME})


class EngineHealth(health_aio.HealthServicer):
    """grpc.health.v1: SERVING while `ready()` says yes and set_serving(False) is not in force."""

    def __init__(self, ready: Callable[[], Awaitable[bool]], services: tuple[str, ...] = ()) -> None:
        super().__init__()
        self._ready = ready
        self._services = ("", *services)  # "" is the whole server
        self._allowed = True

    async def set_serving(self, serving: bool) -> None:
        """Allow SERVING (once the engine is ready), or hold NOT_SERVING, e.g. while draining."""
        self._allowed = serving
        await self.refresh()

    async def refresh(self) -> bool:
        """Ask the engine whether it is ready and publish the answer, watchers included."""
        try:
            serving = self._allowed and bool(await self._ready())
        except Exception:
            logger.exception("readiness probe failed")
            serving = False
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self._services:
            await self.set(service, status)
        return serving

    # Each check asks the engine afresh: the answer is never stale and no polling task is needed.
    # A Watch stream sees later changes when refresh() or set_serving() runs, or another Check does.
    async def Check(self, request, context):  # noqa: N802 (gRPC method name)
        await self.refresh()
        return await super().Check(request, context)

    async def Watch(self, request, context):  # noqa: N802 (gRPC method name)
        await self.refresh()
        return await super().Watch(request, context)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Require metadata `authorization: Bearer <key>` on every RPC except health checks and reflection."""

    def __init__(self, api_key: str) -> None:
        if not api_key.strip():
            raise ValueError("api_key must not be empty")
        self._key = api_key.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.rpartition("/")[0].lstrip("/")
        if handler is None or service in OPEN_SERVICES or self._authorized(handler_call_details.invocation_metadata):
            return handler
        return refusing_handler(handler, _deny)

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                return bearer_matches(value.decode(errors="replace") if isinstance(value, bytes) else value, self._key)
        return False


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send 'authorization: Bearer <key>'")
