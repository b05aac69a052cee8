"""CPU matmuls through oneDNN where it beats MKL: large weights at small batches; everything else stays on MKL.

A oneDNN call converts its input to and from oneDNN's layout, a fixed cost of tens of microseconds that only a
large weight repays. Measured on this kind of CPU (fp32, best of four, MKL time / oneDNN time):

    weight [out, in]       1 row   16 rows   64 rows   128 rows   256 rows
    1024 x 128  (0.13M)    0.24    0.39      0.80      0.86       0.27
    960 x 576   (0.55M)    0.55    0.52      0.85      0.97       0.59
    576 x 1536  (0.88M)    0.47    0.75      0.73      1.07       0.94
    3072 x 576  (1.77M)    0.94    1.97      1.68      1.28       0.90
    49152 x 576 (28.3M)    1.78    2.03      1.71      1.39       1.25

So a weight of at least `ONEDNN_MIN_ELEMENTS` keeps a oneDNN copy, used up to `ONEDNN_MAX_ROWS` rows (up to
`ONEDNN_MAX_ROWS_LARGE` for weights of `ONEDNN_LARGE_ELEMENTS` or more, such as an LM head); at 2048 rows MKL
leads for every shape. PAGERAIL_CPU_MATMUL=mkl keeps every matmul on MKL; =onednn gives every fp32 layer a
oneDNN copy used up to `ONEDNN_MAX_ROWS_LARGE` rows, whatever its size.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MIN_ELEMENTS = 1 << 20
ONEDNN_LARGE_ELEMENTS = 8 << 20
ONEDNN_MAX_ROWS = 128
ONEDNN_MAX_ROWS_LARGE = 256
_ENV_SWITCH = "PAGERAIL_CPU_MATMUL"


def linear(
    x: torch.Tensor, weight: torch.Tensor, onednn_weight: torch.Tensor | None, max_rows: int = ONEDNN_MAX_ROWS
) -> torch.Tensor:
    """x @ weight^T, through the oneDNN copy of the weight when there is one and x has at most `max_rows` rows."""
    if onednn_weight is None or x.dim() != 2 or x.shape[0] > max_rows or x.shape[0] == 0:
        return F.linear(x, weight)
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), onednn_weight, None).to_dense()


def onednn_max_rows(num_elements: int, mode: str = "auto") -> int:
    """The most rows a weight of this many elements multiplies through oneDNN; 0: never (MKL only)."""
    if mode == "mkl":
        return 0
    if mode == "onednn" or num_elements >= ONEDNN_LARGE_ELEMENTS:
        return ONEDNN_MAX_ROWS_LARGE
    return ONEDNN_MAX_ROWS if num_elements >= ONEDNN_MIN_ELEMENTS else 0


def attach_onednn_weights(model: nn.Module) -> int:
    """Give every module with an `onednn_weight` slot whose fp32 CPU weight oneDNN runs faster a oneDNN copy,
    and its row limit in `onednn_max_rows`; returns how many got one."""
    mode = os.environ.get(_ENV_SWITCH, "auto").strip().lower()
    if mode not in ("auto", "mkl", "onednn"):
        raise ValueError(f"{_ENV_SWITCH} must be auto, mkl or onednn, got {mode!r}")
    if not torch.backends.mkldnn.is_available():
        return 0
    attached = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "onednn_weight") or weight is None:
            continue
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            continue
        max_rows = onednn_max_rows(weight.numel(), mode)
        if max_rows:
            module.onednn_weight = weight.detach().contiguous().to_mkldnn()
            module.onednn_max_rows = max_rows
            attached += 1
    return attached
