"""A small random-weight Llama checkpoint that any server can load: config, safetensors and a matching tokenizer.

Benchmarks of engine overhead need a model whose forward pass is short (GPU-like step times on a CPU), and two
servers compared on it must load byte-identical weights. The tokenizer is the embedded SmolLM2's byte-level BPE
cut down to the model's vocabulary, so token ids, tokenizer and embedding table all agree.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Ids below this in SmolLM2's vocabulary are its 17 special tokens and the 256 byte tokens; every merge comes after.
_SMOLLM2_BASE_TOKENS = 17 + 256


@dataclass(frozen=True)
class TinyLlamaShape:
    """The model's dimensions. The defaults make a decode step of 256 sequences take a few milliseconds on a CPU
    (about 9 ms on two AVX-512 cores at 130 tokens of context), the step time of a serving GPU."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        if self.vocab_size <= _SMOLLM2_BASE_TOKENS:
            raise ValueError(f"vocab_size must exceed {_SMOLLM2_BASE_TOKENS} (the tokenizer's special and byte tokens)")


def hf_config(shape: TinyLlamaShape) -> dict:
    """config.json in the plain Llama form every transformers version (and vLLM) reads."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def random_weights(shape: TinyLlamaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names and shapes; N(0, 0.02) matrices and unit norms keep activations at a sane scale."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = shape.hidden_size // shape.num_heads
    hidden, inter = shape.hidden_size, shape.intermediate_size

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator) * 0.02

    weights = {"model.embed_tokens.weight": normal(shape.vocab_size, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}."
        weights |= {
            prefix + "self_attn.q_proj.weight": normal(shape.num_heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": normal(shape.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": normal(shape.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, shape.num_heads * head_dim),
            prefix + "mlp.gate_proj.weight": normal(inter, hidden),
            prefix + "mlp.up_proj.weight": normal(inter, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    return weights


def trim_tokenizer(source_dir: Path, target_dir: Path, vocab_size: int) -> None:
    """Copy a byte-level BPE tokenizer keeping only ids below `vocab_size` and the merges that build them.

    Merges are applied in order and each adds the next id, so the first ones are exactly those whose result
    survives; every byte stays encodable, so any text still tokenizes.
    """
    tokenizer = json.loads((source_dir / "tokenizer.json").read_text())
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{source_dir}/tokenizer.json is not a BPE tokenizer")
    vocab = {token: index for token, index in model["vocab"].items() if index < vocab_size}
    merges = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    model["vocab"], model["merges"] = vocab, merges
    tokenizer["added_tokens"] = [t for t in tokenizer.get("added_tokens", []) if t["id"] < vocab_size]
    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    shutil.copy(source_dir / "tokenizer_config.json", target_dir / "tokenizer_config.json")


def write_tiny_llama(path: str | Path, shape: TinyLlamaShape = TinyLlamaShape(), seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the trimmed SmolLM2 tokenizer into `path`; returns it.

    The same shape and seed always give the same bytes, so every server and every run loads identical weights.
    """
    from safetensors.torch import save_file

    from pagerail.common.model_source import resolve_model_dir

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
    save_file(random_weights(shape, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    trim_tokenizer(resolve_model_dir(None), path, shape.vocab_size)
    (path / "shape.json").write_text(json.dumps({**asdict(shape), "seed": seed}))
    return path
