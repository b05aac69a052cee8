"""Tensor-parallel linear layers whose weight loaders cut this rank's slice out of full checkpoint tensors.

The loaders take real tensors or `LazyTensor`s; they only use shape, `narrow` and `split`, so a lazy checkpoint
tensor is read just for the rows or columns this rank keeps.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.cpu_matmul import CpuWeights, linear
from worker.layers.lazy_tensor import LazyTensor, materialize
from worker.parallel_state import SINGLE_RANK, TensorParallelGroup


def _check_shape(param: torch.Tensor, loaded: torch.Tensor | LazyTensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)} on this rank"
        )


def _new_param(shape: tuple[int, ...], dtype: torch.dtype | None, loader) -> nn.Parameter:
    # torch.empty honours an enclosing `with torch.device(...)`, so weights are born on the target device.
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


class _ParallelLinear(nn.Module):
    """Weight [out_per_rank, in_per_rank] plus optional bias, both carrying a `weight_loader`."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _new_param((out_features, in_features), dtype, self.weight_loader)
        if bias:
            self.bias = _new_param((out_features,), dtype, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        # Copies of the weight for the CPU libraries that run some batch sizes faster, made after loading (cpu_matmul).
        self.cpu_weights: CpuWeights | None = None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.rank}/{self.tp.size}"


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T with A's output rows split across ranks; each rank keeps its slice of y (no communication)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, tp.shard(output_size, "output_size"), bias, tp, dtype)
        self.output_size = output_size

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        if full.shape[0] != self.output_size:
            raise ValueError(f"checkpoint tensor has {full.shape[0]} output rows, expected {self.output_size}")
        rows = param.shape[0]
        piece = full.narrow(0, self.tp.rank * rows, rows)
        _check_shape(param, piece, "column-parallel weight")
        param.data.copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.cpu_weights)
        return out if self.bias is None else out + self.bias


class ReplicatedLinear(ColumnParallelLinear):
    """A small projection every rank holds whole (MoE routers); kept in full precision under weight quantization,
    as the routing decisions are sensitive to it."""

    quantizable = False

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, bias, SINGLE_RANK, dtype)


class RowParallelLinear(_ParallelLinear):
    """y = x A^T with A's input columns split across ranks; partial sums are all-reduced, then bias added once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(tp.shard(input_size, "input_size"), output_size, bias, tp, dtype)
        self.input_size = input_size

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        if param.dim() == 1:
            # The bias is replicated: every rank holds all of it but only adds it after the reduce.
            _check_shape(param, full, "row-parallel bias")
            param.data.copy_(materialize(full))
            return
        if full.dim() != 2 or full.shape[1] != self.input_size:
            raise ValueError(f"checkpoint tensor has shape {tuple(full.shape)}, expected {self.input_size} columns")
        cols = param.shape[1]
        piece = full.narrow(1, self.tp.rank * cols, cols)
        _check_shape(param, piece, "row-parallel weight")
        param.data.copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight, self.cpu_weights))
        if self.bias is not None:
            out = out + self.bias
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate_proj + up_proj).

    Each rank's weight is [part0 slice | part1 slice | ...]: every part is split across ranks separately, so the
    rank-local output can be cut back into its parts without communication.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        local_sizes = [tp.shard(size, f"output_sizes[{i}]") for i, size in enumerate(output_sizes)]
        super().__init__(input_size, sum(output_sizes), bias, tp, dtype)
        self.output_sizes = list(output_sizes)
        self.local_sizes = local_sizes

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        if shard_id is None:
            # An already fused checkpoint tensor: split it into its parts and load each.
            if full.shape[0] != self.output_size:
                raise ValueError(f"fused checkpoint tensor has {full.shape[0]} rows, expected {self.output_size}")
            for index, part in enumerate(full.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, index)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        expected = self.output_sizes[shard_id]
        if full.shape[0] != expected:
            raise ValueError(f"checkpoint tensor for part {shard_id} has {full.shape[0]} rows, expected {expected}")
        target = param.data.narrow(0, offset, size)
        piece = full.narrow(0, self.tp.rank * size, size)
        _check_shape(target, piece, f"merged part {shard_id}")
        target.copy_(piece)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; query heads are split across ranks, and so are KV heads when there are enough.

    When num_kv_heads < tp size, KV heads are replicated: each rank holds the one KV head its query heads use
    (rank r serves query heads r*h .. r*h+h-1, which all belong to KV head r // (size / num_kv_heads)).
    Rank-local output layout: [q: heads_per_rank*d | k: kv_per_rank*d | v: kv_per_rank*d].
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        heads_per_rank = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            kv_per_rank = tp.shard(num_kv_heads, "num_key_value_heads")
            kv_head_start = tp.rank * kv_per_rank
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads={num_kv_heads} "
                    "when it exceeds it"
                )
            kv_per_rank = 1
            kv_head_start = tp.rank // (tp.size // num_kv_heads)
        # Skip ColumnParallelLinear's even split: the local width comes from the head arithmetic above.
        _ParallelLinear.__init__(self, hidden_size, (heads_per_rank + 2 * kv_per_rank) * head_dim, bias, tp, dtype)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = heads_per_rank
        self.num_kv_heads_per_rank = kv_per_rank
        self.kv_head_start = kv_head_start
        self.q_size = heads_per_rank * head_dim
        self.kv_size = kv_per_rank * head_dim
        self.output_size = (num_heads + 2 * num_kv_heads) * head_dim

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        q_full = self.num_heads * self.head_dim
        kv_full = self.num_kv_heads * self.head_dim
        if shard_id is None:
            if full.shape[0] != self.output_size:
                raise ValueError(f"fused qkv checkpoint tensor has {full.shape[0]} rows, expected {self.output_size}")
            for part_id, part in zip("qkv", full.split([q_full, kv_full, kv_full], dim=0), strict=True):
                self.weight_loader(param, part, part_id)
            return
        if shard_id == "q":
            offset, size, start, expected = 0, self.q_size, self.tp.rank * self.q_size, q_full
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start, expected = self.kv_size, self.kv_head_start * self.head_dim, kv_full
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        if full.shape[0] != expected:
            raise ValueError(f"checkpoint tensor for {shard_id}_proj has {full.shape[0]} rows, expected {expected}")
        target = param.data.narrow(0, offset, size)
        piece = full.narrow(0, start, size)
        _check_shape(target, piece, f"{shard_id}_proj")
        target.copy_(piece)
