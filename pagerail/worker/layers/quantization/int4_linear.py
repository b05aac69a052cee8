"""4-bit weight-only linear layers (w4a16) from AWQ and GPTQ checkpoints.

Parameters are created and sharded in the checkpoint's own layout; after loading, both formats are converted to
the one layout the int4 GEMM reads (int4_layout: int32 [K/8, N] packed along K, uint8 zero points [G, N],
scales [G, N], a group index per input row).
"""

from __future__ import annotations

import torch
from torch import nn

from pagerail.worker.layers.quantization.config import QuantConfig, QuantizationConfigError
from pagerail.worker.layers.quantization.int4_layout import PACK_FACTOR, pack_int4
from pagerail.worker.layers.quantization.linear_method import LinearMethod
from pagerail.worker.layers.quantization.triton_int4_gemm import int4_gemm

# AWQ packs the eight columns of a word in this order: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = tuple(range(0, 32, 4))


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C/8] whose words hold 8 columns each (nibble i → column order[i]) → int32 [R, C] of 0..15."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, C/8, 8] in nibble order
    inverse = [order.index(column) for column in range(8)]
    return nibbles[:, :, inverse].reshape(packed.shape[0], packed.shape[1] * 8)


def _same_for_every_part(layer_name: str):
    """A writer for a fused layer's group index: its parts (q/k/v, gate/up) share one input, so act-order gives
    them one permutation; parts that disagree cannot share one fused weight."""
    seen = []

    def write(target: torch.Tensor, piece: torch.Tensor, row: int) -> None:
        if seen and not torch.equal(target, piece.to(target.dtype)):
            raise QuantizationConfigError(
                f"the parts of a fused {layer_name} have different g_idx (act-order) tensors; they must share one"
            )
        target.copy_(piece)
        seen.append(True)

    return write


class Int4LinearMethod(LinearMethod):
    """AWQ (qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N]) or GPTQ (qweight [K/8, N], qzeros [G, N/8],
    scales [G, N], g_idx [K]) weights of one layer."""

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module) -> None:
        from pagerail.worker.layers.linear import new_param

        config, name = self.config, type(layer).__name__
        out_features, in_features = layer.out_features, layer.in_features
        full_in = getattr(layer, "input_size", in_features)  # row-parallel layers split their inputs
        parts = getattr(layer, "local_sizes", None) or (
            [layer.q_size, layer.kv_size, layer.kv_size] if hasattr(layer, "q_size") else [out_features]
        )
        if any(part % PACK_FACTOR for part in parts):
            raise QuantizationConfigError(
                f"the output slices {parts} of a {name} at tensor_parallel_size={layer.tp.size} are not multiples "
                f"of {PACK_FACTOR}, as 4-bit zero points packed 8 per word need"
            )
        if in_features % PACK_FACTOR:
            raise QuantizationConfigError(f"{in_features} input features per rank of a {name} are not a multiple of 8")
        group = config.group_size if config.group_size != -1 else full_in
        # Act-order group indices point anywhere in the full input, so those scales stay whole on every rank.
        whole_groups = config.desc_act or config.group_size == -1
        if not whole_groups and in_features % group:
            raise QuantizationConfigError(
                f"quantization_config.group_size={config.group_size} does not divide the {in_features} input "
                f"features per rank of a {name} at tensor_parallel_size={layer.tp.size}"
            )
        groups = -(-full_in // group) if whole_groups else in_features // group
        group_dim = None if whole_groups else 0
        dtype = layer.params_dtype
        del layer.weight
        packed_out = out_features // PACK_FACTOR
        if config.method == "awq":
            qweight = new_param((in_features, packed_out), torch.int32, layer.weight_loader, 1, 0, PACK_FACTOR)
        else:
            qweight = new_param((in_features // PACK_FACTOR, out_features), torch.int32, layer.weight_loader, 1, 0)
            qweight.input_pack = PACK_FACTOR
            g_idx = new_param((in_features,), torch.int32, layer.weight_loader, None, 0)
            g_idx.store_rows = _same_for_every_part(type(layer).__name__)
            layer.register_parameter("g_idx", g_idx)
        qzeros = new_param((groups, packed_out), torch.int32, layer.weight_loader, 1, group_dim, PACK_FACTOR, group)
        scales = new_param((groups, out_features), dtype, layer.weight_loader, 1, group_dim, 1, group)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        layer.int4_group = group

    def after_loading(self, layer: nn.Module) -> None:
        g_idx = layer.g_idx.data if hasattr(layer, "g_idx") else None
        qweight, scales, zeros, g_idx = canonical_int4(
            self.config, layer.qweight.data, layer.qzeros.data, layer.scales.data, g_idx, layer.int4_group
        )
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("scales", scales)
        layer.register_buffer("zeros", zeros)
        layer.register_buffer("g_idx", g_idx)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        scales = layer.scales if layer.scales.dtype == x.dtype else layer.scales.to(x.dtype)
        return int4_gemm(x, layer.qweight, scales, layer.zeros, layer.g_idx)


def canonical_int4(
    config: QuantConfig,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's AWQ or GPTQ tensors, as loaded, in int4_layout's form: (qweight int32 [K/8, N], scales [G, N],
    zeros uint8 [G, N], g_idx int32 [K]). `group` is the input rows per scale (K for one group); act-order GPTQ
    keeps its own group indices, checked against the scales."""
    if config.method == "awq":
        qweight = pack_int4(unpack_columns(qweight, AWQ_ORDER))  # [K, N/8] → [K/8, N]
        zeros = unpack_columns(qzeros, AWQ_ORDER)
    else:
        zeros = (unpack_columns(qzeros) + config.zero_offset) & 0xF
    in_features = qweight.shape[0] * PACK_FACTOR
    if config.method == "gptq" and config.desc_act:
        g_idx = g_idx.to(torch.int32)
        groups = scales.shape[0]
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise QuantizationConfigError(f"g_idx points outside the layer's {groups} groups")
    else:
        g_idx = (torch.arange(in_features, device=qweight.device) // group).to(torch.int32)
    return qweight.contiguous(), scales.contiguous(), zeros.to(torch.uint8).contiguous(), g_idx.contiguous()
