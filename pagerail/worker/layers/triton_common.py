"""What the Triton kernels share: the optional triton import, the interpreter switch, dtypes, and score helpers."""

from __future__ import annotations

import os

import torch

from pagerail.worker.layers.kv_quant import is_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never reach the kernels; the torch and native paths cover them.
    triton = None
    tl = None

# triton decides at decoration time whether a kernel is compiled or interpreted, so record it once, here.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16} if tl else {}


def triton_available(device: torch.device | str) -> bool:
    """True when the kernel can run on `device`: triton imports and the device is CUDA, or the interpreter is on."""
    if triton is None:
        return False
    return INTERPRETED or torch.device(device).type == "cuda"


def dot_operands(cache_dtype: torch.dtype) -> dict[str, object]:
    """The DOT_DTYPE and DOT_PRECISION kernel arguments for K/V stored as `cache_dtype`.

    tl.dot wants both operands in one dtype, so K/V feed it as stored. The interpreter keeps bf16 as raw uint16
    bits and its tl.dot multiplies those bits, so there bf16 goes through fp32. fp32 operands ask for full
    precision instead of silently dropping to TF32 on tensor cores.
    """
    dot_dtype = torch.float32 if INTERPRETED and cache_dtype == torch.bfloat16 else cache_dtype
    return {"DOT_DTYPE": TL_DTYPES[dot_dtype], "DOT_PRECISION": "ieee" if dot_dtype == torch.float32 else None}


def kv_operands(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> dict[str, object]:
    """The attention kernels' cache arguments: DOT_DTYPE/DOT_PRECISION, KV_FP8 and the two scale pointers.

    A full-precision cache feeds tl.dot as stored. An fp8 cache (value / scale) converts exactly to the queries'
    dtype, which the dots then run in; the scales, float32 scalars on the queries' device, are read by the kernel
    in place (a captured CUDA graph sees the loaded values, no host sync) and multiply the scores and the output.
    """
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"key and value caches differ in dtype: {key_cache.dtype}/{value_cache.dtype}")
    if not is_fp8(key_cache.dtype):
        if key_cache.dtype not in TL_DTYPES:
            raise ValueError(f"unsupported cache dtype {key_cache.dtype}")
        # The scale pointers are never read without KV_FP8: any tensor stands in for them.
        return {**dot_operands(key_cache.dtype), "KV_FP8": False, "k_scale_ptr": q, "v_scale_ptr": q}
    if q.dtype not in TL_DTYPES:
        raise ValueError(f"queries over an fp8 cache must be fp32/fp16/bf16, got {q.dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != q.device:
            raise ValueError(f"an fp8 cache needs {name} as one float32 on {q.device}, got {scale!r}")
    return {**dot_operands(q.dtype), "KV_FP8": True, "k_scale_ptr": k_scale, "v_scale_ptr": v_scale}


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """Attention sinks must hold one float per query head, on the queries' device."""
    if sinks is None:
        return
    if sinks.shape != (num_heads,) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be float [num_heads={num_heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, q on {device}: both must share one device")


if triton is not None:
    # Scores live in the exp2 domain (qk_scale carries log2(e)); a sink, a natural-log logit, is brought there too.
    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def softcapped(scores, softcap):
        """cap * tanh(s / cap) for scores s in the exp2 domain (qk_scale carries log2(e)); `softcap` is the cap
        times log2(e), so the cap applies to the natural-log score. tanh(x) = 1 - 2 / (exp(2x) + 1), from exp
        alone, which every backend and the interpreter have."""
        return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))

    @triton.jit
    def grouped_tile(pid, rows, columns, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles sweep a column tile before
        the next column tile starts, so the weight tiles they share are read from L2."""
        tiles_m = tl.cdiv(rows, BLOCK_M)
        tiles_n = tl.cdiv(columns, BLOCK_N)
        first_m = pid // (GROUP_M * tiles_n) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        in_group = pid % (GROUP_M * tiles_n)
        return first_m + in_group % group_rows, in_group // group_rows
else:
    LOG2E = 1.4426950408889634
    softcapped = None
    grouped_tile = None
