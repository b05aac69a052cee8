"""Gemma 2 and Gemma 3 (text): interleaved sliding and global layers, scaled embeddings, (1 + w) norms around
both sublayers, a gelu-tanh MLP, Gemma 2's logit softcaps and Gemma 3's q/k norms and per-kind RoPE."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagerail.common.attention_windows import layer_sliding_windows
from pagerail.worker.layers.activation import GeluTanhAndMul
from pagerail.worker.layers.attention import Attention, AttentionMetadata
from pagerail.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagerail.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagerail.worker.layers.norm import GemmaRMSNorm
from pagerail.worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagerail.worker.models.causal_lm import CausalLM, check_head_split, head_dim_of
from pagerail.worker.parallel_state import TensorParallelGroup

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def _layer_types(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def _rope_for(config: Any, layer_type: str) -> dict[str, Any]:
    """Gemma 3 keeps one RoPE setting per layer kind (local layers spin faster); Gemma 2 one for all."""
    nested = getattr(config, "rope_parameters", None) or {}
    if layer_type in nested:
        return rope_parameters(_Flat(nested[layer_type], config))
    return rope_parameters(config)


class _Flat:
    """A config view whose rope_parameters are one layer kind's, for rope_parameters() to normalise."""

    def __init__(self, params: dict[str, Any], config: Any) -> None:
        self.rope_parameters = params
        self.max_position_embeddings = config.max_position_embeddings


class GemmaAttention(nn.Module):
    """qkv → (Gemma 3) per-head q/k norms → RoPE → paged attention, scaled by query_pre_attn_scalar → o."""

    def __init__(
        self, config: Any, rotary: RotaryEmbedding, tp: TensorParallelGroup, dtype: torch.dtype, window: int | None
    ) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias, tp, dtype)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias, tp, dtype)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.has_qk_norm = config.model_type == "gemma3_text"
        if self.has_qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.rotary_emb = rotary
        self.attn = Attention(
            self.qkv_proj.num_heads_per_rank,
            self.qkv_proj.num_kv_heads_per_rank,
            self.head_dim,
            float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=window,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.has_qk_norm:
            tokens = q.shape[0]
            q = self.q_norm(q.reshape(tokens, -1, self.head_dim)).reshape(tokens, self.q_size)
            k = self.k_norm(k.reshape(tokens, -1, self.head_dim)).reshape(tokens, self.kv_size)
        q, k = self.rotary_emb.apply(q.contiguous(), k.contiguous(), rope)
        return self.o_proj(self.attn(q, k, v, meta))


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one column-parallel matmul."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation={act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], False, tp, dtype)
        self.act_fn = GeluTanhAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """h = x + post_attn_norm(attn(norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(
        self, config: Any, rotary: RotaryEmbedding, tp: TensorParallelGroup, dtype: torch.dtype, window: int | None
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_kind = "sliding_attention" if window is not None else "full_attention"
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = GemmaAttention(config, rotary, tp, dtype, window)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GemmaMLP(config, tp, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata):
        h = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers with one RoPE table per layer kind, final norm."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5).to(dtype), persistent=False)
        head_dim = head_dim_of(config)
        windows = layer_sliding_windows(config)
        kinds = _layer_types(config)
        self.rotaries = nn.ModuleDict(
            {
                kind: RotaryEmbedding(head_dim, config.max_position_embeddings, _rope_for(config, kind))
                for kind in sorted(set(kinds))
            }
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, self.rotaries[kind], tp, dtype, window)
            for kind, window in zip(kinds, windows, strict=True)
        )
        self.layer_rope = kinds
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        tables = {kind: rotary.tables(positions) for kind, rotary in self.rotaries.items()}
        for kind, layer in zip(self.layer_rope, self.layers, strict=True):
            hidden = layer(tables[kind], hidden, meta)
        return self.norm(hidden)


class GemmaForCausalLM(CausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text-only checkpoints)."""

    def __init__(self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        check_head_split(hf_config, tp)
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported for generation")
        self.config = hf_config
        self.tp = tp
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.final_logit_softcap = getattr(hf_config, "final_logit_softcapping", None)
        self.model = GemmaModel(hf_config, tp, dtype)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits as the base class computes them, then Gemma 2's final softcap: cap * tanh(logits / cap)."""
        logits = super().compute_logits(hidden)
        if logits is None or not self.final_logit_softcap:
            return logits
        cap = float(self.final_logit_softcap)
        return torch.tanh(logits / cap).mul_(cap)
