"""LoRA on a rank: device slots of stacked adapter weights in each adapted projection, the adapters loaded into them
(least recently used out), and which slot each row of a step runs with, so the adapters' deltas are added beside
the base matmul.

A fused projection (q/k/v, gate/up) holds its parts' adapters stacked: A is [slots, parts × max rank, in] and B is
block-diagonal [slots, parts × max rank, out], so x A^T B adds every part's delta in its own output columns; a
smaller rank, or a part the adapter leaves alone, is zero padding. A step whose adapter rows form one contiguous
run computes just those rows; any other mix is grouped (Punica's SGMV idea in plain torch): the rows are gathered
slot by slot into a [groups, longest group, in] batch (short groups padded with zero rows), two batched matmuls
with the groups' A and B give every delta, and one gather of the deltas back into row order is added to the output
(a base-model row reads a padding place's zero delta): four or five operations per projection however many
adapters share the step, and the work of each row's own adapter only. (Gathering the deltas back and adding them
is about four times faster on a CPU than an index_add of them.) Where the native CPU kernel builds
(layers/cpu_lora.py, float32), one call per projection does all of that from a list of the adapter rows grouped
by slot, and reads only the diagonal blocks of a fused projection's B. On a GPU (or under Triton's interpreter)
two Triton kernels (layers/triton_lora.py) read each row's slot instead: one shrink and one expand launch per
projection. The scaling (alpha / r, or alpha / sqrt(r) for rsLoRA) is folded into B. Under
tensor parallelism each rank keeps the slice its base weight keeps: B's output columns for a column-parallel
projection, A's input columns for a row-parallel one (whose partial delta joins the partial base output before
the all-reduce: the sum is linear).
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from pagerail.common.lora import WEIGHTS_FILE, AdapterConfig, read_adapter_config, tensor_name_parts
from pagerail.proto import step_pb2
from pagerail.worker.layers.cpu_lora import LoRAKernel, lora_kernel
from pagerail.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _ParallelLinear,
)
from pagerail.worker.layers.triton_lora import lora_delta, lora_kernels_available
from pagerail.worker.request_state import RequestState

logger = logging.getLogger(__name__)
# Adapters read at once: one slow read (a large adapter, a slow disk) does not hold up the others' requests.
READER_THREADS = 4

# The adapted projections of a Llama-family layer, and the PEFT modules each holds in output order.
_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PROJECTION = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


@dataclass
class StepRows:
    """This step's adapter rows, read by every adapted projection. Either `run` = (slot, rows): one slot's
    contiguous rows; or the grouped layout: `slots` (the groups' slots; None when every slot, in order), `gather`
    (the row behind each of groups × `longest` places), `padding` (the places that pad a short group: zeroed, so
    their delta is zero; None when no group is short) and `place` (each row's place, a padding one for a base-model
    row). Neither: no row runs with an adapter."""

    run: tuple[int, slice] | None = None
    slots: torch.Tensor | None = None
    gather: torch.Tensor | None = None
    longest: int = 0
    padding: torch.Tensor | None = None
    place: torch.Tensor | None = None
    # Each row's slot (-1: the base model), for the Triton kernels; set instead of the above where they run.
    slot_of_row: torch.Tensor | None = None
    # For the native CPU kernel, set instead of the above where it runs: the adapter rows grouped by slot, and
    # each group's (slot, first, end) into them.
    native: tuple[torch.Tensor, torch.Tensor] | None = None

    def clear(self) -> None:
        self.run, self.slots, self.gather, self.padding, self.place, self.slot_of_row, self.native = (None,) * 7


class LoRAProjection:
    """The adapter slots of one projection, and the delta they add to its output."""

    def __init__(
        self,
        layer: _ParallelLinear,
        parts: Sequence[str],
        slots: int,
        max_rank: int,
        rows: StepRows,
        kernel: LoRAKernel | None = None,
    ):
        self.layer = layer
        self.parts = tuple(parts)
        self.max_rank = max_rank
        self.rows = rows
        self.kernel = kernel
        self.row_parallel = isinstance(layer, RowParallelLinear)
        width = len(self.parts) * max_rank
        weight = layer.weight
        dtype = layer.params_dtype or weight.dtype
        device = weight.device
        # A transposed, so the batched shrink reads [in, width] per slot: [slots, in, width]; B as [slots, width, out].
        self.a_t = torch.zeros(slots, layer.in_features, width, dtype=dtype, device=device)
        self.b = torch.zeros(slots, width, layer.out_features, dtype=dtype, device=device)
        # Each part's (first column of x A, its columns, first output column, end output column): B's diagonal
        # blocks, the only ones the native kernel reads.
        blocks = []
        for index in range(len(self.parts)):
            offset, size, _ = self._output_span(index)
            blocks.append((index * max_rank, max_rank, offset, offset + size))
        self.diagonal_blocks = torch.tensor(blocks, dtype=torch.long)

    def delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base output of `x`, before any all-reduce) plus each row's adapter delta."""
        rows = self.rows
        if rows.native is not None:
            x = x if x.stride(-1) == 1 else x.contiguous()
            self.kernel.delta(x, out, self.a_t, self.b, *rows.native, self.diagonal_blocks)
        elif rows.slot_of_row is not None:
            lora_delta(x if x.stride(-1) == 1 else x.contiguous(), out, self.a_t, self.b, rows.slot_of_row)
        elif rows.run is not None:
            slot, span = rows.run
            out[span] += (x[span] @ self.a_t[slot]) @ self.b[slot]
        elif rows.gather is not None:
            a, b = self.a_t, self.b
            if rows.slots is not None:
                a, b = a.index_select(0, rows.slots), b.index_select(0, rows.slots)
            grouped = x.index_select(0, rows.gather)
            if rows.padding is not None:
                grouped.index_fill_(0, rows.padding, 0.0)
            grouped = grouped.view(a.shape[0], rows.longest, x.shape[1])
            deltas = torch.bmm(torch.bmm(grouped, a), b).view(-1, out.shape[1])
            out.add_(deltas.index_select(0, rows.place))
        return out

    def _output_span(self, part: int) -> tuple[int, int, int]:
        """(local offset, size, first row in the full projection) of a part's output rows on this rank."""
        layer, tp = self.layer, self.layer.tp
        if isinstance(layer, QKVParallelLinear):
            if part == 0:
                return 0, layer.q_size, tp.rank * layer.q_size
            offset = layer.q_size + (layer.kv_size if part == 2 else 0)
            return offset, layer.kv_size, layer.kv_head_start * layer.head_dim
        if isinstance(layer, MergedColumnParallelLinear):
            size = layer.local_sizes[part]
            return sum(layer.local_sizes[:part]), size, tp.rank * size
        return 0, layer.out_features, (0 if self.row_parallel else tp.rank * layer.out_features)

    def load(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Put an adapter's (A, B) per part (full checkpoint tensors) into `slot`; parts it lacks stay zero."""
        self.a_t[slot].zero_()
        self.b[slot].zero_()
        rank_of_tp = self.layer.tp.rank
        for index, part in enumerate(self.parts):
            if part not in weights:
                continue
            a, b = weights[part]
            rank = a.shape[0]
            columns = slice(index * self.max_rank, index * self.max_rank + rank)
            if self.row_parallel:
                width = self.layer.in_features
                a = a[:, rank_of_tp * width : (rank_of_tp + 1) * width]
            offset, size, start = self._output_span(index)
            self.a_t[slot, :, columns].copy_(a.T)
            self.b[slot, columns, offset : offset + size].copy_((b[start : start + size] * scaling).T)


class LoRASlots:
    """Every adapted projection of a model, `max_loras` device slots in each, and which adapter holds which slot.

    Adapters are read from their directory on a reader thread when the head asks ahead of their requests
    (`prefetch`; the head schedules those requests once rank 0 reports the read done, so a read never stalls a
    step), kept parsed in host memory (`max_cpu_loras` of them, least recently used out), and copied into a slot
    when a step needs them (a copy of a few small tensors). A step never needs more adapters than there are slots
    (the head's scheduler sees to that), and the slots a step uses are not taken by its others. An adapter a step
    needs that is neither held nor being read is read in the step (a rank whose state the head did not ask ahead).
    """

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.rows = StepRows()
        # The native CPU kernel where the model runs in float32 on the CPU and the kernel builds.
        native = None
        first = next((m for name, m in model.named_modules() if _PROJECTION.search(name)), None)
        if first is not None and first.weight.device.type == "cpu":
            if (first.params_dtype or first.weight.dtype) == torch.float32:
                native = lora_kernel()
        # (layer index, PEFT module name) -> projection, for loading.
        self.projections: list[tuple[int, LoRAProjection]] = []
        self.module_names: set[str] = set()
        for name, module in model.named_modules():
            match = _PROJECTION.search(name)
            if match is None or not isinstance(module, _ParallelLinear):
                continue
            layer_index, parts = int(match[1]), _PARTS[match[2]]
            projection = LoRAProjection(module, parts, max_loras, max_rank, self.rows, native)
            module.lora = projection
            self.projections.append((layer_index, projection))
            self.module_names.update(parts)
        if not self.projections:
            raise ValueError("enable_lora: this model has no projections LoRA adapters can target")
        # The Triton kernels on CUDA (and under the interpreter); the native kernel or the grouped torch path on
        # the CPU.
        self.kernels = lora_kernels_available(self.projections[0][1].b)
        self.native = native is not None and not self.kernels
        self.paths: dict[int, str] = {}  # adapter id -> its directory, as requests named it
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._host: OrderedDict[int, tuple[AdapterConfig, dict]] = OrderedDict()
        self.num_loads = 0
        self.num_evictions = 0
        self.load_seconds = 0.0
        # What the current row layout was made for: the path, each row's adapter and token count (None: none).
        self._layout_key: tuple | None = None
        self._reported = (0, 0, 0.0)
        # Adapters the head asked for ahead of their requests, read on threads of their own beside the steps;
        # and what the next report tells the head: adapters read (or already held) since the last one, adapters
        # held no more, and failed reads.
        self._reader: ThreadPoolExecutor | None = None
        self._reading: dict[int, Future] = {}
        self._news: dict[int, bool] = {}  # adapter id -> ready (True) or dropped (False), the latest of the two
        self._failed: dict[int, str] = {}

    def register(self, lora_id: int, path: str) -> None:
        """A request named adapter `lora_id` at `path`. The head refuses an id naming another path than before
        (the frontend gives a reloaded name a new id), so what is kept under an id never goes stale."""
        self.paths[lora_id] = path

    def prefetch(self, lora_id: int, path: str) -> None:
        """Requests for adapter `lora_id` wait at the head until this rank says it is ready: start reading it
        beside the steps, unless it is held (then say so again: the head's view is behind, e.g. after a drop)."""
        self.paths[lora_id] = path
        if lora_id in self._reading:
            return
        if lora_id in self._host or lora_id in self._slot_of:
            self._news[lora_id] = True
            return
        self._failed.pop(lora_id, None)
        if self._reader is None:
            self._reader = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="lora-reader")
        self._reading[lora_id] = self._reader.submit(read_parsed, path, self.max_rank, self.module_names)

    def wait_for_reads(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a read in progress to end (a step with nothing else to do: the head polls)."""
        if self._reading:
            wait(list(self._reading.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def report(self, result: step_pb2.StepResult | None) -> None:
        """Add the loads, evictions and load time since the last report, and the adapters read, dropped and
        failed, to a step's result (None: a rank other than 0, whose result the head does not read)."""
        for lora_id in [lora_id for lora_id, future in self._reading.items() if future.done()]:
            self._finish_read(lora_id)
        if result is not None:
            now = (self.num_loads, self.num_evictions, self.load_seconds)
            if now != self._reported:
                result.lora_loads = now[0] - self._reported[0]
                result.lora_evictions = now[1] - self._reported[1]
                result.lora_load_seconds = now[2] - self._reported[2]
                self._reported = now
            for lora_id, ready in self._news.items():
                (result.lora_ready if ready else result.lora_dropped).append(lora_id)
            for lora_id, message in self._failed.items():
                result.lora_failed.add(lora_id=lora_id, message=message)
        self._news.clear()
        self._failed.clear()

    def close(self) -> None:
        """Stop the reader thread (reads not yet started are dropped)."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    def clear(self) -> bool:
        """A step without adapter rows; returns False (no row runs with an adapter)."""
        self.rows.clear()
        self._layout_key = None
        return False

    def prepare(self, ordered: Sequence[RequestState]) -> bool:
        """Say which slot each of this step's rows (in `ordered`'s row order) runs with, loading the adapters the
        step needs; True when any row runs with an adapter."""
        rows = self.rows
        lora_ids = tuple(state.lora_id for state in ordered)
        if not any(lora_ids):
            return self.clear()
        needed = set(lora_ids)
        needed.discard(0)
        loads = self.num_loads
        slots = {lora_id: self._slot(lora_id, needed) for lora_id in needed}
        # Consecutive decode steps of the same requests have the same rows: their layout stands (unless a load
        # moved an adapter to another slot).
        key = (self.kernels, lora_ids, tuple(state.num_scheduled_tokens for state in ordered))
        if key == self._layout_key and self.num_loads == loads:
            return True
        rows.clear()
        self._layout_key = key
        device = self.projections[0][1].b.device
        if self.kernels:
            slot_of_row: list[int] = []
            for state in ordered:
                slot_of_row.extend([slots[state.lora_id] if state.lora_id else -1] * state.num_scheduled_tokens)
            rows.slot_of_row = torch.tensor(slot_of_row, dtype=torch.int32, device=device)
            return True
        by_slot: dict[int, list[int]] = {}
        row = 0
        for state in ordered:
            count = state.num_scheduled_tokens
            if state.lora_id:
                by_slot.setdefault(slots[state.lora_id], []).extend(range(row, row + count))
            row += count
        if self.native:
            order = sorted(by_slot)
            segments: list[int] = []
            listed: list[int] = []
            for slot in order:
                segments += (slot, len(listed), len(listed) + len(by_slot[slot]))
                listed += by_slot[slot]
            rows.native = (torch.tensor(listed, dtype=torch.long), torch.tensor(segments, dtype=torch.long).view(-1, 3))
            return True
        if len(by_slot) == 1:
            ((slot, members),) = by_slot.items()
            if members[-1] - members[0] + 1 == len(members):
                rows.run = (slot, slice(members[0], members[-1] + 1))
                return True
        order = sorted(by_slot)
        longest = max(len(members) for members in by_slot.values())
        if row > sum(len(members) for members in by_slot.values()) and all(
            len(members) == longest for members in by_slot.values()
        ):
            longest += 1  # base-model rows need a padding place to read a zero delta from
        gather: list[int] = []
        padding: list[int] = []
        place = [-1] * row
        for members in (by_slot[slot] for slot in order):
            for offset, member in enumerate(members):
                place[member] = len(gather) + offset
            short = longest - len(members)
            if short:
                padding.extend(range(len(gather) + len(members), len(gather) + longest))
            gather.extend(members + [members[0]] * short)
        zero = padding[0] if padding else 0
        rows.longest = longest
        rows.gather = torch.tensor(gather, dtype=torch.long, device=device)
        rows.place = torch.tensor([zero if p < 0 else p for p in place], dtype=torch.long, device=device)
        if padding:
            rows.padding = torch.tensor(padding, dtype=torch.long, device=device)
        if order != list(range(self.max_loras)):
            rows.slots = torch.tensor(order, dtype=torch.long, device=device)
        return True

    def _slot(self, lora_id: int, needed: set[int]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        victim = None
        if len(self._slot_of) < self.max_loras:
            used = set(self._slot_of.values())
            slot = next(s for s in range(self.max_loras) if s not in used)
        else:
            victim = next(held for held in self._slot_of if held not in needed)
            slot = self._slot_of.pop(victim)
            self.num_evictions += 1
        if victim is not None and victim not in self._host:
            self._news[victim] = False  # held nowhere now: a request for it needs it read again
        config, weights = self._parsed(lora_id)
        started = time.perf_counter()
        for layer_index, projection in self.projections:
            projection.load(slot, weights.get(layer_index, {}), config.scaling)
        self._slot_of[lora_id] = slot
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - started
        return slot

    def _parsed(self, lora_id: int) -> tuple[AdapterConfig, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
        """The adapter's config and its weights by layer and module: from the host cache, else from its read in
        progress (waiting for it: this rank is behind the head's rank 0), else read now."""
        kept = self._host.get(lora_id)
        if kept is not None:
            self._host.move_to_end(lora_id)
            return kept
        if lora_id in self._reading:
            parsed = self._finish_read(lora_id)
            if parsed is None:
                raise ValueError(self._failed[lora_id])
            return parsed
        parsed, seconds = read_parsed(self.paths[lora_id], self.max_rank, self.module_names)
        self.load_seconds += seconds
        self._keep(lora_id, parsed)
        return parsed

    def _finish_read(self, lora_id: int) -> tuple | None:
        """Take a read's result (waiting for it): into the host cache and the ready list, or the failed ones."""
        future = self._reading.pop(lora_id)
        try:
            parsed, seconds = future.result()
        except Exception as error:  # any failure of one adapter's read fails its requests, not the rank
            self._failed[lora_id] = f"lora_path {self.paths[lora_id]!r}: the adapter could not be read: {error}"
            logger.warning("LoRA adapter %d: %s", lora_id, self._failed[lora_id])
            return None
        self.load_seconds += seconds
        self._keep(lora_id, parsed)
        self._news[lora_id] = True
        return parsed

    def _keep(self, lora_id: int, parsed: tuple) -> None:
        """Keep a read adapter in the host cache; out go first the adapters a slot holds too (they run without
        their host copy), then the least recently used."""
        self._host[lora_id] = parsed
        while len(self._host) > self.max_cpu_loras:
            evicted = next((held for held in self._host if held in self._slot_of), None)
            if evicted is None:
                evicted = next(iter(self._host))
                self._news[evicted] = False  # held nowhere now: a request for it needs it read again
            del self._host[evicted]


def read_parsed(
    path: str, max_rank: int, module_names: set[str]
) -> tuple[tuple[AdapterConfig, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]], float]:
    """An adapter's config and its float32 (A, B) by layer and module, read from its directory, and the seconds
    the read took; raises ValueError naming what is wrong. Safe on any thread (reads nothing shared)."""
    started = time.perf_counter()
    config = read_adapter_config(path, max_rank)
    missing = [m for m in config.target_modules if m not in module_names]
    if missing:
        raise ValueError(f"target_modules: this model has no {missing[0]} to adapt")
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    by_layer: dict[int, dict[str, list]] = {}
    for name, tensor in tensors.items():
        layer, module, side = tensor_name_parts(name)
        by_layer.setdefault(layer, {}).setdefault(module, [None, None])["AB".index(side)] = tensor.float()
    weights = {}
    for layer, modules in by_layer.items():
        weights[layer] = {}
        for module, (a, b) in modules.items():
            if a is None or b is None:
                raise ValueError(f"{WEIGHTS_FILE}: layer {layer}'s {module} lacks lora_A or lora_B")
            weights[layer][module] = (a, b)
    logger.info("LoRA adapter read from %s (rank %d)", path, config.rank)
    return (config, weights), time.perf_counter() - started
