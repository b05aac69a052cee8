"""The fp8 KV cache's number format: K and V stored as value / scale in e4m3 or e5m2, one scale per tensor."""

from __future__ import annotations

import torch

from pagerail.worker.layers.quantization.fp8_convert import fp8_to_float32

# Older torch builds lack the float8 dtypes; an fp8 kv_cache_dtype is then refused at start (worker.kv_cache).
FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values / scale in the fp8 format `dtype`, clamped to its finite range first: e4m3fn has no infinity, so an
    out-of-range value would otherwise become NaN. Divided in float32 so bf16 inputs round once, into fp8."""
    limit = torch.finfo(dtype).max
    return (values.to(torch.float32) / scale).clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V as the torch attention path reads it: an fp8 tensor times its scale, in the compute `dtype`; any
    other tensor (a full-precision cache) as it is."""
    if not is_fp8(stored.dtype):
        return stored
    # fp8 converts exactly to every compute dtype; the one rounding is that of the product.
    return (fp8_to_float32(stored) * scale).to(dtype)


def write_fp8(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize k/v [T, kv_heads, d] into the head-major fp8 caches [kv_heads, slots, d] at `slot_mapping`; returns
    the stored (fp8) k and v, which a prefill attending over its own fresh K/V reads so that every attention path
    sees the same values the cache holds.

    The copy goes through uint8 views: index_copy_ has no fp8 kernels on every device, and a byte copy is exact.
    The scales stay device tensors, so a captured CUDA graph replays this with no host sync.
    """
    stored_k = quantize(k, k_scale, key_cache.dtype)
    stored_v = quantize(v, v_scale, value_cache.dtype)
    key_cache.view(torch.uint8).index_copy_(1, slot_mapping, stored_k.transpose(0, 1).view(torch.uint8))
    value_cache.view(torch.uint8).index_copy_(1, slot_mapping, stored_v.transpose(0, 1).view(torch.uint8))
    return stored_k, stored_v
