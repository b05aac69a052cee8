"""Random-weight checkpoints of known shapes (a small Qwen3, SmolLM2-135M) for checks that need no real weights."""

from __future__ import annotations

from pathlib import Path

import torch

# SmolLM2-135M's architecture, for a random checkpoint of its shape when the embedded weights are absent.
_SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def random_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint whose logits are peaked enough for greedy decoding to mean something."""
    from transformers import LlamaConfig, Qwen3Config

    if kind == "qwen3":
        config = Qwen3Config(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        config = LlamaConfig(**_SMOLLM2_SHAPE)
    return save_random_weights(config, path, seed, scale=0.05)


def save_random_weights(config, path: Path, seed: int, scale: float) -> Path:
    """A transformers `config`'s model with seeded weights, saved as safetensors into `path`.

    Weights are N(0, scale²), wider than the default init, and norms N(1, 0.01): every weight moves the logits.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else scale * noise)
    model.save_pretrained(path, safe_serialization=True)
    return path


def embedded_or_shaped(workdir: Path) -> tuple[str, Path]:
    """The embedded SmolLM2 when its package is installed, else a random checkpoint of its shape."""
    try:
        from pagerail.common.model_source import resolve_model_dir

        return "smollm2-135m-instruct", resolve_model_dir(None)
    except Exception as exc:  # the weights ship in an optional package; without it the shape still runs
        print(f"embedded model unavailable ({type(exc).__name__}: {exc}); using a random SmolLM2-shaped checkpoint")
        return "smollm2-shaped-random", random_checkpoint("smollm2", workdir / "smollm2-shaped")
