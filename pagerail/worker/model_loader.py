"""Builds a model from its directory with real or dummy weights, and reads its transformers config."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagerail.common.expert_parallel import check_expert_parallel
from pagerail.common.special_tokens import tokenizer_special_id
from pagerail.worker.layers.cpu_matmul import attach_cpu_weights
from pagerail.worker.layers.lazy_tensor import LazyTensor
from pagerail.worker.layers.quantization.config import QuantizationConfigError, quant_config_from_hf
from pagerail.worker.layers.quantization.context import building_with
from pagerail.worker.layers.quantization.install import checkpoint_stream, finish_linear_methods, install_linear_methods
from pagerail.worker.models.registry import model_class
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup

LOAD_FORMATS = ("auto", "dummy")


def load_hf_config(model_dir: str | os.PathLike[str]) -> Any:
    """The transformers config of a local model directory (never touches the network)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.fspath(model_dir), local_files_only=True)


def load_model(
    model_dir: str | os.PathLike[str],
    tp: TensorParallelGroup = SINGLE_RANK,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    enable_expert_parallel: bool = False,
    quantization: str | None = None,
) -> nn.Module:
    """Build the model for `model_dir` on `device` holding this rank's shard, with checkpoint or dummy weights.

    "dummy" fills random weights (std 0.02, norms near 1) that depend only on `seed`, not on the tp size:
    every rank draws the same full tensors and keeps its slice. `enable_expert_parallel` gives each rank of `tp`
    whole experts (num_experts / tp.size of them) instead of a slice of every expert; refused for dense models.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    model_dir = Path(model_dir)
    config = load_hf_config(model_dir)
    if getattr(config, "model_type", None) == "bert" and getattr(config, "sep_token_id", None) is None:
        # BERT's configs leave the separator to the tokenizer; its segments switch after it.
        config.sep_token_id = tokenizer_special_id(model_dir, "sep_token")
    cls = model_class(config)
    device = torch.device(device)
    extra = {}
    if enable_expert_parallel:
        check_expert_parallel(config, tp.size)
        if not getattr(cls, "supports_expert_parallel", False):
            raise ValueError(f"enable_expert_parallel=True, but {cls.__name__} has no experts to spread over ranks")
        extra["enable_expert_parallel"] = True
    qconfig = quant_config_from_hf(config, quantization)
    if qconfig is not None and load_format == "dummy" and not qconfig.on_load:
        raise QuantizationConfigError(
            f"load_format='dummy' cannot fill {qconfig.describe} weights; use the unquantized config with "
            "quantization='fp8' for random fp8 weights"
        )
    # Building under the device context allocates every weight where it will run, with no CPU copy first; a
    # quantized format's linear weights wait on the meta device until the checkpoint says which layers hold them.
    with device, building_with(qconfig):
        model = cls(config, tp, dtype, **extra)
    names = None
    if qconfig is not None and not qconfig.on_load:
        names = set(checkpoint_tensor_names(model_dir))
    install_linear_methods(model, qconfig, names, device)
    if load_format == "dummy":
        _fill_dummy(model, cls, config, device, seed)
    else:
        # Lazy tensors: each weight loader reads only its rank's slice, so tp ranks share the file's bytes.
        model.load_weights(checkpoint_stream(model, qconfig, iter_lazy_safetensors(model_dir)))
    finish_linear_methods(model)
    for module in model.modules():
        finish = getattr(module, "after_loading", None)
        if callable(finish):
            finish()  # formats that convert their tensors once loaded (mxfp4 experts)
    model.quant_config = qconfig
    if device.type == "cpu":
        attach_cpu_weights(model)
    return model.eval()


def checkpoint_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint, following model.safetensors.index.json when present."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}; only safetensors checkpoints and .gguf files load")
    return files


def checkpoint_tensor_names(model_dir: str | os.PathLike[str]) -> list[str]:
    """The names of a checkpoint's tensors, read from the files' headers only."""
    from safetensors import safe_open

    names: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names.extend(handle.keys())
    return names


def iter_lazy_safetensors(model_dir: str | os.PathLike[str]) -> Iterator[tuple[str, LazyTensor]]:
    """(name, lazy tensor) pairs: nothing is read until a weight loader asks for its slice."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, LazyTensor.from_safetensors(handle, name)


def _fill_dummy(model: nn.Module, cls: type[nn.Module], config: Any, device: torch.device, seed: int) -> None:
    # A single-rank copy on the meta device gives each parameter's full (unsharded) shape without allocating it.
    with torch.device("meta"):
        reference = cls(config, SINGLE_RANK, torch.float32)
    full_shapes = {name: param.shape for name, param in reference.named_parameters()}
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        full = torch.randn(full_shapes[name], generator=generator, device=device) * 0.02
        if name.endswith("norm.weight"):
            full += 1.0  # norms near 1 keep activations at a sane scale through the layers
        param.weight_loader(param, full)
