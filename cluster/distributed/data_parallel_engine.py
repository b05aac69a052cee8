"""The offline LLM over data-parallel replicas: a head actor per replica on Ray, each batch split between them by
the prefix-aware router, so prompts that share a prefix meet its cache and identical prompts (the n choices of
one request) stay on one replica."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import ray

from cluster.core.config import EngineConfig
from cluster.core.router import Router
from cluster.core.sampling_params import SamplingParams
from cluster.distributed.head import ClusterOptions
from cluster.distributed.launcher import connect, start_heads, stop_head
from cluster.distributed.remote_engine import RemoteEngine


class DataParallelEngine:
    """`size` replicas, each a head with its own placement group and tensor-parallel workers."""

    def __init__(
        self,
        config: EngineConfig,
        options: ClusterOptions,
        ray_address: str | None,
        name: str,
        size: int,
        device: str = "auto",
        policy: str = "prefix-aware",
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"data_parallel_size must be an integer >= 2 here, got {size!r}")
        connect(ray_address)
        if device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0):
            options = replace(options, use_gpu=True)
        self.names = [f"{name}-{index}" for index in range(size)]
        heads = start_heads(config, options, self.names)
        self.replicas = dict(zip(self.names, (RemoteEngine.for_head(head) for head in heads), strict=True))
        self.router = Router(policy, block_size=config.cache.block_size)
        for replica in self.names:
            self.router.add_replica(replica)
        self.num_routed = dict.fromkeys(self.names, 0)
        self.last_placement: dict[str, str] = {}  # request id -> replica, for the latest batch

    @property
    def head(self):
        """The first replica's head (what single-replica callers read model facts from)."""
        return self.replicas[self.names[0]].head

    def run(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        stops: Callable[[str, list[int]], bool] | None = None,
    ) -> dict[str, SimpleNamespace]:
        """Split the batch between the replicas and run every part at once; map request id → finished output."""
        parts: dict[str, list[tuple[str, list[int], SamplingParams]]] = {replica: [] for replica in self.names}
        placed: dict[tuple[int, ...], str] = {}
        self.last_placement = {}
        for request in requests:
            key = tuple(request[1])
            replica = placed.get(key)
            if replica is None:
                replica = placed[key] = self.router.route(request[1]).replica
            self.router.begin(replica, request[1])
            parts[replica].append(request)
            self.last_placement[request[0]] = replica
            self.num_routed[replica] += 1
        busy = {replica: part for replica, part in parts.items() if part}
        try:
            with ThreadPoolExecutor(max_workers=len(busy)) as pool:
                futures = [pool.submit(self.replicas[replica].run, part, stops) for replica, part in busy.items()]
                outputs: dict[str, SimpleNamespace] = {}
                for future in futures:
                    outputs.update(future.result())
        finally:
            for replica, part in busy.items():
                for _ in part:
                    self.router.end(replica)
        return outputs

    def wait_until_ready(self, timeout_s: float = 300.0) -> None:
        for replica in self.replicas.values():
            replica.wait_until_ready(timeout_s)

    def stats(self) -> dict:
        per_replica = {name: replica.stats() for name, replica in self.replicas.items()}
        return {"replicas": per_replica, "num_routed": dict(self.num_routed)}

    def shutdown(self) -> None:
        for replica in self.replicas.values():
            stop_head(replica.head)
