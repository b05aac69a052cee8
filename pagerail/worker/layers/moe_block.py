"""A sparse MoE block: replicated router, routed experts, an optional gated shared expert, one all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from pagerail.worker.layers.activation import SiluAndMul
from pagerail.worker.layers.cpu_matmul import linear
from pagerail.worker.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagerail.worker.layers.moe import FusedMoE
from pagerail.worker.parallel_state import TensorParallelGroup


class SharedExpertMLP(nn.Module):
    """A dense SiLU MLP split like LlamaMLP, whose forward returns this rank's partial sum (no all-reduce):
    the block adds it to the routed experts' part and reduces both at once."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], False, tp, dtype
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.act_fn(self.gate_up_proj(x))
        # The row-parallel matmul without its reduce (RowParallelLinear.forward would reduce here).
        return linear(act, self.down_proj.weight, self.down_proj.cpu_weights)


class SparseMoeBlock(nn.Module):
    """experts(x, softmax-top-k(gate(x))) [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)], all-reduced once.

    Parameter names follow the Qwen-MoE checkpoints: gate, experts, shared_expert, shared_expert_gate. The router
    weights are replicated (every rank routes every token the same way); the experts are split by FusedMoE.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        enable_expert_parallel: bool = False,
        shared_expert_intermediate_size: int = 0,
        hidden_act: str = "silu",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported for experts; only 'silu' is")
        self.tp = tp
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype)
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            tp,
            dtype,
            renormalize,
            enable_expert_parallel,
            reduce_results=False,
        )
        self.has_shared_expert = shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = SharedExpertMLP(hidden_size, shared_expert_intermediate_size, tp, dtype)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.has_shared_expert:
            # The gate is per token and the same on every rank, so scaling each rank's part scales the sum.
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.tp.all_reduce(out)
