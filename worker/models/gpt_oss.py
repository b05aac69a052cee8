"""gpt-oss (gpt-oss-20b, gpt-oss-120b) from bf16 checkpoints: attention with biases and per-head sinks, sliding
and full layers alternating, YaRN RoPE, and MoE layers with a biased router and biased clamped-SwiGLU experts."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from worker.layers.attention import AttentionMetadata
from worker.layers.lazy_tensor import LazyTensor, materialize
from worker.layers.linear import ReplicatedLinear
from worker.layers.moe import FusedMoE
from worker.layers.moe_activation import ExpertActivation
from worker.layers.rotary import RotaryEmbedding
from worker.models.llama import LlamaAttention
from worker.models.moe_common import MoeCausalLM, MoeDecoderLayer
from worker.parallel_state import TensorParallelGroup

# "model.layers.3.mlp.experts.gate_up_proj_bias" → ("model.layers.3.mlp.experts", "gate_up_proj_bias")
_EXPERTS_TENSOR = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<name>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$"
)
# The checkpoint's stacked expert tensors → (our parameter, the layout FusedMoE's loader reads them in).
_EXPERT_PARAMS = {
    "gate_up_proj": ("w13_weight", "interleaved_transposed"),
    "gate_up_proj_bias": ("w13_bias", "interleaved"),
    "down_proj": ("w2_weight", "transposed"),
    "down_proj_bias": ("w2_bias", None),
}


class SinkAttention(LlamaAttention):
    """LlamaAttention (q/k/v/o with biases here) whose heads each have a learned sink logit: a softmax term with no
    value, so a head may put its weight nowhere. The sinks are split by head with the query heads."""

    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(config, rotary, tp, dtype, sliding_window)
        self.tp = tp
        # float32 whatever the model's dtype: the kernels read them as float, and a bf16 value converts exactly.
        heads = self.qkv_proj.num_heads_per_rank
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        expected = (self.qkv_proj.num_heads,)
        if tuple(full.shape) != expected:
            raise ValueError(f"sinks have shape {tuple(full.shape)}, expected {expected} (one per attention head)")
        heads = param.shape[0]
        param.data.copy_(materialize(full.narrow(0, self.tp.rank * heads, heads)))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb.apply(q, k, rope)
        return self.o_proj(self.attn(q, k, v, meta, self.sinks))


class GptOssMoeBlock(nn.Module):
    """router(x) (linear with bias, replicated) → top-k → softmax over those k logits → biased experts with the
    clamped SwiGLU, all-reduced once. Parameter names follow the checkpoint: router, experts."""

    def __init__(
        self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, enable_expert_parallel: bool = False
    ) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.num_local_experts
        self.router = ReplicatedLinear(hidden, num_experts, True, dtype)
        activation = ExpertActivation("swiglu_clamped", float(config.swiglu_alpha), float(config.swiglu_limit))
        self.experts = FusedMoE(
            num_experts,
            config.num_experts_per_tok,
            hidden,
            config.intermediate_size,
            tp,
            dtype,
            renormalize=False,
            enable_expert_parallel=enable_expert_parallel,
            has_bias=True,
            activation=activation,
            softmax_after_topk=True,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))


class GptOssForCausalLM(MoeCausalLM):
    """Every layer a MoE layer; layer_types alternate sliding (config.sliding_window) and full attention."""

    def __init__(
        self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype, enable_expert_parallel: bool = False
    ) -> None:
        super().__init__()
        quantization = getattr(hf_config, "quantization_config", None)
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ValueError(
                f"quantization_config (quant_method={method!r}) is not supported for gpt-oss; "
                "only unquantized (bf16, fp16, fp32) checkpoints load"
            )

        def make_layer(index: int, rotary: RotaryEmbedding, window: int | None) -> MoeDecoderLayer:
            attention = SinkAttention(hf_config, rotary, tp, dtype, window)
            moe = GptOssMoeBlock(hf_config, tp, dtype, enable_expert_parallel)
            return MoeDecoderLayer(hf_config, attention, moe, dtype)

        self.build(hf_config, tp, dtype, make_layer)

    def checkpoint_name(self, hf_name: str) -> tuple[str, object] | None:
        match = _EXPERTS_TENSOR.match(hf_name)
        if match:
            param, layout = _EXPERT_PARAMS[match["name"]]
            return f"{match['experts']}.{param}", layout
        return super().checkpoint_name(hf_name)
