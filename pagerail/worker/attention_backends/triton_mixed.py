"""The Triton mixed-batch kernel: decodes and prefill chunks of one step in one launch per layer."""

from __future__ import annotations

from pagerail.worker.attention_backends.base import AttentionBackend, prefill_spans
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.layers.attention import AttentionMetadata
from pagerail.worker.staged_step import StagedStep, Staging


class TritonMixedBackend(AttentionBackend):
    """Every sequence in row order reads its context in place through its table row: the kernel needs each one's
    row, context length and query rows staged (R + 1 starts), and no dense mask or gathered context."""

    name = "triton_mixed"
    staging = Staging(all_sequences=True, query_starts=True)

    def build(self, staged: StagedStep, settings: AttentionSettings) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=staged.slot_mapping,
            block_size=staged.block_size,
            num_decodes=staged.num_decodes,
            prefills=prefill_spans(staged, cached_context=False),
        )
        width = -(-staged.max_context // staged.block_size)
        meta.mixed_block_table = staged.table_rows(staged.num_seqs, width)
        meta.mixed_context_lens = staged.context_lens
        meta.mixed_query_starts = staged.query_starts
        return meta
