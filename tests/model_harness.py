"""Runs a model over one prompt as a single prefill, on one rank or on tensor-parallel ranks simulated by threads."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan
from pagerail.worker.model_loader import load_model
from pagerail.worker.parallel_state import TensorParallelGroup


def prefill_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position for one whole-prompt prefill into a fresh zero KV cache."""
    num_tokens = input_ids.shape[0]
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, model.num_kv_heads_per_rank, num_tokens, model.head_dim)
    meta = AttentionMetadata(slot_mapping=torch.arange(num_tokens), prefills=[PrefillSpan(0, num_tokens)])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, torch.arange(num_tokens), meta))


class ThreadedRank(TensorParallelGroup):
    """One rank of a group whose ranks are threads of this process; collectives meet at a barrier."""

    def __init__(self, rank: int, size: int, shared: dict) -> None:
        super().__init__(rank=rank, size=size, process_group=None)
        object.__setattr__(self, "shared", shared)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = x.clone()
        barrier.wait()
        parts = list(slots)
        barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        return x.copy_(sum(parts[1:], parts[0]))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
        parts = self._exchange(x)
        return torch.cat(parts, dim=dim) if self.rank == dst else None


def run_ranks(model_dir: str | Path, size: int, input_ids: torch.Tensor, **load_args) -> list[torch.Tensor]:
    """Every rank's logits for one prefill (None on all but rank 0), with the ranks running concurrently as threads."""
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size, timeout=60)}
    models = [load_model(model_dir, ThreadedRank(r, size, shared), **load_args) for r in range(size)]
    return on_every_rank(size, lambda rank: prefill_logits(models[rank], input_ids), shared["barrier"])


def on_every_rank(size: int, work, barrier: threading.Barrier) -> list:
    """`work(rank)` for every rank at once, one thread each; the results in rank order, or the first error raised.
    A rank that fails aborts `barrier`, so its peers waiting in a collective fail too instead of hanging."""
    results: list = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # surfaced below
            barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
