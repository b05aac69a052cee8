"""Connects to (or starts) Ray and starts a model replica's head actor, which starts its workers."""

from __future__ import annotations

import secrets

import ray

from cluster.core.config import EngineConfig
from cluster.distributed.head import ClusterOptions, HeadActor

NAMESPACE = "pagerail"
DEFAULT_HEAD_NAME = "pagerail-head"


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at `address` ("auto" for the local one), or start a private local one."""
    if ray.is_initialized():
        return
    if address is None:
        ray.init(namespace=NAMESPACE, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)


def start_head(config: EngineConfig, options: ClusterOptions, name: str = DEFAULT_HEAD_NAME):
    """Start the head actor (which reserves a placement group and starts one worker per rank); wait until ready.

    The head is named and namespaced so frontends can find it, and restarted by Ray if it dies.
    """
    token = secrets.token_urlsafe(32)  # handed to the head and workers only, never logged
    head_class = ray.remote(HeadActor)
    head = head_class.options(
        name=name,
        namespace=NAMESPACE,
        num_cpus=0,
        max_restarts=-1,
        max_concurrency=10_000,
    ).remote(config, options, token)
    ray.get(head.ready.remote())
    return head


def find_head(name: str = DEFAULT_HEAD_NAME):
    """The running head actor called `name`."""
    return ray.get_actor(name, namespace=NAMESPACE)
