"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from typing import Any

import torch

from worker.layers.linear import QKVParallelLinear
from worker.layers.rotary import RotaryEmbedding
from worker.models.llama import LlamaAttention
from worker.models.moe_common import MoeCausalLM, MoeDecoderLayer
from worker.models.qwen3_moe import qwen_moe_layer
from worker.parallel_state import TensorParallelGroup


class QkvBiasAttention(LlamaAttention):
    """LlamaAttention whose q/k/v projection has a bias when config.qkv_bias says so (the output one never)."""

    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(config, rotary, tp, dtype, sliding_window)
        if getattr(config, "qkv_bias", True) and self.qkv_proj.bias is None:
            old = self.qkv_proj
            self.qkv_proj = QKVParallelLinear(
                config.hidden_size, old.head_dim, old.num_heads, old.num_kv_heads, True, tp, dtype
            )


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Top-k weights renormalised only when norm_topk_prob (off by default); dense layers per mlp_only_layers."""

    def __init__(
        self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype, enable_expert_parallel: bool = False
    ) -> None:
        super().__init__()

        def make_layer(index: int, rotary: RotaryEmbedding, window: int | None) -> MoeDecoderLayer:
            attention = QkvBiasAttention(hf_config, rotary, tp, dtype, window)
            return qwen_moe_layer(hf_config, index, attention, tp, dtype, enable_expert_parallel)

        self.build(hf_config, tp, dtype, make_layer)
