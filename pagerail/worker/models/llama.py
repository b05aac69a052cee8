"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) written once for any tensor-parallel size.

Phi-3's checkpoints fuse q/k/v and gate/up already (the fused layers split them on load) and may use LongRoPE."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagerail.common.attention_windows import layer_sliding_windows
from pagerail.worker.layers.activation import SiluAndMul
from pagerail.worker.layers.attention import Attention, AttentionMetadata
from pagerail.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagerail.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagerail.worker.layers.norm import RMSNorm
from pagerail.worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagerail.worker.models.causal_lm import CausalLM, check_head_split, head_dim_of
from pagerail.worker.parallel_state import TensorParallelGroup


class LlamaAttention(nn.Module):
    """qkv projection → optional per-head q/k RMSNorm (Qwen3) → RoPE → paged attention → o projection."""

    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        sliding_window: int | None = None,
        *,
        qkv_bias: bool | None = None,
        qk_norm: bool | None = None,
    ) -> None:
        """`qkv_bias` and `qk_norm` override what the config's model_type implies (for families that reuse this
        attention under another model_type, e.g. Qwen2-MoE's biases and Qwen3-MoE's q/k norms)."""
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        # Qwen2 always has q/k/v biases (its config has no switch); others follow attention_bias.
        attention_bias = bool(getattr(config, "attention_bias", False))
        if qkv_bias is None:
            qkv_bias = attention_bias or config.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, qkv_bias, tp, dtype)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, attention_bias, tp, dtype)
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.has_qk_norm = config.model_type == "qwen3" if qk_norm is None else qk_norm
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.rotary_emb = rotary
        self.attn = Attention(
            self.qkv_proj.num_heads_per_rank,
            self.qkv_proj.num_kv_heads_per_rank,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=sliding_window,
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.has_qk_norm:
            tokens = q.shape[0]
            q = self.q_norm(q.reshape(tokens, -1, self.head_dim)).view(tokens, self.q_size)
            k = self.k_norm(k.reshape(tokens, -1, self.head_dim)).view(tokens, self.kv_size)
        q, k = self.rotary_emb.apply(q, k, rope)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one column-parallel matmul."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' is")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, tp, dtype)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)).

    The residual stream travels beside the hidden states, so each add lands in the following norm: on CUDA
    one fused kernel adds and normalises; on CPU the same add and norm as the plain formulation run, in order.
    """

    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, rotary, tp, dtype, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, tp, dtype)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous layer's MLP output, the residual stream before it) → the same pair for the next layer.

        The first layer gets (embeddings, None). The residual stream is x in `x + attn(norm(x))`.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; parameter names mirror HF's `model.*` checkpoint names."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        # One cos/sin cache shared by every layer: it can be large for long-context models.
        self.rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, tp, dtype, window) for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, meta)
        if residual is None:  # no layers
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    """Llama-family causal LM; Mistral's sliding window comes from its config, per layer."""

    def __init__(self, hf_config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        check_head_split(hf_config, tp)
        self.config = hf_config
        self.tp = tp
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, tp, dtype)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
