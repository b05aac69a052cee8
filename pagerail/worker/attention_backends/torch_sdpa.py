"""The plain torch path: each decode's context gathered from the cache and attended under a dense key mask."""

from __future__ import annotations

from pagerail.worker.attention_backends.paged_decode import PagedDecodeBackend
from pagerail.worker.attention_backends.settings import AttentionSettings
from pagerail.worker.layers.attention import AttentionMetadata, decode_key_mask
from pagerail.worker.staged_step import StagedStep


class TorchBackend(PagedDecodeBackend):
    """The paged decode layout plus what gathering needs: the key mask, built once per step rather than by the
    first layer, and the reusable gather buffers (a fresh tensor per layer costs more in page faults than the copy).
    """

    name = "torch"

    def build(self, staged: StagedStep, settings: AttentionSettings) -> AttentionMetadata:
        meta = super().build(staged, settings)
        table = meta.decode_block_table
        if table is not None:
            meta.decode_mask = decode_key_mask(meta.decode_context_lens, table.shape[1] * staged.block_size)
            if settings.workspace is not None:
                meta.decode_key_buffer, meta.decode_value_buffer = settings.workspace.buffers(table.numel())
        return meta
