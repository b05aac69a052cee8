"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from typing import Any

import torch

from pagerail.worker.layers.rotary import RotaryEmbedding
from pagerail.worker.models.llama import LlamaAttention
from pagerail.worker.models.moe_common import MoeCausalLM, MoeDecoderLayer
from pagerail.worker.models.qwen3_moe import qwen_moe_layer
from pagerail.worker.parallel_state import TensorParallelGroup


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Top-k weights renormalised only when norm_topk_prob (off by default); dense layers per mlp_only_layers."""

    def __init__(
        self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype, enable_expert_parallel: bool = False
    ) -> None:
        super().__init__()

        def make_layer(index: int, rotary: RotaryEmbedding, window: int | None) -> MoeDecoderLayer:
            # q/k/v biases (the output projection none) whatever the config's attention_bias says.
            qkv_bias = bool(getattr(hf_config, "qkv_bias", True) or getattr(hf_config, "attention_bias", False))
            attention = LlamaAttention(hf_config, rotary, tp, dtype, window, qkv_bias=qkv_bias)
            return qwen_moe_layer(hf_config, index, attention, tp, dtype, enable_expert_parallel)

        self.build(hf_config, tp, dtype, make_layer)
