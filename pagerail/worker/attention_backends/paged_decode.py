"""The decode kernels that read the cache through the block table in place: Triton's, or the native CPU kernel's."""

from __future__ import annotations

from pagerail.worker.attention_backends.base import AttentionBackend, prefill_spans
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.layers.attention import AttentionMetadata
from pagerail.worker.staged_step import StagedStep


class PagedDecodeBackend(AttentionBackend):
    """Decodes as one batch over their [n, max_blocks] table rows and context lengths, prefill chunks through SDPA.

    Taken by decode-only steps on the Triton path and by the native CPU kernel's steps that the CPU paged backend
    does not take whole; the kernels bound each row by its context length, so no mask is built.
    """

    name = "paged_decode"

    def build(self, staged: StagedStep, settings: AttentionSettings) -> AttentionMetadata:
        n = staged.num_decodes
        meta = AttentionMetadata(
            slot_mapping=staged.slot_mapping,
            block_size=staged.block_size,
            num_decodes=n,
            prefills=prefill_spans(staged, cached_context=True) if staged.prefills else [],
        )
        if n:
            # As wide as the longest decode context: the staged rows are the decodes' alone.
            meta.decode_block_table = staged.table_rows(n, -(-staged.max_context // staged.block_size))
            meta.decode_context_lens = staged.context_lens
        return meta
