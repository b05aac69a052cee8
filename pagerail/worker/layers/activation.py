"""Gated activation for fused gate_up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagerail.worker.layers import cpu_fused, triton_fused


class SiluAndMul(nn.Module):
    """[..., 2*d] holding [gate | up] → silu(gate) * up of shape [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_fused.fused_available(x):
            return triton_fused.silu_and_mul(x)
        if x.device.type == "cpu":
            kernels = cpu_fused.fused_kernels()
            if kernels is not None and cpu_fused.fits(x) and x.shape[1] % 2 == 0:
                return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one fewer activation-sized temporary


class GeluTanhAndMul(nn.Module):
    """[..., 2*d] holding [gate | up] → gelu_tanh(gate) * up of shape [..., d] (Gemma's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)
