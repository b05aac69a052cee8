"""LoRA adapters as requests name them (vLLM's LoRARequest) and as PEFT saves them: the config read and checked
without torch, so the head refuses a bad adapter before anything is queued and the ranks load only good ones."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections (PEFT's module names) an adapter may target.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's tensor names: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight.
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_HEADER_LIMIT = 100 << 20


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with: `lora_int_id` (≥ 1) names it inside the engine, `lora_name` to clients."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer of at least 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be the directory of a PEFT adapter")


@dataclass(frozen=True)
class AdapterConfig:
    """What the forward pass needs from adapter_config.json."""

    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) for rsLoRA
    target_modules: tuple[str, ...]


def projection_shapes(text_config: Mapping) -> dict[str, tuple[int, int]]:
    """(output, input) features of each projection an adapter may target, from a Llama-family HF config."""
    hidden = int(text_config["hidden_size"])
    heads = int(text_config["num_attention_heads"])
    kv_heads = int(text_config.get("num_key_value_heads") or heads)
    head_dim = int(text_config.get("head_dim") or hidden // heads)
    inter = int(text_config.get("intermediate_size") or 4 * hidden)
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_adapter(path: str, max_rank: int, shapes: Mapping[str, tuple[int, int]], num_layers: int) -> AdapterConfig:
    """The adapter's config, its weights' names and shapes checked against the model's projections (`shapes`,
    from projection_shapes) without reading the weights; ValueError naming what is wrong."""
    config = read_adapter_config(path, max_rank)
    for name, shape in _tensor_shapes(Path(path) / WEIGHTS_FILE).items():
        layer, module, side = tensor_name_parts(name)
        if layer >= num_layers:
            raise ValueError(f"{WEIGHTS_FILE}: {name!r}: the model has {num_layers} layers")
        if module not in shapes:
            raise ValueError(f"{WEIGHTS_FILE}: {name!r}: the model has no {module}")
        out_features, in_features = shapes[module]
        expected = [config.rank, in_features] if side == "A" else [out_features, config.rank]
        if list(shape) != expected:
            raise ValueError(
                f"{WEIGHTS_FILE}: {name!r} has shape {list(shape)}, expected {expected} for this model and r"
            )
    return config


def tensor_name_parts(name: str) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a PEFT LoRA tensor name; ValueError for any other tensor."""
    match = _TENSOR_NAME.match(name)
    if match is None:
        if "embed_tokens" in name or "lm_head" in name:
            raise ValueError(f"{WEIGHTS_FILE}: {name!r}: embedding and LM-head adapters are not supported")
        raise ValueError(f"{WEIGHTS_FILE}: {name!r} is not a LoRA weight of a projection this server adapts")
    return int(match[1]), match[2], match[3]


def _tensor_shapes(weights: Path) -> dict[str, list[int]]:
    """Each tensor's shape, from a safetensors file's header (its first 8 bytes give the header's length)."""
    try:
        with weights.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > _HEADER_LIMIT:
                raise ValueError(f"{weights.name} has a header of {length} bytes; not a safetensors file")
            header = json.loads(file.read(length))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{weights.name} is not a readable safetensors file: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{weights.name} is not a safetensors file")
    return {
        name: entry.get("shape", [])
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict)
    }


def read_adapter_config(path: str, max_rank: int) -> AdapterConfig:
    """The adapter's config; ValueError naming the setting for what is missing, malformed or not supported."""
    directory = Path(path)
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"lora_path {path!r} holds no {CONFIG_FILE}")
    if not (directory / WEIGHTS_FILE).is_file():
        raise ValueError(f"lora_path {path!r} holds no {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{CONFIG_FILE} of {path!r} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} of {path!r} must be a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type must be 'LORA', got {config.get('peft_type')!r}")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"r = {rank} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    if config.get("use_dora"):
        raise ValueError("use_dora: DoRA adapters are not supported")
    for name in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(name):
            what = "embedding or LM-head weights" if name == "modules_to_save" else "per-layer settings"
            raise ValueError(f"{name}: adapters with {what} are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ValueError("target_modules: a regular expression is not supported; list the module names")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"target_modules must list the adapted modules, got {targets!r}")
    unknown = [name for name in targets if name not in TARGET_MODULES]
    if unknown:
        raise ValueError(
            f"target_modules: {unknown[0]!r} is not supported; adapters may target {', '.join(TARGET_MODULES)}"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling), tuple(targets))
