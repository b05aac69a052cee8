"""gpt-oss (gpt-oss-20b, gpt-oss-120b), bf16 or with MXFP4 experts: attention with biases and per-head sinks, sliding
and full layers alternating, YaRN RoPE, and MoE layers with a biased router and biased clamped-SwiGLU experts."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagerail.worker.layers.attention import AttentionMetadata
from pagerail.worker.layers.lazy_tensor import LazyTensor, materialize
from pagerail.worker.layers.linear import ReplicatedLinear
from pagerail.worker.layers.moe import FusedMoE
from pagerail.worker.layers.moe_activation import ExpertActivation
from pagerail.worker.layers.moe_mxfp4 import Mxfp4FusedMoE
from pagerail.worker.layers.quantization.config import quant_config_from_hf
from pagerail.worker.layers.quantization.context import building_config
from pagerail.worker.layers.rotary import RotaryEmbedding
from pagerail.worker.models.llama import LlamaAttention
from pagerail.worker.models.moe_common import MoeCausalLM, MoeDecoderLayer
from pagerail.worker.parallel_state import TensorParallelGroup

# "model.layers.3.mlp.experts.gate_up_proj_bias" → ("model.layers.3.mlp.experts", "gate_up_proj_bias")
_EXPERTS_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<name>(gate_up|down)_proj(_bias|_blocks|_scales)?)$")
# The checkpoint's stacked expert tensors → (our parameter, the layout FusedMoE's loader reads them in).
_EXPERT_PARAMS = {
    "gate_up_proj": ("w13_weight", "interleaved_transposed"),
    "gate_up_proj_bias": ("w13_bias", "interleaved"),
    "down_proj": ("w2_weight", "transposed"),
    "down_proj_bias": ("w2_bias", None),
    # MXFP4 checkpoints (openai/gpt-oss-20b, -120b): [E, out, in/32, 16] code bytes and [E, out, in/32] scales.
    "gate_up_proj_blocks": ("w13_blocks", None),
    "gate_up_proj_scales": ("w13_scales", None),
    "down_proj_blocks": ("w2_blocks", None),
    "down_proj_scales": ("w2_scales", None),
}


def expert_format(hf_config: Any) -> str | None:
    """ "mxfp4" when the checkpoint's experts are MXFP4 (its quantization_config says so), None for 16/32-bit ones.

    Any other quantization_config is refused: gpt-oss ships its experts in MXFP4 and nothing else in 4 or 8 bits.
    """
    if not getattr(hf_config, "quantization_config", None):
        return None
    # The loader's setting when it passes one down; the checkpoint's own otherwise.
    config = building_config() or quant_config_from_hf(hf_config)
    if config.method != "mxfp4":
        raise ValueError(
            f"quantization_config (quant_method={config.checkpoint_method or config.method!r}) is not supported for "
            "gpt-oss; unquantized (bf16, fp16, fp32) checkpoints and MXFP4 experts (quant_method='mxfp4') load"
        )
    return "mxfp4"


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
        self,
        config: Any,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        enable_expert_parallel: bool = False,
        weight_format: str | None = None,
    ) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.num_local_experts
        self.router = ReplicatedLinear(hidden, num_experts, True, dtype)
        activation = ExpertActivation("swiglu_clamped", float(config.swiglu_alpha), float(config.swiglu_limit))
        experts_class = Mxfp4FusedMoE if weight_format == "mxfp4" else FusedMoE
        self.experts = experts_class(
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
        self.weight_format = weight_format = expert_format(hf_config)

        def make_layer(index: int, rotary: RotaryEmbedding, window: int | None) -> MoeDecoderLayer:
            attention = SinkAttention(hf_config, rotary, tp, dtype, window)
            moe = GptOssMoeBlock(hf_config, tp, dtype, enable_expert_parallel, weight_format)
            return MoeDecoderLayer(hf_config, attention, moe, dtype)

        self.build(hf_config, tp, dtype, make_layer)

    def checkpoint_name(self, hf_name: str) -> tuple[str, object] | None:
        match = _EXPERTS_TENSOR.match(hf_name)
        if match:
            if self.weight_format == "mxfp4" and match["name"] in ("gate_up_proj", "down_proj"):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} holds 16/32-bit experts, but quantization_config says mxfp4, "
                    f"whose experts are {match['name']}_blocks and {match['name']}_scales"
                )
            param, layout = _EXPERT_PARAMS[match["name"]]
            return f"{match['experts']}.{param}", layout
        return super().checkpoint_name(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """MoeCausalLM.load_weights, then the MXFP4 experts finished (dequantized where no kernel reads them), so the
        model is complete whoever loads it; after_loading is idempotent, a loader may call it again."""
        loaded = super().load_weights(weights)
        for module in self.modules():
            if isinstance(module, Mxfp4FusedMoE):
                module.after_loading()
        return loaded
