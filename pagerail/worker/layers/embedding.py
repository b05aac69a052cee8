"""Vocab-parallel token embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagerail.worker.layers.cpu_matmul import CpuWeights, linear
from pagerail.worker.layers.lazy_tensor import LazyTensor
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; ranks look up the ids they own and the results are all-reduced.

    The vocabulary is padded up to a multiple of the tp size so every rank holds the same number of rows;
    padding rows are zero and never looked up.

        padded vocab:  [ rank 0: start0 .. start0+n ) [ rank 1 ... ) ... [ last rank: real rows | zero rows )
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_embeddings <= 0:
            raise ValueError(f"num_embeddings must be positive, got {num_embeddings}")
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padded_num_embeddings = -(-num_embeddings // tp.size) * tp.size
        self.num_embeddings_per_rank = self.padded_num_embeddings // tp.size
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor | LazyTensor, shard_id: object = None) -> None:
        # Checkpoints sometimes pad their own vocab; accept any table at least as long as the configured vocab.
        if full.dim() != 2 or full.shape[0] < self.num_embeddings or full.shape[1] != self.embedding_dim:
            raise ValueError(
                f"checkpoint embedding has shape {tuple(full.shape)}, expected ({self.num_embeddings}, "
                f"{self.embedding_dim})"
            )
        real = max(self.vocab_end - self.vocab_start, 0)
        if real:
            # narrow, not indexing: a lazy checkpoint tensor then reads only this rank's vocabulary rows.
            param.data[:real].copy_(full.narrow(0, self.vocab_start, real))
        param.data[real:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        # Ids other ranks own are looked up as row 0 and then zeroed, so the all-reduce sums exactly one row.
        local_ids = torch.where(owned, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, rows {self.vocab_start}:{self.vocab_end}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits; each rank computes its vocab slice, rank 0 gathers the slices.

    Only rank 0 samples, so only rank 0 ever holds the full-vocabulary logits.

    For tied embeddings the model assigns the embedding's parameter to `weight`, so both share one tensor.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Copies of the weight for the CPU libraries that run some batch sizes faster, made after loading (cpu_matmul).
        self.cpu_weights: CpuWeights | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits through compute_logits(hidden), not forward")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, embedding_dim] → logits [N, num_embeddings] in float32 on rank 0; None on the other ranks."""
        local = linear(hidden, self.weight, self.cpu_weights)
        logits = self.tp.gather(local, dim=-1)
        if logits is None:
            return None
        return logits[..., : self.num_embeddings].float()
