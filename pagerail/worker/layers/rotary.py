"""Rotary position embedding (neox-style rotate_half, as in HF Llama) with a precomputed cos/sin cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagerail.worker.layers import cpu_fused, triton_fused
from pagerail.worker.layers.yarn import yarn_attention_factor, yarn_inverse_frequencies

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings as one flat dict with at least rope_type and rope_theta.

    transformers 5 keeps them in `config.rope_parameters`; older configs spread them over `rope_theta`
    and `rope_scaling` (whose type key was once `type`), so both layouts are read.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.pop("type", None)
    if params["rope_type"] in ("llama3", "longrope", "yarn"):
        original = getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings
        params.setdefault("original_max_position_embeddings", original)
    partial = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; only 1.0 (RoPE over the whole head) is")
    return params


def inverse_frequencies(
    head_dim: int, params: dict[str, Any], long: bool = False, max_position: int | None = None
) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] in float32 for the given rope parameters (LongRoPE: its long
    factors with `long`, else its short ones; YaRN without a `factor`: max_position / the original context)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    base = float(params["rope_theta"])
    if rope_type == "longrope":
        key = "long_factor" if long else "short_factor"
        factors = params.get(key)
        if factors is None or len(factors) != head_dim // 2:
            count = "missing" if factors is None else f"{len(factors)} values"
            raise ValueError(f"rope_parameters.{key} must hold head_dim / 2 = {head_dim // 2} values, got {count}")
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**shape)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        # Scaling positions by 1/factor is the same as scaling the frequencies.
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    if rope_type == "yarn":
        return yarn_inverse_frequencies(head_dim, params, max_position)
    return inv_freq


def attention_scaling(params: dict[str, Any], max_position: int) -> float:
    """The factor on cos and sin: LongRoPE's sqrt(1 + ln(scale) / ln(original context)), YaRN's mscale; 1.0 for
    other kinds."""
    if params["rope_type"] == "yarn":
        return yarn_attention_factor(params, max_position)
    if params["rope_type"] != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_position / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat q [T, H*D] and k [T, KVH*D] at the given positions [T].

    The cache holds cos and sin for positions 0 .. max_position-1 in float32 as [max_position, head_dim // 2].
    Rotating the halves (x1, x2) to (x1*cos - x2*sin, x2*cos + x1*sin) is exactly HF's
    `x * cos + rotate_half(x) * sin` with the duplicated cache, at half the memory. Positions must stay
    below max_position; the scheduler caps the model length at that value.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if max_position <= 0:
            raise ValueError(f"max_position_embeddings must be positive, got {max_position}")
        self.head_dim = head_dim
        self.max_position = max_position
        positions = torch.arange(max_position, dtype=torch.int64).float()[:, None]
        freqs = positions * inverse_frequencies(head_dim, params, max_position=max_position)[None, :]
        if params["rope_type"] == "longrope":
            # Positions past the original context rotate by the long factors. transformers switches a whole
            # sequence to them once it passes that length (recomputing the cache); per position, a sequence's
            # earlier keys keep the rotation they were written with.
            original = int(params["original_max_position_embeddings"])
            freqs[original:] = positions[original:] * inverse_frequencies(head_dim, params, long=True)[None, :]
        scaling = attention_scaling(params, max_position)
        # Not persistent: it is derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] for one step's positions; computed once per step and shared by every layer."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated; q and k themselves may be overwritten (the CPU kernel rotates them in place)."""
        if triton_fused.fused_available(q, k, *tables):
            return triton_fused.rotary_embedding(q, k, tables[0], tables[1], self.head_dim)
        if q.device.type == "cpu":
            kernels = cpu_fused.fused_kernels()
            cos, sin = tables[0].squeeze(1), tables[1].squeeze(1)
            if kernels is not None and cpu_fused.fits(q, k, cos, sin) and cos.is_contiguous() and sin.is_contiguous():
                kernels.rotary(q, k, cos, sin, self.head_dim)
                return q, k
        cos, sin = (t.to(q.dtype) for t in tables)  # [T, 1, D/2] broadcasts over heads
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if triton_fused.fused_available(q, k, self.cos_cache) and positions.device == q.device:
            # The kernel reads the cache rows itself, skipping the gather into per-step tables.
            return triton_fused.rotary_embedding(q, k, self.cos_cache, self.sin_cache, self.head_dim, positions)
        return self.apply(q, k, self.tables(positions))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).view(shape)
