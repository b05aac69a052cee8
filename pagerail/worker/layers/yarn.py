"""YaRN rotary scaling (gpt-oss, Qwen long-context configs): per-pair frequencies and the factor on cos and sin.

Computed as transformers' `_compute_yarn_parameters` computes them, operation for operation in float32, so the
tables agree bit for bit: pairs that turn fewer than `beta_slow` times over the original context are
interpolated (divided by `factor`), pairs that turn more than `beta_fast` times keep their frequency, and a
linear ramp blends the pairs between.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _mscale(scale: float, mscale: float = 1.0) -> float:
    # YaRN's eq. 21: 0.1 * mscale * ln(scale) + 1, and no change when the context is not extended.
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(params: dict[str, Any], max_position: int) -> float:
    """The context extension: `factor`, else max_position_embeddings / original_max_position_embeddings."""
    factor = params.get("factor")
    if factor is None:
        return max_position / int(params["original_max_position_embeddings"])
    return float(factor)


def yarn_attention_factor(params: dict[str, Any], max_position: int) -> float:
    """`attention_factor` when given; else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    set (DeepSeek), else mscale(factor)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = yarn_factor(params, max_position)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def _correction_dim(num_rotations: float, dim: int, base: float, original: int) -> float:
    # The pair index whose wavelength fits `num_rotations` turns into the original context.
    return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inverse_frequencies(head_dim: int, params: dict[str, Any], max_position: int | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] in float32.

    `max_position` is needed only when the parameters carry no `factor`.
    """
    if "original_max_position_embeddings" not in params:
        raise ValueError("rope_parameters.original_max_position_embeddings is required for rope_type='yarn'")
    if params.get("factor") is None and max_position is None:
        raise ValueError("rope_parameters.factor is required for rope_type='yarn'")
    base = float(params["rope_theta"])
    original = int(params["original_max_position_embeddings"])
    factor = yarn_factor(params, max_position or original)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    dim = head_dim

    low = _correction_dim(beta_fast, dim, base, original)
    high = _correction_dim(beta_slow, dim, base, original)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_share = 1 - ramp
    return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share
