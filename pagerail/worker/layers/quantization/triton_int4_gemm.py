"""w4a16 GEMM for GPTQ/AWQ weights: 4-bit weights dequantized tile by tile inside a Triton GEMM, fp32 accumulation.

The kernel reads one layout (int4_layout.py, GPTQ's sequential packing; AWQ checkpoints are repacked into it
after loading): qweight int32 [K/8, N] with input row k in nibble k % 8 of word row k // 8, scales [G, N] in the
activation dtype, zeros uint8 [G, N] (unpacked, 0..15) and g_idx int32 [K], the group of each input row, which
covers act-order checkpoints (g_idx a permutation of the groups) and plain ones (g_idx = k // group_size) alike.

Each program owns a BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps: it loads the packed words of the
step (each word once per nibble, from L1), shifts out the nibbles, gathers every row's scale and zero point
through g_idx, forms (q - z) * s in the activation dtype, and feeds it to tl.dot with the activation tile.
"""

from __future__ import annotations

import torch

from pagerail.worker.layers.quantization.int4_layout import PACK_FACTOR, check_int4_layout, dequantize_int4
from pagerail.worker.layers.triton_common import dot_operands, grouped_tile, tl, triton, triton_available

__all__ = ["dequantize_int4", "int4_gemm", "int4_gemm_available"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Consecutive programs share GROUP_M row tiles, so the weight columns they read are still in L2 for the next ones.
_GROUP_M = 8


def int4_gemm_available(x: torch.Tensor) -> bool:
    """True when int4_gemm can run for activations `x`: triton present, CUDA (or interpreter), float dtype."""
    return x.dtype in _SUPPORTED_DTYPES and triton_available(x.device)


def _launch_config(rows: int) -> dict[str, int]:
    """Tile sizes from the row count, known on the host.

    Decode is bound by reading the weights: a 16-row tile (the least tl.dot takes) and narrow column tiles give
    N/32 programs to spread the packed words over the SMs. Prefill is bound by the dot: square 128 tiles, with a
    64-deep K step so the dequantized tile stays in registers beside the accumulator.
    """
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if rows <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


if triton is not None:
    # The row count changes every step: specialising on it (== 1, multiple of 16) would compile three variants.
    @triton.jit(do_not_specialize=("rows",))
    def _int4_gemm_kernel(
        out_ptr,
        x_ptr,
        qweight_ptr,
        scales_ptr,
        zeros_ptr,
        g_idx_ptr,
        bias_ptr,
        rows,
        out_features,
        in_features,
        stride_xm,
        stride_xk,
        stride_qk,
        stride_qn,
        stride_sg,
        stride_zg,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        tile_m, tile_n = grouped_tile(tl.program_id(0), rows, out_features, BLOCK_M, BLOCK_N, GROUP_M)

        # Rows in int64: M * K of a long prefill can pass 2**31 elements.
        row_ids = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row_ids < rows
        col_ok = cols < out_features
        ks = tl.arange(0, BLOCK_K)
        # Input row k sits in bits 4 * (k % 8) of word row k // 8; BLOCK_K is a multiple of 8, so both are fixed
        # per lane across the K steps.
        shifts = ((ks % 8) * 4)[:, None]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, in_features, BLOCK_K):
            k = k_start + ks
            k_ok = k < in_features
            x = tl.load(
                x_ptr + row_ids[:, None] * stride_xm + k[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_mask = k_ok[:, None] & col_ok[None, :]
            words = tl.load(
                qweight_ptr + (k // 8)[:, None] * stride_qk + cols[None, :] * stride_qn, mask=w_mask, other=0
            )
            nibbles = (words >> shifts) & 0xF
            # Each input row's own group: act-order checkpoints scatter a group's rows over all of K.
            groups = tl.load(g_idx_ptr + k, mask=k_ok, other=0)
            scales = tl.load(scales_ptr + groups[:, None] * stride_sg + cols[None, :], mask=w_mask, other=0.0)
            zeros = tl.load(zeros_ptr + groups[:, None] * stride_zg + cols[None, :], mask=w_mask, other=0)
            # (q - z) is exact in any float type and so is its fp32 product with the scale: one rounding, to the
            # activation dtype, as dequantize_int4 rounds.
            w = ((nibbles - zeros.to(tl.int32)).to(tl.float32) * scales.to(tl.float32)).to(DOT_DTYPE)
            acc = tl.dot(x.to(DOT_DTYPE), w, acc=acc, input_precision=DOT_PRECISION)

        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + row_ids[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_inputs(x, qweight, scales, zeros, g_idx, bias) -> tuple[int, int]:
    if qweight.dim() == 2 and x.shape[-1] % PACK_FACTOR:
        raise ValueError(
            f"K={x.shape[-1]} of x {tuple(x.shape)} is not a multiple of {PACK_FACTOR}: 4-bit weights pack "
            f"8 input rows per int32 word"
        )
    in_features, out_features = check_int4_layout(qweight, scales, zeros, g_idx)
    if x.shape[-1] != in_features:
        raise ValueError(f"x {tuple(x.shape)} has K={x.shape[-1]}; qweight {tuple(qweight.shape)} is K={in_features}")
    if x.dtype not in _SUPPORTED_DTYPES or scales.dtype != x.dtype:
        raise ValueError(f"x {x.dtype} and scales {scales.dtype} must share one of fp32/fp16/bf16")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} is not [N={out_features}]")
    return in_features, out_features


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W (+ bias) with W [K, N] the 4-bit weight of int4_layout; returns [..., N] in x's dtype.

    x [..., K] (K a multiple of 8); qweight int32 [K/8, N]; scales [G, N] in x's dtype; zeros uint8 [G, N];
    g_idx int32 [K]. Accumulates in fp32; launches no host sync. Without Triton on x's device (CPU) the weight is
    dequantized with torch ops and multiplied there.
    """
    in_features, out_features = _check_inputs(x, qweight, scales, zeros, g_idx, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if not int4_gemm_available(x):
        out = x2 @ dequantize_int4(qweight, scales, zeros, g_idx)
        return (out if bias is None else out + bias.to(out.dtype)).reshape(*lead, out_features)
    rows = x2.shape[0]
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.reshape(*lead, out_features)
    # The kernel indexes scales, zeros and bias with unit column stride.
    scales, zeros = scales.contiguous(), zeros.contiguous()
    g_idx = g_idx.to(torch.int32)
    has_bias = bias is not None
    config = _launch_config(rows)
    tiles = triton.cdiv(rows, config["BLOCK_M"]) * triton.cdiv(out_features, config["BLOCK_N"])
    _int4_gemm_kernel[(tiles,)](
        out,
        x2,
        qweight,
        scales,
        zeros,
        g_idx,
        bias.contiguous() if has_bias else scales,  # never read without HAS_BIAS
        rows,
        out_features,
        in_features,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        GROUP_M=_GROUP_M,
        HAS_BIAS=has_bias,
        **dot_operands(x.dtype),
        **config,
    )
    return out.reshape(*lead, out_features)
