"""The rank's share of the host KV tier: host-memory slots that hold copies of KV blocks, filled and read back as
each step's message says (the head decides which; see cluster/core/host_kv_tier.py)."""

from __future__ import annotations

import time

import torch

from pagerail.proto import step_pb2


def available_host_memory() -> int | None:
    """Bytes of host memory the kernel reports available (MemAvailable), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_slots_for(kv_offload_bytes: int, bytes_per_block: int, available: int | None) -> int:
    """How many host blocks `kv_offload_bytes` holds; refused, naming both numbers, beyond available memory."""
    if available is not None and kv_offload_bytes > available:
        raise ValueError(
            f"kv_offload_bytes={kv_offload_bytes} exceeds the host memory available to this rank ({available} bytes)"
        )
    slots = kv_offload_bytes // bytes_per_block
    if slots < 1:
        raise ValueError(f"kv_offload_bytes={kv_offload_bytes} holds no KV block of {bytes_per_block} bytes")
    return slots


class HostKvPool:
    """One [num_slots, 2, kv_heads, block_size, head_dim] host tensor per layer of the device cache (whose layers
    are [2, kv_heads, num_blocks * block_size, head_dim]); pinned on CUDA, so the copies queue on the step's
    stream without a host wait and the forward that follows sees them done."""

    def __init__(self, caches: list[torch.Tensor], num_slots: int, block_size: int) -> None:
        self.caches = caches
        self.num_slots = num_slots
        self.block_size = block_size
        self.device = caches[0].device
        pin = self.device.type == "cuda"
        _, heads, _, head_dim = caches[0].shape
        self.pools = [
            torch.zeros((num_slots, 2, heads, block_size, head_dim), dtype=cache.dtype, pin_memory=pin)
            for cache in caches
        ]
        self.bytes_per_block = self.pools[0][0].numel() * self.pools[0].element_size() * len(caches)
        # CUDA: the stream background offloads run on, and the event the next step waits for.
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._beside: torch.cuda.Event | None = None

    def transfer(self, batch: step_pb2.StepBatch) -> float:
        """The step's copies, offloads first; seconds the host spent issuing them (on CUDA they run queued).
        Called before every step's forward, with copies or without.

        On CUDA the offloads of freed blocks (not `offload_now`) run on a stream of their own beside the forward;
        the next step's work, whether it copies or not, waits for them on the device, so a block or slot they read
        or write is never reused before they are done. The others, and the loads, run on the step's stream ahead
        of its forward."""
        started = time.perf_counter()
        if self._beside is not None:
            # The previous step's background copies are done before anything of this step runs on the device.
            torch.cuda.current_stream(self.device).wait_event(self._beside)
            self._beside = None
        blocks, slots = list(batch.offload_blocks), list(batch.offload_slots)
        if not blocks and not batch.load_slots:
            return 0.0
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            now = list(batch.offload_now) or [True] * len(blocks)
            later = [(b, s) for b, s, n in zip(blocks, slots, now, strict=True) if not n]
            blocks = [b for b, n in zip(blocks, now, strict=True) if n]
            slots = [s for s, n in zip(batch.offload_slots, now, strict=True) if n]
            if later:
                self._side.wait_stream(current)  # their KV was written by the steps before
                with torch.cuda.stream(self._side):
                    self._offload([b for b, _ in later], [s for _, s in later])
                self._beside = torch.cuda.Event()
                self._beside.record(self._side)
        if blocks:
            self._offload(blocks, slots)
        if batch.load_slots:
            self._load(list(batch.load_slots), list(batch.load_blocks))
        return time.perf_counter() - started

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as [2, kv_heads, num_blocks, block_size, head_dim] (a view)."""
        two, heads, slots, head_dim = cache.shape
        return cache.view(two, heads, slots // self.block_size, self.block_size, head_dim)

    def _offload(self, block_ids: list[int], slots: list[int]) -> None:
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        where = torch.tensor(slots, dtype=torch.long)
        for cache, pool in zip(self.caches, self.pools, strict=True):
            # [n, 2, heads, block_size, head_dim], contiguous per block.
            gathered = self._blocks(cache).index_select(2, blocks).permute(2, 0, 1, 3, 4).contiguous()
            if self.device.type == "cpu":
                pool.index_copy_(0, where, gathered)
            else:
                for row, slot in enumerate(slots):
                    pool[slot].copy_(gathered[row], non_blocking=True)

    def _load(self, slots: list[int], block_ids: list[int]) -> None:
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for cache, pool in zip(self.caches, self.pools, strict=True):
            if self.device.type == "cpu":
                staged = pool.index_select(0, torch.tensor(slots, dtype=torch.long))
            else:
                staged = torch.empty((len(slots), *pool.shape[1:]), dtype=pool.dtype, device=self.device)
                for row, slot in enumerate(slots):
                    staged[row].copy_(pool[slot], non_blocking=True)
            self._blocks(cache).index_copy_(2, blocks, staged.permute(1, 2, 0, 3, 4))

    def write(self, slots: list[int], data: torch.Tensor) -> None:
        """Blocks that came from another replica into `slots`: data [n, layers, 2, this rank's heads, block_size,
        head_dim] on the CPU (written between steps, when no step reads these slots)."""
        if self._side is not None:
            # A background copy still in flight may target a slot the tier has since given to these blocks.
            self._side.synchronize()
        where = torch.tensor(slots, dtype=torch.long)
        for layer, pool in enumerate(self.pools):
            pool.index_copy_(0, where, data[:, layer].to(pool.dtype))
