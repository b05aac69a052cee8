"""The routed experts of a mixture-of-experts layer, split across a tensor-parallel group by experts or by columns.

Two ways to split E experts of intermediate size I over a group of n ranks:

    tensor parallel (default)             expert parallel (enable_expert_parallel)
    rank r: every expert,                 rank r: experts [r*E/n, (r+1)*E/n),
            columns [r*I/n, (r+1)*I/n)            all I columns
    w13 [E, 2*I/n, H], w2 [E, H, I/n]     w13 [E/n, 2*I, H], w2 [E/n, H, I]

Either way the tokens are already on every rank: attention's output projection ends in an all-reduce, so the
hidden states entering the MoE block are replicated. Each rank computes its part of every token's output (its
column slice of every expert, or its whole experts, with the other ranks' experts' slots routed to -1), and one
all-reduce of [T, H] sums the parts, the same collective as the dense MLP's. No all-gather or all-to-all is needed;
an all-to-all dispatch (each token sent only to its experts' ranks) pays off only when attention is data parallel,
so that each rank holds different tokens. What expert parallelism buys here is whole experts per rank: fewer,
larger GEMMs, and each rank reads E/n experts' weights per step instead of a thin slice of all E.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from pagerail.common.expert_parallel import check_expert_parallel
from pagerail.worker.layers.lazy_tensor import LazyTensor, materialize
from pagerail.worker.layers.moe_activation import SILU, ExpertActivation
from pagerail.worker.layers.moe_grouped import grouped_experts
from pagerail.worker.layers.moe_routing import localize_expert_ids, select_experts
from pagerail.worker.parallel_state import TensorParallelGroup

EXPERT_PARTS = ("gate", "up", "down")
# Checkpoint layouts a stacked tensor of all experts may come in besides ours (shard_id None):
# gpt-oss's gate_up_proj [E, H, 2*I] with gate/up columns interleaved (and its bias [E, 2*I]), down_proj [E, I, H].
STACKED_LAYOUTS = ("interleaved_transposed", "transposed")


@functools.cache
def _triton_moe() -> ModuleType | None:
    # Imported on first CUDA use only, so installs without triton (or without the kernel file) still load models.
    try:
        from pagerail.worker.layers import triton_moe
    except ImportError:
        return None
    return triton_moe


def _window(full: torch.Tensor | LazyTensor, dim: int, start: int, length: int) -> torch.Tensor | LazyTensor:
    """A slice that reads nothing yet when `full` is lazy (so each rank reads only its experts' bytes)."""
    if isinstance(full, LazyTensor):
        return full.window(dim, start, length)
    return full.narrow(dim, start, length)


class ExpertWeightView(nn.Module):
    """One local expert's projection as a 2-D view of the stacked parameter (which owns the storage and is what
    checkpoints load into); `cpu_weights` is the slot the CPU matmul chooser fills, as on the linear layers."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight  # a plain attribute, not a parameter: loading and the state dict go through the stack
        self.cpu_weights = None


class FusedMoE(nn.Module):
    """Experts' weights as two stacked parameters: w13 [E_local, 2*I_local, H] (gate rows, then up rows) and
    w2 [E_local, H, I_local]. forward(hidden, router_logits) routes, computes and (with reduce_results) all-reduces.

    Checkpoints give one tensor per expert and projection: the weight loader takes shard_id (expert, part) with
    part in EXPERT_PARTS, or None for a tensor of all experts stacked (w13 [E, 2*I, H], w2 [E, H, I]), or one of
    STACKED_LAYOUTS for gpt-oss's stacked tensors.

    With `has_bias` (gpt-oss) each projection adds a per-expert bias: w13_bias [E_local, 2*I_local] and w2_bias
    [E_local, H]; `activation` replaces silu(gate) * up; `softmax_after_topk` routes as gpt-oss does.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallelGroup,
        dtype: torch.dtype | None,
        renormalize: bool,
        enable_expert_parallel: bool = False,
        reduce_results: bool = True,
        has_bias: bool = False,
        activation: ExpertActivation = SILU,
        softmax_after_topk: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.tp = tp
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.expert_parallel = enable_expert_parallel
        self.reduce_results = reduce_results
        self.activation = activation
        self.softmax_after_topk = softmax_after_topk
        if enable_expert_parallel:
            check_expert_parallel({"num_experts": num_experts}, tp.size)
            self.num_local_experts = num_experts // tp.size
            self.first_expert = tp.rank * self.num_local_experts
            self.inter_local, self.inter_start = intermediate_size, 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.inter_local = tp.shard(intermediate_size, "moe_intermediate_size")
            self.inter_start = tp.rank * self.inter_local
        shapes = self.expert_weight_shapes(dtype)
        if has_bias:
            shapes["w13_bias"] = ((self.num_local_experts, 2 * self.inter_local), dtype)
            shapes["w2_bias"] = ((self.num_local_experts, hidden_size), dtype)
        else:
            self.w13_bias = self.w2_bias = None
        for name, (shape, param_dtype) in shapes.items():
            self.add_weight(name, torch.empty(shape, dtype=param_dtype))
        # (global expert, part) pairs loaded so far: a checkpoint missing one expert still "loads" its parameter.
        self.loaded_parts: set[tuple[int, str]] = set()
        self.w13_views = self.w2_views = None
        if "w13_weight" in self._parameters:
            self.attach_expert_views()

    def expert_weight_shapes(self, dtype: torch.dtype | None) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """The experts' weight parameters (name → shape, dtype); a quantized subclass holds its own."""
        return {
            "w13_weight": ((self.num_local_experts, 2 * self.inter_local, self.hidden_size), dtype),
            "w2_weight": ((self.num_local_experts, self.hidden_size, self.inter_local), dtype),
        }

    def add_weight(self, name: str, data: torch.Tensor) -> None:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        self.register_parameter(name, param)

    def attach_expert_views(self) -> None:
        # On the CPU each local expert's projections also appear as 2-D weights, so that the CPU matmul chooser
        # (cpu_matmul.attach_cpu_weights, run after loading) measures and copies them like any linear layer's.
        if self.w13_weight.device.type != "cpu":
            return
        self.w13_views = nn.ModuleList(ExpertWeightView(self.w13_weight.data[e]) for e in range(self.num_local_experts))
        self.w2_views = nn.ModuleList(ExpertWeightView(self.w2_weight.data[e]) for e in range(self.num_local_experts))

    @property
    def local_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def missing_parts(self) -> list[tuple[int, str]]:
        """(expert, part) pairs this rank holds but no checkpoint tensor has filled yet."""
        return [(e, p) for e in self.local_experts for p in EXPERT_PARTS if (e, p) not in self.loaded_parts]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        if param is self.w13_bias or param is self.w2_bias:
            self._load_bias(param, full, shard_id)
            return
        is_w13 = param is self.w13_weight
        if shard_id is None:
            self._load_stacked(param, full, is_w13)
            return
        if shard_id in STACKED_LAYOUTS:
            self._load_transposed(param, full, is_w13, shard_id)
            return
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_PARTS):
            raise ValueError(f"shard_id must be (expert, one of {', '.join(EXPERT_PARTS)}), got {shard_id!r}")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range for num_experts={self.num_experts}")
        if (part != "down") != is_w13:
            raise ValueError(f"the {part} projection of expert {expert} cannot load into {'w13' if is_w13 else 'w2'}")
        size = self.intermediate_size
        expected = (self.hidden_size, size) if part == "down" else (size, self.hidden_size)
        if tuple(full.shape) != expected:
            raise ValueError(f"expert {expert} {part} weight has shape {tuple(full.shape)}, expected {expected}")
        if expert not in self.local_experts:
            return  # another expert-parallel rank holds it; nothing of it is read here
        local, cols = expert - self.first_expert, self.inter_local
        if part == "down":
            param.data[local].copy_(full.narrow(1, self.inter_start, cols))
        else:
            offset = 0 if part == "gate" else cols
            param.data[local, offset : offset + cols].copy_(full.narrow(0, self.inter_start, cols))
        self.loaded_parts.add((expert, part))

    def _load_stacked(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, is_w13: bool) -> None:
        # All experts in one tensor: dummy weights, and checkpoints saved in transformers' fused layout.
        size, hidden = self.intermediate_size, self.hidden_size
        expected = (self.num_experts, 2 * size, hidden) if is_w13 else (self.num_experts, hidden, size)
        if tuple(full.shape) != expected:
            name = "gate_up" if is_w13 else "down"
            raise ValueError(f"stacked {name} weight of all experts has shape {tuple(full.shape)}, expected {expected}")
        mine = _window(full, 0, self.first_expert, self.num_local_experts)
        cols = self.inter_local
        if is_w13:
            for offset, half in zip((0, cols), mine.split([size, size], dim=1), strict=True):
                param.data[:, offset : offset + cols].copy_(half.narrow(1, self.inter_start, cols))
            parts = ("gate", "up")
        else:
            param.data.copy_(mine.narrow(2, self.inter_start, cols))
            parts = ("down",)
        self.loaded_parts.update((e, p) for e in self.local_experts for p in parts)

    def _load_transposed(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, is_w13: bool, layout: str) -> None:
        # gpt-oss: x @ w layouts, gate_up [E, H, 2*I] with gate column j at 2j and up column j at 2j + 1.
        size, hidden, cols = self.intermediate_size, self.hidden_size, self.inter_local
        if (layout == "interleaved_transposed") != is_w13:
            raise ValueError(f"a {layout} tensor cannot load into {'w13' if is_w13 else 'w2'}")
        expected = (self.num_experts, hidden, 2 * size) if is_w13 else (self.num_experts, size, hidden)
        if tuple(full.shape) != expected:
            name = "gate_up_proj" if is_w13 else "down_proj"
            raise ValueError(f"stacked {name} of all experts has shape {tuple(full.shape)}, expected {expected}")
        mine = _window(full, 0, self.first_expert, self.num_local_experts)
        if is_w13:
            # This rank's gate/up columns [start, start + cols) interleave into one contiguous run of 2 * cols.
            pairs = materialize(_window(mine, 2, 2 * self.inter_start, 2 * cols))
            param.data[:, :cols].copy_(pairs[..., 0::2].transpose(1, 2))
            param.data[:, cols:].copy_(pairs[..., 1::2].transpose(1, 2))
            parts = ("gate", "up")
        else:
            param.data.copy_(materialize(_window(mine, 1, self.inter_start, cols)).transpose(1, 2))
            parts = ("down",)
        self.loaded_parts.update((e, p) for e in self.local_experts for p in parts)

    def _load_bias(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object) -> None:
        is_w13 = param is self.w13_bias
        if shard_id not in (None, "interleaved"):
            raise ValueError(f"an expert bias loads stacked, as None or 'interleaved', got shard_id {shard_id!r}")
        expected = (self.num_experts, 2 * self.intermediate_size if is_w13 else self.hidden_size)
        if tuple(full.shape) != expected:
            name = "gate_up" if is_w13 else "down"
            raise ValueError(f"stacked {name} bias of all experts has shape {tuple(full.shape)}, expected {expected}")
        mine = materialize(_window(full, 0, self.first_expert, self.num_local_experts))
        if not is_w13:
            # Each rank's part of a token's output is summed by the all-reduce: under the column split every rank
            # holds every expert, so only rank 0 adds the down bias. A rank of whole experts adds its own.
            if self.expert_parallel or self.tp.rank == 0:
                param.data.copy_(mine)
            else:
                param.data.zero_()
            return
        size, start, cols = self.intermediate_size, self.inter_start, self.inter_local
        gate, up = (mine[:, 0::2], mine[:, 1::2]) if shard_id == "interleaved" else (mine[:, :size], mine[:, size:])
        param.data[:, :cols].copy_(gate[:, start : start + cols])
        param.data[:, cols:].copy_(up[:, start : start + cols])

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (the same on every rank), router_logits [T, E] → the experts' weighted sum [T, H].

        Without reduce_results each rank returns its own part, for a caller that adds more before one reduce.
        """
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, self.softmax_after_topk)
        if self.expert_parallel and self.tp.size > 1:
            ids = localize_expert_ids(ids, self.first_expert, self.num_local_experts)
        out = self.compute(hidden, weights, ids)
        return self.tp.all_reduce(out) if self.reduce_results else out

    def compute(self, hidden: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """This rank's part for routed (weights, ids into its local experts, -1 for none): Triton on CUDA."""
        extras = (self.w13_bias, self.w2_bias, self.activation)
        if hidden.device.type == "cuda":
            kernels = _triton_moe()
            if kernels is not None and kernels.fused_moe_available(hidden, self.w13_weight, self.w2_weight):
                return kernels.triton_fused_experts(
                    hidden, self.w13_weight, self.w2_weight, weights, local_ids, *extras
                )
        cpu_weights = None
        if self.w13_views is not None:
            cpu_weights = ([v.cpu_weights for v in self.w13_views], [v.cpu_weights for v in self.w2_views])
        return grouped_experts(hidden, self.w13_weight, self.w2_weight, weights, local_ids, *extras, cpu_weights)

    def comm_bytes(self, num_tokens: int) -> int:
        """Bytes each rank puts into this layer's all-reduce for a step of `num_tokens`: [T, H] in the weights' dtype.

        A ring all-reduce sends and receives 2 * (n - 1) / n of this per rank. 0 on a single rank.
        """
        if self.tp.size == 1:
            return 0
        return num_tokens * self.hidden_size * self.w13_weight.dtype.itemsize

    def extra_repr(self) -> str:
        split = "expert" if self.expert_parallel else "tensor"
        return (
            f"experts={self.num_experts} (local {self.num_local_experts}), top_k={self.top_k}, "
            f"intermediate={self.intermediate_size} (local {self.inter_local}), {split} parallel, "
            f"rank={self.tp.rank}/{self.tp.size}"
        )


def moe_comm_bytes(model: nn.Module, num_tokens: int) -> int:
    """Bytes per rank that a step of `num_tokens` moves in the MoE layers' all-reduces (one [T, H] per layer).

    Computed from the shapes, not counted in forward, so it holds for CUDA-graph replays too.
    """
    return sum(module.comm_bytes(num_tokens) for module in model.modules() if isinstance(module, FusedMoE))
