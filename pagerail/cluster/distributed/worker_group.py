"""Starts, restarts and stops one model replica's tensor-parallel worker actors on Ray."""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagerail.cluster.core.executor import CompletedStep, PendingStep, WorkerGroupError
from pagerail.cluster.distributed.cluster_options import DEFAULT_OPTIONS, check_placement_strategy
from pagerail.cluster.distributed.remote_executor import RemoteExecutor
from pagerail.common.tls import TlsConfig
from pagerail.proto import step_pb2
from pagerail.worker.actor import WorkerActor
from pagerail.worker.config import WorkerConfig

logger = logging.getLogger(__name__)

# How long stopping waits for killed ranks to be gone (their GPU memory is freed when the process exits).
_GONE_TIMEOUT_S = 30.0


class WorkerGroup:
    """One placement group, one actor per rank, one gRPC client to them all.

    Implements the head's executor interface, so the engine loop cannot tell it from the in-process one.
    With a `name` (the head actor's), the placement group is "<name>-workers" and rank r is "<name>-rank<r>":
    a restarted head finds what its previous life left behind (Ray frees a group only when its creator is dead
    for good, and a restarting head is not) and removes it before reserving again.
    """

    def __init__(
        self,
        config: WorkerConfig,
        size: int,
        token: str,
        *,
        use_gpu: bool = False,
        cpus_per_worker: float = 1,
        placement_strategy: str = DEFAULT_OPTIONS.placement_strategy,
        tls: TlsConfig | None = None,
        step_timeout_s: float = DEFAULT_OPTIONS.step_timeout_s,
        ready_timeout_s: float = 600.0,
        name: str | None = None,
    ) -> None:
        check_placement_strategy(placement_strategy)
        self.config = config
        self.size = size
        self._token = token
        self._use_gpu = use_gpu
        # Ranks in processes of their own: the head schedules the next step while they compute, on GPUs and on
        # CPUs alike (served on two CPU cores, 1.05x the output tokens/s of serial steps at TP 1 and 2).
        self.overlap_by_default = True
        self._cpus = cpus_per_worker
        self._strategy = placement_strategy
        self._tls = tls
        self._step_timeout = step_timeout_s
        self._ready_timeout = ready_timeout_s
        self.name = name
        self._placement = None
        self._actors: list = []
        self._pings: dict[int, ray.ObjectRef] = {}  # one liveness call in flight per rank, while a step runs
        self._executor: RemoteExecutor | None = None
        self.num_blocks = 0
        self.num_host_blocks = 0  # the host KV tier's slots per rank (0: no tier)
        self.kv_layout: dict = {}  # what one KV block is (worker/worker.py kv_layout)
        self.weights: dict | None = None
        self.pids: list[int] = []
        self.node_ids: list[str] = []
        self.addresses: list[str] = []

    def start(self) -> int:
        """Reserve the bundles, start every rank, join them into one group; returns the usable block count."""
        bundle = {"GPU": 1, "CPU": self._cpus} if self._use_gpu else {"CPU": self._cpus}
        self._remove_leftovers()
        self._placement = placement_group(
            [dict(bundle) for _ in range(self.size)],
            strategy=self._strategy,
            name=self._placement_name or "",
        )
        try:
            ray.get(self._placement.ready(), timeout=self._ready_timeout)
        except ray.exceptions.GetTimeoutError as error:
            raise WorkerGroupError(
                f"the cluster cannot fit {self.size} bundles of {bundle} ({self._strategy}) within "
                f"{self._ready_timeout:.0f}s; add nodes or lower tensor_parallel_size"
            ) from error
        self._actors = self._create_ranks()
        try:
            rank0 = self._actors[0]
            rendezvous = f"{ray.get(rank0.node_ip.remote())}:{ray.get(rank0.reserve_port.remote())}"
            # Every rank must enter init_process_group together, so start them all before waiting.
            starts = [actor.start.remote(rendezvous) for actor in self._actors]
            infos = _get_all_or_first_error(starts, self._ready_timeout)
        except Exception:
            self.shutdown()
            raise
        infos.sort(key=lambda info: info["rank"])
        self.addresses = [info["address"] for info in infos]
        self.pids = [info["pid"] for info in infos]
        self.node_ids = [info["node_id"] for info in infos]
        # Every rank holds a shard of the same blocks: the table is as large as the smallest shard.
        self.num_blocks = min(info["num_blocks"] for info in infos)
        self.num_host_blocks = min(info.get("num_host_blocks", 0) for info in infos)
        self.kv_layout = infos[0].get("kv_layout", {})
        # The replica's weights: one format, bytes summed over the ranks' shards.
        self.weights = {**infos[0]["weights"], "weight_bytes": sum(info["weights"]["weight_bytes"] for info in infos)}
        self._pings = {}
        try:
            # Opens every rank's step stream: a rank that refuses it fails the start, not the first step.
            self._executor = RemoteExecutor(
                self.addresses, self._token, self._tls, self._step_timeout, dead_ranks=self._dead_ranks
            )
        except Exception:
            self.shutdown()
            raise
        logger.info("worker group of %d ranks up at %s with %d blocks", self.size, self.addresses, self.num_blocks)
        return self.num_blocks

    def _create_ranks(self) -> list:
        """One worker actor per rank, each in its bundle of the placement group (not yet started)."""
        actor_class = ray.remote(WorkerActor)
        return [
            actor_class.options(
                num_cpus=self._cpus,
                num_gpus=1 if self._use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank
                ),
                max_restarts=0,
                **({"name": self._actor_name(rank)} if self.name else {}),
            ).remote(self.config, rank, self.size, self._token, self._tls)
            for rank in range(self.size)
        ]

    def start_despite_deaths(self, max_restarts: int, backoff_s: float = 0.5, max_backoff_s: float = 10.0) -> int:
        """start(), and again while a rank's process dies during it (killed, out of memory, its node lost), up to
        `max_restarts` more times, as a rank that dies during a step is replaced; returns the usable block count.
        An error a rank raised (a model it cannot load) is not retried: starting again would raise it again."""
        attempt = 0
        while True:
            try:
                return self.start()
            except ray.exceptions.RayActorError as error:
                if attempt >= max_restarts:
                    raise
                attempt += 1
                delay = min(backoff_s * 2 ** (attempt - 1), max_backoff_s)
                logger.warning("a rank died while the group started (%s); start %d in %.1fs", error, attempt, delay)
                time.sleep(delay)

    @property
    def running(self) -> bool:
        """True between a successful start and the next shutdown (false while restarting)."""
        return self._executor is not None

    @property
    def dispatch_stats(self):
        return self._executor.stats if self._executor is not None else None

    def submit(self, batch: step_pb2.StepBatch) -> PendingStep:
        if self._executor is None:
            return CompletedStep(error=WorkerGroupError("the worker group is not running"))
        return self._executor.submit(batch)

    def restart(self) -> int:
        """Stop every rank, wait until their processes are gone, start fresh ones; returns the new block count."""
        self.shutdown()
        return self.start()

    def export_blocks(self, block_ids: list[int], timeout_s: float = 60.0):
        """Every KV head of `block_ids`, gathered from the ranks' shards, for a request moving to another replica."""
        from pagerail.worker.kv_transfer import gather_heads

        shards = ray.get([actor.export_blocks.remote(block_ids) for actor in self._actors], timeout=timeout_s)
        return gather_heads(shards, self.kv_layout["num_kv_heads"])

    def import_host(self, slots: list[int], data, timeout_s: float = 60.0) -> None:
        """Blocks from another replica into every rank's host slots (each keeps its own KV heads)."""
        ref = ray.put(data)
        ray.get([actor.import_host.remote(slots, ref) for actor in self._actors], timeout=timeout_s)

    def kv_endpoint(self) -> tuple[str, int, int]:
        """(host, port) of the store rank 0 now listens on for a KV channel, and this replica's tensor-parallel
        size."""
        rank0 = self._actors[0]
        return ray.get(rank0.node_ip.remote()), ray.get(rank0.listen_kv_store.remote()), self.size

    def open_kv_channel(
        self, channel_id: str, host: str, port: int, first_rank: int, senders: int, receivers: int,
        timeout_s: float = 30.0, transfer_base_s: float | None = None,
    ) -> None:  # fmt: skip
        """Join every rank to a KV channel as group ranks first_rank.. (the other replica joins at the same time)."""
        refs = [
            actor.kv_channel_open.remote(channel_id, host, port, first_rank + rank, senders, receivers, transfer_base_s)
            for rank, actor in enumerate(self._actors)
        ]
        ray.get(refs, timeout=timeout_s)

    def send_blocks(self, channel_id: str, block_ids: list[int], timeout_s: float = 120.0) -> int:
        """Every rank sends its heads of `block_ids` over the channel; the bytes sent."""
        refs = [actor.kv_send.remote(channel_id, block_ids) for actor in self._actors]
        return sum(ray.get(refs, timeout=timeout_s))

    def receive_blocks(
        self, channel_id: str, slots: list[int], shape: tuple[int, ...], dtype: str, timeout_s: float = 120.0
    ) -> None:
        """Every rank receives its heads of the blocks over the channel into its host slots."""
        refs = [actor.kv_receive.remote(channel_id, slots, shape, dtype) for actor in self._actors]
        ray.get(refs, timeout=timeout_s)

    def flush_traces(self, timeout_s: float = 10.0) -> bool:
        """Ask every rank to export the spans it still buffers; False when one did not within `timeout_s`."""
        try:
            return all(ray.get([actor.flush_traces.remote() for actor in self._actors], timeout=timeout_s))
        except ray.exceptions.RayError as error:  # a dead or stuck rank: its spans are lost, not the caller's call
            logger.warning("could not flush the ranks' traces: %s", error)
            return False

    def shutdown(self) -> None:
        """Kill every rank and free the bundles; returns once the ranks are dead, so their memory is free."""
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        actors, self._actors = self._actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if self._placement is not None:
            remove_placement_group(self._placement)
            self._placement = None
        here = ray.get_runtime_context().get_node_id()
        local_pids = [pid for pid, node in zip(self.pids, self.node_ids, strict=True) if node == here]
        self.pids, self.node_ids, self.addresses = [], [], []
        _wait_until_gone(actors, local_pids)

    # -- failure handling -----------------------------------------------------------------------

    @property
    def _placement_name(self) -> str | None:
        return f"{self.name}-workers" if self.name else None

    def _actor_name(self, rank: int) -> str:
        return f"{self.name}-rank{rank}"

    def _remove_leftovers(self) -> None:
        """Kill the ranks and remove the placement group that an earlier life of this (named) group left."""
        if not self.name:
            return
        leftovers = []
        for rank in range(self.size):
            try:
                actor = ray.get_actor(self._actor_name(rank))
            except ValueError:
                continue
            ray.kill(actor, no_restart=True)
            leftovers.append(actor)
        for _ in range(16):  # one group per earlier life at most; bounded in case a removal does not take
            try:
                stale = get_placement_group(self._placement_name)
            except ValueError:
                break
            logger.warning("removing placement group %s left by a previous head", self._placement_name)
            remove_placement_group(stale)
        if leftovers:
            logger.warning("killed %d worker(s) left by a previous head", len(leftovers))
            _wait_until_gone(leftovers, [])

    def _dead_ranks(self) -> list[int]:
        """The ranks Ray reports dead. Never blocks: each rank has one call in flight, read once it completed."""
        for rank, actor in enumerate(self._actors):
            if rank not in self._pings:
                self._pings[rank] = actor.pid.remote()
        refs = dict(self._pings)
        if not refs:
            return []
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        dead = []
        for rank, ref in refs.items():
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.ActorDiedError:
                dead.append(rank)
                continue
            except ray.exceptions.RayError:
                pass  # unreachable for now, not known dead: the step deadline still applies
            del self._pings[rank]  # answered: ask again next time
        return dead


def _wait_until_gone(actors: list, local_pids: list[int], timeout_s: float = _GONE_TIMEOUT_S) -> None:
    """Block until Ray reports each killed actor dead and each listed process on this node has exited.

    A new rank sizes its KV cache from the free GPU memory, which a dying rank holds until its process exits.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(actors)
    while pending and time.monotonic() < deadline:
        alive = []
        for actor, ref in [(actor, actor.pid.remote()) for actor in pending]:
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.ActorDiedError:
                continue
            except ray.exceptions.RayError:
                pass  # still answering (the call ran before the kill landed), or not yet known dead
            alive.append(actor)
        pending = alive
        if pending:
            time.sleep(0.05)
    pids = list(local_pids)
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if process_running(pid)]
        if pids:
            time.sleep(0.05)
    if pending or pids:
        logger.warning(
            "%d killed rank(s) still not gone after %.0fs (processes %s); starting the new ranks anyway",
            max(len(pending), len(pids)),
            timeout_s,
            pids,
        )


def process_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a zombie has released its memory)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _get_all_or_first_error(refs: list, timeout_s: float) -> list:
    """ray.get of every ref, raising as soon as one of them fails. ray.get itself waits for all of them first, and
    the ranks that did not die wait in the rendezvous for the one that did until their own timeout (minutes)."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} ranks not started in {timeout_s:.0f}s")
        ray.get(done[0])  # its error, if it failed, now rather than when every other rank gave up
    return ray.get(refs)
