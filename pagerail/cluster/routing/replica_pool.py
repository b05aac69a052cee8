"""The data-parallel replicas behind one frontend: one routed client over their heads, kept fed with their load,
and grown or shrunk when scaling is on."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from pagerail.cluster.distributed.head_client import HeadEngineClient
from pagerail.cluster.distributed.launcher import HeadLauncher, find_head
from pagerail.cluster.routing.autoscale import ScalingPolicy
from pagerail.cluster.routing.replica_scaler import ReplicaScaler
from pagerail.cluster.routing.routed_client import RoutedEngineClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSettings:
    """How the frontend spreads requests over the replicas, and (with a launcher) how it scales them."""

    routing_policy: str = "prefix-aware"
    # What prefix-aware routing knows of each replica's cache: its block events ("events"), or an estimate from
    # the prompts sent to it ("estimate").
    routing_index: str = "events"
    # Prefill/decode disaggregation: these replicas prefill, the others decode (empty: every replica does both).
    prefill_replicas: tuple[str, ...] = ()
    block_size: int = 16
    adapter_slots: int = 1  # each replica's LoRA device slots (--max-loras), for adapter affinity
    refresh_interval_s: float = 1.0  # how often the replicas' load and health are read
    min_replicas: int | None = None  # None: as many as started
    max_replicas: int | None = None
    target_waiting_per_replica: float = 8.0
    scale_cooldown_s: float = 30.0
    scale_down_idle_s: float = 60.0
    name_prefix: str = "pagerail-head"  # new replicas are called <name_prefix>-<index>
    launcher: HeadLauncher | None = None  # None: no scaling

    def scaling_policy(self, num_started: int) -> ScalingPolicy | None:
        low = num_started if self.min_replicas is None else self.min_replicas
        high = num_started if self.max_replicas is None else self.max_replicas
        if self.launcher is None or low == high == num_started:
            return None
        return ScalingPolicy(
            low,
            high,
            self.target_waiting_per_replica,
            cooldown_s=self.scale_cooldown_s,
            scale_down_idle_s=self.scale_down_idle_s,
        )


class ReplicaPool:
    """Owns the routed client over the heads named at start and the loop that refreshes their load every
    `refresh_interval_s` (which also puts a restarted head back in rotation once it is ready) and scales."""

    def __init__(self, head_names: list[str], model_name: str, model_info: dict, settings: ReplicaSettings) -> None:
        if not head_names:
            raise ValueError("at least one head name is needed")
        self.model_name = model_name
        self.model_info = model_info
        self.settings = settings
        self.engine = RoutedEngineClient(
            {name: HeadEngineClient(find_head(name), model_name, model_info) for name in head_names},
            policy=settings.routing_policy,
            block_size=settings.block_size,
            model_name=model_name,
            max_model_len=model_info["max_model_len"],
            vocab_size=model_info["vocab_size"],
            index=settings.routing_index,
            prefill_replicas=settings.prefill_replicas,
            adapter_slots=settings.adapter_slots,
        )
        self._next_index = itertools.count(len(head_names))
        self._heads: dict[str, HeadEngineClient] = dict(self.engine.replicas)
        policy = settings.scaling_policy(len(head_names))
        self.scaler = (
            ReplicaScaler(self.engine, policy, self._start_replica, self._stop_replica) if policy is not None else None
        )
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._maintain())

    async def _maintain(self) -> None:
        while True:
            try:
                await self.engine.refresh_loads()
                if self.scaler is not None:
                    await self.scaler.tick(time.monotonic())
            except Exception:  # the next round tries again; serving goes on with the last known loads
                logger.exception("refreshing the replicas failed")
            await asyncio.sleep(self.settings.refresh_interval_s)

    async def _start_replica(self) -> tuple[str, HeadEngineClient]:
        name = f"{self.settings.name_prefix}-{next(self._next_index)}"
        head = await asyncio.to_thread(self.settings.launcher.start, name)
        client = self._heads[name] = HeadEngineClient(head, self.model_name, self.model_info)
        return name, client

    async def _stop_replica(self, name: str) -> None:
        client = self._heads.pop(name, None)
        if client is not None:
            await client.aclose()
        await asyncio.to_thread(self.settings.launcher.stop, name)

    def head_names(self) -> list[str]:
        """Every head this pool serves from or is draining (the ones to stop at shutdown)."""
        return list(self._heads)

    async def aclose(self) -> None:
        """Stop refreshing and scaling, and end this process's output channels at the heads."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.scaler is not None:
            await self.scaler.aclose()
        await asyncio.gather(*(client.aclose() for client in self._heads.values()), return_exceptions=True)
