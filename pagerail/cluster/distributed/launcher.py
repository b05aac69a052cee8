"""Connects to (or starts) Ray and starts a model replica's head actor, which starts its workers."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import ray

from pagerail.cluster.distributed.cluster_options import ClusterOptions
from pagerail.cluster.distributed.head import HeadActor
from pagerail.common.engine_config import EngineConfig

NAMESPACE = "pagerail"


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at `address` ("auto" for the local one), or start a private local one."""
    if ray.is_initialized():
        return
    if address is None:
        # "local": a new instance even where another Ray, or the record a killed one left in /tmp/ray, is found;
        # without it Ray would try to join that one and refuse num_cpus.
        ray.init(address="local", namespace=NAMESPACE, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)


def uses_gpu(device: str) -> bool:
    """Whether the ranks compute on GPUs: asked for, or `auto` on a cluster that has any (call after connect())."""
    return device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)


def launch_head(config: EngineConfig, options: ClusterOptions, name: str):
    """Create the head actor without waiting for it: it reserves a placement group and starts one worker per rank.

    The head is named and namespaced so frontends can find it, and restarted by Ray if it dies.
    """
    token = secrets.token_urlsafe(32)  # handed to the head and workers only, never logged
    head_class = ray.remote(HeadActor)
    return head_class.options(
        name=name,
        namespace=NAMESPACE,
        num_cpus=0,
        max_restarts=-1,
        max_concurrency=10_000,
    ).remote(config, options, token)


def start_heads(config: EngineConfig, options: ClusterOptions, names: list[str]) -> list:
    """Start one head per name at once (each with its own placement group and workers); wait until all are ready.

    When one fails to start, the others are stopped too: a half-started set of replicas is not served.
    """
    heads = [launch_head(config, options, name) for name in names]
    try:
        ray.get([head.ready.remote() for head in heads])
    except BaseException:
        for head in heads:
            ray.kill(head, no_restart=True)
        raise
    return heads


def find_head(name: str):
    """The running head actor called `name`."""
    return ray.get_actor(name, namespace=NAMESPACE)


def stop_head(head, timeout_s: float = 60.0) -> None:
    """Shut a head down (its workers and placement group with it) and end its actor for good."""
    try:
        ray.get(head.shutdown.remote(), timeout=timeout_s)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        pass  # dead, restarting or stuck: ending the actor frees what it holds all the same
    ray.kill(head, no_restart=True)


@dataclass(frozen=True)
class HeadLauncher:
    """Starts and stops further replicas' heads of one model, from any process of the cluster (it is picklable)."""

    config: EngineConfig
    options: ClusterOptions
    ready_timeout_s: float = 600.0  # a new placement group may wait for the cluster's autoscaler to add nodes

    def start(self, name: str):
        """Start the head `name` and wait until it is ready; it is stopped again when it is not in time."""
        head = launch_head(self.config, self.options, name)
        try:
            ray.get(head.ready.remote(), timeout=self.ready_timeout_s)
        except BaseException:
            ray.kill(head, no_restart=True)
            raise
        return head

    def stop(self, name: str) -> None:
        stop_head(find_head(name))
