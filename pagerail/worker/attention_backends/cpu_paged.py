"""The native CPU kernel over every row of a step with short prefill chunks: one call per layer, no SDPA."""

from __future__ import annotations

import numpy as np
import torch

from pagerail.worker.attention_backends.base import AttentionBackend, prefill_spans
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.layers.attention import AttentionMetadata
from pagerail.worker.staged_step import StagedStep


class CpuPagedBackend(AttentionBackend):
    """Every row, decode or prefill, is one query over its own sequence's blocks, its context its position + 1
    (AttentionMetadata.paged_block_table). The decodes' view of the same rows is set as well, for a layer that
    cannot take the native call. Needs the table in host memory: the rows are gathered from it with numpy."""

    name = "cpu_paged"

    def build(self, staged: StagedStep, settings: AttentionSettings) -> AttentionMetadata:
        n, bs = staged.num_decodes, staged.block_size
        meta = AttentionMetadata(
            slot_mapping=staged.slot_mapping,
            block_size=bs,
            num_decodes=n,
            prefills=prefill_spans(staged, cached_context=True),
        )
        counts = [end - start for start, end, _, _ in staged.prefills]
        # The decodes' rows and lengths as staged, then each prefill row's: its chunk's table row, its position + 1.
        chunk_rows = [table_row for _, _, _, table_row in staged.prefills]
        table_rows = np.concatenate((staged.host_rows, np.repeat(chunk_rows, counts)))
        lens = np.concatenate(
            [staged.host_lens]
            + [np.arange(position + 1, end - start + position + 1) for start, end, position, _ in staged.prefills]
        )
        width = -(-int(lens.max()) // bs)
        meta.paged_block_table = torch.from_numpy(staged.host_table[:, :width][table_rows])
        meta.paged_context_lens = torch.from_numpy(lens)
        if n:  # the decodes' own view, as wide as their longest context (what the decode path reads)
            meta.decode_block_table = meta.paged_block_table[:n, : -(-staged.max_context // bs)]
            meta.decode_context_lens = meta.paged_context_lens[:n]
        return meta
