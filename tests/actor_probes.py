"""What the cluster tests read from or do to Ray actors, run inside the actor (Ray's `__ray_call__`), so the product
carries no hooks or introspection RPCs that only tests call."""

from __future__ import annotations

import os
import sys
import time

import ray
import ray.cloudpickle

# Shipped to the actors by value: their processes need not be able to import the tests package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _pid(actor) -> int:
    return os.getpid()


def _worker_pids(head) -> list[int]:
    return list(head.group.pids)


def _worker_nodes(head) -> list[str]:
    return list(head.group.node_ids)


def _install_step_fault(rank, kind: str, seconds: float) -> None:
    worker = rank.worker
    if worker is None:
        raise RuntimeError(f"rank {rank.rank} is not started")

    def faulty_step(batch):
        del worker.execute_step  # back to the real method for the steps after this one
        rank.test_faults_hit = getattr(rank, "test_faults_hit", 0) + 1
        if kind == "fail":
            raise RuntimeError(f"fault injected on rank {rank.rank}")
        time.sleep(seconds)
        return worker.execute_step(batch)

    # The rank's gRPC servicer looks the method up on the same Worker for every step.
    worker.execute_step = faulty_step


def _faults_hit(rank) -> int:
    return getattr(rank, "test_faults_hit", 0)


def actor_pid(actor, timeout_s: float | None = None) -> int:
    """The process id of a head or worker actor."""
    return ray.get(actor.__ray_call__.remote(_pid), timeout=timeout_s)


def worker_pids(head) -> list[int]:
    """The process ids of a head's ranks, in rank order."""
    return ray.get(head.__ray_call__.remote(_worker_pids))


def worker_nodes(head) -> list[str]:
    """The Ray node ids of a head's ranks, in rank order."""
    return ray.get(head.__ray_call__.remote(_worker_nodes))


def inject_step_fault(rank, kind: str, seconds: float = 0.0) -> None:
    """The next step on this worker actor first hangs for `seconds` then runs ("hang"), or fails without computing
    ("fail"); one step only."""
    if kind not in ("hang", "fail"):
        raise ValueError(f"kind must be 'hang' or 'fail', got {kind!r}")
    ray.get(rank.__ray_call__.remote(_install_step_fault, kind, seconds))


def step_faults_hit(rank) -> int:
    """How many injected faults a step on this worker actor has run into."""
    return ray.get(rank.__ray_call__.remote(_faults_hit))
