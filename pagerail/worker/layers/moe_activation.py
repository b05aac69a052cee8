"""How a routed expert turns its gate and up projections into the down projection's input."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class ExpertActivation:
    """`silu`: silu(gate) * up (Mixtral, Qwen-MoE). `swiglu_clamped` (gpt-oss): gate clamped above at `limit`,
    up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.kind!r} is not supported; supported: {EXPERT_ACTIVATIONS}")
        if self.kind == "swiglu_clamped" and not self.limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.limit}")

    @property
    def clamped(self) -> bool:
        return self.kind == "swiglu_clamped"

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [N, I] → [N, I], in the order transformers' GptOssExperts computes it."""
        if not self.clamped:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = ExpertActivation()
