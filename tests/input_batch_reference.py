"""Reference input builder for the property test: each step's model inputs rebuilt from the request lists.

This is the straightforward construction the persistent input buffers (worker/input_buffers.py) and the attention
backends' metadata (worker/attention_backends/) must match exactly: every tensor built from Python lists, the
decode block table padded row by row, the decode key mask always built.
"""

from __future__ import annotations

import torch

from pagerail.worker.input_batch import FlatBatch, GatherWorkspace
from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan
from pagerail.worker.request_state import RequestState


def build_flat_batch(
    scheduled: list[RequestState],
    block_size: int,
    device: torch.device,
    workspace: GatherWorkspace | None = None,
    mixed: bool = False,
) -> FlatBatch:
    """Lay out decodes first so one batched attention call covers them all, then each prefill chunk.

    `mixed`: attention runs the Triton kernels, so a step with prefill chunks gets the mixed-batch kernel's
    per-sequence layout instead of decode tables and prefill masks.
    """
    decodes = [s for s in scheduled if s.num_scheduled_tokens == 1]
    prefills = [s for s in scheduled if s.num_scheduled_tokens > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    sample_states: list[RequestState] = []
    sample_rows: list[int] = []

    for row, state in enumerate(decodes):
        pos = state.num_computed_tokens
        input_ids.append(state.token_ids[pos])
        positions.append(pos)
        slot_mapping.append(state.block_ids[pos // block_size] * block_size + pos % block_size)
        if not state.skip_sampling:
            sample_states.append(state)
            sample_rows.append(row)

    mixed = mixed and bool(prefills)
    spans: list[PrefillSpan] = []
    row = len(decodes)
    for state in prefills:
        start_pos, count = state.num_computed_tokens, state.num_scheduled_tokens
        end_pos = start_pos + count
        input_ids.extend(state.token_ids[start_pos:end_pos])
        positions.extend(range(start_pos, end_pos))
        num_blocks = -(-end_pos // block_size)
        blocks = torch.tensor(state.block_ids[:num_blocks], dtype=torch.long)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
        slot_mapping.extend(slots[start_pos:end_pos].tolist())
        span = PrefillSpan(row, row + count)
        if start_pos > 0 and not mixed:
            # Part of the context is already cached: attend over all of it, causally offset.
            span.context_blocks = blocks.to(device)
            span.context_len = end_pos
            key_pos = torch.arange(end_pos)
            span.mask = (key_pos[None, :] <= torch.arange(start_pos, end_pos)[:, None]).to(device)
        spans.append(span)
        row += count
        if not state.skip_sampling:
            sample_states.append(state)
            sample_rows.append(row - 1)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        block_size=block_size,
        num_decodes=len(decodes),
        prefills=spans,
    )
    if mixed:
        _add_mixed_layout(meta, decodes + prefills, block_size, device)
    elif decodes:
        _add_decode_context(meta, decodes, block_size, device)
        if workspace is not None:
            meta.decode_key_buffer, meta.decode_value_buffer = workspace.buffers(meta.decode_block_table.numel())
    return FlatBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attention=meta,
        ordered=decodes + prefills,
        sample_states=sample_states,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
    )


def _add_decode_context(
    meta: AttentionMetadata, decodes: list[RequestState], block_size: int, device: torch.device
) -> None:
    """Padded [n, max_blocks] block table, context lengths and key mask covering every decode's context."""
    context_lens = [s.num_computed_tokens + 1 for s in decodes]
    max_blocks = -(-max(context_lens) // block_size)
    padded = []
    for state in decodes:
        blocks = state.block_ids[:max_blocks]
        padded.append(blocks + [0] * (max_blocks - len(blocks)))
    lens = torch.tensor(context_lens, dtype=torch.long)
    mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
    meta.decode_block_table = torch.tensor(padded, dtype=torch.long, device=device)
    meta.decode_context_lens = lens.to(device)
    meta.decode_mask = mask[:, None, None, :].to(device)


def _add_mixed_layout(meta: AttentionMetadata, ordered: list[RequestState], block_size: int, device: torch.device):
    """Every sequence's query rows, context length and zero-padded block-table row, in row order."""
    context_lens = [s.num_computed_tokens + s.num_scheduled_tokens for s in ordered]
    starts = [0]
    for state in ordered:
        starts.append(starts[-1] + state.num_scheduled_tokens)
    width = -(-max(context_lens) // block_size)
    padded = [s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in ordered]
    meta.mixed_block_table = torch.tensor(padded, dtype=torch.long, device=device)
    meta.mixed_context_lens = torch.tensor(context_lens, dtype=torch.long, device=device)
    meta.mixed_query_starts = torch.tensor(starts, dtype=torch.long, device=device)
