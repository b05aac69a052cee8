"""Tiny random-weight transformers checkpoints (Llama, Mistral, Qwen2, Qwen3 and MoE families) saved for tests."""

from __future__ import annotations

from pathlib import Path

TINY_KINDS = ("llama", "llama_tied", "mistral", "qwen2", "qwen3")
# Mixtures of experts: 4 or 8 experts of intermediate size 32 (Mixtral: 128), top-1 to top-4.
MOE_KINDS = ("qwen3_moe", "qwen3_moe_dense", "mixtral", "qwen2_moe")

_COMMON = dict(
    vocab_size=250,  # even but not a multiple of 4, so tp=4 exercises vocab padding
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(kind: str):
    """The transformers config for one of TINY_KINDS; each kind covers a different code path."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        # Untied head and llama3 rope scaling whose band edges fall inside the head_dim=16 frequencies.
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_parameters=rope)
    if kind == "llama_tied":
        return LlamaConfig(**_COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    if kind == "mistral":
        return MistralConfig(**_COMMON, tie_word_embeddings=False, sliding_window=None, head_dim=32)
    if kind == "qwen2":
        rope = dict(rope_type="linear", rope_theta=1000000.0, factor=2.0)
        return Qwen2Config(**_COMMON, tie_word_embeddings=True, rope_parameters=rope)
    if kind == "qwen3":
        return Qwen3Config(**_COMMON, tie_word_embeddings=False, head_dim=16)
    if kind in MOE_KINDS:
        return _moe_config(kind)
    raise ValueError(f"kind must be one of {', '.join(TINY_KINDS + MOE_KINDS)}, got {kind!r}")


def _moe_config(kind: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if kind == "qwen3_moe":
        # 8 experts, top-2, renormalised top-k weights (Qwen3-30B-A3B's norm_topk_prob=true).
        return Qwen3MoeConfig(
            **_COMMON,
            head_dim=16,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    if kind == "qwen3_moe_dense":
        # Layer 0 dense (mlp_only_layers), layer 1 top-1 of 4 experts without renormalisation; tied head.
        return Qwen3MoeConfig(
            **_COMMON,
            head_dim=16,
            tie_word_embeddings=True,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        )
    if kind == "mixtral":
        # Top-2 of 4; a sliding window shorter than the longer test prompts.
        return MixtralConfig(
            **_COMMON, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=24
        )
    # qwen2_moe: top-4 of 8 without renormalisation, plus the sigmoid-gated shared expert and q/k/v biases.
    return Qwen2MoeConfig(
        **_COMMON,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
    )


def make_tiny_model(
    kind: str, path: str | Path, seed: int = 0, vocab_size: int | None = None, num_layers: int | None = None
) -> Path:
    """Save a tiny random `kind` model (config + model.safetensors) into `path` and return it.

    `vocab_size` overrides the tiny vocabulary, e.g. to match a real tokenizer's for tests that send text;
    `num_layers` the number of decoder layers.

    Weights are drawn larger than the default init, norms and biases away from 1 and 0, so that every
    parameter visibly moves the logits and a wrong mapping cannot hide.
    """
    from pagerail.cluster.bench.random_checkpoints import save_random_weights

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(kind)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [config.layer_types[0]] * num_layers
    return save_random_weights(config, path, seed, scale=0.08)
