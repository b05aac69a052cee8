"""The tensor-parallel group a worker belongs to, passed explicitly to every parallel layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank and size of this process inside its tensor-parallel group (size 1 needs no process group)."""

    rank: int = 0
    size: int = 1
    process_group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` across ranks in place; a no-op at size 1."""
        if self.size > 1:
            dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order; identity at size 1."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on rank `dst` only; the other ranks get None.

        For results only one rank consumes (the logits rank 0 samples from): the others send their part and
        never hold the whole.
        """
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.rank != dst:
            dist.gather(x, None, dst=dst, group=self.process_group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=dst, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite every rank's `x` with rank `src`'s, in place; a no-op at size 1."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.process_group)
        return x

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's share of `total` items, refusing sizes the group cannot split evenly."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size


SINGLE_RANK = TensorParallelGroup()
