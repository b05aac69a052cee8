"""What every decoder-only model shares: cache geometry, logits, and loading a Hugging Face checkpoint by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagerail.worker.layers.attention import Attention, AttentionMetadata
from pagerail.worker.layers.embedding import ParallelLMHead
from pagerail.worker.layers.lazy_tensor import materialize
from pagerail.worker.parallel_state import TensorParallelGroup

# HF checkpoint projection name → (our fused parameter's module name, shard id inside it).
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# A layer's fp8 KV cache scales as checkpoints spell them after ".self_attn." (vLLM accepts the same) → which of
# its Attention's scales they set; "kv_scale", one scale for both, is the older form. A query scale is for fp8
# attention arithmetic, which this engine does not do (queries stay in the compute dtype): read and dropped.
KV_SCALE_NAMES = {
    "k_scale": ("k_scale",),
    "v_scale": ("v_scale",),
    "attn.k_scale": ("k_scale",),
    "attn.v_scale": ("v_scale",),
    "k_proj.output_scale": ("k_scale",),
    "v_proj.output_scale": ("v_scale",),
    "k_proj.k_scale": ("k_scale",),
    "v_proj.v_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),
    "q_scale": (),
    "attn.q_scale": (),
    "q_proj.output_scale": (),
}


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_head_split(config: Any, tp: TensorParallelGroup) -> None:
    """Checked before any layer is built, so the message names the model field rather than a layer argument."""
    if config.num_attention_heads % tp.size:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not divisible by tensor_parallel_size={tp.size}"
        )


class CausalLM(nn.Module):
    """A causal LM over a flat batch of tokens from many requests; KV caches live in its Attention modules.

    Subclasses build `self.model` (whose forward maps (input_ids, positions, meta) to final hidden states) and
    `self.lm_head`, and map checkpoint names in `checkpoint_name`.
    """

    config: Any
    tp: TensorParallelGroup
    model: nn.Module
    lm_head: ParallelLMHead
    tie_word_embeddings: bool = False
    # Parameters filled from elsewhere than this checkpoint (an EAGLE head's borrowed embeddings): never missing.
    loaded_elsewhere: frozenset[str] = frozenset()

    @property
    def num_layers(self) -> int:
        return len(self.attention_layers())

    @property
    def head_dim(self) -> int:
        return self.attention_layers()[0].head_dim

    @property
    def num_heads_per_rank(self) -> int:
        return self.attention_layers()[0].num_heads

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.attention_layers()[0].num_kv_heads

    def attention_layers(self) -> list[Attention]:
        """The Attention modules in layer order; the worker binds one KV cache shard to each."""
        return [module for module in self.modules() if isinstance(module, Attention)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] long → final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden_size] → logits [N, vocab_size] in float32 on rank 0 (the sampling rank), else None."""
        return self.lm_head.compute_logits(hidden)

    def checkpoint_name(self, hf_name: str) -> tuple[str, object] | None:
        """(our parameter name, shard id inside it) for a checkpoint tensor, or None for one this model skips."""
        if "rotary_emb.inv_freq" in hf_name or "rotary_emb.cos_cached" in hf_name:
            return None  # RoPE tables are recomputed from the config
        if hf_name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # the LM head shares the embedding, which the checkpoint also holds
        prefix, found, scale_name = hf_name.rpartition(".self_attn.")
        if found and scale_name in KV_SCALE_NAMES:
            # "model.layers.3.self_attn.k_proj.output_scale" → ("model.layers.3.self_attn.attn", ("k_scale",))
            return (f"{prefix}.self_attn.attn", KV_SCALE_NAMES[scale_name]) if KV_SCALE_NAMES[scale_name] else None
        # "model.layers.3.self_attn.k_proj.weight" → ("model.layers.3.self_attn.qkv_proj.weight", "k")
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in FUSED_PROJECTIONS:
            fused, shard_id = FUSED_PROJECTIONS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard_id
        return hf_name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load full (unsharded) HF checkpoint tensors; each layer keeps its rank's slice. Returns loaded names."""
        params = dict(self.named_parameters(remove_duplicate=False))
        attention = {name: module for name, module in self.named_modules() if isinstance(module, Attention)}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            mapped = self.checkpoint_name(hf_name)
            if mapped is None:
                continue
            name, shard_id = mapped
            if name in attention:  # fp8 KV cache scales: optional, so never counted as missing when absent
                set_kv_scales(attention[name], shard_id, tensor, hf_name)
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            param.weight_loader(param, tensor, shard_id)
            loaded.add(name)
        if self.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded - self.loaded_elsewhere)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
        return loaded


def set_kv_scales(layer: Attention, names: tuple[str, ...], tensor: torch.Tensor, hf_name: str) -> None:
    """Copy a checkpoint's KV cache scale into `layer`'s k_scale/v_scale buffers (`names`). The cache keeps one
    scale per tensor: a per-head scale is reduced to its largest entry, which keeps every head's values in range.
    Every rank reads the same whole scale, so tensor-parallel shards agree."""
    value = materialize(tensor).to(torch.float32)
    if value.numel() == 0 or not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
        raise ValueError(f"checkpoint tensor {hf_name!r}: a KV cache scale must be finite and > 0")
    for name in names:
        getattr(layer, name).fill_(value.max().item())
