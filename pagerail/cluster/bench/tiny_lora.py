"""Random PEFT LoRA adapters for a model directory (tests and benchmarks): adapter_config.json and
adapter_model.safetensors as PEFT saves them, with nonzero B so that each adapter changes the model's output."""

from __future__ import annotations

import json
from pathlib import Path

from pagerail.common.lora import projection_shapes

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_adapter(
    path: str | Path,
    model_dir: str | Path,
    rank: int,
    targets: tuple[str, ...] = ATTENTION + MLP,
    seed: int = 0,
    alpha: float = 16.0,
    scale: float = 0.2,
    **config,
) -> Path:
    """A random adapter of `rank` on `targets` of every layer of the model at `model_dir`; `config` adds
    adapter_config.json settings (use_rslora=True, ...). The same arguments always give the same bytes."""
    import torch
    from safetensors.torch import save_file

    path, model_dir = Path(path), Path(model_dir)
    base = json.loads((model_dir / "config.json").read_text())
    shapes = projection_shapes(base)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base["num_hidden_layers"]):
        for module in targets:
            out_features, in_features = shapes[module]
            block = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "base_model_name_or_path": str(model_dir),
        "bias": "none",
        "task_type": "CAUSAL_LM",
        **config,
    }
    (path / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return path
