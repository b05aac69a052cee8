"""Routed experts loaded from MXFP4 blocks and scales: packed for the Triton kernel on CUDA, dense on the CPU."""

from __future__ import annotations

import torch

from pagerail.worker.layers.lazy_tensor import LazyTensor, materialize
from pagerail.worker.layers.moe import FusedMoE, _triton_moe, _window
from pagerail.worker.layers.quantization.mxfp4 import (
    BYTES_PER_BLOCK,
    MXFP4_BLOCK,
    check_mxfp4_split,
    deinterleave_rows,
    dequantize_mxfp4,
)
from pagerail.worker.layers.triton_common import triton_available

# Our packed parameters → (the checkpoint tensor's name, for messages; the expert parts it holds).
PACKED_PARAMS = {
    "w13_blocks": ("gate_up_proj_blocks", ("gate", "up")),
    "w13_scales": ("gate_up_proj_scales", ()),
    "w2_blocks": ("down_proj_blocks", ("down",)),
    "w2_scales": ("down_proj_scales", ()),
}


class Mxfp4FusedMoE(FusedMoE):
    """FusedMoE whose expert weights load as gpt-oss's MXFP4 tensors, split like the dense ones:

        w13_blocks uint8 [E_local, 2*I_local, H/32, 16], w13_scales [E_local, 2*I_local, H/32]
        w2_blocks  uint8 [E_local, H, I_local/32, 16],   w2_scales  [E_local, H, I_local/32]

    Checkpoint gate_up rows come interleaved (gate j, up j); they are stored gate rows first, then up rows, as
    FusedMoE's w13. Under the column split each rank's down_proj columns are whole 32-value blocks, so
    I / tensor_parallel_size must be a multiple of 32; expert parallelism has no such limit.

    `after_loading` turns the blocks into w13_weight / w2_weight in the model's dtype where no kernel reads MXFP4
    (the CPU path: dequantized once, the packed bytes freed, then FusedMoE's grouped CPU experts run as for bf16).
    On CUDA with Triton the blocks stay packed (a quarter of bf16's bytes) and a grouped GEMM decodes them.
    """

    def expert_weight_shapes(self, dtype: torch.dtype | None) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        self.dtype = dtype or torch.get_default_dtype()
        experts, hidden = self.num_local_experts, self.hidden_size
        check_mxfp4_split("hidden_size", hidden, 1, "tensor_parallel_size")
        parts = 1 if self.expert_parallel else self.tp.size
        check_mxfp4_split("intermediate_size", self.intermediate_size, parts, "tensor_parallel_size")
        hidden_groups, inter_groups = hidden // MXFP4_BLOCK, self.inter_local // MXFP4_BLOCK
        return {
            "w13_blocks": ((experts, 2 * self.inter_local, hidden_groups, BYTES_PER_BLOCK), torch.uint8),
            "w13_scales": ((experts, 2 * self.inter_local, hidden_groups), torch.uint8),
            "w2_blocks": ((experts, hidden, inter_groups, BYTES_PER_BLOCK), torch.uint8),
            "w2_scales": ((experts, hidden, inter_groups), torch.uint8),
        }

    @property
    def packed(self) -> bool:
        """True while the experts are held as MXFP4 blocks (before after_loading, and on CUDA after it)."""
        return "w13_blocks" in self._parameters

    def weight_loader(
        self, param: torch.nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None
    ) -> None:
        name = next((n for n in PACKED_PARAMS if self._parameters.get(n) is param), None)
        if name is None:
            super().weight_loader(param, full, shard_id)
            return
        checkpoint_name, parts = PACKED_PARAMS[name]
        if shard_id is not None:
            raise ValueError(f"{checkpoint_name} loads stacked (shard_id None), got shard_id {shard_id!r}")
        is_w13 = name.startswith("w13")
        expected = self._full_shape(name)
        if tuple(full.shape) != expected:
            raise ValueError(
                f"stacked {checkpoint_name} of all experts has shape {tuple(full.shape)}, expected {expected}"
            )
        if full.dtype != torch.uint8:
            raise ValueError(f"{checkpoint_name} must be uint8, got {full.dtype}")
        mine = _window(full, 0, self.first_expert, self.num_local_experts)
        if is_w13:
            # This rank's gate/up rows [start, start + cols) interleave into one contiguous run of 2 * cols rows.
            rows = materialize(_window(mine, 1, 2 * self.inter_start, 2 * self.inter_local))
            param.data.copy_(deinterleave_rows(rows, dim=1))
        else:
            # Columns [start, start + cols) of down_proj are the groups [start / 32, (start + cols) / 32).
            groups = self.inter_local // MXFP4_BLOCK
            param.data.copy_(materialize(_window(mine, 2, self.inter_start // MXFP4_BLOCK, groups)))
        self.loaded_parts.update((e, p) for e in self.local_experts for p in parts)

    def _full_shape(self, name: str) -> tuple[int, ...]:
        experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        if name.startswith("w13"):
            shape = (experts, 2 * inter, hidden // MXFP4_BLOCK, BYTES_PER_BLOCK)
        else:
            shape = (experts, hidden, inter // MXFP4_BLOCK, BYTES_PER_BLOCK)
        return shape if name.endswith("blocks") else shape[:-1]

    def after_loading(self) -> None:
        """Dequantize into dense w13_weight / w2_weight unless this device runs the MXFP4 kernel. Idempotent."""
        if not self.packed or self.keeps_packed(self.w13_blocks.device):
            return
        w13 = dequantize_mxfp4(self.w13_blocks.data, self.w13_scales.data, self.dtype)
        w2 = dequantize_mxfp4(self.w2_blocks.data, self.w2_scales.data, self.dtype)
        for name in PACKED_PARAMS:
            del self._parameters[name]
        self.add_weight("w13_weight", w13)
        self.add_weight("w2_weight", w2)
        self.attach_expert_views()

    @staticmethod
    def keeps_packed(device: torch.device) -> bool:
        # Only a real GPU gains from packed weights; the CPU interpreter of Triton would only be slower.
        return device.type == "cuda" and triton_available(device) and _triton_moe() is not None

    def compute(self, hidden: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return super().compute(hidden, weights, local_ids)
        if not self.keeps_packed(hidden.device):
            raise RuntimeError("MXFP4 experts run packed only on CUDA with Triton; call after_loading() first")
        from pagerail.worker.layers.triton_moe_mxfp4 import triton_mxfp4_experts

        packed = (self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales)
        return triton_mxfp4_experts(hidden, *packed, weights, local_ids, self.w13_bias, self.w2_bias, self.activation)

    def comm_bytes(self, num_tokens: int) -> int:
        return 0 if self.tp.size == 1 else num_tokens * self.hidden_size * self.dtype.itemsize

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mxfp4 {'packed' if self.packed else 'dequantized'}"
