"""EAGLE and EAGLE-3 draft heads in their published layouts, with random or constructed weights, for a target.

`exact=True` builds heads whose drafts are the target's own greedy tokens, for a target made transparent by
`make_transparent` (every layer adds nothing to the residual stream, the final norm's weight is one): the target's
next token is then a function of its current token alone, and a head that carries the input token's embedding to
the LM head reproduces it. That pins the head's plumbing (token shift, chaining, KV positions) to acceptance 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_transparent(target_dir: Path) -> None:
    """Zero the target's o_proj and down_proj and set its final norm to one, in place."""
    from safetensors.torch import load_file, save_file

    path = Path(target_dir) / "model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias")):
            tensors[name] = torch.zeros_like(tensor)
        elif name == "model.norm.weight":
            tensors[name] = torch.ones_like(tensor)
    save_file(tensors, str(path), metadata={"format": "pt"})


def make_eagle_head(
    target_dir: Path, path: Path, eagle3: bool, seed: int = 0, exact: bool = False, draft_vocab_size: int | None = None
) -> Path:
    """Save an EAGLE (or EAGLE-3) head for the target in `target_dir` into `path`; returns `path`."""
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    vocab = target["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        # One KV head per query head: an exact EAGLE-3 head carries the whole embedding through its values.
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "attention_bias": bool(eagle3 and exact),
    }
    draft_vocab = draft_vocab_size or vocab
    if eagle3:
        config.update(draft_vocab_size=draft_vocab, target_hidden_size=hidden, norm_before_residual=exact)
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return scale * torch.randn(shape, generator=generator)

    q, kv, inter = heads * head_dim, heads * head_dim, 2 * hidden
    attn_in = 2 * hidden if eagle3 else hidden
    layer = "midlayer" if eagle3 else "layers.0"
    tensors = {
        f"{layer}.self_attn.q_proj.weight": rand(q, attn_in),
        f"{layer}.self_attn.k_proj.weight": rand(kv, attn_in),
        f"{layer}.self_attn.v_proj.weight": rand(kv, attn_in),
        f"{layer}.self_attn.o_proj.weight": rand(hidden, q),
        f"{layer}.post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.1),
        f"{layer}.mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.down_proj.weight": rand(hidden, inter),
    }
    if eagle3:
        tensors.update(
            {
                f"{layer}.input_layernorm.weight": 1.0 + rand(hidden, scale=0.1),
                f"{layer}.hidden_norm.weight": 1.0 + rand(hidden, scale=0.1),
                "norm.weight": 1.0 + rand(hidden, scale=0.1),
                "fc.weight": rand(hidden, 3 * hidden),
                "lm_head.weight": rand(draft_vocab, hidden),
            }
        )
        # The draft vocabulary: every other target id from the top, mapped by offset (d2t) as published heads do.
        ids = torch.arange(vocab)[-draft_vocab:] if draft_vocab < vocab else torch.arange(vocab)
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    else:
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
    if exact:
        _make_exact(tensors, layer, eagle3, hidden, q, target_dir)
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(path) / "model.safetensors"))
    return Path(path)


def _make_exact(tensors: dict, layer: str, eagle3: bool, hidden: int, q: int, target_dir: Path) -> None:
    """Weights under which the head's output is (a positive multiple of) the embedding of its input token."""
    from safetensors.torch import load_file

    zero_out = (f"{layer}.mlp.down_proj.weight",)
    for name in zero_out:
        tensors[name] = torch.zeros_like(tensors[name])
    eye = torch.eye(hidden)
    if not eagle3:
        # fc([e, f]) = e; attention adds nothing; the output e goes to the target's LM head.
        tensors["fc.weight"] = torch.cat([eye, torch.zeros(hidden, hidden)], dim=1)
        tensors[f"{layer}.self_attn.o_proj.weight"] = torch.zeros(hidden, q)
        return
    # Features are normed to zero (hidden_norm weight 0, residual taken after the norm); q and k are one large
    # constant, so each row attends to itself; v carries the normed embedding, o_proj passes it on, and the final
    # norm and a copy of the target's LM head turn it into the target's next token.
    target = load_file(str(Path(target_dir) / "model.safetensors"))
    lm_head = target.get("lm_head.weight", target["model.embed_tokens.weight"])
    tensors["lm_head.weight"] = lm_head[-tensors["lm_head.weight"].shape[0] :].clone()
    tensors[f"{layer}.hidden_norm.weight"] = torch.zeros(hidden)
    tensors[f"{layer}.input_layernorm.weight"] = torch.ones(hidden)
    tensors[f"{layer}.post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["norm.weight"] = torch.ones(hidden)
    tensors["fc.weight"] = torch.zeros(hidden, 3 * hidden)
    for proj in ("q_proj", "k_proj"):
        tensors[f"{layer}.self_attn.{proj}.weight"] = torch.zeros(q, 2 * hidden)
        tensors[f"{layer}.self_attn.{proj}.bias"] = torch.full((q,), 6.0)
    tensors[f"{layer}.self_attn.v_proj.weight"] = torch.cat([eye, torch.zeros(hidden, hidden)], dim=1)
    tensors[f"{layer}.self_attn.v_proj.bias"] = torch.zeros(q)
    tensors[f"{layer}.self_attn.o_proj.weight"] = torch.eye(hidden, q)
    tensors[f"{layer}.self_attn.o_proj.bias"] = torch.zeros(hidden)
