"""CPU matmuls through oneDNN where this machine runs them faster than MKL, measured once per machine.

A oneDNN call converts its input to and from oneDNN's layout, a fixed cost that only a large weight can repay,
and whether it does depends on the CPU. Two measured on the same SmolLM2 shapes (fp32, MKL time / oneDNN time,
above 1: oneDNN faster):

    weight [out, in]          CPU               1 row   16 rows   64 rows   128 rows   256 rows
    3072 x 576  (1.77M)       AMD EPYC          0.94    1.97      1.68      1.28       0.90
    3072 x 576                Intel Xeon (SPR)  0.64    1.11      0.85      0.90       1.05
    49152 x 576 (28.3M, head) AMD EPYC          1.78    2.03      1.71      1.39       1.25
    49152 x 576               Intel Xeon (SPR)  0.90    0.94      1.03      0.67       0.98

A fixed rule taken from one of them costs the other up to a third of its decode step. So every fp32 weight of
at least `ONEDNN_MIN_ELEMENTS` is measured at load: for each row bucket of `ROW_BUCKETS`, the model's own
weights of that shape are streamed through both libraries (more of them than the caches hold, as a forward pass
reads them), and oneDNN takes the bucket only when it is at least `MIN_GAIN` times faster. Smaller weights, and
batches above the last bucket, stay on MKL. The choices are kept per machine in the pagerail cache, so only the
first load on a machine pays for the measurement (about a second for SmolLM2).

PAGERAIL_CPU_MATMUL=mkl keeps every matmul on MKL; =onednn gives every fp32 layer a oneDNN copy used for every
bucket, whatever its size; =auto (the default) measures.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from worker.default_model import cache_root

logger = logging.getLogger(__name__)

ONEDNN_MIN_ELEMENTS = 1 << 20
# Batches of up to each bound share one choice; a larger batch always runs on MKL.
ROW_BUCKETS = (1, 16, 64, 128, 256)
MIN_GAIN = 1.2
# A measurement streams at least this many weight bytes of the shape (all of them when the model has fewer).
STREAM_BYTES = 64 << 20
_ENV_SWITCH = "PAGERAIL_CPU_MATMUL"
_NO_ONEDNN: tuple[bool, ...] = ()

# (rows, use oneDNN) → seconds for one pass over the shape's weights.
Timer = Callable[[int, bool], float]


def linear(
    x: torch.Tensor, weight: torch.Tensor, onednn_weight: torch.Tensor | None, onednn_rows: Sequence[bool] = ()
) -> torch.Tensor:
    """x @ weight^T, through the oneDNN copy of the weight when `onednn_rows[rows]` says so for x's row count."""
    rows = x.shape[0]
    if onednn_weight is None or x.dim() != 2 or rows >= len(onednn_rows) or not onednn_rows[rows]:
        return F.linear(x, weight)
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), onednn_weight, None).to_dense()


def rows_table(bucket_choices: Sequence[bool]) -> tuple[bool, ...]:
    """Per row count 0..ROW_BUCKETS[-1], whether oneDNN runs it, from one choice per bucket; () when none does."""
    if not any(bucket_choices):
        return _NO_ONEDNN
    table = [False]
    for low, high, choice in zip((0, *ROW_BUCKETS[:-1]), ROW_BUCKETS, bucket_choices, strict=True):
        table.extend([choice] * (high - low))
    return tuple(table)


def choose_buckets(timer: Timer, rounds: int = 3) -> list[bool]:
    """For each row bucket, whether oneDNN beats MKL by MIN_GAIN; each side's best of `rounds` passes counts."""
    choices = []
    for rows in ROW_BUCKETS:
        mkl = min(timer(rows, False) for _ in range(rounds))
        onednn = min(timer(rows, True) for _ in range(rounds))
        choices.append(onednn * MIN_GAIN <= mkl)
    return choices


def stream_timer(weights: list[torch.Tensor], copies: list[torch.Tensor]) -> Timer:
    """A Timer that multiplies a random batch by each weight in turn, as a forward pass reads them."""
    in_features = weights[0].shape[1]
    inputs = {rows: torch.randn(rows, in_features) for rows in ROW_BUCKETS}
    always = rows_table([True] * len(ROW_BUCKETS))

    def timer(rows: int, onednn: bool) -> float:
        x = inputs[rows]
        started = time.perf_counter()
        for weight, copy in zip(weights, copies, strict=True):
            linear(x, weight, copy if onednn else None, always)
        return time.perf_counter() - started

    return timer


def attach_onednn_weights(
    model: nn.Module,
    choices_path: Path | None = None,
    measure: Callable[[list[torch.Tensor], list[torch.Tensor]], Timer] = stream_timer,
) -> int:
    """Give every module with an `onednn_weight` slot a oneDNN copy of its fp32 CPU weight, and its per-row-count
    choice in `onednn_rows`, wherever oneDNN runs some batch size faster here; returns how many got one.

    `measure` makes the Timer for a shape's weights and their copies (a stand-in in tests)."""
    mode = os.environ.get(_ENV_SWITCH, "auto").strip().lower()
    if mode not in ("auto", "mkl", "onednn"):
        raise ValueError(f"{_ENV_SWITCH} must be auto, mkl or onednn, got {mode!r}")
    if mode == "mkl" or not torch.backends.mkldnn.is_available():
        return 0
    by_shape: dict[tuple[int, int], list[nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "onednn_weight") or weight is None:
            continue
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            continue
        if mode == "auto" and weight.numel() < ONEDNN_MIN_ELEMENTS:
            continue
        by_shape.setdefault(tuple(weight.shape), []).append(module)
    if not by_shape:
        return 0
    store = _ChoiceStore(choices_path or default_choices_path())
    attached = 0
    for shape, modules in by_shape.items():
        copies = [module.weight.detach().contiguous().to_mkldnn() for module in modules]
        if mode == "onednn":
            table = rows_table([True] * len(ROW_BUCKETS))
        else:
            choices = store.get(shape)
            if choices is None:
                weights, streamed = _streamed(modules, copies)
                choices = choose_buckets(measure(weights, streamed))
                store.put(shape, choices)
                logger.info("CPU matmul %s: oneDNN for row buckets %s, else MKL", shape, _describe(choices))
            table = rows_table(choices)
        if not table:
            continue
        for module, copy in zip(modules, copies, strict=True):
            module.onednn_weight = copy
            module.onednn_rows = table
            attached += 1
    store.save()
    return attached


def default_choices_path() -> Path:
    """Where this machine's choices live: per host, CPU count, torch threads and torch version (each changes them)."""
    host = platform.node() or "host"
    name = f"{host}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads-torch{torch.__version__}.json"
    return cache_root() / "matmul" / name


def _streamed(modules: list[nn.Module], copies: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The shape's weights repeated until they exceed STREAM_BYTES, so no measurement runs from the caches."""
    weights = [module.weight.detach() for module in modules]
    size = weights[0].numel() * weights[0].element_size()
    count = max(1, -(-STREAM_BYTES // size))
    if count <= len(weights):
        return weights[:count], copies[:count]
    # Too few weights of this shape to leave the caches: fresh ones of the same shape make up the rest.
    extra = [torch.randn_like(weights[0]) for _ in range(count - len(weights))]
    return weights + extra, copies + [weight.to_mkldnn() for weight in extra]


def _describe(choices: Sequence[bool]) -> str:
    picked = [f"<={rows}" for rows, choice in zip(ROW_BUCKETS, choices, strict=True) if choice]
    return ", ".join(picked) or "none"


class _ChoiceStore:
    """The per-machine file of measured choices: shape → one bool per row bucket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dirty = False
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        valid = isinstance(saved, dict) and saved.get("row_buckets") == list(ROW_BUCKETS)
        self._choices: dict[str, list[bool]] = saved.get("choices", {}) if valid else {}

    def get(self, shape: tuple[int, int]) -> list[bool] | None:
        choices = self._choices.get(_key(shape))
        if isinstance(choices, list) and len(choices) == len(ROW_BUCKETS):
            return [bool(choice) for choice in choices]
        return None

    def put(self, shape: tuple[int, int], choices: list[bool]) -> None:
        self._choices[_key(shape)] = choices
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        payload = json.dumps({"row_buckets": list(ROW_BUCKETS), "choices": self._choices}, indent=1)
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
