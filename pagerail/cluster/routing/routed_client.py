"""One EngineClient over data-parallel replicas of a model: routes each request, spills when full, fails over."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import asdict, replace

from pagerail.cluster.core.engine_client import EngineClient, RequestDelta
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.errors import QueueFullError
from pagerail.cluster.routing.failover import ReplicaFailed, ended, is_replica_failure
from pagerail.cluster.routing.kv_event_index import KvEventIndex, read_kv_events
from pagerail.cluster.routing.kv_moves import KvMoves, Moved
from pagerail.cluster.routing.replica_fanout import (
    call_all,
    load_of,
    merged_metrics,
    merged_stats,
    on_every_replica,
    probe,
)
from pagerail.cluster.routing.routed_streams import Aborted, OpenRequest, close_stream, next_delta, pin_key, replay_into
from pagerail.cluster.routing.router import NoReplicaError, Route, Router, check_replica_name
from pagerail.cluster.routing.router_metrics import RouterMetrics
from pagerail.cluster.routing.session_log import SessionLog
from pagerail.common.telemetry import trace

logger = logging.getLogger(__name__)

# Attributes of the "routed" event on a request's span.
ROUTE_REPLICA = "pagerail.route.replica"
ROUTE_REASON = "pagerail.route.reason"
ROUTE_CACHED_TOKENS = "pagerail.route.estimated_cached_tokens"
# Where the prefix-aware router learns what each replica caches: its block events, or the prompts sent to it.
ROUTING_INDEXES = ("events", "estimate")


class RoutedEngineClient:
    """Implements EngineClient over named replica clients of one model (see cluster/routing/router.py for the policies).

    A replica that fails after admission (`is_replica_failure`: its actor died, its connection broke, its workers
    gave up) is taken out of rotation and the request resumes on another replica after the tokens already streamed,
    with the same parameters: the client sees one continuous request. Any other error is the caller's to see.
    Streaming-input sessions stay on the replica that opened them and fail with an error instead. `refresh_loads()`
    (called by the owner) feeds the replicas' reported load to the router and puts failed replicas back once they
    answer again. A request that must resume while no replica is in rotation (every one failed or is draining) waits
    up to `resume_wait_s` for one to come back before it ends with an error.
    """

    resume_wait_s = 60.0

    def __init__(
        self,
        replicas: dict[str, EngineClient],
        *,
        policy: str = "prefix-aware",
        block_size: int = 16,
        model_name: str | None = None,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        index: str = "estimate",
        prefill_replicas: Collection[str] = (),
        adapter_slots: int = 1,
    ) -> None:
        if index not in ROUTING_INDEXES:
            raise ValueError(f"index must be one of {ROUTING_INDEXES}, got {index!r}")
        if not isinstance(replicas, dict) or not replicas:
            raise ValueError("replicas must be a non-empty dict of name -> EngineClient")
        first = next(iter(replicas.values()))
        self.model_name = model_name if model_name is not None else first.model_name
        self.max_model_len = max_model_len if max_model_len is not None else first.max_model_len
        self.vocab_size = vocab_size if vocab_size is not None else first.vocab_size
        self.eos_token_ids = first.eos_token_ids
        # "events": the router follows the replicas' block events (exact); "estimate": the prompts it sent.
        self.follows_events = index == "events"
        self.router = Router(
            policy,
            block_size=block_size,
            index=KvEventIndex(block_size) if self.follows_events else None,
            adapter_slots=adapter_slots,
        )
        self.metrics_registry = RouterMetrics(self.model_name)
        # Moving requests with their KV: live migration, and prefill/decode disaggregation over `prefill_replicas`.
        self.moves = KvMoves(self, frozenset(prefill_replicas))
        self._clients: dict[str, EngineClient] = {}
        self._open: dict[str, OpenRequest] = {}
        self._pins: dict[str, list] = {}  # sibling group's parent id -> [replica, open siblings]
        self.num_failovers = 0
        self.num_spills = 0
        self.num_routed: dict[str, int] = {}  # requests (and resumptions) each replica admitted
        for name, client in replicas.items():
            self.add_replica(name, client)

    # -- membership -----------------------------------------------------------------------------

    def add_replica(self, name: str, client: EngineClient) -> None:
        check_replica_name(name)
        if name in self._clients:
            raise ValueError(f"replica {name!r} is already known")
        self.router.add_replica(name)
        self._clients[name] = client
        self._count_rotation()

    def remove_replica(self, name: str) -> None:
        """Stop routing to `name`; requests open there run on (or fail over) through the client they hold."""
        self._clients.pop(name, None)
        self.router.remove_replica(name)
        self._count_rotation()

    def set_in_rotation(self, name: str, in_rotation: bool) -> None:
        """Take a replica out of rotation (draining: its open requests finish) or put it back."""
        self.router.set_in_rotation(name, in_rotation)
        self._count_rotation()

    @property
    def replicas(self) -> dict[str, EngineClient]:
        return dict(self._clients)

    def open_request(self, request_id: str) -> OpenRequest | None:
        return self._open.get(request_id)

    def open_on(self, replica: str) -> list[str]:
        """The requests `replica` serves now."""
        return [request_id for request_id, entry in self._open.items() if entry.replica == replica]

    # -- requests -------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Run the request on a replica; when that replica fails, resume it on another after the outputs it has."""
        # One id names one request across every replica: abort and append_input must find a single holder.
        request_id = request.request_id
        if request_id in self._open:
            raise ValueError(f"request_id {request_id!r} is already in use")
        final = request.final
        session = None if final else SessionLog(self.max_model_len)
        entry = self._open[request_id] = OpenRequest(request_id, session=session)
        pin = pin_key(request)
        try:
            params = request.params
            num_prompt = len(request.prompt_token_ids)
            # Every output of the request so far, all of them with its caller: what a resumed run continues after.
            outputs = list(request.resumed_output_token_ids)
            failed: set[str] = set()
            yielded = False
            cached = 0
            entry.movable = self.moves.movable(entry, request)
            attempt = self.moves.first_attempt(entry, request)
            resume_by = None  # while resuming: until when it may wait for a replica to take it
            while True:
                try:
                    # The previous move (if any) is done once this attempt starts. Cleared before admitting, not
                    # after: a drain while the replica admits it aborts it there, and that abort is a move too.
                    entry.move_requested = False
                    replica, stream, outcome = await self._admit(entry, attempt, failed, pin)
                    entry.move_to = None
                except Aborted:
                    yield ended(request_id, num_prompt, len(outputs), cached, "abort")
                    return
                except (QueueFullError, ValueError) as error:
                    # Every replica left is full, none is left, or one refused.
                    if not yielded:
                        raise
                    if isinstance(error, QueueFullError) and resume_by is not None and time.monotonic() < resume_by:
                        # The caller holds a half-finished answer: wait for a replica (a restarted head, the end
                        # of a drain) rather than lose it. Failed replicas are tried again once they answer.
                        await asyncio.sleep(min(max(error.retry_after_s, 0.1), 1.0))
                        failed.clear()
                        continue
                    why = f"no replica could resume it: {error}"
                    yield ended(request_id, num_prompt, len(outputs), cached, "abort", why)
                    return
                failure = outcome if isinstance(outcome, BaseException) else None
                completed = False
                try:
                    delta = outcome
                    while failure is None:
                        if delta.finished and delta.error_code == "worker_failure" and final and not entry.aborted:
                            # The replica's workers gave up: resume elsewhere, after passing on any last tokens.
                            failure = ReplicaFailed(delta.error or "the replica's workers failed")
                            delta = replace(delta, finished=False, finish_reason=None, error=None, error_code=None)
                        elif delta.finished and self.moves.continues(entry, delta):  # a phase ends, not the request
                            failure = Moved(f"moving off {replica}")
                            delta = replace(delta, finished=False, finish_reason=None)
                        if not yielded:
                            cached = min(delta.num_cached_tokens, num_prompt)
                        elif failed and delta.num_cached_tokens != cached:
                            # A resumed run may find the first run's outputs cached: report the one prompt hit.
                            delta = replace(delta, num_cached_tokens=cached)
                        if failure is None or delta.token_ids:
                            outputs.extend(delta.token_ids)
                            yielded = True
                            yield delta
                        if failure is not None or delta.finished:
                            completed = failure is None
                            if delta.error_code == "worker_failure":  # a session's replica gave up
                                self._replica_failed(replica, delta.error)
                            break
                        failure, delta = await next_delta(stream)
                finally:
                    await close_stream(stream)
                    # A finished request's whole sequence now sits in that replica's prefix cache (an adapter's
                    # under its adapter's hashes).
                    indexed = completed and final
                    lora_id = request.lora.lora_int_id if request.lora is not None else 0
                    self.router.end(replica, [*request.prompt_token_ids, *outputs] if indexed else None, lora_id)
                if completed:
                    return
                if isinstance(failure, Moved):
                    await self.moves.hand_off(entry, replica, [*request.prompt_token_ids, *outputs], failed)
                    attempt = request.resumed(outputs)
                    # Like a failover, a moved request holds a half-finished answer: while every other replica is
                    # full or out of rotation (a drain beside a restarting head), it waits for one.
                    resume_by = time.monotonic() + self.resume_wait_s
                    continue
                self._replica_failed(replica, failure)
                if entry.session is not None:
                    raise session_lost(replica, request_id, failure) from failure
                if entry.aborted:
                    yield ended(request_id, num_prompt, len(outputs), cached, "abort")
                    return
                failed.add(replica)
                resume_by = time.monotonic() + self.resume_wait_s
                entry.phase = None  # the resumption is the whole request: where it prefills, it decodes too
                self.num_failovers += 1
                self.metrics_registry.failovers.labels(self.model_name, replica).inc()
                if (params.max_tokens is not None and len(outputs) >= params.max_tokens) or (
                    num_prompt + len(outputs) >= self.max_model_len
                ):
                    yield ended(request_id, num_prompt, len(outputs), cached, "length")  # only the end went missing
                    return
                # The same request after the outputs it has: the same parameters, seeds and penalty counts go on.
                attempt = request.resumed(outputs)
        finally:
            # A caller that leaves early closed the replica's stream above, which aborts the request there.
            del self._open[request_id]
            if entry.pinned:
                self._pins[pin][1] -= 1
                if self._pins[pin][1] <= 0:
                    del self._pins[pin]

    async def _admit(
        self, entry: OpenRequest, request: EngineRequest, failed: set[str], pin: str | None
    ) -> tuple[str, AsyncIterator[RequestDelta], RequestDelta | Exception]:
        """Open the request on the best replica that takes it, the next ones in turn while they are full, and
        return its first delta there, or the error of a replica that failed instead. Raises ValueError (bad input)
        and QueueFullError (every replica full, or none in rotation)."""
        started = time.perf_counter()
        # What the replica computes: the prompt, and the outputs a resumed request continues after.
        prompt = [*request.prompt_token_ids, *request.resumed_output_token_ids]
        lora_id = request.lora.lora_int_id if request.lora is not None else 0
        hashes = self.router.index.block_hashes(prompt, lora_id)
        routes = self._routes(entry, prompt, hashes, failed, pin, lora_id)
        self.metrics_registry.observe_routing(time.perf_counter() - started)
        full: list[QueueFullError] = []
        for route in routes:
            if entry.aborted:  # while a replica that refused or failed held it
                raise Aborted
            client = self._clients.get(route.replica)
            if client is None or not self.router.routable(route.replica):
                continue  # it left or failed while an earlier replica was being tried
            self.router.begin(route.replica, prompt, hashes, lora_id)
            self.metrics_registry.routed(route.replica, route.reason, route.cached_tokens)
            # On the request's span (the caller's current one): where it went and why.
            trace.get_current_span().add_event(
                "routed",
                {ROUTE_REPLICA: route.replica, ROUTE_REASON: route.reason, ROUTE_CACHED_TOKENS: route.cached_tokens},
            )
            replay = entry.session is not None and bool(full)
            if not replay:  # a session that moves switches under its lock, with the replay of its chunks
                entry.replica, entry.client = route.replica, client
            self._pin(entry, pin, route.replica)
            stream = None
            try:
                stream = client.generate(request)
                first = await replay_into(entry, route.replica, client, stream) if replay else await anext(stream)
            except QueueFullError as error:
                await self._release(route.replica, stream)
                full.append(error)
                self.num_spills += 1
                if entry.session is not None and not entry.session.replayable:
                    raise
                continue
            except StopAsyncIteration:
                failure = ReplicaFailed("the replica ended the stream before its first delta")
                return route.replica, stream, failure  # the caller releases it, as any failed attempt
            except Exception as error:
                if is_replica_failure(error):
                    return route.replica, stream, error  # the caller releases it, as any failed attempt
                await self._release(route.replica, stream)
                raise  # bad input, or a bug: no other replica would do better
            except BaseException:  # cancelled
                await self._release(route.replica, stream)
                raise
            self.metrics_registry.cached_tokens.labels(self.model_name, route.replica).inc(first.num_cached_tokens)
            self.num_routed[route.replica] = self.num_routed.get(route.replica, 0) + 1
            if entry.session is not None:
                entry.session.confirm()
            return route.replica, stream, first
        if not full:
            raise NoReplicaError(f"no replica in rotation is left to take request {entry.request_id!r}")
        retry_after = min(error.retry_after_s for error in full)
        raise QueueFullError(f"all {len(full)} replicas tried are full; retry shortly", retry_after)

    async def _release(self, replica: str, stream: AsyncIterator[RequestDelta] | None) -> None:
        await close_stream(stream)
        self.router.end(replica)

    def _routes(
        self,
        entry: OpenRequest,
        prompt: list[int],
        hashes: list[bytes],
        failed: set[str],
        pin: str | None,
        lora_id: int = 0,
    ) -> list[Route]:
        """Replicas to try in order; the first carries the reason of the choice, the others are spills."""
        exclude = failed | self.moves.excluded(entry)
        routes = self.router.rank(prompt, exclude=exclude, hashes=hashes, lora_id=lora_id)
        if entry.move_to is not None:  # where its KV went
            target = [route for route in routes if route.replica == entry.move_to]
            return [*(r._replace(reason="moved") for r in target), *(r for r in routes if r.replica != entry.move_to)]
        if failed:
            return [routes[0]._replace(reason="failover"), *routes[1:]]
        pinned = self._pins[pin][0] if pin in self._pins else None
        for i, route in enumerate(routes):
            if route.replica == pinned:
                rest = [other._replace(reason="spill") for other in routes[:i] + routes[i + 1 :]]
                return [route._replace(reason="pinned"), *rest]
        return routes

    def _pin(self, entry: OpenRequest, pin: str | None, replica: str) -> None:
        """Sibling choices follow this request to `replica` while any of them is open."""
        if pin is None:
            return
        if not entry.pinned:
            entry.pinned = True
            self._pins.setdefault(pin, [replica, 0])[1] += 1
        self._pins[pin][0] = replica

    async def append_input(self, request_id: str, token_ids: list[int], final: bool) -> None:
        entry = self._open.get(request_id)
        if entry is None or entry.session is None or entry.client is None:
            raise ValueError(f"request_id {request_id!r} is not an open streaming-input session")
        session = entry.session
        async with session.lock:
            session.record(token_ids, final)
            try:
                await entry.client.append_input(request_id, token_ids, final)
            except Exception as error:
                if not is_replica_failure(error):
                    raise
                # What the session's stream says when its replica dies: the caller learns why and what to do.
                raise session_lost(entry.replica, request_id, error) from error

    async def abort(self, request_id: str, stopped: bool = False) -> None:
        entry = self._open.get(request_id)
        if entry is None or entry.client is None:
            return
        entry.aborted = True
        try:
            await entry.client.abort(request_id, stopped=stopped)
        except Exception:  # a dead replica: its stream fails, and the request ends as aborted
            logger.warning("abort of %s at replica %s failed", request_id, entry.replica, exc_info=True)

    # -- the replicas as a whole ----------------------------------------------------------------

    async def is_ready(self) -> bool:
        """Ready while any replica in rotation is."""
        clients = {name: self._clients[name] for name in self.router.in_rotation()}
        return any(answer is True for answer in (await call_all(clients, "is_ready")).values())

    async def pause(self, mode: str) -> None:
        await on_every_replica(dict(self._clients), "pause", mode)

    async def resume(self) -> None:
        await on_every_replica(dict(self._clients), "resume")

    async def refresh_loads(self, timeout_s: float = 5.0) -> None:
        """Ask every replica for its load and readiness and feed the router; one that does not answer in
        `timeout_s`, fails or is not ready leaves the rotation, and one that answers ready again rejoins it."""

        async def one(name: str, client: EngineClient) -> None:
            stats, ready = await probe(name, client, timeout_s)
            if self._clients.get(name) is not client:
                return  # removed or replaced meanwhile
            if stats is not None:
                self.router.set_load(name, *load_of(stats))
                if self.follows_events:
                    await read_kv_events(self.router.index, name, client, timeout_s, lambda: self._clients.get(name))
            self.router.set_healthy(name, ready)

        await asyncio.gather(*(one(name, client) for name, client in list(self._clients.items())))
        self._count_rotation()

    async def stats(self) -> dict:
        """The replicas' counts summed at the top, each replica's stats under "replicas", the router's under
        "router"."""
        merged = await merged_stats(dict(self._clients))
        router = self.router
        merged["router"] = {
            "policy": router.policy,
            "num_replicas": len(router.replicas),
            "num_in_rotation": len(router.in_rotation()),
            "num_open_requests": len(self._open),
            "num_failovers": self.num_failovers,
            "num_spills": self.num_spills,
            "num_routed": dict(self.num_routed),
            "num_index_entries": len(router.index),
            "replicas": {name: {**asdict(state), "load": router.load(name)} for name, state in router.replicas.items()},
        }
        return merged

    async def metrics(self) -> str:
        """Every replica's series with a `replica` label, then the router's own."""
        self._count_rotation()
        return await merged_metrics(dict(self._clients)) + self.metrics_registry.render()

    def _replica_failed(self, name: str, error: object) -> None:
        logger.warning("replica %s failed; out of rotation until it answers again: %s", name, error)
        if name in self.router.replicas:
            self.router.set_healthy(name, False)
        self._count_rotation()

    def _count_rotation(self) -> None:
        self.metrics_registry.in_rotation.labels(self.model_name).set(len(self.router.in_rotation()))


def session_lost(replica: str | None, request_id: str, error: object) -> ReplicaFailed:
    """The error a streaming-input session ends with when its replica fails, on its stream or on a chunk."""
    return ReplicaFailed(
        f"replica {replica!r} failed during streaming-input session {request_id!r} ({error}); "
        "a session cannot move to another replica: open a new one"
    )
