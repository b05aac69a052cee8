"""FP8 W8A8 GEMM with block scales (DeepSeek-V3, Qwen3-FP8): per-token-group activation scales, per-block weight
scales, one fp32 promotion per K block.

Layout: weight float8_e4m3fn [N, K] with weight_scale fp32 [ceil(N/bn), ceil(K/bk)], one scale per bn x bk block
(`block_size` = (bn, bk), the checkpoints' weight_block_size). Activations are quantized on the fly, per token and
per group of bk columns: x_scale fp32 [M, ceil(K/bk)]. Then

    y[m, n] = sum over K blocks b of (sum over k in b of xq[m, k] * wq[n, k]) * x_scale[m, b] * w_scale[n // bn, b].

The kernel's K step is one scale block, so both scales are constant across each tl.dot and apply to its fp32
result; on sm_90 the fp8 dot itself accumulates with reduced precision, and promoting every bk (128) products
bounds that error, as DeepSeek-V3's recipe does. Weight scales are looked up per output column (n // bn), so a
column tile may be narrower than bn or straddle two scale blocks, and N need not be a multiple of bn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagerail.worker.layers.triton_common import grouped_tile, tl, triton, triton_available

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# An all-zero group still needs a positive scale: its values quantize to 0 and dequantize to 0 either way.
_MIN_AMAX = 1e-10
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GROUP_M = 8


def fp8_block_gemm_available(x: torch.Tensor) -> bool:
    """True when fp8_block_gemm runs a kernel for `x`: triton present and CUDA (or the interpreter)."""
    return triton_available(x.device)


def quantize_activations_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float → (x_fp8 [M, K] float8_e4m3fn, x_scale [M, ceil(K/group)] fp32), scale = amax / 448.

    Torch ops on x's device, no host sync (CUDA-graph safe). A Triton kernel would fuse the five launches, but
    the CPU interpreter rounds to fp8 wrongly (a carry out of the mantissa is lost), so it could not be checked
    off the GPU; these ops round as the hardware does. The last group may be partial: it is padded with zeros,
    which change neither its amax nor its values.
    """
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a float [M, K] tensor, got {x.dtype} {tuple(x.shape)}")
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")
    rows, in_features = x.shape
    num_groups = -(-in_features // group)
    values = x.float()
    if num_groups * group != in_features:
        values = F.pad(values, (0, num_groups * group - in_features))
    groups = values.reshape(rows, num_groups, group)
    scale = groups.abs().amax(dim=-1).clamp_min(_MIN_AMAX) / FP8_MAX
    # The division can land a hair above 448 at the group's amax; the clamp keeps it finite in e4m3fn.
    quantized = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    quantized = quantized.view(rows, num_groups * group)
    if num_groups * group != in_features:
        quantized = quantized[:, :in_features].contiguous()
    return quantized, scale


if triton is not None:
    # The row count changes every step: specialising on it (== 1, multiple of 16) would compile three variants.
    @triton.jit(do_not_specialize=("rows",))
    def _fp8_block_gemm_kernel(
        out_ptr,
        x_ptr,
        x_scale_ptr,
        w_ptr,
        w_scale_ptr,
        bias_ptr,
        rows,
        out_features,
        in_features,
        stride_xm,
        stride_xsm,
        stride_wn,
        stride_wsn,
        stride_om,
        SCALE_BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        tile_m, tile_n = grouped_tile(tl.program_id(0), rows, out_features, BLOCK_M, BLOCK_N, GROUP_M)

        # Rows in int64: M * K of a long prefill can pass 2**31 elements.
        row_ids = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row_ids < rows
        col_ok = cols < out_features
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + row_ids[:, None] * stride_xm + ks[None, :]
        # [BLOCK_K, BLOCK_N] tiles of the [N, K] weight, read transposed.
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
        x_scale_ptrs = x_scale_ptr + row_ids * stride_xsm
        # Each column's own scale row: a tile may cover parts of two bn blocks.
        w_scale_ptrs = w_scale_ptr + (cols // SCALE_BLOCK_N) * stride_wsn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block in range(0, tl.cdiv(in_features, BLOCK_K)):
            k_ok = ks < in_features - block * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            x_scale = tl.load(x_scale_ptrs + block, mask=row_ok, other=0.0)
            w_scale = tl.load(w_scale_ptrs + block, mask=col_ok, other=0.0)
            # A fresh fp32 dot per scale block, scaled and promoted into the accumulator.
            acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + row_ids[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _launch_config(rows: int) -> dict[str, int]:
    """Tile sizes from the row count, known on the host: 16-row tiles (the least tl.dot takes) and narrow column
    tiles for decode, so N/64 programs share the weight reads; square 128 tiles for prefill."""
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    if rows <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def _check_gemm(x_fp8, x_scale, weight, weight_scale, block_size, out_dtype) -> None:
    block_n, block_k = block_size
    if block_k < 16 or block_k & (block_k - 1) or block_n <= 0:
        raise ValueError(f"block_size {tuple(block_size)}: bk must be a power of two ≥ 16 and bn positive")
    if x_fp8.dim() != 2 or weight.dim() != 2 or x_fp8.shape[1] != weight.shape[1]:
        raise ValueError(f"x_fp8 {tuple(x_fp8.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    if x_fp8.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"x_fp8 {x_fp8.dtype} and weight {weight.dtype} must be {FP8_DTYPE}")
    (rows, in_features), out_features = x_fp8.shape, weight.shape[0]
    k_blocks = -(-in_features // block_k)
    if x_scale.shape != (rows, k_blocks) or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale {x_scale.dtype} {tuple(x_scale.shape)} is not fp32 [{rows}, {k_blocks}]")
    want = (-(-out_features // block_n), k_blocks)
    if weight_scale.shape != want or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)} is not fp32 {list(want)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not one of fp32/fp16/bf16")


def _dequantized_gemm(x_fp8, x_scale, weight, weight_scale, block_size) -> torch.Tensor:
    """The same product in fp32 torch ops, for devices without the kernel."""
    block_n, block_k = block_size
    in_features = x_fp8.shape[1]
    x = x_fp8.float() * x_scale.repeat_interleave(block_k, dim=1)[:, :in_features]
    scales = weight_scale.repeat_interleave(block_n, dim=0)[: weight.shape[0]]
    w = weight.float() * scales.repeat_interleave(block_k, dim=1)[:, :in_features]
    return x @ w.T


def fp8_block_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, N] in out_dtype: the block-scaled product of the module docstring (plus bias), fp32 accumulation.

    x_fp8 [M, K] and weight [N, K] float8_e4m3fn; x_scale fp32 [M, ceil(K/bk)] (quantize_activations_per_group
    with group bk); weight_scale fp32 [ceil(N/bn), ceil(K/bk)]; block_size (bn, bk), bk a power of two ≥ 16.
    Launches no host sync.
    """
    _check_gemm(x_fp8, x_scale, weight, weight_scale, block_size, out_dtype)
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} is not [N={weight.shape[0]}]")
    if not fp8_block_gemm_available(x_fp8):
        out = _dequantized_gemm(x_fp8, x_scale, weight, weight_scale, block_size)
        return (out if bias is None else out + bias.float()).to(out_dtype)
    rows, in_features = x_fp8.shape
    out_features = weight.shape[0]
    out = torch.empty((rows, out_features), dtype=out_dtype, device=x_fp8.device)
    if rows == 0:
        return out
    # The K loop steps through x, weight and the scales with unit stride.
    x_fp8, weight = x_fp8.contiguous(), weight.contiguous()
    x_scale, weight_scale = x_scale.contiguous(), weight_scale.contiguous()
    config = _launch_config(rows)
    tiles = triton.cdiv(rows, config["BLOCK_M"]) * triton.cdiv(out_features, config["BLOCK_N"])
    _fp8_block_gemm_kernel[(tiles,)](
        out,
        x_fp8,
        x_scale,
        weight,
        weight_scale,
        bias.contiguous() if bias is not None else x_scale,  # never read without HAS_BIAS
        rows,
        out_features,
        in_features,
        x_fp8.stride(0),
        x_scale.stride(0),
        weight.stride(0),
        weight_scale.stride(0),
        out.stride(0),
        SCALE_BLOCK_N=block_size[0],
        BLOCK_K=block_size[1],
        GROUP_M=_GROUP_M,
        HAS_BIAS=bias is not None,
        **config,
    )
    return out


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (fp32/fp16/bf16) @ the block-scaled fp8 weight [N, K] (+ bias): [..., N] in x's dtype."""
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"x must be fp32/fp16/bf16, got {x.dtype}")
    lead = x.shape[:-1]
    x_fp8, x_scale = quantize_activations_per_group(x.reshape(-1, x.shape[-1]), block_size[1])
    out = fp8_block_gemm(x_fp8, x_scale, weight, weight_scale, block_size, x.dtype, bias)
    return out.reshape(*lead, weight.shape[0])
