"""Decode steps as replayed graphs: the sizes captured, the static inputs every graph reads, capture and replay."""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from pagerail.worker.input_batch import FlatBatch
from pagerail.worker.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# Above this many sequences a decode step is long enough that launching its kernels from Python costs little.
DEFAULT_MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, max_capture_size: int | None = None) -> list[int]:
    """The decode batch sizes to capture, ascending: 1, 2, 4, 8, then every multiple of 8, up to the limit.

    The limit is max_num_seqs (capped by max_capture_size) and is always captured itself, so every decode step
    the scheduler can build up to it pads by fewer than 8 rows.
    """
    limit = max_num_seqs if max_capture_size is None else min(max_num_seqs, max_capture_size)
    if limit < 1:
        return []
    ladder = [size for size in (1, 2, 4) if size < limit] + list(range(8, limit, 8))
    return [*ladder, limit]


class CapturePlan:
    """The captured sizes and the padding rule: a decode step of n rows replays the smallest size ≥ n."""

    def __init__(self, sizes: list[int]) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be distinct, ascending and positive, got {sizes}")
        self.sizes = tuple(sizes)

    @classmethod
    def for_limits(cls, max_num_seqs: int, max_capture_size: int | None = None) -> CapturePlan:
        return cls(capture_sizes(max_num_seqs, max_capture_size))

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size ≥ n; None when n exceeds the largest (the step then runs eagerly)."""
        if n < 1 or n > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]


class StaticDecodeInputs:
    """Inputs and output at fixed addresses, sized for the largest capture; a graph of size s reads rows :s.

    Each replay copies the step's n real rows in and leaves rows n..s-1 as harmless padding: token 0 at
    position 0, writing its K/V into the scratch block's first slot and attending over that slot alone
    (context length 1), which the head never hands to a request:

        row         0 .. n-1            | n .. s-1 (padding)
        slot        the step's slots    | scratch_block * block_size
        table       step's columns :w   | [scratch_block, stale ...]   entries past a context are never read
        context     the step's lengths  | 1
    """

    def __init__(
        self,
        max_size: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        scratch_block: int,
    ) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_size, **long)
        self.positions = torch.zeros(max_size, **long)
        self.slot_mapping = torch.full((max_size,), self.scratch_slot, **long)
        # Stale real block ids may stay in columns past a row's context: always valid indices, never read.
        self.block_table = torch.zeros(max_size, max(1, max_blocks_per_seq), **long)
        self.block_table[:, 0] = scratch_block
        self.context_lens = torch.ones(max_size, **long)
        self.hidden = torch.zeros(max_size, hidden_size, dtype=dtype, device=device)
        # Rows below this may hold a previous step's real inputs; every row from here on holds padding.
        self._padded_from = 0

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_table.shape[1]

    def fill(self, flat: FlatBatch) -> int:
        """Copy a decode-only step's inputs into the first rows and pad the rows a previous step left; returns n."""
        meta = flat.attention
        n = meta.num_decodes
        width = meta.decode_block_table.shape[1]
        self.input_ids[:n].copy_(flat.input_ids, non_blocking=True)
        self.positions[:n].copy_(flat.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_table[:n, :width].copy_(meta.decode_block_table, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        if n < self._padded_from:
            # Only rows a larger earlier step wrote need restoring; the rest already hold padding.
            rows = slice(n, self._padded_from)
            self.input_ids[rows] = 0
            self.positions[rows] = 0
            self.slot_mapping[rows] = self.scratch_slot
            self.block_table[rows, 0] = self.scratch_block
            self.context_lens[rows] = 1
        self._padded_from = n
        return n

    def metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata of a size-`size` decode batch whose tensors are views of the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size,
            num_decodes=size,
            decode_block_table=self.block_table[:size],
            decode_context_lens=self.context_lens[:size],
        )


class GraphBackend(Protocol):
    """Records a function once and replays it; CUDA graphs on the GPU, a re-run of the function in CPU tests."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Run `fn` as needed to record it; returns the replay."""
        ...

    def memory(self) -> tuple[int, int]:
        """Bytes (allocated, reserved) on the device now."""
        ...

    def synchronize(self) -> None: ...


class CudaGraphBackend:
    """torch.cuda graphs sharing one memory pool, each captured after eager warm-up runs on a side stream."""

    def __init__(self, device: torch.device, warmup_runs: int = 1) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        # One pool for every graph: they never run concurrently, so they may reuse each other's intermediates.
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        # Warm-up compiles the Triton kernels and creates cuBLAS handles and workspaces, none of which may happen
        # during capture; torch asks for it on a side stream so the warm-up's allocations stay off the graph's.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph.replay

    def memory(self) -> tuple[int, int]:
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class DecodeGraphs:
    """One captured decode forward per planned size, all reading the same static inputs.

    `run` replays the smallest graph that fits a decode-only step and returns its hidden states; any other step
    (prefills, more rows than the largest graph, a block table wider than the static one) is left to the caller.
    A graph holds the addresses of the weights and of the KV caches bound at capture: rebinding a layer's cache
    afterwards needs a new capture.
    """

    def __init__(
        self, model: torch.nn.Module, plan: CapturePlan, inputs: StaticDecodeInputs, backend: GraphBackend
    ) -> None:
        self.model = model
        self.plan = plan
        self.inputs = inputs
        self.backend = backend
        self._replays: dict[int, Callable[[], None]] = {}

    def capture(self) -> None:
        """Capture every size, largest first: the shared pool grows to its final size with the first graph."""
        self.backend.synchronize()
        allocated, reserved = self.backend.memory()
        started = time.perf_counter()
        for size in reversed(self.plan.sizes):
            self._replays[size] = self.backend.capture(functools.partial(self._forward, size))
        self.backend.synchronize()
        seconds = time.perf_counter() - started
        allocated_after, reserved_after = self.backend.memory()
        logger.info(
            "captured %d decode graphs (batch sizes %d..%d) in %.2f s; they hold %.1f MiB allocated, %.1f MiB reserved",
            len(self._replays),
            self.plan.sizes[0],
            self.plan.max_size,
            seconds,
            (allocated_after - allocated) / 2**20,
            (reserved_after - reserved) / 2**20,
        )

    def _forward(self, size: int) -> None:
        # The metadata is built on each call: a layer may cache derived tensors on it (the torch path's mask).
        inputs = self.inputs
        hidden = self.model(inputs.input_ids[:size], inputs.positions[:size], inputs.metadata(size))
        inputs.hidden[:size].copy_(hidden)

    def size_for(self, flat: FlatBatch) -> int | None:
        """The captured size this step would replay, or None when it has to run eagerly."""
        meta = flat.attention
        n = flat.input_ids.shape[0]
        if meta.prefills or meta.num_decodes != n or meta.decode_block_table is None:
            return None
        if getattr(meta, "mixed_query_starts", None) is not None:
            return None  # laid out for the mixed-batch kernel, which only steps with prefill rows take
        if meta.decode_block_table.shape[1] > self.inputs.max_blocks_per_seq:
            return None
        size = self.plan.padded_size(n)
        return size if size in self._replays else None

    def run(self, flat: FlatBatch) -> torch.Tensor | None:
        """Replay the step's graph; its hidden states [n, hidden] (a view of the static output), or None."""
        size = self.size_for(flat)
        if size is None:
            return None
        n = self.inputs.fill(flat)
        self._replays[size]()
        return self.inputs.hidden[:n]
