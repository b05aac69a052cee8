"""Persistent model inputs on a worker: a block table kept on the device and one staged copy of each step's indices."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.input_batch import FlatBatch, GatherWorkspace
from worker.layers.attention import AttentionMetadata, PrefillSpan, decode_key_mask
from worker.request_state import RequestState

# Every section of the staging buffer starts on a multiple of this many int64 entries (16 bytes).
_SECTION_ALIGNMENT = 2


def _aligned(count: int) -> int:
    """`count` entries rounded up to a whole number of aligned units."""
    return -(-count // _SECTION_ALIGNMENT) * _SECTION_ALIGNMENT


@dataclass
class _Row:
    """The block-table row one request owns, and how much of its block list the row already holds."""

    index: int
    owner: RequestState  # a reused handle is a different request: it must not inherit the row
    epoch: int  # owner.block_epoch when the row was last written from scratch
    num_blocks: int  # leading entries of the row that equal owner.block_ids; the rest of the row is zero


class InputBuffers:
    """Builds each step's FlatBatch from preallocated buffers, touching only what the step's deltas changed.

    Block table: one row per known request, handed out from a free list when the request first runs and
    returned when it is dropped, so rows never move while requests join and leave. A row is written only when
    its request's block list grows (the new entries) or is replaced after preemption (the whole row, and zeros
    over what the previous list or owner left behind). A step's decode rows are picked from the table on the
    device by a row index, so nothing is compacted or rebuilt:

        block table (device, persistent)            decode rows staged this step: [2, 0]
        row 0  [ 7 12 40  0  0 ...]  handle 5       decode_block_table = table[[2, 0], :max_blocks]
        row 1  [ free: stale, zeroed on reuse ]                         = [[ 9  3  0]
        row 2  [ 9  3  0  0  0 ...]  handle 8                              [ 7 12 40]]

    Staging: every per-step index is written into one flat int64 host buffer (pinned on CUDA) and crosses to
    the device in a single non-blocking copy; the tensors the model reads are views of the device copy:

        | input_ids T | positions T | slot_mapping T | table rows R | context lens R | query starts | sample rows |
        table writes: flat index K | value K |

    Each section starts 16 bytes aligned (a pad entry after an odd-length one), so the pointers the Triton
    kernels receive keep one alignment whatever the batch shape and never select another compiled variant.

    R counts the decodes, or on the mixed path (one Triton kernel for the whole step, taken when a step has a
    prefill chunk) every scheduled sequence, which then also stages its R + 1 query starts; the mixed path builds
    no dense mask and copies no context, the kernel reads the table rows staged here.

    On the CPU the host buffer is the device buffer and the table is written in place, so there is no copy
    (unless in_place=False). The host work per step is proportional to the scheduled requests, tokens and
    changed blocks, never to the length of a context.
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        *,
        max_num_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_blocks_per_seq: int = 64,
        build_decode_mask: bool = False,
        mixed_attention: bool = False,
        workspace: GatherWorkspace | None = None,
        in_place: bool | None = None,
        paged_prefill_max_context: int = 0,
    ) -> None:
        self.block_size = block_size
        # Steps whose prefill chunks all end within this context get per-row table rows and context lengths, so
        # the native CPU kernel attends every row in one call (AttentionMetadata.paged_block_table); 0: never.
        self.paged_prefill_max_context = paged_prefill_max_context
        self.device = torch.device(device)
        # Attention runs the Triton kernels: steps with prefill rows get the mixed-batch kernel's metadata.
        self.mixed_attention = mixed_attention
        # Only the torch decode path reads a dense key mask; the kernels read the context lengths.
        self.build_decode_mask = build_decode_mask
        self.workspace = workspace
        # None: in place exactly when the device is the host. False on the CPU runs the device path (table
        # writes staged and applied by index, a copy between two buffers), which is how the tests reach it.
        self._in_place = self.device.type == "cpu" if in_place is None else in_place
        self.block_table = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._table_np: np.ndarray | None = None
        self._dirty: list[int] = []  # per row index: leading entries that may be nonzero (the rest are zero)
        self._free: list[int] = []
        self._rows: dict[int, _Row] = {}
        self._grow_table(max(1, max_num_seqs), max(1, max_blocks_per_seq))
        self._copied: torch.cuda.Event | None = None  # recorded after each step's copy (CUDA)
        self._host = torch.zeros(0, dtype=torch.long)
        self._host_np = self._host.numpy()
        self._staged = self._host
        # Decode rows plus one new block per decode, a typical step's table writes.
        self._grow_staging(3 * max_num_tokens + 5 * max_num_seqs)

    def release(self, state: RequestState) -> None:
        """Return a dropped request's row to the free list; its stale entries are zeroed when it is reused."""
        row = self._rows.get(state.handle)
        if row is not None and row.owner is state:
            del self._rows[state.handle]
            self._free.append(row.index)

    def prepare(self, scheduled: list[RequestState]) -> FlatBatch | None:
        """Model inputs for one step; None when no scheduled request has a token to compute."""
        decodes = [s for s in scheduled if s.num_scheduled_tokens == 1]
        prefills = [s for s in scheduled if s.num_scheduled_tokens > 1]
        ordered = decodes + prefills
        if not ordered:
            return None
        if self._copied is not None:
            # The previous step's copy must have left the host buffer before it is overwritten.
            self._copied.synchronize()
        # Comprehensions over the step's requests, each a column of what they stage: this runs per request per
        # step, at GPU step rates. Most steps change no request's block list, so its row is current and needs no
        # look: -1 marks a row to bring up to date first (see RequestState.table_row and _sync_row).
        rows = [state.table_row for state in ordered]
        n, bs = len(decodes), self.block_size
        positions = [state.num_computed_tokens for state in decodes]
        decode_tokens = [state.token_ids[position] for state, position in zip(decodes, positions, strict=True)]
        sample_states = [state for state in ordered if not state.skip_sampling]
        if len(sample_states) == len(ordered):
            sample_rows = list(range(n))  # a prefill's sampled row is known once its span is laid out
        else:
            sample_rows = [index for index, state in enumerate(decodes) if not state.skip_sampling]
        stale = [index for index, row in enumerate(rows) if row < 0] if -1 in rows else []
        writes: tuple[list[int], list[int]] = ([], [])
        if stale:
            # Widen first: the device-side table writes are flat indices computed from the width. A current row
            # already fits the table, so only the stale ones can need a wider one.
            self._grow_table(0, max(len(ordered[index].block_ids) for index in stale))
            for index in stale:
                state = ordered[index]
                rows[index] = state.table_row = self._sync_row(state, writes)

        num_tokens = n + sum(s.num_scheduled_tokens for s in prefills)
        num_writes = len(writes[0])
        mixed = self.mixed_attention and bool(prefills)
        num_seqs = len(ordered) if mixed else n  # sequences whose table row and context length are staged
        # Offsets of the sections of the staging buffer (see the class docstring), each 16-byte aligned: a kernel
        # argument's alignment is part of what Triton specialises on, so it must not move with the batch shape.
        pos_at = _aligned(num_tokens)
        slot_at = pos_at + _aligned(num_tokens)
        rows_at = slot_at + _aligned(num_tokens)
        lens_at = rows_at + _aligned(num_seqs)
        starts_at = lens_at + _aligned(num_seqs)
        sample_at = starts_at + (_aligned(num_seqs + 1) if mixed else 0)
        write_at = sample_at + _aligned(len(sample_states))
        values_at = write_at + _aligned(num_writes)
        end = values_at + num_writes
        self._grow_staging(end)
        buf = self._host_np

        if n:
            # One conversion from Python ints for the three per-decode columns.
            tokens_col, where, table_rows = np.array((decode_tokens, positions, rows[:n]), dtype=np.int64)
            buf[:n] = tokens_col
            buf[pos_at : pos_at + n] = where
            if self._in_place:
                # Each decode's slot from its table row, which _sync_row just brought up to date.
                buf[slot_at : slot_at + n] = self._table_np[table_rows, where // bs] * bs + where % bs
            else:
                buf[slot_at : slot_at + n] = [
                    s.block_ids[p // bs] * bs + p % bs for s, p in zip(decodes, positions, strict=True)
                ]
            buf[rows_at : rows_at + n] = table_rows
            buf[lens_at : lens_at + n] = where + 1
        if mixed:
            # Decodes own one row each; each prefill's end is appended as its span is laid out below.
            buf[starts_at : starts_at + n + 1] = np.arange(n + 1)
            max_context = max(positions) + 1 if n else 0

        spans: list[tuple[PrefillSpan, int, int]] = []  # with the span's table row and cached-prefix length
        row = n
        for index, (state, table_row) in enumerate(zip(prefills, rows[n:], strict=True), start=n):
            start, count = state.num_computed_tokens, state.num_scheduled_tokens
            stop = start + count
            if mixed:
                buf[rows_at + index], buf[lens_at + index] = table_row, stop
                buf[starts_at + index + 1] = row + count
                max_context = max(max_context, stop)
            buf[row : row + count] = state.token_ids[start:stop]
            buf[pos_at + row : pos_at + row + count] = np.arange(start, stop)
            first_block = start // bs
            blocks = np.asarray(state.block_ids[first_block : -(-stop // bs)], dtype=np.int64)
            slots = (blocks[:, None] * bs + np.arange(bs)).ravel()
            offset = start - first_block * bs
            buf[slot_at + row : slot_at + row + count] = slots[offset : offset + count]
            spans.append((PrefillSpan(row, row + count), table_row, start))
            row += count
            if not state.skip_sampling:
                sample_rows.append(row - 1)
        buf[sample_at : sample_at + len(sample_rows)] = sample_rows
        if num_writes:
            buf[write_at : write_at + num_writes] = writes[0]
            buf[values_at:end] = writes[1]

        staged = self._stage(end)
        if num_writes:
            flat_table = self.block_table.view(-1)
            flat_table.index_copy_(0, staged[write_at : write_at + num_writes], staged[values_at:end])
        meta = AttentionMetadata(slot_mapping=staged[slot_at : slot_at + num_tokens], block_size=bs, num_decodes=n)
        paged = (
            spans
            and not mixed
            and self._in_place
            and max(start + span.end - span.start for span, _, start in spans) <= self.paged_prefill_max_context
        )
        if paged:
            meta.paged_block_table, meta.paged_context_lens = self._paged_rows(buf, rows_at, lens_at, n, spans)
            if n:  # the decodes' own view, as wide as their longest context (what the decode path reads)
                table = meta.paged_block_table[:n, : -(-(max(positions) + 1) // bs)]
                self._add_decode_context(meta, table, meta.paged_context_lens[:n])
        elif mixed:
            meta.mixed_block_table = self._gather_rows(buf, staged, rows_at, num_seqs, -(-max_context // bs))
            meta.mixed_context_lens = staged[lens_at : lens_at + num_seqs]
            meta.mixed_query_starts = staged[starts_at : starts_at + num_seqs + 1]
        elif n:
            table = self._gather_rows(buf, staged, rows_at, n, -(-(max(positions) + 1) // bs))
            self._add_decode_context(meta, table, staged[lens_at : lens_at + n])
        for span, table_row, start in spans:
            if start > 0 and not mixed:
                # Part of the context is already cached: attend over all of it, causally offset.
                stop = start + span.end - span.start
                span.context_blocks = self.block_table[table_row, : -(-stop // bs)]
                span.context_len = stop
                keys = torch.arange(stop, device=self.device)
                span.mask = keys[None, :] <= torch.arange(start, stop, device=self.device)[:, None]
            meta.prefills.append(span)
        return FlatBatch(
            input_ids=staged[:num_tokens],
            positions=staged[pos_at : pos_at + num_tokens],
            attention=meta,
            ordered=ordered,
            sample_states=sample_states,
            sample_rows=staged[sample_at : sample_at + len(sample_rows)],
        )

    def _paged_rows(
        self, buf: np.ndarray, rows_at: int, lens_at: int, n: int, spans: list[tuple[PrefillSpan, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's table row and context length: the decodes' as staged, each prefill row its span's table row
        and its own position + 1."""
        counts = [span.end - span.start for span, _, _ in spans]
        table_rows = np.concatenate((buf[rows_at : rows_at + n], np.repeat([row for _, row, _ in spans], counts)))
        lens = np.concatenate(
            [buf[lens_at : lens_at + n]]
            + [np.arange(start + 1, start + count + 1) for (_, _, start), count in zip(spans, counts, strict=True)]
        )
        width = -(-int(lens.max()) // self.block_size)
        return torch.from_numpy(self._table_np[:, :width][table_rows]), torch.from_numpy(lens)

    def _gather_rows(
        self, buf: np.ndarray, staged: torch.Tensor, rows_at: int, count: int, width: int
    ) -> torch.Tensor:
        """The `count` block-table rows whose indices sit at rows_at of the staging buffer, `width` entries each."""
        end = rows_at + count
        if self._in_place:
            # numpy's gather: one small single-threaded copy, no parallel region for a few kilobytes.
            return torch.from_numpy(self._table_np[:, :width][buf[rows_at:end]])
        return self.block_table[:, :width].index_select(0, staged[rows_at:end])

    def _add_decode_context(self, meta: AttentionMetadata, table: torch.Tensor, context_lens: torch.Tensor) -> None:
        """The decodes' [n, max_blocks] block table and context lengths, and what the torch decode path reads."""
        meta.decode_block_table = table
        meta.decode_context_lens = context_lens
        if self.build_decode_mask:
            meta.decode_mask = decode_key_mask(context_lens, table.shape[1] * self.block_size)
        if self.workspace is not None:
            meta.decode_key_buffer, meta.decode_value_buffer = self.workspace.buffers(table.numel())

    def _sync_row(self, state: RequestState, writes: tuple[list[int], list[int]]) -> int:
        """Bring the state's table row up to date with its block list; returns the row index."""
        row = self._rows.get(state.handle)
        if row is None or row.owner is not state:
            if row is not None:
                self._free.append(row.index)  # the handle was reused without the old request being released
            if not self._free:
                self._grow_table(self.block_table.shape[0] + 1, 0)
            row = _Row(self._free.pop(), state, state.block_epoch, 0)
            self._rows[state.handle] = row
        elif row.epoch != state.block_epoch:
            row.epoch, row.num_blocks = state.block_epoch, 0
        blocks, start = state.block_ids, row.num_blocks
        stop = len(blocks)
        # Only a rewrite from the start can leave entries of an older list (or owner) behind the new one.
        clear_to = max(self._dirty[row.index], stop) if start == 0 else stop
        if clear_to > start:
            self._write_row(row.index, start, blocks[start:stop], clear_to - stop, writes)
            self._dirty[row.index] = stop
            row.num_blocks = stop
        return row.index

    def _write_row(
        self, index: int, start: int, blocks: list[int], zeros: int, writes: tuple[list[int], list[int]]
    ) -> None:
        """Entries start.. of one row: the given blocks, then `zeros` zeros (in place, or as device writes)."""
        stop = start + len(blocks)
        if self._in_place:
            self._table_np[index, start:stop] = blocks
            self._table_np[index, stop : stop + zeros] = 0
            return
        base = index * self.block_table.shape[1]
        writes[0].extend(range(base + start, base + stop + zeros))
        writes[1].extend(blocks)
        writes[1].extend([0] * zeros)

    def _grow_table(self, num_rows: int, num_blocks: int) -> None:
        """Make room for `num_rows` rows of `num_blocks` entries, doubling what is too small."""
        old_rows, old_width = self.block_table.shape
        rows = max(old_rows, num_rows if num_rows <= old_rows else max(num_rows, 2 * old_rows))
        width = max(old_width, num_blocks if num_blocks <= old_width else max(num_blocks, 2 * old_width))
        if (rows, width) == (old_rows, old_width):
            return
        table = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        table[:old_rows, :old_width] = self.block_table
        self.block_table = table
        if self._in_place:
            self._table_np = table.numpy()
        self._dirty.extend([0] * (rows - old_rows))
        # Lowest rows first: pop() takes from the end.
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free

    def _grow_staging(self, size: int) -> None:
        if size <= self._host.numel():
            return
        size = max(size, 2 * self._host.numel())
        if self._copied is not None:
            self._copied.synchronize()
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._staged = self._host if self._in_place else torch.zeros(size, dtype=torch.long, device=self.device)

    def _stage(self, size: int) -> torch.Tensor:
        """The step's indices on the device: one non-blocking copy of the used part of the host buffer."""
        if self._in_place:
            return self._host[:size]
        staged = self._staged[:size]
        staged.copy_(self._host[:size], non_blocking=True)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return staged
