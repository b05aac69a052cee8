"""FP8 weights for linear layers: per-row scales (per-tensor, per-channel, or quantized while loading) and 2-D
block scales, with dynamic activation scales on GPUs and dequantized weights on CPUs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagerail.worker.layers.quantization.config import QuantConfig, QuantizationConfigError
from pagerail.worker.layers.quantization.fp8_convert import fp8_to_float32
from pagerail.worker.layers.quantization.linear_method import LinearMethod

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# A row of zeros gets this scale instead of 0, so dequantizing it never divides by zero.
_MIN_SCALE = 1e-12


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [rows, cols] → (fp8 weight, fp32 per-row scale) with weight ≈ fp8 * scale[:, None]."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def expand_block_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] → one scale per weight entry [N, K]."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def dequantize_fp8(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight [N, K] in `dtype`, as its fp8 values times their scales."""
    weight = fp8_to_float32(layer.weight)
    if layer.fp8_block is not None:
        weight = weight * expand_block_scales(layer.fp8_scale.float(), weight.shape, layer.fp8_block)
    else:
        weight = weight * layer.fp8_scale.float()[:, None]
    return weight.to(dtype)


class Fp8LinearMethod(LinearMethod):
    """fp8 e4m3 weights [N, K] with scales as the checkpoint lays them out, or quantized per row while loading."""

    def __init__(self, config: QuantConfig) -> None:
        self.config = config
        self.block = config.block_size if config.scheme == "block" else None
        # Native fp8 checkpoints call block scales weight_scale_inv (they multiply all the same).
        native_block = self.block is not None and config.checkpoint_method == "fp8"
        self.scale_name = "weight_scale_inv" if native_block else "weight_scale"

    def create_weights(self, layer: nn.Module) -> None:
        from pagerail.worker.layers.linear import new_param

        out_features, in_features = layer.out_features, layer.in_features
        del layer.weight
        layer.weight = new_param((out_features, in_features), FP8_DTYPE, layer.weight_loader)
        if self.config.on_load:
            # The checkpoint has no scales: each arriving slice is quantized per row, writing its rows' scales.
            layer.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
            layer.weight.store_rows = _quantizing_writer(layer)
        elif self.block is None:
            scale = new_param((out_features,), torch.float32, layer.weight_loader, input_dim=None)
            scale.broadcast_scalar = True  # a per-tensor checkpoint scale fills its part's rows
            layer.register_parameter(self.scale_name, scale)
        else:
            block_n, block_k = self.block
            _check_block_split(layer, self.block)
            shape = (-(-out_features // block_n), -(-in_features // block_k))
            scale = new_param(shape, torch.float32, layer.weight_loader, output_pack=block_n, input_pack=block_k)
            layer.register_parameter(self.scale_name, scale)
        layer.fp8_block = self.block

    def after_loading(self, layer: nn.Module) -> None:
        layer.fp8_scale = getattr(layer, self.scale_name)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return apply_w8a8(layer, x)
        if layer.fp8_block is None:
            # Per-row scales commute with the matmul: scale the outputs instead of every weight entry.
            weight = fp8_to_float32(layer.weight, reuse_buffer=True)
            return F.linear(x, weight.to(x.dtype)) * layer.fp8_scale.to(x.dtype)
        return F.linear(x, dequantize_fp8(layer, x.dtype))


def _quantizing_writer(layer: nn.Module):
    def write(target: torch.Tensor, piece: torch.Tensor, row: int) -> None:
        quantized, scale = quantize_rows(piece)
        target.copy_(quantized)
        layer.weight_scale[row : row + piece.shape[0]].copy_(scale)

    return write


def _check_block_split(layer: nn.Module, block: tuple[int, int]) -> None:
    """Every rank's slice, and every part of a fused layer, must start on a scale block."""
    block_n, block_k = block
    parts = getattr(layer, "local_sizes", None)
    if parts is None and hasattr(layer, "q_size"):
        parts = [layer.q_size, layer.kv_size, layer.kv_size]
    sizes = parts or [layer.out_features]
    split_in = hasattr(layer, "input_size") and layer.tp.size > 1
    if any(size % block_n for size in sizes[:-1]) or (layer.tp.size > 1 and sizes[-1] % block_n):
        raise QuantizationConfigError(
            f"weight_block_size [{block_n}, {block_k}] does not divide the output slices {sizes} of a "
            f"{type(layer).__name__} at tensor_parallel_size={layer.tp.size}"
        )
    if split_in and layer.in_features % block_k:
        raise QuantizationConfigError(
            f"weight_block_size [{block_n}, {block_k}] does not divide the {layer.in_features} input features per "
            f"rank of a {type(layer).__name__} at tensor_parallel_size={layer.tp.size}"
        )


def quantize_activations_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (fp8 [M, K], fp32 [M, 1]): dynamic per-token scales, no host sync."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _scaled_mm_fits(x: torch.Tensor, layer: nn.Module) -> bool:
    # torch's fp8 GEMM with row-wise scales wants 16-aligned K and N and a bf16 output.
    return x.dtype == torch.bfloat16 and layer.in_features % 16 == 0 and layer.out_features % 16 == 0


def apply_w8a8(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The GPU product: fp8 activations scaled per token (per token and K block for block scales) times the fp8
    weight, accumulated in fp32; a dequantized weight where the fp8 GEMMs do not apply."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if layer.fp8_block is not None:
        from pagerail.worker.layers.quantization.triton_fp8_gemm import fp8_block_linear

        return fp8_block_linear(x, layer.weight, layer.fp8_scale, layer.fp8_block)
    if not _scaled_mm_fits(x, layer):
        return F.linear(x, dequantize_fp8(layer, x.dtype))
    x_fp8, x_scale = quantize_activations_per_row(flat)
    out = torch._scaled_mm(
        x_fp8,
        layer.weight.t(),
        scale_a=x_scale,
        scale_b=layer.fp8_scale.float().reshape(1, -1),
        out_dtype=x.dtype,
    )
    return out.reshape(*lead, layer.out_features)
