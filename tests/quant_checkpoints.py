"""Writes quantized copies of a checkpoint in the published layouts (fp8 per-tensor, compressed-tensors per-channel,
fp8 block-wise, AWQ, GPTQ with and without act-order), each with its dequantized fp32 twin as the reference."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block", "awq", "gptq", "gptq_act")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Block scales of 16 output rows by 32 inputs: every tiny model's projection slices line up with them at TP 2.
BLOCK = (16, 32)
GROUP = 32
# Projections a quantized checkpoint stores quantized (attention, dense and expert MLPs); routers, norms,
# embeddings and the LM head stay in full precision, as published checkpoints keep them.
_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def write_quantized(source: Path, target: Path, reference: Path, fmt: str, seed: int = 0) -> None:
    """`target`: `source` quantized in `fmt`; `reference`: the same weights dequantized, in fp32."""
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(source / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _QUANTIZED.search(name):
            quantized[name] = dequantized[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        # Projections that read the same input (q/k/v, gate/up) get the same act-order permutation, as GPTQ
        # derives it from that input's statistics.
        shared_input = re.sub(r"(q_proj|k_proj|v_proj)$", "qkv", re.sub(r"(gate_proj|up_proj)$", "gate_up", prefix))
        generator.manual_seed(seed + sum(map(ord, shared_input)))
        parts, weight = _quantize(tensor.float(), fmt, generator)
        quantized.update({prefix + suffix: value for suffix, value in parts.items()})
        dequantized[name] = weight
    for path, weights in ((target, quantized), (reference, dequantized)):
        path.mkdir(parents=True, exist_ok=True)
        for extra in source.iterdir():
            if extra.name != "model.safetensors":
                shutil.copy(extra, path / extra.name)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (target / "config.json").write_text(json.dumps(config))


def quantization_config(fmt: str) -> dict:
    if fmt == "fp8_tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    if fmt == "fp8_channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        group = {"weights": weights, "input_activations": activations, "targets": ["Linear"]}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": fmt == "gptq_act",
        "sym": False,
        "checkpoint_format": "gptq",
    }


def _quantize(weight: torch.Tensor, fmt: str, generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """(checkpoint tensors by suffix, the dequantized [out, in] weight) for one [out, in] weight."""
    if fmt == "fp8_tensor":
        scale = weight.abs().max() / FP8_MAX
        q = (weight / scale).to(FP8)
        return {".weight": q, ".weight_scale": scale.reshape(())}, q.float() * scale
    if fmt == "fp8_channel":
        scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
        q = (weight / scale).to(FP8)
        return {".weight": q, ".weight_scale": scale}, q.float() * scale
    if fmt == "fp8_block":
        rows, cols = weight.shape
        grid = torch.zeros(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        expanded = torch.empty_like(weight)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                block = weight[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
                grid[i, j] = block.abs().max() / FP8_MAX
                expanded[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = grid[i, j]
        q = (weight / expanded).to(FP8)
        return {".weight": q, ".weight_scale_inv": grid}, q.float() * expanded
    return _quantize_int4(weight, fmt, generator)


def _quantize_int4(weight: torch.Tensor, fmt: str, generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    out_features, in_features = weight.shape
    groups = in_features // GROUP
    if fmt == "gptq_act":
        # Act-order: input rows are quantized in a permuted order, group by group of that order.
        order = torch.randperm(in_features, generator=generator)
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[order] = (torch.arange(in_features) // GROUP).to(torch.int32)
    else:
        g_idx = (torch.arange(in_features) // GROUP).to(torch.int32)
    w = weight.t()  # [in, out]
    scales = torch.empty(groups, out_features)
    zeros = torch.empty(groups, out_features, dtype=torch.int64)
    for group in range(groups):
        rows = w[g_idx == group]
        low, high = rows.min(dim=0).values.clamp(max=0), rows.max(dim=0).values.clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-6).half().float()
        scales[group] = scale
        zeros[group] = torch.round(-low / scale).clamp(0, 15).long()
    zeros[0, 0], zeros[0, 1] = 0, 15  # both ends of the zero point range
    values = torch.clamp(torch.round(w / scales[g_idx]) + zeros[g_idx], 0, 15).long()
    dequantized = ((values - zeros[g_idx]).float() * scales[g_idx]).t().contiguous()
    scales16 = scales.half()
    if fmt == "awq":
        parts = {
            ".qweight": _pack_columns(values, _AWQ_ORDER),
            ".qzeros": _pack_columns(zeros, _AWQ_ORDER),
            ".scales": scales16,
        }
        return parts, dequantized
    parts = {
        ".qweight": _pack_columns(values.t().contiguous(), tuple(range(8))).t().contiguous(),
        # GPTQ v1 stores each zero point minus one (in 4 bits, so 0 is stored as 15).
        ".qzeros": _pack_columns((zeros - 1) & 0xF, tuple(range(8))),
        ".scales": scales16,
        ".g_idx": g_idx,
    }
    return parts, dequantized


def _pack_columns(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int [R, C] of 0..15 → int32 [R, C/8]; nibble i of each word holds column order[i] of its eight."""
    rows, cols = values.shape
    grouped = values.reshape(rows, cols // 8, 8).long()
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, column in enumerate(order):
        words |= grouped[:, :, column] << (4 * nibble)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
