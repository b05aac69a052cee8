"""MXFP4 gpt-oss checkpoints in the published layout, written from a 16/32-bit one, with their dequantized twin."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagerail.worker.layers.quantization.mxfp4 import E2M1_VALUES, E8M0_BIAS, MXFP4_BLOCK, dequantize_mxfp4

# What openai/gpt-oss-20b's config.json lists: everything but the experts stays in bf16.
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED}
_DENSE_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts\.)(?P<proj>gate_up_proj|down_proj)$")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) → (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    Each group's scale is the smallest power of two that brings its largest magnitude within e2m1's 6, and each
    value rounds to the nearest e2m1 value (ties to the smaller magnitude's code).
    """
    groups = weight.double().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = groups.abs().amax(dim=-1).clamp_min(2.0**-120)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scales = (exponents + E8M0_BIAS).to(torch.uint8)
    scaled = groups / torch.exp2(exponents)[..., None]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    codes = (scaled[..., None] - table).abs().argmin(dim=-1)  # first of equals: +0 over -0, the smaller magnitude
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, scales


def write_mxfp4_checkpoint(dense_dir: Path, mxfp4_dir: Path, dequantized_dir: Path) -> None:
    """gpt-oss `dense_dir` with its experts quantized into `mxfp4_dir` (blocks [E, out, in/32, 16], scales
    [E, out, in/32], the quantization_config), and the same model with those experts dequantized to fp32 in the
    16/32-bit layout ([E, in, out]) into `dequantized_dir`: the two hold the same weights."""
    with safe_open(str(dense_dir / "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    packed, dequantized = {}, {}
    for name, tensor in tensors.items():
        match = _DENSE_EXPERTS.match(name)
        if match is None:
            packed[name] = dequantized[name] = tensor
            continue
        # The bf16 layout is x @ w, [E, in, out]; MXFP4 blocks run along `in` for each output row.
        blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    config = json.loads((dense_dir / "config.json").read_text())
    for root, weights, extra in (
        (mxfp4_dir, packed, {"quantization_config": QUANTIZATION_CONFIG}),
        (dequantized_dir, dequantized, {}),
    ):
        root.mkdir(parents=True)
        (root / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
