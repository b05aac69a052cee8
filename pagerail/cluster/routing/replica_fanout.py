"""Calls that go to every data-parallel replica at once, tolerating the ones that are down."""

from __future__ import annotations

import asyncio
import logging

from pagerail.cluster.core.engine_client import EngineClient
from pagerail.cluster.routing.router_metrics import with_label

logger = logging.getLogger(__name__)


async def call_all(clients: dict[str, EngineClient], method: str, *args) -> dict[str, object]:
    """`method(*args)` on every replica at once: each one's answer, or the exception it raised."""
    answers = await asyncio.gather(*(getattr(c, method)(*args) for c in clients.values()), return_exceptions=True)
    return dict(zip(clients, answers, strict=True))


async def on_every_replica(clients: dict[str, EngineClient], method: str, *args) -> None:
    """Call `method` on every replica; a failed one is logged, and an error raised only when every one failed."""
    answers = await call_all(clients, method, *args)
    errors = [(name, answer) for name, answer in answers.items() if isinstance(answer, BaseException)]
    for name, error in errors:
        logger.warning("%s failed at replica %s: %r", method, name, error)
    if errors and len(errors) == len(clients):
        raise errors[0][1]


async def merged_stats(clients: dict[str, EngineClient]) -> dict:
    """The replicas' integer counts summed at the top (as one engine reports them) and each replica's own stats
    under "replicas" (an "error" entry for one that did not answer)."""
    totals: dict[str, int] = {}
    per_replica: dict[str, dict] = {}
    for name, answer in (await call_all(clients, "stats")).items():
        if isinstance(answer, BaseException):
            per_replica[name] = {"error": repr(answer)}
            continue
        per_replica[name] = answer
        for key, value in answer.items():
            if isinstance(value, int) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
    return {**totals, "replicas": per_replica}


async def merged_metrics(clients: dict[str, EngineClient]) -> str:
    """Every replica's exposition with a `replica` label; one that cannot answer is left out of this scrape."""
    texts = {}
    for name, answer in (await call_all(clients, "metrics")).items():
        if isinstance(answer, BaseException):
            logger.warning("replica %s did not return its metrics: %r", name, answer)
        else:
            texts[name] = answer
    return with_label(texts)


async def probe(name: str, client: EngineClient, timeout_s: float) -> tuple[dict | None, bool]:
    """A replica's stats and readiness; (None, False) when it fails or does not answer within `timeout_s`."""
    try:
        stats, ready = await asyncio.wait_for(asyncio.gather(client.stats(), client.is_ready()), timeout_s)
    except Exception as error:  # a dead or hung replica
        logger.warning("replica %s did not report its load: %r", name, error)
        return None, False
    return stats, ready is True


def load_of(stats: dict) -> tuple[int, int, float]:
    """Running and waiting requests and KV cache usage (0..1) from a replica's stats."""
    running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
    usage = stats.get("kv_usage")
    if usage is None:
        blocks = stats.get("num_blocks", 0)
        usage = 1.0 - stats.get("num_free_blocks", 0) / blocks if blocks else 0.0
    return running, waiting, float(usage)
