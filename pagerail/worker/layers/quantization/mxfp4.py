"""MXFP4 weights as gpt-oss checkpoints ship its experts: e2m1 codes in packed bytes, one e8m0 scale per 32 values."""

from __future__ import annotations

import torch

# Values sharing one scale (the OCP MX block size), and the bytes that hold them (two codes a byte).
MXFP4_BLOCK = 32
BYTES_PER_BLOCK = MXFP4_BLOCK // 2
# e2m1 code → value: bit 3 is the sign, bits 0-2 index the magnitudes; low nibble of a byte first.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# e8m0 scale byte s means 2 ** (s - E8M0_BIAS).
E8M0_BIAS = 127


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] with the same leading dimensions."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        shape = f"{blocks.dtype} {tuple(blocks.shape)}"
        raise ValueError(f"MXFP4 blocks must be uint8 [..., G, {BYTES_PER_BLOCK}], got {shape}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 scales must be uint8 {tuple(blocks.shape[:-1])} (one per block of {MXFP4_BLOCK}), "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] → [..., G * 32] in `dtype`.

    Value 2j + n of a block is code n (0: low nibble, 1: high) of its byte j, times 2 ** (scale - 127). The product
    is formed in float32 (float64 when asked for), where it is exact: an e2m1 magnitude has two significant bits
    and the scale is a power of two, so the smallest nonzero value, 0.5 * 2**-127, is still a float32 subnormal.
    Scale 255 (NaN in the OCP format, never written by quantizers) decodes as 2**128, infinite in float32.
    """
    check_mxfp4(blocks, scales)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    table = torch.tensor(E2M1_VALUES, dtype=work, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64)  # [..., G, 16, 2]: low nibble first
    values = table[codes].reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    exponents = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(values, exponents[..., None].to(work))
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK).to(dtype)


def check_mxfp4_split(field: str, size: int, parts: int, unit: str) -> int:
    """size / parts, refused unless each part holds whole MXFP4 blocks (checkpoint blocks cannot be cut)."""
    if size % MXFP4_BLOCK:
        raise ValueError(f"{field}={size} is not a multiple of {MXFP4_BLOCK}, the MXFP4 block size")
    if size % (parts * MXFP4_BLOCK):
        raise ValueError(
            f"{field}={size} split over {unit}={parts} gives {size / parts:g} columns per rank, not a multiple of "
            f"{MXFP4_BLOCK}: each rank must hold whole MXFP4 blocks of down_proj; use a {unit} that divides "
            f"{field}/{MXFP4_BLOCK}={size // MXFP4_BLOCK}, or enable_expert_parallel (whole experts per rank)"
        )
    return size // parts


def deinterleave_rows(rows: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """gpt-oss's interleaved gate/up rows (gate j at 2j, up j at 2j + 1) → all gate rows, then all up rows."""
    pairs = rows.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)
