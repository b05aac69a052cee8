"""One tensor-parallel rank as a Ray actor body: joins the process group, loads its shard, serves steps over gRPC."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import grpc

from pagerail.common import telemetry
from pagerail.common.auth import check_token
from pagerail.common.heap import freeze_startup_heap
from pagerail.common.tls import TlsConfig
from pagerail.worker.config import WorkerConfig

# torch and everything built on it are imported inside the methods that run on the rank: the head imports this
# module only to create the actors (ray.remote(WorkerActor)), and must not pay torch's import for that.
if TYPE_CHECKING:
    from pagerail.worker.kv_channel import KvChannel
    from pagerail.worker.parallel_state import TensorParallelGroup
    from pagerail.worker.worker import Worker

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
# Bounds the rendezvous (a rank that never shows up) and every later collective (a rank that died mid-step).
DEFAULT_DIST_TIMEOUT_S = 300.0
# In-flight steps get this long to finish when the head stops a rank.
_STOP_GRACE_S = 2.0
# KV channel stores listened on and not yet opened: a router that asked for an endpoint and then gave up leaves one.
_HELD_KV_STORES = 4
# Before sizing its KV cache, a rank on a GPU waits (at most this long) for the free memory to stop rising.
_MEMORY_SETTLE_TIMEOUT_S = 10.0


def builtin_errors(method):
    """Raise the method's errors as builtin exceptions: an error a rank sends the head crosses Ray pickled, and
    unpickling a torch one (a KV channel's DistStoreError when the other replica died) made the head import torch,
    250 MiB it otherwise never loads. Builtin errors (a model the group cannot split: ValueError) pass unchanged."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as error:
            if type(error).__module__ == "builtins":
                raise
            raise RuntimeError(f"{type(error).__module__}.{type(error).__qualname__}: {error}") from None

    return wrapped


def _ray_initialized() -> bool:
    # Imported here so the class is usable (and testable) in a plain process without paying for Ray's import.
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_rendezvous(rendezvous: str) -> str:
    host, sep, port = rendezvous.rpartition(":") if isinstance(rendezvous, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"rendezvous must be 'host:port' with a port in 1..65535, got {rendezvous!r}")
    return rendezvous


class WorkerActor:
    """The body of one rank's actor; the launcher wraps it with ray.remote and drives it in this order:
    node_ip / reserve_port (rank 0 only) → start on every rank at once → ... → stop."""

    def __init__(
        self, config: WorkerConfig, rank: int, world_size: int, token: str, tls: TlsConfig | None = None
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        if tls is not None and not isinstance(tls, TlsConfig):
            raise TypeError(f"tls must be a TlsConfig or None, got {type(tls).__name__}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._token = check_token(token)
        self._tls = tls
        self.worker: Worker | None = None
        self._server: grpc.Server | None = None
        self._joined_group = False
        # Channels for KV blocks to and from other replicas' ranks (worker/kv_channel.py), by id.
        self._kv_channels: dict[str, KvChannel] = {}
        # The store rank 0 hosts for the group's rendezvous (reserve_port), and the ones it listens on for KV
        # channels about to open (listen_kv_store), by port.
        self._group_store = None
        self._kv_stores: dict[int, object] = {}
        observability = config.engine.observability
        telemetry.configure_tracing(
            "worker",
            endpoint=observability.otlp_traces_endpoint,
            sampling_ratio=observability.trace_sampling_ratio,
            rank=rank,
        )

    def __repr__(self) -> str:
        # Ray prints actors in logs and errors; the token must never appear there.
        return f"WorkerActor(rank={self.rank}, world_size={self.world_size}, model_dir={self.config.model_dir!r})"

    def node_ip(self) -> str:
        """The address other nodes reach this actor on."""
        if _ray_initialized():
            import ray

            return ray.util.get_node_ip_address()
        return LOCALHOST

    def reserve_port(self) -> int:
        """The port of the torch.distributed store this rank (rank 0) now hosts for the group's rendezvous. It
        listens from now on, so no other process can take the port before the ranks start."""
        from pagerail.worker.kv_channel import listening_store

        self._group_store = listening_store(self.node_ip(), timeout_s=DEFAULT_DIST_TIMEOUT_S)
        return self._group_store.port

    def listen_kv_store(self) -> int:
        """Host a KV channel's store (rank 0 of the sending replica) on a port the system picks, listening from now
        on; the port, which this rank's kv_channel_open then uses. Unlike a reserved port, no other process can
        take it before the channel opens."""
        from pagerail.worker.kv_channel import listening_store

        store = listening_store(self.node_ip())
        self._kv_stores[store.port] = store
        while len(self._kv_stores) > _HELD_KV_STORES:  # endpoints asked for and never opened: the oldest go
            self._kv_stores.pop(next(iter(self._kv_stores)))
        return store.port

    def pid(self) -> int:
        return os.getpid()

    def flush_traces(self) -> bool:
        """Export the spans this rank still buffers; the head asks on its own flush and before stopping the rank."""
        return telemetry.flush()

    @builtin_errors
    def start(self, rendezvous: str, timeout_s: float = DEFAULT_DIST_TIMEOUT_S) -> dict[str, Any]:
        """Join the process group at `rendezvous` ('host:port' from rank 0's reserve_port), load the shard, serve.

        Every rank must call this at the same time: the rendezvous blocks until all `world_size` ranks joined.
        """
        if self.worker is not None:
            raise RuntimeError(f"rank {self.rank} is already started")
        from pagerail.worker.grpc_server import start_worker_server
        from pagerail.worker.worker import Worker

        config = self._resolved_config()
        try:
            tp = self._join_group(rendezvous, config, timeout_s)
            if config.device.startswith("cuda"):
                wait_for_device_memory_to_settle()
            try:
                self.worker = Worker(config, tp)
            except ValueError as error:
                # Typically heads or KV heads that the tensor-parallel size cannot split.
                raise ValueError(
                    f"rank {self.rank} of {self.world_size} cannot load {config.model_dir}: {error}"
                ) from error
            host = self.node_ip()
            self._server, port = start_worker_server(self.worker, host, self._token, self._tls)
        except BaseException:
            self.stop()
            raise
        address = _host_port(host, port)
        freeze_startup_heap()  # steps run from here on: the model's and the libraries' objects need no collecting
        logger.info(
            "rank %d of %d: %d KV blocks, serving on %s", self.rank, self.world_size, self.worker.num_blocks, address
        )
        return {
            "address": address,
            "num_blocks": self.worker.num_blocks,
            "num_host_blocks": self.worker.num_host_blocks,
            "kv_layout": self.worker.kv_layout,
            "weights": self.worker.weights,
            "pid": os.getpid(),
            "rank": self.rank,
            "node_id": _node_id(),
        }

    @builtin_errors
    def export_blocks(self, block_ids: list[int]):
        """This rank's KV heads of `block_ids` (worker/kv_transfer.py), for a request moving to another replica."""
        return self.worker.export_blocks(block_ids)

    @builtin_errors
    def import_host(self, slots: list[int], data) -> None:
        """Every KV head of blocks from another replica into this rank's host slots (its own heads of them)."""
        self.worker.import_host(slots, data)

    @builtin_errors
    def kv_channel_open(
        self, channel_id: str, host: str, port: int, group_rank: int, senders: int, receivers: int,
        transfer_base_s: float | None = None,
    ) -> None:  # fmt: skip
        """Join a KV channel with another replica's ranks; every member calls this at the same time.
        `transfer_base_s`: the fixed part of each transfer's deadline (None: worker/kv_channel.py's default)."""
        from pagerail.worker.kv_channel import TRANSFER_BASE_S, KvChannel

        base_s = TRANSFER_BASE_S if transfer_base_s is None else transfer_base_s
        store = self._kv_stores.pop(port, None) if group_rank == 0 else None
        self._kv_channels[channel_id] = KvChannel(
            host, port, group_rank, senders, receivers, self.worker.device, transfer_base_s=base_s, store=store
        )

    @builtin_errors
    def kv_send(self, channel_id: str, block_ids: list[int]) -> int:
        """This rank's heads of `block_ids` over the channel to the receiving ranks; the bytes sent."""
        data = self.worker.export_blocks(block_ids)
        with self._dropped_on_failure(channel_id) as channel:
            return channel.send(data, self.worker.kv_layout["num_kv_heads"])

    @builtin_errors
    def kv_receive(self, channel_id: str, slots: list[int], shape: tuple[int, ...], dtype: str) -> None:
        """Blocks from the channel into this rank's host slots (its own KV heads of them)."""
        if self.worker.host_kv is None:
            raise ValueError("this replica has no host KV tier to receive blocks into (kv_offload_bytes)")
        import torch

        with self._dropped_on_failure(channel_id) as channel:
            data = channel.receive(tuple(shape), getattr(torch, dtype), self.worker.kv_layout["num_kv_heads"])
        self.worker.host_kv.write(slots, data)

    @contextlib.contextmanager
    def _dropped_on_failure(self, channel_id: str):
        """The channel, forgotten when a transfer over it fails (the router opens a new one for the next move)."""
        channel = self._kv_channels[channel_id]
        try:
            yield channel
        except BaseException:
            self._kv_channels.pop(channel_id, None)
            channel.close()
            raise

    def stop(self) -> None:
        """Stop serving and leave the process group; safe to call more than once."""
        if self._server is not None:
            self._server.stop(grace=_STOP_GRACE_S).wait()
            self._server = None
        if self._joined_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self._joined_group = False
        self.worker = None

    def _resolved_config(self) -> WorkerConfig:
        """Pin the device and the CPU thread count this actor may use."""
        from pagerail.worker.worker import resolve_device

        config = self.config
        if config.device != "cpu" and resolve_device("auto").type == "cuda":
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, which is therefore always device 0.
            return dataclasses.replace(config, pinned_device="cuda:0")
        if config.num_threads is None:
            cpus = self._assigned_cpus()
            if cpus is not None:
                # A rank granted one CPU of a two-core node must not start a thread per core.
                return dataclasses.replace(config, num_threads=max(1, int(cpus)))
        return config

    @staticmethod
    def _assigned_cpus() -> float | None:
        if not _ray_initialized():
            return None
        import ray

        return ray.get_runtime_context().get_assigned_resources().get("CPU")

    def _join_group(self, rendezvous: str, config: WorkerConfig, timeout_s: float) -> TensorParallelGroup:
        import torch
        import torch.distributed as dist

        from pagerail.worker.parallel_state import TensorParallelGroup

        if self.world_size == 1:
            return TensorParallelGroup()
        _check_rendezvous(rendezvous)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed process group")
        on_cuda = config.device.startswith("cuda")
        if on_cuda:
            torch.cuda.set_device(0)
        timeout = datetime.timedelta(seconds=timeout_s)
        host, _, port = rendezvous.rpartition(":")
        store, self._group_store = self._group_store, None
        if store is None or store.port != int(port):
            store = dist.TCPStore(host.strip("[]"), int(port), self.world_size, self.rank == 0, timeout)
        dist.init_process_group(
            backend="nccl" if on_cuda else "gloo", store=store, rank=self.rank, world_size=self.world_size,
            timeout=timeout,
        )  # fmt: skip
        self._joined_group = True
        return TensorParallelGroup(self.rank, self.world_size, dist.group.WORLD)


def wait_for_device_memory_to_settle(timeout_s: float = _MEMORY_SETTLE_TIMEOUT_S, interval_s: float = 0.25) -> None:
    """Wait while the free memory of this process's GPU is still rising, for at most `timeout_s`.

    A rank killed just before (this group's previous life, or a leftover of a restarted head) frees its memory only
    as its process exits, and the KV cache is sized from what is free: sizing it too early would shrink the cache.
    """
    import torch

    free, total = torch.cuda.mem_get_info()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        now, _ = torch.cuda.mem_get_info()
        if now <= free + total // 100:  # steady (within 1% of the device)
            return
        logger.info(
            "free GPU memory still rising (%.1f → %.1f GiB); waiting before sizing the KV cache",
            free / 2**30,
            now / 2**30,
        )
        free = now


def _node_id() -> str:
    """The Ray node this rank runs on ("local" outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    except ImportError:
        return "local"
