"""Mixtral (8x7B, 8x22B): Mistral's attention, with its sliding window, and a sparse MoE block in every layer."""

from __future__ import annotations

from typing import Any

import torch

from pagerail.worker.layers.moe_block import SparseMoeBlock
from pagerail.worker.layers.rotary import RotaryEmbedding
from pagerail.worker.models.llama import LlamaAttention
from pagerail.worker.models.moe_common import MoeCausalLM, MoeDecoderLayer
from pagerail.worker.parallel_state import TensorParallelGroup


class MixtralForCausalLM(MoeCausalLM):
    """Top-k weights always renormalised; experts named w1 (gate), w3 (up), w2 (down) under block_sparse_moe."""

    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}
    checkpoint_block = "block_sparse_moe"

    def __init__(
        self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype, enable_expert_parallel: bool = False
    ) -> None:
        super().__init__()

        def make_layer(index: int, rotary: RotaryEmbedding, window: int | None) -> MoeDecoderLayer:
            attention = LlamaAttention(hf_config, rotary, tp, dtype, window)
            moe = SparseMoeBlock(
                hf_config.hidden_size,
                hf_config.num_local_experts,
                hf_config.num_experts_per_tok,
                hf_config.intermediate_size,
                True,
                tp,
                dtype,
                enable_expert_parallel,
                hidden_act=getattr(hf_config, "hidden_act", "silu"),
            )
            return MoeDecoderLayer(hf_config, attention, moe, dtype)

        self.build(hf_config, tp, dtype, make_layer)
