"""The one place a step's attention backend is chosen, from the rank's settings and the step's shape."""

from __future__ import annotations

from pagerail.worker.attention_backends.base import AttentionBackend
from pagerail.worker.attention_backends.cpu_paged import CpuPagedBackend
from pagerail.worker.attention_backends.paged_decode import PagedDecodeBackend
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.attention_backends.torch_sdpa import TorchBackend
from pagerail.worker.attention_backends.triton_mixed import TritonMixedBackend
from pagerail.worker.staged_step import StepShape

# Stateless: one of each serves every step of every rank.
TORCH = TorchBackend()
PAGED_DECODE = PagedDecodeBackend()
CPU_PAGED = CpuPagedBackend()
TRITON_MIXED = TritonMixedBackend()


def select_backend(step: StepShape, settings: AttentionSettings, *, host_table: bool) -> AttentionBackend:
    """The backend whose metadata the step's attention reads. `host_table`: the block table is host memory written
    in place (the CPU), which the CPU paged backend gathers its per-row table from."""
    if step.prefills:
        if settings.decode_path == "triton":
            return TRITON_MIXED  # one launch per layer for the whole step instead of SDPA per chunk
        limit = settings.paged_prefill_max_context
        # Every chunk must end within the limit: the longest context any of them attends over.
        if limit and host_table and max(s.num_computed_tokens + s.num_scheduled_tokens for s in step.prefills) <= limit:
            return CPU_PAGED
    return TORCH if settings.decode_path == "torch" else PAGED_DECODE
