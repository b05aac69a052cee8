"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's qk-norm attention with sparse MoE blocks in most layers."""

from __future__ import annotations

from typing import Any

import torch

from pagerail.worker.layers.moe_block import SparseMoeBlock
from pagerail.worker.layers.rotary import RotaryEmbedding
from pagerail.worker.models.llama import LlamaAttention, LlamaMLP
from pagerail.worker.models.moe_common import MoeCausalLM, MoeDecoderLayer
from pagerail.worker.parallel_state import TensorParallelGroup


def is_sparse_layer(config: Any, index: int) -> bool:
    """Qwen2/3-MoE's rule: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return index not in mlp_only and config.num_experts > 0 and (index + 1) % step == 0


def qwen_moe_layer(
    config: Any,
    index: int,
    attention: LlamaAttention,
    tp: TensorParallelGroup,
    dtype: torch.dtype,
    enable_expert_parallel: bool,
) -> MoeDecoderLayer:
    """A Qwen2/3-MoE decoder layer around `attention`: the dense MLP where is_sparse_layer says so, else the sparse
    block (with Qwen2-MoE's shared expert where the config sizes one)."""
    if not is_sparse_layer(config, index):
        return MoeDecoderLayer(config, attention, LlamaMLP(config, tp, dtype), dtype)
    moe = SparseMoeBlock(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        bool(getattr(config, "norm_topk_prob", False)),
        tp,
        dtype,
        enable_expert_parallel,
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
        hidden_act=getattr(config, "hidden_act", "silu"),
    )
    return MoeDecoderLayer(config, attention, moe, dtype)


class Qwen3MoeForCausalLM(MoeCausalLM):
    """Routed experts only (no shared expert); top-k weights renormalised when norm_topk_prob."""

    def __init__(
        self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype, enable_expert_parallel: bool = False
    ) -> None:
        super().__init__()

        def make_layer(index: int, rotary: RotaryEmbedding, window: int | None) -> MoeDecoderLayer:
            attention = LlamaAttention(hf_config, rotary, tp, dtype, window, qk_norm=True)
            return qwen_moe_layer(hf_config, index, attention, tp, dtype, enable_expert_parallel)

        self.build(hf_config, tp, dtype, make_layer)
