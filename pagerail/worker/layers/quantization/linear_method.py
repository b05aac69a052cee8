"""What a quantized weight format does for a linear layer: create its parameters, finish them after loading, and
multiply."""

from __future__ import annotations

import torch
from torch import nn

# Formats whose linear layers hold quantized weights (mxfp4 quantizes only gpt-oss's experts).
LINEAR_FORMATS = ("fp8", "awq", "gptq")


class LinearMethod:
    """One format's handling of one layer; `layer` is the tensor-parallel linear layer that owns the parameters."""

    def create_weights(self, layer: nn.Module) -> None:
        """Register the format's parameters on `layer` (in place of its full-precision weight)."""
        raise NotImplementedError

    def after_loading(self, layer: nn.Module) -> None:
        """Check and convert the loaded parameters into the layout `apply` reads."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] @ W^T → [..., out_features] in x's dtype, without the bias."""
        raise NotImplementedError
