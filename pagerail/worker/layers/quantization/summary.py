"""What a loaded model's weights are: their format and the bytes they take on this rank."""

from __future__ import annotations

from torch import nn


def weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters and buffers (scales, packed weights, rotary tables), shared tensors once."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta" or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def weight_format(model: nn.Module) -> str:
    """The format's description ("fp8 block 128x128", "awq int4 g128", ...), or the dtype of unquantized weights."""
    config = getattr(model, "quant_config", None)
    if config is not None:
        return config.describe
    return str(next(model.parameters()).dtype).removeprefix("torch.")
