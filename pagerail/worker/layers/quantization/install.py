"""Gives a built model's linear layers their weight format, and feeds the checkpoint through the formats' rules:
quantized tensors of layers that hold them pass as they are; those of layers that hold full-precision weights
(MoE experts) are dequantized on the way in."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagerail.worker.layers.quantization.config import QuantConfig, QuantizationConfigError
from pagerail.worker.layers.quantization.fp8_linear import FP8_DTYPE, Fp8LinearMethod, expand_block_scales
from pagerail.worker.layers.quantization.int4_layout import dequantize_int4
from pagerail.worker.layers.quantization.int4_linear import Int4LinearMethod, canonical_int4
from pagerail.worker.layers.quantization.linear_method import LINEAR_FORMATS, LinearMethod

logger = logging.getLogger(__name__)

# The tensors each format adds next to (or in place of) a linear layer's `weight`.
_FP8_SCALES = (".weight_scale_inv", ".weight_scale")
_INT4_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
# Static activation scales: activations are scaled per token at run time instead.
_DROPPED = (".input_scale",)


def linear_method(config: QuantConfig) -> LinearMethod:
    return Fp8LinearMethod(config) if config.method == "fp8" else Int4LinearMethod(config)


def quantized_prefixes(config: QuantConfig, names: Iterable[str]) -> set[str]:
    """Checkpoint module prefixes that hold quantized weights ("model.layers.0.self_attn.q_proj")."""
    suffixes = _FP8_SCALES if config.method == "fp8" else (".qweight",)
    return {name[: -len(suffix)] for name in names for suffix in suffixes if name.endswith(suffix)}


def install_linear_methods(
    model: nn.Module, config: QuantConfig | None, checkpoint_names: set[str] | None, device: torch.device
) -> int:
    """Quantize the linear layers the checkpoint quantized (all quantizable ones when quantizing on load) and give
    the others a full-precision weight; returns how many layers hold quantized weights."""
    from pagerail.worker.layers.linear import new_param

    if config is None or config.method not in LINEAR_FORMATS:
        return 0
    quantized_modules = None
    if not config.on_load:
        prefixes = quantized_prefixes(config, checkpoint_names or ())
        quantized_modules = set()
        for prefix in prefixes:
            mapped = model.checkpoint_name(prefix + ".weight")
            if mapped is not None:
                quantized_modules.add(mapped[0].rsplit(".", 1)[0])
    count = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "quant_method") or weight is None or weight.device.type != "meta":
            continue
        with device:
            if quantized_modules is None or name in quantized_modules:
                module.quant_method = linear_method(config)
                module.quant_method.create_weights(module)
                count += 1
            else:
                module.weight = new_param(tuple(weight.shape), module.params_dtype, module.weight_loader)
    return count


def finish_linear_methods(model: nn.Module) -> None:
    """Each quantized layer's `after_loading` (checks, conversion to the kernels' layout)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.after_loading(module)


def checkpoint_stream(
    model: nn.Module, config: QuantConfig | None, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as the model's loaders take it: static activation scales dropped, and the quantized tensors
    of modules that hold full-precision weights gathered and yielded as one dequantized `<prefix>.weight`."""
    modules = dict(model.named_modules())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name.endswith(_DROPPED):
            continue
        if config is None or config.method not in LINEAR_FORMATS:
            if tensor.dtype == FP8_DTYPE or name.endswith(_FP8_SCALES[:1]):
                raise QuantizationConfigError(
                    f"checkpoint tensor {name!r} is fp8, but the checkpoint has no quantization_config to scale it"
                )
            yield name, tensor
            continue
        prefix, part = _split(config, name)
        # Only fp8-typed weights are quantized; norms, embeddings and modules the format left alone pass as they are.
        plain = part == ".weight" and tensor.dtype != FP8_DTYPE
        if prefix is None or plain or _holds_quantized(model, modules, prefix):
            yield name, tensor
            continue
        # Read now: the file holding the companions may be another one, whose handle outlives this one's.
        group = pending.setdefault(prefix, {})
        group[part] = tensor.full() if hasattr(tensor, "full") else tensor
        if _complete(config, group):
            yield prefix + ".weight", _dequantize(config, prefix, pending.pop(prefix))
    for prefix, group in pending.items():
        missing = [part for part in _needed(config) if not any(name in group for name in part.split(" or "))]
        raise QuantizationConfigError(f"checkpoint module {prefix!r} lacks {', '.join(missing)} for its weights")


def _split(config: QuantConfig, name: str) -> tuple[str | None, str]:
    parts = (".weight", *_FP8_SCALES) if config.method == "fp8" else _INT4_PARTS
    for part in parts:
        if name.endswith(part):
            return name[: -len(part)], part
    return None, ""


def _holds_quantized(model: nn.Module, modules: dict[str, nn.Module], prefix: str) -> bool:
    mapped = model.checkpoint_name(prefix + ".weight")
    if mapped is None:
        return True  # skipped by the model anyway
    module = modules.get(mapped[0].rsplit(".", 1)[0])
    return module is not None and getattr(module, "quant_method", None) is not None


def _needed(config: QuantConfig) -> tuple[str, ...]:
    if config.method == "fp8":
        return (".weight", ".weight_scale_inv or .weight_scale")
    return (".qweight", ".qzeros", ".scales") + ((".g_idx",) if config.desc_act else ())


def _complete(config: QuantConfig, group: dict[str, torch.Tensor]) -> bool:
    if config.method == "fp8":
        return ".weight" in group and any(scale in group for scale in _FP8_SCALES)

    return all(part in group for part in _needed(config))


def _dequantize(config: QuantConfig, prefix: str, group: dict[str, torch.Tensor]) -> torch.Tensor:
    """A full-precision [out, in] weight (fp32) from one module's quantized tensors."""
    if config.method == "fp8":
        weight = group[".weight"].float()
        scale = next(group[name] for name in _FP8_SCALES if name in group).float()
        if config.block_size is not None:
            return weight * expand_block_scales(scale, weight.shape, config.block_size)
        return weight * scale.reshape(-1, 1) if scale.numel() > 1 else weight * scale.reshape(())
    qweight, qzeros, scales = group[".qweight"], group[".qzeros"], group[".scales"].float()
    # The layout a quantized layer converts to after loading, then its one dequantization.
    in_features = qweight.shape[0] * (1 if config.method == "awq" else 8)
    size = config.group_size if config.group_size != -1 else in_features
    try:
        layout = canonical_int4(config, qweight, qzeros, scales, group.get(".g_idx"), size)
        return dequantize_int4(*layout).t().contiguous()
    except ValueError as error:
        raise QuantizationConfigError(f"checkpoint module {prefix!r}: {error}") from None
