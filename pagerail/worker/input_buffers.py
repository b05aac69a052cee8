"""Persistent model inputs on a worker: the block table kept on the device and one staged copy of each step's inputs."""

from __future__ import annotations

import numpy as np
import torch

from pagerail.worker.block_table_rows import PersistentBlockTable
from pagerail.worker.staged_step import PrefillChunk, StagedStep, Staging, StepShape

# Every section of the staging buffer starts on a multiple of this many int64 entries (16 bytes).
_SECTION_ALIGNMENT = 2
_NO_WRITES: tuple[list[int], list[int]] = ([], [])  # read only: a step whose rows are all current


def _aligned(count: int) -> int:
    """`count` entries rounded up to a whole number of aligned units."""
    return -(-count // _SECTION_ALIGNMENT) * _SECTION_ALIGNMENT


class InputBuffers(PersistentBlockTable):
    """Stages each step's common inputs from preallocated buffers, touching only what the step's deltas changed.

    The block table (PersistentBlockTable) keeps one row per known request; a step's sequences are picked from it
    on the device by a row index, so nothing is compacted or rebuilt:

        block table (device, persistent)            table rows staged this step: [2, 0]
        row 0  [ 7 12 40  0  0 ...]  handle 5       table[[2, 0], :max_blocks]
        row 1  [ free: stale, zeroed on reuse ]       = [[ 9  3  0]
        row 2  [ 9  3  0  0  0 ...]  handle 8            [ 7 12 40]]

    Staging: every per-step index is written into one flat int64 host buffer (pinned on CUDA) and crosses to
    the device in a single non-blocking copy; the tensors the model reads are views of the device copy:

        | input_ids T | positions T | slot_mapping T | table rows R | context lens R | query starts | sample rows |
        table writes: flat index K | value K |

    Each section starts 16 bytes aligned (a pad entry after an odd-length one), so the pointers the Triton
    kernels receive keep one alignment whatever the batch shape and never select another compiled variant.

    R counts the decodes, or every scheduled sequence when the step's attention backend asks for all of them
    (Staging), which may also ask for their R + 1 query starts. What the backend builds from these is its own
    business (worker/attention_backends/): the buffers never learn which attention runs.

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
        in_place: bool | None = None,
    ) -> None:
        device = torch.device(device)
        # None: in place exactly when the device is the host. False on the CPU runs the device path (table
        # writes staged and applied by index, a copy between two buffers), which is how the tests reach it.
        in_place = device.type == "cpu" if in_place is None else in_place
        super().__init__(device, max_num_seqs, max_blocks_per_seq, in_place)
        self.block_size = block_size
        self._copied: torch.cuda.Event | None = None  # recorded after each step's copy (CUDA)
        self._host = torch.zeros(0, dtype=torch.long)
        self._host_np = self._host.numpy()
        self._staged = self._host
        # Decode rows plus one new block per decode, a typical step's table writes.
        self._grow_staging(3 * max_num_tokens + 5 * max_num_seqs)

    def prepare(self, step: StepShape, staging: Staging) -> StagedStep:
        """Stage one step's common inputs, laid out as `staging` asks, in one copy to the device."""
        decodes, prefills, ordered = step.decodes, step.prefills, step.ordered
        if self._copied is not None:
            # The previous step's copy must have left the host buffer before it is overwritten.
            self._copied.synchronize()
        # Comprehensions over the step's requests, each a column of what they stage: this runs per request per
        # step, at GPU step rates. Most steps change no request's block list, so its row is current and needs no
        # look: -1 marks a row to bring up to date first (see RequestState.table_row and sync_rows).
        rows = [state.table_row for state in ordered]
        n, bs = len(decodes), self.block_size
        positions = [state.num_computed_tokens for state in decodes]
        decode_tokens = [state.token_ids[position] for state, position in zip(decodes, positions, strict=True)]
        sample_states = [state for state in ordered if not state.skip_sampling]
        # Speculating requests sample every row of their chunk (the next token, then one per draft).
        num_samples = len(sample_states) + (sum(len(s.drafts) for s in prefills if s.drafts) if prefills else 0)
        # The decodes' sampled rows; a prefill's is known once its span is laid out. None: every decode samples.
        decode_samples = None
        if len(sample_states) != len(ordered):
            decode_samples = [index for index, state in enumerate(decodes) if not state.skip_sampling]
        writes = self.sync_rows(ordered, rows) if -1 in rows else _NO_WRITES

        num_tokens = n + sum(s.num_scheduled_tokens for s in prefills)
        num_writes = len(writes[0])
        every_seq = staging.all_sequences
        num_seqs = len(ordered) if every_seq else n  # R: sequences whose table row and context length are staged
        # Offsets of the sections of the staging buffer (see the class docstring), each 16-byte aligned: a kernel
        # argument's alignment is part of what Triton specialises on, so it must not move with the batch shape.
        pos_at = _aligned(num_tokens)
        slot_at = pos_at + _aligned(num_tokens)
        rows_at = slot_at + _aligned(num_tokens)
        lens_at = rows_at + _aligned(num_seqs)
        starts_at = lens_at + _aligned(num_seqs)
        sample_at = starts_at + (_aligned(num_seqs + 1) if staging.query_starts else 0)
        write_at = sample_at + _aligned(num_samples)
        values_at = write_at + _aligned(num_writes)
        end = values_at + num_writes
        self._grow_staging(end)
        buf = self._host_np

        max_context = 0
        if n:
            # One conversion from Python ints for the three per-decode columns.
            decode_rows = rows if n == len(rows) else rows[:n]
            tokens_col, where, table_rows = np.array((decode_tokens, positions, decode_rows), dtype=np.int64)
            buf[:n] = tokens_col
            buf[pos_at : pos_at + n] = where
            if self.in_place:
                # Each decode's slot from its table row, which _sync_row just brought up to date.
                buf[slot_at : slot_at + n] = self._table_np[table_rows, where // bs] * bs + where % bs
            else:
                buf[slot_at : slot_at + n] = [
                    s.block_ids[p // bs] * bs + p % bs for s, p in zip(decodes, positions, strict=True)
                ]
            buf[rows_at : rows_at + n] = table_rows
            buf[lens_at : lens_at + n] = where + 1
            max_context = max(positions) + 1
        if staging.query_starts:
            # Decodes own one row each; each staged prefill's end is appended as its chunk is laid out below.
            buf[starts_at : starts_at + n + 1] = np.arange(n + 1)
        if decode_samples is None:
            buf[sample_at : sample_at + n] = np.arange(n)  # no list of n ints to convert
        else:
            buf[sample_at : sample_at + len(decode_samples)] = decode_samples

        chunks: list[PrefillChunk] = []
        prefill_samples: list[int] = []
        row = n
        for index, (state, table_row) in enumerate(zip(prefills, rows[n:], strict=True), start=n):
            start, count = state.num_computed_tokens, state.num_scheduled_tokens
            stop = start + count
            if every_seq:
                buf[rows_at + index], buf[lens_at + index] = table_row, stop
                if staging.query_starts:
                    buf[starts_at + index + 1] = row + count
                max_context = max(max_context, stop)
            buf[row : row + count] = state.token_ids[start:stop]
            buf[pos_at + row : pos_at + row + count] = np.arange(start, stop)
            first_block = start // bs
            blocks = np.asarray(state.block_ids[first_block : -(-stop // bs)], dtype=np.int64)
            slots = (blocks[:, None] * bs + np.arange(bs)).ravel()
            offset = start - first_block * bs
            buf[slot_at + row : slot_at + row + count] = slots[offset : offset + count]
            chunks.append((row, row + count, start, table_row))
            row += count
            if state.drafts:
                prefill_samples.extend(range(row - count, row))
            elif not state.skip_sampling:
                prefill_samples.append(row - 1)
        if prefill_samples:  # after the decodes' sampled rows
            buf[sample_at + num_samples - len(prefill_samples) : sample_at + num_samples] = prefill_samples
        if num_writes:
            buf[write_at : write_at + num_writes] = writes[0]
            buf[values_at:end] = writes[1]

        staged = self._stage(end)
        if num_writes:
            flat_table = self.block_table.view(-1)
            flat_table.index_copy_(0, staged[write_at : write_at + num_writes], staged[values_at:end])
        return StagedStep(
            input_ids=staged[:num_tokens],
            positions=staged[pos_at : pos_at + num_tokens],
            slot_mapping=staged[slot_at : slot_at + num_tokens],
            sample_rows=staged[sample_at : sample_at + num_samples],
            context_lens=staged[lens_at : lens_at + num_seqs],
            query_starts=staged[starts_at : starts_at + num_seqs + 1] if staging.query_starts else None,
            sample_states=sample_states,
            ordered=ordered,
            num_decodes=n,
            max_context=max_context,
            prefills=chunks,
            block_size=bs,
            block_table=self.block_table,
            host_rows=buf[rows_at : rows_at + num_seqs],
            host_lens=buf[lens_at : lens_at + num_seqs],
            host_table=self._table_np if self.in_place else None,
            device_rows=None if self.in_place else staged[rows_at : rows_at + num_seqs],
        )

    def _grow_staging(self, size: int) -> None:
        if size <= self._host.numel():
            return
        size = max(size, 2 * self._host.numel())
        if self._copied is not None:
            self._copied.synchronize()
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._staged = self._host if self.in_place else torch.zeros(size, dtype=torch.long, device=self.device)

    def _stage(self, size: int) -> torch.Tensor:
        """The step's indices on the device: one non-blocking copy of the used part of the host buffer."""
        if self.in_place:
            return self._host[:size]
        staged = self._staged[:size]
        staged.copy_(self._host[:size], non_blocking=True)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return staged
