"""The canonical 4-bit weight layout (GPTQ's sequential packing) that int4_gemm reads, in torch ops."""

from __future__ import annotations

import torch

# Eight 4-bit values per int32 word, value j in bits 4j..4j+3.
PACK_FACTOR = 8
_NIBBLE_SHIFTS = tuple(range(0, 32, 4))


def check_int4_layout(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> tuple[int, int]:
    """Validate the layout's shapes and dtypes; returns (K, N). Reads nothing from the device."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [K/8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    in_features, out_features = qweight.shape[0] * PACK_FACTOR, qweight.shape[1]
    if g_idx.shape != (in_features,) or g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"g_idx must be int32 [K={in_features}] for qweight {tuple(qweight.shape)}, "
            f"got {g_idx.dtype} {tuple(g_idx.shape)}"
        )
    if scales.dim() != 2 or scales.shape[1] != out_features or not scales.is_floating_point():
        raise ValueError(f"scales must be float [G, N={out_features}], got {scales.dtype} {tuple(scales.shape)}")
    if zeros.shape != scales.shape or zeros.dtype != torch.uint8:
        raise ValueError(
            f"zeros must be uint8 {tuple(scales.shape)} like scales, got {zeros.dtype} {tuple(zeros.shape)}"
        )
    return in_features, out_features


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] → int32 [K, N] of values 0..15: row k is nibble k % 8 of packed row k // 8."""
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=qweight.device)
    # An arithmetic shift of a negative word drags its sign bit along; the mask keeps only the nibble.
    nibbles = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return nibbles.reshape(qweight.shape[0] * PACK_FACTOR, qweight.shape[1])


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int [K, N] of values 0..15 (K a multiple of 8) → int32 [K/8, N], the inverse of unpack_int4."""
    in_features, out_features = values.shape
    if in_features % PACK_FACTOR:
        raise ValueError(f"K={in_features} of values {tuple(values.shape)} is not a multiple of {PACK_FACTOR}")
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int64, device=values.device)
    grouped = values.to(torch.int64).reshape(in_features // PACK_FACTOR, PACK_FACTOR, out_features)
    # The nibbles never overlap, so a sum is their bitwise or; words ≥ 2**31 wrap to int32's negative range.
    words = (grouped << shifts[None, :, None]).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """W [K, N] in scales' dtype: W[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n].

    The product is formed in fp32 and rounded once: exact for (q - z) in -15..15, so the result equals the one
    the kernel rounds to the activation dtype before its dot.
    """
    check_int4_layout(qweight, scales, zeros, g_idx)
    groups = g_idx.long()
    offsets = unpack_int4(qweight) - zeros[groups].to(torch.int32)
    return (offsets.to(torch.float32) * scales[groups].to(torch.float32)).to(scales.dtype)
