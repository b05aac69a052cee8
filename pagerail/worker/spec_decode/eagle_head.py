"""EAGLE and EAGLE-3 draft heads: one decoder layer that drafts from the target's own hidden states.

EAGLE (EAGLE-1, HASS): the head's input at position i is fc([embed(t[i+1]), f_i]), with f_i the target's final
hidden state at i; its output (before any norm) predicts f_{i+1}, and the target's LM head turns it into a token.
EAGLE-3: f_i is fc applied to three of the target's residual-stream states (early, middle and late layers); the
layer's attention reads [input_norm(embed(t[i+1])), hidden_norm(f_i)] (twice the hidden size), and a final norm
and the head's own LM head over a smaller draft vocabulary (mapped to target ids by `d2t`) give the token.

Both published layouts load: EAGLE-1's `layers.0.*` + `fc.*` and EAGLE-3's `midlayer.*` + `fc` + `norm` +
`lm_head` + `d2t` (an optional `model.` prefix is dropped). Missing `embed_tokens` (and EAGLE-1's LM head) are
the target's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagerail.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagerail.worker.layers.lazy_tensor import materialize
from pagerail.worker.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagerail.worker.layers.norm import RMSNorm
from pagerail.worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagerail.worker.models.causal_lm import CausalLM, head_dim_of
from pagerail.worker.models.llama import LlamaAttention, LlamaMLP
from pagerail.worker.parallel_state import SINGLE_RANK


def eagle3_layers(num_target_layers: int, config: Any) -> tuple[int, ...]:
    """The target layers (by index) whose input EAGLE-3's fc reads: the head's own list when its config has
    one, else (2, L // 2, L - 3)."""
    eagle_config = getattr(config, "eagle_config", None) or {}
    given = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    layers = tuple(given) if given else (2, num_target_layers // 2, num_target_layers - 3)
    if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < num_target_layers for i in layers):
        raise ValueError(
            f"speculative_config.model: EAGLE-3 reads three target layers, got {list(layers)} for a target of "
            f"{num_target_layers} layers (eagle_config.eagle_aux_hidden_state_layer_ids)"
        )
    return layers


def head_checkpoint_name(name: str) -> str:
    """A head checkpoint tensor's name in EagleHead's terms."""
    name = name.removeprefix("model.")
    if name.startswith("midlayer."):
        name = "layers.0." + name.removeprefix("midlayer.")
    return name


def check_head_config(config: Any, target_config: Any, eagle3: bool, names: set[str]) -> None:
    """Refuse a head that cannot read this target's hidden states or tokens, naming the field."""
    method = "eagle3" if eagle3 else "eagle"
    target_hidden = target_config.hidden_size
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"speculative_config.model has vocab_size={config.vocab_size}, the target model "
            f"{target_config.vocab_size}: an {method} head must share the target's vocabulary"
        )
    reads = getattr(config, "target_hidden_size", None) or config.hidden_size if eagle3 else config.hidden_size
    if reads != target_hidden:
        field = "target_hidden_size" if eagle3 and getattr(config, "target_hidden_size", None) else "hidden_size"
        raise ValueError(
            f"speculative_config.model has {field}={reads}, the target model hidden_size={target_hidden}: the "
            f"{method} head reads the target's hidden states, so they must match"
        )
    if "embed_tokens.weight" not in names and config.hidden_size != target_hidden:
        raise ValueError(
            f"speculative_config.model has hidden_size={config.hidden_size} and no embed_tokens of its own: it "
            f"would read the target's embeddings of size {target_hidden}"
        )
    if config.num_hidden_layers != 1:
        raise ValueError(
            f"speculative_config.model has num_hidden_layers={config.num_hidden_layers}: {method} heads of one "
            "decoder layer are supported"
        )
    if eagle3 != any(name.startswith("layers.0.hidden_norm") for name in names):
        other = "eagle" if eagle3 else "eagle3"
        raise ValueError(
            f"speculative_config.model is an {other.upper().replace('EAGLE3', 'EAGLE-3')} head (its tensors say so); "
            f"use method {other!r}"
        )


class EagleHead(CausalLM):
    """One EAGLE or EAGLE-3 decoder layer on a single rank, its KV cache bound like a model's."""

    def __init__(self, config: Any, eagle3: bool, dtype: torch.dtype, target_hidden: int, fc_bias: bool) -> None:
        super().__init__()
        self.config, self.tp, self.eagle3 = config, SINGLE_RANK, eagle3
        hidden = config.hidden_size
        self.rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        layer = nn.Module()
        layer.self_attn = LlamaAttention(config, self.rotary, SINGLE_RANK, dtype)
        if eagle3:
            # The attention reads [normed embeddings, normed features]: twice the hidden size.
            attn = layer.self_attn
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            bias = bool(getattr(config, "attention_bias", False))
            heads = config.num_attention_heads
            attn.qkv_proj = QKVParallelLinear(2 * hidden, attn.head_dim, heads, kv_heads, bias, SINGLE_RANK, dtype)
            layer.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            layer.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.fc = ReplicatedLinear(3 * target_hidden, hidden, fc_bias, dtype)
            draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.lm_head = ParallelLMHead(draft_vocab, hidden, SINGLE_RANK, dtype)
            # draft id → target id - draft id, a checkpoint tensor like the weights.
            self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False)
            self.d2t.weight_loader = self._load_d2t
            self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        else:
            self.fc = ReplicatedLinear(2 * hidden, hidden, fc_bias, dtype)
            self.lm_head = ParallelLMHead(config.vocab_size, hidden, SINGLE_RANK, dtype)
        layer.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        layer.mlp = LlamaMLP(config, SINGLE_RANK, dtype)
        self.layers = nn.ModuleList([layer])
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, SINGLE_RANK, dtype)

    def combine(self, target_states: torch.Tensor) -> torch.Tensor:
        """The feature the head reads for a target position: EAGLE-3's fc over the three layers' states (already
        concatenated), EAGLE-1's target final hidden state as it is."""
        return self.fc(target_states) if self.eagle3 else target_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, features: torch.Tensor):
        """(tokens t[i+1], positions i, features f_i) → (the state the LM head reads, the next position's feature)."""
        layer = self.layers[0]
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions)
        if self.eagle3:
            if self.norm_before_residual:
                residual = layer.hidden_norm(features)
                normed = residual
            else:
                residual, normed = features, layer.hidden_norm(features)
            hidden = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        else:
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
            residual = hidden
        hidden = layer.self_attn(rope, hidden, meta)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
        if self.eagle3:
            return self.norm(hidden, residual)
        out = hidden + residual
        return out, out

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """The argmax token of each row, in the target's vocabulary."""
        best = self.lm_head.compute_logits(hidden).argmax(dim=-1)
        if self.eagle3:
            best = best + self.d2t[best]
        return best.tolist()

    @staticmethod
    def _load_d2t(param: nn.Parameter, full, shard_id: object = None) -> None:
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(
                f"speculative_config.model: d2t has shape {tuple(full.shape)}, expected {tuple(param.shape)} "
                "(draft_vocab_size)"
            )
        param.data.copy_(materialize(full).to(torch.long))

    def checkpoint_name(self, hf_name: str) -> tuple[str, object] | None:
        name = head_checkpoint_name(hf_name)
        if name == "t2d":
            return None  # the reverse map: not needed to draft
        return super().checkpoint_name(name)
