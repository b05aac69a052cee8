"""Requests that move between replicas with their KV: live migration off a draining replica, and prefill/decode
disaggregation (a prefill replica computes the prompt and the first token, a decode replica continues).

A move is a resumption, as after a failure, with the KV carried along: the source's cached blocks of the
request's tokens are exported, the target's host tier takes them (cluster/core/kv_handoff.py), the request ends
at the source, and it resumes on the target after the outputs its caller has, where its admission loads those
blocks instead of computing them. A transfer that fails or is refused costs only the recomputation. The client
sees one stream throughout.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from pagerail.cluster.core.engine_client import RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.routing.failover import ReplicaFailed
from pagerail.common.telemetry import get_tracer, traced

if TYPE_CHECKING:
    from pagerail.cluster.core.engine_client import EngineClient
    from pagerail.cluster.routing.routed_streams import OpenRequest
    from pagerail.cluster.routing.router import Router
    from pagerail.cluster.routing.router_metrics import RouterMetrics

logger = logging.getLogger(__name__)
_tracer = get_tracer("pagerail.router")
PREFILL, DECODE = "prefill", "decode"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class Moved(ReplicaFailed):
    """The router ended the request on its replica to resume it, with its KV, on another."""


class MoveHost(Protocol):
    """What moving a request needs of the client that routes it: its replicas and router, its open requests,
    rotation, and the transfer metrics."""

    router: Router
    metrics_registry: RouterMetrics

    @property
    def replicas(self) -> dict[str, EngineClient]: ...

    def open_request(self, request_id: str) -> OpenRequest | None: ...

    def open_on(self, replica: str) -> list[str]: ...

    def set_in_rotation(self, name: str, in_rotation: bool) -> None: ...


class KvMoves:
    """The routed client's moves: which replicas prefill and which decode (none: no disaggregation), and the
    hand-off itself."""

    def __init__(self, routed: MoveHost, prefill: frozenset[str] = frozenset()) -> None:
        self.routed = routed
        self.prefill = frozenset(prefill)
        self.num_moves = 0
        self.num_blocks_moved = 0
        self.bytes_moved = 0
        # Open KV channels between replicas' ranks, by (source, target).
        self._channels: dict[tuple[str, str], str] = {}

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    def movable(self, entry: OpenRequest, request: EngineRequest) -> bool:
        # A grammar's state lives on its replica, and a session's chunks are replayed there: neither moves.
        return entry.session is None and request.final and request.params.structured_outputs is None

    def first_attempt(self, entry: OpenRequest, request: EngineRequest) -> EngineRequest:
        """With disaggregation, a new request first runs on a prefill replica for its first token only."""
        limit = request.params.max_tokens
        if not self.disaggregated or not self.movable(entry, request) or request.resumed_output_token_ids:
            return request
        if limit is not None and limit <= 1:
            return request
        if not any(self.routed.router.routable(name) for name in self.prefill):
            return request  # no prefill replica in rotation: a decode replica does both, as colocated
        entry.phase = PREFILL
        return replace(request, params=replace(request.params, max_tokens=1))

    def continues(self, entry: OpenRequest, delta: RequestDelta) -> bool:
        """Whether this last delta of an attempt ends a phase rather than the request: the prefill attempt's one
        token, or the abort of a request the router is moving."""
        if entry.aborted:
            return False
        if entry.phase == PREFILL:
            return delta.finish_reason == "length"
        return entry.move_requested and delta.finish_reason == "abort"

    def excluded(self, entry: OpenRequest) -> frozenset[str]:
        """Replicas this attempt may not go to: decode replicas for a prefill, prefill replicas for the rest."""
        if not self.disaggregated:
            return frozenset()
        if entry.phase == PREFILL:
            return frozenset(self.routed.replicas) - self.prefill
        return self.prefill

    async def hand_off(self, entry: OpenRequest, source: str, token_ids: list[int], failed: set[str]) -> None:
        """Carry the source's blocks of `token_ids` to the replica the request resumes on (chosen now)."""
        entry.phase = DECODE if entry.phase == PREFILL else entry.phase
        exclude = {source, *failed, *self.excluded(entry)}
        try:
            target = entry.move_to or self.routed.router.rank(token_ids, exclude=exclude)[0].replica
        except Exception:  # no replica to move to: the resumption finds none either and says so
            return
        entry.move_to = target
        source_client, target_client = self.routed.replicas.get(source), self.routed.replicas.get(target)
        if source_client is None or target_client is None:
            return
        started = time.perf_counter()
        with traced(_tracer, "kv_transfer") as span:
            try:
                if hasattr(source_client, "kv_call") and hasattr(target_client, "kv_call"):
                    taken, nbytes = await self._over_channel(source, target, source_client, target_client, token_ids)
                else:
                    handoff = await source_client.export_kv(token_ids)
                    taken = await target_client.import_kv(handoff) if handoff is not None else 0
                    nbytes = handoff.nbytes * taken // max(handoff.num_blocks, 1) if handoff is not None else 0
            except Exception:  # the request recomputes on the target
                logger.warning("KV transfer %s -> %s failed; the request recomputes", source, target, exc_info=True)
                return
            seconds = time.perf_counter() - started
            span.set_attribute("pagerail.kv_transfer.source", source)
            span.set_attribute("pagerail.kv_transfer.target", target)
            span.set_attribute("pagerail.kv_transfer.blocks", taken)
            span.set_attribute("pagerail.kv_transfer.bytes", nbytes)
        self.num_moves += 1
        self.num_blocks_moved += taken
        self.bytes_moved += nbytes
        self.routed.metrics_registry.observe_kv_transfer(source, target, nbytes, seconds)

    async def _over_channel(self, source: str, target: str, src, dst, token_ids: list[int]) -> tuple[int, int]:
        """The move's blocks straight from the source's ranks to the target's (worker/kv_channel.py): the source
        holds them, the target reserves host slots not yet findable, both sides' ranks transfer at once, and the
        target's slots are settled; (blocks, bytes)."""
        holder = f"kv-move-{uuid.uuid4().hex}"
        handoff = await src.kv_call("kv_describe", token_ids, holder)
        if handoff is None:
            return 0, 0
        try:
            rows, slots = await dst.kv_call("kv_reserve", handoff)
            if not slots:
                return 0, 0
            hashes = [handoff.hashes[row] for row in rows]
            layout = handoff.layout
            shape = (
                len(rows),
                layout["num_layers"],
                2,
                layout["num_kv_heads"],
                layout["block_size"],
                layout["head_dim"],
            )
            try:
                channel = await self._channel(source, target, src, dst)
                await asyncio.gather(
                    src.kv_call("kv_send", holder, rows, channel),
                    dst.kv_call("kv_receive", channel, slots, shape, layout["dtype"]),
                )
            except BaseException:
                self._channels.pop((source, target), None)  # a side may have restarted: open anew next time
                await dst.kv_call("kv_settle", hashes, False)
                raise
            await dst.kv_call("kv_settle", hashes, True)
            per_block = 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["block_size"] * layout["head_dim"]
            return len(rows), len(rows) * per_block * _DTYPE_BYTES.get(layout["dtype"], 4)
        finally:
            await src.kv_call("kv_release", holder)

    async def _channel(self, source: str, target: str, src, dst) -> str:
        """The open channel from `source`'s ranks to `target`'s, opened on first use."""
        channel = self._channels.get((source, target))
        if channel is None:
            host, port, senders = await src.kv_call("kv_endpoint")
            receivers = (await dst.kv_call("kv_endpoint"))[2]
            channel = f"{source}->{target}:{uuid.uuid4().hex[:8]}"
            await asyncio.gather(
                src.kv_call("kv_open_channel", channel, host, port, 0, senders, receivers),
                dst.kv_call("kv_open_channel", channel, host, port, senders, senders, receivers),
            )
            self._channels[(source, target)] = channel
        return channel

    async def migrate(self, request_id: str, target: str | None = None) -> bool:
        """Move an open request off its replica (to `target`, or the best other one); False when it cannot move."""
        entry = self.routed.open_request(request_id)
        if entry is None or entry.client is None or entry.move_requested or not entry.movable:
            return False
        entry.move_to = target
        # The request ends there; its serving loop then hands its KV off and resumes it (see continues).
        entry.move_requested = True
        await entry.client.abort(request_id)
        return True

    async def drain(self, replica: str) -> int:
        """Take `replica` out of rotation and move every request it serves to other replicas; how many moved."""
        self.routed.set_in_rotation(replica, False)
        moved = 0
        for request_id in self.routed.open_on(replica):
            moved += await self.migrate(request_id)
        return moved
