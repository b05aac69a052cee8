"""Per-tenant quotas at a frontend: requests in flight against `max_concurrency`, and prompt + generated tokens of
the last minute against `tokens_per_minute`. A tenant over either gets 429 with Retry-After for its own requests;
no other tenant's request is refused or slowed by it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Counter, generate_latest

from pagerail.cluster.core.engine_client import EngineClient, RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.frontend.errors import over_quota
from pagerail.cluster.frontend.tenants import Tenant

WINDOW_S = 60.0
# A refused request is told to come back after this long at least (a Retry-After of 0 invites a busy loop).
MIN_RETRY_S = 1.0


class TenantQuotas:
    """What each tenant has in flight and used in the last minute, and the requests each had refused."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Tenant names come from the tenants file (plus "default"), so the label's values are bounded by it.
        self.registry = CollectorRegistry(auto_describe=True)
        self.refused = Counter(
            "pagerail_tenant_refused_requests",
            "Requests refused with 429 for being over their tenant's quota, by tenant and quota.",
            ("tenant", "quota"),
            registry=self.registry,
        )
        self._in_flight: dict[str, int] = {}
        self._used: dict[str, deque[tuple[float, int]]] = {}  # (when, tokens), oldest first
        self._used_total: dict[str, int] = {}

    def in_flight(self, tenant: Tenant) -> int:
        return self._in_flight.get(tenant.name, 0)

    def tokens_used(self, tenant: Tenant) -> int:
        """Prompt and generated tokens counted in the last minute."""
        self._expire(tenant.name)
        return self._used_total.get(tenant.name, 0)

    def enter(self, tenant: Tenant) -> None:
        """A request of `tenant` starts; a 429 APIError when the tenant is at its concurrency or its tokens of the
        last minute. Every enter that returns is matched by one leave."""
        limit = tenant.max_concurrency
        if limit is not None and self.in_flight(tenant) >= limit:
            self.refused.labels(tenant.name, "max_concurrency").inc()
            raise over_quota(
                f"tenant {tenant.name!r} has {limit} requests in flight (its max_concurrency); retry when one ends",
                MIN_RETRY_S,
            )
        rate = tenant.tokens_per_minute
        if rate is not None and self.tokens_used(tenant) >= rate:
            used = self._used[tenant.name]
            # Until enough of the window's oldest tokens expire to bring it under the rate.
            excess, wait = self._used_total[tenant.name] - rate, WINDOW_S
            for when, tokens in used:
                excess -= tokens
                if excess < 0:
                    wait = when + WINDOW_S - self._clock()
                    break
            self.refused.labels(tenant.name, "tokens_per_minute").inc()
            raise over_quota(
                f"tenant {tenant.name!r} used its {rate} tokens per minute; retry later", max(MIN_RETRY_S, wait)
            )
        self._in_flight[tenant.name] = self._in_flight.get(tenant.name, 0) + 1

    def metrics_text(self) -> bytes:
        """The Prometheus text exposition of the refusals."""
        return generate_latest(self.registry)

    def leave(self, tenant: Tenant) -> None:
        self._in_flight[tenant.name] -= 1

    def count(self, tenant: Tenant, tokens: int) -> None:
        """`tokens` (prompt or generated) of `tenant` served now."""
        if tokens <= 0 or tenant.tokens_per_minute is None:
            return
        self._used.setdefault(tenant.name, deque()).append((self._clock(), tokens))
        self._used_total[tenant.name] = self._used_total.get(tenant.name, 0) + tokens

    def _expire(self, name: str) -> None:
        used = self._used.get(name)
        oldest = self._clock() - WINDOW_S
        while used and used[0][0] <= oldest:
            self._used_total[name] -= used.popleft()[1]


class MeteredEngine:
    """An engine client for one tenant's request: each engine request's prompt and generated tokens are counted
    against the tenant's tokens per minute. Everything else is the engine client's own."""

    def __init__(self, engine: EngineClient, tenant: Tenant, quotas: TenantQuotas) -> None:
        self._engine = engine
        self._tenant = tenant
        self._quotas = quotas

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        quotas, tenant = self._quotas, self._tenant
        quotas.count(tenant, len(request.prompt_token_ids))
        async for delta in self._engine.generate(request):
            quotas.count(tenant, len(delta.token_ids))
            yield delta
