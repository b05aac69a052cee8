"""What the mixture-of-experts families share: the decoder built around any MLP, and per-expert checkpoint loading."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagerail.common.attention_windows import layer_sliding_windows
from pagerail.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagerail.worker.layers.moe import FusedMoE
from pagerail.worker.layers.norm import RMSNorm
from pagerail.worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagerail.worker.models.causal_lm import CausalLM, check_head_split, head_dim_of
from pagerail.worker.models.llama import LlamaDecoderLayer, LlamaModel
from pagerail.worker.parallel_state import TensorParallelGroup

# "model.layers.3.mlp.experts.7.gate_proj.weight" → ("model.layers.3.mlp", "7", "gate_proj")
_EXPERT_TENSOR = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# transformers' own stacked layout: "model.layers.3.mlp.experts.gate_up_proj" [E, 2*I, H], ".down_proj" [E, H, I]
_STACKED_TENSOR = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_STACKED_PARAMS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}

# (layer index, shared rotary table, that layer's sliding window) → the decoder layer.
LayerFactory = Callable[[int, RotaryEmbedding, "int | None"], nn.Module]


class MoeDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer's pre-norm residual block (and its forward) around a given attention and MLP module."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module, dtype: torch.dtype) -> None:
        # Skips LlamaDecoderLayer.__init__, which would build a dense LlamaMLP; the attributes are the ones its
        # forward reads.
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp


class MoeModel(LlamaModel):
    """LlamaModel (and its forward) whose decoder layers come from `make_layer`, one per layer index."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, make_layer: LayerFactory) -> None:
        # Skips LlamaModel.__init__, which would build Llama layers; same attributes as there.
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        self.layers = nn.ModuleList(
            make_layer(index, self.rotary, window) for index, window in enumerate(layer_sliding_windows(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class MoeCausalLM(CausalLM):
    """A causal LM whose MLPs are (some or all) SparseMoeBlocks; loads per-expert checkpoint tensors.

    Subclasses set `expert_projections` (checkpoint projection name → gate/up/down) and, when the checkpoint
    names the block other than "mlp", `checkpoint_block`; our modules are always called `mlp`.
    """

    supports_expert_parallel = True
    expert_projections: dict[str, str] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    checkpoint_block = "mlp"

    def build(self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype, make_layer: LayerFactory) -> None:
        """Embedding, layers from `make_layer`, final norm and LM head (tied when the config says so)."""
        check_head_split(hf_config, tp)
        self.config = hf_config
        self.tp = tp
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = MoeModel(hf_config, tp, dtype, make_layer)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_name(self, hf_name: str) -> tuple[str, object] | None:
        if self.checkpoint_block != "mlp":
            hf_name = hf_name.replace(f".{self.checkpoint_block}.", ".mlp.")
        match = _EXPERT_TENSOR.match(hf_name)
        if match and match["proj"] in self.expert_projections:
            part = self.expert_projections[match["proj"]]
            param = "w2_weight" if part == "down" else "w13_weight"
            return f"{match['block']}.experts.{param}", (int(match["expert"]), part)
        match = _STACKED_TENSOR.match(hf_name)
        if match:
            return f"{match['block']}.experts.{_STACKED_PARAMS[match['proj']]}", None
        return super().checkpoint_name(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """CausalLM.load_weights, with the checkpoint tensor named in any error, and every expert checked."""
        current: list[str | None] = [None]

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                current[0] = name
                yield name, tensor
            current[0] = None  # errors after the last tensor (missing ones) are about no tensor in particular

        try:
            loaded = super().load_weights(tracked())
        except ValueError as exc:
            if current[0] is None or current[0] in str(exc):
                raise
            raise ValueError(f"checkpoint tensor {current[0]!r}: {exc}") from exc
        self._check_experts_complete()
        return loaded

    def _check_experts_complete(self) -> None:
        # The base check sees a stacked parameter as loaded once any expert's tensor reached it.
        names = {part: proj for proj, part in self.expert_projections.items()}
        missing = []
        for module_name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                block = module_name.removesuffix(".experts").removesuffix(".mlp") + f".{self.checkpoint_block}"
                missing += [f"{block}.experts.{e}.{names[part]}.weight" for e, part in module.missing_parts()]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} expert tensors: {shown}")
