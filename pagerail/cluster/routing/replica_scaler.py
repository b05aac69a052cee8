"""Applies a ScalingPolicy to a RoutedEngineClient: starts replicas through a factory, drains and stops idle ones."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.routing.autoscale import ScalingPolicy
from pagerail.cluster.routing.routed_client import RoutedEngineClient

logger = logging.getLogger(__name__)

StartReplica = Callable[[], Awaitable[tuple[str, EngineClient]]]
StopReplica = Callable[[str], Awaitable[None]]


class ReplicaScaler:
    """Each `tick()` reads the router's view of the replicas, asks the policy, and applies its answer in the
    background: a new replica joins the rotation once `start_replica()` returns it; a drained one leaves the
    rotation at once, and is removed and stopped (`stop_replica(name)`) only when no request is open there."""

    def __init__(
        self,
        engine: RoutedEngineClient,
        policy: ScalingPolicy,
        start_replica: StartReplica,
        stop_replica: StopReplica,
        *,
        drain_poll_s: float = 0.1,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self._start_replica = start_replica
        self._stop_replica = stop_replica
        self._drain_poll_s = drain_poll_s
        self._last_busy: dict[str, float] = {}
        self._starting = 0
        self.draining: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self.num_added = 0
        self.num_removed = 0
        self.num_failed_starts = 0

    @property
    def num_replicas(self) -> int:
        """Replicas serving or starting; draining ones no longer count."""
        return len(self.engine.replicas) - len(self.draining) + self._starting

    def idle_seconds(self, now: float) -> dict[str, float]:
        """For each replica in rotation: seconds since it last had a request open or queued (0 while it has)."""
        router = self.engine.router
        idle = {}
        for name in router.in_rotation():
            state = router.replicas[name]
            if state.in_flight or state.running or state.waiting:
                self._last_busy[name] = now
            idle[name] = now - self._last_busy.setdefault(name, now)
        return idle

    async def tick(self, now: float | None = None) -> int:
        """Decide once and start applying it; returns the decision."""
        now = time.monotonic() if now is None else now
        router = self.engine.router
        waiting = sum(router.replicas[name].waiting for name in router.in_rotation())
        idle = self.idle_seconds(now)
        decision = self.policy.decide(self.num_replicas, waiting, idle, now)
        if decision > 0:
            self._starting += 1
            self._spawn(self._add())
        elif decision < 0:
            name = self.policy.drain_candidate(idle)
            if name is not None:
                self.draining.add(name)
                self.engine.set_in_rotation(name, False)  # no new request goes there from now on
                self._spawn(self._drain(name))
        return decision

    async def aclose(self) -> None:
        """Stop what is under way: a start or drain left half-way leaves its replica as it is."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self) -> None:
        try:
            name, client = await self._start_replica()
            self.engine.add_replica(name, client)
            self.num_added += 1
            logger.info("replica %s added; %d replicas", name, len(self.engine.replicas))
        except Exception:
            self.num_failed_starts += 1
            logger.exception("a new replica failed to start")
        finally:
            self._starting -= 1

    async def _drain(self, name: str) -> None:
        try:
            # Its running requests move to the other replicas with their KV; any left finish where they are.
            await self.engine.moves.drain(name)
            state = self.engine.router.replicas.get(name)
            while state is not None and state.in_flight > 0:
                await asyncio.sleep(self._drain_poll_s)
            self.engine.remove_replica(name)
            self._last_busy.pop(name, None)
            await self._stop_replica(name)
            self.num_removed += 1
            logger.info("replica %s drained and stopped; %d replicas", name, len(self.engine.replicas))
        except Exception:
            logger.exception("stopping drained replica %s failed", name)
        finally:
            self.draining.discard(name)
