"""Starts, restarts and stops one model replica's tensor-parallel worker actors on Ray."""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.executor import WorkerGroupError
from cluster.remote_executor import RemoteExecutor
from proto import step_pb2
from worker.actor import WorkerActor
from worker.config import WorkerConfig
from worker.tls import TlsConfig

logger = logging.getLogger(__name__)


class WorkerGroup:
    """One placement group, one actor per rank, one gRPC client to them all.

    Implements the head's executor interface, so the engine loop cannot tell it from the in-process one.
    """

    def __init__(
        self,
        config: WorkerConfig,
        size: int,
        token: str,
        *,
        use_gpu: bool = False,
        cpus_per_worker: float = 1,
        placement_strategy: str = "PACK",
        tls: TlsConfig | None = None,
        step_timeout_s: float = 300.0,
        ready_timeout_s: float = 600.0,
    ) -> None:
        if placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got {placement_strategy!r}"
            )
        self.config = config
        self.size = size
        self._token = token
        self._use_gpu = use_gpu
        self._cpus = cpus_per_worker
        self._strategy = placement_strategy
        self._tls = tls
        self._step_timeout = step_timeout_s
        self._ready_timeout = ready_timeout_s
        self._placement = None
        self._actors: list = []
        self._executor: RemoteExecutor | None = None
        self.num_blocks = 0
        self.pids: list[int] = []
        self.node_ids: list[str] = []
        self.addresses: list[str] = []

    def start(self) -> int:
        """Reserve the bundles, start every rank, join them into one group; returns the usable block count."""
        bundle = {"GPU": 1, "CPU": self._cpus} if self._use_gpu else {"CPU": self._cpus}
        self._placement = placement_group([dict(bundle) for _ in range(self.size)], strategy=self._strategy)
        try:
            ray.get(self._placement.ready(), timeout=self._ready_timeout)
        except ray.exceptions.GetTimeoutError as error:
            raise WorkerGroupError(
                f"the cluster cannot fit {self.size} bundles of {bundle} ({self._strategy}) within "
                f"{self._ready_timeout:.0f}s; add nodes or lower tensor_parallel_size"
            ) from error
        actor_class = ray.remote(WorkerActor)
        self._actors = [
            actor_class.options(
                num_cpus=self._cpus,
                num_gpus=1 if self._use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank
                ),
                max_restarts=0,
            ).remote(self.config, rank, self.size, self._token, self._tls)
            for rank in range(self.size)
        ]
        try:
            rank0 = self._actors[0]
            rendezvous = f"{ray.get(rank0.node_ip.remote())}:{ray.get(rank0.reserve_port.remote())}"
            # Every rank must enter init_process_group together, so start them all before waiting.
            infos = ray.get([actor.start.remote(rendezvous) for actor in self._actors], timeout=self._ready_timeout)
        except Exception:
            self.shutdown()
            raise
        infos.sort(key=lambda info: info["rank"])
        self.addresses = [info["address"] for info in infos]
        self.pids = [info["pid"] for info in infos]
        self.node_ids = [info["node_id"] for info in infos]
        # Every rank holds a shard of the same blocks: the table is as large as the smallest shard.
        self.num_blocks = min(info["num_blocks"] for info in infos)
        self._executor = RemoteExecutor(self.addresses, self._token, self._tls, self._step_timeout)
        logger.info("worker group of %d ranks up at %s with %d blocks", self.size, self.addresses, self.num_blocks)
        return self.num_blocks

    @property
    def running(self) -> bool:
        """True between a successful start and the next shutdown (false while restarting)."""
        return self._executor is not None

    @property
    def dispatch_stats(self):
        return self._executor.stats if self._executor is not None else None

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        if self._executor is None:
            raise WorkerGroupError("the worker group is not running")
        return self._executor.execute(batch)

    def restart(self) -> int:
        self.shutdown()
        return self.start()

    def flush_traces(self, timeout_s: float = 10.0) -> bool:
        """Ask every rank to export the spans it still buffers; False when one did not within `timeout_s`."""
        try:
            return all(ray.get([actor.flush_traces.remote() for actor in self._actors], timeout=timeout_s))
        except ray.exceptions.RayError as error:  # a dead or stuck rank: its spans are lost, not the caller's call
            logger.warning("could not flush the ranks' traces: %s", error)
            return False

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._placement is not None:
            remove_placement_group(self._placement)
            self._placement = None
