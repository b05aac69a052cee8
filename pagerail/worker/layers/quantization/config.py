"""Reads a checkpoint's `quantization_config` (or the `quantization` setting) into one validated weight format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Formats a checkpoint may declare, as users know them; the message of every refusal lists them.
SUPPORTED_FORMATS = (
    "fp8 (per-tensor, per-channel or block-wise weight scales, dynamic activations)",
    "compressed-tensors float-quantized (fp8 W8A8: tensor, channel or block strategy)",
    "awq (4-bit, zero point, gemm layout)",
    "gptq (4-bit, with or without act-order)",
    "mxfp4 (gpt-oss experts)",
)
FP8_SCHEMES = ("tensor", "channel", "block")


class QuantizationConfigError(ValueError):
    """A quantization_config this engine cannot serve: the message names the field and the supported formats."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}; supported weight formats: {'; '.join(SUPPORTED_FORMATS)}")


@dataclass(frozen=True)
class QuantConfig:
    """One weight format for every quantized linear layer of a model.

    method: "fp8", "awq", "gptq" or "mxfp4". For fp8, `scheme` is how weight scales are laid out and
    `block_size` the (output, input) block of a "block" scheme; `on_load` quantizes a 16/32-bit checkpoint while
    loading (per-channel). For int4, `group_size` is the input rows sharing a scale (-1: all of them),
    `desc_act` the act-order permutation, and `zero_offset` what GPTQ v1 checkpoints subtract from stored zeros.
    `ignore` names modules kept in full precision, as the checkpoint lists them.
    """

    method: str
    scheme: str = ""
    block_size: tuple[int, int] | None = None
    on_load: bool = False
    group_size: int = -1
    desc_act: bool = False
    zero_offset: int = 0
    ignore: tuple[str, ...] = ()
    checkpoint_method: str = ""

    @property
    def describe(self) -> str:
        """The start-up line's and the metrics' name for the format, e.g. "fp8 block 128x128" or "gptq g128"."""
        if self.method == "fp8":
            block = f" {self.block_size[0]}x{self.block_size[1]}" if self.block_size else ""
            return f"fp8 {self.scheme}{block}" + (" (quantized on load)" if self.on_load else "")
        if self.method in ("awq", "gptq"):
            act = " act-order" if self.desc_act else ""
            return f"{self.method} int4 g{self.group_size}{act}"
        return self.method


def quant_config_from_hf(hf_config: Any, requested: str | None = None) -> QuantConfig | None:
    """The weight format of a model: the checkpoint's `quantization_config`, checked against `requested`
    (the `quantization` setting); None for an unquantized model with nothing requested."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    if not raw:
        if requested is None:
            return None
        if requested == "fp8":
            return QuantConfig("fp8", scheme="channel", on_load=True)
        raise QuantizationConfigError(
            f"quantization={requested!r} needs a checkpoint quantized in that format (this one has no "
            "quantization_config); only fp8 can quantize a 16/32-bit checkpoint while loading"
        )
    method = str(raw.get("quant_method", "")).lower()
    parsers = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq, "mxfp4": _mxfp4}
    if method not in parsers:
        raise QuantizationConfigError(f"quantization_config.quant_method={method!r} is not supported")
    config = parsers[method](raw)
    if requested is not None and requested != config.method:
        raise QuantizationConfigError(
            f"quantization={requested!r}, but the checkpoint's quantization_config says {config.method!r} "
            f"(quant_method={method!r}); leave quantization unset to use the checkpoint's format"
        )
    return config


def _ignore_list(raw: dict, key: str) -> tuple[str, ...]:
    value = raw.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise QuantizationConfigError(f"quantization_config.{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _block_size(value: Any, field: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise QuantizationConfigError(f"{field} must be two positive integers [output, input], got {value!r}")
    return int(value[0]), int(value[1])


def _fp8(raw: dict) -> QuantConfig:
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationConfigError(f"quantization_config.activation_scheme={scheme!r} must be dynamic or static")
    block = raw.get("weight_block_size")
    ignore = _ignore_list(raw, "modules_to_not_convert")
    if block is not None:
        return QuantConfig(
            "fp8",
            "block",
            _block_size(block, "quantization_config.weight_block_size"),
            ignore=ignore,
            checkpoint_method="fp8",
        )
    # Per-tensor scales; a per-channel checkpoint's [out] or [out, 1] scales load into the same per-row layout.
    return QuantConfig("fp8", "tensor", ignore=ignore, checkpoint_method="fp8")


def _compressed_tensors(raw: dict) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise QuantizationConfigError(
            f"quantization_config.config_groups must hold exactly one group, got {len(groups) if groups else 0}"
        )
    ((name, group),) = groups.items()
    weights = group.get("weights") or {}
    field = f"quantization_config.config_groups.{name}.weights"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise QuantizationConfigError(
            f"{field} type={weights.get('type')!r} num_bits={weights.get('num_bits')!r}: only 8-bit float weights "
            "are supported from compressed-tensors"
        )
    strategy = weights.get("strategy")
    if strategy not in FP8_SCHEMES:
        raise QuantizationConfigError(f"{field}.strategy={strategy!r} must be one of {FP8_SCHEMES}")
    if weights.get("symmetric") is False:
        raise QuantizationConfigError(f"{field}.symmetric=false: fp8 weights must be symmetric")
    activations = group.get("input_activations")
    if activations and activations.get("num_bits") not in (None, 8):
        raise QuantizationConfigError(f"quantization_config.config_groups.{name}.input_activations must be 8-bit")
    block = None
    if strategy == "block":
        block = _block_size(weights.get("block_structure"), f"{field}.block_structure")
    return QuantConfig(
        "fp8", strategy, block, ignore=_ignore_list(raw, "ignore"), checkpoint_method="compressed-tensors"
    )


def _int4_common(raw: dict, method: str) -> tuple[int, tuple[str, ...]]:
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise QuantizationConfigError(f"quantization_config.bits={bits!r}: {method} is supported with 4 bits only")
    group = raw.get("group_size", raw.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 8 == 0)):
        raise QuantizationConfigError(
            f"quantization_config.group_size={group!r} must be -1 or a positive multiple of 8"
        )
    return group, _ignore_list(raw, "modules_to_not_convert")


def _awq(raw: dict) -> QuantConfig:
    group, ignore = _int4_common(raw, "awq")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationConfigError(f"quantization_config.version={version!r}: only the awq gemm layout loads")
    if raw.get("zero_point", True) is not True:
        raise QuantizationConfigError("quantization_config.zero_point=false: awq is supported with zero points")
    if group == -1:
        raise QuantizationConfigError("quantization_config.group_size=-1: awq needs a group size")
    return QuantConfig("awq", group_size=group, ignore=ignore, checkpoint_method="awq")


def _gptq(raw: dict) -> QuantConfig:
    group, ignore = _int4_common(raw, "gptq")
    if raw.get("lm_head"):
        raise QuantizationConfigError("quantization_config.lm_head=true: a quantized LM head is not supported")
    checkpoint_format = str(raw.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantizationConfigError(
            f"quantization_config.checkpoint_format={checkpoint_format!r} must be gptq or gptq_v2"
        )
    # GPTQ v1 checkpoints store each zero point minus one.
    offset = 1 if checkpoint_format == "gptq" else 0
    desc_act = bool(raw.get("desc_act", False))
    return QuantConfig(
        "gptq", group_size=group, desc_act=desc_act, zero_offset=offset, ignore=ignore, checkpoint_method="gptq"
    )


def _mxfp4(raw: dict) -> QuantConfig:
    return QuantConfig("mxfp4", ignore=_ignore_list(raw, "modules_to_not_convert"), checkpoint_method="mxfp4")
