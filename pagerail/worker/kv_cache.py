"""Sizes this rank's KV cache shard from its memory budget and allocates it, one tensor per layer."""

from __future__ import annotations

import torch

from pagerail.worker.host_memory import zeros_on_huge_pages
from pagerail.worker.layers.triton_common import triton_available

DEFAULT_CPU_KV_BYTES = 2 << 30

# kv_cache_dtype → the torch dtype K and V are stored in ("auto" stores the model's dtype).
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype this rank stores K and V in. An fp8 format that this torch or device cannot read on the attention
    path the rank will take is refused here, at start, rather than failing (or being ignored) at the first step."""
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {tuple(FP8_KV_DTYPES)}, got {name!r}")
    dtype = getattr(torch, FP8_KV_DTYPES[name], None)
    if dtype is None:
        raise ValueError(
            f"kv_cache_dtype={name!r} stores K/V as torch.{FP8_KV_DTYPES[name]}, which torch {torch.__version__} "
            "lacks; use kv_cache_dtype='auto' or a torch with float8 dtypes"
        )
    if device.type == "cuda" and triton_available(device) and dtype == torch.float8_e4m3fn:
        # The Triton kernels convert e4m3 with instructions that GPUs before Ada/Hopper lack; e5m2 has a fallback.
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={name!r}: the Triton attention kernels read fp8 e4m3 on compute capability 8.9 or "
                f"newer, and this GPU is {capability[0]}.{capability[1]}; use kv_cache_dtype='fp8_e5m2' or 'auto'"
            )
    return dtype


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """K and V for `block_size` tokens across every layer of this rank's shard, stored as `dtype` (the KV dtype)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def memory_budget(device: torch.device, kv_cache_memory_bytes: int | None) -> int | None:
    """Bytes this rank may spend on its KV cache; None on a GPU, whose budget a profiling forward measures."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    if device.type == "cuda":
        return None  # see worker.memory_profile
    return DEFAULT_CPU_KV_BYTES


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One [2, kv_heads, num_blocks * block_size, head_dim] tensor of `dtype` (the KV dtype) per layer;
    slot = block * block_size + offset."""
    shape = (2, num_kv_heads, num_blocks * block_size, head_dim)
    if device.type == "cpu":
        return [zeros_on_huge_pages(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
