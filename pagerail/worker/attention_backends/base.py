"""What every attention backend provides, and the prefill spans several of them build the same way."""

from __future__ import annotations

from typing import ClassVar

import torch

from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan
from pagerail.worker.staged_step import StagedStep, Staging


class AttentionBackend:
    """One attention path's metadata builder. `staging` says what it needs staged beyond the common inputs; it is
    read before the step's single copy, so it is fixed per backend rather than computed per step.

    Builders run once per step on the host, between the scheduler's message and the forward: each keeps to the
    calls it needs (a Python call costs about a microsecond with caches cold from the forward).
    """

    name: ClassVar[str]
    staging: ClassVar[Staging] = Staging()

    def build(self, staged: StagedStep, settings: AttentionSettings) -> AttentionMetadata:
        """The metadata this backend's kernels read for the staged step."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name} attention backend>"


def prefill_spans(staged: StagedStep, cached_context: bool) -> list[PrefillSpan]:
    """The step's prefill chunks as row spans. With `cached_context`, a chunk after a cached prefix also gets its
    whole context's blocks and causal mask, which SDPA attends over; a fresh chunk attends over its own K/V."""
    spans = []
    bs = staged.block_size
    for start, end, position, table_row in staged.prefills:
        span = PrefillSpan(start, end)
        if cached_context and position > 0:
            stop = position + end - start
            span.context_blocks = staged.block_table[table_row, : -(-stop // bs)]
            span.context_len = stop
            device = staged.block_table.device
            keys = torch.arange(stop, device=device)
            span.mask = keys[None, :] <= torch.arange(position, stop, device=device)[:, None]
        spans.append(span)
    return spans
