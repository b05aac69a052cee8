"""RMSNorm computed in float32 and cast back, matching Hugging Face Llama numerics."""

from __future__ import annotations

import torch
from torch import nn

from pagerail.worker.layers import cpu_fused, triton_fused


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension; the weight is replicated on every rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint norm weight has shape {tuple(full.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(full)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(residual + x), residual + x), the sum rounded in x's dtype.

        On CUDA one Triton kernel does the add and the norm and updates `residual` in place; on the CPU the
        native kernel (float32) or torch writes the sum to a new tensor, leaving `residual` as it was.
        """
        if triton_fused.norm_fits(x, self.weight):
            return triton_fused.rms_norm(x, self.weight, self.eps, residual)
        if x.device.type == "cpu":
            kernels = cpu_fused.fused_kernels()
            if (
                kernels is not None
                and self.weight.dtype == torch.float32  # a 1-D parameter, always contiguous
                and cpu_fused.fits(x)
                and (residual is None or cpu_fused.fits(residual))
            ):
                return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before scaling, in the same order as transformers, so half-precision results agree bit for bit.
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32 and cast back once at the end.

    The checkpoint stores weight - 1, and the product is taken before the cast (Llama casts first), so
    half-precision results agree with transformers' Gemma bit for bit.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint norm weight has shape {tuple(full.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
