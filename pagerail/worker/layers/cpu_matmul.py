"""CPU matmuls through whichever library runs each weight shape and batch size fastest here, measured once per
machine: MKL (torch's default), oneDNN, or pagerail's packed-weight kernel (`packed_linear`).

Which wins depends on the CPU and on the batch. Three measured on SmolLM2's gate/up weight [3072, 576], fp32, time
of the fastest other library against MKL's (above 1: faster than MKL):

    CPU                 library   1 row   16 rows   64 rows   256 rows   2048 rows
    AMD EPYC (AVX-512)  oneDNN    0.94    1.97      1.68      0.90
    Intel Xeon (SPR)    oneDNN    0.64    1.11      0.85      1.05
    AMD EPYC (AVX2)     packed    2.36    2.48      1.38      1.27       1.12

oneDNN converts its input to and from its own layout, a fixed cost only a large weight repays; MKL packs its
operands on every call and takes slower paths on some CPUs than on others; the packed kernel reads a weight laid
out once at load, so a small batch costs little more than streaming the weight from memory. A fixed rule taken
from one machine costs another up to a third of its decode step. So every fp32 weight large enough to matter is
measured at load: for each row bucket of `ROW_BUCKETS` (and `LARGE_ROWS` for larger batches), the model's own
weights of that shape are streamed through each library (more of them than the caches hold, as a forward pass
reads them), and the fastest takes the bucket, after a handicap (`HANDICAP`) that makes another library beat MKL
by a margin before it is given a copy of the weight. The choices are kept per machine in the pagerail cache, so
only the first load on a machine pays for the measurement (a few seconds for SmolLM2). A weight keeps a copy
only for the libraries that took some bucket.

PAGERAIL_CPU_MATMUL=mkl keeps every matmul on MKL; =onednn or =packed gives every fp32 layer a copy for that
library, used for every batch size; =auto (the default) measures.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagerail.common.default_model import cache_root
from pagerail.worker.layers.packed_linear import PackedLinearKernel, PackedWeight, packed_linear_kernel

logger = logging.getLogger(__name__)

MKL, ONEDNN, PACKED = "mkl", "onednn", "packed"
# Batches of up to each bound share one choice; larger batches share the choice measured at LARGE_ROWS.
ROW_BUCKETS = (1, 16, 64, 128, 256)
LARGE_ROWS = 512
# A bucket goes to the library whose best time, times this, is least: oneDNN must repay its layout conversions and
# the copy of the weight it needs, the packed kernel its copy.
HANDICAP = {MKL: 1.0, ONEDNN: 1.2, PACKED: 1.05}
# Weights smaller than these are left to MKL: oneDNN's fixed cost only pays on large weights, and a small weight's
# matmul is too short for any choice to matter.
ONEDNN_MIN_ELEMENTS = 1 << 20
PACKED_MIN_ELEMENTS = 1 << 14
# A measurement streams at least this many weight bytes of the shape (all of them when the model has fewer); from
# 128 rows on the matmul is bound by arithmetic, not memory, and a quarter of that is enough.
STREAM_BYTES = 64 << 20
_ENV_SWITCH = "PAGERAIL_CPU_MATMUL"

# (rows, library) → seconds for one pass over the shape's weights.
Timer = Callable[[int, str], float]


@dataclass(slots=True)
class CpuWeights:
    """The copies of one fp32 CPU weight that other libraries than MKL run, and which library runs which batch."""

    by_rows: tuple[str, ...]  # the library for each row count 0..ROW_BUCKETS[-1]
    larger: str  # the library for more rows than ROW_BUCKETS[-1]
    onednn: torch.Tensor | None = None
    packed: PackedWeight | None = None
    kernel: PackedLinearKernel | None = None

    def library(self, rows: int) -> str:
        return self.by_rows[rows] if rows < len(self.by_rows) else self.larger


def linear(x: torch.Tensor, weight: torch.Tensor, cpu: CpuWeights | None = None) -> torch.Tensor:
    """x @ weight^T, through the library `cpu` chose for x's row count (MKL without a choice)."""
    if cpu is None or x.dim() != 2:
        return F.linear(x, weight)
    library = cpu.library(x.shape[0])
    if library == PACKED:
        return cpu.kernel.linear(x, cpu.packed)
    if library == ONEDNN:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), cpu.onednn, None).to_dense()
    return F.linear(x, weight)


def rows_table(bucket_choices: Sequence[str]) -> tuple[tuple[str, ...], str]:
    """Per row count 0..ROW_BUCKETS[-1], its library, and the larger batches' one, from one choice per bucket
    (`ROW_BUCKETS`, then `LARGE_ROWS`)."""
    if len(bucket_choices) != len(ROW_BUCKETS) + 1:
        raise ValueError(f"expected {len(ROW_BUCKETS) + 1} bucket choices, got {len(bucket_choices)}")
    table = [MKL]
    for low, high, choice in zip((0, *ROW_BUCKETS[:-1]), ROW_BUCKETS, bucket_choices[:-1], strict=True):
        table.extend([choice] * (high - low))
    return tuple(table), bucket_choices[-1]


def everywhere(library: str) -> list[str]:
    """One choice per bucket that sends every batch size to `library`."""
    return [library] * (len(ROW_BUCKETS) + 1)


def choose_buckets(timer: Timer, libraries: Sequence[str], rounds: int = 3) -> list[str]:
    """For each row bucket and then LARGE_ROWS, the library with the least handicapped best-of-`rounds` time."""
    choices = []
    for rows in (*ROW_BUCKETS, LARGE_ROWS):
        best = {library: min(timer(rows, library) for _ in range(rounds)) for library in libraries}
        choices.append(min(libraries, key=lambda library: best[library] * HANDICAP[library]))
    return choices


def _copy_only(
    library: str, table: tuple[tuple[str, ...], str], copy: Any, kernel: PackedLinearKernel | None
) -> CpuWeights:
    """A choice that runs every batch through `library`'s copy of a weight (oneDNN's or the packed kernel's)."""
    if library == ONEDNN:
        return CpuWeights(*table, onednn=copy)
    return CpuWeights(*table, packed=copy, kernel=kernel)


def stream_timer(weights: list[torch.Tensor], copies: dict[str, list[Any]], kernel: PackedLinearKernel | None) -> Timer:
    """A Timer that multiplies a random batch by each weight in turn, as a forward pass reads them; from 128 rows on
    only the first quarter of the weights (the matmul is then bound by arithmetic)."""
    in_features = weights[0].shape[1]
    inputs = {rows: torch.randn(rows, in_features) for rows in (*ROW_BUCKETS, LARGE_ROWS)}

    runs: dict[str, list[tuple[torch.Tensor, CpuWeights | None]]] = {MKL: [(weight, None) for weight in weights]}
    for library, library_copies in copies.items():
        table = rows_table(everywhere(library))
        runs[library] = [
            (weight, _copy_only(library, table, copy, kernel))
            for weight, copy in zip(weights, library_copies, strict=True)
        ]

    def timer(rows: int, library: str) -> float:
        x = inputs[rows]
        count = len(weights) if rows < 128 else max(1, len(weights) // 4)
        started = time.perf_counter()
        for weight, cpu in runs[library][:count]:
            linear(x, weight, cpu)
        return time.perf_counter() - started

    return timer


Measure = Callable[[list[torch.Tensor], dict[str, list[Any]], "PackedLinearKernel | None"], Timer]


def attach_cpu_weights(model: nn.Module, choices_path: Path | None = None, measure: Measure = stream_timer) -> int:
    """Give every module with a `cpu_weights` slot and an fp32 CPU weight the copies and per-batch choices of the
    libraries that run some batch size of its shape faster than MKL here; returns how many modules got some.

    `measure` makes the Timer for a shape's weights and their copies (a stand-in in tests)."""
    mode = os.environ.get(_ENV_SWITCH, "auto").strip().lower()
    if mode not in ("auto", MKL, ONEDNN, PACKED):
        raise ValueError(f"{_ENV_SWITCH} must be auto, mkl, onednn or packed, got {mode!r}")
    if mode == MKL:
        return 0
    kernel = packed_linear_kernel() if mode in ("auto", PACKED) else None
    if mode == ONEDNN and not torch.backends.mkldnn.is_available():
        raise ValueError(f"{_ENV_SWITCH}=onednn, but this torch is built without oneDNN")
    if mode == PACKED and kernel is None:
        raise ValueError(f"{_ENV_SWITCH}=packed, but the packed kernel cannot be built here (see the warning above)")
    by_shape: dict[tuple[int, int], list[nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_weights") or weight is None:
            continue
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
            by_shape.setdefault(tuple(weight.shape), []).append(module)
    store = _ChoiceStore(choices_path or default_choices_path(), kernel.build if kernel is not None else None)
    attached = 0
    for shape, modules in by_shape.items():
        if mode != "auto":
            choices = everywhere(mode)
        else:
            libraries = _candidates(shape[0] * shape[1], kernel)
            if libraries == [MKL]:
                continue
            choices = store.get(shape, libraries)
            if choices is None:
                weights, copies = _streamed(modules, libraries, kernel)
                choices = choose_buckets(measure(weights, copies, kernel), libraries)
                del weights, copies
                store.put(shape, libraries, choices)
                logger.info("CPU matmul %s: %s", shape, _describe(choices))
        if set(choices) == {MKL}:
            continue
        table = rows_table(choices)
        for module in modules:
            weight = module.weight.detach()
            module.cpu_weights = CpuWeights(
                *table,
                onednn=weight.contiguous().to_mkldnn() if ONEDNN in choices else None,
                packed=kernel.pack(weight) if PACKED in choices else None,
                kernel=kernel if PACKED in choices else None,
            )
            attached += 1
    store.save()
    return attached


def default_choices_path() -> Path:
    """Where this machine's choices live: per host, CPU count, torch threads and torch version (each changes them)."""
    host = platform.node() or "host"
    name = f"{host}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads-torch{torch.__version__}.json"
    return cache_root() / "matmul" / name


def _candidates(elements: int, kernel: PackedLinearKernel | None) -> list[str]:
    libraries = [MKL]
    if torch.backends.mkldnn.is_available() and elements >= ONEDNN_MIN_ELEMENTS:
        libraries.append(ONEDNN)
    if kernel is not None and elements >= PACKED_MIN_ELEMENTS:
        libraries.append(PACKED)
    return libraries


def _streamed(
    modules: list[nn.Module], libraries: list[str], kernel: PackedLinearKernel | None
) -> tuple[list[torch.Tensor], dict[str, list[Any]]]:
    """The shape's weights repeated until they exceed STREAM_BYTES (so no measurement runs from the caches), with
    each library's copy of every one."""
    weights = [module.weight.detach() for module in modules]
    size = weights[0].numel() * weights[0].element_size()
    count = max(1, -(-STREAM_BYTES // size))
    # Too few weights of this shape to leave the caches: fresh ones of the same shape make up the rest.
    weights = weights[:count] + [torch.randn_like(weights[0]) for _ in range(count - len(weights))]
    copies: dict[str, list[Any]] = {}
    if ONEDNN in libraries:
        copies[ONEDNN] = [weight.contiguous().to_mkldnn() for weight in weights]
    if PACKED in libraries:
        copies[PACKED] = [kernel.pack(weight) for weight in weights]
    return weights, copies


def _describe(choices: Sequence[str]) -> str:
    bounds = [f"<={rows}" for rows in ROW_BUCKETS] + [f">{ROW_BUCKETS[-1]}"]
    return ", ".join(f"{bound} {choice}" for bound, choice in zip(bounds, choices, strict=True))


class _ChoiceStore:
    """The per-machine file of measured choices: shape → the libraries measured and one choice per bucket, and
    which build of the packed kernel was measured (another build, e.g. after an update, is measured again)."""

    def __init__(self, path: Path, packed_build: str | None = None) -> None:
        self.path = path
        self.packed_build = packed_build
        self._dirty = False
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        valid = (
            isinstance(saved, dict)
            and saved.get("row_buckets") == list(ROW_BUCKETS)
            and saved.get("large_rows") == LARGE_ROWS
            and isinstance(saved.get("choices"), dict)
        )
        self._choices: dict[str, Any] = saved["choices"] if valid else {}

    def get(self, shape: tuple[int, int], libraries: list[str]) -> list[str] | None:
        """The choices measured for `shape` among exactly `libraries`; None when there are none (or others were)."""
        entry = self._choices.get(_key(shape))
        if not isinstance(entry, dict) or entry.get("libraries") != libraries:
            return None
        if PACKED in libraries and entry.get("packed_build") != self.packed_build:
            return None
        choices = entry.get("choices")
        if isinstance(choices, list) and len(choices) == len(ROW_BUCKETS) + 1 and set(choices) <= set(libraries):
            return list(choices)
        return None

    def put(self, shape: tuple[int, int], libraries: list[str], choices: list[str]) -> None:
        entry: dict[str, Any] = {"libraries": libraries, "choices": choices}
        if PACKED in libraries:
            entry["packed_build"] = self.packed_build
        self._choices[_key(shape)] = entry
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        payload = json.dumps(
            {"row_buckets": list(ROW_BUCKETS), "large_rows": LARGE_ROWS, "choices": self._choices}, indent=1
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Written beside and renamed, so ranks loading at once never read half a file.
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(payload)
            os.replace(scratch, self.path)
        except OSError as error:
            logger.warning("CPU matmul choices not kept in %s (%s); measured again next load", self.path, error)
        self._dirty = False


def _key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"
