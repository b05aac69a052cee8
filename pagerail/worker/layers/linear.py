"""Tensor-parallel linear layers whose weight loaders cut this rank's slice out of full checkpoint tensors.

The loaders take real tensors or `LazyTensor`s; they only use shape, `narrow` and `split`, so a lazy checkpoint
tensor is read just for the rows or columns this rank keeps.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pagerail.worker.layers.cpu_matmul import CpuWeights, linear
from pagerail.worker.layers.lazy_tensor import LazyTensor, materialize
from pagerail.worker.layers.quantization.context import building_config
from pagerail.worker.layers.quantization.linear_method import LINEAR_FORMATS, LinearMethod
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup


def _check_shape(param: torch.Tensor, loaded: torch.Tensor | LazyTensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)} on this rank"
        )


def new_param(
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    loader,
    output_dim: int | None = 0,
    input_dim: int | None = 1,
    output_pack: int = 1,
    input_pack: int = 1,
) -> nn.Parameter:
    """A weight-like parameter and where its output and input features lie, for the sharding loaders.

    `output_dim`/`input_dim` are the dimensions indexed by output/input features (None: the tensor is not split
    along them, so every rank holds all of it), each entry covering `output_pack`/`input_pack` features (8 for
    int4 values packed in an int32, the group size for group scales). A quantized format's parameters keep the
    checkpoint's layout, so one loader cuts plain, packed and grouped tensors alike.
    """
    # torch.empty honours an enclosing `with torch.device(...)`, so weights are born on the target device.
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    param.output_dim, param.input_dim = output_dim, input_dim
    param.output_pack, param.input_pack = output_pack, input_pack
    return param


def _span(start: int, size: int, pack: int, what: str) -> tuple[int, int]:
    # A slice of features in entries of `pack` features: it must start on an entry; a last partial entry (a
    # block-scale row past the end of an odd-sized weight) counts whole.
    if start % pack:
        raise ValueError(f"{what} starts at feature {start}, which is not a multiple of its {pack}-feature groups")
    return start // pack, -(-size // pack)


def store(param: nn.Parameter, target: torch.Tensor, piece: torch.Tensor | LazyTensor, row: int, name: str) -> None:
    """Copy a checkpoint slice into `target` (a view of `param` whose first output row is `row`), through the
    parameter's own writer when it has one (weights quantized while loading)."""
    piece = materialize(piece)
    if piece.numel() == 1 and target.numel() > 1 and getattr(param, "broadcast_scalar", False):
        target.fill_(piece.reshape(()).item())  # a per-tensor scale filling its shard's per-row scales
        return
    if piece.shape != target.shape and piece.numel() == target.numel() and piece.dim() != target.dim():
        piece = piece.reshape(target.shape)  # [out, 1] per-channel scales into an [out] parameter
    _check_shape(target, piece, name)
    writer = getattr(param, "store_rows", None)
    if writer is not None:
        writer(target, piece, row)
    else:
        target.copy_(piece)


def load_output_slice(
    param: nn.Parameter,
    full: torch.Tensor | LazyTensor,
    offset: int,
    start: int,
    size: int,
    name: str,
    expected: int,
) -> None:
    """Put output features [start, start+size) of a checkpoint tensor, which holds `expected` output features,
    at local output features [offset, offset+size)."""
    dim = param.output_dim
    if dim is None:
        store(param, param.data, full, 0, name)  # replicated along outputs (act-order group indices)
        return
    pack = param.output_pack
    scalar = full.numel() == 1 and getattr(param, "broadcast_scalar", False)
    if not scalar and (full.dim() <= dim or full.shape[dim] != -(-expected // pack)):
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(full.shape)}, expected {expected} output features"
            + (f" in entries of {pack}" if pack > 1 else "")
            + f" along dimension {dim}"
        )
    target_start, length = _span(offset, size, pack, f"{name}'s slice on this rank")
    source_start, _ = _span(start, size, pack, f"{name}'s checkpoint slice")
    target = param.data.narrow(dim, target_start, length)
    if scalar:
        store(param, target, full, offset, name)
        return
    store(param, target, full.narrow(dim, source_start, length), offset, name)


class _ParallelLinear(nn.Module):
    """Weight [out_per_rank, in_per_rank] plus optional bias, both carrying a `weight_loader`.

    Under a quantized weight format (see worker/layers/quantization) the weight is created on the meta device and
    replaced, once the model is built and the checkpoint says which layers it quantized, by the format's
    parameters (`quant_method.create_weights`) or by a real full-precision weight.
    """

    # False for layers kept in full precision whatever the format (MoE routers).
    quantizable = True

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.params_dtype = dtype
        quantized = building_config() is not None and building_config().method in LINEAR_FORMATS
        with torch.device("meta") if quantized and self.quantizable else contextlib.nullcontext():
            self.weight = new_param((out_features, in_features), dtype, self.weight_loader)
        if bias:
            self.bias = new_param((out_features,), dtype, self.weight_loader, input_dim=None)
        else:
            self.register_parameter("bias", None)
        # The quantized format's matmul, when this layer holds quantized weights.
        self.quant_method: LinearMethod | None = None
        # Copies of the weight for the CPU libraries that run some batch sizes faster, made after loading (cpu_matmul).
        self.cpu_weights: CpuWeights | None = None
        # LoRA adapter slots (worker/lora.py LoRAProjection) when this projection serves adapters.
        self.lora = None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T for this rank's weight: no bias, no reduce."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return linear(x, self.weight, self.cpu_weights)

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
        rows = self.out_features
        load_output_slice(param, full, 0, self.tp.rank * rows, rows, "column-parallel weight", self.output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.lora is not None:
            out = self.lora.delta(x, out)
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
        dim = param.input_dim
        if dim is None:
            # Replicated (the bias, per-row scales, act-order group scales): every rank holds all of it; the bias
            # is added once, after the reduce.
            store(param, param.data, full, 0, "row-parallel replicated tensor")
            return
        start, length = _span(self.tp.rank * self.in_features, self.in_features, param.input_pack, "row split")
        if full.shape[dim] < start + length:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(full.shape)}, expected {self.input_size} input features"
            )
        store(param, param.data, full.narrow(dim, start, length), 0, "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.matmul(x)
        if self.lora is not None:
            partial = self.lora.delta(x, partial)  # a partial delta of this rank's input slice, reduced with it
        out = self.tp.all_reduce(partial)
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
            dim, pack = param.output_dim, param.output_pack
            sizes = [size // pack for size in self.output_sizes]
            if dim is None or full.shape[dim] != sum(sizes):
                raise ValueError(f"fused checkpoint tensor has shape {tuple(full.shape)}, expected {sum(sizes)} rows")
            for index, part in enumerate(full.split(sizes, dim=dim)):
                self.weight_loader(param, part, index)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        load_output_slice(
            param, full, offset, self.tp.rank * size, size, f"merged part {shard_id}", self.output_sizes[shard_id]
        )


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
            dim, pack = param.output_dim, param.output_pack
            sizes = [q_full // pack, kv_full // pack, kv_full // pack]
            if dim is None or full.shape[dim] != sum(sizes):
                raise ValueError(
                    f"fused qkv checkpoint tensor has shape {tuple(full.shape)}, expected {sum(sizes)} rows"
                )
            for part_id, part in zip("qkv", full.split(sizes, dim=dim), strict=True):
                self.weight_loader(param, part, part_id)
            return
        if shard_id == "q":
            offset, size, start, expected = 0, self.q_size, self.tp.rank * self.q_size, q_full
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start, expected = self.kv_size, self.kv_head_start * self.head_dim, kv_full
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        load_output_slice(param, full, offset, start, size, f"{shard_id}_proj", expected)
